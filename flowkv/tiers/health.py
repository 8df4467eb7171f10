"""The health guard: a tier that fails or hangs is skipped, counted, and retried later.

:class:`GuardedTier` wraps any :class:`~flowkv.tiers.Tier` and is one itself.
Every call is bounded by ``timeout_s`` (``anyio.fail_after``). A call that
raises or times out marks the tier *unhealthy*; while unhealthy, calls are not
sent at all — lookups answer misses and puts are dropped, both counted — until
the back-off has passed. Then one call is let through as a probe: success makes
the tier healthy again, failure doubles the back-off (up to ``backoff_max_s``).
No exception from the tier ever reaches the caller, so inference goes on
without it::

    guarded = GuardedTier(RedisTier(name="remote", config=cfg),
                          timeout_s=0.2, backoff_initial_s=1.0, backoff_max_s=30.0)
    payloads = await guarded.get(keys)   # all None while Redis is down
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from flowkv.tiers.base import Tier

__all__ = ["GuardedTier", "TierHealth"]

logger = logging.getLogger("flowkv.tiers")

T = TypeVar("T")


class TierHealth(str, enum.Enum):
    """Whether a guarded tier is being called (healthy) or skipped (unhealthy)."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class GuardedTier(Tier):
    """Bounded timeouts, failure counting and exponential back-off around ``tier``.

    ``clock`` (monotonic seconds) decides when the back-off has passed; tests
    and simulations pass their own.
    """

    def __init__(
        self,
        tier: Tier,
        *,
        timeout_s: float = 1.0,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"GuardedTier timeout_s must be > 0, got {timeout_s!r}")
        if not backoff_initial_s > 0:
            raise ValueError(f"GuardedTier backoff_initial_s must be > 0, got {backoff_initial_s!r}")
        if backoff_max_s < backoff_initial_s:
            raise ValueError(
                f"GuardedTier backoff_max_s ({backoff_max_s!r}) must be >= "
                f"backoff_initial_s ({backoff_initial_s!r})"
            )
        self.tier = tier
        self.name = tier.name
        self.timeout_s = float(timeout_s)
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self._clock = clock
        self.state = TierHealth.HEALTHY
        self._backoff_s = 0.0  # current back-off; 0 while healthy
        self._retry_at = 0.0  # clock value after which the next probe may go
        self._probing = False  # one probe at a time after a back-off
        self.last_error: str | None = None
        # Counters (see stats()).
        self.calls = 0  # calls sent to the tier
        self.failures = 0  # calls that raised or timed out (timeouts included)
        self.timeouts = 0  # calls cut off by timeout_s
        self.skipped = 0  # calls not sent because the tier was unhealthy
        self.dropped_puts = 0  # entries not stored: skipped or failed puts

    # -- the Tier contract -------------------------------------------------

    async def exists(self, keys: list[str]) -> list[bool]:
        result = await self._guarded("exists", self.tier.exists, keys, len(keys))
        return result if result is not None else [False] * len(keys)

    async def get(self, keys: list[str], tenant: str | None = None) -> list[bytes | None]:
        """The tier's ``get``; a tier that keeps tenants (``tenants = True``) is told whose read it is."""
        read = self.tier.get
        if tenant is not None and getattr(self.tier, "tenants", False):
            read = functools.partial(self.tier.get, tenant=tenant)
        result = await self._guarded("get", read, keys, len(keys))
        return result if result is not None else [None] * len(keys)

    async def put(self, entries: list[tuple[str, bytes]]) -> None:
        done = await self._guarded("put", self._put_inner, entries, None)
        if done is None:
            self.dropped_puts += len(entries)

    async def aclose(self) -> None:
        # Closing is bounded too, but never skipped: resources must go.
        try:
            with anyio.fail_after(self.timeout_s):
                await self.tier.aclose()
        except Exception as exc:  # noqa: BLE001 - a failing tier must not break shutdown
            logger.warning("tier %r: aclose failed: %s", self.name, _describe(exc))

    def stats(self) -> dict[str, int | float]:
        """Guard counters, ``healthy`` (1/0), ``backoff_s``, then the tier's own counters.

        ``healthy`` is 0 while the guard skips the tier, and while the tier
        itself reports ``degraded`` (a full disk whose writes fail).
        """
        try:
            inner = self.tier.stats()
        except Exception as exc:  # noqa: BLE001 - stats are telemetry, never fatal
            logger.debug("tier %r: stats failed: %s", self.name, _describe(exc))
            inner = {}
        counters: dict[str, int | float] = {
            "healthy": int(self.state is TierHealth.HEALTHY and not inner.get("degraded")),
            "calls": self.calls,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "skipped": self.skipped,
            "dropped_puts": self.dropped_puts,
            "backoff_s": self._backoff_s,
        }
        for key, value in inner.items():
            counters.setdefault(key, value)
        return counters

    def __repr__(self) -> str:
        return f"GuardedTier({self.tier!r}, state={self.state.value})"

    # -- the guard ---------------------------------------------------------

    async def _put_inner(self, entries: list[tuple[str, bytes]]) -> bool:
        await self.tier.put(entries)
        return True

    async def _guarded(
        self,
        op: str,
        fn: Callable[[Any], Awaitable[T]],
        arg: Any,
        expected_len: int | None,
    ) -> T | None:
        """``await fn(arg)`` under the guard; ``None`` when skipped or failed."""
        is_probe = False
        if self.state is TierHealth.UNHEALTHY:
            if self._probing or self._clock() < self._retry_at:
                self.skipped += 1
                return None
            is_probe = self._probing = True
        self.calls += 1
        try:
            with anyio.fail_after(self.timeout_s):
                result = await fn(arg)
            if expected_len is not None and (not isinstance(result, list) or len(result) != expected_len):
                # A tier answering out of contract is as broken as one raising.
                raise TypeError(
                    f"tier {self.name!r}: {op} returned {type(result).__name__} "
                    f"of length {len(result) if isinstance(result, list) else '?'}, "
                    f"expected a list of {expected_len}"
                )
        except TimeoutError:
            self.timeouts += 1
            self._record_failure(op, f"timed out after {self.timeout_s} s")
            return None
        except Exception as exc:  # noqa: BLE001 - the guard's whole purpose
            self._record_failure(op, _describe(exc))
            return None
        finally:
            if is_probe:
                self._probing = False
        self._record_success()
        return result

    def _record_failure(self, op: str, why: str) -> None:
        self.failures += 1
        self.last_error = f"{op}: {why}"
        if self.state is TierHealth.HEALTHY:
            self._backoff_s = self.backoff_initial_s
        else:
            self._backoff_s = min(self._backoff_s * 2, self.backoff_max_s)
        self._retry_at = self._clock() + self._backoff_s
        if self.state is TierHealth.HEALTHY:
            logger.warning(
                "tier %r unhealthy (%s); skipping it for %.3g s", self.name, self.last_error, self._backoff_s
            )
        self.state = TierHealth.UNHEALTHY

    def _record_success(self) -> None:
        if self.state is TierHealth.UNHEALTHY:
            logger.warning("tier %r healthy again", self.name)
        self.state = TierHealth.HEALTHY
        self._backoff_s = 0.0


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
