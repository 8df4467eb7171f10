"""The health guard and the I/O portal: failing, hanging and recovering tiers."""

from __future__ import annotations

import threading
import uuid

import anyio
import pytest

from flowkv.tiers import GuardedTier, RedisTier, RedisTierConfig, Tier, TierHealth, portal
from redis_servers import (  # noqa: F401 - fixtures are used by name
    RedisServer,
    free_port,
    make_payload,
    own_redis_server,
)

pytestmark = pytest.mark.anyio

KIB = 1024
# The guard's timeout for calls to a server that answers: room for a busy test machine.
# Tests that cut off a hung server lower it to HUNG_TIMEOUT_S only while it is paused.
HEALTHY_TIMEOUT_S = 10.0
HUNG_TIMEOUT_S = 1.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ManualClock:
    """The guard's clock, moved by the test: back-off passes when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def redis_tier(url: str) -> RedisTier:
    # A socket timeout far beyond the guard's: only the guard can cut a hung call short.
    config = RedisTierConfig(url=url, namespace=f"health-{uuid.uuid4().hex[:8]}", socket_timeout_s=60.0)
    return RedisTier(name="remote", config=config)


def chunk_key(i: int) -> str:
    return f"tiny-llama/1.0/bfloat16/fp/-/{i:064x}"


@pytest.mark.redis
async def test_server_killed_mid_workload_then_restarted(own_redis_server: RedisServer) -> None:
    clock = ManualClock()
    guarded = GuardedTier(
        redis_tier(own_redis_server.url), timeout_s=HEALTHY_TIMEOUT_S, backoff_initial_s=5.0, backoff_max_s=60.0,
        clock=clock,
    )
    answers = []
    for i in range(10):
        if i == 5:
            own_redis_server.kill()
        entry = (chunk_key(i), make_payload(2 * KIB, seed=i))
        await guarded.put([entry])  # never raises
        answers.append(await guarded.get([chunk_key(j) for j in range(i + 1)]))

    assert all(answer == [make_payload(2 * KIB, seed=j) for j in range(i + 1)] for i, answer in enumerate(answers[:5]))
    assert all(answer == [None] * (i + 6) for i, answer in enumerate(answers[5:]))
    stats = guarded.stats()
    assert guarded.state is TierHealth.UNHEALTHY
    # The first call after the kill failed; the other nine were never sent.
    assert stats["failures"] == 1 and stats["calls"] == 11 and stats["skipped"] == 9
    assert stats["dropped_puts"] == 5
    assert guarded.last_error is not None

    own_redis_server.start()  # same port, empty (nothing persisted)
    assert await guarded.exists([chunk_key(0)]) == [False]  # still backing off
    assert guarded.stats()["skipped"] == 10

    clock.advance(5.0)
    await guarded.put([(chunk_key(0), make_payload(KIB, seed=0))])
    assert guarded.state is TierHealth.HEALTHY
    assert await guarded.get([chunk_key(0)]) == [make_payload(KIB, seed=0)]
    assert guarded.stats()["backoff_s"] == 0
    await guarded.aclose()


@pytest.mark.redis
async def test_hung_server_is_cut_off_by_the_guard_timeout(own_redis_server: RedisServer) -> None:
    clock = ManualClock()
    guarded = GuardedTier(
        redis_tier(own_redis_server.url), timeout_s=HEALTHY_TIMEOUT_S, backoff_initial_s=1.0, backoff_max_s=8.0,
        clock=clock,
    )
    await guarded.put([(chunk_key(1), make_payload(KIB, seed=1))])
    guarded.timeout_s = HUNG_TIMEOUT_S
    own_redis_server.pause()
    try:
        assert await guarded.get([chunk_key(1), chunk_key(2)]) == [None, None]
        stats = guarded.stats()
        # Cut off by the guard's own timeout (the socket timeout is 60 s).
        assert (stats["timeouts"], stats["failures"]) == (1, 1)
        assert guarded.state is TierHealth.UNHEALTHY

        # After the back-off, one probe goes out; concurrent calls are skipped meanwhile.
        clock.advance(1.0)
        results: list[list[bool]] = []

        async def lookup() -> None:
            results.append(await guarded.exists([chunk_key(1)]))

        async with anyio.create_task_group() as group:
            group.start_soon(lookup)
            group.start_soon(lookup)
        assert results == [[False], [False]]
        stats = guarded.stats()
        assert (stats["timeouts"], stats["skipped"]) == (2, 1)
        assert stats["backoff_s"] == 2.0
    finally:
        own_redis_server.resume()
        guarded.timeout_s = HEALTHY_TIMEOUT_S

    clock.advance(2.0)
    assert await guarded.get([chunk_key(1)]) == [make_payload(KIB, seed=1)]
    assert guarded.state is TierHealth.HEALTHY
    await guarded.aclose()


@pytest.mark.redis
async def test_backoff_doubles_up_to_its_maximum() -> None:
    clock = ManualClock()
    nobody_home = redis_tier(f"redis://127.0.0.1:{free_port()}")
    guarded = GuardedTier(nobody_home, timeout_s=5.0, backoff_initial_s=1.0, backoff_max_s=4.0, clock=clock)
    seen = []
    for _ in range(5):
        assert await guarded.get([chunk_key(1)]) == [None]
        seen.append(guarded.stats()["backoff_s"])
        assert await guarded.get([chunk_key(1)]) == [None]  # within the back-off: skipped
        clock.advance(seen[-1])
    assert seen == [1.0, 2.0, 4.0, 4.0, 4.0]
    stats = guarded.stats()
    assert (stats["calls"], stats["failures"], stats["skipped"]) == (5, 5, 5)
    await guarded.aclose()


class WrongLengthTier(Tier):
    """A user's tier that answers out of contract."""

    name = "wrong-length"

    async def exists(self, keys: list[str]) -> list[bool]:
        return [True]

    async def get(self, keys: list[str]) -> list[bytes | None]:
        return []

    async def put(self, entries: list[tuple[str, bytes]]) -> None:
        raise OSError("disk full")

    async def aclose(self) -> None:
        raise RuntimeError("close failed")

    def stats(self) -> dict[str, int | float]:
        raise RuntimeError("stats failed")


async def test_out_of_contract_answers_and_errors_never_reach_the_caller() -> None:
    clock = ManualClock()
    guarded = GuardedTier(WrongLengthTier(), timeout_s=1.0, backoff_initial_s=1.0, backoff_max_s=1.0, clock=clock)
    assert await guarded.exists(["a", "b"]) == [False, False]
    assert "expected a list of 2" in guarded.last_error
    clock.advance(1.0)
    assert await guarded.get(["a"]) == [None]
    clock.advance(1.0)
    await guarded.put([("a", b"x"), ("b", b"y")])
    assert "OSError: disk full" in guarded.last_error
    await guarded.aclose()
    stats = guarded.stats()
    assert (stats["failures"], stats["dropped_puts"], stats["healthy"]) == (3, 2, 0)


def test_guard_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        GuardedTier(WrongLengthTier(), timeout_s=0)
    with pytest.raises(ValueError, match="backoff_max_s"):
        GuardedTier(WrongLengthTier(), backoff_initial_s=2.0, backoff_max_s=1.0)


@pytest.mark.redis
def test_synchronous_code_reaches_tiers_through_the_portal(own_redis_server: RedisServer) -> None:
    guarded = GuardedTier(redis_tier(own_redis_server.url), timeout_s=HEALTHY_TIMEOUT_S, backoff_initial_s=60.0,
                          backoff_max_s=60.0)
    entry = (chunk_key(1), make_payload(KIB, seed=1))
    portal.submit(guarded.put, [entry]).result(timeout=30)  # write-behind
    assert portal.call(guarded.get, [chunk_key(1)], timeout_s=30) == [entry[1]]

    guarded.timeout_s = HUNG_TIMEOUT_S
    own_redis_server.pause()
    try:
        # The inference thread gets misses back, bounded by the guard's timeout.
        assert portal.call(guarded.get, [chunk_key(1)], timeout_s=30) == [None]
        assert guarded.stats()["timeouts"] == 1
    finally:
        own_redis_server.resume()
    portal.call(guarded.aclose, timeout_s=30)


def test_portal_call_times_out_and_cancels() -> None:
    cancelled = threading.Event()

    async def hang() -> None:
        try:
            await anyio.sleep(3600)
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match="longer than 0.05 s"):
        portal.call(hang, timeout_s=0.05)
    assert cancelled.wait(timeout=30)


def test_portal_refuses_to_wait_on_itself() -> None:
    async def nested() -> None:
        portal.call(anyio.sleep, 0)

    with pytest.raises(RuntimeError, match="portal thread itself"):
        portal.call(nested, timeout_s=30)
