"""The engine keyed by chunk hashes its caller worked out: what the vLLM connector sends instead of tokens."""

from __future__ import annotations

import pytest
import torch

from flowkv import CacheEngine, KVTransfer, telemetry
from flowkv._testing.paged import make_paged_kv, random_slot_mapping
from flowkv.kernels import KVGeometry
from flowkv.keys import chain_hashes
from flowkv.otlp_json import load_spans
from flowkv.pipeline import dumps_pipeline, loads_pipeline

CHUNK = 32
NUM_BLOCKS = 64
GEOMETRY = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
SRC = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=1)
SLOTS = random_slot_mapping(NUM_BLOCKS * 16, GEOMETRY, NUM_BLOCKS, seed=2)


def engine(**overrides) -> CacheEngine:
    return CacheEngine.from_pipeline("local-cpu", geometry=GEOMETRY, model_name="tiny",
                                     overrides={"chunk_size": CHUNK, "tiers.memory.capacity": "4MiB",
                                                "hash": "sha256", **overrides})


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunks_stored_by_their_hashes_one_run_at_a_time_are_the_chunks_of_the_tokens():
    e = engine()
    ids = tokens(6 * CHUNK + 5, seed=1)
    hashes = chain_hashes(ids, CHUNK, "sha256")
    # Two stores, each of the chunks one step completed, with no token before them.
    for start, end in ((0, 2 * CHUNK), (2 * CHUNK, 6 * CHUNK)):
        stored = e.store(KVTransfer(tokens=ids[start:end], kv_caches=SRC, slot_mapping=SLOTS[start:end],
                                    chunk_hashes=hashes[start // CHUNK:end // CHUNK]))
        assert stored.stored_tokens == end - start
    assert e.lookup(torch.tensor(ids)) == 6 * CHUNK


def test_a_lookup_by_hashes_answers_as_one_by_tokens_and_says_what_memory_holds():
    e = engine()
    ids = tokens(4 * CHUNK, seed=2)
    e.store(KVTransfer(tokens=ids, kv_caches=SRC, slot_mapping=SLOTS[: len(ids)]))
    asked = ids + tokens(CHUNK + 3, seed=3)
    found = e.lookup_result(chunk_hashes=chain_hashes(asked, CHUNK, "sha256"), num_tokens=len(asked))
    assert (found.hit_tokens, found.memory_tokens) == (4 * CHUNK, 4 * CHUNK)
    assert e.lookup(torch.tensor(asked)) == 4 * CHUNK
    assert e.held_tokens(chain_hashes(asked, CHUNK, "sha256"), len(asked)) == 4 * CHUNK
    # A hash of another function's length keys nothing: the run fails and answers no hit.
    assert e.lookup_result(chunk_hashes=[b"short"], num_tokens=CHUNK).hit_tokens == 0


def test_a_repeated_lookup_counts_only_what_the_first_did_not():
    e = engine()
    ids = tokens(4 * CHUNK, seed=4)
    e.store(KVTransfer(tokens=ids[: 2 * CHUNK], kv_caches=SRC, slot_mapping=SLOTS[: 2 * CHUNK]))
    first = e.lookup_result(ids)
    e.store(KVTransfer(tokens=ids, kv_caches=SRC, slot_mapping=SLOTS[: len(ids)]))
    again = e.lookup_result(ids, counted=(len(ids), first.hit_tokens))
    stats = e.stats()
    assert (first.hit_tokens, again.hit_tokens) == (2 * CHUNK, 4 * CHUNK)
    assert (stats["lookups"], stats["lookup_repeats"]) == (1, 1)
    assert (stats["lookup_requested_tokens"], stats["lookup_hit_tokens"]) == (4 * CHUNK, 4 * CHUNK)


def disk_engine(tmp_path, *, lookup_tiers: list[str] | None = None) -> CacheEngine:
    """Memory in front of a disk tier, its lookup stage asking ``lookup_tiers`` (default: all), traced to files."""
    text = dumps_pipeline(
        pipeline={"name": "held", "chunk_size": CHUNK, "hash": "sha256"},
        tiers={"memory": {"kind": "memory", "capacity": "4MiB", "pin_memory": False},
               "disk": {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}},
        store=["tokenize", "chunk-hash", "allocate", "gather", "put"],
        retrieve=["tokenize", "chunk-hash", ("lookup", {"tiers": lookup_tiers} if lookup_tiers else {}), "get",
                  "decompress", "scatter"],
        sections={"telemetry": {"exporter": "file", "folder": str(tmp_path / "traces")}},
    )
    return CacheEngine(loads_pipeline(text), geometry=GEOMETRY, model_name="tiny")


@pytest.mark.parametrize("lookup_tiers", [None, ["memory"]])
def test_held_tokens_runs_the_lookup_list_as_a_check(tmp_path, lookup_tiers):
    """A check before a load: the lookup stage's own ``tiers`` and a span, no pin, no prefetch, nothing counted."""
    e = disk_engine(tmp_path, lookup_tiers=lookup_tiers)
    try:
        ids = tokens(4 * CHUNK, seed=5)
        e.store(KVTransfer(tokens=ids, kv_caches=SRC, slot_mapping=SLOTS[: len(ids)]))
        assert e.flush(10.0)
        e.memory.clear()  # the chunks are on disk only
        before = e.stats()
        held = e.held_tokens(chain_hashes(ids, CHUNK, "sha256"), len(ids))
        assert held == (0 if lookup_tiers == ["memory"] else 4 * CHUNK)
        after = e.stats()
        for name in ("lookups", "lookup_requested_tokens", "lookup_hit_tokens", "prefetches", "promotions"):
            assert after.get(name, 0) == before.get(name, 0), name
        assert len(e.memory) == 0 and after["tiers"]["memory"]["pinned_objects"] == 0
        telemetry.flush()
        spans = [s for f in (tmp_path / "traces").glob("flowkv-*.json") for s in load_spans(f)]
        by_id = {s.span_id: s for s in spans}
        [lookup] = [s for s in spans if s.name == "lookup"]
        assert by_id[lookup.parent_span_id].name == "flowkv.lookup"
    finally:
        e.close()
