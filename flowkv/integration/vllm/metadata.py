"""What the scheduler-side connector sends the workers each step, and where it lands in vLLM's pages.

``FlowKVMetadata`` is built by ``ConnectorScheduler.build_connector_meta`` in
vLLM's engine-core process and bound in every worker before the forward
pass: this step's loads (``LoadSpec``) and saves (``SaveSpec``). Token
counts in them are aligned to flowkv chunks or vLLM blocks with
``floor_to`` / ``ceil_to``; a worker turns a spec's blocks into the engine's
``slot_mapping`` and skips its stored prefix with ``chunk_mask``. A spec
names its chunks by chained hash (``chunk_hashes``) and carries only the
tokens of the chunks it touches; pipelines with a segmenter get every token
from 0 instead (see ``chunk_hashes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["FlowKVMetadata", "LoadSpec", "SaveSpec", "ceil_to", "chunk_mask", "floor_to", "slot_mapping"]


@dataclass
class LoadSpec:
    """Load ``[start, end)`` of a request's tokens from flowkv into its blocks.

    ``token_ids`` are the request's tokens ``[token_start, token_start + len)``,
    to the end of the last chunk the load touches, so the engine can key every
    chunk; tokens outside ``[start, end)`` get slot -1 and are not written
    (vLLM holds them already, or will compute them). ``chunk_hashes`` (None
    for pipelines that cut chunks their own way) key the chunks of
    ``token_ids``; then ``token_start`` is a chunk boundary and nothing before
    it is sent.
    """

    req_id: str
    token_ids: list[int]
    token_start: int
    block_ids: list[int]
    start: int
    end: int
    # The chunk-aligned prefix the engine need not read at all (>= token_start).
    skip_prefix: int
    lookup_id: str | None
    tags: dict[str, str]
    chunk_hashes: list[bytes] | None = None
    # vLLM waits for the load between steps (it answered (n, True)): the worker
    # reports the request in get_finished once it landed.
    load_async: bool = False
    # Blend pipelines: the request's recompute_ratio when its kv_transfer_params set one
    # (``flowkv.blend.recompute_ratio``); None: the pipeline's [blend] recompute_ratio.
    recompute_ratio: float | None = None


@dataclass
class SaveSpec:
    """Store the chunks of ``token_ids`` (the request's tokens from ``token_start``) past ``skip_prefix``."""

    req_id: str
    token_ids: list[int]
    token_start: int
    block_ids: list[int]
    # Tokens before this flowkv has already (chunk-aligned, >= token_start).
    skip_prefix: int
    tags: dict[str, str]
    chunk_hashes: list[bytes] | None = None
    # vLLM's own hashes of the full blocks of token_ids (only when flowkv publishes vLLM KV events).
    block_hashes: list[bytes] | None = None


@dataclass
class FlowKVMetadata(KVConnectorMetadata):
    """One step's loads and saves, built by the scheduler connector."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # The step schedules no token: vLLM steps on, back to back, while its requests wait for their
    # asynchronous loads (the worker then waits a moment for one to land instead of spinning).
    idle: bool = False


def floor_to(value: int, multiple: int) -> int:
    """``value`` rounded down to a whole number of ``multiple`` (chunk or block size)."""
    return value // multiple * multiple


def ceil_to(value: int, multiple: int) -> int:
    """``value`` rounded up to a whole number of ``multiple`` (chunk or block size)."""
    return -(-value // multiple) * multiple


def slot_mapping(block_ids: list[int], block_size: int, token_start: int, num_tokens: int,
                 start: int, end: int) -> torch.Tensor:
    """The paged-cache slot of each of the request's tokens ``[token_start, token_start + num_tokens)``,
    held in ``block_ids``; -1 outside ``[start, end)``."""
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)
    stop = min(end, token_start + num_tokens)
    needed = ceil_to(stop, block_size) // block_size
    if needed > len(blocks):
        raise ValueError(f"{len(blocks)} blocks cannot hold {end} tokens of block size {block_size}")
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    first = max(start, token_start)
    if first < stop:
        inside = torch.arange(first, stop, dtype=torch.int64)
        slots[first - token_start:stop - token_start] = blocks[inside // block_size] * block_size + inside % block_size
    return slots


def chunk_mask(num_tokens: int, skip_prefix: int) -> torch.Tensor | None:
    """The engine's mask that skips the first ``skip_prefix`` tokens (None: skip nothing)."""
    if skip_prefix <= 0:
        return None
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    mask[:skip_prefix] = True
    return mask
