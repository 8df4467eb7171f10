"""The tier contract: what a slow storage tier implements.

A tier stores encoded chunk payloads under printable string keys
(``CacheKey.to_str()``, e.g. ``"model/1.0/bfloat16/fp/tags/3f9a..."``). Keys are
opaque to a tier: they may contain ``/`` and any other printable character, so a
tier maps them to its own names (file names, namespaced Redis keys) safely.

Every method is ``async`` and runs on the engine's anyio portal thread
(:mod:`flowkv.tiers.portal`). Blocking work (file I/O, checksums of large
payloads) goes to a worker thread with ``anyio.to_thread.run_sync`` so one slow
tier does not hold up the others sharing that loop.

A user's own tier::

    from flowkv.registry import tier
    from flowkv.tiers import Tier

    @attrs.define(kw_only=True)
    class S3TierConfig:
        bucket: str

    @tier("s3", config=S3TierConfig)
    class S3Tier(Tier):
        def __init__(self, *, name: str, config: S3TierConfig) -> None:
            self.name = name
            ...
        async def exists(self, keys): ...
        async def get(self, keys): ...
        async def put(self, entries): ...
        async def aclose(self): ...

and in the pipeline file::

    [tiers.archive]
    kind = "s3"                  # or "mypkg.tiers:S3Tier"
    bucket = "kv-cache"

Wrap it in :class:`flowkv.tiers.GuardedTier` (the engine does) and a failing or
hanging tier is skipped instead of stalling inference.
"""

from __future__ import annotations

import abc

from flowkv import payload

__all__ = ["Tier", "verify_payload"]


class Tier(abc.ABC):
    """A storage tier for encoded chunk payloads.

    Contract, for every implementation:

    - ``exists(keys)`` answers one bool per key, in order, without moving data.
      It may be optimistic (a later ``get`` can still miss).
    - ``get(keys)`` answers one ``bytes`` or ``None`` per key, in order.
      ``None`` is a miss, and so is data that fails its integrity check
      (:func:`verify_payload`): corrupt or truncated data is never returned.
    - ``put(entries)`` stores ``(key, payload)`` pairs. A tier may decline any
      entry (capacity, admission policy); the same key always carries the same
      payload, so an entry already present may be skipped.
    - ``aclose()`` releases connections and files; the tier is not used after.
    - ``stats()`` is synchronous and cheap: counters as a flat dict of numbers.

    Methods may raise on infrastructure failure (server down, disk gone);
    :class:`flowkv.tiers.GuardedTier` turns that into misses and dropped puts.
    """

    #: The tier's name from the pipeline file (``[tiers.NAME]``).
    name: str

    @abc.abstractmethod
    async def exists(self, keys: list[str]) -> list[bool]:
        """One bool per key: whether the tier (probably) holds it."""

    @abc.abstractmethod
    async def get(self, keys: list[str]) -> list[bytes | None]:
        """One payload per key, or ``None`` for a miss (absent or corrupt)."""

    @abc.abstractmethod
    async def put(self, entries: list[tuple[str, bytes]]) -> None:
        """Store ``(key, payload)`` pairs; entries may be declined."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the tier's resources."""

    def stats(self) -> dict[str, int | float]:
        """Counters for telemetry and tests; empty unless the tier keeps some."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={getattr(self, 'name', '?')!r})"


def verify_payload(blob: bytes) -> bool:
    """Whether ``blob`` is an intact flowkv payload (header and checksum good).

    ``flowkv.payload.verify`` checks header, length and body checksum without
    decoding; any ``PayloadError`` it raises makes the answer False.
    """
    try:
        payload.verify(blob)
    except payload.PayloadError:
        return False
    return True
