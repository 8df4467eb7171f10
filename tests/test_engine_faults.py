"""What the engine does when things go wrong inside a run: corrupt data, lost chunks, failing stages.

The failing and evicting stages below are ordinary user stages, named in a
pipeline file as ``"<this module>:<function>"``, the way an operator's own
stage is.
"""

from __future__ import annotations

import logging

import pytest
import torch

import flowkv
from flowkv import CacheEngine, KVTransfer
from flowkv.kernels import KVGeometry
from flowkv.kernels.geometry import canonical_view
from flowkv.pipeline import resolve_source
from flowkv._testing.paged import make_paged_kv, random_slot_mapping

CHUNK = 64
NUM_BLOCKS = 32
NUM_TOKENS = 4 * CHUNK
GEOMETRY = KVGeometry("flash_kv_nhd", num_layers=2, num_kv_heads=2, head_size=16, block_size=16,
                      dtype=torch.bfloat16)
SETTINGS = {"chunk_size": CHUNK, "tiers.memory.capacity": "4MiB"}

# Calls that reached the failing stage, so a test can tell skipped work from failed work.
EXPLOSIONS: list[str] = []


@flowkv.stage("explode-when-tagged", kinds=("store", "retrieve", "lookup"), needs={"key"}, gives={"key"})
def explode_when_tagged(chunks, *, ctx):
    """Raises for requests tagged ``explode``; passes the others through."""
    for chunk in chunks:
        if "explode" in chunk.request.tags:
            EXPLOSIONS.append(ctx.kind)
            raise RuntimeError(f"disk on fire during {ctx.kind}")
        yield chunk


@flowkv.stage("evict-after-lookup", kinds=("retrieve",), needs={"hit"}, gives={"hit"})
def evict_after_lookup(chunks, *, ctx, index: int = 2):
    """Drops chunk ``index`` from memory after lookup found it: an eviction racing the retrieve."""
    for chunk in chunks:
        if chunk.index == index:
            ctx.services.storage.remove(chunk.key_str)
        yield chunk


def pipeline_with(tmp_path, stage: str, *, after: str, kinds: tuple[str, ...], base: str = "local-cpu") -> str:
    """The built-in pipeline ``base`` with ``stage`` inserted after ``after`` in the ``kinds`` lists."""
    lines = []
    current = None
    for line in resolve_source(base).read_text().splitlines():
        lines.append(line)
        if line.startswith("[["):
            current = line.strip("[]").split(".")[0]
        if current in kinds and line.strip() == f'use = "{after}"':
            lines += [f"[[{current}.stages]]", f'use = "{__name__}:{stage}"']
    path = tmp_path / f"{base}-{stage}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 32000, (NUM_TOKENS,), generator=torch.Generator().manual_seed(seed))


def slot_values(kv_caches, slots):
    g = GEOMETRY
    return torch.stack([canonical_view(layer, g)[:, slots // g.block_size, slots % g.block_size]
                        for layer in kv_caches]).view(torch.int16)


def compressible_kv(seed: int) -> list[torch.Tensor]:
    kv_caches = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=seed)
    for layer in kv_caches:
        layer.copy_(torch.round(layer.float() * 4) / 4)
    return kv_caches


# -- corrupt data ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["header", "body"])
def test_a_corrupt_payload_in_memory_is_a_counted_miss_and_never_loaded(where):
    e = CacheEngine.from_pipeline("local-cpu-lz4", geometry=GEOMETRY, model_name="tiny", overrides=SETTINGS)
    src = compressible_kv(seed=1)
    dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=2, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, GEOMETRY, NUM_BLOCKS, seed=3)
    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == NUM_TOKENS

    # Chunk 1's slab, encoded by the pipeline's codec: flip a byte of its header or of its body.
    key = e.memory.keys()[1]  # oldest first, i.e. in chunk order after one store
    obj = e.memory.get(key)
    assert obj.meta["codec"] == "lz4-shuffle"
    encoded = obj.view_bytes()[: obj.meta["encoded_len"]]
    offset = 8 if where == "header" else len(encoded) - 5
    encoded[offset] ^= 0x5A
    obj.ref_down()

    # Lookup reads no payload: it cannot know, and promises all four chunks.
    assert e.lookup(ids) == NUM_TOKENS
    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots))
    ret_mask = result.ret_mask

    assert int(ret_mask.sum()) == CHUNK and ret_mask[:CHUNK].all()
    assert result.failed_range == (CHUNK, NUM_TOKENS)
    assert result.loaded_to == CHUNK
    assert torch.equal(slot_values(dst, slots[:CHUNK]), slot_values(src, slots[:CHUNK]))
    assert not slot_values(dst, slots[CHUNK:]).any(), "nothing of the corrupt chunk or after it was written"
    stats = e.stats()
    assert stats["corrupt_payloads"] == 1
    assert stats["retrieve_short"] == 1
    # The corrupt chunk is dropped, so it is not promised again.
    assert e.lookup(ids) == CHUNK
    assert e.is_healthy(), "bad data is a miss, not an engine failure"
    # A retrieve that does no work (a closed engine skips it) leaves no failed range of an earlier one.
    e.close()
    skipped = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots))
    assert not skipped.ret_mask.any()
    assert skipped.failed_range is None


def test_a_chunk_evicted_after_lookup_shrinks_the_mask_and_names_the_range(tmp_path):
    pipeline = pipeline_with(tmp_path, "evict_after_lookup", after="lookup", kinds=("retrieve",))
    e = CacheEngine.from_pipeline(pipeline, geometry=GEOMETRY, model_name="tiny", overrides=SETTINGS)
    src = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=1)
    dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=2, fill=False)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, GEOMETRY, NUM_BLOCKS, seed=3)
    e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots))

    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots))
    ret_mask = result.ret_mask
    assert int(ret_mask.sum()) == 2 * CHUNK and ret_mask[: 2 * CHUNK].all()
    assert result.failed_range == (2 * CHUNK, NUM_TOKENS)
    assert not slot_values(dst, slots[2 * CHUNK :]).any()
    assert e.stats()["retrieve_missing_chunks"] == 1

    # The next retrieve finds chunk 3 orphaned behind the hole: it loads chunks 0-1 and fails nothing.
    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots))
    assert int(result.ret_mask.sum()) == 2 * CHUNK
    assert result.failed_range is None


# -- failing stages ------------------------------------------------------------------


@pytest.fixture
def failing_engine(tmp_path):
    EXPLOSIONS.clear()
    pipeline = pipeline_with(tmp_path, "explode_when_tagged", after="chunk-hash", kinds=("store", "retrieve"))
    e = CacheEngine.from_pipeline(pipeline, geometry=GEOMETRY, model_name="tiny", overrides=SETTINGS)
    yield e
    e.close()


def test_a_raising_stage_is_logged_and_counted_and_the_call_answers_safely(failing_engine, caplog):
    e = failing_engine
    kv = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=1)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, GEOMETRY, NUM_BLOCKS, seed=3)
    # Untagged requests work: the stage is in every list (lookup runs the head of retrieve).
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots)).stored_tokens == NUM_TOKENS
    assert e.lookup(ids) == NUM_TOKENS

    boom = {"explode": "yes"}
    with caplog.at_level(logging.ERROR, logger="flowkv.engine"):
        assert e.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots, tags=boom)).stored_tokens == 0
    assert "disk on fire during store" in caplog.text
    assert "explode_when_tagged" in caplog.text, "the log names the failing stage"
    # A success in between resets the count of failures in a row.
    assert e.lookup(ids) == NUM_TOKENS
    assert e.lookup(ids, tags=boom) == 0
    assert e.is_healthy()
    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots, tags=boom)).ret_mask
    assert ret_mask.shape == (NUM_TOKENS,) and not ret_mask.any()

    stats = e.stats()
    assert (stats["store_errors"], stats["lookup_errors"], stats["retrieve_errors"]) == (1, 1, 1)
    assert EXPLOSIONS == ["store", "lookup", "retrieve"]


def test_three_failures_in_a_row_make_the_engine_unhealthy_and_skip_work(failing_engine):
    e = failing_engine
    kv = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=1)
    ids = tokens()
    slots = random_slot_mapping(NUM_TOKENS, GEOMETRY, NUM_BLOCKS, seed=3)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots)).stored_tokens == NUM_TOKENS
    e.lookup(ids, pin=True, lookup_id="req")
    boom = {"explode": "yes"}
    for _ in range(3):
        assert e.is_healthy()
        assert e.lookup(ids, tags=boom) == 0
    assert not e.is_healthy()
    assert not e.stats()["healthy"]
    assert len(EXPLOSIONS) == 3

    # Skipped, not attempted: even requests that would succeed, and the failing stage is not called.
    assert e.lookup(ids) == 0
    assert e.store(KVTransfer(tokens=tokens(seed=5), kv_caches=kv, slot_mapping=slots)).stored_tokens == 0
    dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=2, fill=False)
    ret_mask = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots, lookup_id="req")).ret_mask
    assert not ret_mask.any() and not dst[0].any()
    assert len(EXPLOSIONS) == 3
    stats = e.stats()
    assert stats["skipped_unhealthy"] == 3
    # A skipped retrieve still lets go of its lookup's pins.
    assert stats["tiers"]["memory"]["pinned_objects"] == 0


def test_a_closed_engine_skips_work():
    e = CacheEngine.from_pipeline("local-cpu", geometry=GEOMETRY, model_name="tiny", overrides=SETTINGS)
    kv = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=1)
    slots = random_slot_mapping(NUM_TOKENS, GEOMETRY, NUM_BLOCKS, seed=3)
    e.close()
    assert not e.is_healthy()
    assert e.store(KVTransfer(tokens=tokens(), kv_caches=kv, slot_mapping=slots)).stored_tokens == 0
    assert e.lookup(tokens()) == 0
    e.close()  # twice is fine
