"""The cache engine: lookup, store and retrieve, each run as its pipeline's stage list.

::

    lookup(tokens)              -> hit tokens    [tokenize, chunk-hash, lookup]
    store(tokens, kv, slots)    -> stored tokens [tokenize, chunk-hash, allocate, gather, compress, put]
    retrieve(tokens, kv, slots) -> ret_mask      [tokenize, chunk-hash, lookup, get, decompress, scatter]

The engine owns what stages share — the KV geometry, the key prefix, the
memory tier, the slower tiers behind their health guards and write-behind
queues — and hands itself to stages as ``ctx.engine``. Nothing here moves
data on its own: every path is the pipeline file's stage list.

Failure policy: a caller's mistake (a mask that is not a chunk-aligned
prefix, a slot mapping of the wrong length) raises ``ValueError``; anything
that goes wrong inside a run is logged and counted, and the call answers
what it safely can (0 hits, 0 stored, the mask of what was loaded).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import xxhash

from flowkv import payload as payloads
from flowkv import telemetry
from flowkv.items import Chunk, Request, RunContext
from flowkv.keys import (
    CacheKey,
    KeyPrefix,
    chain_hashes,
    chain_span_hashes,
    default_hash_function_name,
    get_hash_function,
)
from flowkv.kernels import KVGeometry
from flowkv.layerwise import LayerwiseRetrieve, LayerwiseStore
from flowkv.memory import MemoryArena, MemoryObj, MemoryTier
from flowkv.pipeline import Pipeline, load_pipeline
from flowkv.runner import Runner, StageError

log = logging.getLogger("flowkv.engine")

# Room above one raw chunk in the largest memory object: an encoded payload's header,
# and the few bytes a lossless codec can add to incompressible data.
_SLAB_MARGIN = 4096
# After this many failed runs in a row the engine reports unhealthy for a while.
_FAILURES_BEFORE_UNHEALTHY = 3
_UNHEALTHY_FOR_S = 5.0


class CacheEngine:
    """KV-cache storage for one model on one worker, driven by a pipeline file."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        geometry: KVGeometry,
        model_name: str,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        self.pipeline = pipeline
        self.geometry = geometry
        self.model_name = model_name
        self.world_size = world_size
        self.rank = rank
        self.chunk_size = pipeline.chunk_size
        self.save_partial_chunks = pipeline.section.save_partial_chunks
        self.pin_timeout_s = pipeline.section.pin_timeout_s
        hash_name = pipeline.section.hash
        self.hash_fn = get_hash_function(default_hash_function_name() if hash_name == "auto" else hash_name)
        self._counters: collections.Counter[str] = collections.Counter()  # counts, and *_ms totals
        self._latencies: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._prefixes: dict[tuple[tuple[str, str], ...], KeyPrefix] = {}
        self._key_cache: collections.OrderedDict[tuple[Any, ...], list[CacheKey]] = collections.OrderedDict()
        self._prefetching: dict[str, concurrent.futures.Future[Any]] = {}
        self._prefetch_owner: dict[Any, list[str]] = {}
        self._failures = 0
        self._unhealthy_until = 0.0
        self._closed = False
        # Tokens the last retrieve was promised but could not load (None: it loaded all it found).
        self.last_failed_range: tuple[int, int] | None = None

        self.tier_names = list(pipeline.tiers)
        memory_specs = [t for t in pipeline.tiers.values() if t.kind == "memory"]
        if len(memory_specs) != 1:
            raise ValueError(
                f"pipeline '{pipeline.name}' ({pipeline.source}) must declare exactly one tier of "
                f"kind 'memory' (it declares {len(memory_specs)}): store stages its chunks there"
            )
        spec = memory_specs[0]
        self.memory_name = spec.name
        chunk_bytes = self.geometry.token_bytes * self.chunk_size
        self.memory = MemoryTier(
            MemoryArena(
                spec.config.capacity,
                slab_bytes=chunk_bytes + _SLAB_MARGIN,
                pin_memory=spec.config.pin_memory,
                prefault=spec.config.prefault,
            )
        )
        self.slow: dict[str, Any] = {}
        self._write_behind: dict[str, WriteBehind] = {}
        for name, tier_spec in pipeline.tiers.items():
            if tier_spec.kind == "memory":
                continue
            from flowkv.tiers import GuardedTier
            from flowkv.tiers.writebehind import WriteBehind

            config = tier_spec.config
            if world_size > 1 and isinstance(getattr(config, "path", None), str):
                # One process per folder: each tensor-parallel rank keeps its own.
                config = attrs.evolve(config, path=str(Path(config.path).expanduser() / f"rank{rank}"))
            backend = tier_spec.info.cls(name=name, config=config)
            guarded = GuardedTier(
                backend,
                timeout_s=tier_spec.guard.timeout_s,
                backoff_initial_s=min(1.0, tier_spec.guard.backoff_max_s),
                backoff_max_s=tier_spec.guard.backoff_max_s,
            )
            self.slow[name] = guarded
            self._write_behind[name] = WriteBehind(guarded, tier_spec.guard.write_queue)
        self._tier_timeout_s = {n: s.guard.timeout_s for n, s in pipeline.tiers.items()}

        self.tracer = telemetry.tracer_for(pipeline.telemetry)
        self.runners = {
            kind: Runner(pipeline.stages(kind), kind=kind, pipeline=pipeline.name, tracer=self.tracer)
            for kind in ("store", "retrieve", "lookup")
        }
        self.layerwise = pipeline.layerwise.enabled
        # Layerwise: each list splits into head (once), per-layer block, tail (once).
        self.segments: dict[tuple[str, str], Runner] = {}
        if self.layerwise:
            for kind in ("store", "retrieve"):
                specs = pipeline.stages(kind)
                per_layer = [i for i, s in enumerate(specs) if s.info.per_layer]
                first, last = per_layer[0], per_layer[-1] + 1
                for part, chosen in (("head", specs[:first]), ("layer", specs[first:last]),
                                     ("tail", specs[last:])):
                    self.segments[(kind, part)] = Runner(chosen, kind=kind, pipeline=pipeline.name,
                                                         tracer=self.tracer)
        self._layer_worker: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def from_pipeline(
        cls,
        pipeline: str | Path | Pipeline,
        *,
        geometry: KVGeometry,
        model_name: str,
        world_size: int = 1,
        rank: int = 0,
        overrides: Mapping[str, Any] | None = None,
    ) -> CacheEngine:
        """An engine for a pipeline given by built-in name, path or loaded ``Pipeline``."""
        if not isinstance(pipeline, Pipeline):
            pipeline = load_pipeline(pipeline, overrides=overrides)
        return cls(pipeline, geometry=geometry, model_name=model_name, world_size=world_size, rank=rank)

    # -- the API ----------------------------------------------------------

    def lookup(
        self,
        tokens: Any,
        *,
        pin: bool = False,
        tags: Mapping[str, str] | None = None,
        lookup_id: Any = None,
        request_id: str | None = None,
    ) -> int:
        """How many leading tokens the tiers can serve (whole chunks, contiguous from 0).

        Reads no payload. With ``pin``, memory hits are kept from eviction for
        ``lookup_id`` until ``retrieve(lookup_id=...)``, ``release`` or the pin timeout.
        """
        if not self.is_healthy():
            self.count("skipped_unhealthy")
            return 0
        if pin and lookup_id is None:
            raise ValueError("lookup(pin=True) needs a lookup_id to release the pins by")
        started = time.perf_counter()
        self.memory.expire_pins()
        request = Request(tokens=_as_tokens(tokens), tags=dict(tags or {}), lookup_id=lookup_id,
                          pin=pin, request_id=request_id)
        self._run("lookup", request)
        self._observe("lookup", started)
        hit = request.hit_tokens or 0
        self.count("lookups")
        self.count("lookup_requested_tokens", request.num_tokens)
        self.count("lookup_hit_tokens", hit)
        return hit

    def store(
        self,
        tokens: Any,
        *,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        tags: Mapping[str, str] | None = None,
        request_id: str | None = None,
    ) -> int:
        """Store the KV of ``tokens`` (read from ``kv_caches`` at ``slot_mapping``); tokens stored.

        Chunks under ``mask`` (True = already stored) and chunks already held
        are skipped; when memory runs out the run stops, keeping the prefix it
        stored.
        """
        if not self.is_healthy():
            self.count("skipped_unhealthy")
            return 0
        if self.layerwise:
            handle = self.store_layerwise(tokens, kv_caches=kv_caches, slot_mapping=slot_mapping,
                                          mask=mask, tags=tags, request_id=request_id)
            for layer in range(self.geometry.num_layers):
                handle.layer_ready(layer)
            return handle.finish()
        started = time.perf_counter()
        request = self._request(tokens, kv_caches, slot_mapping, mask, tags, request_id)
        items = self._run("store", request)
        stored = sum(c.num_tokens for c in items if isinstance(c, Chunk))
        self._stored(stored)
        self._observe("store", started)
        return stored

    def _stored(self, tokens: int) -> None:
        self.count("stores")
        self.count("stored_tokens", tokens)

    def retrieve(
        self,
        tokens: Any,
        *,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        tags: Mapping[str, str] | None = None,
        lookup_id: Any = None,
        request_id: str | None = None,
    ) -> torch.Tensor:
        """Load what the tiers hold of ``tokens`` into ``kv_caches``; True where loaded.

        The mask is the longest good prefix: a chunk gone since lookup ends it,
        and ``last_failed_range`` then says which tokens were promised but not
        loaded. Pins of ``lookup_id`` are released.
        """
        self.last_failed_range = None
        if self.layerwise:
            handle = self.retrieve_layerwise(tokens, kv_caches=kv_caches, slot_mapping=slot_mapping,
                                             mask=mask, tags=tags, lookup_id=lookup_id, request_id=request_id)
            for layer in range(self.geometry.num_layers):
                handle.wait(layer)
            return handle.finish()
        started = time.perf_counter()
        request = self._request(tokens, kv_caches, slot_mapping, mask, tags, request_id)
        request.lookup_id = lookup_id
        request.ret_mask = torch.zeros(request.num_tokens, dtype=torch.bool)
        try:
            if not self.is_healthy():
                self.count("skipped_unhealthy")
                return request.ret_mask
            self._run("retrieve", request)
        finally:
            if lookup_id is not None:
                self.release(lookup_id)
        self._retrieved(request)
        self._observe("retrieve", started)
        return request.ret_mask

    def _retrieved(self, request: Request) -> None:
        self.last_failed_range = request.failed_range
        self.count("retrieves")
        self.count("retrieved_tokens", int(request.ret_mask.sum()))
        if request.failed_range is not None:
            self.count("retrieve_short")

    def retrieve_layerwise(
        self,
        tokens: Any,
        *,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        tags: Mapping[str, str] | None = None,
        lookup_id: Any = None,
        request_id: str | None = None,
    ) -> LayerwiseRetrieve:
        """Start a retrieve whose layers land one by one, overlapping the model's compute.

        The head of the retrieve list (find and read the chunks) runs now; each
        layer's block (scatter) is queued on the transfer worker (a side CUDA
        stream on GPU). Call ``wait(layer)`` before the model reads a layer's KV
        and ``finish()`` for the mask: a chunk counts only when all its layers landed.
        """
        self._require_layerwise()
        request = self._request(tokens, kv_caches, slot_mapping, mask, tags, request_id)
        request.lookup_id = lookup_id
        request.ret_mask = torch.zeros(request.num_tokens, dtype=torch.bool)
        handle = LayerwiseRetrieve(self, request)
        handle.start()
        return handle

    def store_layerwise(
        self,
        tokens: Any,
        *,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None = None,
        tags: Mapping[str, str] | None = None,
        request_id: str | None = None,
    ) -> LayerwiseStore:
        """Start a store that copies each layer out as soon as the model computed it.

        Call ``layer_ready(layer)`` after each layer's attention and ``finish()``
        at the end (stored tokens); ``abort()`` drops a store that will not finish.
        """
        self._require_layerwise()
        request = self._request(tokens, kv_caches, slot_mapping, mask, tags, request_id)
        return LayerwiseStore(self, request)

    def _require_layerwise(self) -> None:
        if not self.layerwise:
            raise ValueError(f"pipeline '{self.pipeline.name}' is not layerwise: set [layerwise] enabled = true")

    def layer_worker(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one thread that runs per-layer blocks in order, beside the inference thread."""
        with self._lock:
            if self._layer_worker is None:
                self._layer_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flowkv-layers")
            return self._layer_worker

    def release(self, lookup_id: Any) -> None:
        """Drop every pin ``lookup_id`` holds (a finished or aborted request)."""
        self.memory.release_owner(lookup_id)
        with self._lock:
            keys = self._prefetch_owner.pop(lookup_id, [])
        for key in keys:
            self.memory.release_owner((lookup_id, key))

    def prefetch_pending(self, lookup_id: Any) -> bool:
        """Whether chunks that lookup found in slower tiers are still on their way to memory."""
        with self._lock:
            keys = list(self._prefetch_owner.get(lookup_id, []))
            return any(not self._prefetching[k].done() for k in keys if k in self._prefetching)

    def is_healthy(self) -> bool:
        """False once closed, or for a while after repeated failed runs."""
        if self._closed:
            return False
        return time.monotonic() >= self._unhealthy_until

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until write-behind queues are empty; False if the timeout came first."""
        deadline = time.monotonic() + timeout_s
        for queue in self._write_behind.values():
            if not queue.wait_empty(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def stats(self) -> dict[str, Any]:
        """Counters of the engine and each tier."""
        out: dict[str, Any] = dict(self._counters)
        out["healthy"] = self.is_healthy()
        out["tiers"] = {self.memory_name: attrs.asdict(self.memory.stats())}
        for name, tier in self.slow.items():
            out["tiers"][name] = {**tier.stats(), **self._write_behind[name].stats()}
        return out

    def close(self) -> None:
        """Flush write-behind (briefly), close slow tiers and free memory."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s=5.0)
        from flowkv.tiers import portal

        for name, tier in self.slow.items():
            try:
                portal.call(tier.aclose, timeout_s=self._tier_timeout_s[name] + 1.0)
            except Exception:  # closing must not raise into the inference engine
                log.warning("flowkv: closing tier %s failed", name, exc_info=True)
        self.memory.clear()
        if self._layer_worker is not None:
            self._layer_worker.shutdown(wait=True)

    # -- what stages use --------------------------------------------------

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _observe(self, kind: str, started: float) -> None:
        """Record one call's duration: a running total, and an observation for metrics."""
        ms = (time.perf_counter() - started) * 1e3
        with self._lock:
            self._counters[f"{kind}_ms"] += ms
            observations = self._latencies.setdefault(kind, [])
            if len(observations) < 10_000:  # bounded between two metric intervals
                observations.append(ms)

    def drain_latencies(self) -> dict[str, list[float]]:
        """Durations (ms) of lookups, stores and retrieves since the last call."""
        with self._lock:
            drained, self._latencies = self._latencies, {}
        return drained

    def chunk_shape(self, chunk: Chunk) -> tuple[int, ...]:
        return self.geometry.chunk_shape(chunk.num_tokens)

    def key_prefix(self, tags: Mapping[str, str]) -> KeyPrefix:
        frozen = tuple(sorted(tags.items()))
        prefix = self._prefixes.get(frozen)
        if prefix is None:
            prefix = KeyPrefix.build(
                model=self.model_name, world_size=self.world_size, worker_rank=self.rank,
                dtype=self.geometry.dtype, layout=self.geometry.fingerprint(), tags=dict(tags),
            )
            self._prefixes[frozen] = prefix
        return prefix

    def chunk_keys(self, request: Request, spans: Sequence[tuple[int, int]] | None = None) -> list[CacheKey]:
        """Keys of the request's chunks: every ``chunk_size`` tokens (a partial last one
        included), or of the given consecutive ``spans`` (from a segmenter).

        Lookup, retrieve and store of one request hash the same tokens; a small
        cache keyed by a fast digest of the tokens does it once.
        """
        prefix = self.key_prefix(request.tags)
        tokens = request.tokens
        digest = xxhash.xxh3_128_digest(np.ascontiguousarray(tokens.numpy()))  # no copy when contiguous
        regular = spans is None or all(
            start == i * self.chunk_size and end == min(start + self.chunk_size, request.num_tokens)
            for i, (start, end) in enumerate(spans)
        )
        cache_key = (prefix, digest, request.num_tokens, None if regular else tuple(spans))
        with self._lock:
            keys = self._key_cache.get(cache_key)
            if keys is not None:
                self._key_cache.move_to_end(cache_key)
                return keys
        if regular:
            hashes = chain_hashes(tokens, self.chunk_size, self.hash_fn, partial=True)
        else:
            hashes = chain_span_hashes(tokens, spans, self.hash_fn)
        keys = prefix.keys(hashes)
        with self._lock:
            self._key_cache[cache_key] = keys
            while len(self._key_cache) > 64:
                self._key_cache.popitem(last=False)
        return keys

    def find(self, keys: list[str], *, skip: list[bool], tiers: Sequence[str] | None = None) -> list[str | None]:
        """For each key, the first tier (in order) that holds it, or None."""
        found: list[str | None] = [None] * len(keys)
        for name in tiers or self.tier_names:
            todo = [i for i, k in enumerate(keys) if found[i] is None and not skip[i]]
            if not todo:
                break
            if name == self.memory_name:
                for i in todo:
                    if self.memory.contains(keys[i]):
                        found[i] = name
                continue
            answers = self._call(name, "exists", [keys[i] for i in todo], default=[False] * len(todo))
            for i, present in zip(todo, answers):
                if present:
                    found[i] = name
        return found

    def pin(self, keys: list[str], lookup_id: Any) -> None:
        for key in keys:
            self.memory.pin(key, lookup_id, timeout_s=self.pin_timeout_s)

    def prefetch(self, chunks: list[Chunk], lookup_id: Any) -> None:
        """Start loading chunks found in slower tiers into memory (not waiting)."""
        if not chunks:
            return
        from flowkv.tiers import portal

        by_tier: dict[str, list[Chunk]] = collections.defaultdict(list)
        with self._lock:
            for chunk in chunks:
                if chunk.key_str not in self._prefetching:
                    by_tier[chunk.tier].append(chunk)
        for name, group in by_tier.items():
            keys = [c.key_str for c in group]
            shapes = [self.chunk_shape(c) for c in group]
            future = portal.submit(self.slow[name].get, keys)
            # Readers wait on ``landed``, set once the chunks are in memory: waiters
            # of ``future`` itself wake before its done-callbacks (the promotion) run.
            landed: concurrent.futures.Future[None] = concurrent.futures.Future()
            with self._lock:
                for key in keys:
                    self._prefetching[key] = landed
                if lookup_id is not None:
                    self._prefetch_owner.setdefault(lookup_id, []).extend(keys)
            future.add_done_callback(
                lambda f, keys=keys, shapes=shapes, owner=lookup_id, landed=landed:
                    self._prefetched(f, keys, shapes, owner, landed)
            )
            self.count("prefetches", len(keys))

    def _prefetched(self, future: concurrent.futures.Future[Any], keys: list[str],
                    shapes: list[tuple[int, ...]], owner: Any,
                    landed: concurrent.futures.Future[None]) -> None:
        try:
            try:
                blobs = future.result()
            except Exception:
                blobs = [None] * len(keys)
            for key, shape, blob in zip(keys, shapes, blobs):
                if blob is not None and self._promote(key, blob, shape) and owner is not None:
                    # Pinned under (owner, key) so release(owner) can find it.
                    self.memory.pin(key, (owner, key), timeout_s=self.pin_timeout_s)
        finally:
            with self._lock:
                for key in keys:
                    if self._prefetching.get(key) is landed:
                        del self._prefetching[key]
            landed.set_result(None)

    def read(self, chunk: Chunk, ctx: RunContext, *, promote: bool) -> bool:
        """Fill ``chunk.kv`` or ``chunk.payload`` from the tier lookup named; False if gone."""
        key = chunk.key_str
        with self._lock:
            future = self._prefetching.get(key)
        if future is not None:
            try:
                future.result(timeout=self._tier_timeout_s.get(chunk.tier, 1.0) + 1.0)
            except Exception:
                pass
        if self._read_memory(chunk, ctx):
            return True
        # Not (or no longer) in memory: try the slower tiers, the one lookup named first.
        order = [chunk.tier] if chunk.tier in self.slow else []
        order += [n for n in self.slow if n not in order]
        for name in order:
            blob = self._call(name, "get", [key], default=[None])[0]
            if blob is None:
                continue
            chunk.tier = name
            if promote and self._promote(key, blob, self.chunk_shape(chunk)) and self._read_memory(chunk, ctx):
                return True
            chunk.payload = blob
            return True
        return False

    def _read_memory(self, chunk: Chunk, ctx: RunContext) -> bool:
        obj = self.memory.get(chunk.key_str)
        if obj is None:
            return False
        ctx.defer(obj.ref_down)
        chunk.obj = obj
        chunk.tier = self.memory_name
        if "codec" in obj.meta:
            chunk.payload = obj.view_bytes()[: obj.meta["encoded_len"]]
        else:
            chunk.kv = obj.tensor
        return True

    def _promote(self, key: str, blob: bytes, shape: tuple[int, ...]) -> bool:
        """Copy a payload from a slower tier into memory; raw payloads are decoded on the way."""
        if self.memory.contains(key):
            return True
        try:
            header = payloads.read_header(blob)
        except payloads.PayloadError:
            self.count("corrupt_payloads")
            return False
        if header.codec == "none":
            obj = self.memory.allocate(shape, self.geometry.dtype)
            if obj is None:
                return False
            try:
                payloads.decode_into(blob, obj.tensor)
            except payloads.PayloadError:
                obj.ref_down()
                self.count("corrupt_payloads")
                return False
        else:
            try:
                obj = self.memory.allocate_bytes(len(blob))
            except ValueError:  # larger than a slab: leave it in its tier
                return False
            if obj is None:
                return False
            obj.view_bytes()[:] = blob
            obj.meta["codec"] = header.codec
        self.memory.put(key, obj)
        obj.ref_down()
        self.count("promotions")
        return True

    def put_memory(self, chunk: Chunk) -> int:
        """Hand a stored chunk to the memory tier (raw KV, or its encoded payload)."""
        obj = chunk.obj
        payload = chunk.payload
        if payload is not None and len(payload) <= obj.nbytes:
            # The encoding overwrites the chunk's own pages (the raw KV is no
            # longer needed; a second allocation could evict this store's own
            # earlier chunks when memory is short), and the pages past it go
            # back to the arena: a compressed entry costs only its bytes.
            obj.view_bytes()[: len(payload)] = payload
            chunk.kv = None
            obj.shrink_to_bytes(len(payload))
            obj.meta["codec"] = payloads.read_header(payload).codec
            obj.meta["encoded_len"] = len(payload)
        else:
            # No codec, or an encoding no smaller than the raw chunk: keep it raw.
            payload = None
        if not self.memory.put(chunk.key_str, obj):
            return 0  # another store of the same tokens got there first
        return obj.nbytes if payload is None else len(payload)

    def put_behind(self, name: str, chunk: Chunk) -> int:
        """Queue a chunk's payload for a slower tier; never waits."""
        blob = chunk.payload
        if blob is None:
            blob = payloads.encode(chunk.kv, "none")
        elif isinstance(blob, memoryview):
            blob = bytes(blob)
        return len(blob) if self._write_behind[name].offer(chunk.key_str, blob) else 0

    def discard_corrupt(self, chunk: Chunk, error: Exception) -> None:
        """A payload failed its checks: count it and drop it from memory so it is not served again."""
        self.count("corrupt_payloads")
        log.warning("flowkv: dropping corrupt chunk %s from %s: %s", chunk.key_str, chunk.tier, error)
        self.memory.remove(chunk.key_str)

    # -- internals ----------------------------------------------------------

    def _call(self, tier: str, method: str, *args: Any, default: Any) -> Any:
        from flowkv.tiers import portal

        guarded = self.slow[tier]
        try:
            return portal.call(getattr(guarded, method), *args, timeout_s=self._tier_timeout_s[tier] + 1.0)
        except Exception:  # the guard answers misses itself; this covers the portal's own timeout
            self.count(f"tier_call_failures.{tier}")
            return default

    def _request(
        self,
        tokens: Any,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        slot_mapping: torch.Tensor,
        mask: torch.Tensor | None,
        tags: Mapping[str, str] | None,
        request_id: str | None,
    ) -> Request:
        tokens = _as_tokens(tokens)
        n = int(tokens.numel())
        if isinstance(kv_caches, Mapping):
            kv_caches = list(kv_caches.values())
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise ValueError("slot_mapping must be a 1-D int64 tensor, one slot per token")
        if slot_mapping.numel() < n:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} slots for {n} tokens")
        request = Request(tokens=tokens, kv_caches=list(kv_caches), slot_mapping=slot_mapping.long(),
                          tags=dict(tags or {}), request_id=request_id)
        request.masked = self._check_mask(mask, n)
        # Store and retrieve expire pins too: a scheduler that stopped calling
        # lookup must not leave a full arena pinned against every later store.
        self.memory.expire_pins()
        return request

    def _check_mask(self, mask: torch.Tensor | None, n: int) -> int:
        if mask is None:
            return 0
        mask = torch.as_tensor(mask, dtype=torch.bool).flatten()
        if mask.numel() != n:
            raise ValueError(f"mask has {mask.numel()} entries for {n} tokens")
        masked = int(mask.sum())
        if masked and not bool(mask[:masked].all()):
            raise ValueError("mask must be True on a prefix of the tokens and False after it")
        if masked % self.chunk_size and masked != n:
            raise ValueError(
                f"mask covers {masked} tokens, not a multiple of chunk_size {self.chunk_size}: "
                "the engine's own prefix must end on a chunk boundary"
            )
        return masked

    def _run(self, kind: str, request: Request) -> list[Any]:
        ctx = RunContext(kind=kind, request=request, engine=self)
        try:
            return self._run_with(self.runners[kind], [request], ctx)
        finally:
            ctx.run_deferred()

    def _run_with(self, runner: Runner, source: list[Any], ctx: RunContext, parent: Any = None) -> list[Any]:
        """Run ``runner`` over ``source``; a failed run is counted and answers no items."""
        request = ctx.request
        attributes = {"request_id": request.request_id if request else None, "layer": ctx.layer}
        try:
            items = runner.run(source, ctx, attributes=attributes, parent=parent)
        except StageError as exc:
            self._failed(ctx.kind, exc)
            return []
        self._failures = 0
        return items

    def _failed(self, kind: str, exc: StageError) -> None:
        self.count(f"{kind}_errors")
        self._failures += 1
        log.error("flowkv: %s failed: %s", kind, exc, exc_info=exc.original)
        if self._failures >= _FAILURES_BEFORE_UNHEALTHY:
            self._unhealthy_until = time.monotonic() + _UNHEALTHY_FOR_S
            self._failures = 0
            log.error("flowkv: %d failed runs in a row; skipping work for %.0f s",
                      _FAILURES_BEFORE_UNHEALTHY, _UNHEALTHY_FOR_S)


def _as_tokens(tokens: Any) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        return tokens.detach().to("cpu", torch.int64)
    return torch.as_tensor(list(tokens), dtype=torch.int64)


__all__ = ["CacheEngine", "MemoryObj"]
