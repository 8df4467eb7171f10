"""Pins: lookup hits kept from eviction until their retrieve, with deadlines and a timer of their own.

A lookup pins the object-tier chunks it found for its owner (the request's
lookup id); the retrieve, a ``release`` or the pin deadline lets them go.
Deadlines are read on a clock (`flowkv.clock.MONOTONIC`, or a
`flowkv.clock.ManualClock` in tests). From the first pin on, a timer thread
drops the pins past their deadline every ``pin_timeout_s / 4`` (at most 5 s)
of that clock, so an abandoned lookup frees memory with no further traffic.
The thread ends with ``stop()`` or when the pins are garbage.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from flowkv.clock import Clock, Ticker
from flowkv.tiers.base import ObjectTier

__all__ = ["Pins"]

log = logging.getLogger("flowkv.tiers")


class Pins:
    """The pins on the object tiers ``objects`` (name -> tier), with their deadlines and timer."""

    def __init__(self, objects: Mapping[str, ObjectTier], *, clock: Clock, timeout_s: float) -> None:
        self._objects = objects
        self.clock = clock
        self.timeout_s = timeout_s
        #: how often (on ``clock``) the timer drops expired pins
        self.timer_interval_s = min(timeout_s / 4, 5.0)
        self._timer: Ticker | None = None
        self._lock = threading.Lock()  # guards the timer's start

    def pin(self, hits: Sequence[tuple[str, str | None]], owner: Any) -> None:
        """Keep the object-tier hits among ``hits`` (key, tier found in) for ``owner`` (one call per tier)."""
        by_tier: dict[str, list[str]] = collections.defaultdict(list)
        for key, tier in hits:
            if tier in self._objects:
                by_tier[tier].append(key)  # type: ignore[index]
        if not by_tier:
            return
        now = self.clock.now()
        for tier, keys in by_tier.items():
            self._objects[tier].pin_many(keys, owner, timeout_s=self.timeout_s, now=now)
        self.started()

    def pin_one(self, tier: str, key: str, owners: Sequence[Any]) -> None:
        """Pin ``key`` in ``tier`` for each of ``owners`` (a prefetched chunk that landed)."""
        now = self.clock.now()
        for owner in owners:
            self._objects[tier].pin(key, owner, timeout_s=self.timeout_s, now=now)
        self.started()

    def release(self, owner: Any) -> None:
        """Drop every pin ``owner`` holds in any object tier."""
        for objects in self._objects.values():
            objects.release_owner(owner)

    def holds(self, owner: Any) -> bool:
        """Whether ``owner`` pins a chunk in an object tier."""
        return any(objects.holds_pins(owner) for objects in self._objects.values())

    def expire(self) -> None:
        """Drop pins past their deadline (a scheduler that stopped asking must not pin forever)."""
        now = self.clock.now()
        for objects in self._objects.values():
            objects.expire_pins(now=now)

    def started(self) -> None:
        """Pins were taken: start the timer if it is not running yet."""
        if self._timer is not None:
            return
        with self._lock:
            if self._timer is not None:
                return
            ticker = self.clock.ticker(self.timer_interval_s)
            self._timer = ticker
        threading.Thread(target=_expire_until_stopped, args=(weakref.ref(self), ticker),
                         name="flowkv-pin-timer", daemon=True).start()

    def stop(self) -> None:
        """Stop the timer (the pins stay; nothing expires them any more but ``expire``)."""
        if self._timer is not None:
            self._timer.stop()


def _expire_until_stopped(pins_ref: weakref.ref[Pins], ticker: Ticker) -> None:
    """The timer's thread: holds its pins only while a tick runs, so they can go."""
    try:
        while ticker.wait():
            pins = pins_ref()
            if pins is None:
                return
            try:
                pins.expire()
            except Exception:  # a timer never dies of one bad tick
                log.warning("flowkv: expiring pins failed", exc_info=True)
            del pins
    finally:
        ticker.stop()
