"""Pins that a lookup's prefetch takes when its chunks land from Redis (issue 15, item 1).

A lookup whose hits lie below memory starts promoting them at once and pins
each for the lookup as it lands. The vLLM scheduler releases a lookup as soon
as it asks again for a request that could not be scheduled, so a release
often comes before the prefetch lands: it must cover those later pins too.
And pins nobody releases must expire at their deadline with no traffic.

The prefetch is held in flight the way a slow network holds it: the real
redis-server is stopped (SIGSTOP) just as the lookup sends its reads, and
continued (SIGCONT) after the release. Time is a ManualClock: pins expire
when the test moves it, never because the machine was slow.
"""

from __future__ import annotations

import pytest

from flowkv import CacheEngine
from flowkv.testing import ManualClock
from flowkv.tiers.manager import Entry
from redis_servers import RedisServer, own_redis_server  # noqa: F401 - pytest fixture
from test_tier_chain import (
    GEOMETRY,
    HEALTHY_TIMEOUT_S,
    NUM_CHUNKS,
    NUM_TOKENS,
    SETTLE_S,
    Workload,
    fresh_namespace,
    settle,
)

pytestmark = pytest.mark.redis

PIN_TIMEOUT_S = 30.0


def redis_engine(url: str, namespace: str, clock: ManualClock) -> CacheEngine:
    settings = {
        "chunk_size": NUM_TOKENS // NUM_CHUNKS,
        "tiers.memory.capacity": "8MiB",
        "tiers.redis.url": url,
        "tiers.redis.namespace": namespace,
        # Longer than any pause below: the held read lands, it is not cut off.
        "tiers.redis.timeout_s": HEALTHY_TIMEOUT_S,
        "pin_timeout_s": PIN_TIMEOUT_S,
    }
    return CacheEngine.from_pipeline("cpu-redis", geometry=GEOMETRY, model_name="tiny", overrides=settings,
                                     clock=clock)


def only_in_redis(server: RedisServer, work: Workload, clock: ManualClock) -> CacheEngine:
    """An engine whose memory is empty while Redis holds every chunk of ``work``."""
    namespace = fresh_namespace()
    writer = redis_engine(server.url, namespace, ManualClock())
    assert work.store(writer) == NUM_TOKENS
    assert writer.flush(SETTLE_S)
    writer.close()
    return redis_engine(server.url, namespace, clock)


def pinned(engine: CacheEngine) -> int:
    return engine.stats()["tiers"]["memory"]["pinned_objects"]


def landed(engine: CacheEngine, chunks: int) -> None:
    """Wait until ``chunks`` prefetched chunks are in memory (readiness, not a time limit)."""
    settle(lambda: engine.stats().get("promotions", 0) >= chunks, f"{chunks} prefetched chunks landing")


def hold_prefetch_reads(monkeypatch, engine: CacheEngine, server: RedisServer) -> None:
    """Stop redis-server as each prefetch starts: its reads stay in flight until ``server.resume()``."""
    start_prefetch = engine.storage.prefetch

    def stopped_then_prefetch(entries, owner):
        server.pause()
        start_prefetch(entries, owner)

    monkeypatch.setattr(engine.storage, "prefetch", stopped_then_prefetch)


def test_release_before_the_prefetch_lands_leaves_no_pin(own_redis_server, monkeypatch):  # noqa: F811
    work = Workload()
    engine = only_in_redis(own_redis_server, work, ManualClock())
    try:
        hold_prefetch_reads(monkeypatch, engine, own_redis_server)
        try:
            assert engine.lookup(work.tokens, pin=True, lookup_id="L") == NUM_TOKENS
            assert engine.prefetch_pending("L")
            engine.release("L")  # the scheduler asked again: this lookup is over
        finally:
            own_redis_server.resume()
        landed(engine, NUM_CHUNKS)
        assert all(engine.memory.contains(key) for key in work.keys(engine))
        assert pinned(engine) == 0  # before the fix: NUM_CHUNKS, until the pin timeout and some later call
        assert engine.memory.release_owner("L") == 0
        # Nothing pinned, so a store that needs the room can have it.
        assert engine.stats()["tiers"]["memory"]["entries"] == NUM_CHUNKS
    finally:
        engine.close()


def test_a_second_owner_of_chunks_on_their_way_is_pinned_for_too(own_redis_server):  # noqa: F811
    """Two lookups find the same chunks in Redis while the first one's read is in flight
    (the storage manager's calls, as the lookup stage makes them)."""
    work = Workload()
    engine = only_in_redis(own_redis_server, work, ManualClock())
    try:
        storage = engine.storage
        keys = work.keys(engine)
        assert storage.find(keys) == ["redis"] * NUM_CHUNKS
        shape = GEOMETRY.chunk_shape(NUM_TOKENS // NUM_CHUNKS)
        entries = [Entry(key, "redis", tuple(shape), GEOMETRY.dtype) for key in keys]
        own_redis_server.pause()
        try:
            storage.prefetch(entries, "first")
            storage.prefetch(entries, "second")
            storage.release("first")
        finally:
            own_redis_server.resume()
        landed(engine, NUM_CHUNKS)
        assert engine.stats()["prefetches"] == NUM_CHUNKS  # read once, for both owners
        assert pinned(engine) == NUM_CHUNKS  # held for "second" only
        assert engine.memory.release_owner("first") == 0
        storage.release("second")
        assert pinned(engine) == 0
    finally:
        engine.close()


def test_prefetch_pins_nobody_releases_expire_with_no_traffic(own_redis_server):  # noqa: F811
    clock = ManualClock()
    work = Workload()
    engine = only_in_redis(own_redis_server, work, clock)
    try:
        assert engine.lookup(work.tokens, pin=True, lookup_id="abandoned") == NUM_TOKENS
        landed(engine, NUM_CHUNKS)
        settle(lambda: not engine.prefetch_pending("abandoned"), "the prefetch")
        assert pinned(engine) == NUM_CHUNKS
        clock.advance(PIN_TIMEOUT_S - 1.0)
        assert pinned(engine) == NUM_CHUNKS  # not before the deadline
        clock.advance(1.0 + engine.storage.pin_timer_interval_s)  # no engine call in between
        assert pinned(engine) == 0
    finally:
        engine.close()


def test_retrieve_after_the_prefetch_landed_releases_its_pins(own_redis_server):  # noqa: F811
    work = Workload()
    engine = only_in_redis(own_redis_server, work, ManualClock())
    try:
        assert engine.lookup(work.tokens, pin=True, lookup_id="req") == NUM_TOKENS
        work.assert_loaded(work.retrieve(engine, lookup_id="req"), NUM_TOKENS)
        landed(engine, NUM_CHUNKS)
        assert pinned(engine) == 0
    finally:
        engine.close()
