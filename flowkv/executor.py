"""The executor: runs a pipeline's stage lists for the engine, whole or layer by layer.

::

    lookup / store / retrieve       -> one Runner over the kind's stage list
    store_layerwise / retrieve_...  -> head (once) | per-layer block (each layer,
                                       on the layer worker) | tail (once)
    decode_promotion                -> the retrieve list's decode stages ("flowkv.promote"),
                                       over a byte-tier hit the storage manager promotes

It owns the runners and layerwise segments, the layer worker thread, and the
accounting (counters, latencies, the failed-run health window: one object,
one lock, shared by the inference thread, the layer worker and the tier I/O
thread). Every call answers a result object (``StoreResult``,
``RetrieveResult``); nothing of one call is left on shared attributes.

Failure policy: a caller's mistake (a mask that is not a chunk-aligned
prefix, a slot mapping of the wrong length) raises ``ValueError``; anything
that goes wrong inside a run is logged and counted, and the call answers what
it safely can (0 hits, 0 stored, the mask of what was loaded).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from flowkv.accounting import Accounting
from flowkv.calls import KVTransfer, LookupResult, RetrieveResult, StoreResult, as_tokens
from flowkv.items import Chunk, Request, RunContext, Services
from flowkv.layerwise import LayerwiseRetrieve, LayerwiseStore
from flowkv.pipeline import Pipeline
from flowkv.registry import Facet, Role
from flowkv.runner import Runner, StageError
from flowkv.tenants import TENANT_TAG
from flowkv.tiers.base import Entry, TierObject

__all__ = ["Executor"]

_PARTS = ("head", "layer", "tail")


class Executor:
    """Runs ``pipeline``'s lists with ``services`` handed to every stage."""

    def __init__(self, pipeline: Pipeline, services: Services, *, accounting: Accounting, tracer: Any) -> None:
        self.services = services
        self.accounting = accounting
        self.tracer = tracer
        self.pipeline_name = pipeline.name
        self.num_layers = services.geometry.num_layers
        self.layerwise = pipeline.layerwise.enabled
        self._runners: dict[tuple[str, str], Runner] = {}
        for kind in ("store", "retrieve", "lookup"):
            self._runners[(kind, "all")] = self._runner(pipeline, kind, pipeline.stages(kind))
        if self.layerwise:
            for kind in ("store", "retrieve"):
                specs = pipeline.stages(kind)
                per_layer = [i for i, s in enumerate(specs) if s.info.per_layer]
                first, last = per_layer[0], per_layer[-1] + 1
                for part, chosen in zip(_PARTS, (specs[:first], specs[first:last], specs[last:])):
                    self._runners[(kind, part)] = self._runner(pipeline, kind, chosen)
        #: the retrieve list's decode stages (codecs that give KV), which promotions run too
        self.decoders = tuple(s for s in pipeline.retrieve if s.info.role is Role.CODEC and Facet.KV in s.info.gives)
        self._runners[("promote", "all")] = self._runner(pipeline, "promote", self.decoders)
        self._lock = threading.Lock()  # guards the layer worker's creation and shutdown
        self._layer_worker: concurrent.futures.ThreadPoolExecutor | None = None

    def _runner(self, pipeline: Pipeline, kind: str, specs: Any) -> Runner:
        return Runner(specs, kind=kind, pipeline=pipeline.name, tracer=self.tracer)

    # -- running stage lists ----------------------------------------------------

    def context(self, kind: str, request: Request | None, layer: int | None = None) -> RunContext:
        """A run's context: what its stages see as ``ctx``."""
        return RunContext(kind=kind, request=request, services=self.services, layer=layer)

    def run(self, kind: str, source: list[Any], ctx: RunContext, *, part: str = "all", parent: Any = None) -> list[Any]:
        """Run ``kind``'s stage list (or one layerwise ``part``: head, layer, tail) over ``source``.

        A failed run is counted (and, repeated, makes the engine unhealthy for
        a while) and answers no items. ``ctx``'s deferred callbacks are the
        caller's to run.
        """
        request = ctx.request
        attributes = {"request_id": request.request_id if request else None, "layer": ctx.layer}
        try:
            items = self._runners[(kind, part)].run(source, ctx, attributes=attributes, parent=parent)
        except StageError as exc:
            self.accounting.run_failed(ctx.kind, exc)
            return []
        self.accounting.run_succeeded()
        return items

    def _run_whole(self, kind: str, request: Request) -> list[Any]:
        ctx = self.context(kind, request)
        try:
            return self.run(kind, [request], ctx)
        finally:
            ctx.run_deferred()

    def decode_promotion(self, entry: Entry, payload: Any, room: TierObject) -> bool:
        """Decode a byte-tier hit being promoted into ``room`` (a memory object of its shape) through
        the pipeline's own decode stages: one run, ``flowkv.promote``, a span per stage. Whether the
        room now holds its KV (a corrupt payload: the decode stage counted and refused it)."""
        tokens = entry.shape[2]  # a chunk's shape: (layers, kv, tokens, heads, head_size)
        request = Request(tokens=None, length=tokens, tags={TENANT_TAG: entry.tenant})
        chunk = Chunk(request, 0, 0, tokens, key_str=entry.key, obj=room, payload=payload, tier=entry.tier)
        ctx = self.context("promote", request)
        try:
            self.run("promote", [chunk], ctx)
        finally:
            ctx.run_deferred()
        kv, target = chunk.kv, room.tensor
        if kv is None:
            return False
        if kv.data_ptr() != target.data_ptr():  # a decode stage that made a tensor of its own
            if tuple(kv.shape) != tuple(target.shape) or kv.dtype != target.dtype:
                return False
            target.copy_(kv)
        return True

    def submit_layer(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)`` on the one thread that runs per-layer blocks in order."""
        with self._lock:
            if self._layer_worker is None:
                self._layer_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flowkv-layers")
            worker = self._layer_worker
        return worker.submit(fn, *args)

    def healthy(self) -> bool:
        return self.accounting.healthy()

    def skipped(self) -> None:
        """A call not made because the engine is unhealthy."""
        self.accounting.count("skipped_unhealthy")

    # -- the calls --------------------------------------------------------------

    def lookup(self, tokens: Any, *, pin: bool = False, tags: Mapping[str, str] | None = None,
               lookup_id: Any = None, request_id: str | None = None,
               chunk_hashes: Sequence[bytes] | None = None, num_tokens: int | None = None,
               counted: tuple[int, int] | None = None, prefetch: bool | None = None,
               count: bool = True) -> LookupResult:
        """Whole chunks the tiers hold, contiguous from token 0, and which of them memory holds.

        Given ``chunk_hashes`` (and ``num_tokens``) instead of ``tokens``, the
        chunks are keyed by those hashes and the request carries no tokens
        (the stages that read tokens say they do not accept hashes).
        ``counted`` is (tokens, hit tokens) that earlier lookups of the same
        request counted: this one is then a repeat, and counts only what they
        did not. ``prefetch`` overrides the lookup stage's option of that name.
        Without ``count`` (not an inference engine's lookup: a check before a
        load, a controller's command) the engine counts nothing of it, and it
        runs whatever the engine's health.
        """
        if count and not self.healthy():
            self.skipped()
            return LookupResult(0, 0)
        if pin and lookup_id is None:
            raise ValueError("lookup(pin=True) needs a lookup_id to release the pins by")
        if tokens is None and (chunk_hashes is None or num_tokens is None):
            raise ValueError("lookup needs tokens, or chunk_hashes and num_tokens")
        request = Request(tokens=None if tokens is None else as_tokens(tokens),
                          length=num_tokens if tokens is None else None, tags=dict(tags or {}),
                          lookup_id=lookup_id, pin=pin, prefetch=prefetch, request_id=request_id,
                          chunk_hashes=chunk_hashes)
        started = time.perf_counter()
        self.services.storage.expire_pins()
        self._run_whole("lookup", request)
        hit = request.hit_tokens or 0
        if count:
            self.accounting.observe("lookup", started)
            count = self.accounting.count
            counted_tokens, counted_hits = counted or (0, 0)
            count("lookup_repeats" if counted_tokens else "lookups")
            count("lookup_requested_tokens", max(0, request.num_tokens - counted_tokens))
            count("lookup_hit_tokens", max(0, hit - counted_hits))
        return LookupResult(hit, min(request.memory_tokens, hit), request.lookup_chunks, request.hit_chunks)

    def _request(self, transfer: KVTransfer) -> Request:
        request = transfer.request(self.services.chunk_size)
        # Store and retrieve expire pins too: a scheduler that stopped calling
        # lookup must not leave a full arena pinned against every later store.
        self.services.storage.expire_pins()
        return request

    def store(self, transfer: KVTransfer) -> StoreResult:
        if not self.healthy():
            self.skipped()
            return StoreResult(0)
        if self.layerwise:
            handle = self.start_store(transfer)
            return self._every_layer(handle, handle.layer_ready)
        started = time.perf_counter()
        request = self._request(transfer)
        items = self._run_whole("store", request)
        return self.finish_store(sum(c.num_tokens for c in items if isinstance(c, Chunk)), started)

    def retrieve(self, transfer: KVTransfer) -> RetrieveResult:
        if self.layerwise:
            handle = self.start_retrieve(transfer)
            return self._every_layer(handle, handle.wait)
        started = time.perf_counter()
        request = self._request(transfer)
        request.ret_mask = torch.zeros(request.num_tokens, dtype=torch.bool)
        try:
            if not self.healthy():
                self.skipped()
                return RetrieveResult.of(request)
            self._run_whole("retrieve", request)
        finally:
            if request.lookup_id is not None:
                self.services.storage.release(request.lookup_id)
        return self._account_retrieve(request, started)

    def start_retrieve(self, transfer: KVTransfer) -> LayerwiseRetrieve:
        self._require_layerwise()
        request = self._request(transfer)
        request.ret_mask = torch.zeros(request.num_tokens, dtype=torch.bool)
        handle = LayerwiseRetrieve(self, request)
        handle.start()
        return handle

    def start_store(self, transfer: KVTransfer) -> LayerwiseStore:
        self._require_layerwise()
        return LayerwiseStore(self, self._request(transfer))

    def _every_layer(self, handle: Any, step: Callable[[int], None]) -> Any:
        """A whole-request call on a layerwise pipeline: every layer at once, then finish."""
        for layer in range(self.num_layers):
            step(layer)
        handle.finish()
        return handle.result

    def _require_layerwise(self) -> None:
        if not self.layerwise:
            raise ValueError(f"pipeline '{self.pipeline_name}' is not layerwise: set [layerwise] enabled = true")

    # -- the end of a call (layerwise handles end theirs here too) --------------

    def finish_store(self, stored: int, started: float) -> StoreResult:
        """Account for a store that began at ``started`` and stored ``stored`` tokens."""
        self.accounting.count("stores")
        self.accounting.count("stored_tokens", stored)
        self.accounting.observe("store", started)
        return StoreResult(stored)

    def finish_retrieve(self, request: Request, started: float) -> RetrieveResult:
        """Release the lookup's pins and account for a retrieve that began at ``started``."""
        if request.lookup_id is not None:
            self.services.storage.release(request.lookup_id)
        return self._account_retrieve(request, started)

    def _account_retrieve(self, request: Request, started: float) -> RetrieveResult:
        result = RetrieveResult.of(request)
        self.accounting.count("retrieves")
        self.accounting.count("retrieved_tokens", result.loaded_tokens)
        if result.failed_range is not None:
            self.accounting.count("retrieve_short")
        self.accounting.observe("retrieve", started)
        return result

    def close(self) -> None:
        with self._lock:
            worker, self._layer_worker = self._layer_worker, None
        if worker is not None:
            worker.shutdown(wait=True)
