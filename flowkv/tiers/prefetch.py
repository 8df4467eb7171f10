"""Prefetch and promotion: byte-tier hits copied up into the staging tier (memory).

A lookup that finds chunks below memory starts reading them at once
(``Prefetcher.prefetch``, on the I/O thread); each lands in memory pinned for
the lookup's owner, unless a release came first, and a retrieve that comes
while they are on their way waits for them (``wait``). ``Promoter.promote``
is the copy itself, also used by a read with ``promote`` on: a payload
checked against its key; an encoded one kept encoded (its reader decodes
it); a raw one decoded into a memory object of the reader's shape, by the
``decode`` its engine gives (`StorageManager.decode_promotions_with`: a run
of the pipeline's own decode stages, with their spans). Nothing here
decodes: without a ``decode`` (a node server, which hosts many geometries)
a raw payload is kept as it is too.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flowkv import payload as payloads
from flowkv.tiers import portal
from flowkv.tiers.base import Entry, ObjectTier, TierEvents, TierObject, for_tenant
from flowkv.tiers.health import GuardedTier
from flowkv.tiers.pins import Pins

if TYPE_CHECKING:
    from flowkv.accounting import Counters

__all__ = ["Prefetcher", "Promoter"]

log = logging.getLogger("flowkv.tiers")


class Promoter:
    """Copies byte-tier payloads into the staging tier ``memory`` (named ``staging``)."""

    def __init__(self, staging: str, memory: ObjectTier, *, counters: Counters, events: TierEvents) -> None:
        self.staging = staging
        self.memory = memory
        self._counters = counters
        self._events = events
        #: decode(entry, payload, room) -> whether ``room`` (a staging-tier object of the entry's shape)
        #: now holds the payload's KV; None: raw payloads are kept as they are, like encoded ones
        self.decode: Callable[[Entry, Any, TierObject], bool] | None = None

    def keyed(self, tier: str, key: str, blob: Any) -> Any:
        """``blob`` when its header is sound and names ``key``; else None, counted once (a payload moved or
        planted under another key, or one that does not parse, is a miss; the next tier may hold it)."""
        if blob is None:
            return None
        try:
            payloads.read_header(blob, expect_key=key)
        except payloads.PayloadError as exc:
            self._counters.count("corrupt_payloads")
            log.warning("flowkv: refusing the payload %s gave for %s: %s", tier, key, exc)
            return None
        return blob

    def promote(self, entry: Entry, blob: Any) -> bool:
        """Copy a payload ``entry.tier`` gave into the staging tier, as ``entry.tenant``'s: a raw one
        decoded into the entry's shape (when there is a ``decode`` and a shape), any other kept as it is."""
        memory = self.memory
        key = entry.key
        if memory.contains(key):
            return True
        room = for_tenant(memory, entry.tenant)  # the promoted entry is the reader's
        try:
            header = payloads.read_header(blob, expect_key=key)
        except payloads.PayloadError as exc:
            self._counters.count("corrupt_payloads")
            log.warning("flowkv: refusing the payload read for %s: %s", key, exc)
            return False
        if header.codec == "none" and entry.shape is not None and self.decode is not None:
            # As large decoded as encoded: it lands raw, so no later hit decodes it again.
            obj = memory.allocate(entry.shape, entry.dtype, **room)
            if obj is None:
                return False
            if not self.decode(entry, blob, obj):  # a corrupt payload: the decode stage counted it
                obj.ref_down()
                return False
        else:
            try:
                obj = memory.allocate_bytes(len(blob), **room)
            except ValueError:  # larger than a slab: leave it in its tier
                return False
            if obj is None:
                return False
            try:
                payloads.verify(blob, expect_key=key)  # kept encoded: checked now, so nothing corrupt is held
            except payloads.PayloadError:
                obj.ref_down()
                self._counters.count("corrupt_payloads")
                return False
            obj.view_bytes()[:] = blob
            obj.meta["codec"] = header.codec
        if header.segment_start is not None:
            obj.meta["start_position"] = header.segment_start
        admitted = memory.put(key, obj)
        obj.ref_down()
        if admitted:
            self._events.emit("admit", self.staging, key)
        self._counters.count("promotions")
        return True


class Prefetcher:
    """Byte-tier hits on their way to the staging tier, and the owners each is pinned for when it lands.

    ``guarded`` are the byte tiers (name -> guarded tier), ``timeout_s`` each
    one's call timeout; ``pins`` are the staging tier's pins.
    """

    def __init__(self, guarded: Mapping[str, GuardedTier], timeout_s: Mapping[str, float], *,
                 promoter: Promoter, pins: Pins, counters: Counters) -> None:
        self._guarded = guarded
        self._timeout_s = timeout_s
        self._promoter = promoter
        self._pins = pins
        self._counters = counters
        self._lock = threading.Lock()  # guards the state below
        # key -> set once that key's prefetch landed (promoted or not)
        self._prefetching: dict[str, concurrent.futures.Future[None]] = {}
        # owner -> keys its lookups prefetched (on their way, or landed and pinned for it)
        self._owner: dict[Any, set[str]] = {}
        # key on its way -> owners to pin it for when it lands (a release takes its owner out)
        self._waiting: dict[str, set[Any]] = {}

    def prefetch(self, entries: Sequence[Entry], owner: Any) -> None:
        """Start promoting the byte-tier hits among ``entries`` into the staging tier (not waiting).

        Each promoted chunk is pinned for ``owner`` when it lands, unless
        ``forget(owner)`` came first. A chunk already on its way is not read
        twice; it is pinned for ``owner`` too.
        """
        by_tier: dict[str, list[Entry]] = collections.defaultdict(list)
        landing: dict[str, concurrent.futures.Future[None]] = {}
        with self._lock:
            for entry in entries:
                if entry.tier not in self._guarded:
                    continue
                if owner is not None:
                    self._owner.setdefault(owner, set()).add(entry.key)
                    self._waiting.setdefault(entry.key, set()).add(owner)
                if entry.key not in self._prefetching:
                    by_tier[entry.tier].append(entry)  # type: ignore[index]
            for name, group in by_tier.items():
                # Readers wait on ``landed``, set once the chunks are in memory: waiters
                # of the read's own future wake before its done-callbacks (the promotion) run.
                landed: concurrent.futures.Future[None] = concurrent.futures.Future()
                landing[name] = landed
                for entry in group:
                    self._prefetching[entry.key] = landed
        for name, group in by_tier.items():
            landed = landing[name]
            try:
                future = portal.submit(self._guarded[name].get, [e.key for e in group], group[0].tenant)
            except Exception:  # no I/O thread (shutting down): nothing lands
                log.warning("flowkv: prefetch from %s not started", name, exc_info=True)
                self._landed(None, group, landed)
                continue
            future.add_done_callback(lambda f, group=group, landed=landed: self._landed(f, group, landed))
            self._counters.count("prefetches", len(group))

    def _landed(self, future: concurrent.futures.Future[Any] | None, group: list[Entry],
                landed: concurrent.futures.Future[None]) -> None:
        promoter = self._promoter
        done = 0
        try:
            try:
                blobs = future.result() if future is not None else [None] * len(group)
            except Exception:
                blobs = [None] * len(group)
            for entry, blob in zip(group, blobs):
                blob = promoter.keyed(entry.tier, entry.key, blob)  # type: ignore[arg-type]
                promoted = blob is not None and promoter.promote(entry, blob)
                with self._lock:  # a forget either took its owner out already, or unpins after this
                    owners = self._waiting.pop(entry.key, ())
                    if promoted and owners:
                        self._pins.pin_one(promoter.staging, entry.key, list(owners))
                done += 1
        finally:
            with self._lock:
                for index, entry in enumerate(group):
                    if index >= done:  # not landed (a promotion raised): nobody waits for it any more
                        self._waiting.pop(entry.key, None)
                    if self._prefetching.get(entry.key) is landed:
                        del self._prefetching[entry.key]
            landed.set_result(None)

    def forget(self, owner: Any) -> None:
        """Pin nothing more for ``owner`` (call before unpinning it: a chunk that lands after this is not
        pinned for it)."""
        with self._lock:
            for key in self._owner.pop(owner, ()):
                waiting = self._waiting.get(key)
                if waiting is not None:
                    waiting.discard(owner)

    def waits_for(self, owner: Any) -> bool:
        """Whether ``owner``'s lookups prefetched chunks not yet forgotten."""
        with self._lock:
            return bool(self._owner.get(owner))

    def pending(self, owner: Any) -> bool:
        """Whether chunks a lookup by ``owner`` found in byte tiers are still on their way to memory."""
        with self._lock:
            keys = self._owner.get(owner, ())
            return any(not self._prefetching[k].done() for k in keys if k in self._prefetching)

    def wait(self, entries: Sequence[Entry]) -> None:
        """Wait (each within its tier's timeout) for the prefetches of ``entries`` on their way."""
        if not self._prefetching:  # no lock for the common case: nothing prefetching at all
            return
        with self._lock:
            landings = [(e, self._prefetching.get(e.key)) for e in entries]
        for entry, landing in landings:
            if landing is not None:
                try:
                    landing.result(timeout=self._timeout_s.get(entry.tier, 1.0) + 1.0)
                except Exception:
                    pass
