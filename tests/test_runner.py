"""The runner: one span per stage per run, generators closed on every exit, stages blamed by name.

Stages here are declared in this module and named from TOML as
``"<this module>:<function>"``, so every run goes through the loader and
every StageError can be checked against the TOML line of its table. Spans are
read with the SDK's in-memory exporter; a counting processor checks that
each span ends exactly once.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, TraceIdRatioBased
from opentelemetry.trace import StatusCode

from flowkv import RunContext, Runner, StageError, loads_pipeline, stage
from flowkv.pipeline import TelemetrySpec
from flowkv.telemetry import tracer_for

FILE = "run.toml"
HERE = __name__

# Every test stage appends its label here when its generator ends, however it ends.
closed: list[str] = []


@pytest.fixture(autouse=True)
def _fresh_close_log():
    closed.clear()
    yield
    closed.clear()


@stage("closing", kinds=("store", "retrieve", "lookup"))
def closing(items: Iterator[Any], *, label: str) -> Iterator[Any]:
    """Pass items on; log ``label`` when the generator ends (exhausted, raised or closed)."""
    try:
        for item in items:
            yield item
    finally:
        closed.append(label)


@stage("explode", kinds=("store", "retrieve", "lookup"))
def explode(items: Iterator[Any], *, label: str = "explode", after: int = 0) -> Iterator[Any]:
    """Pass ``after`` items on, then raise."""
    try:
        for count, item in enumerate(items):
            if count >= after:
                raise RuntimeError(f"{label} broke at item {count}")
            yield item
    finally:
        closed.append(label)


@stage("measure", kinds=("store", "retrieve", "lookup"))
def measure(items: Iterator[Any], *, ctx: RunContext, nbytes: int = 10) -> Iterator[Any]:
    """Report ``nbytes`` per item and the tier it 'used'."""
    for item in items:
        ctx.record(bytes=nbytes, tier="memory", chunks=1)
        yield item


@stage("stubborn", kinds=("store", "retrieve", "lookup"))
def stubborn(items: Iterator[Any]) -> Iterator[Any]:
    """Raise while being closed early."""
    try:
        yield from items
    except GeneratorExit:
        raise RuntimeError("stubborn refused to close") from None


# -- helpers -----------------------------------------------------------------


class CountingProcessor(SpanProcessor):
    """Counts on_end per span id: every span must end exactly once."""

    def __init__(self) -> None:
        self.ends: Counter[int] = Counter()

    def on_end(self, span: ReadableSpan) -> None:
        self.ends[span.context.span_id] += 1


class Tracing:
    def __init__(self, sampler=None) -> None:
        self.exporter = InMemorySpanExporter()
        self.counter = CountingProcessor()
        kwargs = {"sampler": sampler} if sampler is not None else {}
        self.provider = TracerProvider(**kwargs)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.provider.add_span_processor(self.counter)
        self.tracer = self.provider.get_tracer("test")

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def by_name(self) -> dict[str, ReadableSpan]:
        found = {s.name: s for s in self.spans()}
        assert len(found) == len(self.spans()), "span names are not unique in this test"
        return found


@pytest.fixture
def tracing() -> Tracing:
    return Tracing()


def chain(*tables: str) -> str:
    """A store list of ``[[store.stages]]`` tables, one per argument (``use`` and settings)."""
    return "\n".join(f"[[store.stages]]\n{body.strip()}\n" for body in tables)


def stage_line(text: str, index: int) -> int:
    """The TOML line of the ``index``-th ``[[store.stages]]`` table."""
    headers = [n for n, line in enumerate(text.splitlines(), start=1) if line == "[[store.stages]]"]
    return headers[index]


def runner(text: str, tracer=None) -> Runner:
    pipeline = loads_pipeline(text, file=FILE)
    return Runner(pipeline.store, kind="store", pipeline="test", tracer=tracer)


def own_module(name: str) -> str:
    return f'use = "{HERE}:{name}"'


def closing_stage(label: str) -> str:
    return f'{own_module("closing")}\nlabel = "{label}"'


def assert_clean(t: Tracing) -> None:
    """Every span ended once, and nothing is left current."""
    assert t.spans(), "no spans recorded"
    assert set(t.counter.ends.values()) == {1}, t.counter.ends
    assert len(t.counter.ends) == len(t.spans())
    assert not trace.get_current_span().get_span_context().is_valid


# -- the span tree -----------------------------------------------------------


def test_one_span_per_stage_under_one_root(tracing):
    text = chain(closing_stage("a"), 'use = "pass-through"', closing_stage("c"))
    out = runner(text, tracing.tracer).run(range(5), attributes={"request_id": "req-1", "layer": 3})
    assert out == list(range(5))
    assert_clean(tracing)
    spans = tracing.spans()
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["flowkv.store"]
    root = roots[0]
    children = sorted((s for s in spans if s.parent is not None), key=lambda s: s.attributes["flowkv.stage.index"])
    assert [s.name for s in children] == ["closing", "pass-through", "closing"]
    for index, span in enumerate(children):
        assert span.parent.span_id == root.context.span_id  # siblings, all children of the root
        assert span.context.trace_id == root.context.trace_id
        assert span.attributes["flowkv.stage.index"] == index
        assert span.attributes["flowkv.stage.source"] == f"{FILE}:{stage_line(text, index)}"
        assert span.attributes["flowkv.kind"] == "store"
        assert span.attributes["flowkv.request_id"] == "req-1"
        assert span.attributes["flowkv.layer"] == 3
        assert span.attributes["flowkv.items_in"] == span.attributes["flowkv.items_out"] == 5
        assert root.start_time <= span.start_time and span.end_time <= root.end_time
    assert root.attributes["flowkv.pipeline"] == "test"
    assert root.attributes["flowkv.items_out"] == 5
    assert root.attributes["flowkv.request_id"] == "req-1"
    assert root.status.status_code is StatusCode.UNSET


def test_root_span_under_a_given_parent(tracing):
    text = chain('use = "pass-through"')
    with tracing.tracer.start_as_current_span("request") as outer:
        runner(text, tracing.tracer).run([1], parent=outer)
    spans = tracing.by_name()
    assert spans["flowkv.store"].parent.span_id == spans["request"].context.span_id
    assert spans["pass-through"].parent.span_id == spans["flowkv.store"].context.span_id
    assert_clean(tracing)


def test_no_span_is_current_inside_a_stage_between_steps(tracing):
    seen: list[str] = []

    def watching_source():
        for item in range(3):
            # The source runs inside stage 0's next(): stage 0's span is current there...
            seen.append(trace.get_current_span().name if trace.get_current_span().is_recording() else "-")
            yield item

    text = chain('use = "pass-through"')
    result = runner(text, tracing.tracer).run(watching_source())
    assert result == [0, 1, 2]
    assert seen == ["pass-through"] * 3
    assert_clean(tracing)  # ...and none is current after the run


class StageTime:
    """The runner's clock in the own-time tests: it moves only when a stage or source below moves it,
    so own times are exact sums, whatever else the machine is doing."""

    ns = 0

    @classmethod
    def perf_counter_ns(cls) -> int:
        return cls.ns

    @classmethod
    def spend(cls, seconds: float) -> None:
        cls.ns += round(seconds * 1e9)


@pytest.fixture
def stage_time(monkeypatch) -> type[StageTime]:
    import flowkv.runner

    StageTime.ns = 0
    monkeypatch.setattr(flowkv.runner, "time", StageTime)
    return StageTime


@stage("spending", kinds=("store", "retrieve", "lookup"))
def spending(items: Iterator[Any], *, seconds: float) -> Iterator[Any]:
    """Sleep ``seconds`` per item and move the runner's test clock on by as much, in the stage's own code."""
    for item in items:
        time.sleep(seconds)
        StageTime.spend(seconds)
        yield item


def test_own_time_counts_a_stage_not_its_downstream(tracing, stage_time):
    nap = 0.005
    items = 8
    text = chain(f'{own_module("spending")}\nseconds = {nap}', 'use = "pass-through"')
    runner(text, tracing.tracer).run(range(items))
    spans = tracing.by_name()
    sleeper = spans["spending"].attributes["flowkv.own_time_ns"]
    downstream = spans["pass-through"].attributes["flowkv.own_time_ns"]
    assert sleeper == items * round(nap * 1e9)  # exactly what the stage itself spent
    assert downstream == 0  # the stage's time is not its downstream's
    assert 0 <= downstream < sleeper
    root = spans["flowkv.store"]
    assert sleeper + downstream <= root.end_time - root.start_time  # the real sleeps happened inside the run


def test_own_time_excludes_a_slow_source(tracing, stage_time):
    def slow_source():
        for item in range(5):
            stage_time.spend(0.005)
            yield item

    text = chain(f'{own_module("spending")}\nseconds = 0')
    runner(text, tracing.tracer).run(slow_source())
    own = tracing.by_name()["spending"].attributes["flowkv.own_time_ns"]
    assert own == 0  # the source's 25 ms are upstream of the stage
    assert own < 5 * 0.005 * 1e9


def test_recorded_attributes_and_totals(tracing):
    text = chain(f'{own_module("measure")}\nnbytes = 64', 'use = "pass-through"')
    ctx = RunContext(kind="store")
    runner(text, tracing.tracer).run(range(4), ctx)
    spans = tracing.by_name()
    assert spans["measure"].attributes["flowkv.bytes"] == 4 * 64
    assert spans["measure"].attributes["flowkv.chunks"] == 4
    assert spans["measure"].attributes["flowkv.tier"] == "memory"
    assert "flowkv.bytes" not in spans["pass-through"].attributes
    assert spans["flowkv.store"].attributes["flowkv.bytes"] == 4 * 64
    assert ctx.totals == {"bytes": 4 * 64, "chunks": 4}


def test_recorded_totals_without_tracing():
    text = chain(f'{own_module("measure")}\nnbytes = 8')
    ctx = RunContext(kind="store")
    runner(text).run(range(3), ctx)
    assert ctx.totals == {"bytes": 24, "chunks": 3}


# -- failures ----------------------------------------------------------------

MIDDLE_FAILURE = chain(
    closing_stage("c0"),
    closing_stage("c1"),
    f'{own_module("explode")}\nlabel = "boom"\nafter = 2',
    closing_stage("c3"),
    closing_stage("c4"),
)


@pytest.mark.parametrize("traced", [False, True], ids=["bare", "traced"])
def test_middle_stage_raising_closes_every_generator(traced, tracing):
    run = runner(MIDDLE_FAILURE, tracing.tracer if traced else None)
    with pytest.raises(StageError) as caught:
        run.run(range(10))
    error = caught.value
    assert error.stage == "explode"
    assert error.location == f"{FILE}:{stage_line(MIDDLE_FAILURE, 2)}"
    assert isinstance(error.original, RuntimeError) and error.__cause__ is error.original
    assert f"stage 'explode' ({FILE}:{stage_line(MIDDLE_FAILURE, 2)}) failed: RuntimeError" in str(error)
    # The raiser ends first and the exception ends its downstream stages on its way out;
    # then the runner closes the suspended upstream generators, last stage first.
    assert closed == ["boom", "c3", "c4", "c1", "c0"]
    if traced:
        assert_clean(tracing)
        spans = {s.attributes["flowkv.stage.index"]: s for s in tracing.spans() if s.parent}
        assert len(spans) == 5
        failed = spans[2]
        assert failed.status.status_code is StatusCode.ERROR
        assert failed.attributes["flowkv.error"] == "RuntimeError: boom broke at item 2"
        assert [e.name for e in failed.events] == ["exception"]
        assert failed.attributes["flowkv.items_out"] == 2
        assert all("flowkv.error" not in spans[i].attributes for i in (0, 1, 3, 4))
        root = next(s for s in tracing.spans() if s.parent is None)
        assert root.status.status_code is StatusCode.ERROR
    else:
        assert tracing.spans() == []


@pytest.mark.parametrize("traced", [False, True], ids=["bare", "traced"])
def test_the_same_function_twice_is_blamed_by_position(traced, tracing):
    text = chain(
        f'{own_module("explode")}\nlabel = "first"\nafter = 100',
        f'{own_module("explode")}\nlabel = "second"\nafter = 1',
        f'{own_module("explode")}\nlabel = "third"\nafter = 100',
    )
    with pytest.raises(StageError) as caught:
        runner(text, tracing.tracer if traced else None).run(range(5))
    assert caught.value.location == f"{FILE}:{stage_line(text, 1)}"
    assert "second broke" in str(caught.value)


@pytest.mark.parametrize("traced", [False, True], ids=["bare", "traced"])
def test_source_raising_is_blamed_on_the_source(traced, tracing):
    def broken_source():
        yield 1
        raise OSError("disk gone")

    text = chain(closing_stage("c0"), closing_stage("c1"))
    with pytest.raises(StageError) as caught:
        runner(text, tracing.tracer if traced else None).run(broken_source())
    assert caught.value.stage == "source"
    assert isinstance(caught.value.original, OSError)
    assert closed == ["c0", "c1"]
    if traced:
        assert_clean(tracing)
        stage_spans = [s for s in tracing.spans() if s.parent]
        assert all("flowkv.error" not in s.attributes for s in stage_spans)


def test_bare_and_traced_paths_agree(tracing):
    text = chain(closing_stage("a"), 'use = "take"\nlimit = 3', f'{own_module("measure")}')
    bare_ctx, traced_ctx = RunContext(kind="store"), RunContext(kind="store")
    bare = runner(text).run(range(10), bare_ctx)
    traced = runner(text, tracing.tracer).run(range(10), traced_ctx)
    assert bare == traced == [0, 1, 2]
    assert bare_ctx.totals == traced_ctx.totals
    errors = []
    for tracer in (None, tracing.tracer):
        with pytest.raises(StageError) as caught:
            runner(MIDDLE_FAILURE, tracer).run(range(10))
        errors.append((caught.value.stage, caught.value.location, str(caught.value)))
    assert errors[0] == errors[1]


# -- early stop --------------------------------------------------------------


@pytest.mark.parametrize("traced", [False, True], ids=["bare", "traced"])
def test_a_stage_that_stops_early_ends_the_run_cleanly(traced, tracing):
    pulled: list[int] = []

    def source():
        for item in range(1000):
            pulled.append(item)
            yield item

    text = chain(closing_stage("c0"), closing_stage("c1"), 'use = "take"\nlimit = 3', closing_stage("c3"))
    out = runner(text, tracing.tracer if traced else None).run(source())
    assert out == [0, 1, 2]
    assert pulled == [0, 1, 2]  # nothing read past what take needed
    # c3 ran out with take; the runner then closed the upstream ones, last first.
    assert closed == ["c3", "c1", "c0"]
    if traced:
        assert_clean(tracing)
        spans = {s.attributes["flowkv.stage.index"]: s for s in tracing.spans() if s.parent}
        assert [spans[i].attributes["flowkv.items_out"] for i in range(4)] == [3, 3, 3, 3]
        assert spans[2].attributes["flowkv.items_in"] == 3
        assert all(s.status.status_code is StatusCode.UNSET for s in tracing.spans())


def test_take_zero_runs_no_upstream_item(tracing):
    pulled: list[int] = []

    def source():
        for item in range(5):
            pulled.append(item)
            yield item

    text = chain(closing_stage("c0"), 'use = "take"\nlimit = 0')
    assert runner(text, tracing.tracer).run(source()) == []
    assert pulled == []
    assert_clean(tracing)
    spans = tracing.by_name()
    assert spans["closing"].attributes["flowkv.items_out"] == 0


def test_a_stage_failing_to_close_still_ends_every_span(tracing):
    text = chain(f'{own_module("stubborn")}', 'use = "take"\nlimit = 1')
    with pytest.raises(RuntimeError, match="stubborn refused to close"):
        runner(text, tracing.tracer).run(range(5))
    assert_clean(tracing)
    assert len(tracing.spans()) == 3


# -- sampling ----------------------------------------------------------------


def test_sampling_zero_gives_no_spans_and_the_same_results():
    for sampler in (ALWAYS_OFF, TraceIdRatioBased(0.0)):
        t = Tracing(sampler)
        text = chain(closing_stage("a"), f'{own_module("measure")}')
        ctx = RunContext(kind="store")
        assert runner(text, t.tracer).run(range(4), ctx) == [0, 1, 2, 3]
        assert t.spans() == []
        assert ctx.totals["bytes"] == 40


def test_tracer_for_telemetry_off_is_the_noop_tracer():
    for spec in (TelemetrySpec(), TelemetrySpec(exporter="console", sampling=0.0)):
        tracer = tracer_for(spec)
        assert not tracer.start_span("probe").is_recording()
