"""Tracers from a pipeline's ``[telemetry]`` table.

flowkv keeps its own ``TracerProvider`` per telemetry setting instead of the
process-global one, so that it neither fights the inference engine's own
tracing nor depends on who configured OpenTelemetry first. With
``exporter = "none"`` the tracer is OpenTelemetry's no-op tracer and the
runner takes its untraced path.
"""

from __future__ import annotations

import atexit
import logging
import threading

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from flowkv.pipeline_model import TelemetrySpec

log = logging.getLogger(__name__)

_lock = threading.Lock()
_providers: dict[TelemetrySpec, TracerProvider] = {}
_NOOP = trace.NoOpTracer()


def make_exporter(spec: TelemetrySpec) -> SpanExporter:
    """The span exporter ``[telemetry]`` asks for (not called for ``exporter = "none"``)."""
    if spec.exporter == "console":
        return ConsoleSpanExporter()
    if spec.exporter == "file":
        from flowkv.otlp_json import OTLPJsonFileExporter

        return OTLPJsonFileExporter(spec.folder)
    if spec.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = spec.endpoint or "http://localhost:4317"
        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    endpoint = (spec.endpoint or "http://localhost:4318").rstrip("/")
    if not endpoint.endswith("/v1/traces"):
        endpoint += "/v1/traces"
    return HTTPExporter(endpoint=endpoint)


def provider_for(spec: TelemetrySpec) -> TracerProvider | None:
    """The (shared) provider for these settings; None when telemetry is off."""
    if spec.exporter == "none" or spec.sampling <= 0.0:
        return None
    with _lock:
        provider = _providers.get(spec)
        if provider is None:
            provider = TracerProvider(
                resource=Resource.create({"service.name": spec.service_name, **_host_attributes()}),
                sampler=ParentBased(TraceIdRatioBased(spec.sampling)),
            )
            exporter = make_exporter(spec)
            processor = (
                SimpleSpanProcessor(exporter)
                if spec.exporter == "console"
                # A short delay: inference processes are often stopped, not shut down.
                else BatchSpanProcessor(exporter, schedule_delay_millis=200)
            )
            provider.add_span_processor(processor)
            _providers[spec] = provider
        return provider


def _host_attributes() -> dict[str, float]:
    """The machine's copy bandwidth (GB/s, measured once per process), which
    ``flowkv trace summarize`` holds transfer stages against."""
    try:
        from flowkv.kernels import copy_gbps

        return {"flowkv.host.copy_gbps": round(copy_gbps(), 2)}
    except Exception:  # telemetry never breaks the data path
        return {}


def tracer_for(spec: TelemetrySpec) -> trace.Tracer:
    """The tracer for a pipeline's ``[telemetry]``: a no-op one when telemetry is off."""
    provider = provider_for(spec)
    if provider is None:
        return _NOOP
    return provider.get_tracer("flowkv")


def flush(timeout_ms: int = 5000) -> None:
    """Export every finished span now (before a process exits, or a test reads files)."""
    with _lock:
        providers = list(_providers.values())
    for provider in providers:
        try:
            provider.force_flush(timeout_ms)
        except Exception:  # telemetry never breaks the data path
            log.debug("flowkv: flushing traces failed", exc_info=True)


@atexit.register
def _shutdown() -> None:
    with _lock:
        providers = list(_providers.values())
        _providers.clear()
    for provider in providers:
        try:
            provider.shutdown()
        except Exception:
            log.debug("flowkv: shutting down a tracer provider failed", exc_info=True)
