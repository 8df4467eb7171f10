"""What the scheduler-side connector sends the workers each step, and where it lands in vLLM's pages.

``FlowKVMetadata`` is built by ``ConnectorScheduler.build_connector_meta`` in
vLLM's engine-core process and bound in every worker before the forward
pass: this step's loads (``LoadSpec``) and saves (``SaveSpec``). Token
counts in them are aligned to flowkv chunks or vLLM blocks with
``floor_to`` / ``ceil_to``; a worker turns a spec's blocks into the engine's
``slot_mapping`` and skips its stored prefix with ``chunk_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["FlowKVMetadata", "LoadSpec", "SaveSpec", "ceil_to", "chunk_mask", "floor_to", "slot_mapping"]


@dataclass
class LoadSpec:
    """Load ``[start, end)`` of a request's tokens from flowkv into its blocks.

    ``token_ids`` runs to the end of the last chunk the load touches, so the
    engine can key every chunk; tokens outside ``[start, end)`` get slot -1
    and are not written (vLLM holds them already, or will compute them).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    # The chunk-aligned prefix the engine need not read at all.
    skip_prefix: int
    lookup_id: str | None
    tags: dict[str, str]


@dataclass
class SaveSpec:
    """Store the chunks of ``token_ids`` past ``skip_prefix`` (flowkv has those already)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_prefix: int
    tags: dict[str, str]
    # vLLM's own hashes of the full blocks of token_ids (only when flowkv publishes vLLM KV events).
    block_hashes: list[bytes] | None = None


@dataclass
class FlowKVMetadata(KVConnectorMetadata):
    """One step's loads and saves, built by the scheduler connector."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def floor_to(value: int, multiple: int) -> int:
    """``value`` rounded down to a whole number of ``multiple`` (chunk or block size)."""
    return value // multiple * multiple


def ceil_to(value: int, multiple: int) -> int:
    """``value`` rounded up to a whole number of ``multiple`` (chunk or block size)."""
    return -(-value // multiple) * multiple


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int, start: int, end: int) -> torch.Tensor:
    """The paged-cache slot of each of ``num_tokens`` tokens held in ``block_ids``; -1 outside ``[start, end)``."""
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)
    needed = ceil_to(min(end, num_tokens), block_size) // block_size
    if needed > len(blocks):
        raise ValueError(f"{len(blocks)} blocks cannot hold {end} tokens of block size {block_size}")
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    inside = torch.arange(start, min(end, num_tokens), dtype=torch.int64)
    slots[start:end] = blocks[inside // block_size] * block_size + inside % block_size
    return slots


def chunk_mask(num_tokens: int, skip_prefix: int) -> torch.Tensor | None:
    """The engine's mask that skips the first ``skip_prefix`` tokens (None: skip nothing)."""
    if skip_prefix <= 0:
        return None
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    mask[:skip_prefix] = True
    return mask
