"""Triton gather/scatter between paged KV and chunk buffers (CUDA; CPU only under
``TRITON_INTERPRET=1``, which the tests use).

One program moves one token of one (layer, kv) pair: all its heads, read or
written through the cache's strides and the chunk buffer's (any order of its
dims: ``KVGeometry.chunk_order`` or a contiguous one), so one kernel serves
every layout and chunk format. The
grid is ``(num_tokens, layers_in_group * kv)``; a slot of -1 masks the whole
program's loads and stores. Values are moved as same-width integers, a bitwise
copy that works for every float type including fp8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .probe import note_row_bytes

__all__ = ["gather_groups", "scatter_groups"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _paged_to_chunk(
    cache_ptr,
    chunk_ptr,
    slot_ptr,
    num_heads,
    head_size,
    block_size,
    stride_layer,
    stride_kv,
    stride_block,
    stride_offset,
    stride_head,
    chunk_layer,
    chunk_kv,
    chunk_token,
    chunk_head,
    KV: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    TO_CHUNK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1).to(tl.int64)
    layer = layer_kv // KV
    kv = layer_kv % KV
    slot = tl.load(slot_ptr + token)
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    # A skipped slot (-1) gets zero heads; a scalar where() rather than
    # `mask & (slot >= 0)`, which the interpreter cannot broadcast.
    live_heads = tl.where(slot >= 0, num_heads, 0)
    mask = (heads < live_heads) & (dims < head_size)
    cache_at = (
        cache_ptr
        + layer * stride_layer
        + kv * stride_kv
        + block * stride_block
        + offset * stride_offset
        + heads * stride_head
        + dims
    )
    # The chunk's logical (layer, kv, token, head, dim) through its strides; dim is stride 1.
    chunk_at = chunk_ptr + layer * chunk_layer + kv * chunk_kv + token * chunk_token + heads * chunk_head + dims
    if TO_CHUNK:
        tl.store(chunk_at, tl.load(cache_at, mask=mask), mask=mask)
    else:
        tl.store(cache_at, tl.load(chunk_at, mask=mask), mask=mask)


def _launch(group: torch.Tensor, chunk: torch.Tensor, slots: torch.Tensor, to_chunk: bool) -> None:
    num_layers, kv, _, block_size, heads, head_size = group.shape
    if group.stride(5) != 1 and head_size > 1:
        raise ValueError(f"the Triton kernels need a contiguous head dim; cache strides are {group.stride()}")
    note_row_bytes(head_size * group.element_size())
    bits = _BITS[group.element_size()]
    s_layer, s_kv, s_block, s_offset, s_head, _ = group.stride()
    c_layer, c_kv, c_token, c_head, c_dim = chunk.stride()
    if c_dim != 1 and head_size > 1:
        raise ValueError(f"the Triton kernels need the chunk's head dim innermost; its strides are {chunk.stride()}")
    grid = (slots.numel(), num_layers * kv)
    _paged_to_chunk[grid](
        group.view(bits),
        chunk.view(bits),
        slots,
        heads,
        head_size,
        block_size,
        s_layer,
        s_kv,
        s_block,
        s_offset,
        s_head,
        c_layer,
        c_kv,
        c_token,
        c_head,
        KV=kv,
        BLOCK_HEADS=triton.next_power_of_2(heads),
        BLOCK_DIM=triton.next_power_of_2(head_size),
        TO_CHUNK=to_chunk,
    )


def gather_groups(groups: list[tuple[int, torch.Tensor]], slots: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the tokens at ``slots`` of every layer group into ``out`` (dense, any order)."""
    for first, group in groups:
        _launch(group, out[first : first + group.shape[0]], slots, to_chunk=True)


def scatter_groups(chunk: torch.Tensor, groups: list[tuple[int, torch.Tensor]], slots: torch.Tensor) -> None:
    """Write ``chunk`` (dense, any order) into every layer group at ``slots``; -1 writes nothing."""
    for first, group in groups:
        _launch(group, chunk[first : first + group.shape[0]], slots, to_chunk=False)
