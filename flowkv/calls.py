"""What a store or retrieve call takes, and what it answers.

::

    KVTransfer(tokens, kv_caches, slot_mapping, mask, tags, request_id, lookup_id, chunk_hashes)
        -> CacheEngine.store(t)    -> StoreResult(stored_tokens)
        -> CacheEngine.retrieve(t) -> RetrieveResult(ret_mask, loaded_to, failed_range)
    CacheEngine.lookup_result(tokens | chunk_hashes) -> LookupResult(hit_tokens, memory_tokens)

The same value goes to the layerwise forms (``store_layerwise``,
``retrieve_layerwise``), whose handles carry the result once finished.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from flowkv.items import Request

__all__ = ["KVTransfer", "LookupResult", "RetrieveResult", "StoreResult", "as_tokens"]


@attrs.frozen(kw_only=True)
class KVTransfer:
    """One request's KV moving between the inference engine's paged cache and flowkv."""

    tokens: Any  # 1-D token ids (tensor or sequence)
    # The paged KV caches, one tensor per attention layer (a mapping's values in order).
    kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
    slot_mapping: torch.Tensor  # 1-D int64, one slot per token; -1 = leave that token alone
    # True on the chunk-aligned prefix the inference engine holds already: not stored, not loaded.
    mask: torch.Tensor | None = None
    tags: Mapping[str, str] | None = None  # what else keys the KV (LoRA, tenant salt)
    request_id: str | None = None  # the inference engine's id, on spans
    lookup_id: Any = None  # retrieve: release the pins this lookup took
    # The chained hashes of the chunks of ``tokens`` (tokens[0] starts a chunk) when the
    # caller has them; then nothing is hashed (fixed-size chunks only).
    chunk_hashes: Sequence[bytes] | None = None

    def request(self, chunk_size: int) -> Request:
        """The run's source item; a caller's mistake (shapes, mask) raises ``ValueError``."""
        tokens = as_tokens(self.tokens)
        n = int(tokens.numel())
        kv_caches = self.kv_caches
        if isinstance(kv_caches, Mapping):
            kv_caches = list(kv_caches.values())
        slot_mapping = self.slot_mapping
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise ValueError("slot_mapping must be a 1-D int64 tensor, one slot per token")
        if slot_mapping.numel() < n:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} slots for {n} tokens")
        return Request(tokens=tokens, kv_caches=list(kv_caches), slot_mapping=slot_mapping.long(),
                       tags=dict(self.tags or {}), request_id=self.request_id, lookup_id=self.lookup_id,
                       masked=_masked(self.mask, n, chunk_size), chunk_hashes=self.chunk_hashes)


@attrs.frozen
class LookupResult:
    """What a lookup found: the hit, and how much of it a load only copies."""

    hit_tokens: int  # tokens [0, hit_tokens) the tiers can serve (whole chunks, contiguous)
    # Tokens [0, memory_tokens) of the hit are held by object tiers (memory): a load copies
    # them. Past that the hit lies in byte tiers (disk, Redis), read (or prefetched) first.
    memory_tokens: int
    chunks: int = 0  # the chunks the request was cut into
    hit_chunks: int = 0  # the chunks of the hit


@attrs.frozen
class StoreResult:
    """What a store did."""

    stored_tokens: int  # tokens of the chunks it stored (held or masked chunks not counted)


@attrs.frozen
class RetrieveResult:
    """What a retrieve loaded into the paged cache."""

    ret_mask: torch.Tensor  # True for every token this retrieve loaded
    # Tokens [start, end) that lookup promised but could not be loaded (None: all it found came).
    failed_range: tuple[int, int] | None = None
    masked: int = 0  # the caller's mask covered tokens [0, masked): neither read nor loaded
    # Loaded segment chunks whose KV was computed at another position: (start, end,
    # stored_start). Their keys carry the rotation of stored_start (CacheBlend re-rotates
    # them by start - stored_start and recomputes a share of their tokens).
    moved: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def of(cls, request: Request) -> RetrieveResult:
        result = cls(request.ret_mask, request.failed_range, request.masked)
        loaded_to = result.loaded_to
        moved = tuple(span for span in request.moved if span[1] <= loaded_to)
        return attrs.evolve(result, moved=moved) if moved else result

    @property
    def loaded_to(self) -> int:
        """Tokens ``[0, loaded_to)`` are in the paged cache: the caller's masked prefix, then
        the chunks this retrieve loaded, up to the first it did not (the one place this is
        worked out)."""
        window = self.ret_mask[self.masked:]
        if bool(window.all()):
            return len(self.ret_mask)
        return self.masked + int(torch.argmin(window.to(torch.int8)))

    @property
    def loaded_tokens(self) -> int:
        return int(self.ret_mask.sum())

    def loaded_within(self, start: int, end: int) -> int:
        """Where a load of tokens ``[start, end)`` got to (``start``: nothing, ``end``: all)."""
        return min(max(self.loaded_to, start), end)


def as_tokens(tokens: Any) -> torch.Tensor:
    """1-D int64 token ids on the CPU."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        return tokens.detach().to("cpu", torch.int64)
    return torch.as_tensor(list(tokens), dtype=torch.int64)


def _masked(mask: torch.Tensor | None, n: int, chunk_size: int) -> int:
    """How many leading tokens ``mask`` covers; it must be a chunk-aligned prefix."""
    if mask is None:
        return 0
    mask = torch.as_tensor(mask, dtype=torch.bool).flatten()
    if mask.numel() != n:
        raise ValueError(f"mask has {mask.numel()} entries for {n} tokens")
    masked = int(mask.sum())
    if masked and not bool(mask[:masked].all()):
        raise ValueError("mask must be True on a prefix of the tokens and False after it")
    if masked % chunk_size and masked != n:
        raise ValueError(
            f"mask covers {masked} tokens, not a multiple of chunk_size {chunk_size}: "
            "the engine's own prefix must end on a chunk boundary"
        )
    return masked
