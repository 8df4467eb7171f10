"""One engine step as one trace: a ``flowkv.step`` span with one ``flowkv.request`` span per request.

Every run flowkv makes for a request in the step (its retrieve and store,
their stages, layers and waits) nests under that request's span, so a trace
viewer shows a step as one tree. Attributes: ``flowkv.step.index``,
``.loads``, ``.saves``, ``.requests`` and ``flowkv.layerwise`` on the step;
``flowkv.request_id``, ``flowkv.load.start`` / ``flowkv.load.end``,
``flowkv.hit_tokens`` (loaded) and ``flowkv.stored_tokens`` on a request.
"""

from __future__ import annotations

import logging
from typing import Any

from flowkv.integration.vllm.metadata import FlowKVMetadata

logger = logging.getLogger("flowkv.integration")

__all__ = ["StepTrace"]


class StepTrace:
    """One engine step's spans: a ``flowkv.step`` root and one ``flowkv.request`` per request under it.

    Telemetry never breaks the data path: span failures are swallowed.
    """

    def __init__(self, tracer: Any, index: int, meta: FlowKVMetadata, *, layerwise: bool) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = tracer
        self._requests: dict[str, Any] = {}
        self.span = tracer.start_span("flowkv.step", attributes={
            "flowkv.step.index": index,
            "flowkv.step.loads": len(meta.loads),
            "flowkv.step.saves": len(meta.saves),
            "flowkv.step.requests": len({spec.req_id for spec in (*meta.loads, *meta.saves)}),
            "flowkv.layerwise": layerwise,
        })

    def request(self, req_id: str) -> Any:
        span = self._requests.get(req_id)
        if span is None:
            span = self._tracer.start_span(
                "flowkv.request", context=self._trace.set_span_in_context(self.span),
                attributes={"flowkv.request_id": req_id},
            )
            self._requests[req_id] = span
        return span

    def active(self, req_id: str) -> Any:
        """A context in which flowkv's runs for ``req_id`` nest under its request span."""
        return self._trace.use_span(self.request(req_id), end_on_exit=False)

    def annotate(self, req_id: str, attributes: dict[str, Any]) -> None:
        try:
            self.request(req_id).set_attributes(attributes)
        except Exception:
            logger.debug("flowkv: annotating the step trace failed", exc_info=True)

    def end(self) -> None:
        try:
            for span in self._requests.values():
                span.end()
            self.span.end()
        except Exception:
            logger.debug("flowkv: ending the step trace failed", exc_info=True)
