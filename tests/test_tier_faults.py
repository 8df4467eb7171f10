"""Slow tiers failing under the cache engine: servers killed or hung, corrupt data, full write-behind.

Through ``CacheEngine`` only. The promise checked everywhere: no exception
reaches the caller, corrupt data never reaches the paged cache, and every
failure is counted. "No call waits past its timeout" is read from counters,
never from a clock: the health guard cuts a call off at the tier's
``timeout_s`` and counts it (``timeouts``), skips calls while the tier is
unhealthy (``skipped``), and the engine's own, longer safety timeout
(``tier_call_failures.NAME``) never has to fire.
"""

from __future__ import annotations


import pytest
import redis
import torch

from flowkv import CacheEngine
from redis_servers import own_redis_server, redis_server  # noqa: F401 - pytest fixtures
from test_tier_chain import (
    CHUNK,
    NUM_CHUNKS,
    NUM_TOKENS,
    SETTLE_S,
    Workload,
    disk_file,
    drop_from_memory,
    make_engine,
    redis_key,
    settle,
    tier_stats,
)

# A dead server refuses at once and is probed again soon.
DEAD_SERVER = {"tiers.redis.backoff_max_s": 0.5}
# A hung server is probed again soon. Its calls are cut off at HUNG_TIMEOUT_S, set
# only while it is paused: a healthy call on a busy test machine keeps the generous
# timeout make_engine gives it, and never hits the short one.
HUNG_SERVER = {"tiers.redis.backoff_max_s": 0.5}
HUNG_TIMEOUT_S = 1.0


def one_request(engine: CacheEngine, work: Workload) -> torch.Tensor:
    """What a serving engine does for a request: look up, load what is there, store the rest."""
    hit = engine.lookup(work.tokens, pin=True, lookup_id=id(work))
    ret_mask = work.retrieve(engine, lookup_id=id(work))
    assert int(ret_mask.sum()) <= hit
    work.store(engine)
    return ret_mask


def assert_recovers(engine: CacheEngine, seed: int) -> None:
    """Once the server answers again, a new request is written to it and read back from it.

    Connections pooled before the outage may fail once more each (the guard
    then skips Redis for a back-off), so this retries with fresh requests
    until one whole round trip goes through Redis.
    """
    seeds = iter(range(seed, seed + 10_000))

    def round_trip_through_redis() -> bool:
        work = Workload(seed=next(seeds))
        writes = tier_stats(engine, "redis")["writes"]
        one_request(engine, work)
        engine.flush(SETTLE_S)
        if tier_stats(engine, "redis")["writes"] < writes + NUM_CHUNKS:
            return False
        drop_from_memory(engine, work.keys(engine))
        reads = tier_stats(engine, "redis")["hits"]
        work.dst = Workload(seed=0).dst
        ret_mask = work.retrieve(engine)
        if not ret_mask.all():
            return False
        work.assert_loaded(ret_mask, NUM_TOKENS)
        return tier_stats(engine, "redis")["hits"] == reads + NUM_CHUNKS

    settle(round_trip_through_redis, "a round trip through the restarted server")
    assert tier_stats(engine, "redis")["healthy"] == 1


# -- the server goes away -------------------------------------------------------


def test_redis_killed_mid_workload(own_redis_server):  # noqa: F811
    engine = make_engine("cpu-redis", redis_url=own_redis_server.url, **DEAD_SERVER)
    try:
        before = [Workload(seed=seed) for seed in range(3)]
        for work in before:
            one_request(engine, work)
        assert engine.flush(SETTLE_S)
        assert tier_stats(engine, "redis")["writes"] == 3 * NUM_CHUNKS, tier_stats(engine, "redis")

        own_redis_server.kill()
        # Memory still serves what it holds; what only Redis held is a miss, not an error.
        drop_from_memory(engine, before[0].keys(engine))
        assert engine.lookup(before[0].tokens) == 0
        before[0].assert_loaded(before[0].retrieve(engine), 0)
        assert engine.lookup(before[1].tokens) == NUM_TOKENS
        for seed in range(10, 16):
            work = Workload(seed=seed)
            work.assert_loaded(one_request(engine, work), 0)
            assert engine.lookup(work.tokens) == NUM_TOKENS  # stored in memory all the same
        engine.flush(SETTLE_S)

        stats = tier_stats(engine, "redis")
        assert stats["healthy"] == 0
        assert stats["failures"] >= 1
        assert stats["skipped"] >= 1  # the dead server was not asked again and again
        assert stats["dropped_puts"] >= 1
        engine_stats = engine.stats()
        assert "tier_call_failures.redis" not in engine_stats
        assert engine_stats.get("lookup_errors", 0) == engine_stats.get("retrieve_errors", 0) == 0
        assert engine_stats["healthy"] is True

        own_redis_server.start()  # same port, empty (nothing persisted)
        assert_recovers(engine, seed=100)
    finally:
        engine.close()


def test_redis_hung_mid_workload(own_redis_server):  # noqa: F811
    """A paused server (connections open, no answers): every call is cut off by the guard's timeout."""
    engine = make_engine("cpu-redis", redis_url=own_redis_server.url, **HUNG_SERVER)
    try:
        first = Workload(seed=1)
        one_request(engine, first)
        assert engine.flush(SETTLE_S)
        drop_from_memory(engine, first.keys(engine))

        guard = engine.slow["redis"]
        healthy_timeout_s, guard.timeout_s = guard.timeout_s, HUNG_TIMEOUT_S
        own_redis_server.pause()
        try:
            assert engine.lookup(first.tokens) == 0
            first.assert_loaded(first.retrieve(engine), 0)
            for seed in range(20, 24):
                work = Workload(seed=seed)
                work.assert_loaded(one_request(engine, work), 0)
            stats = tier_stats(engine, "redis")
            assert stats["timeouts"] >= 1
            assert stats["skipped"] >= 1
            assert stats["healthy"] == 0
            assert "tier_call_failures.redis" not in engine.stats()
        finally:
            own_redis_server.resume()
            guard.timeout_s = healthy_timeout_s
        assert_recovers(engine, seed=200)
    finally:
        engine.close()


# -- corrupt data ---------------------------------------------------------------


def flip_middle_byte(blob: bytes) -> bytes:
    middle = len(blob) // 2
    return blob[:middle] + bytes([blob[middle] ^ 0x01]) + blob[middle + 1:]


def flip_first_byte(blob: bytes) -> bytes:
    return bytes([blob[0] ^ 0x80]) + blob[1:]


def truncate(blob: bytes) -> bytes:
    return blob[: len(blob) - 1000]


DAMAGE = {"flipped-body-byte": flip_middle_byte, "flipped-header-byte": flip_first_byte, "truncated": truncate}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_disk_file_is_a_miss(damage, tmp_path):
    work = Workload()
    disk = tmp_path / "disk"
    first = make_engine("cpu-disk", disk=disk)
    assert work.store(first) == NUM_TOKENS
    keys = work.keys(first)
    first.close()
    path = disk_file(disk, keys[1])
    path.write_bytes(DAMAGE[damage](path.read_bytes()))

    engine = make_engine("cpu-disk", disk=disk)
    try:
        # The disk index knows the file, so lookup promises it; reading it finds the damage.
        result = engine.retrieve(work.transfer())
        work.assert_loaded(result.ret_mask, CHUNK)
        assert result.failed_range == (CHUNK, NUM_TOKENS)
        assert tier_stats(engine, "disk")["corrupt"] == 1
        assert not engine.memory.contains(keys[1])
        assert not path.exists()  # removed, so it is not promised again
        assert engine.lookup(work.tokens) == CHUNK
    finally:
        engine.close()


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_redis_value_is_a_miss(damage, redis_server):  # noqa: F811
    work = Workload()
    engine = make_engine("cpu-redis", redis_url=redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert work.store(engine) == NUM_TOKENS
        assert engine.flush(SETTLE_S)
        keys = work.keys(engine)
        drop_from_memory(engine, keys)
        stored = redis_key(engine, keys[1])
        client.set(stored, DAMAGE[damage](client.get(stored)))

        result = engine.retrieve(work.transfer())
        work.assert_loaded(result.ret_mask, CHUNK)
        assert result.failed_range == (CHUNK, NUM_TOKENS)
        assert tier_stats(engine, "redis")["corrupt"] == 1
        assert engine.stats()["retrieve_missing_chunks"] == 1
        assert not engine.memory.contains(keys[1])
    finally:
        client.close()
        engine.close()


def test_damaged_disk_file_falls_through_to_redis(tmp_path, redis_server):  # noqa: F811
    """A corrupt copy in one tier is skipped for a good copy further down the chain."""
    work = Workload()
    disk = tmp_path / "disk"
    namespace = f"faults-fallthrough-{tmp_path.name}"
    first = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_server.url, namespace=namespace)
    assert work.store(first) == NUM_TOKENS
    keys = work.keys(first)
    first.close()
    path = disk_file(disk, keys[1])
    path.write_bytes(flip_middle_byte(path.read_bytes()))

    engine = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_server.url, namespace=namespace)
    try:
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)
        assert tier_stats(engine, "disk")["corrupt"] == 1
        assert tier_stats(engine, "redis")["hits"] == 1
    finally:
        engine.close()


# -- write-behind -----------------------------------------------------------------


def test_full_write_behind_queue_drops_and_counts(own_redis_server):  # noqa: F811
    """Redis stops answering while a store offers more chunks than the queue holds.

    The store itself does not wait: memory takes every chunk, the queue takes
    what fits (its capacity counts the batch already in flight), the rest is
    dropped from the Redis tier and counted. Once Redis answers, exactly the queued chunks
    arrive.
    """
    chunks, capacity = 8, 2
    engine = make_engine("cpu-redis", redis_url=own_redis_server.url,
                         **{"tiers.redis.write_queue": capacity, "tiers.redis.timeout_s": 60.0})
    client = redis.Redis.from_url(own_redis_server.url)
    try:
        assert engine.lookup(Workload(seed=9).tokens) == 0  # connected before the pause
        work = Workload(chunks * CHUNK, seed=3)
        own_redis_server.pause()
        try:
            assert work.store(engine) == chunks * CHUNK
            queue = tier_stats(engine, "redis")
        finally:
            own_redis_server.resume()
        assert queue["write_queued"] == capacity
        assert queue["write_dropped"] == chunks - capacity
        assert engine.stats()["stored_tokens"] == chunks * CHUNK

        assert engine.flush(SETTLE_S)
        after = tier_stats(engine, "redis")
        assert after["write_dropped"] == queue["write_dropped"]
        assert after["writes"] == queue["write_queued"]
        assert after["timeouts"] == 0
        assert int(client.dbsize()) == queue["write_queued"]
        # The prefix that did reach Redis is served from it.
        keys = work.keys(engine)
        written = [bool(client.exists(redis_key(engine, key))) for key in keys]
        assert written[0]
        drop_from_memory(engine, keys)
        prefix = written.index(False) if False in written else chunks
        assert engine.lookup(work.tokens) == prefix * CHUNK
    finally:
        client.close()
        engine.close()
