"""flowkv.kernels: moving KV between an engine's paged cache and flowkv's chunk buffers.

>>> import torch
>>> from flowkv.kernels import KVGeometry, gather, scatter
>>> from flowkv._testing.paged import make_paged_kv, random_slot_mapping
>>> g = KVGeometry("flash_kv_nhd", 2, 4, 64, 16, torch.float16)
>>> src, dst = make_paged_kv(g, 8, seed=0), make_paged_kv(g, 8, seed=0, fill=False)
>>> slots = random_slot_mapping(50, g, 8, seed=3)
>>> chunk = gather(src, g, slots, g.empty_chunk(50))
>>> scatter(chunk, dst, g, slots)
"""

from .bench import bench_gather_scatter, copy_gbps
from .geometry import LAYOUTS, ChunkShape, KVGeometry, canonical_view, dense_order, detect_layout
from .packed_cpu import PackedBlockLayout, PackingError
from .probe import TransferProbe
from .transfer import gather, gather_many, scatter, scatter_many, triton_available

__all__ = [
    "LAYOUTS",
    "ChunkShape",
    "KVGeometry",
    "PackedBlockLayout",
    "PackingError",
    "TransferProbe",
    "bench_gather_scatter",
    "canonical_view",
    "copy_gbps",
    "dense_order",
    "detect_layout",
    "gather",
    "gather_many",
    "scatter",
    "scatter_many",
    "triton_available",
]
