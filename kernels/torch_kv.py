"""Gather/scatter between paged KV and chunk buffers with plain torch ops (CPU and CUDA).

Every transfer copies *rows*: the longest runs of elements that are contiguous
both in the engine's cache and in the chunk buffer, found from the strides of
both. The chunk buffer may be laid out in any order of its dims;
``KVGeometry.chunk_order`` picks the one that keeps the cache's own rows whole.
Walking the chunk's dims from the innermost out, a dim joins the row while it
continues it on both sides:

* ``cpu`` cache, chunk in its format ``(layers, heads, tokens, kv, dim)``: the
  head dim, keys and values (side by side in the cache), and a block's token
  offsets — one row is one head's block, ``block_size * 2 * head_size`` values;
* ``*_hnd``: one head's block, ``block_size * head_size`` values;
* ``*_nhd`` and ``mla``: a whole block of all heads.

Token offsets join a row only when every block the slot mapping touches is
copied whole and in order (``whole_block_ids``); otherwise a row ends at one
token of one head (or of all heads, where heads are adjacent), and the token
dim maps through the slot mapping. A chunk in another order (a decoded
payload, a caller's contiguous tensor) moves correctly, in shorter rows.

All layers that are views of one storage at a fixed distance (vLLM's CPU
backend allocates one buffer for all layers) form one group and move in one
call; the row index then spans the layers too. Rows are moved as the widest
integer type that tiles them: a bitwise copy that works for dtypes the index
kernels lack (fp8). Rows of 2 KiB and more on the CPU are copied by numpy
(``np.take`` for a gather, row assignment for a scatter), one memcpy per row
without the GIL, by the calling thread and a helper thread that takes pieces
while it is free (no OpenMP team, whose barrier waits for a core another
process holds; see ``NUMPY_GATHER``). Shorter rows, and GPU caches, use one
``index_select`` (gather) or ``index_copy_`` (scatter).

The reference path (``_gather_by_indexing`` / ``_scatter_by_indexing``) uses
advanced indexing on the canonical view; it is used when no row longer than
one element fits (a head dim that is not contiguous).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

from .affinity import other_cores, set_thread_cores
from .geometry import dense_order
from .probe import note_row_bytes

__all__ = ["gather_groups", "scatter_groups", "whole_block_ids"]

# A group: (index of its first layer in the chunk buffer, a
# (num_layers, kv, num_blocks, block_size, num_kv_heads, head_size) view).
LayerGroup = tuple[int, torch.Tensor]

# Scatter of rows at least this long (bytes) into a CPU cache is done by numpy (one memcpy
# per row, where index_copy_ copies element by element); shorter rows by index_copy_,
# which pays less per row.
NUMPY_MIN_ROW_BYTES = 2048
# Gather with numpy too (instead of index_select, which parallelizes a memcpy per row over
# torch's OpenMP threads: inside vLLM's worker those are vLLM's team, one pinned to each core
# (tests/test_vllm_hooks.py), and a parallel region waits at its barrier for a core another
# process holds: measured in vLLM's worker on this loaded machine (load 18), a request's 16 MiB
# gathered by index_select ran at a median of 0.5-0.8 GB/s (best 20), by numpy at 8.7-10.3 GB/s
# (best 17-20), 20 runs each). Measured before with 1 torch thread,
# a request of 4,096 tokens gathered as one copy (medians of 8, interleaved): 1.33 against
# 0.89 GB/s with the second core free (the helper thread takes half), 0.89 against 0.77 GB/s
# with a forward-like load on it.
NUMPY_GATHER = True
# A CPU copy is cut into pieces that the caller and the helper threads take turns at (see
# `RowCopier`): about two per thread, none larger than PIECE_BYTES nor smaller than
# MIN_PIECE_BYTES. Few pieces, because each piece costs its thread one wait for the GIL: with a
# busy Python thread beside it (a span exporter, a tier's I/O) a thread that released the GIL
# waits up to the switch interval to get it back. Measured here, one thread and such a Python
# thread on its core, 128 MiB in rows of 64 KiB: np.take as one call 2.39 GB/s, in 64 pieces
# of 2 MiB 1.37 GB/s (the torch copy of the same bytes 2.21 GB/s).
PIECE_BYTES = 32 << 20
MIN_PIECE_BYTES = 1 << 20
# Whether a copy made on the main thread may use the helper threads.
USE_HELPER = True
# Most helper threads (the caller copies too); fewer when fewer cores are free. Inside vLLM's CPU
# worker the thread that calls the connector is the OpenMP master, pinned to the first core of
# VLLM_CPU_OMP_THREADS_BIND: helpers it started would share that core and copy nothing in
# parallel, so they go to the process's other cores (`affinity.other_cores`), where vLLM's
# OpenMP workers wait while the connector copies between forward passes.
MAX_HELPERS = 3
# "free": the helpers run off the cores their creator is pinned to (`affinity.other_cores`);
# "inherit": where their creator runs, as threads do (before; for measuring the difference).
HELPER_AFFINITY = "free"

# A dim of the copy, in the chunk's physical order: (size, stride in the chunk,
# stride in the cache, or None for the one dim that maps through the slot mapping).
_Dim = tuple[int, int, "int | None"]


def whole_block_ids(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """The block of each run of ``block_size`` slots, if the slot mapping is made
    only of whole blocks each filled from offset 0 in order; else None."""
    num_tokens = slots.numel()
    if num_tokens == 0 or num_tokens % block_size:
        return None
    if slots.device.type == "cpu":  # a few numpy ops on a small array cost less than torch's
        per_block = slots.numpy().reshape(-1, block_size)
        starts = per_block[:, 0]
        if (starts % block_size).any() or not (per_block - starts[:, None] == _np_offsets(block_size)).all():
            return None
        return torch.from_numpy(starts // block_size)
    per_block = slots.view(-1, block_size)
    starts = per_block[:, :1]
    offsets = _block_offsets(block_size, slots.device, slots.dtype)
    if not bool(((starts % block_size == 0) & (per_block - starts == offsets).all(dim=1, keepdim=True)).all()):
        return None
    return starts.squeeze(1) // block_size


@functools.lru_cache(maxsize=64)
def _np_offsets(block_size: int) -> np.ndarray:
    return np.arange(block_size)


@functools.lru_cache(maxsize=64)
def _block_offsets(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(block_size, device=device, dtype=dtype)


@functools.lru_cache(maxsize=64)
def _frame_rows(device: torch.device, first: int, shape: tuple[int, ...],
                affine: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The slot-independent part of the row index: ``first`` plus, for each
    ``(position, stride in rows)``, an arange over that dim of ``shape``,
    broadcast. It depends only on the cache and the chunk's order, so it is
    built once per cache instead of on every call."""
    frame = torch.full([1] * len(shape), first, dtype=torch.int64, device=device)
    for position, stride in affine:
        view = [1] * len(shape)
        view[position] = shape[position]
        frame = frame + (torch.arange(shape[position], device=device) * stride).view(view)
    return frame


def _widest_int(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type that tiles a row and every tensor's start."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0 and all(t.storage_offset() * t.element_size() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def _copy_dims(group_shape: tuple[int, ...], group_stride: tuple[int, ...], chunk_shape: tuple[int, ...],
               chunk_stride: tuple[int, ...], order: tuple[int, ...], whole_blocks: bool) -> list[_Dim]:
    """The dims of the copy in the chunk's physical order (outermost first), size-1 dims left
    out but for the one the slot mapping maps; the token dim splits into (block, offset)
    when whole blocks are copied."""
    num_layers, kv, _, block_size, heads, head_size = group_shape
    s_layer, s_kv, s_block, s_offset, s_head, s_dim = group_stride
    num_tokens = chunk_shape[2]
    dims: list[_Dim] = []
    for logical in order:
        stride = chunk_stride[logical]
        if logical == 2:
            if whole_blocks:
                dims += [(num_tokens // block_size, stride * block_size, None), (block_size, stride, s_offset)]
            else:
                dims.append((num_tokens, stride, None))
            continue
        size, cache_stride = ((num_layers, s_layer), (kv, s_kv), None, (heads, s_head), (head_size, s_dim))[logical]
        dims.append((size, stride, cache_stride))
    return [dim for dim in dims if dim[0] > 1 or dim[2] is None]


# A row plan that does not depend on the slots: row length, the shape of the index
# (outer dims in the chunk's order), its affine terms, where the slot-mapped dim sits,
# and a block's and a block offset's stride in rows.
_StaticPlan = tuple[int, tuple[int, ...], tuple[tuple[int, int], ...], int, int, int]


def _row_plan(
    group: torch.Tensor, chunk: torch.Tensor, order: tuple[int, ...], slots: torch.Tensor,
    block_ids: torch.Tensor | None, chunks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(cache rows as an ``(N, row)`` tensor over the group's storage, the row index in
    the chunk's physical order as ``(chunks, rows per chunk)``, row length in elements), or
    None if no row fits. ``slots`` (and ``block_ids``) may cover ``chunks`` buffers alike in
    shape and layout, one after another: one plan for all of them (a request's chunks)."""
    static = _static_plan(tuple(group.shape), group.stride(), group.storage_offset(), tuple(chunk.shape),
                          chunk.stride(), order, block_ids is not None)
    if static is None:
        return None
    row, shape, affine, mapped, block_rows, offset_rows = static
    frame = _frame_rows(group.device, group.storage_offset() // row, shape, affine)
    if block_ids is not None:
        per_slot = block_ids * block_rows
    else:
        block_size = group.shape[3]
        per_slot = (slots // block_size) * block_rows + (slots % block_size) * offset_rows
    view = [chunks] + [1] * len(shape)
    view[1 + mapped] = shape[mapped]
    index = frame.unsqueeze(0) + per_slot.to(frame.device).view(view)
    storage_elems = group.untyped_storage().nbytes() // group.element_size()
    rows = group.as_strided((storage_elems // row, row), (row, 1), 0)
    return rows, index.reshape(chunks, -1), row


@functools.lru_cache(maxsize=256)
def _static_plan(group_shape: tuple[int, ...], group_stride: tuple[int, ...], base: int,
                 chunk_shape: tuple[int, ...], chunk_stride: tuple[int, ...], order: tuple[int, ...],
                 whole_blocks: bool) -> _StaticPlan | None:
    """The slot-independent part of `_row_plan`, from shapes and strides alone (cached:
    an engine moves chunks of a few shapes between the same caches)."""
    dims = _copy_dims(group_shape, group_stride, chunk_shape, chunk_stride, order, whole_blocks)
    _, _, s_block, s_offset, _, _ = group_stride
    # Row lengths the innermost dims can make, longest last: a dim joins while it
    # continues the row in the chunk and in the cache alike.
    lengths, inner = [1], 0
    for size, chunk_stride, cache_stride in reversed(dims):
        if cache_stride is None or chunk_stride != lengths[-1] or cache_stride != lengths[-1]:
            break
        lengths.append(lengths[-1] * size)
        inner += 1
    for merged in range(inner, 0, -1):
        row = lengths[merged]
        outer = dims[: len(dims) - merged]
        offsets = [base] + [cache for _, _, cache in outer if cache is not None]
        offsets += [s_block] + ([s_offset] if not whole_blocks else [])
        if all(offset % row == 0 for offset in offsets):
            break
    else:
        return None
    shape = tuple(size for size, _, _ in outer)
    affine = tuple((i, cache // row) for i, (_, _, cache) in enumerate(outer) if cache is not None)
    # The slot-mapped dim is never merged into a row, so it is always among the outer dims.
    (mapped,) = (i for i, (_, _, cache) in enumerate(outer) if cache is None)
    return row, shape, affine, mapped, s_block // row, s_offset // row


class _Job:
    """One copy cut into ``count`` pieces; whoever is free takes the next one."""

    def __init__(self, count: int, piece: Callable[[int], None]) -> None:
        self.count = count
        self.piece = piece
        self.next = 0
        self.busy = 0  # pieces helpers have in hand
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def work(self, helper: bool) -> int:
        """Take pieces until none is left; returns how many this thread copied."""
        done = 0
        while True:
            with self.cond:
                if self.next >= self.count or self.error is not None:
                    return done
                index = self.next
                self.next += 1
                self.busy += helper
            try:
                self.piece(index)
                done += 1
            except BaseException as exc:  # handed to the caller
                with self.cond:
                    self.error = self.error or exc
            finally:
                if helper:
                    with self.cond:
                        self.busy -= 1
                        self.cond.notify_all()

    def finish(self) -> None:
        """Called by the caller once it found no piece left: wait for pieces a helper holds."""
        with self.cond:
            self.cond.wait_for(lambda: self.busy == 0)
        if self.error is not None:
            raise self.error


def _helped() -> bool:
    """Whether a copy by this thread is shared with helpers: only the main thread's. A copy
    on a side thread (layerwise) already overlaps the model's compute, and a helper would
    take a core from it."""
    return USE_HELPER and threading.current_thread() is threading.main_thread()


class RowCopier:
    """Runs a CPU copy's pieces on the calling thread and, while they are free, helper threads.

    Once the helpers run (their start waits until each is on its cores), the caller never
    waits for one to take a piece: on a machine whose other cores are
    busy (another process, the inference engine's OpenMP threads) the caller does every
    piece itself, where a parallel region of torch's would wait for a core at its barrier
    (measured here: a gather of 64 rows took 8 ms with two OpenMP threads, 8 us with one).
    When cores are free, the helpers take their share. numpy releases the GIL while it
    copies. One helper per free core, at most ``MAX_HELPERS``.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._started = False
        #: The cores the helpers were placed on (None: their creator's).
        self.cores: list[int] | None = None
        self._lock = threading.Lock()
        #: Pieces copied since start, and of those by the helpers (benchmarks report the share).
        self.pieces = 0
        self.helper_pieces = 0

    def _serve(self, cores: set[int] | None, placed: threading.Event) -> None:
        if cores:
            set_thread_cores(cores)
        placed.set()
        while True:
            done = self._jobs.get().work(helper=True)
            with self._lock:
                self.helper_pieces += done

    def _start(self) -> None:
        cores = other_cores() if HELPER_AFFINITY == "free" else None
        self.cores = sorted(cores) if cores else None
        free = len(cores) if cores else max(1, len(os.sched_getaffinity(0)) - 1)
        for i in range(max(1, min(MAX_HELPERS, free))):
            placed = threading.Event()
            thread = threading.Thread(target=self._serve, args=(cores, placed), name=f"flowkv-copy-{i}",
                                      daemon=True)
            thread.start()
            placed.wait()  # once per process: no helper ever copies on the caller's core
            self._threads.append(thread)
        self._started = True

    @property
    def helpers(self) -> int:
        return len(self._threads)

    def pieces_for(self, nbytes: int) -> int:
        """How many pieces a copy of ``nbytes`` is cut into (see PIECE_BYTES)."""
        threads = 1 + (max(1, self.helpers) if _helped() else 0)
        count = max(2 * threads if threads > 1 else 1, -(-nbytes // PIECE_BYTES))
        return max(1, min(count, nbytes // MIN_PIECE_BYTES))

    def run(self, count: int, piece: Callable[[int], None]) -> None:
        job = _Job(count, piece)
        if count > 1 and _helped():
            with self._lock:
                if not self._started:
                    self._start()
            for _ in range(min(count - 1, self.helpers)):
                self._jobs.put(job)
        job.work(helper=False)
        job.finish()
        with self._lock:
            self.pieces += count


#: The copier the kernels use. Its helpers start with its first copy, placed by the thread
#: that makes it (`affinity.other_cores`); a benchmark swaps in a fresh one for each condition.
copier = RowCopier()


def _copy_rows_numpy(cache_rows: torch.Tensor, index: torch.Tensor, chunk_rows: torch.Tensor, *,
                     to_chunk: bool) -> None:
    """Rows ``index`` of ``cache_rows`` to/from consecutive rows of ``chunk_rows``, with numpy
    (CPU tensors of one integer type): one memcpy per row, in pieces (see `RowCopier`)."""
    cache, rows, chunk = cache_rows.numpy(), index.numpy(), chunk_rows.numpy()
    if rows.size and (rows.min() < 0 or rows.max() >= cache.shape[0]):  # "clip" below must never clip
        raise IndexError(f"row index out of range [0, {cache.shape[0]}): a kernel planning bug")
    row_bytes = max(1, chunk.shape[-1] * chunk.itemsize)
    if chunk.ndim == 3:
        # (chunks, rows, row) with gaps between the chunks: a piece is a run of whole chunks.
        # A gather takes one chunk at a time (numpy would buffer a take into a strided
        # ``out``); a scatter writes the run in one assignment (numpy reads the strided rows
        # as they are), one GIL release for the piece.
        chunks = chunk.shape[0]
        per_piece = -(-chunks // copier.pieces_for(rows.size * row_bytes))

        def run_of_chunks(i: int) -> None:
            part = slice(i * per_piece, (i + 1) * per_piece)
            if to_chunk:
                for j in range(*part.indices(chunks)):
                    np.take(cache, rows[j], axis=0, out=chunk[j], mode="clip")
            else:
                cache[rows[part]] = chunk[part]

        copier.run(-(-chunks // per_piece), run_of_chunks)
        return
    per_piece = -(-rows.size // copier.pieces_for(rows.size * row_bytes))
    count = -(-rows.size // per_piece)

    def piece(i: int) -> None:
        part = slice(i * per_piece, (i + 1) * per_piece)
        if to_chunk:
            np.take(cache, rows[part], axis=0, out=chunk[part], mode="clip")  # "raise" would buffer the output
        else:
            cache[rows[part]] = chunk[part]

    copier.run(count, piece)


def _gather_by_indexing(group: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    block_size = group.shape[3]
    out.copy_(group[:, :, slots // block_size, slots % block_size])


def _scatter_by_indexing(chunk: torch.Tensor, group: torch.Tensor, slots: torch.Tensor) -> None:
    block_size = group.shape[3]
    group[:, :, slots // block_size, slots % block_size] = chunk


def _physical(chunk: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """The chunk's order and its buffer in that order (contiguous)."""
    order = dense_order(chunk)
    if order is None:
        raise ValueError(f"chunk of strides {chunk.stride()} is not dense (a permutation of a contiguous buffer)")
    return order, chunk.permute(order)


def _move_dense(groups: list[LayerGroup], slots: torch.Tensor, chunk: torch.Tensor, *, to_chunk: bool) -> None:
    """Copy between every group and a dense ``chunk``, with no skipped slots:
    into ``chunk`` (gather) when ``to_chunk``, else into the cache (scatter)."""
    block_ids = whole_block_ids(slots, groups[0][1].shape[3])
    for first, group in groups:
        part = chunk[first : first + group.shape[0]]
        order, physical = _physical(part)
        plan = _row_plan(group, part, order, slots, block_ids)
        note_row_bytes((group.shape[-1] if plan is None else plan[2]) * group.element_size())
        if plan is None:
            if to_chunk:
                _gather_by_indexing(group, slots, part)
            else:
                _scatter_by_indexing(part, group, slots)
            continue
        rows, index, row = plan
        index = index.reshape(-1)
        bits = _widest_int(row * part.element_size(), part)
        cache_rows, chunk_rows = rows.view(bits), physical.reshape(-1, row).view(bits)
        numpy = cache_rows.device.type == "cpu" and row * part.element_size() >= NUMPY_MIN_ROW_BYTES
        if numpy and (NUMPY_GATHER or not to_chunk):
            _copy_rows_numpy(cache_rows, index, chunk_rows, to_chunk=to_chunk)
        elif to_chunk:
            torch.index_select(cache_rows, 0, index, out=chunk_rows)
        else:
            cache_rows.index_copy_(0, index, chunk_rows)


def _empty_in_order(like: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A chunk buffer like ``like`` (dense) with ``num_tokens`` tokens, laid out in its order."""
    order = dense_order(like)
    shape = list(like.shape)
    shape[2] = num_tokens
    buffer = like.new_empty([shape[d] for d in order])
    return buffer.permute(tuple(order.index(d) for d in range(like.dim())))


def gather_groups(groups: list[LayerGroup], slots: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the tokens at ``slots`` of every group into ``out`` (dense, logically
    ``(layers, kv, tokens, heads, head_size)``); slot -1 leaves its row of ``out`` as is."""
    skipped = slots < 0
    if not bool(skipped.any()):
        _move_dense(groups, slots, out, to_chunk=True)
        return
    kept = torch.nonzero(~skipped).squeeze(1)
    if kept.numel() == 0:
        return
    dense = _empty_in_order(out, kept.numel())
    _move_dense(groups, slots[kept], dense, to_chunk=True)
    out.index_copy_(2, kept, dense)


def scatter_groups(chunk: torch.Tensor, groups: list[LayerGroup], slots: torch.Tensor) -> None:
    """Write ``chunk`` (dense) into the cache at ``slots``; slot -1 writes nothing."""
    skipped = slots < 0
    if not bool(skipped.any()):
        _move_dense(groups, slots, chunk, to_chunk=False)
        return
    kept = torch.nonzero(~skipped).squeeze(1)
    if kept.numel() == 0:
        return
    dense = _empty_in_order(chunk, kept.numel())
    dense.copy_(chunk.index_select(2, kept))
    _move_dense(groups, slots[kept], dense, to_chunk=False)


def _joined_rows(slots: torch.Tensor, chunks: list[torch.Tensor], group: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For chunk buffers alike in shape and layout that lie a fixed distance apart in one
    storage (an arena hands out a request's chunks back to back; one layer of each, for a
    layerwise copy), and ``slots``, theirs one after another: (cache rows, the row index of all
    of them, their rows), or None when they cannot move as one copy. Buffers that follow each
    other give ``(N, row)`` rows and an index of N; buffers with gaps between them (one layer's
    slice of each chunk) give ``(chunks, rows per chunk, row)`` rows and a ``(chunks, rows per
    chunk)`` index."""
    first = chunks[0]
    order = dense_order(first)
    if order is None:
        return None
    nbytes = first.numel() * first.element_size()
    start = first.data_ptr()
    pitch = chunks[1].data_ptr() - start
    if pitch < nbytes:
        return None
    shape, stride = first.shape, first.stride()
    for i, chunk in enumerate(chunks):
        if chunk.data_ptr() != start + i * pitch or chunk.shape != shape or chunk.stride() != stride:
            return None
    # The strided view of them all below is made on the first one's storage: the last one's
    # bytes must lie inside it (then every one's do).
    storage = first.untyped_storage()
    if chunks[-1].data_ptr() + nbytes > storage.data_ptr() + storage.nbytes():
        return None
    # One plan for all of them: the chunks' slots one after another. Whole blocks are
    # whole blocks of each chunk when a chunk is whole blocks long (the runs align).
    block_size = group.shape[3]
    block_ids = whole_block_ids(slots, block_size) if first.shape[2] % block_size == 0 else None
    plan = _row_plan(group, first, order, slots, block_ids, chunks=len(chunks))
    if plan is None:
        return None
    rows_of, index, row = plan
    note_row_bytes(row * group.element_size())
    if pitch == nbytes:
        return rows_of, index.reshape(-1), first.as_strided((index.numel(), row), (row, 1), first.storage_offset())
    if pitch % (row * first.element_size()):
        return None
    joined = first.as_strided((len(chunks), index.shape[1], row), (pitch // first.element_size(), row, 1),
                              first.storage_offset())
    return rows_of, index, joined


def move_joined(groups: list[LayerGroup], slots: torch.Tensor, chunks: list[torch.Tensor], *,
                to_chunk: bool) -> bool:
    """Gather (``to_chunk``) or scatter ``chunks``, whose slots are ``slots`` one after another, as
    one copy, when the chunks follow each other in memory and move whole layer groups with no
    skipped slots; False (nothing moved) when they cannot."""
    if len(groups) != 1 or len(chunks) < 2:
        return False
    _, group = groups[0]
    if any(chunk.shape[0] != group.shape[0] for chunk in chunks):
        return False
    found = _joined_rows(slots, chunks, group)
    if found is None:
        return False
    rows, index, chunk_rows = found
    bits = _widest_int(chunk_rows.shape[-1] * chunk_rows.element_size(), chunk_rows)
    cache_rows, chunk_rows = rows.view(bits), chunk_rows.view(bits)
    row_bytes = chunk_rows.shape[-1] * chunk_rows.element_size()
    cpu = cache_rows.device.type == "cpu"
    if chunk_rows.dim() == 3:  # rows with gaps between chunks: numpy writes through the strided view
        if not cpu:
            return False
        _copy_rows_numpy(cache_rows, index, chunk_rows, to_chunk=to_chunk)
    elif cpu and row_bytes >= NUMPY_MIN_ROW_BYTES and (NUMPY_GATHER or not to_chunk):
        _copy_rows_numpy(cache_rows, index, chunk_rows, to_chunk=to_chunk)
    elif to_chunk:
        torch.index_select(cache_rows, 0, index, out=chunk_rows)
    else:
        cache_rows.index_copy_(0, index, chunk_rows)
    return True
