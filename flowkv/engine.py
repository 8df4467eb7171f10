"""The cache engine: lookup, store and retrieve, each run as its pipeline's stage list.

::

    lookup(tokens)         -> hit tokens      [tokenize, chunk-hash, lookup]
    lookup_result(...)     -> LookupResult    (the same, from tokens or chunk hashes)
    store(KVTransfer)      -> StoreResult     [tokenize, chunk-hash, allocate, gather, compress, put]
    retrieve(KVTransfer)   -> RetrieveResult  [tokenize, chunk-hash, lookup, get, decompress, scatter]

A façade over three parts, each in its own module::

    CacheEngine --+-- ChunkKeys       (flowkv.keys)         the chunk keys of a request
                  +-- StorageManager  (flowkv.tiers.manager)  the ordered tiers, memory included
                  +-- Executor        (flowkv.executor)     runners, layerwise segments, accounting

Stages see the first two (and the counters) as ``ctx.services``. A store
or retrieve takes one ``KVTransfer`` (``flowkv.calls``), the layerwise
forms too, and answers a result object of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowkv import telemetry
from flowkv.accounting import Accounting
from flowkv.calls import KVTransfer, LookupResult, RetrieveResult, StoreResult
from flowkv.clock import Clock
from flowkv.executor import Executor
from flowkv.items import Request, Services
from flowkv.kernels import KVGeometry, PackedBlockLayout
from flowkv.keys import CacheKey, ChunkKeys, KeyPrefix
from flowkv.layerwise import LayerwiseRetrieve, LayerwiseStore
from flowkv.memory import MemoryObj
from flowkv.pipeline import Pipeline, load_pipeline
from flowkv.tiers.manager import StorageManager

__all__ = ["CacheEngine", "KVTransfer", "LookupResult", "MemoryObj", "RetrieveResult", "StoreResult"]

# Room above one raw chunk in the largest memory object: an encoded payload's header,
# and the few bytes a lossless codec can add to incompressible data.
_SLAB_MARGIN = 4096


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
        clock: Clock | None = None,
        packing: PackedBlockLayout | None = None,
    ) -> None:
        """``clock`` paces pin deadlines and the pin timer (`flowkv.clock.ManualClock` in tests);
        ``packing`` is how the engine's cache packs tokens inside a block (vLLM's CPU layout,
        `flowkv.kernels.PackedBlockLayout`), so that lossy codecs see true tokens."""
        if pipeline.server:
            raise ValueError(f"pipeline '{pipeline.name}' ({pipeline.source}) is a node server's (its [server] "
                             "list): `flowkv server --pipeline` runs it; an engine uses a pipeline with a tier of "
                             "kind 'server' (such as node or node-disk)")
        self.pipeline = pipeline
        self.geometry = geometry
        self.model_name = model_name
        self.world_size = world_size
        self.rank = rank
        self.chunk_size = pipeline.chunk_size
        self.save_partial_chunks = pipeline.section.save_partial_chunks
        self.layerwise = pipeline.layerwise.enabled
        self.accounting = Accounting()
        # A packed cache's raw chunks are its blocks' bytes: the packing is part of the layout.
        layout = geometry.fingerprint() + (f"-{packing.fingerprint()}" if packing is not None else "")
        self.keys = ChunkKeys(model=model_name, world_size=world_size, rank=rank, dtype=geometry.dtype,
                              layout=layout, chunk_size=self.chunk_size,
                              hash_function=pipeline.section.hash)
        self.storage = StorageManager.from_specs(
            pipeline.tiers, slab_bytes=geometry.token_bytes * self.chunk_size + _SLAB_MARGIN,
            pin_timeout_s=pipeline.section.pin_timeout_s, world_size=world_size, rank=rank,
            counters=self.accounting, clock=clock,
        )
        self.services = Services(geometry=geometry, chunk_size=self.chunk_size,
                                 save_partial_chunks=self.save_partial_chunks, keys=self.keys,
                                 storage=self.storage, counters=self.accounting, blend=pipeline.blend,
                                 packing=packing)
        self.tracer = telemetry.tracer_for(pipeline.telemetry)
        self.executor = Executor(pipeline, self.services, accounting=self.accounting, tracer=self.tracer)
        if self.executor.decoders:  # promoted raw payloads land decoded, through the pipeline's own stages
            self.storage.decode_promotions_with(self.executor.decode_promotion)

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
        clock: Clock | None = None,
        packing: PackedBlockLayout | None = None,
    ) -> CacheEngine:
        """An engine for a pipeline given by built-in name, path or loaded ``Pipeline``."""
        if not isinstance(pipeline, Pipeline):
            pipeline = load_pipeline(pipeline, overrides=overrides)
        return cls(pipeline, geometry=geometry, model_name=model_name, world_size=world_size, rank=rank,
                   clock=clock, packing=packing)

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
        return self.executor.lookup(tokens, pin=pin, tags=tags, lookup_id=lookup_id,
                                    request_id=request_id).hit_tokens

    def lookup_result(
        self,
        tokens: Any = None,
        *,
        chunk_hashes: Sequence[bytes] | None = None,
        num_tokens: int | None = None,
        pin: bool = False,
        tags: Mapping[str, str] | None = None,
        lookup_id: Any = None,
        request_id: str | None = None,
        counted: tuple[int, int] | None = None,
        prefetch: bool | None = None,
        count: bool = True,
    ) -> LookupResult:
        """``lookup``, answering which part of the hit memory holds (a load of it only copies).

        Takes the tokens, or the chunks' chained hashes and the token count
        (a caller that hashed the tokens already sends 32 bytes a chunk, not
        the tokens). ``counted``: (tokens, hit tokens) earlier lookups of the
        same request counted; the counters then take only the rest, so each
        request's tokens count once (``lookup_repeats`` counts the repeats).
        ``prefetch`` overrides the lookup stage's option of that name; without
        ``count`` (a controller's command, not an inference engine's lookup)
        nothing is counted, and the lookup runs whatever the engine's health.
        """
        return self.executor.lookup(tokens, pin=pin, tags=tags, lookup_id=lookup_id, request_id=request_id,
                                    chunk_hashes=chunk_hashes, num_tokens=num_tokens, counted=counted,
                                    prefetch=prefetch, count=count)

    def store(self, transfer: KVTransfer, /) -> StoreResult:
        """Store the KV of the transfer's tokens (read from its ``kv_caches`` at ``slot_mapping``).

        Chunks under its ``mask`` (True = already stored) and chunks already
        held are skipped; when memory runs out the run stops, keeping the
        prefix it stored (``stored_tokens``).
        """
        return self.executor.store(_checked(transfer, "store"))

    def retrieve(self, transfer: KVTransfer, /) -> RetrieveResult:
        """Load what the tiers hold of the transfer's tokens into its ``kv_caches``.

        The ``ret_mask`` is the longest good prefix: a chunk gone since lookup
        ends it, and ``failed_range`` then says which tokens were promised but
        not loaded. Pins of the transfer's ``lookup_id`` are released.
        """
        return self.executor.retrieve(_checked(transfer, "retrieve"))

    def retrieve_layerwise(self, transfer: KVTransfer, /) -> LayerwiseRetrieve:
        """Start a retrieve whose layers land one by one, overlapping the model's compute.

        The head of the retrieve list (find and read the chunks) runs now; each
        layer's block (scatter) is queued on the transfer worker (a side CUDA
        stream on GPU). Call ``wait(layer)`` before the model reads a layer's KV
        and ``finish()`` for the mask (``.result`` then holds the
        ``RetrieveResult``): a chunk counts only when all its layers landed.
        """
        return self.executor.start_retrieve(_checked(transfer, "retrieve_layerwise"))

    def store_layerwise(self, transfer: KVTransfer, /) -> LayerwiseStore:
        """Start a store that copies each layer out as soon as the model computed it.

        Call ``layer_ready(layer)`` after each layer's attention and ``finish()``
        at the end (stored tokens; ``.result`` the ``StoreResult``); ``abort()``
        drops a store that will not finish.
        """
        return self.executor.start_store(_checked(transfer, "store_layerwise"))

    def held_tokens(self, chunk_hashes: Sequence[bytes], num_tokens: int, *,
                    tags: Mapping[str, str] | None = None) -> int:
        """How many of ``num_tokens`` tokens, chunked from the first and keyed by
        ``chunk_hashes``, the tiers hold now (whole chunks, contiguous from the
        first): the lookup list run as a check before a load (its ``tiers`` and
        span as any lookup's), taking no pin, starting no prefetch, counting nothing."""
        return self.executor.lookup(None, chunk_hashes=chunk_hashes, num_tokens=num_tokens, tags=tags,
                                    prefetch=False, count=False).hit_tokens

    def release(self, lookup_id: Any) -> None:
        """Drop every pin ``lookup_id`` holds (a finished or aborted request)."""
        self.storage.release(lookup_id)

    def prefetch_pending(self, lookup_id: Any) -> bool:
        """Whether chunks that lookup found in slower tiers are still on their way to memory."""
        return self.storage.prefetch_pending(lookup_id)

    def is_healthy(self) -> bool:
        """False once closed, or for a while after repeated failed runs."""
        return self.accounting.healthy()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until write-behind queues are empty; False if the timeout came first."""
        return self.storage.flush(timeout_s)

    def stats(self) -> dict[str, Any]:
        """Counters of the engine and each tier."""
        out: dict[str, Any] = self.accounting.counters()
        out["healthy"] = self.is_healthy()
        out["tiers"] = self.storage.stats()
        for name in self.storage.guarded:
            written = out["tiers"].get(name, {}).get("written_bytes")
            if written is not None:
                # What the tier stored, not what its write-behind queue accepted (a full disk accepts and drops).
                out[f"tier.{name}.written_bytes"] = written
        return out

    def drain_latencies(self) -> dict[str, list[float]]:
        """Durations (ms) of lookups, stores and retrieves since the last call."""
        return self.accounting.drain_latencies()

    def close(self) -> None:
        """Finish queued layer work, flush write-behind (briefly), close the tiers and free memory."""
        if self.accounting.closed:
            return
        self.accounting.close()
        self.executor.close()
        self.storage.close()

    def count(self, name: str, n: float = 1) -> None:
        self.accounting.count(name, n)

    # -- what tests, benchmarks and tools read --------------------------------

    @property
    def memory(self) -> Any:
        """The tier stores allocate in (``flowkv.tiers.memory.MemoryTier``)."""
        return self.storage.memory

    @property
    def slow(self) -> dict[str, Any]:
        """The byte tiers by name, each in its health guard (``.tier`` is the tier itself)."""
        return self.storage.guarded

    @property
    def hash_fn(self) -> Any:
        return self.keys.hash_fn

    @property
    def _key_cache(self) -> Any:  # ``flowkv bench engine`` clears it to time a first lookup
        return self.keys.cache

    def key_prefix(self, tags: Mapping[str, str]) -> KeyPrefix:
        return self.keys.prefix(tags)

    def chunk_keys(self, request: Request, spans: Any = None) -> list[CacheKey]:
        """Keys of the request's chunks: every ``chunk_size`` tokens (a partial last one
        included), or of the given consecutive ``spans`` (from a segmenter)."""
        return self.keys.of(request.tokens, request.tags, spans, hashes=request.chunk_hashes,
                            num_tokens=request.num_tokens)


def _checked(transfer: Any, call: str) -> KVTransfer:
    """The call's ``KVTransfer``; anything else is a caller's mistake, said at once."""
    if not isinstance(transfer, KVTransfer):
        raise TypeError(f"CacheEngine.{call} takes one KVTransfer(tokens=..., kv_caches=..., slot_mapping=...), "
                        f"not {type(transfer).__name__}")
    return transfer
