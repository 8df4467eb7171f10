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
  tiers at once, or with ``later`` in one batch per tier at ``commit``; a
  chunk for an object tier other than the staging one is copied there);
- the ``*_many`` forms do a request's chunks in one call per tier, so a
  remote object tier costs one round trip per request, not per chunk;
- ``pin`` / ``release`` / ``expire_pins`` keep lookup hits from eviction until
  retrieve; ``prefetch`` starts promoting byte-tier hits at lookup time (a
  release covers what the lookup's prefetch lands after it); a timer of the
  manager's own drops pins past their deadline when no call comes;
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
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import attrs
import torch

from flowkv import payload as payloads
from flowkv.clock import MONOTONIC, Clock, Ticker
from flowkv.tenants import DEFAULT_TENANT
from flowkv.tiers import portal
from flowkv.tiers.base import ObjectTier, Tier, TierObject
from flowkv.tiers.health import GuardedTier, TierHealth
from flowkv.tiers.writebehind import WriteBehind

if TYPE_CHECKING:
    from flowkv.accounting import Counters
    from flowkv.pipeline import TierSpec

__all__ = ["Entry", "Found", "StorageManager", "TierEvent"]

log = logging.getLogger("flowkv.tiers")


# Entry and Found are made once per chunk per call: tuples, cheaper than attrs classes.


class Entry(NamedTuple):
    """One chunk as the tiers see it: its key, where lookup found it, what its raw KV is."""

    key: str
    tier: str | None  # the tier lookup found it in (None: not found, or masked)
    # The raw KV's shape: a raw payload must decode to exactly this. None (a node
    # server, which hosts many geometries): promoted payloads stay encoded.
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    # Whose request reads it (flowkv.tenants.tenant_of): a promotion lands as that tenant's entry.
    tenant: str = DEFAULT_TENANT


class Found(NamedTuple):
    """What ``read`` found: an object tier's object (the reader holds a reference) or a payload."""

    tier: str
    obj: TierObject | None = None  # release with obj.ref_down() when done
    kv: torch.Tensor | None = None  # raw KV (a view onto ``obj``)
    payload: Any = None  # encoded bytes (header + body)


@attrs.frozen
class TierEvent:
    """Something an object tier admitted or let go of (for a fleet controller)."""

    kind: Literal["admit", "evict", "remove"]
    tier: str
    key: str


class _NoCounters:
    def count(self, name: str, n: float = 1) -> None:
        pass


class StorageManager:
    """The ordered tiers of one pipeline: object tiers (memory) and byte tiers (disk, Redis, yours).

    ``tiers`` are built tier instances in lookup order. The first object
    tier is the *staging* tier: stores allocate there, and byte-tier hits are
    promoted there; a later object tier (``memory`` then ``server``) gets a
    copy of each chunk ``put`` sends it. Byte tiers are wrapped in a
    :class:`GuardedTier` (with ``guards[name]``: ``timeout_s``,
    ``backoff_max_s``, ``write_queue``).

    Pins carry deadlines on ``clock`` (`flowkv.clock.MONOTONIC`, or a
    `flowkv.clock.ManualClock` in tests); from the first pin on, a timer
    thread drops the pins past their deadline every ``pin_timeout_s / 4``
    (at most 5 s) of that clock, so an abandoned lookup frees memory with no
    further traffic. The thread ends with ``close()`` or with the manager.
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
        self.pin_timeout_s = pin_timeout_s
        self.clock: Clock = clock or MONOTONIC
        #: how often (on ``clock``) the pin timer drops expired pins
        self.pin_timer_interval_s = min(pin_timeout_s / 4, 5.0)
        self._pin_timer: Ticker | None = None
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
        # Object-tier puts made with ``later``, per thread until ``commit``: tier -> [(key, obj, payload)]
        self._later = threading.local()
        self._lock = threading.Lock()  # guards the prefetch state below and the pin timer's start
        # key -> set once that key's prefetch landed (promoted or not)
        self._prefetching: dict[str, concurrent.futures.Future[None]] = {}
        # owner -> keys its lookups prefetched (on their way, or landed and pinned for it)
        self._prefetch_owner: dict[Any, set[str]] = {}
        # key on its way -> owners to pin it for when it lands (a release takes its owner out)
        self._prefetch_waiting: dict[str, set[Any]] = {}
        self._observers: list[Callable[[TierEvent], None]] = []

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
    ) -> StorageManager:
        """Build every ``[tiers.NAME]`` of a pipeline the same way: ``Cls(name=NAME, config=cfg)``."""
        tiers: dict[str, ObjectTier | Tier] = {}
        for name, spec in specs.items():
            config = spec.config
            if world_size > 1 and isinstance(getattr(config, "path", None), str):
                # One process per folder: each tensor-parallel rank keeps its own.
                config = attrs.evolve(config, path=str(Path(config.path).expanduser() / f"rank{rank}"))
            tiers[name] = spec.info.cls(name=name, config=config)
        guards = {name: spec.guard for name, spec in specs.items()}
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
                    answers = objects.contains_many(wanted, pin_owner=pin, pin_timeout_s=self.pin_timeout_s,
                                                    pin_now=self.clock.now())
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
            self._start_pin_timer()
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
        return self.memory.allocate(shape, dtype, **_for_tenant(self.memory, tenant))

    def allocate_many(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, *,
                      tenant: str = DEFAULT_TENANT) -> list[TierObject]:
        """Room in the staging tier for each chunk, in order, as many as fit (one call)."""
        return self.memory.allocate_many(shapes, dtype, **_for_tenant(self.memory, tenant))

    def allocate_each(self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, *,
                      tenant: str = DEFAULT_TENANT) -> Iterator[TierObject]:
        """Room in the staging tier for each chunk, one per ``next()``, ending when full
        (``ObjectTier.allocate_each``: in-process tiers allocate as pulled, remote ones at once).
        The rooms are ``tenant``'s: its quota bounds them, and its entries they become."""
        return self.memory.allocate_each(shapes, dtype, **_for_tenant(self.memory, tenant))

    def release_objects(self, found: Sequence[tuple[str, TierObject]]) -> None:
        """Drop the caller's reference on each ``(tier, obj)``: one call per tier."""
        by_tier: dict[str, list[TierObject]] = collections.defaultdict(list)
        for tier, obj in found:
            by_tier[tier].append(obj)
        for tier, objs in by_tier.items():
            self._objects[tier].release_objects(objs)

    def put(self, tier: str, key: str, *, obj: TierObject | None = None, kv: torch.Tensor | None = None,
            payload: Any = None, later: bool = False, tenant: str = DEFAULT_TENANT) -> int:
        """Commit a chunk to ``tier``; the bytes it takes there (0: already held, or dropped).

        An object tier takes ``obj``: when ``payload`` (the chunk's encoding) is
        no larger, the encoding replaces the raw KV in the object's own pages
        and the rest goes back (``obj.meta["codec"]`` is then set and the raw
        view is gone). Another object tier than the staging one gets a copy.
        With ``later`` an object tier's commit waits for ``commit()`` (this
        answers 0; ``commit`` answers the bytes), so a store commits its chunks
        in one call per tier. A byte tier gets ``payload`` (or ``kv`` encoded
        raw) through its write-behind queue and never waits. The chunk is ``tenant``'s
        (an object allocated for a tenant stays that tenant's in its own tier).
        """
        objects = self._objects.get(tier)
        if objects is None:
            start = obj.meta.get("start_position") if obj is not None else None
            blob = payload if payload is not None else payloads.encode(kv, "none", key=key, segment_start=start)
            if isinstance(blob, memoryview):
                blob = bytes(blob)
            if not self._write_behind[tier].offer(key, blob, tenant):
                return 0
            self._emit("admit", tier, key)  # queued to be written: a write that fails later is a miss
            return len(blob)
        if obj is None:
            raise ValueError(f"put to object tier {tier!r} needs the chunk's object (run 'allocate' first)")
        if tier != self.staging:
            # A copy: of the object's encoding when the staging tier took one, else of the payload
            # (kept until the copy) or the raw KV.
            keep = payload if payload is not None and "codec" not in obj.meta and len(payload) <= obj.nbytes else None
            if later:
                self._pending().setdefault(tier, []).append((key, obj, keep, tenant))
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
        else:
            payload = None  # no codec, or an encoding no smaller than the raw chunk: keep it raw
        if later:
            self._pending().setdefault(tier, []).append((key, obj, None, tenant))
            return 0
        if not objects.put(key, obj):
            return 0  # another store of the same tokens got there first
        self._emit("admit", tier, key)
        return obj.nbytes

    def _pending(self) -> dict[str, list[tuple[str, TierObject, Any, str]]]:
        pending = getattr(self._later, "puts", None)
        if pending is None:
            pending = self._later.puts = {}
        return pending

    def commit(self) -> dict[str, int]:
        """Commit this thread's ``put(..., later=True)`` chunks, one call per object tier;
        the bytes each tier took (held keys and chunks that found no room take none)."""
        pending, self._later.puts = self._pending(), {}
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
                    self._emit("admit", tier, key)
        return written

    def _commit_copies(self, tier: str, batch: Sequence[tuple[str, TierObject, Any, str]]) -> int:
        """Copy each chunk into object tier ``tier`` (one allocation call, one commit call)."""
        target = self._objects[tier]
        held = target.contains_many([key for key, _, _, _ in batch])
        batch = [item for item, present in zip(batch, held) if not present]
        if not batch:
            return 0
        # A store is one request's: one tenant for its batch.
        tenant = _for_tenant(target, batch[0][3])
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
                self._emit("admit", tier, key)
        return written

    # -- retrieve -------------------------------------------------------------

    def read(self, entry: Entry, *, promote: bool) -> Found | None:
        """``entry``'s data from the tiers: object tiers first, then byte tiers (the one
        lookup named first); None when no tier has it any more.

        With ``promote``, a byte-tier hit is copied into the staging tier (a raw
        payload decoded on the way) and served from there.
        """
        key = entry.key
        self._wait_prefetch([entry])
        for name, objects in self._objects.items():
            found = _found_in(name, objects, entry)
            if found is not None:
                return found
        return self._read_bytes(entry, promote=promote)

    def read_many(self, entries: Sequence[Entry], *, promote: bool) -> Iterator[Found | None]:
        """``read`` for each entry, in order: object tiers asked once for all of them
        (one round trip to a node server), byte tiers chunk by chunk as the caller
        pulls. Objects fetched for entries the caller never pulled are released."""
        self._wait_prefetch(entries)
        hits: list[Found | None] = [None] * len(entries)
        todo = list(range(len(entries)))
        for name, objects in self._objects.items():
            if not todo:
                break
            wanted = [entries[i] for i in todo]
            objs = objects.get_many([(e.key, e.shape, e.dtype) for e in wanted],
                                    **_for_tenant(objects, wanted[0].tenant))
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

    def _wait_prefetch(self, entries: Sequence[Entry]) -> None:
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

    def _read_bytes(self, entry: Entry, *, promote: bool) -> Found | None:
        key = entry.key
        order = [entry.tier] if entry.tier in self.guarded else []
        order += [n for n in self.guarded if n not in order]
        for name in order:
            blob = self._keyed(name, key, self._call(name, "get", [key], entry.tenant, default=[None])[0])
            if blob is None:
                continue
            if promote and self._promote(key, blob, entry.shape, entry.dtype, entry.tenant):
                found = _found_in(self.staging, self.memory, entry)
                if found is not None:
                    return found
            return Found(tier=name, payload=blob)
        return None

    def _keyed(self, tier: str, key: str, blob: Any) -> Any:
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
                self._emit("remove", name, key)
        return removed

    # -- pins and prefetch ----------------------------------------------------

    def pin(self, hits: Sequence[tuple[str, str | None]], owner: Any) -> None:
        """Keep the object-tier hits among ``hits`` (key, tier found in) from eviction for ``owner``
        (one call per tier)."""
        by_tier: dict[str, list[str]] = collections.defaultdict(list)
        for key, tier in hits:
            if tier in self._objects:
                by_tier[tier].append(key)  # type: ignore[index]
        if not by_tier:
            return
        now = self.clock.now()
        for tier, keys in by_tier.items():
            self._objects[tier].pin_many(keys, owner, timeout_s=self.pin_timeout_s, now=now)
        self._start_pin_timer()

    def release(self, owner: Any) -> None:
        """Drop every pin ``owner`` holds, its prefetched chunks' included, and any its
        prefetch would take when it lands later."""
        with self._lock:
            # First out of the waiting lists (under the lock the landing pins under),
            # then unpin: a chunk that lands after this is not pinned for ``owner``.
            for key in self._prefetch_owner.pop(owner, ()):
                waiting = self._prefetch_waiting.get(key)
                if waiting is not None:
                    waiting.discard(owner)
        for objects in self._objects.values():
            objects.release_owner(owner)

    def holds_pins(self, owner: Any) -> bool:
        """Whether ``owner`` still pins a chunk in an object tier, or waits for a prefetch to land pinned."""
        with self._lock:
            if self._prefetch_owner.get(owner):
                return True
        return any(objects.holds_pins(owner) for objects in self._objects.values())

    def expire_pins(self) -> None:
        """Drop pins past their deadline (a scheduler that stopped asking must not pin forever)."""
        now = self.clock.now()
        for objects in self._objects.values():
            objects.expire_pins(now=now)

    def _start_pin_timer(self) -> None:
        if self._pin_timer is not None:
            return
        with self._lock:
            if self._pin_timer is not None:
                return
            ticker = self.clock.ticker(self.pin_timer_interval_s)
            self._pin_timer = ticker
        threading.Thread(target=_expire_pins_until_stopped, args=(weakref.ref(self), ticker),
                         name="flowkv-pin-timer", daemon=True).start()

    def prefetch(self, entries: Sequence[Entry], owner: Any) -> None:
        """Start promoting the byte-tier hits among ``entries`` into the staging tier (not waiting).

        Each promoted chunk is pinned for ``owner`` when it lands, unless
        ``release(owner)`` came first. A chunk already on its way is not read
        twice; it is pinned for ``owner`` too.
        """
        by_tier: dict[str, list[Entry]] = collections.defaultdict(list)
        landing: dict[str, concurrent.futures.Future[None]] = {}
        with self._lock:
            for entry in entries:
                if entry.tier not in self.guarded:
                    continue
                if owner is not None:
                    self._prefetch_owner.setdefault(owner, set()).add(entry.key)
                    self._prefetch_waiting.setdefault(entry.key, set()).add(owner)
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
                future = portal.submit(self.guarded[name].get, [e.key for e in group], group[0].tenant)
            except Exception:  # no I/O thread (shutting down): nothing lands
                log.warning("flowkv: prefetch from %s not started", name, exc_info=True)
                self._prefetched(None, group, landed)
                continue
            future.add_done_callback(lambda f, group=group, landed=landed: self._prefetched(f, group, landed))
            self._counters.count("prefetches", len(group))

    def _prefetched(self, future: concurrent.futures.Future[Any] | None, group: list[Entry],
                    landed: concurrent.futures.Future[None]) -> None:
        done = 0
        try:
            try:
                blobs = future.result() if future is not None else [None] * len(group)
            except Exception:
                blobs = [None] * len(group)
            for entry, blob in zip(group, blobs):
                blob = self._keyed(entry.tier, entry.key, blob)  # type: ignore[arg-type]
                promoted = blob is not None and self._promote(entry.key, blob, entry.shape, entry.dtype,
                                                              entry.tenant)
                with self._lock:  # a release either took its owner out already, or unpins after this
                    owners = self._prefetch_waiting.pop(entry.key, ())
                    if promoted and owners:
                        now = self.clock.now()
                        for owner in owners:
                            self.memory.pin(entry.key, owner, timeout_s=self.pin_timeout_s, now=now)
                done += 1
                if promoted and owners:
                    self._start_pin_timer()
        finally:
            with self._lock:
                for index, entry in enumerate(group):
                    if index >= done:  # not landed (a promotion raised): nobody waits for it any more
                        self._prefetch_waiting.pop(entry.key, None)
                    if self._prefetching.get(entry.key) is landed:
                        del self._prefetching[entry.key]
            landed.set_result(None)

    def prefetch_pending(self, owner: Any) -> bool:
        """Whether chunks a lookup by ``owner`` found in byte tiers are still on their way to memory."""
        with self._lock:
            keys = self._prefetch_owner.get(owner, ())
            return any(not self._prefetching[k].done() for k in keys if k in self._prefetching)

    def _promote(self, key: str, blob: Any, shape: tuple[int, ...] | None, dtype: torch.dtype | None,
                 tenant: str = DEFAULT_TENANT) -> bool:
        """Copy a byte-tier payload into the staging tier; raw payloads are decoded on the way
        (unless ``shape`` is None: then every payload stays encoded, and its reader decodes it)."""
        memory = self.memory
        if memory.contains(key):
            return True
        room = _for_tenant(memory, tenant)  # the promoted entry is the reader's
        try:
            header = payloads.read_header(blob, expect_key=key)
        except payloads.PayloadError as exc:
            self._counters.count("corrupt_payloads")
            log.warning("flowkv: refusing the payload read for %s: %s", key, exc)
            return False
        if header.codec == "none" and shape is not None:
            obj = memory.allocate(shape, dtype, **room)
            if obj is None:
                return False
            try:
                payloads.decode_into(blob, obj.tensor, expect_key=key)
            except payloads.PayloadError:
                obj.ref_down()
                self._counters.count("corrupt_payloads")
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
            self._emit("admit", self.staging, key)
        self._counters.count("promotions")
        return True

    # -- events ------------------------------------------------------------------

    def subscribe(self, observer: Callable[[TierEvent], None]) -> None:
        """Call ``observer`` with every admit, evict and remove of an object tier, and every write
        queued for a byte tier (its own evictions are not seen).

        Called on whichever thread made the change, outside tier locks; it must
        be quick and must not raise (a controller queues the event and returns).
        """
        self._observers.append(observer)
        for name, objects in self._objects.items():
            objects.on_evict = lambda key, name=name: self._emit("evict", name, key)

    def _emit(self, kind: Literal["admit", "evict", "remove"], tier: str, key: str) -> None:
        if not self._observers:
            return
        event = TierEvent(kind, tier, key)
        for observer in list(self._observers):
            try:
                observer(event)
            except Exception:  # an observer never breaks the data path
                log.debug("flowkv: tier event observer failed", exc_info=True)

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
        if self._pin_timer is not None:
            self._pin_timer.stop()
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


def _expire_pins_until_stopped(manager_ref: weakref.ref[StorageManager], ticker: Ticker) -> None:
    """The pin timer's thread: holds its manager only while a tick runs, so the manager can go."""
    try:
        while ticker.wait():
            manager = manager_ref()
            if manager is None:
                return
            try:
                manager.expire_pins()
            except Exception:  # a timer never dies of one bad tick
                log.warning("flowkv: expiring pins failed", exc_info=True)
            del manager
    finally:
        ticker.stop()


def _for_tenant(tier: Any, tenant: str) -> dict[str, str]:
    """``tenant=`` for a tier whose calls take it (``tenants = True``); nothing for one that predates tenants."""
    return {"tenant": tenant} if getattr(tier, "tenants", False) else {}


def _found_in(name: str, objects: ObjectTier, entry: Entry) -> Found | None:
    [obj] = objects.get_many([(entry.key, entry.shape, entry.dtype)], **_for_tenant(objects, entry.tenant))
    return None if obj is None else _as_found(name, obj)


def _as_found(name: str, obj: TierObject) -> Found:
    if "codec" in obj.meta:
        return Found(tier=name, obj=obj, payload=obj.view_bytes()[: obj.meta["encoded_len"]])
    return Found(tier=name, obj=obj, kv=obj.tensor)
