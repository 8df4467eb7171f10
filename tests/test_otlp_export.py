"""Spans leave flowkv in OTLP form: over gRPC, over HTTP, and as OTLP/JSON files."""

from __future__ import annotations

import base64
import json
import re

import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from otlp_receiver import OTLPHttpReceiver, otlp_grpc_receiver, otlp_http_receiver  # noqa: F401 (fixtures)

from flowkv.otlp_json import OTLPJsonFileExporter, TraceFileError, load_spans

STAGE_ATTRS = {
    "flowkv.stage": "gather",
    "flowkv.kind": "store",
    "flowkv.stage.index": 3,
    "flowkv.stage.source": "pipelines/local-cpu.toml:17",
    "flowkv.items_in": 4,
    "flowkv.items_out": 4,
    "flowkv.own_time_ns": 1_234_567,
    "flowkv.bytes": 8 * 2**20,
    "flowkv.layer": 0,
}


def _provider(*processors) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "flowkv-test"}))
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def _emit_store_run(provider: TracerProvider) -> None:
    """A store run shaped like the runner's: a root and two stage children."""
    tracer = provider.get_tracer("flowkv")
    with tracer.start_as_current_span(
        "flowkv.store", attributes={"flowkv.pipeline": "local-cpu", "flowkv.kind": "store", "flowkv.chunks": 4}
    ):
        with tracer.start_as_current_span("gather", attributes=STAGE_ATTRS) as gather:
            gather.add_event("batch", {"chunks": 4})
        with tracer.start_as_current_span(
            "put",
            attributes={"flowkv.stage": "put", "flowkv.tier": "cpu", "ratios": (0.5, 0.25), "flags": (True, False)},
        ) as put:
            put.set_status(Status(StatusCode.ERROR, "MemoryError: arena full"))


def _check_store_run(spans) -> None:
    by_name = {span.name: span for span in spans}
    assert set(by_name) == {"flowkv.store", "gather", "put"}
    root = by_name["flowkv.store"]
    assert root.parent_span_id is None
    assert by_name["gather"].parent_span_id == root.span_id
    assert by_name["put"].parent_span_id == root.span_id
    assert {span.trace_id for span in spans} == {root.trace_id}
    assert by_name["gather"].attributes == STAGE_ATTRS
    assert by_name["put"].attributes["ratios"] == (0.5, 0.25)
    assert by_name["put"].attributes["flags"] == (True, False)
    assert by_name["put"].status_code == "error"
    assert by_name["put"].status_message == "MemoryError: arena full"
    assert root.attributes["flowkv.pipeline"] == "local-cpu"
    assert root.resource["service.name"] == "flowkv-test"
    assert by_name["gather"].events[0].name == "batch"
    assert root.start_ns <= by_name["gather"].start_ns <= by_name["gather"].end_ns <= root.end_ns


def test_grpc_exporter_delivers_spans_with_attributes(otlp_grpc_receiver):
    exporter = GrpcSpanExporter(endpoint=otlp_grpc_receiver.endpoint, insecure=True)
    provider = _provider(BatchSpanProcessor(exporter))
    _emit_store_run(provider)
    assert provider.force_flush()
    _check_store_run(otlp_grpc_receiver.wait_for_spans(3))
    provider.shutdown()


def test_grpc_simple_processor_sends_each_span(otlp_grpc_receiver):
    provider = _provider(SimpleSpanProcessor(GrpcSpanExporter(endpoint=otlp_grpc_receiver.endpoint, insecure=True)))
    _emit_store_run(provider)
    provider.shutdown()
    # SimpleSpanProcessor exports synchronously, one request per finished span.
    assert len(otlp_grpc_receiver.requests()) == 3
    _check_store_run(otlp_grpc_receiver.spans())


def test_http_exporter_delivers_spans_with_attributes(otlp_http_receiver):
    provider = _provider(BatchSpanProcessor(HttpSpanExporter(endpoint=otlp_http_receiver.endpoint)))
    _emit_store_run(provider)
    assert provider.force_flush()
    _check_store_run(otlp_http_receiver.wait_for_spans(3))
    provider.shutdown()


def test_http_receiver_takes_otlp_json_bodies(tmp_path):
    """The same OTLP/JSON our file exporter writes is accepted on the wire."""
    exporter = OTLPJsonFileExporter(tmp_path)
    provider = _provider(SimpleSpanProcessor(exporter))
    _emit_store_run(provider)
    provider.shutdown()
    import urllib.request

    with OTLPHttpReceiver() as receiver:
        for line in exporter.path.read_text().splitlines():
            post = urllib.request.Request(
                receiver.endpoint, data=line.encode(), headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(post) as reply:
                assert reply.status == 200
        _check_store_run(receiver.spans())


def test_file_exporter_round_trip_equals_sdk_spans(tmp_path):
    memory = InMemorySpanExporter()
    exporter = OTLPJsonFileExporter(tmp_path / "traces", file_prefix="run")
    provider = _provider(SimpleSpanProcessor(memory), BatchSpanProcessor(exporter))
    _emit_store_run(provider)
    _emit_store_run(provider)
    provider.shutdown()

    assert exporter.path.parent == tmp_path / "traces"
    assert re.fullmatch(r"run-\d{8}-\d{6}-\d+\.json", exporter.path.name)
    loaded = load_spans(exporter.path)
    sdk_spans = memory.get_finished_spans()
    assert len(loaded) == len(sdk_spans) == 6
    loaded_by_id = {span.span_id: span for span in loaded}
    for sdk_span in sdk_spans:
        record = loaded_by_id[format(sdk_span.context.span_id, "016x")]
        assert record.name == sdk_span.name
        assert record.trace_id == format(sdk_span.context.trace_id, "032x")
        expected_parent = format(sdk_span.parent.span_id, "016x") if sdk_span.parent else None
        assert record.parent_span_id == expected_parent
        assert record.attributes == dict(sdk_span.attributes)
        assert (record.start_ns, record.end_ns) == (sdk_span.start_time, sdk_span.end_time)
    _check_store_run([s for s in loaded if s.trace_id == loaded[0].trace_id])


def test_file_is_otlp_json_lines_matching_the_protobuf_encoding(tmp_path):
    """Each line is the OTLP/JSON mapping of what the SDK would send on the wire."""
    memory = InMemorySpanExporter()
    exporter = OTLPJsonFileExporter(tmp_path)
    provider = _provider(SimpleSpanProcessor(memory), SimpleSpanProcessor(exporter))
    _emit_store_run(provider)
    provider.shutdown()

    lines = exporter.path.read_text().splitlines()
    assert len(lines) == 3  # SimpleSpanProcessor: one export, one line, per span
    for line, sdk_span in zip(lines, memory.get_finished_spans()):
        document = json.loads(line)
        span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        # OTLP/JSON differs from plain protobuf JSON exactly here:
        assert re.fullmatch(r"[0-9a-f]{32}", span["traceId"])
        assert re.fullmatch(r"[0-9a-f]{16}", span["spanId"])
        assert isinstance(span["kind"], int)  # enums as integers
        assert span["startTimeUnixNano"] == str(sdk_span.start_time)  # int64 as strings
        for kv in span.get("attributes", []):
            assert set(kv) == {"key", "value"}
            assert len(kv["value"]) == 1
        # Independently: hex ids -> base64, then protobuf's own parser must
        # give back the SDK encoder's message, field for field.
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in span:
                span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
        parsed = json_format.ParseDict(document, ExportTraceServiceRequest())
        assert parsed == encode_spans([sdk_span])


def test_exporter_writes_no_file_without_spans_and_refuses_after_shutdown(tmp_path):
    exporter = OTLPJsonFileExporter(tmp_path / "never")
    provider = _provider(SimpleSpanProcessor(exporter))
    provider.shutdown()
    assert exporter.path is None
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match="file_prefix"):
        OTLPJsonFileExporter(tmp_path, file_prefix="a/b")


def test_loader_reads_jaeger_api_v3_and_array_forms(tmp_path):
    # Hand-written per the OTLP/JSON spec (as Jaeger's API v3 returns it).
    request = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "vllm"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "flowkv"},
                        "spans": [
                            {
                                "traceId": "5b8efff798038103d269b633813fc60c",
                                "spanId": "eee19b7ec3c1b174",
                                "parentSpanId": "",
                                "name": "flowkv.retrieve",
                                "kind": "SPAN_KIND_INTERNAL",
                                "startTimeUnixNano": "1544712660000000000",
                                "endTimeUnixNano": 1544712661000000000,
                                "attributes": [
                                    {"key": "flowkv.layer", "value": {"intValue": "7"}},
                                    {"key": "flowkv.tier", "value": {"stringValue": "disk"}},
                                ],
                                "status": {"code": 2, "message": "boom"},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    for name, content in {
        "api_v3.json": json.dumps({"result": request}),
        "array.json": json.dumps([request, request]),
        "pretty.json": json.dumps(request, indent=2),
    }.items():
        path = tmp_path / name
        path.write_text(content)
        spans = load_spans(path)
        span = spans[0]
        assert span.parent_span_id is None
        assert span.trace_id == "5b8efff798038103d269b633813fc60c"
        assert span.kind == "internal"
        assert span.attributes == {"flowkv.layer": 7, "flowkv.tier": "disk"}
        assert span.duration_ns == 1_000_000_000
        assert span.status_code == "error"
        assert span.resource == {"service.name": "vllm"}
        assert len(spans) == (2 if name == "array.json" else 1)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty trace file"),
        ('{"resourceSpans": []}\n{"resourceSpans": [', ":2: invalid JSON"),
        ('{"data": [{"traceID": "abc"}]}', "Jaeger's own JSON format"),
        ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "W46/95gDgQPSabYzgT/GDA=="}]}]}]}', "32 hex digits"),
        ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 5}]}]}]}', "not valid OTLP/JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_loader_rejects_bad_files_with_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(TraceFileError, match=re.escape(message)) as caught:
        load_spans(path)
    assert str(caught.value).startswith(str(path))


def test_loader_names_a_missing_file(tmp_path):
    with pytest.raises(TraceFileError, match="no such trace file"):
        load_spans(tmp_path / "missing.json")


def test_file_exporter_keeps_lines_whole_under_concurrent_exports(tmp_path):
    """SimpleSpanProcessor exports on the ending thread: 4 threads write at once."""
    import threading

    exporter = OTLPJsonFileExporter(tmp_path)
    provider = _provider(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("flowkv")

    def worker(number):
        for layer in range(50):
            with tracer.start_as_current_span("gather", attributes={"worker": number, "flowkv.layer": layer}):
                pass

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    provider.shutdown()
    lines = exporter.path.read_text().splitlines()
    assert len(lines) == 200
    assert all(json.loads(line)["resourceSpans"] for line in lines)
    spans = load_spans(exporter.path)
    assert sorted((s.attributes["worker"], s.attributes["flowkv.layer"]) for s in spans) == [
        (n, layer) for n in range(4) for layer in range(50)
    ]
