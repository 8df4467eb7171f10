"""Write-behind: chunks for a slower tier wait in a bounded queue, written on the I/O thread."""

from __future__ import annotations

import collections
import threading
from typing import Any

from flowkv.tiers import portal


class WriteBehind:
    """A bounded queue of (key, payload) for one slower tier, drained on the I/O thread.

    ``capacity`` bounds every chunk held for the tier: those waiting and those in
    the batch being written. ``offer`` never blocks: when ``capacity`` chunks are
    held, the chunk is dropped from this tier and counted.
    """

    _BATCH = 16

    def __init__(self, tier: Any, capacity: int) -> None:
        self.tier = tier
        self.capacity = capacity
        self._queue: collections.deque[tuple[str, bytes, str]] = collections.deque()
        # A tier that keeps tenants (``tenants = True``, e.g. disk) gets (key, payload, tenant) entries.
        inner = getattr(tier, "tier", tier)
        self._with_tenant = bool(getattr(inner, "tenants", False))
        self._lock = threading.Lock()
        # Set while no drain task runs (changed under _lock): nothing queued or in flight.
        self._idle = threading.Event()
        self._idle.set()
        self._in_flight = 0
        self.queued = 0
        self.dropped = 0
        self.written = 0

    def offer(self, key: str, blob: bytes, tenant: str = "default") -> bool:
        with self._lock:
            if len(self._queue) + self._in_flight >= self.capacity:
                self.dropped += 1
                return False
            self._queue.append((key, blob, tenant))
            self.queued += 1
            start = self._idle.is_set()
            self._idle.clear()
        if start:
            portal.submit(self._drain)
        return True

    async def _drain(self) -> None:
        while True:
            with self._lock:
                batch = [self._queue.popleft() for _ in range(min(self._BATCH, len(self._queue)))]
                if not batch:
                    self._idle.set()
                    return
                self._in_flight = len(batch)
            try:
                entries = batch if self._with_tenant else [(key, blob) for key, blob, _ in batch]
                await self.tier.put(entries)  # the guard counts failures and never raises
                done = True
            except Exception:
                done = False
            with self._lock:
                self._in_flight = 0
                if done:
                    self.written += len(batch)
                else:
                    self.dropped += len(batch)

    def wait_empty(self, timeout_s: float) -> bool:
        return self._idle.wait(timeout_s)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"write_queue": len(self._queue) + self._in_flight, "write_queued": self.queued,
                    "write_dropped": self.dropped, "write_done": self.written}
