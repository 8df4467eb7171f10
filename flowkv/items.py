"""What flows through stages: one ``Request`` in, ``Chunk`` items after ``tokenize``.

A run's source yields the request; ``tokenize`` cuts it into chunks; every
later stage adds a facet to each chunk (its key, its memory buffer, its
encoded payload, where it was found) and passes it on, or stops the run early.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch


@attrs.define(eq=False)
class Request:
    """One store, retrieve or lookup call, as the engine received it."""

    tokens: torch.Tensor  # 1-D int64 token ids
    # Paged KV caches of the inference engine, one tensor per layer (None for lookup).
    kv_caches: list[torch.Tensor] | None = None
    slot_mapping: torch.Tensor | None = None  # 1-D int64, one slot per token; -1 = skip
    tags: dict[str, str] = attrs.field(factory=dict)
    request_id: str | None = None
    lookup_id: str | None = None  # pins taken by lookup belong to this id
    pin: bool = False  # lookup: pin what it finds
    # Filled by retrieve: True for every token whose KV was loaded.
    ret_mask: torch.Tensor | None = None
    # Tokens at the start whose KV the inference engine already holds (the caller's
    # mask, checked chunk-aligned by the engine): not stored, not loaded.
    masked: int = 0
    # End of the contiguous hit the lookup stage found (tokens from 0).
    hit_tokens: int | None = None
    # Token range [start, end) that lookup promised but retrieve could not load.
    failed_range: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


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

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def __repr__(self) -> str:
        return f"Chunk(#{self.index} [{self.start}:{self.end}] tier={self.tier} skip={self.skip})"


@attrs.define(eq=False)
class RunContext:
    """Handed to stages that declare a ``ctx`` parameter.

    ``engine`` is whatever the caller runs the pipeline for (``CacheEngine``'s
    shared state: geometry, tiers, key builder); ``record`` puts attributes on
    the running stage's span without the stage touching OpenTelemetry.
    """

    kind: str  # "store", "retrieve" or "lookup"
    request: Request | None = None
    engine: Any = None
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
