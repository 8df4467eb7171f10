"""`flowkv trace summarize|timeline` on traces with known times."""

from __future__ import annotations

import html.parser
import json

import attrs
import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from flowkv.otlp_json import OTLPJsonFileExporter, SpanRecord, load_spans
from flowkv.tracetools import format_summary, main, summarize, timeline

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
MIB = 1 << 20


class TraceWriter:
    """Emits spans with chosen times through the real SDK into an OTLP/JSON file."""

    def __init__(self, folder):
        self.exporter = OTLPJsonFileExporter(folder)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "vllm-worker", "process.pid": 4242}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("flowkv")

    def span(self, name, start_ms, end_ms, parent=None, **attributes):
        context = trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(name, context=context, start_time=T0 + int(start_ms * MS), attributes=attributes)
        span.end(end_time=T0 + int(end_ms * MS))
        return span

    def close(self):
        self.provider.shutdown()
        return self.exporter.path


def write_layerwise_retrieve(folder):
    """One engine step, 4 layers; each layer's transfer takes 10 ms.

    worker:     |L0 get+scatter|L1 ...........|L2 ...........|L3 ...........|
                0              10             20             30             40 ms
    inference:  [wait L0 10ms ] 4ms [wait 6ms] 4ms [wait 6ms] 4ms [wait 6ms]

    Blocked transfer time: 10 + 6 + 6 + 6 = 28 ms of 40 ms -> overlap 12/40 = 0.3.
    """
    writer = TraceWriter(folder)
    step = writer.span("flowkv.step", 0, 60)
    for layer in range(4):
        start = 10 * layer
        root = writer.span(
            "flowkv.retrieve", start, start + 10, parent=step,
            **{"flowkv.pipeline": "local-cpu", "flowkv.kind": "retrieve", "flowkv.layer": layer},
        )
        for index, (stage, begin, end) in enumerate([("get", 0, 6), ("scatter", 6, 10)]):
            writer.span(
                stage, start + begin, start + end, parent=root,
                **{
                    "flowkv.stage": stage, "flowkv.kind": "retrieve", "flowkv.stage.index": index,
                    "flowkv.layer": layer, "flowkv.own_time_ns": (end - begin) * MS,
                    "flowkv.bytes": MIB, "flowkv.items_out": 1, "flowkv.tier": "cpu",
                },
            )
    for layer, (begin, end) in enumerate([(0, 10), (14, 20), (24, 30), (34, 40)]):
        writer.span("flowkv.wait", begin, end, parent=step, **{"flowkv.layer": layer})
    return writer.close()


@pytest.fixture
def layerwise_file(tmp_path):
    return write_layerwise_retrieve(tmp_path)


def record(name, start_ms, end_ms, span_id, parent=None, **attributes):
    return SpanRecord(
        trace_id="0" * 31 + "1",
        span_id=f"{span_id:016x}",
        parent_span_id=None if parent is None else f"{parent:016x}",
        name=name,
        kind="internal",
        start_ns=T0 + int(start_ms * MS),
        end_ns=T0 + int(end_ms * MS),
        attributes=attributes,
    )


def test_overlap_ratio_of_known_layerwise_trace(layerwise_file):
    summary = summarize(load_spans(layerwise_file))
    assert summary.transfer_ns == 40 * MS
    assert summary.blocked_ns == 28 * MS
    assert summary.overlap_ratio == 12 / 40
    layers = {l.layer: l for l in summary.layers}
    assert [layers[i].transfer_ns for i in range(4)] == [10 * MS] * 4
    assert [layers[i].blocked_ns for i in range(4)] == [10 * MS, 6 * MS, 6 * MS, 6 * MS]
    assert [layers[i].wait_ns for i in range(4)] == [10 * MS, 6 * MS, 6 * MS, 6 * MS]
    assert [layers[i].compute_ns for i in range(4)] == [None, 4 * MS, 4 * MS, 4 * MS]
    assert [layers[i].transfer_bytes for i in range(4)] == [2 * MIB] * 4
    assert summary.runs == {"retrieve": 4}
    assert summary.step_ns == 60 * MS
    # Transfers (10 ms) outlast compute between layers (4 ms): rule 1 fires.
    assert any("outlast the compute" in text for text in summary.suggestions)
    assert not any("layerwise = false" in text for text in summary.suggestions)


def test_overlap_counts_concurrent_layers_and_nested_spans_once():
    spans = [
        record("flowkv.retrieve", 0, 10, 1, **{"flowkv.layer": 0}),
        record("get", 2, 8, 2, parent=1, **{"flowkv.stage": "get", "flowkv.layer": 0, "flowkv.own_time_ns": 6 * MS}),
        record("flowkv.retrieve", 5, 15, 3, **{"flowkv.layer": 1}),
        record("flowkv.wait", 8, 12, 4, **{"flowkv.layer": 0}),
    ]
    summary = summarize(spans)
    layers = {l.layer: l for l in summary.layers}
    assert (layers[0].transfer_ns, layers[0].blocked_ns) == (10 * MS, 2 * MS)
    assert (layers[1].transfer_ns, layers[1].blocked_ns) == (10 * MS, 4 * MS)
    assert summary.overlap_ratio == 14 / 20


def test_own_time_from_attribute_and_fallback_from_children():
    spans = [
        record("flowkv.store", 0, 20, 1, **{"flowkv.kind": "store"}),
        record("gather", 0, 20, 2, parent=1, **{"flowkv.stage": "gather", "flowkv.own_time_ns": 3 * MS,
                                                  "flowkv.bytes": 4 * MIB, "flowkv.items_out": 4}),
        record("gather", 0, 20, 9, parent=1, **{"flowkv.stage": "gather", "flowkv.own_time_ns": 2 * MS,
                                                  "flowkv.bytes": 4 * MIB, "flowkv.items_out": 4}),
        # no own_time_ns: 10 ms minus its children's union [1,5) = 6 ms
        record("put", 10, 20, 3, parent=1, **{"flowkv.stage": "put", "flowkv.error": "OSError: disk full"}),
        record("redis.call", 11, 13, 4, parent=3),
        record("redis.call", 12, 15, 5, parent=3),
    ]
    summary = summarize(spans)
    stages = {s.stage: s for s in summary.stages}
    assert stages["gather"].own_ns == 5 * MS and stages["gather"].own_time_measured
    assert stages["gather"].count == 2 and stages["gather"].total_bytes == 8 * MIB and stages["gather"].items_out == 8
    assert stages["put"].own_ns == 6 * MS and not stages["put"].own_time_measured
    assert stages["put"].errors == 1
    assert stages["put"].kind == "store"  # from the parent run root
    assert stages["put"].share == 6 / 11
    assert summary.slowest[0] == "store/put"
    text = format_summary(summary)
    assert "store/put *" in text and "upper bound" in text
    assert "layerwise off" in text


def test_rule_codec_stage_dominates():
    spans = [
        record("compress", 0, 6, 1, **{"flowkv.stage": "compress", "flowkv.kind": "store", "flowkv.own_time_ns": 6 * MS}),
        record("put", 6, 10, 2, **{"flowkv.stage": "put", "flowkv.kind": "store", "flowkv.own_time_ns": 4 * MS}),
    ]
    (advice,) = summarize(spans).suggestions
    assert "Codec stage store/compress takes 60%" in advice


def test_rule_tier_without_hits_goes_later():
    spans = [
        record("lookup", 0, 5, 1, **{"flowkv.stage": "lookup", "flowkv.kind": "lookup", "flowkv.tier": "disk",
                                       "flowkv.own_time_ns": 5 * MS, "flowkv.hit_tokens": 0}),
        record("lookup", 5, 6, 2, **{"flowkv.stage": "lookup", "flowkv.kind": "lookup", "flowkv.tier": "cpu",
                                       "flowkv.own_time_ns": 1 * MS, "flowkv.hit_tokens": 512}),
    ]
    summary = summarize(spans)
    assert {t.tier: t.hit_tokens for t in summary.tiers} == {"disk": 0, "cpu": 512}
    assert any("Tier disk found no hits" in text and "after cpu" in text for text in summary.suggestions)


def test_rule_small_items_and_small_chunks():
    spans = [
        record("gather", 0, 8, 1, **{"flowkv.stage": "gather", "flowkv.kind": "store", "flowkv.own_time_ns": 8 * MS,
                                       "flowkv.bytes": 32 * 64 * 1024, "flowkv.items_out": 32}),
        record("put", 8, 10, 2, **{"flowkv.stage": "put", "flowkv.kind": "store", "flowkv.own_time_ns": 2 * MS,
                                     "flowkv.bytes": 4 * 64 * 1024, "flowkv.items_out": 4, "flowkv.tier": "redis"}),
        record("get", 0, 9, 3, **{"flowkv.stage": "get", "flowkv.kind": "retrieve", "flowkv.own_time_ns": 9 * MS,
                                    "flowkv.bytes": 4 * 64 * 1024, "flowkv.items_out": 4, "flowkv.tier": "redis"}),
    ]
    advice = summarize(spans).suggestions
    # No stage has a batch setting: the advice names the one that makes items larger.
    assert any("store/gather" in a and "small items" in a and "`chunk_size`" in a for a in advice)
    assert not any("batch" in a for a in advice)
    assert any("retrieve/get" in a and "`chunk_size`" in a for a in advice)
    assert not any("store/put" in a for a in advice)  # 20% share: below the rule's threshold


def test_rules_layerwise_off_and_well_hidden():
    spans = [
        record("flowkv.step", 0, 10, 1),
        record("flowkv.retrieve", 1, 4, 2, parent=1),
    ]
    (advice,) = summarize(spans).suggestions
    assert "30% of engine step time" in advice and "`layerwise = true`" in advice

    hidden = [record("flowkv.retrieve", 0, 10, 1, **{"flowkv.layer": 0}), record("flowkv.wait", 9.5, 10, 2, **{"flowkv.layer": 0})]
    (advice,) = summarize(hidden).suggestions
    assert "hides 95%" in advice and "keep `layerwise = true`" in advice

    assert summarize([record("x", 0, 1, 1)]).suggestions == ("No setting stands out from these numbers.",)


def test_timeline_json_has_one_lane_per_stage_and_layer(layerwise_file, tmp_path):
    spans = load_spans(layerwise_file)
    out = timeline(spans, tmp_path / "timeline.json")
    document = json.loads(out.read_text())
    events = document["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    expected = {"engine step", "inference: blocked (flowkv.wait)"}
    for layer in range(4):
        expected |= {f"flowkv.retrieve · layer {layer}", f"retrieve/get · layer {layer}", f"retrieve/scatter · layer {layer}"}
    assert set(lanes.values()) == expected
    assert len(lanes) == len(expected)
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(spans) == 17
    by_lane = {lanes[(e["pid"], e["tid"])]: e for e in slices if lanes[(e["pid"], e["tid"])] != "inference: blocked (flowkv.wait)"}
    assert by_lane["retrieve/get · layer 2"]["ts"] == 20_000.0  # microseconds from the first span
    assert by_lane["retrieve/get · layer 2"]["dur"] == 6_000.0
    assert by_lane["retrieve/get · layer 2"]["args"]["flowkv.layer"] == 2
    process_names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert process_names == ["vllm-worker (pid 4242)"]


class _PageParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.open, self.tags, self.bars, self.labels = [], [], 0, []
        self._in_label = False

    def handle_starttag(self, tag, attributes):
        attributes = dict(attributes)
        self.tags.append(tag)
        if tag not in ("meta",):
            self.open.append(tag)
        self.bars += "bar" in attributes.get("class", "").split()
        self._in_label = attributes.get("class") == "label"

    def handle_endtag(self, tag):
        assert self.open and self.open.pop() == tag, f"unbalanced </{tag}>"

    def handle_data(self, data):
        if self._in_label:
            self.labels.append(data)
            self._in_label = False


def test_timeline_html_is_self_contained(layerwise_file, tmp_path):
    spans = load_spans(layerwise_file)
    out = timeline(spans, tmp_path / "timeline.html")
    page = out.read_text()
    parser = _PageParser()
    parser.feed(page)
    parser.close()
    assert parser.open == []
    assert "script" not in parser.tags and "link" not in parser.tags and "http" not in page
    assert parser.bars == len(spans)
    assert "retrieve/scatter · layer 3" in parser.labels
    assert len(parser.labels) == 14


def test_timeline_rejects_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"\.json .* or \.html"):
        timeline([record("x", 0, 1, 1)], tmp_path / "t.svg")


def test_cli_summarize_json(layerwise_file, capsys):
    assert main(["trace", "summarize", str(layerwise_file), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["overlap_ratio"] == 0.3
    assert result["transfer_ns"] == 40 * MS and result["blocked_ns"] == 28 * MS
    assert [s["stage"] for s in result["stages"]] == ["get", "scatter"]
    assert result["stages"][0]["own_ns"] == 24 * MS
    assert result["slowest"] == ["retrieve/get", "retrieve/scatter"]
    assert result["suggestions"]


def test_cli_summarize_text_and_timeline(layerwise_file, tmp_path, capsys):
    assert main(["trace", "summarize", str(layerwise_file)]) == 0
    text = capsys.readouterr().out
    assert "overlap ratio: 0.300 (12.000 ms of 40.000 ms transfer hidden behind compute)" in text
    assert "retrieve/get" in text and "suggestions:" in text
    assert main(["trace", "timeline", str(layerwise_file), "-o", str(tmp_path / "t.html")]) == 0
    assert (tmp_path / "t.html").stat().st_size > 0


def test_cli_errors_are_clear(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["trace", "summarize", str(bad)]) == 2
    assert f"flowkv trace: error: {bad}:1: invalid JSON" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text('{"resourceSpans": []}')
    assert main(["trace", "summarize", str(empty)]) == 2
    assert "holds no spans" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "timeline", str(bad)])  # -o is required
    assert exit_info.value.code == 2


def test_cli_help_describes_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "summarize", "--help"])
    assert exit_info.value.code == 0
    assert "overlap ratio" in capsys.readouterr().out


def test_summary_json_round_trips_through_attrs(layerwise_file):
    summary = summarize(load_spans(layerwise_file))
    assert json.loads(json.dumps(attrs.asdict(summary)))["layers"][1]["compute_ns"] == 4 * MS


def test_real_runner_trace_file_summarizes(tmp_path):
    """Spans from flowkv's runner, through the file exporter, read back by the tools."""
    from flowkv.items import RunContext
    from flowkv.runner import BoundStage, Runner

    def gather(chunks, *, ctx):
        for chunk in chunks:
            ctx.record(bytes=len(chunk))
            yield chunk

    def compress(chunks):
        for chunk in chunks:
            yield chunk[: len(chunk) // 2]

    exporter = OTLPJsonFileExporter(tmp_path)
    provider = TracerProvider(resource=Resource.create({"service.name": "flowkv"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    runner = Runner(
        [
            BoundStage("gather", gather, {}, True, "local.toml:3", 0),
            BoundStage("compress", compress, {}, False, "local.toml:6", 1),
        ],
        kind="store",
        pipeline="local",
        tracer=provider.get_tracer("flowkv"),
    )
    for layer in range(3):
        out = runner.run([b"x" * 1024] * 4, RunContext(kind="store", layer=layer), attributes={"layer": layer})
        assert len(out) == 4
    provider.shutdown()

    spans = load_spans(exporter.path)
    summary = summarize(spans)
    assert summary.runs == {"store": 3}
    stages = {s.stage: s for s in summary.stages}
    assert set(stages) == {"gather", "compress"}
    assert all(s.own_time_measured and s.count == 3 and s.items_out == 12 for s in stages.values())
    assert stages["gather"].total_bytes == 3 * 4 * 1024
    assert [l.layer for l in summary.layers] == [0, 1, 2]
    assert summary.transfer_ns > 0
    assert summary.overlap_ratio is None  # no flowkv.wait spans: blocked time unknown
    assert "overlap ratio: n/a (no flowkv.wait spans" in format_summary(summary)
    document = json.loads(timeline(spans, tmp_path / "t.json").read_text())
    lanes = {e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert "store/gather · layer 2" in lanes and "flowkv.store · layer 0" in lanes


# -- bytes per second against the machine's copy bandwidth -------------------------

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "traces"


def test_recorded_fresh_arena_trace_names_first_touch_faults():
    """tests/fixtures/traces/fresh-arena-stores.json: four stores of 2,816 tokens (vLLM CPU layout,
    4 layers x 4 KV heads x 64, bf16, block 128) into an arena that was not pre-faulted, then
    four retrieves of them, recorded by the engine with the file exporter."""
    summary = summarize(load_spans(FIXTURES / "fresh-arena-stores.json"))
    assert summary.copy_gbps is not None and summary.copy_gbps_source == "trace"
    stages = {f"{s.kind}/{s.stage}": s for s in summary.stages}
    gather, scatter = stages["store/gather"], stages["retrieve/scatter"]
    assert gather.transfer and scatter.transfer and not stages["store/put"].transfer
    assert gather.gbps == gather.total_bytes / gather.own_ns
    assert gather.faults * 4096 >= gather.total_bytes  # every page of the fresh arena faulted once
    assert scatter.faults * 4096 < 0.25 * scatter.total_bytes  # the cache's pages were written before
    slow_gather = [a for a in summary.suggestions if a.startswith("Transfer stage store/gather")]
    assert len(slow_gather) == 1 and "first-touch page faults" in slow_gather[0]
    assert "prefault" in slow_gather[0]
    assert not any("retrieve/scatter" in a and "first-touch" in a for a in summary.suggestions)
    text = format_summary(summary)
    header = next(line for line in text.splitlines() if line.startswith("stage"))
    assert "GB/s" in header and "x copy" in header
    row = next(line for line in text.splitlines() if line.startswith("store/gather"))
    assert f"{gather.gbps:.2f}" in row and f"{gather.gbps / summary.copy_gbps:.2f}" in row
    assert "recorded in the trace" in text


def transfer_span(span_id, *, own_ms, nbytes, faults=0, cpu_ms=None, preempted=0, row_bytes=None, stage="gather"):
    attributes = {"flowkv.stage": stage, "flowkv.kind": "store" if stage == "gather" else "retrieve",
                  "flowkv.own_time_ns": int(own_ms * MS), "flowkv.bytes": nbytes, "flowkv.items_out": 1,
                  "flowkv.faults": faults, "flowkv.cpu_ns": int((own_ms if cpu_ms is None else cpu_ms) * MS),
                  "flowkv.preempted": preempted}
    if row_bytes is not None:
        attributes["flowkv.row_bytes"] = row_bytes
    return record(stage, 0, own_ms, span_id, **attributes)


def slow_transfer_advice(spans, copy_gbps=10.0):
    summary = summarize(spans, copy_gbps=copy_gbps)
    return [a for a in summary.suggestions if a.startswith("Transfer stage")]


def test_slow_transfer_causes_are_told_apart():
    # 64 MiB in 20 ms = 3.4 GB/s against 10 GB/s: far below.
    (contended,) = slow_transfer_advice([transfer_span(1, own_ms=20, nbytes=64 * MIB, cpu_ms=8, preempted=40,
                                                       row_bytes=64 << 10)])
    assert "thread contention" in contended and "40%" in contended and "40 preemptions" in contended
    assert "first-touch" not in contended and "layout" not in contended

    (short_rows,) = slow_transfer_advice([transfer_span(1, own_ms=20, nbytes=64 * MIB, row_bytes=256)])
    assert "layout (its copies move rows of 256 B)" in short_rows
    assert "contention" not in short_rows and "first-touch" not in short_rows

    (faulted,) = slow_transfer_advice([transfer_span(1, own_ms=20, nbytes=64 * MIB, faults=16384, row_bytes=8192)])
    assert "first-touch page faults (16384 faults" in faulted and "layout" not in faulted

    (unknown,) = slow_transfer_advice([transfer_span(1, own_ms=20, nbytes=64 * MIB, row_bytes=8192)])
    assert "none that the trace records" in unknown
    assert "3.4 GB/s, 34% of this machine's copy bandwidth (10.0 GB/s)" in unknown

    # 32 chunks of 1 MiB: 105 us each at 10 GB/s, so the fixed cost of each call weighs.
    small = transfer_span(1, own_ms=10, nbytes=32 * MIB, row_bytes=8192)
    small.attributes["flowkv.items_out"] = 32
    (per_call,) = slow_transfer_advice([small])
    assert "per-call cost (each chunk moves 1.0 MiB, 105 us at copy speed" in per_call
    assert "`chunk_size`" in per_call and "none that" not in per_call


def test_fast_transfers_and_traces_without_bandwidth_get_no_transfer_advice():
    fast = transfer_span(1, own_ms=10, nbytes=64 * MIB, row_bytes=256)  # 6.7 GB/s: 67% of 10 GB/s
    assert slow_transfer_advice([fast]) == []
    summary = summarize([transfer_span(1, own_ms=20, nbytes=64 * MIB, row_bytes=256)])  # no copy_gbps anywhere
    assert summary.copy_gbps is None and summary.copy_gbps_source == ""
    assert not any(a.startswith("Transfer stage") for a in summary.suggestions)
    assert summary.stages[0].gbps is not None  # bytes per second are shown all the same


def test_cli_copy_bandwidth_given_measured_or_left_out(layerwise_file, capsys):
    assert main(["trace", "summarize", str(layerwise_file), "--json", "--copy-gbps", "20"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["copy_gbps"], result["copy_gbps_source"]) == (20.0, "given")
    scatter = next(s for s in result["stages"] if s["stage"] == "scatter")
    assert scatter["transfer"] and scatter["gbps"] == 4 * MIB / (16 * MS)
    assert any(a.startswith("Transfer stage retrieve/scatter") for a in result["suggestions"])

    assert main(["trace", "summarize", str(layerwise_file), "--json", "--no-measure"]) == 0
    assert json.loads(capsys.readouterr().out)["copy_gbps"] is None

    assert main(["trace", "summarize", str(layerwise_file)]) == 0  # the trace has none: measured here
    assert "measured now by summarize on this machine" in capsys.readouterr().out


def test_engine_traces_carry_the_probe_and_the_copy_bandwidth(tmp_path):
    import torch

    from flowkv import CacheEngine, KVTransfer, telemetry
    from flowkv._testing.paged import make_paged_kv, random_slot_mapping
    from flowkv.kernels import KVGeometry

    g = KVGeometry("cpu", 2, 2, 64, 32, torch.bfloat16)
    engine = CacheEngine.from_pipeline("local-cpu", geometry=g, model_name="tiny", overrides={
        "chunk_size": 64, "tiers.memory.capacity": "4MiB", "tiers.memory.prefault": "off",
        "telemetry.exporter": "file", "telemetry.folder": str(tmp_path)})
    caches = make_paged_kv(g, 8, seed=0)
    slots = random_slot_mapping(128, g, 8, seed=1)
    tokens = torch.arange(128)
    assert engine.store(KVTransfer(tokens=tokens, kv_caches=caches, slot_mapping=slots)).stored_tokens == 128
    assert int(engine.retrieve(KVTransfer(tokens=tokens, kv_caches=make_paged_kv(g, 8, seed=2, fill=False),
                                          slot_mapping=slots)).ret_mask.sum()) == 128
    telemetry.flush()
    engine.close()
    [path] = tmp_path.glob("flowkv-*.json")
    spans = load_spans(path)
    transfers = [s for s in spans if s.attributes.get("flowkv.stage") in ("gather", "scatter")]
    assert {s.attributes["flowkv.stage"] for s in transfers} == {"gather", "scatter"}
    for span in transfers:
        assert all(isinstance(span.attributes[k], int) for k in
                   ("flowkv.faults", "flowkv.cpu_ns", "flowkv.preempted", "flowkv.row_bytes"))
        assert span.resource["flowkv.host.copy_gbps"] > 0
    summary = summarize(spans)
    assert summary.copy_gbps_source == "trace"
    assert all(s.transfer == (s.stage in ("gather", "scatter")) for s in summary.stages)


def test_the_summary_gives_the_blends_recompute_share_and_its_cost():
    spans = [
        record("flowkv.request", 0, 100, 1),
        # One blend of 400 loaded tokens, 60 recomputed past the check layer ...
        record("flowkv.blend.rerotate", 0, 2, 2, parent=1),
        record("flowkv.blend.recompute", 2, 10, 3, parent=1, **{"flowkv.layer": 0}),
        record("flowkv.blend.recompute", 12, 14, 4, parent=1, **{"flowkv.layer": 1}),
        record("flowkv.blend.write", 10, 11, 9, parent=1, **{"flowkv.layer": 0}),  # a layer, written once recomputed
        record("flowkv.blend.attend", 11, 12, 5, parent=1, **{"flowkv.layer": 0}),
        record("flowkv.blend.write", 14, 15, 6, parent=1, **{"flowkv.blend.reused_tokens": 400,
                                                          "flowkv.blend.recomputed_tokens": 60}),
        # ... another of 100 with nothing recomputed (ratio 0), and a save's copy out of vLLM.
        record("flowkv.blend.write", 20, 21, 7, parent=1, **{"flowkv.blend.reused_tokens": 100,
                                                          "flowkv.blend.recomputed_tokens": 0}),
        record("flowkv.blend.stage", 30, 33, 8, parent=1),
    ]
    blend = summarize(spans).blend
    assert (blend.blends, blend.reused_tokens, blend.recomputed_tokens) == (2, 500, 60)
    assert blend.recompute_share == 0.12
    assert blend.step_ns == {"attend": 1 * MS, "recompute": 10 * MS, "rerotate": 2 * MS, "stage": 3 * MS,
                             "write": 3 * MS}
    assert blend.load_ns == 16 * MS  # the save's copy is not the loads' cost
    text = format_summary(summarize(spans))
    assert "blend: 2 loads, 500 tokens reused, 60 recomputed (12.0%)" in text
    assert summarize([record("flowkv.request", 0, 1, 1)]).blend is None
