"""The memory tier: chunks in one pre-allocated host arena, least recently used evicted first.

An object tier (:class:`flowkv.tiers.ObjectTier`) built like every tier, from
its ``[tiers.NAME]`` table::

    [tiers.memory]
    kind = "memory"
    capacity = "4GiB"      # the arena; each entry costs its bytes in 4 KiB pages
    pin_memory = true      # page-locked when CUDA is present (fast async copies)
    prefault = "background"  # make the arena's pages resident early: background|now|off
    quotas = { default = "1GiB", acme = "8GiB" }   # per tenant (flowkv.tenants); default: unnamed ones
    prefault_window = "256MiB"  # background: bytes kept resident ahead of where stores write

``open(slab_bytes=...)`` allocates the arena (`flowkv.memory.MemoryArena`)
once the storage manager knows the largest object (one raw chunk and a
margin). Entries are `flowkv.memory.MemoryObj` s: reference counted views
onto the arena's pages. Ownership: `allocate` returns an object with
``ref_count == 1`` held by the caller; the tier takes its own reference on
`MemoryTier.put`; `MemoryTier.get` takes one for the caller. The pages return
to the arena when the count reaches 0. Pins (per lookup owner, with a
deadline) keep an entry from being evicted between lookup and retrieve; they
hold no reference.

Example::

    >>> import torch
    >>> tier = MemoryTier(name="memory", config=MemoryTierConfig(capacity=1 << 20, pin_memory=False))
    >>> tier.open(slab_bytes=64 * 1024)
    >>> obj = tier.allocate((4, 256), torch.float16)
    >>> tier.put("model/1.0/float16/l/notags/00ff", obj)
    True
    >>> obj.ref_down()                   # the tier keeps its own reference
    >>> hit = tier.get("model/1.0/float16/l/notags/00ff")
    >>> hit.tensor.shape
    torch.Size([4, 256])
    >>> hit.ref_down()
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Any, Literal

import attrs
import torch

from flowkv.memory import MemoryArena, MemoryObj
from flowkv.resident import DEFAULT_WINDOW_BYTES
from flowkv.registry import tier
from flowkv.tenants import DEFAULT_TENANT, DEFAULT_TENANT_LABELS, TenantLedger, clean_tenant
from flowkv.tiers.base import ObjectTier

__all__ = ["MemoryTier", "MemoryTierConfig", "MemoryTierStats"]


@attrs.frozen(kw_only=True)
class MemoryTierConfig:
    """``[tiers.NAME] kind = "memory"``: a pre-allocated arena; each entry costs its bytes in 4 KiB pages."""

    capacity: int = 1 << 30  # bytes; "4GiB" in the file
    eviction: Literal["lru"] = "lru"
    # Page-lock the arena when CUDA is present, for fast asynchronous copies.
    pin_memory: bool = True
    # Make the arena's pages resident before stores write them (flowkv/resident.py):
    # "background" (a window ahead of where stores write, refilled while the engine is
    # idle), "now" (all of it, before the engine starts) or "off".
    prefault: Literal["background", "now", "off"] = "background"
    # Bytes each tenant may hold ({} = no quotas; "default" = every tenant not named): flowkv.tenants.
    quotas: dict[str, int] = attrs.field(factory=dict, hash=False)
    # Tenants with their own metric label; later ones count under "default".
    tenant_labels: int = DEFAULT_TENANT_LABELS
    # The background window, in bytes ("256MiB" in the file).
    prefault_window: int = DEFAULT_WINDOW_BYTES


@attrs.frozen
class MemoryTierStats:
    """A snapshot of a `MemoryTier`'s counters."""

    #: entries held
    entries: int
    #: bytes of pages in use in the arena (tier entries and objects still being filled)
    used_bytes: int
    #: bytes the arena can hold
    capacity_bytes: int
    #: entries evicted to make room
    evictions: int
    #: allocations that found no room even after eviction
    allocation_failures: int
    #: entries with at least one pin
    pinned_objects: int
    #: `MemoryTier.get` calls that found their key
    hits: int
    #: `MemoryTier.get` calls that did not
    misses: int
    #: per tenant label: bytes, entries, hits, misses, evictions, quota_refusals, quota (`TenantLedger.report`)
    tenants: dict[str, dict[str, int]] = attrs.field(factory=dict)


@tier("memory", config=MemoryTierConfig)
class MemoryTier(ObjectTier):
    """Keys (`flowkv.keys.CacheKey.to_str` strings) to `MemoryObj`s, in LRU order.

    Eviction takes the least recently used entry that is neither pinned nor
    referenced by anyone but the tier. Each entry belongs to a tenant (the one
    its room was allocated for): with ``quotas``, a tenant at its quota
    evicts its own least recently used entries first, and a full arena takes
    entries of tenants over their quota before anyone else's. Thread-safe:
    one lock, held only for bookkeeping, never across a tensor copy, and an
    allocation never waits (no room is an answer of None, for one tenant
    without touching another's).
    """

    tenants = True

    def __init__(self, *, name: str = "memory", config: MemoryTierConfig | None = None) -> None:
        self.name = name
        self.config = config or MemoryTierConfig()
        self._arena: MemoryArena | None = None
        # Oldest first; a hit moves an entry to the end.
        self._entries: OrderedDict[str, MemoryObj] = OrderedDict()
        # key -> {owner_id: deadline (monotonic seconds)}
        self._pins: dict[str, dict[Any, float]] = {}
        # owner_id -> keys it pinned, so release_owner does not scan every pin
        self._owner_keys: dict[Any, set[str]] = {}
        # No pin's deadline is earlier (a bound: a pin released or moved later leaves
        # it low), so expire_pins, run by every engine call, scans only when one may be due.
        self._earliest_deadline = math.inf
        # Lock order: tier lock, then arena lock (inside MemoryObj methods); never reversed.
        self._lock = threading.Lock()
        self._evictions = 0
        self._allocation_failures = 0
        self._hits = 0
        self._misses = 0
        # Per tenant: bytes and entries held (rooms being filled count too), hits, misses, evictions.
        self._ledger = TenantLedger(self.config.quotas, labels=self.config.tenant_labels)
        self._tenant: dict[str, str] = {}  # key -> its tenant
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}  # tenant -> its keys, oldest first
        # id(obj) -> (obj, tenant, bytes charged): rooms allocated and not yet put (or freed unput).
        self._filling: dict[int, tuple[MemoryObj, str, int]] = {}

    @classmethod
    def on_arena(cls, arena: MemoryArena, *, name: str = "memory", quotas: dict[str, int] | None = None,
                 tenant_labels: int = DEFAULT_TENANT_LABELS) -> MemoryTier:
        """A tier over an arena built by the caller (tests, benchmarks, the node server)."""
        tier = cls(name=name, config=MemoryTierConfig(capacity=arena.capacity_bytes, pin_memory=arena.pinned,
                                                      quotas=dict(quotas or {}), tenant_labels=tenant_labels))
        tier._arena = arena
        return tier

    def open(self, *, slab_bytes: int) -> None:
        """Allocate the arena: ``capacity`` bytes, objects of at most ``slab_bytes``."""
        if self._arena is None:
            self._arena = MemoryArena(self.config.capacity, slab_bytes=slab_bytes, pin_memory=self.config.pin_memory,
                                      prefault=self.config.prefault,
                                      prefault_window=self.config.prefault_window)

    @property
    def arena(self) -> MemoryArena:
        """The page arena every object of this tier lives in."""
        if self._arena is None:
            raise RuntimeError(f"memory tier {self.name!r} used before open()")
        return self._arena

    # -- lookups ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return self.contains(key)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is held (does not touch LRU order)."""
        with self._lock:
            return key in self._entries

    def keys(self) -> list[str]:
        """A snapshot of the keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def tenant_of(self, key: str) -> str | None:
        """The tenant ``key``'s entry belongs to, or None when it is not held."""
        with self._lock:
            return self._tenant.get(key)

    def get(self, key: str, *, tenant: str | None = None) -> MemoryObj | None:
        """The object under ``key`` with a reference taken for the caller (who must
        `MemoryObj.ref_down` it), or ``None``. Marks the entry most recently used.
        The hit or miss counts for ``tenant`` (the reader; default: the entry's own)."""
        with self._lock:
            obj = self._entries.get(key)
            if obj is None:
                self._misses += 1
                self._ledger.miss(clean_tenant(tenant))
                return None
            self._entries.move_to_end(key)
            owner = self._tenant[key]
            self._by_tenant[owner].move_to_end(key)
            self._hits += 1
            self._ledger.hit(clean_tenant(tenant) if tenant is not None else owner)
            obj.ref_up()
            return obj

    def get_many(self, wanted, *, tenant: str | None = None) -> list[MemoryObj | None]:
        """``get`` for each ``(key, shape, dtype)``, hits and misses counted for ``tenant``."""
        return [self.get(key, tenant=tenant) for key, _, _ in wanted]

    # -- writes ----------------------------------------------------------

    def put(self, key: str, obj: MemoryObj, *, tenant: str | None = None) -> bool:
        """Hold ``obj`` under ``key``, taking the tier's own reference.

        The entry belongs to the tenant its room was allocated for (else
        ``tenant``, else ``default``). Returns False (and takes nothing) when
        ``key`` is already held, or when the entry would put its tenant over
        its quota and nothing of that tenant's own can be evicted. The caller
        keeps its own reference and drops it when done.
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        if obj.arena is not self.arena:
            raise ValueError("MemoryObj belongs to another arena; allocate it from this tier")
        evicted: list[str] = []
        try:
            with self._lock:
                if key in self._entries:
                    return False
                filling = self._filling.pop(id(obj), None)
                if filling is not None:
                    _, charged_to, charged = filling
                    self._ledger.remove(charged_to, charged, entries=0)
                    tenant = charged_to
                owner = clean_tenant(tenant) if tenant is not None else DEFAULT_TENANT
                cost = obj.held_bytes  # after a codec gave pages back
                while self._ledger.over_quota(owner, cost):
                    victim = self._evict_first_locked(self._by_tenant.get(owner, ()))
                    if victim is None:
                        self._ledger.refused(owner)
                        return False
                    evicted.append(victim)
                obj.ref_up()
                self._entries[key] = obj
                self._tenant[key] = owner
                self._by_tenant.setdefault(owner, OrderedDict())[key] = None
                self._ledger.add(owner, cost)
                return True
        finally:
            self._notify_evicted(evicted)

    def remove(self, key: str) -> bool:
        """Drop ``key`` and any pins on it; False when it is not held.

        Readers that hold a reference keep a valid object until they drop it.
        """
        with self._lock:
            obj = self._entries.get(key)
            if obj is None:
                return False
            self._drop_pins_locked(key, obj)
            self._drop_entry_locked(key, evicted=False)
            return True

    # -- pins ------------------------------------------------------------

    def pin(self, key: str, owner_id: Any, *, timeout_s: float, now: float | None = None) -> bool:
        """Keep ``key`` from eviction on behalf of ``owner_id`` (a lookup) until
        `unpin`, `release_owner`, or ``timeout_s`` later (`expire_pins`).

        Pinning again by the same owner only moves the deadline. Returns False
        when ``key`` is not held. ``now`` is a `time.monotonic` reading.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        deadline = (time.monotonic() if now is None else now) + timeout_s
        with self._lock:
            obj = self._entries.get(key)
            if obj is None:
                return False
            owners = self._pins.setdefault(key, {})
            if owner_id not in owners:
                obj.pin()
                self._owner_keys.setdefault(owner_id, set()).add(key)
            owners[owner_id] = deadline
            self._earliest_deadline = min(self._earliest_deadline, deadline)
            return True

    def unpin(self, key: str, owner_id: Any) -> bool:
        """Release ``owner_id``'s pin on ``key``; False when there was none."""
        with self._lock:
            return self._unpin_locked(key, owner_id)

    def release_owner(self, owner_id: Any) -> int:
        """Release every pin ``owner_id`` holds (retrieve done, request aborted); returns how many."""
        with self._lock:
            keys = self._owner_keys.get(owner_id)
            if not keys:
                return 0
            released = 0
            for key in list(keys):
                released += self._unpin_locked(key, owner_id)
            return released

    def holds_pins(self, owner_id: Any) -> bool:
        with self._lock:
            return owner_id in self._owner_keys

    def expire_pins(self, now: float | None = None) -> int:
        """Release pins whose deadline has passed; returns how many.

        ``now`` is a `time.monotonic` reading (default: now).
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            if now < self._earliest_deadline:
                return 0
            expired = []
            earliest = math.inf
            for key, owners in self._pins.items():
                for owner, deadline in owners.items():
                    if deadline <= now:
                        expired.append((key, owner))
                    else:
                        earliest = min(earliest, deadline)
            self._earliest_deadline = earliest
            for key, owner in expired:
                self._unpin_locked(key, owner)
            return len(expired)

    def _unpin_locked(self, key: str, owner_id: Any) -> bool:
        owners = self._pins.get(key)
        if owners is None or owner_id not in owners:
            return False
        del owners[owner_id]
        if not owners:
            del self._pins[key]
        owner_keys = self._owner_keys[owner_id]
        owner_keys.discard(key)
        if not owner_keys:
            del self._owner_keys[owner_id]
        self._entries[key].unpin()
        return True

    def _drop_pins_locked(self, key: str, obj: MemoryObj) -> None:
        for owner_id in self._pins.pop(key, {}):
            owner_keys = self._owner_keys[owner_id]
            owner_keys.discard(key)
            if not owner_keys:
                del self._owner_keys[owner_id]
            obj.unpin()

    # -- allocation ------------------------------------------------------

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *,
                 tenant: str = DEFAULT_TENANT) -> MemoryObj | None:
        """Allocate from the arena for ``tenant``, evicting LRU entries if needed; ``None`` when
        nothing evictable is left (every entry pinned or in use by a reader), or when ``tenant``
        is at its quota and none of its own entries can go."""
        nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
        return self._allocate_evicting(lambda: self.arena.allocate(shape, dtype), nbytes, tenant)

    def allocate_bytes(self, nbytes: int, *, tenant: str = DEFAULT_TENANT) -> MemoryObj | None:
        """`MemoryArena.allocate_bytes`, evicting like `allocate`."""
        return self._allocate_evicting(lambda: self.arena.allocate_bytes(nbytes), nbytes, tenant)

    def allocate_many(self, shapes, dtype, *, tenant: str = DEFAULT_TENANT) -> list[MemoryObj]:
        """Rooms for ``shapes`` in order, for ``tenant``, as many as fit."""
        objects: list[MemoryObj] = []
        for shape in shapes:
            obj = self.allocate(shape, dtype, tenant=tenant)
            if obj is None:
                break
            objects.append(obj)
        return objects

    def allocate_each(self, shapes, dtype, *, tenant: str = DEFAULT_TENANT):
        """Rooms for ``shapes``, for ``tenant``, one per ``next()`` (`ObjectTier.allocate_each`)."""
        for shape in shapes:
            obj = self.allocate(shape, dtype, tenant=tenant)
            if obj is None:
                return
            yield obj

    def _allocate_evicting(self, allocate, nbytes: int, tenant: str) -> MemoryObj | None:
        tenant = clean_tenant(tenant)
        evicted: list[str] = []
        try:
            with self._lock:
                self._sweep_filling_locked()
                cost = self.arena.cost(nbytes)
                # A tenant at its quota makes room from its own entries, whatever the arena has free.
                while self._ledger.over_quota(tenant, cost):
                    victim = self._evict_first_locked(self._by_tenant.get(tenant, ()))
                    if victim is None:
                        self._allocation_failures += 1
                        self._ledger.refused(tenant)
                        return None
                    evicted.append(victim)
            obj = allocate()
            if obj is None:
                with self._lock:
                    while True:
                        # Another thread may have freed pages since the first try.
                        obj = allocate()
                        if obj is not None:
                            break
                        victim = self._evict_for_room_locked()
                        if victim is None:
                            self._allocation_failures += 1
                            return None
                        evicted.append(victim)
            with self._lock:
                self._filling[id(obj)] = (obj, tenant, obj.held_bytes)
                self._ledger.add(tenant, obj.held_bytes, entries=0)
            return obj
        finally:
            self._notify_evicted(evicted)

    def _notify_evicted(self, evicted: list[str]) -> None:
        on_evict = self.on_evict
        if evicted and on_evict is not None:  # outside the lock: an observer may call back in
            for key in evicted:
                on_evict(key)

    def _sweep_filling_locked(self) -> None:
        """Uncharge rooms whose holder dropped them without a put (a store that stopped)."""
        for ident in [i for i, (obj, _, _) in self._filling.items() if obj.freed]:
            _, tenant, charged = self._filling.pop(ident)
            self._ledger.remove(tenant, charged, entries=0)

    def _evict_for_room_locked(self) -> str | None:
        """The arena is full: entries of tenants over their quota go first, then plain LRU."""
        if self._ledger.quotas:
            # Few tenants, many entries: walk the over-quota tenants' own LRU lists, not the whole index.
            for tenant in [t for t in self._by_tenant if self._ledger.over_quota(t)]:
                victim = self._evict_first_locked(self._by_tenant[tenant])
                if victim is not None:
                    return victim
        return self._evict_first_locked(self._entries)

    def _evict_first_locked(self, keys) -> str | None:
        """Evict the first of ``keys`` (oldest first) that nobody pins or reads; its key, or None."""
        for key in keys:
            obj = self._entries[key]
            # ref_count == 1 means the tier's is the only reference. It cannot
            # rise under our feet: new references come from get() (which needs
            # this lock) or from a holder, and a holder would make it >= 2.
            if obj.pin_count == 0 and obj.ref_count == 1:
                self._drop_entry_locked(key, evicted=True)
                self._evictions += 1
                return key
        return None

    def _drop_entry_locked(self, key: str, *, evicted: bool) -> None:
        obj = self._entries.pop(key)
        owner = self._tenant.pop(key)
        keys = self._by_tenant[owner]
        del keys[key]
        if not keys:
            del self._by_tenant[owner]
        self._ledger.remove(owner, obj.held_bytes, evicted=evicted)
        obj.ref_down()

    # -- counters --------------------------------------------------------

    def stats(self) -> MemoryTierStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            self._sweep_filling_locked()  # rooms given back unfilled count no more
            return MemoryTierStats(
                entries=len(self._entries),
                used_bytes=self.arena.used_bytes,
                capacity_bytes=self.arena.capacity_bytes,
                evictions=self._evictions,
                allocation_failures=self._allocation_failures,
                pinned_objects=len(self._pins),
                hits=self._hits,
                misses=self._misses,
                tenants=self._ledger.report(),
            )

    def clear(self) -> None:
        """Drop every entry and pin (readers keep their references)."""
        with self._lock:
            for key, obj in list(self._entries.items()):
                self._drop_pins_locked(key, obj)
                obj.ref_down()
            self._entries.clear()
            self._tenant.clear()
            self._by_tenant.clear()
            self._ledger.clear_holdings()
            self._filling.clear()
