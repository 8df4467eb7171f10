"""The memory tier: arena and objects (flowkv.memory), LRU tier and pins (flowkv.tiers.memory), sizes."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from flowkv.memory import MemoryArena, parse_size
from flowkv.tiers.memory import MemoryTier

SLAB = 4096
CHUNK_SHAPE = (2, 2, 16, 2, 8)  # (layers, kv, tokens, heads, head_size), float32 -> 4 KiB


def make_tier(num_slabs: int) -> MemoryTier:
    return MemoryTier.on_arena(MemoryArena(num_slabs * SLAB, slab_bytes=SLAB))


def store(tier: MemoryTier, key: str, fill: float = 0.0) -> None:
    obj = tier.allocate(CHUNK_SHAPE, torch.float32)
    assert obj is not None, f"no room to store {key}"
    obj.tensor.fill_(fill)
    assert tier.put(key, obj)
    obj.ref_down()


# -- sizes -----------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * 2**30), ("4GB", 4 * 10**9), ("512 MiB", 512 * 2**20), ("512mb", 512 * 10**6),
    ("100B", 100), ("100", 100), ("1KiB", 1024), ("1KB", 1000), ("2TiB", 2 * 2**40),
    ("1TB", 10**12), ("1.5GiB", 3 * 2**29), ("0.5KB", 500), (" 8 kib ", 8192), (123, 123),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 GiBs", "4XB", "-1GiB", "4e9", "1.5B", "0.0001KB",
                                  "4 G", "four GiB", True, -5, 4.0, None])
def test_parse_size_refuses_bad_input(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_error_names_the_units():
    with pytest.raises(ValueError, match="KiB.*GiB"):
        parse_size("4 gigs")


# -- arena -----------------------------------------------------------------------


def test_arena_full_returns_none_and_free_makes_room():
    arena = MemoryArena(3 * SLAB, slab_bytes=SLAB)
    objs = [arena.allocate(CHUNK_SHAPE, torch.float32) for _ in range(3)]
    assert all(o is not None for o in objs)
    assert arena.allocate((1,), torch.uint8) is None
    assert arena.used_bytes == arena.capacity_bytes == 3 * SLAB
    objs[1].ref_down()
    assert arena.free_slabs == 1
    again = arena.allocate((10,), torch.float16)
    assert again is not None and again.tensor.shape == (10,)


def test_arena_views_have_shape_dtype_and_do_not_overlap():
    arena = MemoryArena(parse_size("64KiB"), slab_bytes=SLAB)
    a = arena.allocate(CHUNK_SHAPE, torch.float32)
    b = arena.allocate((3, 7), torch.bfloat16)  # a partial chunk takes only the pages it needs
    assert a.tensor.shape == CHUNK_SHAPE and a.tensor.dtype == torch.float32
    assert b.tensor.shape == (3, 7) and b.tensor.dtype == torch.bfloat16
    assert a.nbytes == 4096 and b.nbytes == 42
    a.tensor.fill_(1.0)
    b.tensor.fill_(2.0)
    assert torch.all(a.tensor == 1.0) and torch.all(b.tensor == 2.0)
    assert a.tensor.data_ptr() % 64 == 0 and b.tensor.data_ptr() % 64 == 0


def test_arena_rounds_slabs_to_alignment_and_refuses_bad_sizes():
    arena = MemoryArena(1000, slab_bytes=100)
    assert arena.slab_bytes == 128 and arena.num_slabs == 7
    with pytest.raises(ValueError, match="does not fit a slab"):
        arena.allocate((129,), torch.uint8)
    with pytest.raises(ValueError, match="holds no slab"):
        MemoryArena(100, slab_bytes=4096)
    with pytest.raises(ValueError):
        MemoryArena("1GiB", slab_bytes=0)
    with pytest.raises(ValueError):
        arena.allocate((-1, 4), torch.uint8)


def test_small_objects_take_pages_not_slabs():
    arena = MemoryArena(2 * SLAB, slab_bytes=SLAB, page_bytes=1024)
    assert (arena.page_bytes, arena.pages_per_slab, arena.num_pages) == (1024, 4, 8)
    quarter = [arena.allocate((1024,), torch.uint8) for _ in range(5)]  # five quarter-slab objects
    assert all(q is not None for q in quarter)
    assert arena.used_bytes == 5 * 1024 and arena.free_slabs == 0  # 3 pages left: no whole slab
    assert arena.allocate(CHUNK_SHAPE, torch.float32) is None
    assert arena.allocate((1025,), torch.uint8) is not None  # two pages
    assert arena.allocate((1,), torch.uint8) is not None  # the last page
    assert arena.free_bytes == 0


def test_freed_neighbours_coalesce_into_one_run():
    arena = MemoryArena(2 * SLAB, slab_bytes=SLAB, page_bytes=1024)
    objs = [arena.allocate((1024,), torch.uint8) for _ in range(8)]
    for i in (1, 3, 2):  # free 1 and 3 (two runs), then 2 joins them
        objs[i].ref_down()
    assert arena.free_runs == 1 and arena.free_slabs == 0
    objs[4].ref_down()
    assert arena.free_runs == 1 and arena.free_slabs == 1
    full = arena.allocate(CHUNK_SHAPE, torch.float32)
    assert full is not None and full.tensor.data_ptr() == arena.buffer.data_ptr() + 1024
    objs[0].ref_down()
    objs[7].ref_down()
    assert arena.free_runs == 2 and arena.free_bytes == 2048


def test_fragmented_arena_refuses_an_object_longer_than_any_free_run():
    arena = MemoryArena(2 * SLAB, slab_bytes=SLAB, page_bytes=1024)
    objs = [arena.allocate((1024,), torch.uint8) for _ in range(8)]
    for obj in objs[::2]:
        obj.ref_down()
    assert arena.free_bytes == SLAB and arena.free_runs == 4
    assert arena.allocate((2048,), torch.uint8) is None  # four free pages, none adjacent


def test_tier_evicts_until_one_run_is_long_enough():
    tier = MemoryTier.on_arena(MemoryArena(2 * SLAB, slab_bytes=SLAB, page_bytes=1024))
    for i in range(8):
        obj = tier.allocate((1024,), torch.uint8)
        assert tier.put(f"k{i}", obj)
        obj.ref_down()
    held = tier.get("k1")  # in use: not evictable, and splits the arena
    obj = tier.allocate(CHUNK_SHAPE, torch.float32)
    assert obj is not None
    # k0 alone (before k1) was too short; the next four in LRU order after it made a slab.
    assert tier.stats().evictions == 5 and "k1" in tier and "k0" not in tier
    held.ref_down()
    obj.ref_down()


def test_shrink_gives_the_tail_pages_back_and_keeps_the_bytes():
    arena = MemoryArena(2 * SLAB, slab_bytes=SLAB, page_bytes=1024)
    obj = arena.allocate(CHUNK_SHAPE, torch.float32)
    obj.view_bytes()[:1500] = bytes(range(250)) * 6
    obj.shrink_to_bytes(1500)
    assert obj.tensor.dtype == torch.uint8 and obj.tensor.shape == (1500,) and obj.nbytes == 1500
    assert bytes(obj.view_bytes()) == bytes(range(250)) * 6
    assert arena.used_bytes == 2048 and arena.free_slabs == 1
    obj.ref_up()
    with pytest.raises(RuntimeError, match="only reference"):
        obj.shrink_to_bytes(10)
    obj.ref_down()
    with pytest.raises(ValueError):
        obj.shrink_to_bytes(1501)
    obj.ref_down()
    assert arena.free_bytes == arena.capacity_bytes and arena.free_runs == 1


def test_random_allocations_never_overlap_and_account_every_page():
    arena = MemoryArena(8 * SLAB, slab_bytes=SLAB, page_bytes=256)
    rng = random.Random(7)
    live: list = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).ref_down()
            continue
        obj = arena.allocate((rng.randint(1, SLAB),), torch.uint8)
        if obj is None:
            continue
        if rng.random() < 0.3:
            obj.shrink_to_bytes(rng.randint(0, obj.nbytes))
        live.append(obj)
        spans = sorted((o.tensor.data_ptr(), o.tensor.data_ptr() + max(o.nbytes, 1)) for o in live)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "two objects overlap"
        pages = sum(-(-max(o.nbytes, 1) // 256) for o in live)
        assert arena.used_bytes == pages * 256
    for obj in live:
        obj.ref_down()
    assert arena.free_runs == 1 and arena.free_bytes == arena.capacity_bytes


def test_pin_memory_request_is_honoured_only_with_cuda():
    arena = MemoryArena("64KiB", slab_bytes="4KiB", pin_memory=True)
    assert arena.pinned == torch.cuda.is_available()
    assert arena.buffer.is_pinned() == arena.pinned


def test_encoded_payload_in_a_slab():
    arena = MemoryArena(4 * SLAB, slab_bytes=SLAB)
    payload = bytes(range(256)) * 5
    obj = arena.allocate_bytes(len(payload))
    obj.view_bytes()[:] = payload
    obj.meta["codec"] = "lz4"
    assert obj.meta == {"encoded_len": len(payload), "codec": "lz4"}
    assert bytes(obj.view_bytes()) == payload
    assert obj.nbytes == len(payload)
    with pytest.raises(ValueError):
        arena.allocate_bytes(SLAB + 1)


def test_refcount_frees_once_and_catches_misuse():
    arena = MemoryArena(2 * SLAB, slab_bytes=SLAB)
    obj = arena.allocate((4,), torch.int32)
    obj.ref_up()
    obj.ref_down()
    assert arena.free_slabs == 1 and not obj.freed
    obj.ref_down()
    assert arena.free_slabs == 2 and obj.freed
    with pytest.raises(RuntimeError, match="after its last reference"):
        obj.tensor
    with pytest.raises(RuntimeError):
        obj.ref_down()
    with pytest.raises(RuntimeError):
        obj.ref_up()
    with pytest.raises(RuntimeError):
        arena.allocate((4,), torch.int32).unpin()


# -- tier ------------------------------------------------------------------------


def test_get_put_contains_remove():
    tier = make_tier(4)
    store(tier, "a", 1.0)
    assert tier.contains("a") and "a" in tier and len(tier) == 1
    hit = tier.get("a")
    assert torch.all(hit.tensor == 1.0) and hit.ref_count == 2
    hit.ref_down()
    assert tier.get("missing") is None
    # A second put of a present key is skipped and takes no reference.
    dup = tier.allocate(CHUNK_SHAPE, torch.float32)
    assert not tier.put("a", dup) and dup.ref_count == 1
    dup.ref_down()
    assert tier.remove("a") and not tier.remove("a")
    stats = tier.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.used_bytes) == (0, 1, 1, 0)
    assert tier.arena.free_slabs == 4


def test_put_refuses_objects_of_another_arena():
    tier = make_tier(2)
    foreign = MemoryArena(SLAB, slab_bytes=SLAB).allocate((4,), torch.uint8)
    with pytest.raises(ValueError, match="another arena"):
        tier.put("k", foreign)


def test_lru_eviction_order():
    tier = make_tier(3)
    for key in "abc":
        store(tier, key)
    tier.get("a").ref_down()  # a becomes most recently used: order b, c, a
    store(tier, "d")
    assert tier.keys() == ["c", "a", "d"]
    store(tier, "e")
    assert tier.keys() == ["a", "d", "e"]
    assert tier.contains("a") is True and tier.keys() == ["a", "d", "e"]  # contains does not touch
    assert tier.stats().evictions == 2


def test_pinned_and_referenced_entries_are_never_evicted():
    tier = make_tier(3)
    for key in "abc":
        store(tier, key)
    assert tier.pin("a", owner_id="lookup-1", timeout_s=30, now=0.0)
    reader = tier.get("b")  # a reader holds b; order c, a, b
    store(tier, "d")         # only c may go
    assert tier.keys() == ["a", "b", "d"]
    tier.pin("d", owner_id="lookup-2", timeout_s=30, now=0.0)
    assert tier.allocate(CHUNK_SHAPE, torch.float32) is None  # returns at once, no wait
    stats = tier.stats()
    assert stats.allocation_failures == 1 and stats.pinned_objects == 2
    assert tier.keys() == ["a", "b", "d"]
    assert torch.equal(reader.tensor, torch.zeros(CHUNK_SHAPE))
    reader.ref_down()
    store(tier, "e")  # now b is evictable
    assert tier.keys() == ["a", "d", "e"]


def test_pins_by_owner_and_release():
    tier = make_tier(4)
    for key in "abc":
        store(tier, key)
    assert not tier.pin("missing", "L1", timeout_s=5)
    for key in "ab":
        assert tier.pin(key, "L1", timeout_s=5)
    tier.pin("a", "L1", timeout_s=5)  # same owner again: still one pin
    tier.pin("a", "L2", timeout_s=5)
    a = tier.get("a")
    assert a.pin_count == 2
    assert tier.unpin("a", "L2") and not tier.unpin("a", "L2") and not tier.unpin("c", "L1")
    assert a.pin_count == 1
    assert tier.release_owner("L1") == 2
    assert tier.release_owner("L1") == 0
    assert a.pin_count == 0 and tier.stats().pinned_objects == 0
    a.ref_down()
    with pytest.raises(ValueError):
        tier.pin("a", "L1", timeout_s=0)


def test_pin_timeout_expiry_makes_entries_evictable():
    tier = make_tier(2)
    store(tier, "a")
    store(tier, "b")
    tier.pin("a", "L1", timeout_s=5.0, now=100.0)
    tier.pin("b", "L2", timeout_s=10.0, now=100.0)
    assert tier.allocate(CHUNK_SHAPE, torch.float32) is None
    assert tier.expire_pins(now=104.9) == 0
    assert tier.expire_pins(now=105.0) == 1
    assert tier.stats().pinned_objects == 1
    tier.pin("b", "L2", timeout_s=10.0, now=108.0)  # re-pin moves the deadline to 118
    assert tier.expire_pins(now=115.0) == 0
    store(tier, "c")  # a, no longer pinned, is evicted
    assert tier.keys() == ["b", "c"]
    assert tier.expire_pins(now=118.0) == 1
    assert tier.release_owner("L2") == 0


def test_remove_drops_pins_but_readers_keep_their_object():
    tier = make_tier(2)
    store(tier, "a", 3.0)
    tier.pin("a", "L1", timeout_s=5)
    reader = tier.get("a")
    assert tier.remove("a")
    assert tier.stats().pinned_objects == 0 and reader.pin_count == 0
    assert tier.release_owner("L1") == 0
    assert torch.all(reader.tensor == 3.0) and tier.arena.free_slabs == 1
    reader.ref_down()
    assert tier.arena.free_slabs == 2


def test_allocate_bytes_evicts_too():
    tier = make_tier(1)
    store(tier, "a")
    obj = tier.allocate_bytes(100)
    assert obj is not None and obj.meta["encoded_len"] == 100 and len(tier) == 0
    obj.view_bytes()[:] = b"x" * 100
    assert tier.put("p", obj)
    obj.ref_down()
    hit = tier.get("p")
    assert bytes(hit.view_bytes()) == b"x" * 100
    hit.ref_down()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_leave_no_pin_and_no_leaked_slab(seed):
    """1,000 random mixed operations against a model of what must hold."""
    rng = random.Random(seed)
    tier = make_tier(8)
    arena = tier.arena
    keys = [f"k{i}" for i in range(16)]
    owners = [f"lookup-{i}" for i in range(4)]
    unput = []      # allocated, caller's reference held, not in the tier
    readers = []    # (key, obj) references taken by get
    pins = {}       # key -> {owner: deadline}: the model of live pins
    fills = {}      # key -> value written into its tensor
    entries = {}    # key -> the object the tier holds under it
    now = 0.0

    for _ in range(1000):
        now += rng.random()
        before = set(tier.keys())
        op = rng.choice(["allocate", "put", "get", "drop_reader", "pin", "unpin",
                         "release", "expire", "remove"])
        if op == "allocate":
            obj = tier.allocate(CHUNK_SHAPE, torch.float32)
            if obj is None:
                # No room is only allowed when nothing was evictable.
                assert all(pins.get(k) or any(rk == k for rk, _ in readers) for k in before)
            else:
                unput.append(obj)
        elif op == "put" and unput:
            obj, key = unput.pop(), rng.choice(keys)
            value = float(rng.randrange(1000))
            obj.tensor.fill_(value)
            if tier.put(key, obj):
                fills[key] = value
                entries[key] = obj
            obj.ref_down()
        elif op == "get":
            key = rng.choice(keys)
            obj = tier.get(key)
            assert (obj is not None) == (key in before)
            if obj is not None:
                assert torch.all(obj.tensor == fills[key])
                readers.append((key, obj))
        elif op == "drop_reader" and readers:
            _, obj = readers.pop(rng.randrange(len(readers)))
            obj.ref_down()
        elif op == "pin":
            key, owner = rng.choice(keys), rng.choice(owners)
            timeout = rng.uniform(0.5, 5.0)
            assert tier.pin(key, owner, timeout_s=timeout, now=now) == (key in before)
            if key in before:
                pins.setdefault(key, {})[owner] = now + timeout
        elif op == "unpin":
            key, owner = rng.choice(keys), rng.choice(owners)
            assert tier.unpin(key, owner) == (owner in pins.get(key, {}))
            pins.get(key, {}).pop(owner, None)
        elif op == "release":
            owner = rng.choice(owners)
            expected = sum(owner in o for o in pins.values())
            assert tier.release_owner(owner) == expected
            for o in pins.values():
                o.pop(owner, None)
        elif op == "expire":
            expected = sum(d <= now for o in pins.values() for d in o.values())
            assert tier.expire_pins(now=now) == expected
            for o in pins.values():
                for owner in [w for w, d in o.items() if d <= now]:
                    del o[owner]
        elif op == "remove":
            key = rng.choice(keys)
            assert tier.remove(key) == (key in before)
            pins.pop(key, None)
            entries.pop(key, None)
        pins = {k: o for k, o in pins.items() if o}

        after = set(tier.keys())
        evicted = before - after - ({key} if op == "remove" else set())
        for key in evicted:
            assert key not in pins, f"pinned {key} was evicted"
            assert not any(rk == key for rk, _ in readers), f"referenced {key} was evicted"
            fills.pop(key, None)
            entries.pop(key)
        assert tier.stats().pinned_objects == len(pins)
        held = {id(o) for o in entries.values()} | {id(o) for o in unput} | {id(o) for _, o in readers}
        assert arena.num_slabs - arena.free_slabs == len(held)

    for owner in owners:
        tier.release_owner(owner)
    for _, obj in readers:
        obj.ref_down()
    for obj in unput:
        obj.ref_down()
    assert tier.stats().pinned_objects == 0
    assert arena.num_slabs - arena.free_slabs == len(tier)  # only entries hold slabs
    tier.clear()
    assert arena.free_slabs == arena.num_slabs and tier.stats().used_bytes == 0


def test_two_threads_share_the_tier():
    """A worker thread and a background thread storing, reading and pinning at once:
    every object read back holds exactly what its writer put there."""
    tier = make_tier(6)
    errors = []
    barrier = threading.Barrier(2)

    def worker(thread_index: int) -> None:
        rng = random.Random(thread_index)
        try:
            barrier.wait()
            for step in range(1500):
                key = f"k{rng.randrange(10)}"
                value = float(key[1:])  # both threads write the same value per key
                obj = tier.allocate(CHUNK_SHAPE, torch.float32)
                if obj is not None:
                    obj.tensor.fill_(value)  # copy outside any lock
                    tier.put(key, obj)
                    obj.ref_down()
                hit = tier.get(key)
                if hit is not None:
                    if not torch.all(hit.tensor == value):
                        errors.append(f"{key} holds wrong data")
                    hit.ref_down()
                owner = (thread_index, step % 3)
                tier.pin(key, owner, timeout_s=1.0, now=float(step))
                if step % 7 == 0:
                    tier.release_owner(owner)
                tier.expire_pins(now=float(step))
        except Exception as exc:  # surfaced below with the thread's name
            errors.append(f"thread {thread_index}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    tier.expire_pins(now=10_000.0)
    assert tier.stats().pinned_objects == 0
    assert tier.arena.num_slabs - tier.arena.free_slabs == len(tier)
    tier.clear()
    assert tier.arena.free_slabs == tier.arena.num_slabs
