"""flowkv.kernels Triton kernels equal the torch ones, run on CPU tensors under
Triton's interpreter (slow: sizes stay small)."""

from __future__ import annotations

import importlib
import os

# The interpreter is chosen when a kernel is decorated, so this must precede
# any import of triton or of flowkv.kernels.triton_kv.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton does not import; the Triton kernels cannot be tested")

from flowkv._testing.paged import make_paged_kv, random_slot_mapping  # noqa: E402
from flowkv.kernels import KVGeometry, gather, scatter  # noqa: E402

NUM_BLOCKS = 6


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels():
    # Another test module may have imported the kernels compiled for CUDA first.
    from flowkv.kernels import triton_kv

    importlib.reload(triton_kv)
    yield


def run_both(g: KVGeometry, slots: torch.Tensor, layers=None, *, shared_storage=True):
    """Gather and scatter with each implementation; return both results."""
    source = make_paged_kv(g, NUM_BLOCKS, seed=11, shared_storage=shared_storage)
    n_layers = g.num_layers if layers is None else len(layers)
    shape = (n_layers,) + g.chunk_shape(len(slots))[1:]
    results = {}
    for impl in ("torch", "triton"):
        chunk = gather(source, g, slots, torch.full(shape, 3.0, dtype=g.dtype), layers=layers, impl=impl)
        restored = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False, shared_storage=shared_storage)
        scatter(chunk, restored, g, slots, layers=layers, impl=impl)
        results[impl] = (chunk, restored)
    return results


def assert_same(results) -> None:
    torch_chunk, torch_cache = results["torch"]
    triton_chunk, triton_cache = results["triton"]
    assert torch.equal(triton_chunk.view(torch.uint8), torch_chunk.view(torch.uint8))
    for a, b in zip(triton_cache, torch_cache, strict=True):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "layout", ["cpu", "flash_kv_nhd", "flash_kv_hnd", "flash_blocks_nhd", "flash_blocks_hnd", "mla"]
)
def test_triton_matches_torch(layout, dtype):
    g = KVGeometry(layout, 2, 1 if layout == "mla" else 2, 16, 8, dtype)
    slots = random_slot_mapping(13, g, NUM_BLOCKS, seed=1)  # a partial last block
    slots[4] = -1
    results = run_both(g, slots)
    assert_same(results)
    chunk = results["triton"][0]
    assert bool((chunk[:, :, 4] == 3.0).all()), "a skipped slot's row of out was written"
    assert not bool((chunk[:, :, 5] == 3.0).all())


@pytest.mark.parametrize("layout", ["cpu", "flash_blocks_nhd"])
def test_triton_layer_subsets_and_separate_tensors(layout):
    g = KVGeometry(layout, 3, 2, 16, 8, torch.float16)
    slots = random_slot_mapping(16, g, NUM_BLOCKS, seed=2)
    assert_same(run_both(g, slots, layers=[2, 0]))
    assert_same(run_both(g, slots, layers=[1, 2], shared_storage=False))


def test_triton_odd_head_counts_are_masked():
    # Neither heads nor head size a power of two: the kernel's tiles overhang.
    g = KVGeometry("flash_kv_hnd", 1, 3, 24, 8, torch.float16)
    assert_same(run_both(g, random_slot_mapping(9, g, NUM_BLOCKS, seed=3)))


@pytest.mark.parametrize(
    "layout", ["cpu", "flash_kv_nhd", "flash_kv_hnd", "flash_blocks_nhd", "flash_blocks_hnd", "mla"]
)
def test_triton_reads_and_writes_chunks_in_the_geometry_format(layout):
    """The chunk buffer in ``KVGeometry.chunk_order`` (strided logical view): Triton equals torch."""
    g = KVGeometry(layout, 2, 1 if layout == "mla" else 2, 16, 8, torch.bfloat16)
    slots = random_slot_mapping(16, g, NUM_BLOCKS, seed=4)
    source = make_paged_kv(g, NUM_BLOCKS, seed=12)
    chunks, caches = {}, {}
    for impl in ("torch", "triton"):
        chunk = g.empty_chunk(len(slots))
        chunks[impl] = gather(source, g, slots, chunk, impl=impl)
        assert chunks[impl].stride() == g.empty_chunk(len(slots)).stride()
        caches[impl] = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False)
        scatter(chunks[impl], caches[impl], g, slots, impl=impl)
    assert_same({impl: (chunks[impl], caches[impl]) for impl in chunks})
    assert torch.equal(chunks["torch"], gather(source, g, slots, torch.empty(tuple(g.chunk_shape(16)), dtype=g.dtype)))
