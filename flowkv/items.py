"""What flows through stages, and what a stage may use.

A run's source yields one ``Request``; ``tokenize`` cuts it into ``Chunk`` s;
every later stage adds a facet to each chunk (its key, its memory buffer, its
encoded payload, where it was found) and passes it on, or stops the run early.
A stage that declares a ``ctx`` parameter gets the ``RunContext``: the run's
kind, request and layer, ``record`` for its span, ``defer`` for cleanup, and
``ctx.services`` — the typed ``Services`` of the engine it runs for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from flowkv.tenants import tenant_of

if TYPE_CHECKING:
    from flowkv.accounting import Counters
    from flowkv.kernels import KVGeometry, PackedBlockLayout
    from flowkv.keys import CacheKey, ChunkKeys
    from flowkv.pipeline_model import BlendSpec
    from flowkv.tiers.manager import StorageManager


@attrs.define(eq=False)
class Request:
    """One store, retrieve or lookup call, as the engine received it."""

    # 1-D int64 token ids; None for a lookup by chunk hashes (``chunk_hashes`` and ``length``).
    tokens: torch.Tensor | None
    # Paged KV caches of the inference engine, one tensor per layer (None for lookup).
    kv_caches: list[torch.Tensor] | None = None
    slot_mapping: torch.Tensor | None = None  # 1-D int64, one slot per token; -1 = skip
    tags: dict[str, str] = attrs.field(factory=dict)
    request_id: str | None = None
    lookup_id: str | None = None  # pins taken by lookup belong to this id
    pin: bool = False  # lookup: pin what it finds
    # Lookup: start promoting hits below memory (None: as the lookup stage's ``prefetch`` says).
    prefetch: bool | None = None
    # Filled by retrieve: True for every token whose KV was loaded.
    ret_mask: torch.Tensor | None = None
    # Tokens at the start whose KV the inference engine already holds (the caller's
    # mask, checked chunk-aligned by the engine): not stored, not loaded.
    masked: int = 0
    # End of the contiguous hit the lookup stage found (tokens from 0).
    hit_tokens: int | None = None
    # Token range [start, end) that lookup promised but retrieve could not load.
    failed_range: tuple[int, int] | None = None
    # The chained hashes of the request's chunks (every chunk_size tokens from
    # tokens[0]) when the caller has them: the vLLM scheduler hashes a request
    # once and sends hashes, so chunk-hash makes keys without reading tokens.
    chunk_hashes: Sequence[bytes] | None = None
    # The token count of a request that came as chunk hashes, without its tokens.
    length: int | None = None
    # Filled by lookup: tokens [0, memory_tokens) of the hit are in object tiers (a load only copies),
    # and how many chunks it was asked for and found (``lookup_chunks``, ``hit_chunks``).
    memory_tokens: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    # Filled by retrieve: segment chunks found stored at another position than the one
    # they are loaded at, as (start, end, stored_start); their keys need re-rotating.
    moved: list[tuple[int, int, int]] = attrs.field(factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel()) if self.tokens is not None else int(self.length or 0)

    @property
    def tenant(self) -> str:
        """Whose request this is: its ``tenant`` tag, else its ``cache_salt``, else ``default``."""
        return tenant_of(self.tags)

    def fail_from(self, chunk: Chunk) -> None:
        """``chunk`` was promised but cannot be loaded: the good prefix ends before it.

        The failed range runs from its start to the end of what lookup
        promised (at least to its own end); the earliest such chunk wins.
        """
        if self.failed_range is None or chunk.start < self.failed_range[0]:
            self.failed_range = (chunk.start, max(self.hit_tokens or 0, chunk.end))


@attrs.define(eq=False, repr=False)
class Chunk:
    """One chunk of a request: tokens [start, end) and what stages learned of it."""

    request: Request
    index: int  # chunk number, 0 for the first
    start: int
    end: int
    key: Any = None  # flowkv.keys.CacheKey once chunk-hash ran
    key_str: str | None = None  # key.to_str(), what tiers index by
    skip: bool = False  # masked by the engine's own cache: keep in the hash chain, move no data
    obj: Any = None  # flowkv.memory.MemoryObj this chunk's data lives in (raw KV or encoded)
    kv: torch.Tensor | None = None  # raw KV, shape (layers, kv, tokens, heads, head_size)
    payload: Any = None  # encoded bytes (header + body) for codecs and byte tiers
    tier: str | None = None  # where lookup found it / where put stored it
    # Layers moved so far (layerwise runs); a chunk counts only once all are.
    layers_done: int = 0
    # Segment keys (the `segment` stage): where the segment holding this chunk begins.
    # chunk-hash then keys it by that segment's tokens alone; None = the prefix chain.
    segment_start: int | None = None
    # Where this chunk's first token sat when its KV was stored (segment chunks record it).
    stored_start: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def __repr__(self) -> str:
        return f"Chunk(#{self.index} [{self.start}:{self.end}] tier={self.tier} skip={self.skip})"


@attrs.frozen(kw_only=True)
class Services:
    """What the engine offers the stages it runs: the stage contract, besides the items.

    Built-in stages use exactly this; so does a user's stage (``ctx.services``).
    """

    # The paged KV cache's layout; chunk shapes and dtype. None in a node server's [server]
    # list (one server holds many engines' chunks; the stages that may run there read no geometry).
    geometry: KVGeometry | None
    chunk_size: int  # tokens per chunk ([pipeline] chunk_size)
    save_partial_chunks: bool  # store a last chunk shorter than chunk_size ([pipeline])
    keys: ChunkKeys | None  # chunk keys: keys.of(tokens, tags, spans); None in a [server] list (chunks come keyed)
    storage: StorageManager  # the ordered tiers: find, read, allocate, put, pin, prefetch
    counters: Counters  # counters.count(name, n): shown in stats() and the vLLM metrics
    blend: BlendSpec | None = None  # the pipeline's [blend] table (separator, ratio), None without one
    # How the engine packs tokens inside a block (vLLM's CPU cache), drawn from its cache-write op
    # at start: lossy codecs quantize the true tokens through it. None: a block row is one token.
    packing: PackedBlockLayout | None = None

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The raw KV shape of a chunk of ``num_tokens`` tokens."""
        return self.geometry.chunk_shape(num_tokens)

    def chunk_keys(self, request: Request, spans: Sequence[tuple[int, int]] | None = None,
                   segment_starts: Sequence[int] | None = None) -> list[CacheKey]:
        """Keys of ``request``'s chunks (every ``chunk_size`` tokens, or the given ``spans``);
        segment keys when ``segment_starts`` says where each span's segment begins."""
        if segment_starts is not None:
            return self.keys.of(request.tokens, request.tags, spans, segment_starts=segment_starts)
        return self.keys.of(request.tokens, request.tags, spans, hashes=request.chunk_hashes,
                            num_tokens=request.num_tokens)

    def count(self, name: str, n: float = 1) -> None:
        self.counters.count(name, n)


@attrs.define(eq=False)
class RunContext:
    """Handed to stages that declare a ``ctx`` parameter.

    ``services`` is what the engine offers stages (``Services``; None when a
    runner drives stages with no engine behind them); ``record`` puts
    attributes on the running stage's span without the stage touching
    OpenTelemetry.
    """

    kind: str  # "store", "retrieve", "lookup", or "server" (a node server's writer)
    request: Request | None = None
    services: Services | None = None
    layer: int | None = None
    # Set by the runner around each stage step when the run is traced.
    _recorder: Callable[[dict[str, Any]], None] | None = None
    # Totals the stages report, readable after the run (traced or not).
    totals: dict[str, float] = attrs.field(factory=dict)
    # Called once the run is over, whatever its end: releases what stages took.
    _deferred: list[Callable[[], Any]] = attrs.field(factory=list)

    def defer(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` when the run ends (e.g. drop a reference a stage took)."""
        self._deferred.append(callback)

    def run_deferred(self) -> None:
        """Call the deferred callbacks, newest first; the runner's caller does this."""
        while self._deferred:
            callback = self._deferred.pop()
            try:
                callback()
            except Exception:  # one failed release must not keep the others from running
                pass

    def record(self, **attributes: Any) -> None:
        """Attach attributes (bytes=, tier=, hit_tokens=, ...) to the running stage's span.

        Numeric ``bytes``, ``chunks`` and ``hit_tokens`` also add up in ``totals``.
        """
        for name in ("bytes", "chunks", "hit_tokens"):
            value = attributes.get(name)
            if isinstance(value, (int, float)):
                self.totals[name] = self.totals.get(name, 0) + value
        if self._recorder is not None:
            self._recorder(attributes)
