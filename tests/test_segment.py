"""The built-in ``segment`` stage and segment keys (issue 24, step 1), through the engine API.

Requests are cut after each ``[blend] separator``; with segment keys a
document's chunks are keyed by its own tokens only, so a document stored
after one prefix is found after another, in any order. With ``keys =
"chain"`` the same boundaries keep the prefix chain (what the old
``examples/segmenter`` did): a prompt reuses a whole document, where
fixed-size chunks stop at the last chunk boundary inside it.
"""

from __future__ import annotations

import pytest
import torch

from flowkv import CacheEngine, KVTransfer
from flowkv.keys import ChunkKeys, chain_hashes, segment_hashes
from flowkv.kernels import KVGeometry, gather
from flowkv.pipeline import PipelineError, load_pipeline, loads_pipeline, resolve_source
from flowkv.stages.chunking import segment_ends
from flowkv.testing import make_paged_kv, random_slot_mapping

SEP = [7, 7]
CHUNK = 64
BLOCKS = 96
GEOMETRY = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)


def doc(seed: int, n: int) -> list[int]:
    """``n`` random tokens, then the separator that closes the document."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(100, 2000, (n,), generator=g)).tolist() + SEP


def make(pipeline: str, *, tmp_path=None, **overrides) -> CacheEngine:
    settings = {"chunk_size": CHUNK, "tiers.memory.capacity": "8MiB", "blend.separator": SEP, **overrides}
    if pipeline == "local-cpu":
        settings = {k: v for k, v in settings.items() if not k.startswith("blend.")}
    if tmp_path is not None:
        settings["tiers.disk.path"] = str(tmp_path / "disk")
    return CacheEngine.from_pipeline(pipeline, geometry=GEOMETRY, model_name="tiny", overrides=settings)


def kv_of(cache, slots: torch.Tensor) -> torch.Tensor:
    return gather(cache, GEOMETRY, slots, torch.empty(GEOMETRY.chunk_shape(len(slots)), dtype=GEOMETRY.dtype))


# -- cutting ------------------------------------------------------------------------


def test_segments_end_after_each_separator_which_belongs_to_the_segment_it_closes() -> None:
    assert segment_ends([1, 2, 7, 7, 3, 4, 5], SEP, 100) == [(0, 4), (4, 7)]
    assert segment_ends([7, 7, 7, 7], SEP, 100) == [(0, 2), (2, 4)]
    assert segment_ends([1, 7, 7], SEP, 100) == [(0, 3)]
    assert segment_ends([], SEP, 100) == []
    # A long segment is cut into pieces that all name its start; the cuts leave no hole.
    cuts = segment_ends([1, 2, 3, 4, 5, 7, 7, 9], SEP, 3)
    assert cuts == [(0, 3), (0, 6), (0, 7), (7, 8)]
    ends = [end for _, end in cuts]
    assert ends == sorted(ends) and ends[-1] == 8
    with pytest.raises(ValueError, match="at least one token"):
        segment_ends([1, 2], [], 3)


# -- keys -------------------------------------------------------------------------


def test_a_segment_key_depends_only_on_its_own_tokens_and_the_isolation_fields() -> None:
    a, b, c = doc(1, 30), doc(2, 20), doc(3, 10)

    def keys(tokens, **fields):
        spans, starts = [], []
        start = 0
        for seg_start, end in segment_ends(tokens, SEP, 16):
            spans.append((start, end))
            starts.append(seg_start)
            start = end
        base = dict(model="m", world_size=2, rank=0, dtype="bfloat16", layout="lbhnc", chunk_size=16,
                    hash_function="sha256")
        base.update(fields)
        tags = base.pop("tags", None)
        return ChunkKeys(**base).of(torch.tensor(tokens), tags, spans, segment_starts=starts)

    ab, cb, ba = keys(a + b), keys(c + b), keys(b + a)
    a_keys, b_keys = ab[:2], ab[2:]  # a: 32 tokens in two pieces of 16; b: 22 in two
    assert cb[1:] == b_keys  # b after c keys as b after a
    assert ba[:2] == b_keys and ba[2:] == a_keys  # the order does not matter
    assert keys(a + b)[0] != keys(b + a)[0]
    for field, value in (("model", "other"), ("rank", 1), ("dtype", "float16"), ("layout", "nhd"),
                         ("tags", {"lora": "x"})):
        assert keys(a + b, **{field: value})[2] != b_keys[0], field
    # Segment keys never meet the prefix chain of the same tokens (domain separated).
    assert segment_hashes(a, [(0, 32)], [0], "sha256")[0] != chain_hashes(a, 32, "sha256")[0]


# -- the [blend] table ------------------------------------------------------------------


def test_blend_pipelines_load_and_need_a_separator() -> None:
    for name in ("blend", "blend-disk"):
        with pytest.raises(PipelineError) as err:
            load_pipeline(name)
        assert "missing required key 'separator'" in str(err.value)
        assert f"{name}.toml:" in str(err.value) and str(err.value).count(":") >= 3  # FILE:LINE:COL
        pipeline = load_pipeline(name, overrides={"blend.separator": [271, 198], "blend.recompute_ratio": 0.3})
        assert pipeline.blend.separator == [271, 198]
        assert pipeline.blend.recompute_ratio == 0.3 and pipeline.blend.check_layers == [1]
    assert load_pipeline("blend", overrides={"blend.separator": [1]}).blend.recompute_ratio == 0.15
    assert load_pipeline("local-cpu").blend is None


BLEND_TEXT = """
[pipeline]
name = "b"

[tiers.memory]
kind = "memory"
capacity = "1MiB"
{blend}
[[store.stages]]
use = "segment"

[[store.stages]]
use = "chunk-hash"

[[retrieve.stages]]
use = "segment"
"""


@pytest.mark.parametrize(("blend", "where", "message"), [
    ("", (10, 1), "stage 'segment' reads its separator from the [blend] table"),
    ("[blend]\nrecompute_ratio = 0.2\n", (8, 1), "missing required key 'separator'"),
    ("[blend]\nseparator = []\n", (9, 1), "separator must be a non-empty list of token ids"),
    ("[blend]\nseparator = [-1]\n", (9, 1), "separator must be a non-empty list of token ids"),
    ("[blend]\nseparator = [1]\nrecompute_ratio = 1.01\n", (10, 1), "recompute_ratio must lie in 0.0..1.0"),
    ("[blend]\nseparator = [1]\ncheck_layers = [1, 1]\n", (10, 1), "check_layers must be a non-empty list"),
    ("[blend]\nseparator = [1]\ncheck_layer = [1]\n", (10, 1), "unknown key 'check_layer'; did you mean 'check_layers'"),
])
def test_a_bad_blend_table_stops_at_load_with_its_place(blend, where, message) -> None:
    with pytest.raises(PipelineError) as err:
        loads_pipeline(BLEND_TEXT.format(blend=blend), file="b.toml")
    lines = str(err.value).splitlines()
    assert any(line.startswith(f"b.toml:{where[0]}:{where[1]}: ") and message in line for line in lines), lines


def test_ratio_bounds_are_accepted() -> None:
    for ratio in (0, 0.0, 1.0):
        text = BLEND_TEXT.format(blend=f"[blend]\nseparator = [1]\nrecompute_ratio = {ratio}\n")
        assert loads_pipeline(text).blend.recompute_ratio == float(ratio)


# -- store and retrieve through the engine ------------------------------------------------


@pytest.mark.parametrize("pipeline", ["blend", "blend-disk"])
def test_documents_stored_in_one_order_are_found_and_loaded_in_another(pipeline, tmp_path) -> None:
    system, d1, d2, d3 = doc(10, 40), doc(11, 90), doc(12, 50), doc(13, 30)
    question = [11, 12, 13, 14, 15]
    first = system + d1 + d2 + d3 + question
    src = make_paged_kv(GEOMETRY, BLOCKS, seed=0)
    src_slots = random_slot_mapping(len(first), GEOMETRY, BLOCKS, seed=1)
    engine = make(pipeline, tmp_path=tmp_path if pipeline == "blend-disk" else None)
    try:
        # The open question is not stored: the documents are, each whole.
        assert engine.store(KVTransfer(tokens=torch.tensor(first), kv_caches=src,
                                       slot_mapping=src_slots)).stored_tokens == len(first) - len(question)
        if pipeline == "blend-disk":
            assert engine.flush(30.0)
            assert engine.stats()["tiers"]["disk"]["writes"] > 0
            engine.close()  # a restarted engine: memory empty, what follows comes from disk
            engine = make(pipeline, tmp_path=tmp_path)

        second = system + d3 + d1 + question[:2]
        assert engine.lookup(torch.tensor(second)) == len(second) - 2
        dst = make_paged_kv(GEOMETRY, BLOCKS, seed=2, fill=False)
        dst_slots = random_slot_mapping(len(second), GEOMETRY, BLOCKS, seed=3)
        result = engine.retrieve(KVTransfer(tokens=torch.tensor(second), kv_caches=dst, slot_mapping=dst_slots))
        mask = result.ret_mask
        assert int(mask.sum()) == len(second) - 2 and bool(mask[: len(second) - 2].all())
        if pipeline == "blend-disk":
            assert engine.stats()["tiers"]["disk"]["hits"] > 0
        # Each document's KV is what was stored for it, now at its new place.
        at = {"system": 0, "d1": len(system), "d3": len(system) + len(d1) + len(d2)}
        now = {"system": 0, "d3": len(system), "d1": len(system) + len(d3)}
        for name, size in (("system", len(system)), ("d3", len(d3)), ("d1", len(d1))):
            want = kv_of(src, src_slots[at[name]:at[name] + size])
            got = kv_of(dst, dst_slots[now[name]:now[name] + size])
            assert torch.equal(got, want), name
        # Each moved piece says where its KV was computed (memory: object meta; disk: payload header).
        moved = []
        for name, size in (("d3", len(d3)), ("d1", len(d1))):
            moved += [(now[name] + piece, now[name] + min(piece + CHUNK, size), at[name] + piece)
                      for piece in range(0, size, CHUNK)]
        assert result.moved == tuple(moved)  # the system prompt sits where it was: not moved

        # A document never stored ends the hit: the system prompt is found, then nothing.
        third = system + doc(99, 20) + d2
        assert engine.lookup(torch.tensor(third)) == len(system)
    finally:
        engine.close()


def test_chain_keys_on_segment_boundaries_reuse_a_whole_document(tmp_path) -> None:
    """``keys = "chain"``: document boundaries with the prefix chain (the old example segmenter)."""
    chained = tmp_path / "rag.toml"
    text = (resolve_source("blend").read_text()
            .replace('use = "segment"', 'use = "segment"\nkeys = "chain"'))
    chained.write_text(text)
    a, b, c = doc(1, 98), doc(2, 50), doc(3, 40)
    question = [11, 12, 13, 14, 15]
    first = torch.tensor(a + b + question)
    second = torch.tensor(a + c + question)
    src = make_paged_kv(GEOMETRY, BLOCKS, seed=0)
    slots = random_slot_mapping(len(first), GEOMETRY, BLOCKS, seed=1)

    segmented = make(str(chained))
    fixed = make("local-cpu")
    stored = segmented.store(KVTransfer(tokens=first, kv_caches=src, slot_mapping=slots)).stored_tokens
    assert stored == len(a) + len(b)  # the question is not stored
    fixed.store(KVTransfer(tokens=first, kv_caches=src, slot_mapping=slots))

    assert segmented.lookup(second) == len(a)  # all of document A (100 tokens)
    assert fixed.lookup(second) == CHUNK  # fixed chunks: only the first 64
    # Chained: b after c is not b after a.
    assert segmented.lookup(torch.tensor(c + b)) == 0

    dst = make_paged_kv(GEOMETRY, BLOCKS, seed=2, fill=False)
    mask = segmented.retrieve(KVTransfer(tokens=second, kv_caches=dst, slot_mapping=slots)).ret_mask
    assert int(mask.sum()) == len(a) and bool(mask[: len(a)].all())
    hit = slots[: len(a)]
    assert torch.equal(kv_of(dst, hit), kv_of(src, hit))
