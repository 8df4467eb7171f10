"""Throughput of gather/scatter against a plain copy of the same bytes, measured in one run."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .geometry import KVGeometry
from .transfer import gather, scatter

__all__ = ["bench_gather_scatter", "copy_gbps"]

_copy_gbps: float | None = None


def _best_seconds(step: Callable[[], object], repeats: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up: first-touch page faults, kernel compilation
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def bench_gather_scatter(
    geometry: KVGeometry | None = None,
    *,
    num_tokens: int = 8192,
    num_blocks: int | None = None,
    device: str | torch.device = "cpu",
    impl: str | None = None,
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, float]:
    """Gather and scatter ``num_tokens`` tokens of a synthetic paged cache whose
    blocks are in random order, into and out of a chunk buffer in the geometry's
    format, and a plain ``copy_`` of the same bytes.

    The default geometry is 8 layers x 8 KV heads x head 128, bf16, block 16,
    ``cpu`` layout. Returns GB/s (``gather_gbps``, ``scatter_gbps``,
    ``copy_gbps``), the ratios to the copy (``gather_vs_copy``,
    ``scatter_vs_copy``) and ``bytes`` moved per direction. Times are the best
    of ``repeats`` runs.
    """
    from flowkv._testing.paged import make_paged_kv, random_slot_mapping

    if geometry is None:
        geometry = KVGeometry("cpu", 8, 8, 128, 16, torch.bfloat16)
    device = torch.device(device)
    blocks_needed = -(-num_tokens // geometry.block_size)
    num_blocks = num_blocks or 2 * blocks_needed
    caches = make_paged_kv(geometry, num_blocks, seed=seed, device=device)
    slots = random_slot_mapping(num_tokens, geometry, num_blocks, seed=seed + 1).to(device)
    chunk = geometry.empty_chunk(num_tokens, device=device)
    copy_src = torch.empty_like(chunk)
    nbytes = chunk.numel() * chunk.element_size()

    seconds = {
        "copy": _best_seconds(lambda: chunk.copy_(copy_src), repeats, device),
        "gather": _best_seconds(lambda: gather(caches, geometry, slots, chunk, impl=impl), repeats, device),
        "scatter": _best_seconds(lambda: scatter(chunk, caches, geometry, slots, impl=impl), repeats, device),
    }
    gbps = {name: nbytes / s / 1e9 for name, s in seconds.items()}
    return {
        "bytes": float(nbytes),
        "copy_gbps": gbps["copy"],
        "gather_gbps": gbps["gather"],
        "scatter_gbps": gbps["scatter"],
        "gather_vs_copy": gbps["gather"] / gbps["copy"],
        "scatter_vs_copy": gbps["scatter"] / gbps["copy"],
    }


def copy_gbps(nbytes: int = 64 << 20, repeats: int = 3, *, cached: bool = True) -> float:
    """This machine's copy bandwidth in GB/s: the best of ``repeats`` torch copies of
    ``nbytes`` between two buffers already written (with torch's threads, as the
    kernels run). The first answer is kept for the process unless ``cached`` is False:
    it is the yardstick traces compare transfers with, measured once at start.

    >>> copy_gbps(1 << 20, cached=False) > 0
    True
    """
    global _copy_gbps
    if cached and _copy_gbps is not None:
        return _copy_gbps
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    gbps = nbytes / _best_seconds(lambda: dst.copy_(src), repeats, torch.device("cpu")) / 1e9
    if cached:
        _copy_gbps = gbps
    return gbps
