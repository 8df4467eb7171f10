"""Layerwise runs: one request's store or retrieve, moved layer by layer beside the model's compute.

::

    inference thread                      transfer worker (side CUDA stream on GPU)
    retrieve_layerwise() -- head --+
                                   +--> layer 0 block, layer 1 block, ... (queued at once)
    wait(0) ... compute layer 0
    wait(1) ... compute layer 1          (layer i+1 lands while layer i computes)
    finish() -> ret_mask

A store runs the other way: ``layer_ready(i)`` after the model computed layer
i queues its gather; ``finish()`` runs the tail (compress, put) over the
chunks whose every layer arrived.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING, Any

import torch

from flowkv.items import Chunk, Request, RunContext

if TYPE_CHECKING:
    from flowkv.engine import CacheEngine


class LayerwiseRun:
    """What a layerwise store and retrieve share: the request span, the worker, the device stream."""

    def __init__(self, engine: CacheEngine, request: Request, kind: str) -> None:
        self.engine = engine
        self.request = request
        self.kind = kind
        self.started = time.perf_counter()  # a layerwise call lasts from its start to finish()
        self.num_layers = engine.geometry.num_layers
        self.ctx = RunContext(kind=kind, request=request, engine=engine)
        self.chunks: list[Chunk] = []
        self.futures: dict[int, concurrent.futures.Future[Any]] = {}
        self.finished = False
        self.span = engine.tracer.start_span(f"flowkv.{kind}.layerwise")
        if request.request_id is not None:
            self.span.set_attribute("flowkv.request_id", request.request_id)
        device = request.kv_caches[0].device if request.kv_caches else torch.device("cpu")
        # On CUDA, per-layer copies run on a side stream ordered by events; on CPU the
        # worker thread alone gives the overlap (torch kernels release the GIL).
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.events: dict[int, Any] = {}

    def submit(self, layer: int, ready_event: Any = None) -> None:
        self.futures[layer] = self.engine.layer_worker().submit(self._run_layer, layer, ready_event)

    def _run_layer(self, layer: int, ready_event: Any) -> None:
        ctx = RunContext(kind=self.kind, request=self.request, engine=self.engine, layer=layer)
        runner = self.engine.segments[(self.kind, "layer")]
        if self.stream is None:
            self.engine._run_with(runner, self.chunks, ctx, parent=self.span)
            return
        with torch.cuda.stream(self.stream):
            if ready_event is not None:
                self.stream.wait_event(ready_event)
            self.engine._run_with(runner, self.chunks, ctx, parent=self.span)
            event = torch.cuda.Event()
            event.record(self.stream)
            self.events[layer] = event

    def wait_layer(self, layer: int) -> None:
        future = self.futures.get(layer)
        if future is None:
            return
        with self.engine.tracer.start_as_current_span(
            "flowkv.wait", context=_span_context(self.span), attributes={"flowkv.layer": layer}
        ):
            future.result()
            event = self.events.get(layer)
            if event is not None:
                torch.cuda.current_stream().wait_event(event)

    def complete_prefix(self) -> list[Chunk]:
        """The chunks, in order, up to the first one missing a layer."""
        done = []
        for chunk in self.chunks:
            if chunk.layers_done < self.num_layers:
                request = self.request
                request.failed_range = request.failed_range or (
                    chunk.start, max(request.hit_tokens or 0, self.chunks[-1].end))
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

    def __init__(self, engine: CacheEngine, request: Request) -> None:
        super().__init__(engine, request, "retrieve")

    def start(self) -> None:
        engine = self.engine
        if not engine.is_healthy():
            engine.count("skipped_unhealthy")
            return
        items = engine._run_with(engine.segments[("retrieve", "head")], [self.request], self.ctx,
                                 parent=self.span)
        self.chunks = [c for c in items if isinstance(c, Chunk) and not c.skip]
        if not self.chunks:  # nothing to load: wait() has no layer to wait for
            return
        for layer in range(self.num_layers):
            self.submit(layer)

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s KV is in the paged cache (call before the model reads it)."""
        self.wait_layer(layer)

    def finish(self) -> torch.Tensor:
        """Wait for every layer; the ret_mask of chunks whose layers all landed."""
        if not self.finished:
            self.close()
            for chunk in self.complete_prefix():
                self.request.ret_mask[chunk.start:chunk.end] = True
            if self.request.lookup_id is not None:
                self.engine.release(self.request.lookup_id)
            self.engine._retrieved(self.request)
            self.engine._observe("retrieve", self.started)
        return self.request.ret_mask


class LayerwiseStore(LayerwiseRun):
    """One request's store, copying each layer out once the model computed it."""

    def __init__(self, engine: CacheEngine, request: Request) -> None:
        super().__init__(engine, request, "store")
        self.head_done = False  # the head (find and allocate the chunks) runs at the first layer_ready
        self.skipped = not engine.is_healthy()

    def layer_ready(self, layer: int) -> None:
        """``layer``'s KV for this request is computed: queue its copy out."""
        engine = self.engine
        if self.skipped:
            return
        if not self.head_done:
            self.head_done = True
            items = engine._run_with(engine.segments[("store", "head")], [self.request], self.ctx,
                                     parent=self.span)
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
            self.engine.count("skipped_unhealthy")
            self.close()
            return 0
        self.settle()
        complete = self.complete_prefix()
        items = self.engine._run_with(self.engine.segments[("store", "tail")], complete, self.ctx,
                                      parent=self.span) if complete else []
        self.close()
        stored = sum(c.num_tokens for c in items if isinstance(c, Chunk))
        self.engine._stored(stored)
        self.engine._observe("store", self.started)
        return stored

    def abort(self) -> None:
        """Drop this store (the request went away): free what it allocated."""
        if not self.finished:
            self.close()


def _span_context(span: Any) -> Any:
    from opentelemetry import trace

    return trace.set_span_in_context(span)
