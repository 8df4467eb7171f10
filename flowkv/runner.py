"""Drive a chain of generator stages, and give each one its telemetry.

    source ──▶ stage 0 ──▶ stage 1 ──▶ ... ──▶ stage n ──▶ caller

Each stage is a generator over the previous one's output. Stages never touch
OpenTelemetry: when a run is traced, the runner wraps every stage's output
iterator, opens the stage's span at its first step, makes the span current
only for the duration of each ``next()`` (never across a ``yield``), counts
items, measures the stage's own time (its time inside ``next()`` minus its
upstream's), and ends the span exactly once — on exhaustion, error or close.
An untraced run (telemetry off, or not sampled) chains the bare generators.

On any exit every generator is closed, last stage first; an exception from a
stage comes out as ``StageError`` naming the stage and its TOML location.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from flowkv.items import RunContext
from flowkv.pipeline_model import StageSpec

_SUMMED = ("bytes", "chunks", "hit_tokens")


class StageError(RuntimeError):
    """A stage raised; ``stage`` and ``location`` say which, ``__cause__`` what."""

    def __init__(self, stage: str, location: str, original: BaseException) -> None:
        super().__init__(
            f"stage '{stage}' ({location}) failed: {type(original).__name__}: {original}"
        )
        self.stage = stage
        self.location = location
        self.original = original


@attrs.frozen
class BoundStage:
    """A stage ready to run: its function and effective settings."""

    name: str
    func: Any
    settings: dict[str, Any]
    takes_ctx: bool
    location: str  # "FILE:LINE" of its TOML table
    index: int
    role: str | None = None  # its declared role (flowkv.registry.Role), recorded on its spans

    @classmethod
    def from_spec(cls, spec: StageSpec) -> BoundStage:
        return cls(
            name=spec.name,
            func=spec.info.func,
            settings=spec.info.config_kwargs(spec.config),
            takes_ctx=spec.info.takes_ctx,
            location=spec.location.short,
            index=spec.index,
            role=str(spec.info.role),
        )

    def start(self, upstream: Iterator[Any], ctx: RunContext) -> Iterator[Any]:
        if self.takes_ctx:
            return self.func(upstream, ctx=ctx, **self.settings)
        return self.func(upstream, **self.settings)


class Runner:
    """Runs one stage list (store, retrieve or lookup) of a pipeline, many times."""

    def __init__(
        self,
        stages: Sequence[StageSpec | BoundStage],
        *,
        kind: str,
        pipeline: str,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.stages = [s if isinstance(s, BoundStage) else BoundStage.from_spec(s) for s in stages]
        self.kind = kind
        self.pipeline = pipeline
        self.tracer = tracer or trace.NoOpTracer()

    def run(
        self,
        source: Iterable[Any],
        ctx: RunContext | None = None,
        *,
        attributes: dict[str, Any] | None = None,
        parent: trace.Span | None = None,
    ) -> list[Any]:
        """Run the chain over ``source`` to the end; the last stage's items."""
        ctx = ctx or RunContext(kind=self.kind)
        parent_context = trace.set_span_in_context(parent) if parent is not None else None
        root = self.tracer.start_span(f"flowkv.{self.kind}", context=parent_context)
        if not root.is_recording():
            return self._run_bare(source, ctx)
        try:
            root.set_attribute("flowkv.pipeline", self.pipeline)
            root.set_attribute("flowkv.kind", self.kind)
            for key, value in (attributes or {}).items():
                if value is not None:
                    root.set_attribute(f"flowkv.{key}", value)
            items = self._run_traced(source, ctx, root, attributes or {})
            root.set_attribute("flowkv.items_out", len(items))
            for key in _SUMMED:
                if key in ctx.totals:
                    root.set_attribute(f"flowkv.{key}", ctx.totals[key])
            return items
        except BaseException as exc:
            root.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        finally:
            root.end()

    # -- untraced ---------------------------------------------------------
    def _run_bare(self, source: Iterable[Any], ctx: RunContext) -> list[Any]:
        generators: list[Iterator[Any]] = []
        iterator: Iterator[Any] = iter(source)
        # Each generator's frame, so a traceback says which one raised: two stages may
        # share one function, and a generator source must not be blamed on stage 0.
        frames: dict[Any, BoundStage | None] = {}
        if getattr(iterator, "gi_frame", None) is not None:
            frames[iterator.gi_frame] = None  # type: ignore[attr-defined]
        try:
            for bound in self.stages:
                iterator = bound.start(iterator, ctx)
                generators.append(iterator)
                if getattr(iterator, "gi_frame", None) is not None:
                    frames[iterator.gi_frame] = bound  # type: ignore[attr-defined]
            return list(iterator)
        except Exception as exc:
            raise _blame(exc, frames) from exc
        finally:
            _close_all(generators)

    # -- traced -----------------------------------------------------------
    def _run_traced(
        self, source: Iterable[Any], ctx: RunContext, root: trace.Span, attributes: dict[str, Any]
    ) -> list[Any]:
        parent = trace.set_span_in_context(root)
        upstream = _Step(iter(source), None, ctx)  # the source, timed so stage 0's own time excludes it
        steps: list[_Step] = []
        try:
            for bound in self.stages:
                state = _StageState(bound, self.tracer, parent, self.kind, attributes)
                step = _Step(bound.start(upstream, ctx), state, ctx, upstream)
                steps.append(step)
                upstream = step
            return list(upstream)
        except Exception as exc:
            failed = getattr(exc, "__flowkv_failed_step__", None)
            if failed is None or failed.state is None:
                raise StageError("source", "the run's source", exc) from exc
            raise StageError(failed.state.bound.name, failed.state.bound.location, exc) from exc
        finally:
            try:
                _close_all([s.generator for s in steps])
            finally:  # a stage that raises while closing must not leave spans open
                for step in steps:
                    step.finish()


class _StageState:
    """One stage's span and counters during one traced run."""

    __slots__ = ("bound", "span", "span_context", "tracer", "parent", "attributes", "recorded",
                 "error", "ended", "kind")

    def __init__(self, bound: BoundStage, tracer: trace.Tracer, parent: Any, kind: str,
                 attributes: dict[str, Any]) -> None:
        self.bound = bound
        self.tracer = tracer
        self.parent = parent
        self.kind = kind
        self.attributes = attributes
        self.span: trace.Span | None = None
        self.span_context: Any = None
        self.recorded: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.ended = False

    def open(self) -> None:
        self.span = self.tracer.start_span(self.bound.name, context=self.parent)
        self.span_context = trace.set_span_in_context(self.span, self.parent)

    def record(self, attributes: dict[str, Any]) -> None:
        for key, value in attributes.items():
            if key in _SUMMED and isinstance(value, (int, float)):
                self.recorded[key] = self.recorded.get(key, 0) + value
            else:
                self.recorded[key] = value


class _Step:
    """The iterator between two stages: times and traces the stage that produces into it."""

    __slots__ = ("generator", "state", "ctx", "upstream", "total_ns", "items_out")

    def __init__(self, generator: Iterator[Any], state: _StageState | None, ctx: RunContext,
                 upstream: _Step | None = None) -> None:
        self.generator = generator
        self.state = state
        self.ctx = ctx
        self.upstream = upstream
        self.total_ns = 0
        self.items_out = 0

    def __iter__(self) -> _Step:
        return self

    def __next__(self) -> Any:
        state = self.state
        if state is None:  # the source
            start = time.perf_counter_ns()
            try:
                item = next(self.generator)
            except StopIteration:
                raise
            except BaseException as exc:
                # Mark it here, or stage 0's step would take the source's failure for its own.
                _mark_failed(exc, self)
                raise
            finally:
                self.total_ns += time.perf_counter_ns() - start
            self.items_out += 1
            return item
        if state.span is None:
            state.open()
        token = otel_context.attach(state.span_context)
        previous = self.ctx._recorder
        self.ctx._recorder = state.record
        start = time.perf_counter_ns()
        try:
            item = next(self.generator)
        except StopIteration:
            self.finish()
            raise
        except BaseException as exc:
            if _mark_failed(exc, self):
                state.error = exc
            raise
        finally:
            self.total_ns += time.perf_counter_ns() - start
            self.ctx._recorder = previous
            otel_context.detach(token)
        self.items_out += 1
        return item

    def finish(self) -> None:
        """End this stage's span, once."""
        state = self.state
        if state is None or state.ended:
            return
        state.ended = True
        if state.span is None:  # never stepped (an earlier stage failed, or the run stopped)
            state.open()
        span = state.span
        try:
            upstream = self.upstream
            span.set_attribute("flowkv.stage", state.bound.name)
            span.set_attribute("flowkv.stage.index", state.bound.index)
            span.set_attribute("flowkv.stage.source", state.bound.location)
            if state.bound.role is not None:
                span.set_attribute("flowkv.stage.role", state.bound.role)
            span.set_attribute("flowkv.kind", state.kind)
            for key in ("request_id", "layer"):
                if state.attributes.get(key) is not None:
                    span.set_attribute(f"flowkv.{key}", state.attributes[key])
            span.set_attribute("flowkv.items_in", upstream.items_out if upstream else 0)
            span.set_attribute("flowkv.items_out", self.items_out)
            if "chunks" not in state.recorded:  # stages pass chunks: what came out is the count
                span.set_attribute("flowkv.chunks", self.items_out)
            own = self.total_ns - (upstream.total_ns if upstream else 0)
            span.set_attribute("flowkv.own_time_ns", max(own, 0))
            for key, value in state.recorded.items():
                if isinstance(value, (bool, int, float, str)):
                    span.set_attribute(f"flowkv.{key}", value)
            if state.error is not None:
                span.set_attribute("flowkv.error", f"{type(state.error).__name__}: {state.error}")
                span.record_exception(state.error)
                span.set_status(Status(StatusCode.ERROR, str(state.error)))
        except Exception:  # telemetry never breaks the data path
            pass
        finally:
            span.end()


def _mark_failed(exc: BaseException, step: _Step) -> bool:
    """Tag ``exc`` with the step it first came out of; False when a step upstream already did."""
    if getattr(exc, "__flowkv_failed_step__", None) is not None:
        return False
    try:
        exc.__flowkv_failed_step__ = step  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    return True


def _blame(exc: BaseException, frames: dict[Any, BoundStage | None]) -> BaseException:
    """The StageError for ``exc``: the innermost stage (or source) frame in its traceback raised it."""
    if isinstance(exc, StageError):
        return exc
    culprit: BoundStage | None = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame in frames:
            culprit = frames[tb.tb_frame]
        tb = tb.tb_next
    if culprit is None:
        return StageError("source", "the run's source", exc)
    return StageError(culprit.name, culprit.location, exc)


def _close_all(generators: Sequence[Iterator[Any]]) -> None:
    """Close every generator, last stage first; the first close error is raised after all."""
    first: BaseException | None = None
    for generator in reversed(generators):
        close = getattr(generator, "close", None)
        if close is None:
            continue
        try:
            close()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first
