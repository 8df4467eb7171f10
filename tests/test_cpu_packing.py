"""Single tokens in vLLM's packed CPU KV blocks (issue 24, step 2), against vLLM's own cache-write op.

No engine: the op is called directly, on every ISA it accepts on this
machine. The layout table is drawn from the op at start; these tests fail
when vLLM packs blocks in a way the table cannot express, when reading
through the table disagrees with what the op wrote, or when a fact the
reader relies on changes (keys then values per block and head, each a
permutation of the block's tokens' channels).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from flowkv.integration.vllm.cpu_packing import (  # noqa: E402
    CPU_ISAS,
    backend_isa,
    cache_write,
    packed_layout,
    write_tokens,
)
from flowkv.kernels import PackedBlockLayout, PackingError  # noqa: E402

GEOMETRIES = [(32, 64), (128, 128), (64, 80)]  # (block_size, head_size); 80: vLLM's vec16 case
DTYPES = [torch.bfloat16, torch.float32]


def accepted(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> bool:
    """Whether this vLLM build's op takes ``isa`` for this geometry on this machine."""
    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    token = torch.ones(1, 1, head_size, dtype=dtype)
    try:
        cache_write(token, token, key_cache, value_cache, torch.zeros(1, dtype=torch.int64), isa)
    except RuntimeError:
        return False
    return True


CASES = [(isa, bs, hs, dt) for isa in CPU_ISAS for bs, hs in GEOMETRIES for dt in DTYPES if accepted(isa, bs, hs, dt)]


def case_id(case) -> str:
    isa, bs, hs, dt = case
    return f"{isa}-b{bs}-h{hs}-{str(dt).removeprefix('torch.')}"


def test_the_isa_the_backend_picks_here_is_among_those_tested() -> None:
    for block_size, head_size in GEOMETRIES:
        isa = backend_isa(torch.bfloat16, block_size, head_size)
        assert (isa, block_size, head_size, torch.bfloat16) in CASES, (isa, block_size, head_size)
    assert {case[0] for case in CASES} >= {"vec", "vec16"}  # the portable kernels build everywhere on x86/arm


def random_layer(num_blocks: int, heads: int, block_size: int, head_size: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, heads, block_size, 2 * head_size, generator=g).to(dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tokens_written_by_vllms_op_read_back_exactly_through_the_table(case) -> None:
    isa, block_size, head_size, dtype = case
    layout = packed_layout(dtype, block_size=block_size, head_size=head_size, isa=isa)
    heads, blocks = 3, 5
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(blocks * block_size, generator=g)[: 2 * block_size + 7]
    keys = torch.randn(len(slots), heads, head_size, generator=g).to(dtype)
    values = torch.randn(len(slots), heads, head_size, generator=g).to(dtype)
    layer = random_layer(blocks, heads, block_size, head_size, dtype, seed=2)
    before = layer.clone()
    write_tokens(layout, layer, slots, keys, values)
    got_keys, got_values = layout.read_tokens(layer, slots)  # dense: whole blocks unpacked
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    few_keys, few_values = layout.read_tokens(layer, slots[:3])  # sparse: element by element
    assert torch.equal(few_keys, keys[:3]) and torch.equal(few_values, values[:3])
    # Every other token is as it was: a token write touches its own elements only.
    others = torch.tensor(sorted(set(range(blocks * block_size)) - set(slots.tolist())))
    assert [torch.equal(a, b) for a, b in zip(layout.read_tokens(layer, others), layout.read_tokens(before, others))] \
        == [True, True]
    # Writing through the table gives the very bytes the op wrote.
    mine = before.clone()
    layout.write_tokens(mine, slots, keys, values)
    assert torch.equal(mine.view(torch.uint8), layer.view(torch.uint8))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_packed_block_unpacks_into_true_channels_and_back(case) -> None:
    isa, block_size, head_size, dtype = case
    layout = packed_layout(dtype, block_size=block_size, head_size=head_size, isa=isa)
    layer = random_layer(2, 2, block_size, head_size, dtype, seed=3)
    slots = torch.arange(2 * block_size)
    keys, values = layout.read_tokens(layer, slots)
    regions = layout.regions(layer)
    for kind, want in ((0, keys), (1, values)):
        tokens = layout.unpack(regions[:, :, kind], kind)  # (blocks, heads, block_size, head_size)
        assert torch.equal(tokens.permute(0, 2, 1, 3).reshape(-1, 2, head_size), want)
        assert torch.equal(layout.pack(tokens, kind), regions[:, :, kind])


def test_the_packing_seen_with_vllm_0_32_on_its_portable_isas() -> None:
    """The facts docs and codecs quote: vec keys dimension-major, values token-major.
    The table follows vLLM wherever it goes; this test says when it went somewhere else."""
    layout = packed_layout(torch.bfloat16, block_size=32, head_size=64, isa="vec")
    t, d = torch.meshgrid(torch.arange(32), torch.arange(64), indexing="ij")
    assert torch.equal(layout.key_offsets, d * 32 + t)
    assert torch.equal(layout.value_offsets, t * 64 + d)


def test_an_op_that_drops_elements_or_mixes_heads_is_refused() -> None:
    def leaves_holes(key, value, key_cache, value_cache, slot_mapping, isa):
        cache_write(key, value, key_cache, value_cache, slot_mapping, isa)
        key_cache[..., 0] = -1

    def mixes_heads(key, value, key_cache, value_cache, slot_mapping, isa):
        cache_write(key.flip(1), value, key_cache, value_cache, slot_mapping, isa)

    for op, message in ((leaves_holes, "unwritten"), (mixes_heads, "outside its own block and head")):
        with pytest.raises(PackingError, match=message):
            PackedBlockLayout.draw(op, isa="vec", block_size=32, head_size=64, dtype=torch.bfloat16)


def test_a_packing_that_is_no_strided_view_goes_through_the_table() -> None:
    """Any permutation inside a block works, not only the tiles vLLM uses today."""
    block_size, head_size = 32, 16
    perm = torch.randperm(block_size * head_size, generator=torch.Generator().manual_seed(5))

    def shuffled(key, value, key_cache, value_cache, slot_mapping, isa):
        for row, slot in enumerate(slot_mapping.tolist()):
            block, offset = divmod(slot, block_size)
            for cache, data in ((key_cache, key), (value_cache, value)):
                for head in range(cache.shape[1]):
                    cache[block, head].view(-1)[perm[offset * head_size:(offset + 1) * head_size]] = data[row, head]

    layout = PackedBlockLayout.draw(shuffled, isa="test", block_size=block_size, head_size=head_size,
                                    dtype=torch.float32)
    assert layout.token_view(layout.regions(torch.zeros(1, 1, block_size, 2 * head_size)), 0) is None
    layer = torch.zeros(3, 2, block_size, 2 * head_size)
    slots = torch.tensor([0, 5, 33, 95])
    keys, values = torch.randn(4, 2, head_size), torch.randn(4, 2, head_size)
    key_cache, value_cache = layer.view(3, 2, 2 * block_size, head_size).chunk(2, dim=2)
    shuffled(keys, values, key_cache, value_cache, slots, "test")
    got = layout.read_tokens(layer, slots)
    assert torch.equal(got[0], keys) and torch.equal(got[1], values)
    regions = layout.regions(layer)
    assert torch.equal(layout.pack(layout.unpack(regions[:, :, 0], 0), 0), regions[:, :, 0])


@pytest.mark.parametrize("isa", sorted({case[0] for case in CASES if case[1:] == (32, 64, torch.bfloat16)}))
def test_a_gathered_chunk_of_packed_blocks_unpacks_into_true_tokens_and_back(isa) -> None:
    """The seam for lossy codecs: flowkv gathers vLLM's blocks as bytes; unpack_chunk gives the
    tokens' true keys and values (key channels in the last dim), pack_chunk puts them back."""
    from flowkv.kernels import KVGeometry, gather

    block_size, head_size, heads, blocks = 32, 64, 2, 6
    layout = packed_layout(torch.bfloat16, block_size=block_size, head_size=head_size, isa=isa)
    geometry = KVGeometry("cpu", num_layers=2, num_kv_heads=heads, head_size=head_size, block_size=block_size,
                          dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    layers = [torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in (4, 1)])  # two whole blocks
    written = []
    for layer in layers:
        keys = torch.randn(len(slots), heads, head_size, generator=g).to(torch.bfloat16)
        values = torch.randn(len(slots), heads, head_size, generator=g).to(torch.bfloat16)
        write_tokens(layout, layer, slots, keys, values)
        written.append(torch.stack((keys, values)))
    chunk = gather(layers, geometry, slots, geometry.empty_chunk(len(slots)))
    true = layout.unpack_chunk(chunk)
    assert torch.equal(true, torch.stack(written))  # (layers, kv, tokens, heads, head_size)
    again = layout.pack_chunk(true, geometry.empty_chunk(len(slots)))
    assert torch.equal(again, chunk)


def test_an_engine_with_vllms_packing_stores_int8_per_true_key_channel_and_loads_it_back(tmp_path) -> None:
    """cpu-disk-int8 on a cache vLLM's op wrote: the disk payloads hold the tokens' true keys and
    values (option bit 1), quantized per key channel, and a load from disk packs them back into
    vLLM's blocks within int8's bound on the true tokens. Fails when the packing the table reads
    is not the one the op wrote (the bound is per true channel; loud channels break it otherwise)."""
    import time

    from flowkv import CacheEngine, KVTransfer, payload
    from flowkv.codecs import get_codec
    from flowkv.items import Request
    from flowkv.kernels import KVGeometry
    from flowkv.tiers.disk import key_digest

    block_size, head_size, heads, blocks = 32, 64, 2, 8
    layout = packed_layout(torch.bfloat16, block_size=block_size, head_size=head_size)
    geometry = KVGeometry("cpu", num_layers=2, num_kv_heads=heads, head_size=head_size, block_size=block_size,
                          dtype=torch.bfloat16)
    engine = CacheEngine.from_pipeline("cpu-disk-int8", geometry=geometry, model_name="tiny", packing=layout,
                                       overrides={"chunk_size": 64, "tiers.memory.capacity": "8MiB",
                                                  "tiers.disk.path": str(tmp_path / "disk"),
                                                  "tiers.disk.timeout_s": 10.0})
    try:
        slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in (5, 2, 7, 0)])
        g = torch.Generator().manual_seed(6)
        true = torch.randn(2, 2, len(slots), heads, head_size, generator=g)
        true[:, 0, :, :, ::8] *= 40  # loud key channels, as a trained model's keys have
        true = true.to(torch.bfloat16)
        src = [torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.bfloat16) for _ in range(2)]
        for layer, kv in zip(src, true):
            write_tokens(layout, layer, slots, kv[0], kv[1])
        tokens = torch.randint(0, 32000, (len(slots),), generator=g)
        assert engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots)).stored_tokens == len(slots)
        assert engine.flush(30.0)
        keys = [k.to_str() for k in engine.chunk_keys(Request(tokens=tokens))]
        blobs = [(tmp_path / "disk" / key_digest(k)[:2] / f"{key_digest(k)}.kv").read_bytes() for k in keys]
        assert [(payload.read_header(b).codec, payload.read_header(b).unpacked) for b in blobs] == [("int8", True)] * 2
        for key in keys:
            assert engine.memory.remove(key)
        dst = [torch.zeros_like(layer) for layer in src]
        deadline = time.monotonic() + 30
        while not bool(engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots)).ret_mask.all()):
            assert time.monotonic() < deadline, "the disk copy never came back"
        codec = get_codec("int8")
        params = codec.resolve_params(scale_dtype="fp16")
        for index, (layer, kv) in enumerate(zip(dst, true)):
            loaded = torch.stack(layout.read_tokens(layer, slots))  # (2, tokens, heads, head_size)
            assert not torch.equal(loaded, kv)  # int8: lossy
            for start in (0, 64):  # per chunk, as it was quantized
                want = true[index:index + 1, :, start:start + 64]
                bound = codec.max_error(want, params)[0]
                error = (loaded[:, start:start + 64].double() - want[0].double()).abs()
                assert bool((error <= bound).all()), f"layer {index}, chunk at {start}: beyond int8's per-channel bound"
    finally:
        engine.close()


def test_caches_packed_differently_never_share_raw_chunks() -> None:
    """The chunk keys' layout carries the packing: raw chunks are the blocks' bytes, so an engine
    whose cache packs keys another way (another ISA; here vec's table transposed, as amx and vec
    differ) keys the same tokens differently, and one with the same table keys them the same."""
    from flowkv import CacheEngine
    from flowkv.items import Request
    from flowkv.kernels import KVGeometry

    vec = packed_layout(torch.bfloat16, block_size=32, head_size=64, isa="vec")
    same = packed_layout(torch.bfloat16, block_size=32, head_size=64, isa="vec")
    t, d = torch.meshgrid(torch.arange(32), torch.arange(64), indexing="ij")
    other = PackedBlockLayout(isa="other", block_size=32, head_size=64, dtype=torch.bfloat16,
                              key_offsets=t * 64 + d, value_offsets=vec.value_offsets)
    assert vec.fingerprint() == same.fingerprint() != other.fingerprint()
    geometry = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=64, block_size=32, dtype=torch.bfloat16)
    tokens = torch.arange(128)
    keys = {}
    for name, packing in (("vec", vec), ("same", same), ("other", other), ("none", None)):
        engine = CacheEngine.from_pipeline("local-cpu", geometry=geometry, model_name="tiny", packing=packing,
                                           overrides={"chunk_size": 64, "tiers.memory.capacity": "4MiB"})
        try:
            keys[name] = [k.to_str() for k in engine.chunk_keys(Request(tokens=tokens))]
        finally:
            engine.close()
    assert keys["vec"] == keys["same"]
    assert len({tuple(keys[name]) for name in ("vec", "other", "none")}) == 3
    assert vec.fingerprint() in keys["vec"][0] and other.fingerprint() in keys["other"][0]
