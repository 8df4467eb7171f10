"""Time as flowkv's background timers see it: the machine's monotonic clock, or one a test moves.

A timer is a loop over a ticker::

    ticker = clock.ticker(interval_s=1.0)
    while ticker.wait():          # True once per interval of the clock's time; False once stopped
        expire_what_is_due(clock.now())

`MONOTONIC` is `time.monotonic` with real waits. `ManualClock` stands still
until ``advance(seconds)``, which wakes every ticker that became due and
returns only once each of them has done its work and waits again: a test
that advances past a deadline sees the timer's effect on the next line, with
no sleep and no polling.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["MONOTONIC", "Clock", "ManualClock", "MonotonicClock", "Ticker"]


class Ticker(Protocol):
    """One timer's pacing: ``wait()`` until an interval passed (True) or ``stop()`` was called (False)."""

    def wait(self) -> bool: ...

    def stop(self) -> None: ...


class Clock(Protocol):
    """Monotonic seconds (``now``) and tickers paced by them."""

    def now(self) -> float: ...

    def ticker(self, interval_s: float) -> Ticker: ...


class _EventTicker:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stopped = threading.Event()

    def wait(self) -> bool:
        return not self._stopped.wait(self.interval_s)

    def stop(self) -> None:
        self._stopped.set()


class MonotonicClock:
    """The machine's monotonic clock (`time.monotonic`); tickers sleep for real."""

    def now(self) -> float:
        return time.monotonic()

    def ticker(self, interval_s: float) -> Ticker:
        if not interval_s > 0:
            raise ValueError(f"a ticker's interval must be positive, got {interval_s!r}")
        return _EventTicker(interval_s)

    def __repr__(self) -> str:
        return "MonotonicClock()"


MONOTONIC = MonotonicClock()


class ManualClock:
    """A clock that moves only when told to: ``advance(seconds)``.

    ``advance`` wakes the tickers whose interval has passed and waits (at most
    ``settle_s`` of real time, then raises) until each has run its work and
    is waiting again, or has stopped.
    """

    def __init__(self, start: float = 1000.0, *, settle_s: float = 60.0) -> None:
        self._now = float(start)
        self.settle_s = settle_s
        self._cond = threading.Condition()
        self._tickers: set[_ManualTicker] = set()

    def now(self) -> float:
        return self._now

    def __call__(self) -> float:  # usable where a plain ``() -> float`` clock is expected
        return self._now

    def ticker(self, interval_s: float) -> Ticker:
        if not interval_s > 0:
            raise ValueError(f"a ticker's interval must be positive, got {interval_s!r}")
        ticker = _ManualTicker(self, interval_s)
        with self._cond:
            self._tickers.add(ticker)
        return ticker

    def advance(self, seconds: float) -> None:
        """Move the clock on by ``seconds``; return once every ticker that became due has ticked."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock does not go back ({seconds!r} s)")
        deadline = time.monotonic() + self.settle_s
        with self._cond:
            self._now += seconds
            self._cond.notify_all()
            while any(t.unsettled() for t in self._tickers):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"a timer did not finish its tick within {self.settle_s} s")
                self._cond.wait(left)

    def __repr__(self) -> str:
        return f"ManualClock(now={self._now})"


class _ManualTicker:
    def __init__(self, clock: ManualClock, interval_s: float) -> None:
        self._clock = clock
        self.interval_s = interval_s
        self._last = clock._now
        self._waiting = False
        # Busy from creation until the first wait(): its thread may not have started yet.
        self._busy = True
        self._stopped = False

    def unsettled(self) -> bool:
        if self._stopped:
            return False
        return self._busy or (self._waiting and self._clock._now >= self._last + self.interval_s)

    def wait(self) -> bool:
        cond = self._clock._cond
        with cond:
            self._busy = False
            self._waiting = True
            cond.notify_all()
            while not self._stopped and self._clock._now < self._last + self.interval_s:
                cond.wait()
            self._waiting = False
            if self._stopped:
                return False
            self._last = self._clock._now
            self._busy = True
            return True

    def stop(self) -> None:
        cond = self._clock._cond
        with cond:
            self._stopped = True
            self._busy = False
            self._clock._tickers.discard(self)
            cond.notify_all()
