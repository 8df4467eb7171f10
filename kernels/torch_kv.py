"""Gather/scatter between paged KV and chunk buffers with plain torch ops (CPU and CUDA).

Every transfer is one ``index_select`` (gather) or ``index_copy_`` (scatter)
over *rows*: the longest runs of elements that are contiguous both in the
engine's cache and in the chunk buffer. A row is

* one head's ``head_size`` values, when heads are not adjacent in the cache
  (the ``cpu`` and ``*_hnd`` layouts interleave heads with block offsets);
* one token's ``num_kv_heads * head_size`` values (``*_nhd``, ``mla``);
* one whole block's tokens, when every block the slot mapping touches is
  copied whole and in order (``*_nhd``, ``mla``).

All layers that are views of one storage at a fixed distance (vLLM's CPU
backend allocates one buffer for all layers) form one group and move in one
call; the row index then spans the layers too. Rows are moved as the widest
integer type that tiles them: a bitwise copy that works for dtypes the index
kernels lack (fp8), and ``index_copy_`` copies element by element, so wider
elements mean fewer of them.

The reference path (``_gather_by_indexing`` / ``_scatter_by_indexing``) uses
advanced indexing on the canonical view; it is used when a cache's strides
do not allow rows (head dim not contiguous, offsets that are not row
multiples).
"""

from __future__ import annotations

import functools

import torch

from .probe import note_row_bytes

__all__ = ["gather_groups", "scatter_groups", "whole_block_ids"]

# A group: (index of its first layer in the chunk buffer, a
# (num_layers, kv, num_blocks, block_size, num_kv_heads, head_size) view).
LayerGroup = tuple[int, torch.Tensor]


def whole_block_ids(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """The block of each run of ``block_size`` slots, if the slot mapping is made
    only of whole blocks each filled from offset 0 in order; else None."""
    num_tokens = slots.numel()
    if num_tokens == 0 or num_tokens % block_size:
        return None
    per_block = slots.view(-1, block_size)
    starts = per_block[:, :1]
    offsets = _block_offsets(block_size, slots.device, slots.dtype)
    if not bool(((starts % block_size == 0) & (per_block - starts == offsets).all(dim=1, keepdim=True)).all()):
        return None
    return starts.squeeze(1) // block_size


@functools.lru_cache(maxsize=64)
def _frame_rows(device: torch.device, first: int, layers: tuple[int, int], kv: tuple[int, int],
                heads: tuple[int, int]) -> torch.Tensor:
    """Row of each (layer, kv, head) of slot 0, as a ``(layers, kv, 1, heads)`` index
    (each pair: count, stride in rows). It depends only on the cache, not on the slots,
    so it is built once per cache instead of on every call."""
    def term(count_stride: tuple[int, int], dim: int) -> torch.Tensor:
        count, stride = count_stride
        shape = [1, 1, 1, 1]
        shape[dim] = count
        return (torch.arange(count, device=device) * stride).view(shape)

    return first + term(layers, 0) + term(kv, 1) + term(heads, 3)


@functools.lru_cache(maxsize=64)
def _block_offsets(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(block_size, device=device, dtype=dtype)


def _widest_int(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type that tiles a row and every tensor's start."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0 and all(t.storage_offset() * t.element_size() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def _row_plan(
    group: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(cache rows as an ``(N, row)`` tensor over the group's storage, the row
    index in chunk order, row length in elements), or None if rows do not fit."""
    num_layers, kv, _, block_size, heads, head_size = group.shape
    s_layer, s_kv, s_block, s_offset, s_head, s_dim = group.stride()
    if s_dim != 1 and head_size > 1:
        return None
    device = group.device
    heads_adjacent = heads == 1 or s_head == head_size
    candidates = []
    if heads_adjacent and block_ids is not None and (block_size == 1 or s_offset == heads * head_size):
        candidates.append(("block", block_size * heads * head_size))
    if heads_adjacent:
        candidates.append(("token", heads * head_size))
    candidates.append(("head", head_size))
    base = group.storage_offset()
    for unit, row in candidates:
        strides = [base, s_layer, s_kv, s_block]
        if unit == "token":
            strides.append(s_offset)
        elif unit == "head":
            strides += [s_offset, s_head]
        if all(s % row == 0 for s in strides):
            break
    else:
        return None

    if unit == "block":
        per_token = block_ids * (s_block // row)
    else:
        per_token = (slots // block_size) * (s_block // row) + (slots % block_size) * (s_offset // row)
    head_rows = (heads, s_head // row) if unit == "head" else (1, 0)
    frame = _frame_rows(device, base // row, (num_layers, s_layer // row), (kv, s_kv // row), head_rows)
    index = frame + per_token.view(1, 1, -1, 1)
    storage_elems = group.untyped_storage().nbytes() // group.element_size()
    rows = group.as_strided((storage_elems // row, row), (row, 1), 0)
    return rows, index.reshape(-1), row


def _as_wide(cache_rows: torch.Tensor, chunk: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides' rows reinterpreted as the same wide integer type (a bitwise copy)."""
    bits = _widest_int(row * chunk.element_size(), chunk)
    return cache_rows.view(bits), chunk.view(-1, row).view(bits)


def _gather_by_indexing(group: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    block_size = group.shape[3]
    out.copy_(group[:, :, slots // block_size, slots % block_size])


def _scatter_by_indexing(chunk: torch.Tensor, group: torch.Tensor, slots: torch.Tensor) -> None:
    block_size = group.shape[3]
    group[:, :, slots // block_size, slots % block_size] = chunk


def _move_dense(groups: list[LayerGroup], slots: torch.Tensor, chunk: torch.Tensor, *, to_chunk: bool) -> None:
    """Copy between every group and a contiguous ``chunk``, with no skipped slots:
    into ``chunk`` (gather) when ``to_chunk``, else into the cache (scatter)."""
    block_ids = whole_block_ids(slots, groups[0][1].shape[3])
    for first, group in groups:
        part = chunk[first : first + group.shape[0]]
        plan = _row_plan(group, slots, block_ids)
        note_row_bytes((group.shape[-1] if plan is None else plan[2]) * group.element_size())
        if plan is None:
            if to_chunk:
                _gather_by_indexing(group, slots, part)
            else:
                _scatter_by_indexing(part, group, slots)
            continue
        rows, index, row = plan
        cache_rows, chunk_rows = _as_wide(rows, part, row)
        if to_chunk:
            torch.index_select(cache_rows, 0, index, out=chunk_rows)
        else:
            cache_rows.index_copy_(0, index, chunk_rows)


def gather_groups(groups: list[LayerGroup], slots: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the tokens at ``slots`` of every group into ``out`` (contiguous,
    ``(layers, kv, tokens, heads, head_size)``); slot -1 leaves its row of ``out`` as is."""
    skipped = slots < 0
    if not bool(skipped.any()):
        _move_dense(groups, slots, out, to_chunk=True)
        return
    kept = torch.nonzero(~skipped).squeeze(1)
    if kept.numel() == 0:
        return
    dense = out.new_empty(out.shape[:2] + (kept.numel(),) + out.shape[3:])
    _move_dense(groups, slots[kept], dense, to_chunk=True)
    out.index_copy_(2, kept, dense)


def scatter_groups(chunk: torch.Tensor, groups: list[LayerGroup], slots: torch.Tensor) -> None:
    """Write ``chunk`` (contiguous) into the cache at ``slots``; slot -1 writes nothing."""
    skipped = slots < 0
    if not bool(skipped.any()):
        _move_dense(groups, slots, chunk, to_chunk=False)
        return
    kept = torch.nonzero(~skipped).squeeze(1)
    if kept.numel() == 0:
        return
    _move_dense(groups, slots[kept], chunk.index_select(2, kept), to_chunk=False)
