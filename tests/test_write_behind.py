"""The write-behind queue bounds every chunk it holds, waiting or being written."""

from __future__ import annotations

import threading

import anyio

from flowkv.tiers.writebehind import WriteBehind


class HeldTier:
    """A slower tier whose writes wait until the test lets them through."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.stored: list[str] = []

    async def put(self, entries: list[tuple[str, bytes]]) -> None:
        self.started.set()
        while not self.release.is_set():
            await anyio.sleep(0.001)
        self.stored.extend(key for key, _ in entries)


def test_capacity_counts_the_batch_being_written():
    tier = HeldTier()
    queue = WriteBehind(tier, capacity=3)
    assert queue.offer("k0", b"x")
    assert tier.started.wait(30)  # k0 is now in flight, not waiting
    offered = [queue.offer(f"k{i}", b"x") for i in range(1, 6)]
    assert offered == [True, True, False, False, False]
    assert queue.stats() == {"write_queue": 3, "write_queued": 3, "write_dropped": 3, "write_done": 0}

    tier.release.set()
    assert queue.wait_empty(30)
    assert tier.stored == ["k0", "k1", "k2"]
    assert queue.stats() == {"write_queue": 0, "write_queued": 3, "write_dropped": 3, "write_done": 3}
    assert queue.offer("k6", b"x")  # room again once written
    assert queue.wait_empty(30)
    assert tier.stored[-1] == "k6"


class FailingTier:
    async def put(self, entries: list[tuple[str, bytes]]) -> None:
        raise OSError("disk full")


def test_a_write_that_raises_counts_as_dropped_and_frees_room():
    queue = WriteBehind(FailingTier(), capacity=1)
    assert queue.offer("k0", b"x")
    assert queue.wait_empty(30)
    assert queue.offer("k1", b"x")
    assert queue.wait_empty(30)
    assert queue.stats() == {"write_queue": 0, "write_queued": 2, "write_dropped": 2, "write_done": 0}
