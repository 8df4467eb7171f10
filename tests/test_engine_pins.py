"""Pins taken by lookup: what holds them, what drops them, and that none leaks."""

from __future__ import annotations

import random

import torch

from flowkv import CacheEngine, KVTransfer
from flowkv.kernels import KVGeometry
from flowkv.testing import ManualClock
from flowkv._testing.paged import make_paged_kv, random_slot_mapping

CHUNK = 32
NUM_BLOCKS = 64
GEOMETRY = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
# What one raw chunk costs in memory: whole 4 KiB pages (8 KiB here).
SLAB = -(-(GEOMETRY.token_bytes * CHUNK) // 4096) * 4096


def engine(slabs: int = 64, clock: ManualClock | None = None, **overrides) -> CacheEngine:
    """An engine whose pin deadlines and pin timer follow ``clock`` (a fresh ManualClock by default):
    no pin expires unless the test moves the clock."""
    settings = {"chunk_size": CHUNK, "tiers.memory.capacity": slabs * SLAB, **overrides}
    return CacheEngine.from_pipeline("local-cpu", geometry=GEOMETRY, model_name="tiny", overrides=settings,
                                     clock=clock or ManualClock())


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed))


SRC = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=1)
SLOTS = random_slot_mapping(NUM_BLOCKS * GEOMETRY.block_size, GEOMETRY, NUM_BLOCKS, seed=2)


def store(e: CacheEngine, ids: torch.Tensor) -> int:
    return e.store(KVTransfer(tokens=ids, kv_caches=SRC, slot_mapping=SLOTS[: len(ids)])).stored_tokens


def retrieve(e: CacheEngine, ids: torch.Tensor, dst, **kwargs) -> int:
    return int(e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=SLOTS[: len(ids)],
                                     **kwargs)).ret_mask.sum())


def pinned(e: CacheEngine) -> int:
    return e.stats()["tiers"]["memory"]["pinned_objects"]


def test_retrieve_releases_the_pins_of_its_lookup():
    e = engine()
    ids = tokens(4 * CHUNK, seed=0)
    store(e, ids)
    assert e.lookup(ids, pin=True, lookup_id="req-a") == 4 * CHUNK
    assert pinned(e) == 4
    dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=3, fill=False)
    assert retrieve(e, ids, dst, lookup_id="req-a") == 4 * CHUNK
    assert pinned(e) == 0


def test_release_drops_every_pin_of_one_lookup_only():
    e = engine()
    ids = tokens(4 * CHUNK, seed=0)
    store(e, ids)
    e.lookup(ids, pin=True, lookup_id="a")
    e.lookup(ids[: 2 * CHUNK], pin=True, lookup_id="b")
    e.release("a")
    assert pinned(e) == 2  # "b" still holds chunks 0 and 1
    e.release("a")  # twice, or an id that never pinned: nothing happens
    e.release("never-seen")
    e.release("b")
    assert pinned(e) == 0


def test_pins_keep_chunks_from_eviction_until_retrieve():
    e = engine(slabs=4)
    first, second = tokens(4 * CHUNK, seed=0), tokens(2 * CHUNK, seed=1)
    assert store(e, first) == 4 * CHUNK
    assert e.lookup(first, pin=True, lookup_id="first") == 4 * CHUNK
    # Memory is full of pinned chunks: the next store backs off instead of evicting them.
    assert store(e, second) == 0
    assert e.stats()["store_backpressure_stops"] == 1
    dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=3, fill=False)
    assert retrieve(e, first, dst, lookup_id="first") == 4 * CHUNK
    # Unpinned now: the same store evicts the two oldest and succeeds.
    assert store(e, second) == 2 * CHUNK
    assert e.lookup(first) == 0


def test_pins_expire_at_their_deadline_without_any_call():
    clock = ManualClock()
    timeout_s = 2.0
    e = engine(slabs=4, clock=clock, pin_timeout_s=timeout_s)
    ids = tokens(4 * CHUNK, seed=0)
    store(e, ids)
    e.lookup(ids, pin=True, lookup_id="abandoned")
    clock.advance(timeout_s - 0.01)
    e.lookup(tokens(CHUNK, seed=5))  # a call before the deadline expires nothing
    assert pinned(e) == 4
    # No call after this: the storage manager's own timer drops the pins at its next tick.
    clock.advance(0.01 + e.storage.pin_timer_interval_s)
    assert pinned(e) == 0
    # A full arena of expired pins does not stop a store.
    assert store(e, tokens(2 * CHUNK, seed=1)) == 2 * CHUNK


def test_pins_past_their_deadline_are_gone_for_the_engines_next_call():
    for next_call in ("lookup", "store", "retrieve"):
        clock = ManualClock()
        e = engine(slabs=4, clock=clock, pin_timeout_s=0.05)
        ids = tokens(4 * CHUNK, seed=0)
        store(e, ids)
        e.lookup(ids, pin=True, lookup_id="abandoned")
        assert pinned(e) == 4, next_call
        clock.advance(0.1)
        other = tokens(2 * CHUNK, seed=1)
        if next_call == "lookup":
            e.lookup(other)
        elif next_call == "store":
            # A full arena of expired pins must not stop a store.
            assert store(e, other) == 2 * CHUNK
        else:
            retrieve(e, other, make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=3, fill=False))
        assert pinned(e) == 0, next_call


def test_no_pin_or_slab_survives_1000_mixed_operations():
    timeout_s = 0.5
    step_s = 0.01  # each operation moves the clock on; a pin lives 50 operations
    clock = ManualClock()
    e = engine(slabs=12, clock=clock, pin_timeout_s=timeout_s)
    rng = random.Random(0)
    base = tokens(8 * CHUNK, seed=0)
    # Prompts share prefixes, like requests with one system prompt.
    prompts = [base[: rng.randint(1, 8 * CHUNK)] for _ in range(6)] + [tokens(5 * CHUNK, seed=s) for s in (1, 2)]
    dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=3, fill=False)
    open_lookups: dict[str, tuple[torch.Tensor, int, float]] = {}
    abandoned = expired = 0

    for step in range(1000):
        clock.advance(step_s)
        # A lookup nobody came back for within its pin timeout is abandoned: its pins expire.
        for lookup_id, (_, _, when) in list(open_lookups.items()):
            if clock.now() - when >= timeout_s - step_s:
                del open_lookups[lookup_id]
                expired += 1
        op = rng.choice(["store", "store", "lookup", "pin", "pin", "retrieve", "release", "abandon"])
        ids = rng.choice(prompts)
        if op == "store":
            stored = store(e, ids)
            assert 0 <= stored <= len(ids) and stored % CHUNK == 0
        elif op == "lookup":
            assert e.lookup(ids) % CHUNK == 0
        elif op == "pin":
            lookup_id = f"req-{step}"
            open_lookups[lookup_id] = (ids, e.lookup(ids, pin=True, lookup_id=lookup_id), clock.now())
        elif op in ("retrieve", "release", "abandon") and open_lookups:
            lookup_id = rng.choice(sorted(open_lookups))
            ids, hit, when = open_lookups.pop(lookup_id)
            if op == "retrieve":
                # Every lookup still open is within its pin timeout (the clock says so exactly).
                assert clock.now() - when < timeout_s
                loaded = retrieve(e, ids, dst, lookup_id=lookup_id)
                assert loaded >= hit, f"step {step}: pinned chunks were lost before retrieve"
            elif op == "release":
                e.release(lookup_id)
            else:
                abandoned += 1  # never retrieved nor released: only the timeout frees it
                continue
            # The owner holds nothing any more.
            assert e.memory.release_owner(lookup_id) == 0
        memory = e.stats()["tiers"]["memory"]
        assert memory["pinned_objects"] <= memory["entries"] <= 12
        # Every page in use belongs to an entry: no run leaked one.
        assert memory["used_bytes"] == memory["entries"] * SLAB

    assert abandoned > 0 and expired > 0 and e.stats()["stores"] > 0 and e.stats()["retrieves"] > 0
    for lookup_id in list(open_lookups):
        e.release(lookup_id)
    # Past every deadline the timer alone clears what the abandoned lookups pinned.
    clock.advance(timeout_s + e.storage.pin_timer_interval_s)
    memory = e.stats()["tiers"]["memory"]
    assert memory["pinned_objects"] == 0
    assert memory["used_bytes"] == memory["entries"] * SLAB
    assert memory["evictions"] > 0, "the arena was never under pressure"
    # With no pin left, everything can be evicted: a fresh prompt fills the whole arena.
    assert store(e, tokens(12 * CHUNK, seed=99)) == 12 * CHUNK
