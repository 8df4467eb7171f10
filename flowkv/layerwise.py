"""Layerwise runs: one request's store or retrieve, moved layer by layer beside the model's compute.

::

    inference thread                      transfer worker (side CUDA stream on GPU)
    retrieve_layerwise() -- head --+
                                   +--> layer 0 block, layer 1 block, ... (queued at once)
    wait(0) ... compute layer 0
    wait(1) ... compute layer 1          (layer i+1 lands while layer i computes)
    finish() -> ret_mask                  (handle.result: the RetrieveResult)

A store runs the other way: ``layer_ready(i)`` after the model computed layer
i queues its gather; ``finish()`` runs the tail (compress, put) over the
chunks whose every layer arrived.

The handles drive an executor (``flowkv.executor.Executor``) through its
public methods only: ``context``, ``run`` (one part of a list), ``submit_layer``
and ``finish_store`` / ``finish_retrieve``. A chunk counts only when every
layer moved: ``complete_prefix`` is that rule, and the first chunk it stops
at is where ``Request.fail_from`` cuts the load.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from flowkv.calls import StoreResult
from flowkv.items import Chunk, Request, RunContext


class SegmentExecutor(Protocol):
    """What a layerwise handle needs of the executor that made it."""

    tracer: Any
    num_layers: int

    def context(self, kind: str, request: Request | None, layer: int | None = None) -> RunContext: ...

    def run(self, kind: str, source: list[Any], ctx: RunContext, *, part: str = "all",
            parent: Any = None) -> list[Any]: ...

    def submit_layer(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]: ...

    def healthy(self) -> bool: ...

    def skipped(self) -> None: ...

    def finish_store(self, stored: int, started: float) -> Any: ...

    def finish_retrieve(self, request: Request, started: float) -> Any: ...


class LayerwiseRun:
    """What a layerwise store and retrieve share: the request span, the worker, the device stream."""

    def __init__(self, executor: SegmentExecutor, request: Request, kind: str) -> None:
        self.executor = executor
        self.request = request
        self.kind = kind
        self.started = time.perf_counter()  # a layerwise call lasts from its start to finish()
        self.num_layers = executor.num_layers
        self.ctx = executor.context(kind, request)
        self.chunks: list[Chunk] = []
        self.futures: dict[int, concurrent.futures.Future[Any]] = {}
        self.finished = False
        self.result: Any = None  # the StoreResult / RetrieveResult, once finished
        self.span = executor.tracer.start_span(f"flowkv.{kind}.layerwise")
        if request.request_id is not None:
            self.span.set_attribute("flowkv.request_id", request.request_id)
        device = request.kv_caches[0].device if request.kv_caches else torch.device("cpu")
        # On CUDA, per-layer copies run on a side stream ordered by events; on CPU the
        # worker thread alone gives the overlap (torch kernels release the GIL).
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        # Written by the layer worker before its future completes, read after waiting on it.
        self.events: dict[int, Any] = {}

    def run_part(self, part: str, source: list[Any]) -> list[Any]:
        """Run the head or tail of the list, once, under this call's span."""
        return self.executor.run(self.kind, source, self.ctx, part=part, parent=self.span)

    def submit(self, layer: int, ready_event: Any = None) -> None:
        self.futures[layer] = self.executor.submit_layer(self._run_layer, layer, ready_event)

    def _run_layer(self, layer: int, ready_event: Any) -> None:
        executor = self.executor
        ctx = executor.context(self.kind, self.request, layer)
        if self.stream is None:
            executor.run(self.kind, self.chunks, ctx, part="layer", parent=self.span)
            return
        with torch.cuda.stream(self.stream):
            if ready_event is not None:
                self.stream.wait_event(ready_event)
            executor.run(self.kind, self.chunks, ctx, part="layer", parent=self.span)
            event = torch.cuda.Event()
            event.record(self.stream)
            self.events[layer] = event

    def wait_layer(self, layer: int) -> None:
        future = self.futures.get(layer)
        if future is None:
            return
        with self.executor.tracer.start_as_current_span(
            "flowkv.wait", context=_span_context(self.span), attributes={"flowkv.layer": layer}
        ):
            future.result()
            event = self.events.get(layer)
            if event is not None:
                torch.cuda.current_stream().wait_event(event)

    def complete_prefix(self) -> list[Chunk]:
        """The chunks, in order, up to the first one missing a layer (which fails the request there)."""
        done = []
        for chunk in self.chunks:
            if chunk.layers_done < self.num_layers:
                self.request.fail_from(chunk)
                break
            done.append(chunk)
        return done

    def settle(self) -> None:
        """Wait until every queued layer block ran and its copies are done."""
        for future in self.futures.values():
            try:
                future.result()
            except Exception:  # a failed layer is already counted; finish what can be finished
                pass
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        self.settle()
        self.ctx.run_deferred()
        self.span.end()
        self.finished = True


class LayerwiseRetrieve(LayerwiseRun):
    """One request's retrieve, landing layer by layer."""

    def __init__(self, executor: SegmentExecutor, request: Request) -> None:
        super().__init__(executor, request, "retrieve")

    def start(self) -> None:
        if not self.executor.healthy():
            self.executor.skipped()
            return
        items = self.run_part("head", [self.request])
        self.chunks = [c for c in items if isinstance(c, Chunk) and not c.skip]
        if not self.chunks:  # nothing to load: wait() has no layer to wait for
            return
        for layer in range(self.num_layers):
            self.submit(layer)

    @property
    def found_to(self) -> int:
        """Where the load ends if every layer lands: the end of the chunks the head found."""
        return self.chunks[-1].end if self.chunks else self.request.masked

    def found_within(self, start: int, end: int) -> int:
        """``found_to`` within a load of tokens ``[start, end)``."""
        return min(max(self.found_to, start), end)

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s KV is in the paged cache (call before the model reads it)."""
        self.wait_layer(layer)

    def finish(self) -> torch.Tensor:
        """Wait for every layer; the ret_mask of chunks whose layers all landed (``result``: all of it)."""
        if not self.finished:
            self.close()
            for chunk in self.complete_prefix():
                self.request.ret_mask[chunk.start:chunk.end] = True
            self.result = self.executor.finish_retrieve(self.request, self.started)
        return self.request.ret_mask


class LayerwiseStore(LayerwiseRun):
    """One request's store, copying each layer out once the model computed it."""

    def __init__(self, executor: SegmentExecutor, request: Request) -> None:
        super().__init__(executor, request, "store")
        self.head_done = False  # the head (find and allocate the chunks) runs at the first layer_ready
        self.skipped = not executor.healthy()

    def layer_ready(self, layer: int) -> None:
        """``layer``'s KV for this request is computed: queue its copy out."""
        if self.skipped:
            return
        if not self.head_done:
            self.head_done = True
            items = self.run_part("head", [self.request])
            self.chunks = [c for c in items if isinstance(c, Chunk)]
        if not self.chunks:  # nothing new to store: no per-layer runs, spans or events
            return
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.stream.device))
        self.submit(layer, ready)

    def finish(self) -> int:
        """Wait for the copies, then store the chunks whose layers all arrived; tokens stored."""
        if self.finished:
            return 0
        if self.skipped:
            self.executor.skipped()
            self.close()
            self.result = StoreResult(0)
            return 0
        self.settle()
        complete = self.complete_prefix()
        items = self.run_part("tail", complete) if complete else []
        self.close()
        self.result = self.executor.finish_store(sum(c.num_tokens for c in items if isinstance(c, Chunk)),
                                                 self.started)
        return self.result.stored_tokens

    def abort(self) -> None:
        """Drop this store (the request went away): free what it allocated."""
        if not self.finished:
            self.close()


def _span_context(span: Any) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)
