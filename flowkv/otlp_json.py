"""OTLP/JSON trace files: an OpenTelemetry span exporter and a loader.

The files hold the OTLP/JSON encoding of ``ExportTraceServiceRequest`` (the
protobuf JSON mapping with the OTLP twists: trace and span ids as lowercase
hex, enums as integers, 64-bit integers as strings). Each line is one
complete request, i.e. the JSON Lines layout of the OpenTelemetry file
exporter spec::

    {"resourceSpans":[{"resource":{...},"scopeSpans":[{"scope":{...},"spans":[...]}]}]}
    {"resourceSpans":[...]}

One file per process run, named ``<prefix>-<YYYYmmdd-HHMMSS>-<pid>.json``.
The suffix is ``.json`` (not ``.jsonl``) because Jaeger UI's upload dialog
filters on ``.json``; it then reads a multi-line file line by line and
merges the ``resourceSpans`` of every line, so the whole run opens as one
upload (see ``traces/README.md``).

Example, wiring the exporter by hand (``flowkv.telemetry`` does this for
``[telemetry] exporter = "file"``)::

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from flowkv.otlp_json import OTLPJsonFileExporter, load_spans

    exporter = OTLPJsonFileExporter("traces")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    ...
    provider.shutdown()
    spans = load_spans(exporter.path)
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PBSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PBStatus
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = [
    "OTLPJsonFileExporter",
    "SpanEvent",
    "SpanRecord",
    "TraceFileError",
    "load_spans",
    "request_to_otlp_json",
    "requests_from_otlp_json",
    "spans_from_otlp_json",
    "spans_from_request",
]


class TraceFileError(ValueError):
    """A trace file (or OTLP/JSON document) that cannot be read as OTLP traces."""


@attrs.frozen
class SpanEvent:
    """An event recorded on a span (``span.add_event``)."""

    name: str
    time_ns: int
    attributes: dict[str, Any]


@attrs.frozen
class SpanRecord:
    """One finished span, as read back from OTLP (file or wire).

    Ids are lowercase hex strings as in OTLP/JSON; times are Unix epoch
    nanoseconds. Array attribute values are tuples, as the SDK stores them.
    """

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str | None  # None for a root span
    name: str
    kind: str  # "internal", "server", "client", "producer", "consumer", "unspecified"
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: str = "unset"  # "unset", "ok", "error"
    status_message: str = ""
    events: tuple[SpanEvent, ...] = ()
    resource: dict[str, Any] = attrs.field(factory=dict)
    scope: str = ""  # instrumentation scope (tracer) name

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


# --------------------------------------------------------------------------
# Encoding: SDK spans -> OTLP/JSON
# --------------------------------------------------------------------------

# Paths (in MessageToDict's camelCase output) of the bytes fields that OTLP
# writes as hex where plain protobuf JSON would write base64.
_SPAN_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
_LINK_ID_FIELDS = ("traceId", "spanId")


def _recode_ids(request: dict, convert) -> None:
    """Apply ``convert`` to every trace/span id of a request dict, in place.

    Both key spellings are visited: OTLP/JSON writers use lowerCamelCase, and
    the spec asks readers to accept the proto's snake_case names too.
    """

    def spelled(obj: dict, camel: str) -> Iterator[str]:
        snake = _SNAKE[camel]
        return (key for key in (camel, snake) if key in obj)

    for resource_spans in _list(request, "resourceSpans"):
        for scope_spans in _list(resource_spans, "scopeSpans"):
            for span in _list(scope_spans, "spans"):
                for field in _SPAN_ID_FIELDS:
                    for key in spelled(span, field):
                        span[key] = convert(span[key], field)
                for link in _list(span, "links"):
                    for field in _LINK_ID_FIELDS:
                        for key in spelled(link, field):
                            link[key] = convert(link[key], field)


_SNAKE = {
    "traceId": "trace_id",
    "spanId": "span_id",
    "parentSpanId": "parent_span_id",
    "resourceSpans": "resource_spans",
    "scopeSpans": "scope_spans",
    "spans": "spans",
    "links": "links",
}


def _list(obj: Any, camel: str) -> list:
    if not isinstance(obj, dict):
        raise TraceFileError(f"expected a JSON object, got {type(obj).__name__}")
    value = obj.get(camel, obj.get(_SNAKE[camel], []))
    if not isinstance(value, list):
        raise TraceFileError(f"'{camel}' must be a JSON array, got {type(value).__name__}")
    return value


def _base64_to_hex(value: str, _field: str) -> str:
    return base64.b64decode(value).hex()


def request_to_otlp_json(request: ExportTraceServiceRequest) -> dict:
    """The OTLP/JSON form of a request, as a JSON-ready dict."""
    document = json_format.MessageToDict(
        request,
        preserving_proto_field_name=False,  # OTLP/JSON keys are lowerCamelCase
        use_integers_for_enums=True,  # the OTLP/JSON spec requires integer enums
    )
    _recode_ids(document, _base64_to_hex)
    return document


class OTLPJsonFileExporter(SpanExporter):
    """Writes spans to an OTLP/JSON Lines file, one file per process run.

    ``folder`` is created when the first batch arrives (relative paths
    resolve against the working directory at that moment); no batch, no
    file. Every ``export`` call appends one line and flushes it, so a crash
    loses at most the batch in flight. Thread-safe: the SDK's batch
    processor exports from its own thread while ``force_flush`` and
    ``shutdown`` may come from any thread. A forked child writes its own
    file (the name carries the pid).
    """

    def __init__(self, folder: str | os.PathLike[str] = "traces", *, file_prefix: str = "flowkv"):
        if not file_prefix or os.sep in file_prefix or (os.altsep and os.altsep in file_prefix):
            raise ValueError(f"file_prefix must be a plain file-name prefix, got {file_prefix!r}")
        self._folder = Path(folder)
        self._file_prefix = file_prefix
        self._lock = threading.Lock()
        self._file = None
        self._file_pid: int | None = None
        self._path: Path | None = None
        self._shut_down = False

    @property
    def path(self) -> Path | None:
        """The file this process writes, or None before the first export."""
        return self._path

    def _open_for_this_process(self):
        pid = os.getpid()
        if self._file is not None and self._file_pid == pid:
            return self._file
        # After a fork the inherited handle points at the parent's file; the
        # child starts its own (its buffer is empty: every line is flushed).
        self._folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self._folder / f"{self._file_prefix}-{stamp}-{pid}.json"
        self._file = open(path, "a", encoding="utf-8")
        self._file_pid = pid
        self._path = path
        return self._file

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        line = json.dumps(request_to_otlp_json(encode_spans(spans)), separators=(",", ":"))
        with self._lock:
            if self._shut_down:
                return SpanExportResult.FAILURE
            try:
                out = self._open_for_this_process()
                out.write(line + "\n")
                out.flush()
            except OSError:
                # Telemetry must never break the data path; the SDK logs FAILURE.
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if self._file is not None and self._file_pid == os.getpid():
                try:
                    self._file.flush()
                except OSError:
                    return False
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._shut_down = True
            if self._file is not None and self._file_pid == os.getpid():
                self._file.close()
            self._file = None


# --------------------------------------------------------------------------
# Decoding: OTLP (protobuf or JSON) -> SpanRecord
# --------------------------------------------------------------------------

_KIND_NAMES = {
    PBSpan.SPAN_KIND_UNSPECIFIED: "unspecified",
    PBSpan.SPAN_KIND_INTERNAL: "internal",
    PBSpan.SPAN_KIND_SERVER: "server",
    PBSpan.SPAN_KIND_CLIENT: "client",
    PBSpan.SPAN_KIND_PRODUCER: "producer",
    PBSpan.SPAN_KIND_CONSUMER: "consumer",
}
_STATUS_NAMES = {
    PBStatus.STATUS_CODE_UNSET: "unset",
    PBStatus.STATUS_CODE_OK: "ok",
    PBStatus.STATUS_CODE_ERROR: "error",
}


def _any_value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(_any_value(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, which)


def _attributes(key_values) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in key_values}


def spans_from_request(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    """Flatten one OTLP request (as received over gRPC/HTTP) into span records."""
    records = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            for span in scope_spans.spans:
                records.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        name=span.name,
                        kind=_KIND_NAMES.get(span.kind, "unspecified"),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        status_code=_STATUS_NAMES.get(span.status.code, "unset"),
                        status_message=span.status.message,
                        events=tuple(
                            SpanEvent(e.name, e.time_unix_nano, _attributes(e.attributes))
                            for e in span.events
                        ),
                        resource=resource,
                        scope=scope,
                    )
                )
    return records


_ID_HEX_DIGITS = {"traceId": 32, "spanId": 16, "parentSpanId": 16}


def _hex_to_base64(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise TraceFileError(f"{field} must be a hex string, got {type(value).__name__}")
    if value == "":
        return ""  # OTLP/JSON allows an empty parentSpanId for roots
    want = _ID_HEX_DIGITS[field]
    if len(value) != want:
        raise TraceFileError(
            f"{field} {value!r} must be {want} hex digits (OTLP/JSON ids are hex, not base64)"
        )
    try:
        return base64.b64encode(bytes.fromhex(value)).decode("ascii")
    except ValueError:
        raise TraceFileError(f"{field} {value!r} is not hex") from None


def _otlp_documents(document: Any) -> Iterator[dict]:
    """The OTLP trace requests inside one parsed JSON value.

    Accepts a request (``{"resourceSpans": [...]}``), Jaeger's API v3
    envelope (``{"result": {"resourceSpans": [...]}}``), or a list of these.
    """
    if isinstance(document, list):
        for item in document:
            yield from _otlp_documents(item)
        return
    if not isinstance(document, dict):
        raise TraceFileError(f"expected a JSON object with 'resourceSpans', got {type(document).__name__}")
    if "result" in document and "resourceSpans" not in document:
        yield from _otlp_documents(document["result"])
        return
    if "resourceSpans" not in document and "resource_spans" not in document:
        keys = ", ".join(sorted(document)[:5]) or "none"
        hint = " (this looks like Jaeger's own JSON format, not OTLP)" if "data" in document else ""
        raise TraceFileError(f"not an OTLP trace document: no 'resourceSpans' key (keys: {keys}){hint}")
    yield document


def requests_from_otlp_json(document: Any) -> list[ExportTraceServiceRequest]:
    """The protobuf requests in one parsed OTLP/JSON value (see ``_otlp_documents``)."""
    requests = []
    for request_json in _otlp_documents(document):
        request_json = json.loads(json.dumps(request_json))  # private copy to rewrite ids in
        _recode_ids(request_json, _hex_to_base64)
        request = ExportTraceServiceRequest()
        try:
            json_format.ParseDict(request_json, request, ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise TraceFileError(f"not valid OTLP/JSON: {exc}") from None
        requests.append(request)
    return requests


def spans_from_otlp_json(document: Any) -> list[SpanRecord]:
    """Span records from one parsed OTLP/JSON value."""
    return [span for request in requests_from_otlp_json(document) for span in spans_from_request(request)]


def _iter_json_values(text: str) -> Iterable[tuple[int, Any]]:
    """(line number, value): the whole text as one JSON value, else JSON Lines."""
    try:
        yield 1, json.loads(text)
        return
    except json.JSONDecodeError as whole_error:
        if "\n" not in text.strip():
            raise TraceFileError(f"1: invalid JSON: {whole_error.msg} at column {whole_error.colno}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFileError(f"{number}: invalid JSON: {exc.msg} at column {exc.colno}") from None


def load_spans(path: str | os.PathLike[str]) -> list[SpanRecord]:
    """Read every span from an OTLP/JSON trace file.

    Reads what ``OTLPJsonFileExporter`` writes (JSON Lines, one request a
    line), a single OTLP/JSON document, a JSON array of them, and what
    Jaeger's API v3 returns (``{"result": {...}}``, one a line when
    streamed). Errors name the file and line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such trace file") from None
    except UnicodeDecodeError:
        raise TraceFileError(f"{path}: not a text file (OTLP/JSON expected; binary OTLP protobuf is not read)") from None
    if not text.strip():
        raise TraceFileError(f"{path}: empty trace file")
    records: list[SpanRecord] = []
    try:
        for number, value in _iter_json_values(text):
            try:
                records.extend(spans_from_otlp_json(value))
            except TraceFileError as exc:
                raise TraceFileError(f"{number}: {exc}") from None
    except TraceFileError as exc:
        raise TraceFileError(f"{path}:{exc}") from None
    return records
