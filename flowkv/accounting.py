"""What the engine counts: counters, call latencies, and the failed-run health window.

One object, one lock: it is touched from the inference thread, the layer
worker and the tier I/O thread alike. The executor owns it; stages and the
storage manager only ``count``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Protocol

log = logging.getLogger("flowkv.engine")

# After this many failed runs in a row the engine reports unhealthy for a while.
FAILURES_BEFORE_UNHEALTHY = 3
UNHEALTHY_FOR_S = 5.0
# Latency observations kept between two drains (metric intervals).
_MAX_OBSERVATIONS = 10_000


class Counters(Protocol):
    """What stages and tiers may do with the engine's counters."""

    def count(self, name: str, n: float = 1) -> None: ...


class Accounting:
    """Counters (counts, and ``*_ms`` totals), latency observations, and health after failed runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._latencies: dict[str, list[float]] = {}
        self._failures = 0  # failed runs in a row
        self._unhealthy_until = 0.0
        self._closed = False
        # Bumped by every change to the counters or latencies: a reader that saw the same
        # number last time knows nothing changed without copying them (vLLM asks every step).
        self.changes = 0

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counters[name] += n
            self.changes += 1

    def counters(self) -> dict[str, float]:
        """A snapshot of every counter."""
        with self._lock:
            return dict(self._counters)

    def observe(self, kind: str, started: float) -> None:
        """One call of ``kind`` that began at ``started`` (``time.perf_counter``) is over."""
        ms = (time.perf_counter() - started) * 1e3
        with self._lock:
            self._counters[f"{kind}_ms"] += ms
            self.changes += 1
            observations = self._latencies.setdefault(kind, [])
            if len(observations) < _MAX_OBSERVATIONS:
                observations.append(ms)

    def drain_latencies(self) -> dict[str, list[float]]:
        """Durations (ms) of lookups, stores and retrieves since the last call."""
        with self._lock:
            drained, self._latencies = self._latencies, {}
        return drained

    def run_succeeded(self) -> None:
        with self._lock:
            self._failures = 0

    def run_failed(self, kind: str, exc: Any) -> None:
        """A run raised: count it; after a streak of failures, skip work for a while."""
        with self._lock:
            self._counters[f"{kind}_errors"] += 1
            self.changes += 1
            self._failures += 1
            tripped = self._failures >= FAILURES_BEFORE_UNHEALTHY
            if tripped:
                self._unhealthy_until = time.monotonic() + UNHEALTHY_FOR_S
                self._failures = 0
        log.error("flowkv: %s failed: %s", kind, exc, exc_info=getattr(exc, "original", None))
        if tripped:
            log.error("flowkv: %d failed runs in a row; skipping work for %.0f s",
                      FAILURES_BEFORE_UNHEALTHY, UNHEALTHY_FOR_S)

    def healthy(self) -> bool:
        """False once closed, or for a while after repeated failed runs."""
        with self._lock:
            return not self._closed and time.monotonic() >= self._unhealthy_until

    def close(self) -> None:
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed
