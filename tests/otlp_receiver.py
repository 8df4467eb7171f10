"""Real OTLP trace receivers for tests: gRPC and HTTP, on loopback.

They speak the OTLP wire protocols (the generated gRPC TraceService; HTTP
POST /v1/traces with protobuf or JSON bodies) and keep every
``ExportTraceServiceRequest`` they get, so a test can point the SDK's
``OTLPSpanExporter`` (or a whole flowkv pipeline with
``[telemetry] exporter = "otlp"``) at ``receiver.endpoint`` and look at
``receiver.spans()``.

Use as pytest fixtures — import them into the test module (or list this
module in ``pytest_plugins`` of a conftest)::

    from otlp_receiver import otlp_grpc_receiver  # noqa: F401  (fixture)

    def test_pipeline_spans(otlp_grpc_receiver):
        ... export to otlp_grpc_receiver.endpoint, then flush the provider ...
        names = [s.name for s in otlp_grpc_receiver.spans()]
"""

from __future__ import annotations

import gzip
import http.server
import json
import threading
import zlib
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from flowkv.otlp_json import SpanRecord, TraceFileError, requests_from_otlp_json, spans_from_request


class _Collected:
    """Requests received so far, shared between server threads and the test."""

    def __init__(self) -> None:
        self._requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._arrived = threading.Condition()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._arrived:
            self._requests.append(request)
            self._arrived.notify_all()

    def requests(self) -> list[trace_service_pb2.ExportTraceServiceRequest]:
        """Every request received, in arrival order."""
        with self._arrived:
            return list(self._requests)

    def spans(self) -> list[SpanRecord]:
        """Every span received, flattened, in arrival order."""
        return [span for request in self.requests() for span in spans_from_request(request)]

    def wait_for_spans(self, count: int, timeout: float = 30.0) -> list[SpanRecord]:
        """Block until at least ``count`` spans arrived.

        For exporters that send from a background thread. The timeout only
        keeps a broken test from hanging; it is not a speed check.
        """

        def enough() -> bool:
            return sum(len(ss.spans) for r in self._requests for rs in r.resource_spans for ss in rs.scope_spans) >= count

        with self._arrived:
            if not self._arrived.wait_for(enough, timeout=timeout):
                raise AssertionError(f"expected {count} spans at the receiver, got {len(self.spans())}")
        return self.spans()

    def clear(self) -> None:
        with self._arrived:
            self._requests.clear()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collected: _Collected) -> None:
        self._collected = collected

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        self._collected.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPGrpcReceiver(_Collected):
    """An OTLP/gRPC trace receiver on 127.0.0.1, on a free port.

    ``endpoint`` is ``"http://127.0.0.1:PORT"``; pass it with
    ``insecure=True`` to ``opentelemetry.exporter.otlp.proto.grpc``'s
    ``OTLPSpanExporter``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        if self.port == 0:
            raise RuntimeError("could not bind an OTLP/gRPC receiver on 127.0.0.1")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> OTLPGrpcReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait()

    def __enter__(self) -> OTLPGrpcReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class OTLPHttpReceiver(_Collected):
    """An OTLP/HTTP trace receiver on 127.0.0.1: POST /v1/traces.

    Accepts ``application/x-protobuf`` and ``application/json`` bodies,
    optionally gzip- or deflate-encoded, as the OTLP/HTTP spec allows.
    ``endpoint`` is the full traces URL (``http://127.0.0.1:PORT/v1/traces``),
    which is what the HTTP ``OTLPSpanExporter(endpoint=...)`` takes.
    """

    def __init__(self) -> None:
        super().__init__()
        collected = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format, *args):  # keep pytest output clean
                pass

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802 (http.server hook name)
                if self.path != "/v1/traces":
                    self._reply(404, b"only /v1/traces is served", "text/plain")
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                content_type = self.headers.get("Content-Type", "").split(";")[0].strip()
                request = trace_service_pb2.ExportTraceServiceRequest()
                try:
                    if content_type == "application/json":
                        (request,) = requests_from_otlp_json(json.loads(body))
                    else:
                        request.ParseFromString(body)
                except (ValueError, TraceFileError) as exc:
                    self._reply(400, str(exc).encode(), "text/plain")
                    return
                collected.add(request)
                response = trace_service_pb2.ExportTraceServiceResponse()
                if content_type == "application/json":
                    self._reply(200, b"{}", "application/json")
                else:
                    self._reply(200, response.SerializeToString(), "application/x-protobuf")

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-http-receiver", daemon=True)

    def start(self) -> OTLPHttpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> OTLPHttpReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def otlp_grpc_receiver():
    """A started ``OTLPGrpcReceiver``; ``.endpoint``, ``.spans()``."""
    with OTLPGrpcReceiver() as receiver:
        yield receiver


@pytest.fixture
def otlp_http_receiver():
    """A started ``OTLPHttpReceiver``; ``.endpoint``, ``.spans()``."""
    with OTLPHttpReceiver() as receiver:
        yield receiver


__all__ = ["OTLPGrpcReceiver", "OTLPHttpReceiver", "otlp_grpc_receiver", "otlp_http_receiver"]
