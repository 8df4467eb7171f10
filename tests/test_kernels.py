"""flowkv.kernels: geometry, layout detection, and torch gather/scatter for every layout.

Results are checked against a per-token reference written here from the
layout table, independent of the kernels' own canonical views.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flowkv._testing.paged import make_paged_kv, random_slot_mapping
from flowkv.kernels import LAYOUTS, KVGeometry, bench_gather_scatter, canonical_view, detect_layout, gather, scatter

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NUM_BLOCKS = 12


def geometry_for(layout: str, dtype=torch.bfloat16, *, num_layers=3, heads=4, head_size=32, block_size=16):
    return KVGeometry(layout, num_layers, 1 if layout == "mla" else heads, head_size, block_size, dtype)


def token_view(layer: torch.Tensor, layout: str, slot: int, block_size: int, head_size: int) -> torch.Tensor:
    """One token of one layer as a writable (kv, heads, head_size) view, read
    straight off the layout table."""
    block, offset = divmod(slot, block_size)
    if layout == "cpu":
        return layer[block, :, offset].unflatten(-1, (2, head_size)).transpose(0, 1)
    if layout == "flash_kv_nhd":
        return layer[:, block, offset]
    if layout == "flash_kv_hnd":
        return layer[:, block, :, offset]
    if layout == "flash_blocks_nhd":
        return layer[block, :, offset]
    if layout == "flash_blocks_hnd":
        return layer[block, :, :, offset]
    assert layout == "mla"
    return layer[block, offset].view(1, 1, head_size)


def reference_gather(caches, g: KVGeometry, slots, layers=None) -> torch.Tensor:
    layers = range(g.num_layers) if layers is None else layers
    chunk = torch.zeros((len(layers),) + g.chunk_shape(len(slots))[1:], dtype=g.dtype)
    for i, layer in enumerate(layers):
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                chunk[i, :, t] = token_view(caches[layer], g.layout, slot, g.block_size, g.head_size)
    return chunk


def reference_scatter(chunk, caches, g: KVGeometry, slots, layers=None) -> None:
    layers = range(g.num_layers) if layers is None else layers
    for i, layer in enumerate(layers):
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                token_view(caches[layer], g.layout, slot, g.block_size, g.head_size).copy_(chunk[i, :, t])


def assert_caches_equal(got, want) -> None:
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"layer {index} differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", [64, 50], ids=["whole-blocks", "partial-last-block"])
def test_round_trip_is_bitwise(layout, dtype, num_tokens):
    g = geometry_for(layout, dtype)
    source = make_paged_kv(g, NUM_BLOCKS, seed=1)
    slots = random_slot_mapping(num_tokens, g, NUM_BLOCKS, seed=2)

    chunk = gather(source, g, slots, torch.empty(g.chunk_shape(num_tokens), dtype=dtype))
    assert torch.equal(chunk, reference_gather(source, g, slots))

    restored = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False)
    scatter(chunk, restored, g, slots)
    expected = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False)
    reference_scatter(chunk, expected, g, slots)
    assert_caches_equal(restored, expected)
    # Every gathered token came back; nothing else was written.
    assert torch.equal(gather(restored, g, slots, torch.empty_like(chunk)), chunk)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_skipped_slots_are_neither_read_nor_written(layout):
    g = geometry_for(layout)
    source = make_paged_kv(g, NUM_BLOCKS, seed=3)
    slots = random_slot_mapping(40, g, NUM_BLOCKS, seed=4)
    slots[[0, 17, 39]] = -1
    sentinel = torch.full(g.chunk_shape(40), 5.0, dtype=g.dtype)

    chunk = gather(source, g, slots, sentinel.clone())
    assert torch.equal(chunk[:, :, [0, 17, 39]], sentinel[:, :, [0, 17, 39]])
    assert torch.equal(chunk, reference_gather(source, g, slots) + (slots < 0).view(1, 1, -1, 1, 1) * 5.0)

    restored = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False)
    scatter(chunk, restored, g, slots)
    expected = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False)
    reference_scatter(chunk, expected, g, slots)
    assert_caches_equal(restored, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dropped_cache_is_freed_though_its_layer_groups_were_cached(layout):
    """The transfers keep each recent cache's layer groups (views of it) for the next call: once the
    engine drops its cache, those go too, or a stopped engine's KV pool stays allocated."""
    import gc
    import weakref

    g = geometry_for(layout)
    caches = make_paged_kv(g, NUM_BLOCKS, seed=5)
    storage = caches[0]._base if caches[0]._base is not None else caches[0]  # what holds the memory
    freed = weakref.ref(storage)
    del storage
    slots = random_slot_mapping(16, g, NUM_BLOCKS, seed=6)
    chunk = gather(caches, g, slots, torch.empty(g.chunk_shape(16), dtype=g.dtype))
    scatter(chunk, caches, g, slots)
    assert freed() is not None
    del caches
    gc.collect()
    assert freed() is None


def test_all_slots_skipped_is_a_no_op():
    g = geometry_for("cpu")
    source = make_paged_kv(g, NUM_BLOCKS, seed=3)
    out = torch.full(g.chunk_shape(4), 2.0, dtype=g.dtype)
    gather(source, g, torch.full((4,), -1), out)
    assert bool((out == 2.0).all())
    scatter(out, source, g, torch.full((4,), -1))
    assert_caches_equal(source, make_paged_kv(g, NUM_BLOCKS, seed=3))


@pytest.mark.parametrize("layout", ["cpu", "flash_kv_nhd", "flash_blocks_hnd", "mla"])
@pytest.mark.parametrize("layers", [[1], [0, 2], [2, 1], [1, 2]], ids=str)
@pytest.mark.parametrize("shared_storage", [True, False], ids=["one-buffer", "per-layer-tensors"])
def test_layer_subsets(layout, layers, shared_storage):
    g = geometry_for(layout)
    source = make_paged_kv(g, NUM_BLOCKS, seed=5, shared_storage=shared_storage)
    slots = random_slot_mapping(48, g, NUM_BLOCKS, seed=6)
    out = torch.empty((len(layers),) + g.chunk_shape(48)[1:], dtype=g.dtype)
    gather(source, g, slots, out, layers=layers)
    assert torch.equal(out, reference_gather(source, g, slots, layers))

    restored = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False, shared_storage=shared_storage)
    scatter(out, restored, g, slots, layers=layers)
    expected = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False)
    reference_scatter(out, expected, g, slots, layers)
    assert_caches_equal(restored, expected)


def assert_round_trip_into_zeros(source, g: KVGeometry, slots) -> None:
    """Gather from ``source``, scatter into zeroed caches (``zeros_like``): both equal the reference."""
    chunk = gather(source, g, slots, torch.empty(g.chunk_shape(len(slots)), dtype=g.dtype))
    assert torch.equal(chunk, reference_gather(source, g, slots))
    restored = [torch.zeros_like(t) for t in source]
    scatter(chunk, restored, g, slots)
    expected = [torch.zeros_like(t) for t in source]
    reference_scatter(chunk, expected, g, slots)
    assert_caches_equal(restored, expected)


def blocks_outermost_caches(g: KVGeometry, seed: int) -> list[torch.Tensor]:
    """Layers interleaved inside each block of one buffer (vLLM's BL* layouts):
    each layer a strided, non-contiguous view."""
    per_layer = g.layer_shape(NUM_BLOCKS)
    generator = torch.Generator().manual_seed(seed)
    buffer = torch.randn((NUM_BLOCKS, g.num_layers, *per_layer[1:]), generator=generator).to(g.dtype)
    return [buffer[:, i] for i in range(g.num_layers)]


@pytest.mark.parametrize("layout", ["cpu", "flash_blocks_nhd", "flash_blocks_hnd", "mla"])
def test_strided_layers_blocks_outermost(layout):
    g = geometry_for(layout)
    source = blocks_outermost_caches(g, seed=7)
    assert not source[0].is_contiguous()
    assert_round_trip_into_zeros(source, g, random_slot_mapping(64, g, NUM_BLOCKS, seed=8))


def test_head_dim_not_contiguous_uses_indexing_path():
    g = geometry_for("flash_kv_nhd")
    physical = torch.randn(g.num_layers, 2, NUM_BLOCKS, g.block_size, g.head_size, g.num_kv_heads).to(g.dtype)
    source = [layer.transpose(-1, -2) for layer in physical]  # logical (2, nb, bs, H, D), dim stride H
    assert_round_trip_into_zeros(source, g, random_slot_mapping(30, g, NUM_BLOCKS, seed=9))


def test_dict_of_layers_keeps_insertion_order():
    g = geometry_for("cpu")
    source = make_paged_kv(g, NUM_BLOCKS, seed=10)
    named = {f"model.layers.{i}.self_attn": t for i, t in zip([2, 0, 1], source)}
    slots = random_slot_mapping(20, g, NUM_BLOCKS, seed=11)
    chunk = gather(named, g, slots, torch.empty(g.chunk_shape(20), dtype=g.dtype))
    assert torch.equal(chunk, reference_gather(source, g, slots))
    assert detect_layout(named, num_kv_heads=4, head_size=32).num_layers == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_chunk_with_a_gpu_cache_moves_through_the_gpu(layout):
    """The engine's arena is host memory: gather into it and scatter from it with a GPU cache."""
    g = geometry_for(layout)
    source = make_paged_kv(g, NUM_BLOCKS, seed=3, device="cuda")
    slots = random_slot_mapping(40, g, NUM_BLOCKS, seed=4)
    slots[[0, 17, 39]] = -1
    host = torch.full(g.chunk_shape(40), 5.0, dtype=g.dtype).pin_memory()
    gather(source, g, slots, host)
    on_gpu = gather(source, g, slots, torch.full(g.chunk_shape(40), 5.0, dtype=g.dtype, device="cuda"))
    assert torch.equal(host, on_gpu.cpu())

    restored = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False, device="cuda")
    expected = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False, device="cuda")
    scatter(host, restored, g, slots)
    scatter(on_gpu, expected, g, slots)
    assert_caches_equal(restored, expected)


def test_bad_arguments_are_reported():
    g = geometry_for("cpu")
    caches = make_paged_kv(g, NUM_BLOCKS, seed=0)
    slots = random_slot_mapping(20, g, NUM_BLOCKS, seed=0)
    out = torch.empty(g.chunk_shape(20), dtype=g.dtype)
    with pytest.raises(ValueError, match=r"expected \(3, 2, 20, 4, 32\)"):
        gather(caches, g, slots, torch.empty(g.chunk_shape(21), dtype=g.dtype))
    with pytest.raises(ValueError, match="bfloat16"):
        gather(caches, g, slots, out.float())
    with pytest.raises(ValueError, match="valid slots"):
        gather(caches, g, torch.full((20,), NUM_BLOCKS * g.block_size), out)
    with pytest.raises(ValueError, match="valid slots"):
        scatter(out, caches, g, torch.full((20,), -2))
    with pytest.raises(ValueError, match="got 2 KV layers"):
        gather(caches[:2], g, slots, out)
    with pytest.raises(ValueError, match="layers"):
        gather(caches, g, slots, out[:1], layers=[3])
    with pytest.raises(ValueError, match="1-D"):
        gather(caches, g, slots.view(2, 10), out)
    with pytest.raises(ValueError, match="contiguous"):
        gather(caches, g, slots, out.transpose(3, 4).contiguous().transpose(3, 4))
    with pytest.raises(ValueError, match="impl"):
        gather(caches, g, slots, out, impl="cuda")
    with pytest.raises(ValueError, match="does not match layout"):
        gather(make_paged_kv(geometry_for("flash_kv_nhd"), NUM_BLOCKS, seed=0), g, slots, out)
    # A layer unlike the one before it starts its own group and is checked on its own.
    with pytest.raises(ValueError, match="KV layer dtype torch.float32"):
        gather(caches[:2] + [caches[2].float()], g, slots, out)
    with pytest.raises(ValueError, match="different numbers of blocks"):
        gather(caches[:2] + [caches[2][:4]], g, slots, out)


def test_geometry_shapes_and_sizes():
    g = KVGeometry("flash_kv_hnd", 8, 8, 128, 16, torch.bfloat16)
    assert g.kv == 2
    assert g.chunk_shape(256) == (8, 2, 256, 8, 128)
    assert g.token_bytes == 8 * 2 * 8 * 128 * 2
    mla = KVGeometry("mla", 4, 1, 576, 64, torch.float16)
    assert mla.kv == 1
    assert mla.chunk_shape(10) == (4, 1, 10, 1, 576)
    assert mla.token_bytes == 4 * 576 * 2
    with pytest.raises(ValueError, match="one latent head"):
        KVGeometry("mla", 4, 8, 576, 64, torch.float16)
    with pytest.raises(ValueError, match="unknown KV layout 'paged'"):
        KVGeometry("paged", 4, 8, 128, 16, torch.float16)
    with pytest.raises(ValueError, match="block_size"):
        KVGeometry("cpu", 4, 8, 128, 0, torch.float16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_detect_layout_on_each_layout(layout):
    g = geometry_for(layout, torch.float16)
    caches = make_paged_kv(g, NUM_BLOCKS, seed=0)
    assert detect_layout(caches, num_kv_heads=4, head_size=32) == g
    assert detect_layout(caches, num_kv_heads=4, head_size=32, block_size=16) == g


def test_detect_layout_errors_name_the_shape():
    unknown = [torch.zeros(3, 7, 16, 32)]
    with pytest.raises(ValueError, match=r"\(3, 7, 16, 32\) fits no known KV layout"):
        detect_layout(unknown, num_kv_heads=4, head_size=32)
    caches = make_paged_kv(geometry_for("cpu"), NUM_BLOCKS, seed=0)
    with pytest.raises(ValueError, match="fits no known KV layout"):
        detect_layout(caches, num_kv_heads=4, head_size=32, block_size=32)
    with pytest.raises(ValueError, match="layers disagree"):
        detect_layout([caches[0], caches[1][:4]], num_kv_heads=4, head_size=32)
    with pytest.raises(ValueError, match="empty"):
        detect_layout([], num_kv_heads=4, head_size=32)


def test_detect_layout_ambiguity_needs_a_hint():
    # 16 heads and block size 16: NHD and HND shapes are the same.
    g = KVGeometry("flash_kv_hnd", 2, 16, 64, 16, torch.float16)
    caches = make_paged_kv(g, 4, seed=0)
    with pytest.raises(ValueError, match=r"ambiguous between \['flash_kv_hnd', 'flash_kv_nhd'\]"):
        detect_layout(caches, num_kv_heads=16, head_size=64)
    assert detect_layout(caches, num_kv_heads=16, head_size=64, backend_hint="HND").layout == "flash_kv_hnd"
    assert detect_layout(caches, num_kv_heads=16, head_size=64, backend_hint="LBNHC").layout == "flash_kv_nhd"
    # Two blocks: flash-attn (2, nb, ...) and flashinfer (nb, 2, ...) look alike too.
    two_blocks = [torch.zeros(2, 2, 16, 4, 64)]
    with pytest.raises(ValueError, match="ambiguous"):
        detect_layout(two_blocks, num_kv_heads=4, head_size=64)
    assert detect_layout(two_blocks, num_kv_heads=4, head_size=64, backend_hint="FLASHINFER").layout == (
        "flash_blocks_nhd"
    )
    assert detect_layout(two_blocks, num_kv_heads=4, head_size=64, backend_hint=["FLASH_ATTN", "NHD"]).layout == (
        "flash_kv_nhd"
    )
    # A hint never overrides an unambiguous shape.
    cpu = make_paged_kv(geometry_for("cpu"), NUM_BLOCKS, seed=0)
    assert detect_layout(cpu, num_kv_heads=4, head_size=32, backend_hint="FLASHINFER").layout == "cpu"


def test_detect_layout_on_vllm_cpu_shapes():
    # Shapes seen from vLLM's CPU backend (VLLM_CPU_NOTES.md).
    g = detect_layout([torch.zeros(4096, 2, 128, 128)] * 2, num_kv_heads=2, head_size=64, backend_hint="CPU_ATTN")
    assert (g.layout, g.block_size, g.num_kv_heads) == ("cpu", 128, 2)
    mla = detect_layout([torch.zeros(10, 64, 576)], num_kv_heads=128, head_size=576, backend_hint="FLASHMLA")
    assert (mla.layout, mla.num_kv_heads, mla.block_size) == ("mla", 1, 64)


def test_fingerprint_is_stable_across_processes():
    g = KVGeometry("cpu", 8, 8, 128, 16, torch.bfloat16)
    code = (
        "import torch; from flowkv.kernels import KVGeometry; "
        "print(KVGeometry('cpu', 8, 8, 128, 16, torch.bfloat16).fingerprint())"
    )
    seen = {
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
        for _ in range(2)
    }
    assert seen == {g.fingerprint()}
    others = {
        KVGeometry("cpu", 8, 8, 128, 16, torch.float16).fingerprint(),
        KVGeometry("flash_kv_nhd", 8, 8, 128, 16, torch.bfloat16).fingerprint(),
        KVGeometry("cpu", 8, 8, 128, 32, torch.bfloat16).fingerprint(),
        KVGeometry("cpu", 8, 4, 128, 16, torch.bfloat16).fingerprint(),
        KVGeometry("cpu", 8, 8, 64, 16, torch.bfloat16).fingerprint(),
        KVGeometry("cpu", 4, 8, 128, 16, torch.bfloat16).fingerprint(),
    }
    assert len(others) == 6 and g.fingerprint() not in others


def test_synthetic_cache_is_deterministic_and_shares_one_buffer():
    g = geometry_for("cpu", torch.float16)
    a, b = make_paged_kv(g, NUM_BLOCKS, seed=4), make_paged_kv(g, NUM_BLOCKS, seed=4)
    assert_caches_equal(a, b)
    assert not torch.equal(a[0], make_paged_kv(g, NUM_BLOCKS, seed=5)[0])
    assert len({t.untyped_storage().data_ptr() for t in a}) == 1
    slots = random_slot_mapping(40, g, NUM_BLOCKS, seed=1)
    blocks = slots // g.block_size
    assert torch.equal(slots % g.block_size, torch.arange(40) % g.block_size)
    assert len(set(blocks[::16].tolist())) == 3
    with pytest.raises(ValueError, match="need 13 blocks"):
        random_slot_mapping(200, g, NUM_BLOCKS, seed=1)


def test_bench_reports_throughput_against_copy():
    result = bench_gather_scatter(KVGeometry("cpu", 2, 2, 64, 32, torch.bfloat16), num_tokens=256, repeats=1)
    assert result["bytes"] == 2 * 2 * 256 * 2 * 64 * 2
    assert result["gather_gbps"] > 0 and result["copy_gbps"] > 0
    assert result["gather_vs_copy"] == pytest.approx(result["gather_gbps"] / result["copy_gbps"])


# -- the chunk format: the cache's own rows ------------------------------------------

# Bytes one copy moves when whole blocks go into a chunk in the geometry's format
# (geometry_for: 4 heads x head size 32, block 16), per layout.
WHOLE_BLOCK_ROW = {
    "cpu": 16 * 2 * 32,  # one head's block, keys and values
    "flash_kv_hnd": 16 * 32,  # one head's block
    "flash_blocks_hnd": 16 * 32,
    "flash_kv_nhd": 16 * 4 * 32,  # one block, every head
    "flash_blocks_nhd": 16 * 4 * 32,
    "mla": 16 * 32,
}


def scatter_like_reference(chunk, g, slots):
    """Scatter ``chunk`` into zeroed caches with the kernel and with the reference; assert
    they agree, and return the reference's caches."""
    got, want = (make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False) for _ in range(2))
    scatter(chunk, got, g, slots)
    reference_scatter(chunk, want, g, slots)
    assert_caches_equal(got, want)
    return want


def rows_moved(caches, g, slots, chunk, *, scatter_too=True):
    """The shortest row (in elements) gather and scatter copied, as the probe reports it."""
    from flowkv.kernels import TransferProbe

    probe = TransferProbe()
    with probe:
        gather(caches, g, slots, chunk)
    if scatter_too:
        with probe:
            scatter(chunk, [torch.zeros_like(t) for t in caches], g, slots)
    return probe.row_bytes // g.dtype.itemsize


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("span", [(0, 64), (0, 50), (5, 45), (16, 17)],
                         ids=["whole-blocks", "partial-last-block", "mid-block-start", "one-token"])
def test_chunk_format_round_trips_bitwise(layout, dtype, span):
    """Chunks in the geometry's own format: whole blocks, a partial last block, a chunk that
    starts inside a block (chunk sizes that are not block multiples), a single token."""
    g = geometry_for(layout, dtype)
    source = make_paged_kv(g, NUM_BLOCKS, seed=1)
    slots = random_slot_mapping(64, g, NUM_BLOCKS, seed=2)[span[0]:span[1]]
    chunk = gather(source, g, slots, g.empty_chunk(len(slots)))
    assert tuple(chunk.shape) == g.chunk_shape(len(slots))
    assert torch.equal(chunk, reference_gather(source, g, slots))
    expected = scatter_like_reference(chunk, g, slots)
    # A contiguous chunk (another order) scatters the same bytes.
    again = make_paged_kv(g, NUM_BLOCKS, seed=0, fill=False)
    scatter(chunk.contiguous(), again, g, slots)
    assert_caches_equal(again, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_format_copies_the_caches_whole_block_rows(layout):
    g = geometry_for(layout)
    source = make_paged_kv(g, NUM_BLOCKS, seed=1)
    whole = random_slot_mapping(64, g, NUM_BLOCKS, seed=2)
    assert rows_moved(source, g, whole, g.empty_chunk(64)) == WHOLE_BLOCK_ROW[layout]
    # Not whole blocks: rows end at one token, all heads where the cache keeps them
    # together, keys and values of one head on the CPU layout.
    per_token = {"cpu": 2 * 32, "flash_kv_hnd": 32, "flash_blocks_hnd": 32, "mla": 32}.get(layout, 4 * 32)
    assert rows_moved(source, g, whole[5:45], g.empty_chunk(40)) == per_token


def test_logical_chunk_on_the_cpu_layout_moves_head_rows():
    """The old format (contiguous (layers, kv, tokens, heads, dim)) still works, in rows of one head."""
    g = geometry_for("cpu")
    source = make_paged_kv(g, NUM_BLOCKS, seed=1)
    slots = random_slot_mapping(64, g, NUM_BLOCKS, seed=2)
    chunk = torch.empty(tuple(g.chunk_shape(64)), dtype=g.dtype)
    assert rows_moved(source, g, slots, chunk) == g.head_size
    assert torch.equal(chunk, reference_gather(source, g, slots))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_format_with_skipped_slots_and_layer_subsets(layout):
    g = geometry_for(layout)
    source = make_paged_kv(g, NUM_BLOCKS, seed=3)
    whole = random_slot_mapping(48, g, NUM_BLOCKS, seed=4)
    slots = torch.where(torch.isin(torch.arange(48), torch.tensor([0, 17, 47])), -1, whole)
    chunk = g.empty_chunk(48)
    chunk.fill_(5.0)
    gather(source, g, slots, chunk)
    expected = reference_gather(source, g, slots)
    kept = slots >= 0
    assert torch.equal(chunk[:, :, kept], expected[:, :, kept])
    assert bool((chunk[:, :, ~kept] == 5.0).all())
    scatter_like_reference(chunk, g, slots)
    # One layer at a time, as layerwise runs do, into the layer's slice of the chunk.
    per_layer = g.empty_chunk(48)
    for layer in range(g.num_layers):
        gather(source, g, whole, per_layer[layer:layer + 1], layers=[layer])
    assert torch.equal(per_layer, reference_gather(source, g, whole))


def test_chunk_shape_carries_the_format_and_the_arena_lays_it_out():
    from flowkv.kernels import ChunkShape
    from flowkv.memory import MemoryArena

    g = geometry_for("cpu")
    shape = g.chunk_shape(32)
    assert isinstance(shape, ChunkShape) and shape == (3, 2, 32, 4, 32)
    assert shape.dim_order == g.chunk_order == (0, 3, 2, 1, 4) and shape.physical == (3, 4, 32, 2, 32)
    arena = MemoryArena(1 << 20, slab_bytes=1 << 18, prefault="off")
    obj = arena.allocate(shape, g.dtype)
    assert obj.tensor.shape == shape and obj.tensor.stride() == g.empty_chunk(32).stride()
    # view_bytes is the object's pages in their physical order, whatever the view.
    obj.tensor.copy_(torch.randn(shape).to(g.dtype))
    physical = obj.tensor.permute(shape.dim_order)
    assert bytes(obj.view_bytes()) == physical.contiguous().view(torch.uint8).numpy().tobytes()
    obj.view_bytes()[:2] = b"\x00\x00"
    assert physical.reshape(-1)[0].item() == 0
    assert arena.allocate(tuple(shape), g.dtype).tensor.is_contiguous()  # a plain tuple: logical order


def test_fingerprint_names_the_chunk_format():
    orders = {layout: geometry_for(layout).fingerprint().rsplit("-", 1)[1] for layout in LAYOUTS}
    assert orders == {"cpu": "lhtkd", "flash_kv_hnd": "lkhtd", "flash_blocks_hnd": "lkhtd",
                      "flash_kv_nhd": "bf16", "flash_blocks_nhd": "bf16", "mla": "bf16"}
    # Chunk format 1 of the CPU layout (logical order) keyed 'cpu-l3-h4-d32-b16-bf16':
    # its chunks can never be found under format 2's keys.
    assert geometry_for("cpu").fingerprint() != "cpu-l3-h4-d32-b16-bf16"


def test_transfer_probe_counts_first_touch_faults():
    from flowkv.kernels import TransferProbe
    from flowkv.resident import ResidentBuffer

    fresh = ResidentBuffer.anonymous(4 << 20, prefault="off", huge_pages=False)
    probe = TransferProbe()
    with probe:
        fresh.tensor[::4096].fill_(1)
    assert probe.faults >= 1 and probe.cpu_ns >= 0 and probe.preempted >= 0
    assert "row_bytes" not in probe.attributes()


@pytest.mark.parametrize("helper", [True, False], ids=["with-helper", "caller-only"])
def test_cpu_row_copy_in_pieces_is_bitwise(monkeypatch, helper):
    """Long rows on a CPU are copied by numpy in pieces, which a helper thread may share."""
    from flowkv.kernels import torch_kv

    monkeypatch.setattr(torch_kv, "PIECE_BYTES", 4096)  # many pieces of two rows
    monkeypatch.setattr(torch_kv, "USE_HELPER", helper)
    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", True)
    g = geometry_for("cpu", torch.float32)  # rows of a head's block: 16 x 64 x 4 B = 4 KiB
    source = make_paged_kv(g, NUM_BLOCKS, seed=5)
    slots = random_slot_mapping(64, g, NUM_BLOCKS, seed=6)
    assert rows_moved(source, g, slots, g.empty_chunk(64), scatter_too=False) * 4 >= torch_kv.NUMPY_MIN_ROW_BYTES
    for _ in range(3):
        chunk = gather(source, g, slots, g.empty_chunk(64))
        assert torch.equal(chunk, reference_gather(source, g, slots))
        scatter_like_reference(chunk, g, slots)



needs_two_cores = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                     reason="needs two cores and thread affinity")


def _pinned_copy(monkeypatch, affinity: str):
    """A fresh copier's first copy made by the main thread pinned to its first core, as
    vLLM's worker thread (the OpenMP master) is pinned, its other OpenMP threads on the other
    cores: (the copier, the caller's core, the cores of each helper thread)."""
    import threading

    from flowkv.kernels import torch_kv

    cores = sorted(os.sched_getaffinity(0))
    # vLLM's other OpenMP threads, one pinned to each other core, waiting between forward passes.
    release = threading.Event()

    def openmp_worker(core: int) -> None:
        os.sched_setaffinity(0, {core})
        release.wait()

    workers = [threading.Thread(target=openmp_worker, args=(core,)) for core in cores[1:]]
    for worker in workers:
        worker.start()
    copier = torch_kv.RowCopier()
    monkeypatch.setattr(torch_kv, "copier", copier)
    monkeypatch.setattr(torch_kv, "HELPER_AFFINITY", affinity)
    monkeypatch.setattr(torch_kv, "USE_HELPER", True)
    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", True)
    monkeypatch.setattr(torch_kv, "MIN_PIECE_BYTES", 4096)
    g = geometry_for("cpu", torch.float32)  # rows of 4 KiB
    source = make_paged_kv(g, NUM_BLOCKS, seed=7)
    slots = random_slot_mapping(64, g, NUM_BLOCKS, seed=8)
    os.sched_setaffinity(0, {cores[0]})
    try:
        chunk = gather(source, g, slots, g.empty_chunk(64))
    finally:
        os.sched_setaffinity(0, set(cores))
        release.set()
        for worker in workers:
            worker.join()
    assert torch.equal(chunk, reference_gather(source, g, slots))
    helpers = [t for t in threading.enumerate() if t in copier._threads]
    assert len(helpers) == copier.helpers >= 1
    return copier, cores[0], [os.sched_getaffinity(t.native_id) for t in helpers]


@needs_two_cores
def test_copy_helpers_started_by_a_pinned_thread_run_off_its_core(monkeypatch):
    """vLLM pins its worker thread to one core; the copy helpers that thread starts would
    inherit that core and copy nothing in parallel. They go to the other cores."""
    from flowkv.kernels import affinity, torch_kv

    copier, caller_core, helper_cores = _pinned_copy(monkeypatch, "free")
    others = sorted(set(os.sched_getaffinity(0)) - {caller_core})
    assert copier.cores is not None and caller_core not in copier.cores and set(others) <= set(copier.cores)
    # never outside the cores the process's threads may use (taskset)
    assert set(copier.cores) <= affinity.process_cores()
    assert all(cores == set(copier.cores) for cores in helper_cores), helper_cores
    # one helper per free core, at most MAX_HELPERS
    assert copier.helpers == min(torch_kv.MAX_HELPERS, len(copier.cores))


@needs_two_cores
def test_copy_helpers_inherit_the_pinned_core_when_asked(monkeypatch):
    """The "inherit" setting keeps the threads where they start (how they ran before): on the
    caller's one core."""
    copier, caller_core, helper_cores = _pinned_copy(monkeypatch, "inherit")
    assert copier.cores is None and all(cores == {caller_core} for cores in helper_cores), helper_cores


def test_a_cpu_copy_is_cut_into_few_pieces(monkeypatch):
    """Each piece costs its thread one wait for the GIL: a copy is about two pieces per thread,
    more only past PIECE_BYTES each, none below MIN_PIECE_BYTES."""
    import threading

    from flowkv.kernels import torch_kv

    copier = torch_kv.RowCopier()  # not started: counts one helper
    monkeypatch.setattr(torch_kv, "USE_HELPER", True)
    mib = 1 << 20
    assert copier.pieces_for(128 * mib) == 4
    assert copier.pieces_for(24 * mib) == 4
    assert copier.pieces_for(2048 * mib) == 2048 // (torch_kv.PIECE_BYTES // mib)
    assert copier.pieces_for(3 * mib) == 3 and copier.pieces_for(mib // 2) == 1
    monkeypatch.setattr(torch_kv, "USE_HELPER", False)
    assert copier.pieces_for(24 * mib) == 1 and copier.pieces_for(128 * mib) == 4
    monkeypatch.setattr(torch_kv, "USE_HELPER", True)
    side: list[int] = []  # a side thread (layerwise) copies alone: no piece for a helper
    thread = threading.Thread(target=lambda: side.append(copier.pieces_for(24 * mib)))
    thread.start()
    thread.join()
    assert side == [1]


def test_a_cpu_copy_in_few_pieces_moves_every_row(monkeypatch):
    """Pieces of uneven size (rows that do not divide evenly): every row lands, gather and scatter."""
    from flowkv.kernels import torch_kv

    monkeypatch.setattr(torch_kv, "MIN_PIECE_BYTES", 4096)
    monkeypatch.setattr(torch_kv, "PIECE_BYTES", 5 * 4096)
    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", True)
    g = geometry_for("cpu", torch.float32)  # rows of 4 KiB; 48 tokens = 3 layers x 4 heads x 3 blocks = 36 rows
    source = make_paged_kv(g, NUM_BLOCKS, seed=9)
    slots = random_slot_mapping(48, g, NUM_BLOCKS, seed=10)
    assert torch_kv.copier.pieces_for(36 * 4096) == 8  # of 5 rows, the last of 1
    chunk = gather(source, g, slots, g.empty_chunk(48))
    assert torch.equal(chunk, reference_gather(source, g, slots))
    scatter_like_reference(chunk, g, slots)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vllms_cpu_block_interior_is_packed_and_whole_blocks_move_bitwise(dtype):
    """A fact about vLLM's CPU backend, checked with its own cache write: a row of the 4-D layer
    tensor ``(num_blocks, heads, block_size, 2*head_size)`` is *not* one token's key and value.
    vLLM views each block and head as ``2*block_size`` rows of ``head_size`` (keys, then values)
    and its cache-write kernel packs them further by ISA (on ``vec``: the keys dimension-major).
    So flowkv's ``cpu`` geometry is exact for whole blocks only: a gather of whole blocks and a
    scatter into other blocks reproduce vLLM's bytes exactly. (A chunk smaller than a block, or
    ending inside one, carries bytes of tokens after its end: see the README's known issues.)"""
    from types import SimpleNamespace

    from vllm.v1.attention.backends import cpu_attn

    num_blocks, heads, block, head = 6, 2, 32, 64
    g = KVGeometry("cpu", 1, heads, head, block, dtype)
    layer = torch.zeros(num_blocks, heads, block, 2 * head, dtype=dtype)
    slots = torch.cat([torch.arange(0, block), torch.arange(2 * block, 3 * block)])  # blocks 0 and 2, whole
    key = torch.randn(len(slots), heads, head).to(dtype)
    value = torch.randn(len(slots), heads, head).to(dtype)
    isa = cpu_attn._get_attn_isa(dtype, block, head, "auto")
    impl = SimpleNamespace(attn_type=cpu_attn.AttentionType.DECODER, kv_cache_dtype="auto")
    vllm_layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update(impl, vllm_layer, key, value, layer, slots)

    # Keys first, then values, in each block and head; a 4-D row is not a token.
    slab = layer.reshape(num_blocks, heads, 2, block * head)
    assert not torch.equal(layer[0, :, :, :head].transpose(0, 1), key[:block])
    assert slab[1].abs().sum() == 0 and slab[0, :, 1].abs().sum() > 0
    if isa == "vec":  # the keys of a block are stored dimension-major (the transpose), the values token-major
        assert torch.equal(slab[0, :, 0].reshape(heads, head, block), key[:block].permute(1, 2, 0))
        assert torch.equal(slab[0, :, 1].reshape(heads, block, head), value[:block].permute(1, 0, 2))

    # Whole blocks move bitwise: gather blocks 0 and 2, scatter them into blocks 3 and 5 of another cache.
    chunk = gather([layer], g, slots, g.empty_chunk(len(slots)))
    other = torch.zeros_like(layer)
    scatter(chunk, [other], g, torch.cat([torch.arange(3 * block, 4 * block), torch.arange(5 * block, 6 * block)]))
    assert torch.equal(other[3], layer[0]) and torch.equal(other[5], layer[2])


# -- a request's chunks in one copy (gather_many / scatter_many) ------------------------------------

class _CountIndexCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the row-index copies the kernels make (index_select / index_copy_ / numpy's are
    not torch ops, so the scatter path is counted through `note_row_bytes` instead)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith(("index_select", "index_copy")):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _arena_chunks(g, arena, sizes):
    return [arena.allocate(g.chunk_shape(size), g.dtype) for size in sizes]


@pytest.mark.parametrize("layout", ["cpu", "flash_kv_nhd", "flash_blocks_hnd"])
@pytest.mark.parametrize("whole_blocks", [True, False])
@pytest.mark.parametrize("numpy_gather", [False, True], ids=["index_select", "numpy"])
def test_chunks_back_to_back_move_in_one_copy_and_bitwise(layout, whole_blocks, numpy_gather, monkeypatch):
    from flowkv.kernels import gather_many, scatter_many, torch_kv
    from flowkv.memory import MemoryArena

    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", numpy_gather)
    g = geometry_for(layout, block_size=16)
    source = make_paged_kv(g, NUM_BLOCKS, seed=3)
    slots = (torch.arange(96) if whole_blocks else random_slot_mapping(96, g, NUM_BLOCKS, seed=4))
    arena = MemoryArena(8 << 20, slab_bytes=1 << 20, prefault="off")
    objs = _arena_chunks(g, arena, [32, 32, 32])  # an arena hands a request's chunks out back to back
    parts = [(slots[i * 32:(i + 1) * 32], obj.tensor) for i, obj in enumerate(objs)]
    with _CountIndexCopies() as counted:
        gather_many(source, g, parts)
    # one index_select over all the rows (or none: numpy copies rows of 2 KiB and more)
    assert counted.calls == 1 if not numpy_gather else counted.calls <= 1
    assert torch.equal(torch.cat([obj.tensor for obj in objs], dim=2), reference_gather(source, g, slots))
    target = make_paged_kv(g, NUM_BLOCKS, seed=5, fill=False)
    scatter_many(parts, target, g)
    assert torch.equal(reference_gather(target, g, slots), reference_gather(source, g, slots))


def test_chunks_that_do_not_follow_each_other_move_one_by_one(monkeypatch):
    from flowkv.kernels import gather_many, scatter_many, torch_kv
    from flowkv.memory import MemoryArena

    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", False)  # count the gathers as index_select calls
    g = geometry_for("flash_kv_nhd", block_size=16)
    source = make_paged_kv(g, NUM_BLOCKS, seed=6)
    slots = random_slot_mapping(96, g, NUM_BLOCKS, seed=7)
    arena = MemoryArena(8 << 20, slab_bytes=1 << 20, prefault="off")
    first, second, _gap, third = _arena_chunks(g, arena, [32, 32, 32, 32])  # not a fixed distance apart
    parts = [(slots[:32], first.tensor), (slots[32:64], second.tensor), (slots[64:], third.tensor)]
    with _CountIndexCopies() as counted:
        gather_many(source, g, parts)
    assert counted.calls == 3
    assert torch.equal(torch.cat([first.tensor, second.tensor, third.tensor], dim=2), reference_gather(source, g, slots))
    slots = slots[:64]
    # A skipped slot (-1) anywhere: each part on its own, the skipped row kept as it was.
    skipping = slots.clone()
    skipping[40] = -1
    target = make_paged_kv(g, NUM_BLOCKS, seed=8, fill=False)
    before = reference_gather(target, g, slots[40:41])
    adjacent = _arena_chunks(g, arena, [32, 32])
    for obj, part in zip(adjacent, (slots[:32], slots[32:])):
        obj.tensor.copy_(reference_gather(source, g, part))
    scatter_many([(skipping[:32], adjacent[0].tensor), (skipping[32:], adjacent[1].tensor)], target, g)
    assert torch.equal(reference_gather(target, g, slots[40:41]), before)
    kept = torch.cat([slots[:40], slots[41:]])
    assert torch.equal(reference_gather(target, g, kept), reference_gather(source, g, kept))


def test_chunk_batches_are_checked_like_one_call():
    from flowkv.kernels import gather_many

    g = geometry_for("cpu")
    source = make_paged_kv(g, NUM_BLOCKS, seed=9)
    slots = random_slot_mapping(64, g, NUM_BLOCKS, seed=10)
    with pytest.raises(ValueError, match="expected"):
        gather_many(source, g, [(slots[:32], g.empty_chunk(32)), (slots[32:], g.empty_chunk(16))])
    with pytest.raises(ValueError, match="slot_mapping holds slots"):
        gather_many(source, g, [(slots[:32], g.empty_chunk(32)), (slots[32:] + 10_000, g.empty_chunk(32))])


@pytest.mark.parametrize("layout", ["cpu", "flash_kv_nhd"])
def test_one_layer_of_chunks_back_to_back_moves_in_one_copy(layout, monkeypatch):
    """Layerwise: layer l of each chunk is a slice with gaps between the chunks; still one copy."""
    from flowkv.kernels import gather_many, scatter_many, torch_kv
    from flowkv.memory import MemoryArena

    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", False)  # one chunk at a time would be index_select calls
    g = geometry_for(layout, block_size=16)
    source = make_paged_kv(g, NUM_BLOCKS, seed=11)
    slots = random_slot_mapping(96, g, NUM_BLOCKS, seed=12)
    arena = MemoryArena(8 << 20, slab_bytes=1 << 20, prefault="off")
    objs = _arena_chunks(g, arena, [32, 32, 32])
    for layer in range(g.num_layers):
        parts = [(slots[i * 32:(i + 1) * 32], obj.tensor[layer:layer + 1]) for i, obj in enumerate(objs)]
        with _CountIndexCopies() as counted:
            gather_many(source, g, parts, layers=[layer])
        assert counted.calls == 0  # not one index_select per chunk: one numpy copy over the strided rows
    assert torch.equal(torch.cat([obj.tensor for obj in objs], dim=2), reference_gather(source, g, slots))
    target = make_paged_kv(g, NUM_BLOCKS, seed=13, fill=False)
    for layer in range(g.num_layers):
        scatter_many([(slots[i * 32:(i + 1) * 32], obj.tensor[layer:layer + 1]) for i, obj in enumerate(objs)],
                     target, g, layers=[layer])
    assert torch.equal(reference_gather(target, g, slots), reference_gather(source, g, slots))


@pytest.mark.parametrize("helper", [False, True], ids=["runs-of-two-chunks", "one-chunk-a-piece"])
def test_one_layer_of_chunks_in_pieces_of_whole_chunks(helper, monkeypatch):
    """Layerwise copies in pieces that are runs of whole chunks (the last one shorter): every
    layer of every chunk lands, gather and scatter."""
    from flowkv.kernels import gather_many, scatter_many, torch_kv
    from flowkv.memory import MemoryArena

    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", True)
    monkeypatch.setattr(torch_kv, "USE_HELPER", helper)
    g = geometry_for("cpu", torch.float32, block_size=16)  # rows of 4 KiB
    layer_bytes = 32 * g.token_bytes // g.num_layers  # one layer of one chunk
    monkeypatch.setattr(torch_kv, "MIN_PIECE_BYTES", 1)
    monkeypatch.setattr(torch_kv, "PIECE_BYTES", 2 * layer_bytes)
    source = make_paged_kv(g, NUM_BLOCKS, seed=14)
    slots = random_slot_mapping(96, g, NUM_BLOCKS, seed=15)
    arena = MemoryArena(8 << 20, slab_bytes=1 << 20, prefault="off")
    objs = _arena_chunks(g, arena, [32, 32, 32])
    assert torch_kv.copier.pieces_for(3 * layer_bytes) == (2 * (1 + max(1, torch_kv.copier.helpers)) if helper else 2)
    target = make_paged_kv(g, NUM_BLOCKS, seed=16, fill=False)
    for layer in range(g.num_layers):
        parts = [(slots[i * 32:(i + 1) * 32], obj.tensor[layer:layer + 1]) for i, obj in enumerate(objs)]
        gather_many(source, g, parts, layers=[layer])
        scatter_many(parts, target, g, layers=[layer])
    assert torch.equal(torch.cat([obj.tensor for obj in objs], dim=2), reference_gather(source, g, slots))
    assert torch.equal(reference_gather(target, g, slots), reference_gather(source, g, slots))


@pytest.mark.parametrize("layout", ["cpu", "flash_kv_nhd"])
@pytest.mark.parametrize("case", ["chunks-not-whole-blocks", "one-chunk-of-loose-tokens"])
def test_chunks_back_to_back_with_token_rows_move_in_one_copy(layout, case, monkeypatch):
    """One plan over all the chunks' slots: chunks that are not whole blocks long, or one chunk
    whose tokens are not whole blocks, still move as one copy (rows of one token), bitwise."""
    from flowkv.kernels import gather_many, scatter_many, torch_kv
    from flowkv.memory import MemoryArena

    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", False)  # count the gather as index_select calls
    g = geometry_for(layout, block_size=16)
    source = make_paged_kv(g, NUM_BLOCKS, seed=17)
    size = 24 if case == "chunks-not-whole-blocks" else 32
    slots = random_slot_mapping(3 * size, g, NUM_BLOCKS, seed=18)
    if case == "one-chunk-of-loose-tokens":
        loose = slots[size:2 * size]
        slots[size:2 * size] = loose[torch.randperm(size, generator=torch.Generator().manual_seed(19))]
    arena = MemoryArena(8 << 20, slab_bytes=1 << 20, prefault="off")
    objs = _arena_chunks(g, arena, [size] * 3)
    parts = [(slots[i * size:(i + 1) * size], obj.tensor) for i, obj in enumerate(objs)]
    with _CountIndexCopies() as counted:
        gather_many(source, g, parts)
    assert counted.calls == 1
    assert torch.equal(torch.cat([obj.tensor for obj in objs], dim=2), reference_gather(source, g, slots))
    target = make_paged_kv(g, NUM_BLOCKS, seed=20, fill=False)
    scatter_many(parts, target, g)
    assert torch.equal(reference_gather(target, g, slots), reference_gather(source, g, slots))
