"""The storage manager: every tier of a pipeline, in order, and the policies between them.

::

    find / read                                        put (stage option tiers = [...])
      |                                                  |
      v                                                  v
    [memory] --copy--> [node]  --> [disk] --> [redis]    object tiers first: stores allocate in the
      ^  promote (read, prefetch)    |          |        first (staging); byte tiers: guarded,
      +------------------------------+----------+        written behind

This is the one place that knows the tiers' order and which of them hold
objects (memory; a node server's shared arena, kind ``server``). Stages
reach it as ``ctx.services.storage``:

- ``find`` answers, for each key, the first tier in order that holds it
  (prefix contiguity is the lookup stage's rule over that answer);
- ``read`` hands back a chunk's object or payload, promoting a byte-tier hit
  into memory when the caller asks (``get``'s ``promote`` option);
- ``allocate`` gives a store room in memory; ``put`` commits a chunk to a
  named tier (byte tiers through their bounded write-behind queue; object
  tiers at once; a chunk for an object tier other than the staging one is
  copied there); a :class:`StoreBatch` (``batch()``) holds a store's
  object-tier puts until its ``commit``, one call per tier;
- the ``*_many`` forms do a request's chunks in one call per tier, so a
  remote object tier costs one round trip per request, not per chunk;
- ``pin`` / ``release`` / ``expire_pins`` keep lookup hits from eviction until
  retrieve (:mod:`flowkv.tiers.pins`, with the timer that drops pins past
  their deadline when no call comes); ``prefetch`` starts promoting
  byte-tier hits at lookup time (:mod:`flowkv.tiers.prefetch`; a release
  covers what the lookup's prefetch lands after it);
- ``health``, ``stats``, ``flush``, ``close``; ``subscribe`` for admit and
  evict events of object tiers.

Byte-tier calls run on the I/O thread (:mod:`flowkv.tiers.portal`), each
bounded by its tier's ``timeout_s``; a failing tier answers misses and drops
writes (:class:`flowkv.tiers.GuardedTier`), and inference goes on without it.

The manager holds no engine state: it needs no KV geometry (callers say what
shape a chunk decodes to) and no pipeline beyond its ``[tiers]`` tables, so a
node server can host it in a process of its own.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from flowkv import payload as payloads
from flowkv.clock import MONOTONIC, Clock
from flowkv.tenants import DEFAULT_TENANT
from flowkv.tiers import portal
from flowkv.tiers.base import Entry, Found, ObjectTier, Tier, TierEvent, TierEvents, TierObject, for_tenant
from flowkv.tiers.health import GuardedTier, TierHealth
from flowkv.tiers.pins import Pins
from flowkv.tiers.prefetch import Prefetcher, Promoter
from flowkv.tiers.writebehind import WriteBehind

if TYPE_CHECKING:
    from flowkv.accounting import Counters
    from flowkv.pipeline import TierSpec

__all__ = ["Entry", "Found", "StorageManager", "StoreBatch", "TierEvent"]

log = logging.getLogger("flowkv.tiers")


class _NoCounters:
    def count(self, name: str, n: float = 1) -> None:
        pass


# One object-tier put waiting for its batch's commit: key, object, the payload kept for a copy, tenant.
_Pending = tuple[str, TierObject, Any, str]


class StoreBatch:
    """One store's object-tier puts, committed together: one call per object tier at ``commit``.

    ``put`` is :meth:`StorageManager.put`, except that an object tier's chunk
    waits for ``commit`` (and ``put`` answers 0 for it). A batch is the
    caller's own object: one never committed stores nothing in object tiers
    and touches no other store (the ``put`` stage commits its batch through
    ``ctx.defer``, so it commits however the run ends).
    """

    def __init__(self, manager: StorageManager) -> None:
        self._manager = manager
        self._pending: dict[str, list[_Pending]] = {}

    def put(self, tier: str, key: str, *, obj: TierObject | None = None, kv: torch.Tensor | None = None,
            payload: Any = None, tenant: str = DEFAULT_TENANT) -> int:
        """Put a chunk to ``tier`` (byte tiers at once, through their write-behind queue; object
        tiers at ``commit``); the bytes it took now."""
        return self._manager._put(tier, key, obj, kv, payload, tenant, self._pending)

    def commit(self) -> dict[str, int]:
        """Commit the object-tier puts made so far, one call per tier; the bytes each tier took
        (held keys and chunks that found no room take none). The batch is empty after."""
        pending, self._pending = self._pending, {}
        return self._manager._commit(pending)


class StorageManager:
    """The ordered tiers of one pipeline: object tiers (memory) and byte tiers (disk, Redis, yours).

    ``tiers`` are built tier instances in lookup order. The first object
    tier is the *staging* tier: stores allocate there, and byte-tier hits are
    promoted there; a later object tier (``memory`` then ``server``) gets a
    copy of each chunk ``put`` sends it. Byte tiers are wrapped in a
    :class:`GuardedTier` (with ``guards[name]``: ``timeout_s``,
    ``backoff_max_s``, ``write_queue``).

    Pins carry deadlines of ``pin_timeout_s`` on ``clock``
    (`flowkv.clock.MONOTONIC`, or a `flowkv.clock.ManualClock` in tests),
    dropped by a timer when no call comes (:class:`flowkv.tiers.pins.Pins`;
    the timer ends with ``close()`` or with the manager).
    """

    def __init__(
        self,
        tiers: Mapping[str, ObjectTier | Tier],
        *,
        slab_bytes: int,
        pin_timeout_s: float = 30.0,
        guards: Mapping[str, Any] | None = None,
        counters: Counters | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._counters: Counters = counters or _NoCounters()
        self.order: tuple[str, ...] = tuple(tiers)
        self._objects: dict[str, ObjectTier] = {}
        self.guarded: dict[str, GuardedTier] = {}
        self._write_behind: dict[str, WriteBehind] = {}
        self._timeout_s: dict[str, float] = {}
        for name, tier in tiers.items():
            if getattr(tier, "holds", "bytes") == "objects":
                tier.open(slab_bytes=slab_bytes)
                self._objects[name] = tier  # type: ignore[assignment]
                continue
            guard = (guards or {}).get(name)
            timeout_s = guard.timeout_s if guard is not None else 1.0
            backoff_max_s = guard.backoff_max_s if guard is not None else 30.0
            guarded = GuardedTier(tier, timeout_s=timeout_s, backoff_initial_s=min(1.0, backoff_max_s),  # type: ignore[arg-type]
                                  backoff_max_s=backoff_max_s)
            self.guarded[name] = guarded
            self._write_behind[name] = WriteBehind(guarded, guard.write_queue if guard is not None else 256)
            self._timeout_s[name] = timeout_s
        if not self._objects:
            raise ValueError(f"a storage manager needs an object tier (memory or server), got {list(tiers)}")
        #: the object tier stores allocate in and byte-tier hits are promoted to
        self.staging: str = next(iter(self._objects))
        self.memory: ObjectTier = self._objects[self.staging]
        self._events = TierEvents()
        self.pins = Pins(self._objects, clock=clock or MONOTONIC, timeout_s=pin_timeout_s)
        self.promoter = Promoter(self.staging, self.memory, counters=self._counters, events=self._events)
        self.prefetcher = Prefetcher(self.guarded, self._timeout_s, promoter=self.promoter, pins=self.pins,
                                     counters=self._counters)

    @property
    def pin_timer_interval_s(self) -> float:
        """How often (on the pins' clock) the pin timer drops expired pins."""
        return self.pins.timer_interval_s

    @classmethod
    def from_specs(
        cls,
        specs: Mapping[str, TierSpec],
        *,
        slab_bytes: int,
        pin_timeout_s: float = 30.0,
        world_size: int = 1,
        rank: int = 0,
        counters: Counters | None = None,
        clock: Clock | None = None,
        arena: ObjectTier | None = None,
    ) -> StorageManager:
        """Build every ``[tiers.NAME]`` of a pipeline the same way: ``Cls(name=NAME, config=cfg)``.

        With ``arena`` (a node server's own memory), that object tier is
        ``memory``, first in order, and stands in for the pipeline's object
        tiers; the byte tiers follow in the pipeline's order.
        """
        tiers: dict[str, ObjectTier | Tier] = {"memory": arena} if arena is not None else {}
        guards: dict[str, Any] = {}
        for name, spec in specs.items():
            if arena is not None:
                if spec.info.holds == "objects":
                    continue
                if name == "memory":
                    raise ValueError(f"tier {name!r} at {spec.location}: the name 'memory' is the server's arena")
            config = spec.config
            if world_size > 1 and isinstance(getattr(config, "path", None), str):
                # One process per folder: each tensor-parallel rank keeps its own.
                config = attrs.evolve(config, path=str(Path(config.path).expanduser() / f"rank{rank}"))
            tiers[name] = spec.info.cls(name=name, config=config)
            guards[name] = spec.guard
        return cls(tiers, slab_bytes=slab_bytes, pin_timeout_s=pin_timeout_s, guards=guards, counters=counters,
                   clock=clock)

    # -- what is where ------------------------------------------------------

    def holds_objects(self, tier: str | None) -> bool:
        """Whether ``tier`` is an object tier (its hits are objects, pinnable, no I/O wait)."""
        return tier in self._objects

    def tier(self, name: str) -> ObjectTier | GuardedTier:
        """The tier named ``name`` (byte tiers with their guard)."""
        objects = self._objects.get(name)  # not `or`: an empty memory tier is falsy (it has a length)
        return objects if objects is not None else self.guarded[name]

    def find(self, keys: Sequence[str], *, skip: Sequence[bool] | None = None,
             tiers: Sequence[str] | None = None, pin: Any = None) -> list[str | None]:
        """For each key, the first tier (in order, or of ``tiers``) that holds it, or None.

        Keys with ``skip`` set are not asked for. Reads no payload. With ``pin``
        (a lookup owner), object-tier hits of the prefix hit (leading keys
        found or skipped) are pinned for it, as ``pin`` would.
        """
        found: list[str | None] = [None] * len(keys)
        pinned: dict[str, list[int]] = {}
        for name in tiers or self.order:
            todo = [i for i, k in enumerate(keys) if found[i] is None and not (skip and skip[i])]
            if not todo:
                break
            wanted = [keys[i] for i in todo]
            objects = self._objects.get(name)
            if objects is not None:
                # With ``pin``, lookup and pin are one call (one round trip to a node server).
                if pin is None:
                    answers = objects.contains_many(wanted)
                else:
                    answers = objects.contains_many(wanted, pin_owner=pin, pin_timeout_s=self.pins.timeout_s,
                                                    pin_now=self.pins.clock.now())
                    pinned[name] = [i for i, present in zip(todo, answers) if present]
            else:
                answers = self._call(name, "exists", wanted, default=[False] * len(todo))
            for i, present in zip(todo, answers):
                if present:
                    found[i] = name
        if pinned:
            # Only the prefix hit stays pinned: a retrieve loads nothing past the first miss.
            end = next((i for i, tier in enumerate(found) if tier is None and not (skip and skip[i])), len(keys))
            for name, indices in pinned.items():
                beyond = [keys[i] for i in indices if i >= end]
                if beyond:
                    self._objects[name].unpin_many(beyond, pin)
            self.pins.started()
        return found

    def contains(self, key: str) -> bool:
        """Whether the staging tier holds ``key`` (a store need not write it again)."""
        return self.memory.contains(key)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` for each key, in one call to the staging tier."""
        return self.memory.contains_many(list(keys))

    # -- store ----------------------------------------------------------------

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *,
                 tenant: str = DEFAULT_TENANT) -> TierObject | None:
        """Room in the staging tier for a chunk of ``tenant``'s raw KV (evicting if needed); None when full."""
        return self.memory.allocate(shape, dtype, **for_tenant(self.memory, tenant))

    def allocate_many(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, *,
                      tenant: str = DEFAULT_TENANT) -> list[TierObject]:
        """Room in the staging tier for each chunk, in order, as many as fit (one call)."""
        return self.memory.allocate_many(shapes, dtype, **for_tenant(self.memory, tenant))

    def allocate_each(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, *,
                      tenant: str = DEFAULT_TENANT) -> Iterator[TierObject]:
        """Room in the staging tier for each chunk, one per ``next()``, ending when full
        (``ObjectTier.allocate_each``: in-process tiers allocate as pulled, remote ones at once).
        The rooms are ``tenant``'s: its quota bounds them, and its entries they become."""
        return self.memory.allocate_each(shapes, dtype, **for_tenant(self.memory, tenant))

    def release_objects(self, found: Sequence[tuple[str, TierObject]]) -> None:
        """Drop the caller's reference on each ``(tier, obj)``: one call per tier."""
        by_tier: dict[str, list[TierObject]] = collections.defaultdict(list)
        for tier, obj in found:
            by_tier[tier].append(obj)
        for tier, objs in by_tier.items():
            self._objects[tier].release_objects(objs)

    def put(self, tier: str, key: str, *, obj: TierObject | None = None, kv: torch.Tensor | None = None,
            payload: Any = None, tenant: str = DEFAULT_TENANT) -> int:
        """Commit a chunk to ``tier``; the bytes it takes there (0: already held, or dropped).

        An object tier takes ``obj``: when ``payload`` (the chunk's encoding) is
        no larger, the encoding replaces the raw KV in the object's own pages
        and the rest goes back (``obj.meta["codec"]`` is then set and the raw
        view is gone). Another object tier than the staging one gets a copy.
        A byte tier gets ``payload`` (or ``kv`` encoded raw) through its
        write-behind queue and never waits. The chunk is ``tenant``'s (an
        object allocated for a tenant stays that tenant's in its own tier).
        A store that puts many chunks puts them through a :meth:`batch`.
        """
        return self._put(tier, key, obj, kv, payload, tenant, None)

    def batch(self) -> StoreBatch:
        """A new :class:`StoreBatch`: ``put`` as here, object tiers committed together at its ``commit``."""
        return StoreBatch(self)

    def _put(self, tier: str, key: str, obj: TierObject | None, kv: torch.Tensor | None, payload: Any,
             tenant: str, pending: dict[str, list[_Pending]] | None) -> int:
        """``put``; with ``pending`` (a batch's), an object tier's chunk is added there, not committed."""
        objects = self._objects.get(tier)
        if objects is None:
            start = obj.meta.get("start_position") if obj is not None else None
            blob = payload if payload is not None else payloads.encode(kv, "none", key=key, segment_start=start)
            if isinstance(blob, memoryview):
                blob = bytes(blob)
            if not self._write_behind[tier].offer(key, blob, tenant):
                return 0
            self._events.emit("admit", tier, key)  # queued to be written: a write that fails later is a miss
            return len(blob)
        if obj is None:
            raise ValueError(f"put to object tier {tier!r} needs the chunk's object (run 'allocate' first)")
        if tier != self.staging:
            # A copy: of the object's encoding when the staging tier took one, else of the payload
            # (kept until the copy) or the raw KV.
            keep = payload if payload is not None and "codec" not in obj.meta and len(payload) <= obj.nbytes else None
            if pending is not None:
                pending.setdefault(tier, []).append((key, obj, keep, tenant))
                return 0
            return self._commit_copies(tier, [(key, obj, keep, tenant)])
        if payload is not None and len(payload) <= obj.nbytes:
            # Overwrite the chunk's own pages (the raw KV is no longer needed; a
            # second allocation could evict this store's own earlier chunks when
            # memory is short), and give the pages past it back to the arena: a
            # compressed entry costs only its bytes.
            obj.view_bytes()[: len(payload)] = payload
            obj.shrink_to_bytes(len(payload))
            obj.meta["codec"] = payloads.read_header(payload).codec
            obj.meta["encoded_len"] = len(payload)
        if pending is not None:
            pending.setdefault(tier, []).append((key, obj, None, tenant))
            return 0
        if not objects.put(key, obj):
            return 0  # another store of the same tokens got there first
        self._events.emit("admit", tier, key)
        return obj.nbytes

    def _commit(self, pending: Mapping[str, list[_Pending]]) -> dict[str, int]:
        """Commit a batch's object-tier puts, one call per tier, in tier order; the bytes each took."""
        written: dict[str, int] = {}
        for tier in [name for name in self.order if name in pending]:
            batch = pending[tier]
            if tier != self.staging:
                written[tier] = self._commit_copies(tier, batch)
                continue
            admitted = self._objects[tier].put_many([(key, obj) for key, obj, _, _ in batch])
            written[tier] = 0
            for (key, obj, _, _), ok in zip(batch, admitted):
                if ok:
                    written[tier] += obj.nbytes
                    self._events.emit("admit", tier, key)
        return written

    def _commit_copies(self, tier: str, batch: Sequence[_Pending]) -> int:
        """Copy each chunk into object tier ``tier`` (one allocation call, one commit call)."""
        target = self._objects[tier]
        held = target.contains_many([key for key, _, _, _ in batch])
        batch = [item for item, present in zip(batch, held) if not present]
        if not batch:
            return 0
        # A store is one request's: one tenant for its batch.
        tenant = for_tenant(target, batch[0][3])
        raw = [item for item in batch if item[2] is None and "codec" not in item[1].meta]
        encoded = [item for item in batch if item[2] is not None or "codec" in item[1].meta]
        copies: list[tuple[str, TierObject]] = []
        try:
            if raw:
                objs = target.allocate_many([tuple(obj.tensor.shape) for _, obj, _, _ in raw],
                                            raw[0][1].tensor.dtype, **tenant)
                for (key, obj, _, _), copy in zip(raw, objs):
                    copy.tensor.copy_(obj.tensor)
                    copies.append((key, copy))
            for key, obj, blob, _ in encoded:
                data = blob if blob is not None else obj.view_bytes()[: obj.meta["encoded_len"]]
                got = target.allocate_many([(len(data),)], torch.uint8, **tenant)
                if not got:
                    break
                copy = got[0]
                copy.view_bytes()[:] = data
                copy.meta["codec"] = payloads.read_header(data).codec
                copy.meta["encoded_len"] = len(data)
                copies.append((key, copy))
            if not copies:
                self._counters.count(f"tier.{tier}.copy_no_room", len(batch))
                return 0
            admitted = target.put_many(copies)
        finally:
            target.release_objects([copy for _, copy in copies])
        written = 0
        for (key, copy), ok in zip(copies, admitted):
            if ok:
                written += copy.meta.get("encoded_len", copy.nbytes)
                self._events.emit("admit", tier, key)
        return written

    # -- retrieve -------------------------------------------------------------

    def read(self, entry: Entry, *, promote: bool) -> Found | None:
        """``entry``'s data from the tiers: object tiers first, then byte tiers (the one
        lookup named first); None when no tier has it any more.

        With ``promote``, a byte-tier hit is copied into the staging tier (a raw
        payload decoded on the way, by the decode given to
        :meth:`decode_promotions_with`) and served from there.
        """
        self.prefetcher.wait([entry])
        for name, objects in self._objects.items():
            found = _found_in(name, objects, entry)
            if found is not None:
                return found
        return self._read_bytes(entry, promote=promote)

    def read_many(self, entries: Sequence[Entry], *, promote: bool) -> Iterator[Found | None]:
        """``read`` for each entry, in order: object tiers asked once for all of them
        (one round trip to a node server), byte tiers chunk by chunk as the caller
        pulls. Objects fetched for entries the caller never pulled are released."""
        self.prefetcher.wait(entries)
        hits: list[Found | None] = [None] * len(entries)
        todo = list(range(len(entries)))
        for name, objects in self._objects.items():
            if not todo:
                break
            wanted = [entries[i] for i in todo]
            objs = objects.get_many([(e.key, e.shape, e.dtype) for e in wanted],
                                    **for_tenant(objects, wanted[0].tenant))
            for i, obj in zip(todo, objs):
                if obj is not None:
                    hits[i] = _as_found(name, obj)
            todo = [i for i in todo if hits[i] is None]
        index = 0
        try:
            for index, entry in enumerate(entries):
                found = hits[index]
                if found is None:
                    found = self._read_bytes(entry, promote=promote)
                hits[index] = None  # the caller owns it now
                yield found
            index = len(entries)
        finally:
            unpulled = [(f.tier, f.obj) for f in hits[index:] if f is not None and f.obj is not None]
            if unpulled:
                self.release_objects(unpulled)

    def _read_bytes(self, entry: Entry, *, promote: bool) -> Found | None:
        key = entry.key
        order = [entry.tier] if entry.tier in self.guarded else []
        order += [n for n in self.guarded if n not in order]
        for name in order:
            blob = self.promoter.keyed(name, key, self._call(name, "get", [key], entry.tenant, default=[None])[0])
            if blob is None:
                continue
            if promote and self.promoter.promote(entry._replace(tier=name), blob):
                found = _found_in(self.staging, self.memory, entry)
                if found is not None:
                    return found
            return Found(tier=name, payload=blob)
        return None

    def discard(self, key: str, tier: str | None, error: Exception) -> None:
        """A payload failed its checks: count it and drop it from object tiers so it is not served again."""
        self._counters.count("corrupt_payloads")
        log.warning("flowkv: dropping corrupt chunk %s from %s: %s", key, tier, error)
        self.remove(key)

    def remove(self, key: str) -> bool:
        """Drop ``key`` from every object tier; whether any held it."""
        removed = False
        for name, objects in self._objects.items():
            if objects.remove(key):
                removed = True
                self._events.emit("remove", name, key)
        return removed

    # -- pins and prefetch ----------------------------------------------------

    def pin(self, hits: Sequence[tuple[str, str | None]], owner: Any) -> None:
        """Keep the object-tier hits among ``hits`` (key, tier found in) from eviction for ``owner``
        (one call per tier)."""
        self.pins.pin(hits, owner)

    def release(self, owner: Any) -> None:
        """Drop every pin ``owner`` holds, its prefetched chunks' included, and any its
        prefetch would take when it lands later."""
        self.prefetcher.forget(owner)  # first: a chunk that lands after this is not pinned for ``owner``
        self.pins.release(owner)

    def holds_pins(self, owner: Any) -> bool:
        """Whether ``owner`` still pins a chunk in an object tier, or waits for a prefetch to land pinned."""
        return self.prefetcher.waits_for(owner) or self.pins.holds(owner)

    def expire_pins(self) -> None:
        """Drop pins past their deadline (a scheduler that stopped asking must not pin forever)."""
        self.pins.expire()

    def prefetch(self, entries: Sequence[Entry], owner: Any) -> None:
        """Start promoting the byte-tier hits among ``entries`` into the staging tier (not waiting);
        each lands pinned for ``owner`` unless ``release(owner)`` came first
        (:meth:`flowkv.tiers.prefetch.Prefetcher.prefetch`)."""
        self.prefetcher.prefetch(entries, owner)

    def decode_promotions_with(self, decode: Callable[[Entry, Any, TierObject], bool]) -> None:
        """Have ``decode(entry, payload, room)`` decode each raw payload promoted into the staging
        tier into ``room`` (an object of the entry's shape), answering whether it did: an engine's
        run of its pipeline's decode stages (`flowkv.executor.Executor.decode_promotion`). Without
        one, raw payloads are promoted as they are (kept encoded, like any other)."""
        self.promoter.decode = decode

    def prefetch_pending(self, owner: Any) -> bool:
        """Whether chunks a lookup by ``owner`` found in byte tiers are still on their way to memory."""
        return self.prefetcher.pending(owner)

    # -- events ------------------------------------------------------------------

    def subscribe(self, observer: Callable[[TierEvent], None]) -> None:
        """Call ``observer`` with every admit, evict and remove of an object tier, and every write
        queued for a byte tier (its own evictions are not seen).

        Called on whichever thread made the change, outside tier locks; it must
        be quick and must not raise (a controller queues the event and returns).
        """
        events = self._events
        events.observers.append(observer)
        for name, objects in self._objects.items():
            objects.on_evict = lambda key, name=name: events.emit("evict", name, key)

    # -- health, stats, shutdown ----------------------------------------------

    def health(self) -> dict[str, TierHealth]:
        """Each tier's state: an in-process object tier is always healthy; a byte tier or a node
        server is skipped (misses at once) while unhealthy."""
        states = {name: TierHealth(objects.health()) for name, objects in self._objects.items()}
        states.update({name: tier.state for name, tier in self.guarded.items()})
        return {name: states[name] for name in self.order}

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters of each tier (byte tiers: guard, tier and write-behind counters)."""
        out: dict[str, dict[str, Any]] = {}
        for name in self.order:
            objects = self._objects.get(name)
            if objects is not None:
                numbers = objects.stats()
                out[name] = attrs.asdict(numbers) if attrs.has(type(numbers)) else dict(numbers)
            else:
                out[name] = {**self.guarded[name].stats(), **self._write_behind[name].stats()}
        return out

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until write-behind queues are empty; False if the timeout came first."""
        deadline = time.monotonic() + timeout_s
        for queue in self._write_behind.values():
            if not queue.wait_empty(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def close(self) -> None:
        """Stop the pin timer, flush write-behind (briefly), close byte tiers, then free the object tiers."""
        self.pins.stop()
        self.flush(timeout_s=5.0)
        for name, tier in self.guarded.items():
            try:
                portal.call(tier.aclose, timeout_s=self._timeout_s[name] + 1.0)
            except Exception:  # closing must not raise into the inference engine
                log.warning("flowkv: closing tier %s failed", name, exc_info=True)
        for objects in self._objects.values():
            objects.close()

    def _call(self, tier: str, method: str, *args: Any, default: Any) -> Any:
        try:
            return portal.call(getattr(self.guarded[tier], method), *args, timeout_s=self._timeout_s[tier] + 1.0)
        except Exception:  # the guard answers misses itself; this covers the portal's own timeout
            self._counters.count(f"tier_call_failures.{tier}")
            return default


def _found_in(name: str, objects: ObjectTier, entry: Entry) -> Found | None:
    [obj] = objects.get_many([(entry.key, entry.shape, entry.dtype)], **for_tenant(objects, entry.tenant))
    return None if obj is None else _as_found(name, obj)


def _as_found(name: str, obj: TierObject) -> Found:
    if "codec" in obj.meta:
        return Found(tier=name, obj=obj, payload=obj.view_bytes()[: obj.meta["encoded_len"]])
    return Found(tier=name, obj=obj, kv=obj.tensor)
