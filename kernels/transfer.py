"""gather / scatter: move tokens between the engine's paged KV cache and a chunk buffer.

Both check their arguments, group the layers (see ``torch_kv``), and hand the
copy to one implementation: ``"torch"`` (CPU and CUDA) or ``"triton"`` (CUDA,
or CPU under ``TRITON_INTERPRET=1``). By default CUDA tensors use Triton when
it imports, everything else uses torch.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import torch_kv
from .geometry import KVGeometry, as_layer_list, canonical_view, dense_order

__all__ = ["gather", "gather_many", "scatter", "scatter_many", "triton_available"]

KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]

# Whether `gather_many` / `scatter_many` join chunks that follow each other in memory into
# one copy (off: one call per chunk, as before they existed; for measuring the difference).
JOIN_CHUNKS = True


def triton_available() -> bool:
    """True when the Triton kernels import (Triton installed and importable)."""
    try:
        from . import triton_kv  # noqa: F401
    except ImportError:
        return False
    return True


def _choose_impl(impl: str | None, device: torch.device) -> str:
    if impl is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if impl not in ("torch", "triton"):
        raise ValueError(f"impl must be 'torch' or 'triton', got {impl!r}")
    if impl == "triton":
        if not triton_available():
            raise RuntimeError("impl='triton' was asked for but triton does not import")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got {device}"
            )
    return impl


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _layer_groups(layers: list[torch.Tensor], geometry: KVGeometry) -> list[torch_kv.LayerGroup]:
    """Split the layers into runs that are one strided tensor (same storage, dtype, shape
    and strides, storage offsets a fixed positive distance apart), each a canonical view
    with a leading layer dim. Only a run's first layer is checked against the geometry
    and viewed: the others equal it in everything but their offset."""
    groups: list[torch_kv.LayerGroup] = []
    start = 0
    while start < len(layers):
        first = layers[start]
        end, step = start + 1, 0
        while end < len(layers):
            layer = layers[end]
            distance = layer.storage_offset() - layers[end - 1].storage_offset()
            if (
                not _same_storage(first, layer)
                or layer.dtype != first.dtype
                or layer.stride() != first.stride()
                or layer.shape != first.shape
                or distance <= 0
                or (step and distance != step)
            ):
                break
            step = distance
            end += 1
        # A canonical view keeps its layer's storage offset, so the run's offsets step alike.
        view = canonical_view(first, geometry)
        group = view.as_strided((end - start, *view.shape), (step, *view.stride()), view.storage_offset())
        groups.append((start, group))
        start = end
    return groups


# Layer groups of recent caches: an engine passes the same tensors on every call. Keyed by
# the tensors' ids and checked through weak references, so that a cache is not mistaken for a
# new one at the same address. A group is a view of the cache and keeps its storage alive: the
# entry goes as soon as one of its layer tensors is dropped (an engine that shut down), or the
# stopped engine's whole KV pool would stay allocated in the process.
_GROUPS: dict[tuple[Any, ...], tuple[list[weakref.ref], list[torch_kv.LayerGroup]]] = {}
_GROUPS_KEPT = 16
_GROUPS_LOCK = threading.Lock()


def _cached_layer_groups(layers: list[torch.Tensor], geometry: KVGeometry) -> list[torch_kv.LayerGroup]:
    key = (geometry, tuple(map(id, layers)))
    hit = _GROUPS.get(key)
    if hit is not None and all(ref() is layer for ref, layer in zip(hit[0], layers)):
        return hit[1]
    groups = _layer_groups(layers, geometry)
    with _GROUPS_LOCK:
        if len(_GROUPS) >= _GROUPS_KEPT:
            _GROUPS.pop(next(iter(_GROUPS)))
        _GROUPS[key] = ([weakref.ref(layer, lambda _, key=key: _GROUPS.pop(key, None)) for layer in layers],
                        groups)
    return groups


def _prepare(
    kv_caches: KVCaches,
    geometry: KVGeometry,
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    layers: Sequence[int] | None,
    chunk_name: str,
) -> tuple[list[torch_kv.LayerGroup], torch.Tensor]:
    cache_layers, layer_ids = _layers(kv_caches, geometry, layers)
    _check_slot_mapping(slot_mapping)
    _check_chunk(chunk, geometry, len(layer_ids), slot_mapping.numel(), cache_layers[0].device, chunk_name)
    groups, slots, _ = _groups_and_slots(cache_layers, layer_ids, geometry, slot_mapping)
    return groups, slots


def _layers(kv_caches: KVCaches, geometry: KVGeometry,
            layers: Sequence[int] | None) -> tuple[list[torch.Tensor], list[int]]:
    cache_layers = as_layer_list(kv_caches)
    if len(cache_layers) != geometry.num_layers:
        raise ValueError(f"got {len(cache_layers)} KV layers, geometry has {geometry.num_layers}")
    if layers is None:
        return cache_layers, list(range(geometry.num_layers))
    layer_ids = [int(i) for i in layers]
    bad = [i for i in layer_ids if not 0 <= i < geometry.num_layers]
    if bad or not layer_ids:
        raise ValueError(f"layers {list(layers)} must be non-empty indices below {geometry.num_layers}")
    return cache_layers, layer_ids


def _check_slot_mapping(slot_mapping: torch.Tensor) -> None:
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise ValueError("slot_mapping must be a 1-D integer tensor")
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise ValueError(f"slot_mapping must hold integers, got {slot_mapping.dtype}")


def _check_chunk(chunk: torch.Tensor, geometry: KVGeometry, num_layers: int, num_tokens: int,
                 device: torch.device, chunk_name: str) -> None:
    expected = (num_layers, geometry.kv, num_tokens, geometry.num_kv_heads, geometry.head_size)
    if tuple(chunk.shape) != expected:
        raise ValueError(f"{chunk_name} has shape {tuple(chunk.shape)}, expected {expected}")
    # A chunk buffer on the CPU (the engine's arena) with a cache on a GPU moves
    # through a staging buffer on the cache's device; any other pairing is a mistake.
    if chunk.dtype != geometry.dtype or (chunk.device != device and chunk.device.type != "cpu"):
        raise ValueError(
            f"{chunk_name} is {chunk.dtype} on {chunk.device}; the cache is {geometry.dtype} on {device}"
        )
    order = dense_order(chunk)
    # Layers outermost: a layer group's slice of the chunk is then dense too. The head
    # dim innermost: every row the kernels copy is made of whole heads.
    sized = [d for d in order or () if chunk.shape[d] > 1]
    if order is None or (chunk.shape[0] > 1 and sized[0] != 0) or (chunk.shape[4] > 1 and sized[-1] != 4):
        raise ValueError(f"{chunk_name} must be a contiguous buffer in some order of its dims, layers "
                         f"outermost and head_size innermost (got shape {tuple(chunk.shape)}, "
                         f"strides {chunk.stride()})")


def _groups_and_slots(cache_layers: list[torch.Tensor], layer_ids: list[int], geometry: KVGeometry,
                      slot_mapping: torch.Tensor) -> tuple[list[torch_kv.LayerGroup], torch.Tensor, int]:
    """The layer groups, the slots as int64 on the cache's device, and the lowest slot (-1: some
    are skipped; 0 when there are none), the slots checked against the cache's size."""
    device = cache_layers[0].device
    groups = _cached_layer_groups([cache_layers[i] for i in layer_ids], geometry)
    num_blocks = groups[0][1].shape[2]
    if any(group.shape[2] != num_blocks for _, group in groups):
        raise ValueError(f"KV layers hold different numbers of blocks: {[group.shape[2] for _, group in groups]}")
    low = 0
    if slot_mapping.numel():
        # Checked where the slots are (on the host, as the engine passes them):
        # checking after the move to a GPU would wait for the device on every call.
        slots_per_layer = num_blocks * geometry.block_size
        low, high = (int(v) for v in torch.aminmax(slot_mapping))
        if low < -1 or high >= slots_per_layer:
            raise ValueError(
                f"slot_mapping holds slots in [{low}, {high}]; valid slots are -1 "
                f"(skip) and 0..{slots_per_layer - 1} ({num_blocks} blocks of {geometry.block_size})"
            )
    return groups, slot_mapping.to(device=device, dtype=torch.int64), low


def gather(
    kv_caches: KVCaches,
    geometry: KVGeometry,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Copy the tokens at ``slot_mapping`` out of the paged cache into ``out``.

    ``out`` has the logical shape ``geometry.chunk_shape(len(slot_mapping))``
    (or ``len(layers)`` in dim 0 when only ``layers``, indices into
    ``kv_caches``, are gathered) and is a contiguous buffer in some order of
    its dims, layers outermost and head_size innermost; in
    ``geometry.chunk_order`` the copies are longest (``geometry.empty_chunk``
    makes one). A slot of -1 leaves that token's row of
    ``out`` untouched. ``out`` may be on the CPU while the cache is on a GPU
    (the tokens then pass through a buffer on the GPU). Returns ``out``.

    >>> from flowkv._testing.paged import make_paged_kv, random_slot_mapping
    >>> g = KVGeometry("cpu", 2, 2, 64, 32, torch.float32)
    >>> caches = make_paged_kv(g, num_blocks=8, seed=0)
    >>> slots = random_slot_mapping(40, g, 8, seed=1)
    >>> gather(caches, g, slots, g.empty_chunk(40)).shape
    torch.Size([2, 2, 40, 2, 64])
    """
    groups, slots = _prepare(kv_caches, geometry, slot_mapping, out, layers, "out")
    if slots.numel() == 0:
        return out
    device = slots.device
    target = out
    if out.device != device:
        # Rows of skipped slots must keep what ``out`` holds.
        target = out.to(device) if bool((slots < 0).any()) else torch.empty_like(out, device=device)
    if _choose_impl(impl, device) == "triton":
        from . import triton_kv

        triton_kv.gather_groups(groups, slots, target)
    else:
        torch_kv.gather_groups(groups, slots, target)
    if target is not out:
        out.copy_(target)
    return out


def scatter(
    chunk: torch.Tensor,
    kv_caches: KVCaches,
    geometry: KVGeometry,
    slot_mapping: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
    impl: str | None = None,
) -> None:
    """Write ``chunk`` (as made by :func:`gather`) into the paged cache at
    ``slot_mapping``; a slot of -1 writes nothing. Two tokens with one slot
    leave either value there. ``chunk`` may be on the CPU while the cache is
    on a GPU (it is copied to the GPU first)."""
    groups, slots = _prepare(kv_caches, geometry, slot_mapping, chunk, layers, "chunk")
    if slots.numel() == 0:
        return
    chunk = chunk.to(slots.device)
    if _choose_impl(impl, slots.device) == "triton":
        from . import triton_kv

        triton_kv.scatter_groups(chunk, groups, slots)
    else:
        torch_kv.scatter_groups(chunk, groups, slots)


def _joinable(kv_caches: KVCaches, geometry: KVGeometry, parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
              layers: Sequence[int] | None, impl: str | None, name: str
              ) -> tuple[list[torch_kv.LayerGroup], torch.Tensor, list[torch.Tensor]] | None:
    """The layer groups, every part's slots one after another (int64) and the parts' buffers, for
    moving ``parts`` as one copy, checked as `gather` checks one call (the slots all at once), or
    None when they must move one by one (a GPU cache, Triton, a skipped slot)."""
    if len(parts) < 2 or not JOIN_CHUNKS:
        return None
    cache_layers, layer_ids = _layers(kv_caches, geometry, layers)
    if cache_layers[0].device.type != "cpu" or _choose_impl(impl, cache_layers[0].device) != "torch":
        return None
    first_slots, first = parts[0]
    for slot_mapping, chunk in parts:
        _check_slot_mapping(slot_mapping)
        if slot_mapping.device.type != "cpu":
            return None
        if chunk is not first and (chunk.shape == first.shape and chunk.stride() == first.stride()
                                   and chunk.dtype == first.dtype and chunk.device == first.device
                                   and slot_mapping.numel() == first_slots.numel()):
            continue  # alike the first in everything `_check_chunk` reads: checked once
        _check_chunk(chunk, geometry, len(layer_ids), slot_mapping.numel(), cache_layers[0].device, name)
    joined = torch.cat([slot_mapping for slot_mapping, _ in parts])
    groups, joined, low = _groups_and_slots(cache_layers, layer_ids, geometry, joined)
    if joined.numel() == 0 or low < 0:
        return None
    return groups, joined, [chunk for _, chunk in parts]


def gather_many(
    kv_caches: KVCaches,
    geometry: KVGeometry,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    layers: Sequence[int] | None = None,
    impl: str | None = None,
) -> None:
    """`gather` of every ``(slot_mapping, out)`` in ``parts``, as one copy where it can.

    A request's chunks land in buffers an arena hands out back to back: when
    the ``out`` buffers follow each other in memory, alike in shape and
    layout, on the CPU, with no skipped slot, they move in one kernel call
    (one index over all their rows) instead of one call per chunk; otherwise
    each part is a `gather` of its own.

    >>> from flowkv._testing.paged import make_paged_kv, random_slot_mapping
    >>> g = KVGeometry("cpu", 2, 2, 64, 32, torch.float32)
    >>> caches = make_paged_kv(g, num_blocks=8, seed=0)
    >>> slots = random_slot_mapping(64, g, 8, seed=1)
    >>> flat = torch.empty(2 * math.prod(g.chunk_shape(32)))
    >>> outs = [half.view(tuple(g.chunk_shape(32))) for half in flat.chunk(2)]  # back to back
    >>> gather_many(caches, g, [(slots[:32], outs[0]), (slots[32:], outs[1])])
    >>> torch.equal(torch.cat(outs, dim=2), gather(caches, g, slots, g.empty_chunk(64)))
    True
    """
    joinable = _joinable(kv_caches, geometry, parts, layers, impl, "out")
    if joinable is not None and torch_kv.move_joined(*joinable, to_chunk=True):
        return
    for slot_mapping, out in parts:
        gather(kv_caches, geometry, slot_mapping, out, layers=layers, impl=impl)


def scatter_many(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    kv_caches: KVCaches,
    geometry: KVGeometry,
    *,
    layers: Sequence[int] | None = None,
    impl: str | None = None,
) -> None:
    """`scatter` of every ``(slot_mapping, chunk)`` in ``parts``, as one copy where it can (see
    `gather_many`)."""
    joinable = _joinable(kv_caches, geometry, parts, layers, impl, "chunk")
    if joinable is not None and torch_kv.move_joined(*joinable, to_chunk=False):
        return
    for slot_mapping, chunk in parts:
        scatter(chunk, kv_caches, geometry, slot_mapping, layers=layers, impl=impl)
