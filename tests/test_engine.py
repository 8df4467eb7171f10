"""The cache engine through its public API: lookup, store, retrieve on a synthetic paged cache.

Every test builds a small geometry so a run moves kilobytes, not gigabytes;
the built-in pipelines are shrunk with ``overrides`` (chunk size, capacity).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flowkv
from flowkv import CacheEngine, KVTransfer, telemetry
from flowkv.kernels import KVGeometry
from flowkv.kernels.geometry import LAYOUTS, canonical_view
from flowkv.otlp_json import load_spans
from flowkv._testing.paged import make_paged_kv, random_slot_mapping

CHUNK = 64
NUM_BLOCKS = 64
# 4 full chunks and a partial one of 44 tokens.
NUM_TOKENS = 4 * CHUNK + 44


def geometry(layout: str = "cpu") -> KVGeometry:
    heads = 1 if layout == "mla" else 2
    return KVGeometry(layout, num_layers=2, num_kv_heads=heads, head_size=16, block_size=16, dtype=torch.bfloat16)


def engine(pipeline: str = "local-cpu", g: KVGeometry | None = None, **overrides) -> CacheEngine:
    settings = {"chunk_size": CHUNK, "tiers.memory.capacity": "8MiB", **overrides}
    return CacheEngine.from_pipeline(pipeline, geometry=g or geometry(), model_name="tiny", overrides=settings)


def tokens(n: int = NUM_TOKENS, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed))


def compressible_kv(g: KVGeometry, seed: int) -> list[torch.Tensor]:
    """A paged cache whose chunks lz4 shrinks (values on a coarse grid), so they are stored encoded."""
    kv_caches = make_paged_kv(g, NUM_BLOCKS, seed=seed)
    for layer in kv_caches:
        layer.copy_(torch.round(layer.float() * 4) / 4)
    return kv_caches


def random_bits_kv(g: KVGeometry, seed: int) -> list[torch.Tensor]:
    """A paged cache of uniformly random bit patterns: nothing compresses it, shuffled or not."""
    kv_caches = make_paged_kv(g, NUM_BLOCKS, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for layer in kv_caches:
        bits = torch.randint(-(2**15), 2**15, layer.shape, dtype=torch.int32, generator=generator)
        layer.view(torch.int16).copy_(bits.to(torch.int16))
    return kv_caches


def encoded_entries(e: CacheEngine) -> list[str]:
    """Keys the memory tier holds as encoded payloads (not raw KV)."""
    found = []
    for key in e.memory.keys():
        obj = e.memory.get(key)
        if "codec" in obj.meta:
            found.append(key)
        obj.ref_down()
    return found


def slot_values(kv_caches: list[torch.Tensor], g: KVGeometry, slots: torch.Tensor) -> torch.Tensor:
    """The KV at ``slots`` of every layer, as raw bits (so the comparison is bitwise)."""
    per_layer = []
    for layer in kv_caches:
        view = canonical_view(layer, g)  # (kv, blocks, block_size, heads, head_size)
        per_layer.append(view[:, slots // g.block_size, slots % g.block_size])
    return torch.stack(per_layer).view(torch.int16)


def assert_loaded_exactly(src, dst, g, slots, ret_mask) -> None:
    """``dst`` equals ``src`` bit for bit at the slots of loaded tokens, and is still zero elsewhere."""
    loaded = slots[ret_mask]
    assert torch.equal(slot_values(dst, g, loaded), slot_values(src, g, loaded))
    every_slot = torch.arange(NUM_BLOCKS * g.block_size)
    untouched = every_slot[~torch.isin(every_slot, loaded)]
    assert not slot_values(dst, g, untouched).any()


# -- round trips ---------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_bitwise_for_every_layout_with_a_partial_last_chunk(layout):
    g = geometry(layout)
    e = engine(g=g, save_partial_chunks=True)
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)

    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == NUM_TOKENS
    assert e.lookup(ids) == NUM_TOKENS
    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots))
    ret_mask = result.ret_mask

    assert ret_mask.dtype == torch.bool and ret_mask.shape == (NUM_TOKENS,)
    assert ret_mask.all()
    assert_loaded_exactly(src, dst, g, slots, ret_mask)
    assert result.failed_range is None
    assert result.loaded_to == NUM_TOKENS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_prefix_is_neither_stored_nor_loaded(layout):
    g = geometry(layout)
    e = engine(g=g)
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=4)
    mask = torch.zeros(NUM_TOKENS, dtype=torch.bool)
    mask[: 2 * CHUNK] = True

    # Chunks 2 and 3; the partial chunk is not saved by default.
    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots, mask=mask)).stored_tokens == 2 * CHUNK
    # Chunk 0 is missing, so lookup (contiguous from chunk 0) serves nothing.
    assert e.lookup(ids) == 0

    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots, mask=mask)).ret_mask
    expected = torch.zeros(NUM_TOKENS, dtype=torch.bool)
    expected[2 * CHUNK : 4 * CHUNK] = True
    assert torch.equal(ret_mask, expected)
    assert_loaded_exactly(src, dst, g, slots, ret_mask)


@pytest.mark.parametrize("compressible", [True, False], ids=["encoded", "incompressible-kept-raw"])
def test_lz4_pipeline_round_trip_is_bitwise(compressible):
    g = geometry("flash_blocks_hnd")
    e = engine("local-cpu-lz4", g=g, save_partial_chunks=True)
    src = compressible_kv(g, seed=5) if compressible else random_bits_kv(g, seed=5)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=6, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=7)

    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == NUM_TOKENS
    # Random bits do not shrink under lz4: such chunks stay raw rather than grow.
    assert len(encoded_entries(e)) == (5 if compressible else 0)
    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask
    assert ret_mask.all()
    assert_loaded_exactly(src, dst, g, slots, ret_mask)


def test_layer_tensors_in_a_mapping_round_trip_like_a_list():
    # vLLM hands kv_caches as {layer_name: tensor}.
    g = geometry()
    e = engine()
    src = make_paged_kv(g, NUM_BLOCKS, seed=8, shared_storage=False)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=9, fill=False, shared_storage=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=10)
    named = {f"model.layers.{i}.self_attn": t for i, t in enumerate(src)}
    assert e.store(KVTransfer(tokens=ids, kv_caches=named, slot_mapping=slots)).stored_tokens == 4 * CHUNK
    by_name = {f"l{i}": t for i, t in enumerate(dst)}
    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=by_name, slot_mapping=slots)).ret_mask
    assert int(ret_mask.sum()) == 4 * CHUNK
    assert_loaded_exactly(src, dst, g, slots, ret_mask)


# -- LMCache semantics ----------------------------------------------------------


def test_lookup_counts_only_the_contiguous_hit_from_chunk_0_and_reads_no_payload():
    g = geometry()
    e = engine()
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=2)
    e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots))
    reads = e.stats()["tiers"]["memory"]["hits"]

    assert e.lookup(ids) == 4 * CHUNK  # the partial chunk was not saved
    assert e.lookup(ids[: 3 * CHUNK]) == 3 * CHUNK
    assert e.lookup(ids[: 3 * CHUNK + 10]) == 3 * CHUNK
    diverged = ids.clone()
    diverged[CHUNK + 5] += 1  # chunk 1 differs, so chunks 1.. have other keys
    assert e.lookup(diverged) == CHUNK
    assert e.lookup(tokens(seed=99)) == 0
    assert e.lookup(ids[:10]) == 0
    assert e.lookup([]) == 0
    assert e.stats()["tiers"]["memory"]["hits"] == reads, "lookup must not read payloads"

    # A hole at chunk 0 hides everything after it.
    other = tokens(seed=11)
    mask = torch.zeros(NUM_TOKENS, dtype=torch.bool)
    mask[:CHUNK] = True
    assert e.store(KVTransfer(tokens=other, kv_caches=src, slot_mapping=slots, mask=mask)).stored_tokens == 3 * CHUNK
    assert e.lookup(other) == 0


def test_store_skips_chunks_already_present():
    g = geometry()
    e = engine()
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=2)
    assert e.store(KVTransfer(tokens=ids[: 2 * CHUNK], kv_caches=src, slot_mapping=slots)).stored_tokens == 2 * CHUNK
    entries = e.stats()["tiers"]["memory"]["entries"]
    # The longer prompt shares the first two chunks: only the other two are new.
    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == 2 * CHUNK
    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == 0
    assert e.stats()["tiers"]["memory"]["entries"] == entries + 2
    assert e.stats()["stored_tokens"] == 4 * CHUNK


@pytest.mark.parametrize("save_partial", [False, True])
def test_save_partial_chunks(save_partial):
    g = geometry()
    e = engine(save_partial_chunks=save_partial)
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)
    served = NUM_TOKENS if save_partial else 4 * CHUNK

    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == served
    assert e.stats()["tiers"]["memory"]["entries"] == (5 if save_partial else 4)
    assert e.lookup(ids) == served
    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask
    assert int(ret_mask.sum()) == served and ret_mask[:served].all()
    assert_loaded_exactly(src, dst, g, slots, ret_mask)
    # A partial chunk is keyed by its own tokens: a longer prompt does not reuse it.
    assert e.lookup(tokens(NUM_TOKENS + 1)) == 4 * CHUNK


def test_retrieve_with_a_mask_loads_only_after_the_masked_prefix():
    g = geometry()
    e = engine()
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)
    e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots))
    mask = torch.zeros(NUM_TOKENS, dtype=torch.bool)
    mask[:CHUNK] = True

    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots, mask=mask)).ret_mask
    expected = torch.zeros(NUM_TOKENS, dtype=torch.bool)
    expected[CHUNK : 4 * CHUNK] = True
    assert torch.equal(ret_mask, expected)
    assert_loaded_exactly(src, dst, g, slots, ret_mask)
    assert e.stats()["retrieved_tokens"] == 3 * CHUNK


def request_kv(g: KVGeometry) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A filled source cache, an empty destination, the tokens and their slots."""
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
    return src, dst, tokens(), random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)


def test_a_transfer_value_is_the_one_way_in_and_answers_result_objects():
    g = geometry()
    e = engine()
    src, dst, ids, slots = request_kv(g)
    mask = torch.zeros(NUM_TOKENS, dtype=torch.bool)
    mask[:CHUNK] = True

    stored = e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots))
    assert stored == flowkv.StoreResult(4 * CHUNK)
    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)) == flowkv.StoreResult(0)  # held
    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots, mask=mask))
    assert isinstance(result, flowkv.RetrieveResult)
    assert result.loaded_tokens == 3 * CHUNK and result.loaded_to == 4 * CHUNK and result.failed_range is None
    # Where a load of [start, end) got to: clamped to the window.
    assert result.loaded_within(CHUNK + 5, NUM_TOKENS) == 4 * CHUNK
    assert result.loaded_within(CHUNK + 5, 2 * CHUNK) == 2 * CHUNK
    assert result.loaded_within(4 * CHUNK + 10, NUM_TOKENS) == 4 * CHUNK + 10
    # The tokens alone, the old keyword form, or a transfer with keywords beside it: a caller's mistake.
    runs = (e.stats()["stores"], e.stats()["retrieves"])
    for call in (e.store, e.retrieve, e.store_layerwise, e.retrieve_layerwise):
        with pytest.raises(TypeError, match=f"CacheEngine.{call.__name__} takes one KVTransfer"):
            call(ids)
        with pytest.raises(TypeError, match="unexpected keyword argument 'kv_caches'"):
            call(ids, kv_caches=dst, slot_mapping=slots)
        with pytest.raises(TypeError, match="unexpected keyword argument 'mask'"):
            call(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots), mask=mask)
    assert (e.stats()["stores"], e.stats()["retrieves"]) == runs  # none of them started a run


def test_each_call_keeps_its_own_result():
    g = geometry()
    e = engine()
    src, dst, ids, slots = request_kv(g)
    e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots))
    keys = [k.to_str() for k in e.chunk_keys(flowkv.Request(tokens=ids))]
    e.lookup(ids)
    assert e.memory.remove(keys[2])
    short = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots))
    whole = e.retrieve(KVTransfer(tokens=ids[: 2 * CHUNK], kv_caches=dst, slot_mapping=slots))
    assert whole.failed_range is None and whole.loaded_to == 2 * CHUNK
    assert short.loaded_to == 2 * CHUNK
    assert not hasattr(e, "last_failed_range")


def test_the_failed_range_runs_from_the_earliest_failed_chunk_to_the_end_of_the_hit():
    request = flowkv.Request(tokens=torch.arange(5 * CHUNK))
    request.hit_tokens = 4 * CHUNK
    chunk = lambda i: flowkv.Chunk(request=request, index=i, start=i * CHUNK, end=(i + 1) * CHUNK)  # noqa: E731
    request.fail_from(chunk(3))
    assert request.failed_range == (3 * CHUNK, 4 * CHUNK)
    request.fail_from(chunk(1))  # an earlier chunk moves the start back
    request.fail_from(chunk(2))  # a later one does not
    assert request.failed_range == (CHUNK, 4 * CHUNK)
    request.fail_from(chunk(4))  # past the hit: the range ends at the chunk's own end
    assert request.failed_range == (CHUNK, 4 * CHUNK)


@pytest.mark.parametrize(
    ("make_mask", "message"),
    [
        (lambda m: m.__setitem__(slice(0, CHUNK + 1), True), "not a multiple of chunk_size"),
        (lambda m: m.__setitem__(slice(CHUNK, 2 * CHUNK), True), "prefix"),
    ],
    ids=["unaligned", "not-a-prefix"],
)
def test_bad_masks_raise_a_clear_value_error(make_mask, message):
    g = geometry()
    e = engine()
    kv = make_paged_kv(g, NUM_BLOCKS, seed=1)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=2)
    mask = torch.zeros(NUM_TOKENS, dtype=torch.bool)
    make_mask(mask)
    with pytest.raises(ValueError, match=message):
        e.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots, mask=mask))
    with pytest.raises(ValueError, match=message):
        e.retrieve(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots, mask=mask))


def test_other_caller_mistakes_raise_value_error():
    g = geometry()
    e = engine()
    kv = make_paged_kv(g, NUM_BLOCKS, seed=1)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=2)
    with pytest.raises(ValueError, match="mask has 10 entries"):
        e.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots, mask=torch.ones(10, dtype=torch.bool)))
    with pytest.raises(ValueError, match="slot_mapping has"):
        e.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots[:100]))
    with pytest.raises(ValueError, match="1-D"):
        e.lookup(ids.view(2, -1)[:, :10])
    with pytest.raises(ValueError, match="lookup_id"):
        e.lookup(ids, pin=True)
    # A mask over every token need not end on a chunk boundary: nothing to do.
    every = torch.ones(NUM_TOKENS, dtype=torch.bool)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots, mask=every)).stored_tokens == 0


# -- keys ------------------------------------------------------------------------


def disk_pipeline(tmp_path, folder) -> str:
    path = tmp_path / "disk.toml"
    path.write_text(textwrap.dedent(f"""
        [pipeline]
        name = "memory-and-disk"
        chunk_size = {CHUNK}

        [tiers.memory]
        kind = "memory"
        capacity = "8MiB"

        [tiers.disk]
        kind = "disk"
        path = "{folder}"
        capacity = "64MiB"

        [[store.stages]]
        use = "tokenize"
        [[store.stages]]
        use = "chunk-hash"
        [[store.stages]]
        use = "allocate"
        [[store.stages]]
        use = "gather"
        [[store.stages]]
        use = "put"

        [[retrieve.stages]]
        use = "tokenize"
        [[retrieve.stages]]
        use = "chunk-hash"
        [[retrieve.stages]]
        use = "lookup"
        [[retrieve.stages]]
        use = "get"
        [[retrieve.stages]]
        use = "decompress"
        [[retrieve.stages]]
        use = "scatter"
    """))
    return str(path)


_CHILD = """
import sys, torch
from flowkv import CacheEngine, KVTransfer
from flowkv.kernels import KVGeometry
from flowkv._testing.paged import make_paged_kv, random_slot_mapping
pipeline, n, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
e = CacheEngine.from_pipeline(pipeline, geometry=g, model_name="tiny")
ids = torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(0))
stored = e.store(KVTransfer(tokens=ids, kv_caches=make_paged_kv(g, 64, seed=1),
                            slot_mapping=random_slot_mapping(n, g, 64, seed=3))).stored_tokens
assert e.flush(), "write-behind did not drain"
e.close()
print(stored)
"""


def test_keys_are_equal_across_processes(tmp_path):
    """A chunk stored by one process (another hash seed) is found and loaded by this one."""
    pipeline = disk_pipeline(tmp_path, tmp_path / "cache")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    child = subprocess.run([sys.executable, "-c", _CHILD, pipeline, str(NUM_TOKENS), str(CHUNK)],
                           env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert int(child.stdout.split()[-1]) == 4 * CHUNK

    g = geometry()
    e = CacheEngine.from_pipeline(pipeline, geometry=g, model_name="tiny")
    try:
        ids = tokens()
        slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)
        assert e.lookup(ids) == 4 * CHUNK
        dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
        ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask
        assert int(ret_mask.sum()) == 4 * CHUNK
        assert_loaded_exactly(make_paged_kv(g, NUM_BLOCKS, seed=1), dst, g, slots, ret_mask)
    finally:
        e.close()


def test_other_model_rank_or_tags_get_no_hit(tmp_path):
    pipeline = disk_pipeline(tmp_path, tmp_path / "shared")
    g = geometry()
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)
    writer = CacheEngine.from_pipeline(pipeline, geometry=g, model_name="tiny", world_size=2, rank=0)
    assert writer.store(KVTransfer(tokens=ids, kv_caches=make_paged_kv(g, NUM_BLOCKS, seed=1), slot_mapping=slots,
                                   tags={"lora": "a"})).stored_tokens == 4 * CHUNK
    assert writer.flush()
    assert writer.lookup(ids, tags={"lora": "a"}) == 4 * CHUNK
    assert writer.lookup(ids, tags={"lora": "b"}) == 0
    assert writer.lookup(ids) == 0
    writer.close()

    def readers():
        yield CacheEngine.from_pipeline(pipeline, geometry=g, model_name="tiny", world_size=2, rank=0), 4 * CHUNK
        yield CacheEngine.from_pipeline(pipeline, geometry=g, model_name="other", world_size=2, rank=0), 0
        yield CacheEngine.from_pipeline(pipeline, geometry=g, model_name="tiny", world_size=2, rank=1), 0
        yield CacheEngine.from_pipeline(pipeline, geometry=g, model_name="tiny", world_size=1, rank=0), 0
        wider = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=32, dtype=torch.bfloat16)
        yield CacheEngine.from_pipeline(pipeline, geometry=wider, model_name="tiny", world_size=2, rank=0), 0

    for reader, expected in readers():
        try:
            # The disk tier reads its folder at start, so a fresh engine sees the writer's chunks.
            assert reader.lookup(ids, tags={"lora": "a"}) == expected, (reader.model_name, reader.rank)
        finally:
            reader.close()


# -- memory pressure ----------------------------------------------------------------


def slab_bytes(g: KVGeometry) -> int:
    """What one raw chunk costs in memory: whole 4 KiB pages."""
    return -(-(g.token_bytes * CHUNK) // 4096) * 4096


@pytest.mark.parametrize("pipeline", ["local-cpu", "local-cpu-lz4"])
def test_a_full_arena_stops_store_without_error_and_keeps_the_prefix(pipeline):
    g = geometry()
    e = engine(pipeline, g=g, **{"tiers.memory.capacity": 3 * slab_bytes(g)})
    src = random_bits_kv(g, seed=1)  # lz4 cannot shrink it: every chunk takes a whole slab
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)

    stored = e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens
    assert 0 < stored < 4 * CHUNK and stored % CHUNK == 0
    assert e.lookup(ids) == stored, "what store reports must be what lookup finds"
    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask
    assert int(ret_mask.sum()) == stored and ret_mask[:stored].all()
    assert_loaded_exactly(src, dst, g, slots, ret_mask)
    # Room for three raw chunks holds three incompressible chunks.
    assert stored == 3 * CHUNK
    assert e.stats()["store_backpressure_stops"] == 1
    assert e.is_healthy()


def test_compressed_chunks_cost_only_their_bytes_so_memory_holds_more():
    """Room for three raw chunks: raw KV fills it with three, lz4 holds all four and the partial one."""
    g = geometry()
    capacity = 3 * slab_bytes(g)
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    for layer in src:  # each head's vector one repeated value: lz4 shrinks it several-fold
        layer.copy_(torch.round(layer.float()[..., :1] * 4).expand(layer.shape))
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)
    raw = engine("local-cpu", g=g, save_partial_chunks=True, **{"tiers.memory.capacity": capacity})
    assert raw.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == 3 * CHUNK

    e = engine("local-cpu-lz4", g=g, save_partial_chunks=True, **{"tiers.memory.capacity": capacity})
    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == NUM_TOKENS
    memory = e.stats()["tiers"]["memory"]
    assert len(encoded_entries(e)) == memory["entries"] == 5
    raw_bytes = NUM_TOKENS * g.token_bytes
    assert memory["used_bytes"] < raw_bytes / 2, (memory["used_bytes"], raw_bytes)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask
    assert ret_mask.all()
    assert_loaded_exactly(src, dst, g, slots, ret_mask)


def test_eviction_between_lookup_and_retrieve_shrinks_the_mask():
    g = geometry()
    e = engine(g=g, **{"tiers.memory.capacity": 5 * slab_bytes(g)})
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)
    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == 4 * CHUNK
    # Reading chunks 0 and 1 makes 2 and 3 the least recently used.
    e.retrieve(KVTransfer(tokens=ids[: 2 * CHUNK], kv_caches=dst, slot_mapping=slots))
    dst = make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False)

    assert e.lookup(ids) == 4 * CHUNK
    # Another request needs two slabs; one is free, chunk 2 is evicted.
    other = KVTransfer(tokens=tokens(2 * CHUNK, seed=20), kv_caches=src, slot_mapping=slots)
    assert e.store(other).stored_tokens == 2 * CHUNK
    assert e.stats()["tiers"]["memory"]["evictions"] == 1

    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask
    assert int(ret_mask.sum()) == 2 * CHUNK and ret_mask[: 2 * CHUNK].all()
    assert_loaded_exactly(src, dst, g, slots, ret_mask)


# -- telemetry ------------------------------------------------------------------------


def test_file_telemetry_writes_one_span_per_stage(tmp_path):
    folder = tmp_path / "traces"
    source = (flowkv.pipeline.resolve_source("local-cpu")).read_text()
    source = source.replace('exporter = "none"', f'exporter = "file"\nfolder = "{folder}"')
    path = tmp_path / "traced.toml"
    path.write_text(source)
    g = geometry()
    e = CacheEngine.from_pipeline(path, geometry=g, model_name="tiny", overrides={"chunk_size": CHUNK})
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=3)
    e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots, request_id="req-1"))
    e.retrieve(KVTransfer(tokens=ids, kv_caches=make_paged_kv(g, NUM_BLOCKS, seed=2, fill=False),
                          slot_mapping=slots))
    telemetry.flush()

    files = list(folder.glob("*.json"))
    assert len(files) == 1
    spans = load_spans(files[0])
    roots = {s.name: s for s in spans if s.parent_span_id is None}
    assert set(roots) == {"flowkv.store", "flowkv.retrieve"}
    for kind, stages in (("store", e.pipeline.store), ("retrieve", e.pipeline.retrieve)):
        root = roots[f"flowkv.{kind}"]
        children = sorted((s for s in spans if s.parent_span_id == root.span_id),
                          key=lambda s: s.attributes["flowkv.stage.index"])
        assert [s.name for s in children] == [spec.name for spec in stages]
        assert all(s.trace_id == root.trace_id for s in children)
        assert root.attributes["flowkv.pipeline"] == "local-cpu"
    assert roots["flowkv.store"].attributes["flowkv.request_id"] == "req-1"
    gather = next(s for s in spans if s.name == "gather")
    assert gather.attributes["flowkv.bytes"] == 4 * CHUNK * g.token_bytes


def test_accounting_changes_only_when_the_engine_counts_something():
    """vLLM asks for the connector's stats after every step; ``accounting.changes`` lets the worker
    skip the snapshot in steps (a decoding batch's) that changed nothing."""
    g = geometry()
    e = engine("local-cpu", g=g)
    src = make_paged_kv(g, NUM_BLOCKS, seed=1)
    slots = random_slot_mapping(NUM_TOKENS, g, NUM_BLOCKS, seed=2)
    ids = tokens()
    before = e.accounting.changes
    e.stats()
    e.drain_latencies()
    assert e.accounting.changes == before  # reading changes nothing
    e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots))
    after_store = e.accounting.changes
    assert after_store > before
    e.lookup(ids)
    assert e.accounting.changes > after_store
