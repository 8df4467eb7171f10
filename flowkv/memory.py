"""The memory tier: a slab arena, reference-counted `MemoryObj`s, and an LRU `MemoryTier`.

::

    MemoryArena.buffer (one uint8 tensor, pinned on CUDA machines when asked)
    +-----------+-----------+-----------+-----------+-----------+
    |  slab 0   |  slab 1   |  slab 2   |  slab 3   |   ...     |   slab_bytes each
    +-----------+-----------+-----------+-----------+-----------+
      MemoryObj   free        MemoryObj   free
      (a view of the requested shape/dtype at the start of its slab)

Every object takes exactly one slab, full chunk or partial, raw KV or an
encoded payload: allocation is a pop from a free list, never fragments, and
its worst case is bounded (a partial chunk wastes the rest of its slab).

Ownership: `allocate` returns an object with ``ref_count == 1`` held by the
caller. The tier takes its own reference on `MemoryTier.put`; `MemoryTier.get`
takes one for the caller. The slab returns to the arena when the count
reaches 0. Pins (per lookup owner, with a deadline) keep an entry from being
evicted between lookup and retrieve; they hold no reference.

Example::

    >>> import torch
    >>> tier = MemoryTier(MemoryArena(parse_size("1MiB"), slab_bytes=64 * 1024))
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
from typing import Any

import attrs
import torch

from flowkv.sizes import parse_size

__all__ = [
    "MemoryArena",
    "MemoryObj",
    "MemoryTier",
    "MemoryTierStats",
    "parse_size",
]


# --------------------------------------------------------------------------
# Arena and objects
# --------------------------------------------------------------------------

# Slab starts are aligned so that a view of any dtype (up to complex128) is
# legal and starts on a cache line.
_SLAB_ALIGN = 64


class MemoryObj:
    """One object in a `MemoryArena` slab: a tensor view plus reference and pin counts.

    ``ref_count`` starts at 1, owned by whoever allocated it; the slab goes
    back to the arena when `ref_down` brings it to 0, after which `tensor`
    raises. ``meta`` holds facts about the content, e.g. ``{"codec": "lz4",
    "encoded_len": 12345}`` when the slab holds an encoded payload.
    """

    __slots__ = ("_arena", "_slab", "_tensor", "nbytes", "ref_count", "pin_count", "meta")

    def __init__(self, arena: MemoryArena, slab: int, tensor: torch.Tensor, nbytes: int) -> None:
        self._arena = arena
        self._slab = slab
        self._tensor: torch.Tensor | None = tensor
        #: bytes the object uses in its slab
        self.nbytes = nbytes
        #: holders of a reference (allocator's caller, the tier, readers)
        self.ref_count = 1
        #: holders of a pin (lookup owners in the tier)
        self.pin_count = 0
        #: content facts: codec, encoded length, ...
        self.meta: dict[str, Any] = {}

    @property
    def arena(self) -> MemoryArena:
        """The arena that owns this object's slab."""
        return self._arena

    @property
    def freed(self) -> bool:
        """True once the slab went back to the arena."""
        return self._tensor is None

    @property
    def tensor(self) -> torch.Tensor:
        """The view of the requested shape and dtype onto the slab."""
        tensor = self._tensor
        if tensor is None:
            raise RuntimeError("MemoryObj used after its last reference was dropped")
        return tensor

    def view_bytes(self) -> memoryview:
        """A writable ``memoryview`` of the object's bytes (CPU arenas only).

        For an object from `MemoryArena.allocate_bytes` this is exactly the
        payload; write into it with ``obj.view_bytes()[:] = payload``.
        """
        tensor = self.tensor
        if tensor.device.type != "cpu":
            raise RuntimeError(f"view_bytes needs a CPU arena, this one is on {tensor.device}")
        return memoryview(tensor.view(torch.uint8).reshape(-1).numpy()).cast("B")

    def ref_up(self) -> None:
        """Take one more reference."""
        with self._arena._lock:
            if self._tensor is None:
                raise RuntimeError("ref_up on a MemoryObj that was already freed")
            self.ref_count += 1

    def ref_down(self) -> None:
        """Drop one reference; the last one frees the slab."""
        with self._arena._lock:
            if self.ref_count <= 0:
                raise RuntimeError("ref_down on a MemoryObj with no references left")
            self.ref_count -= 1
            if self.ref_count == 0:
                self._tensor = None
                self._arena._release(self._slab)

    def pin(self) -> None:
        """Count one more pin (the tier pins on behalf of lookup owners)."""
        with self._arena._lock:
            self.pin_count += 1

    def unpin(self) -> None:
        """Drop one pin."""
        with self._arena._lock:
            if self.pin_count <= 0:
                raise RuntimeError("unpin on a MemoryObj that is not pinned")
            self.pin_count -= 1

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"refs={self.ref_count} pins={self.pin_count}"
        return f"<MemoryObj slab={self._slab} nbytes={self.nbytes} {state} meta={self.meta}>"


class MemoryArena:
    """A pre-allocated buffer carved into fixed-size slabs, one per `MemoryObj`.

    ``slab_bytes`` is rounded up to a multiple of 64. ``pin_memory`` pins
    the buffer when CUDA is available (``pinned`` says whether it is).
    Allocation never waits: a full arena answers ``None``.
    """

    def __init__(self, capacity_bytes: int | str, *, slab_bytes: int | str,
                 pin_memory: bool = False, device: str | torch.device = "cpu") -> None:
        capacity = parse_size(capacity_bytes)
        slab = parse_size(slab_bytes)
        if slab <= 0:
            raise ValueError(f"slab_bytes must be positive, got {slab_bytes!r}")
        slab = -(-slab // _SLAB_ALIGN) * _SLAB_ALIGN
        num_slabs = capacity // slab
        if num_slabs == 0:
            raise ValueError(f"capacity {capacity} B holds no slab of {slab} B")
        self.device = torch.device(device)
        #: whether the buffer is page-locked (fast, async host<->GPU copies)
        self.pinned = bool(pin_memory and self.device.type == "cpu" and torch.cuda.is_available())
        #: size of every slab in bytes
        self.slab_bytes = slab
        #: number of slabs
        self.num_slabs = num_slabs
        #: the one backing buffer
        self.buffer = torch.empty(num_slabs * slab, dtype=torch.uint8, device=self.device,
                                  pin_memory=self.pinned)
        # LIFO free list: a slab freed a moment ago is likely still in cache.
        self._free_slabs = list(range(num_slabs - 1, -1, -1))
        # Guards the free list and every object's counts; never held across a copy.
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        """Bytes the arena can hand out (all slabs)."""
        return self.num_slabs * self.slab_bytes

    @property
    def free_slabs(self) -> int:
        """Slabs not in use."""
        return len(self._free_slabs)

    @property
    def used_bytes(self) -> int:
        """Bytes of slabs in use (whole slabs, however little of each is filled)."""
        return (self.num_slabs - len(self._free_slabs)) * self.slab_bytes

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> MemoryObj | None:
        """An object whose `MemoryObj.tensor` has ``shape`` and ``dtype``, or ``None`` when full.

        Raises `ValueError` when the object could never fit a slab: that is a
        configuration error, not memory pressure.
        """
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        slab = self._take_slab(nbytes)
        if slab is None:
            return None
        start = slab * self.slab_bytes
        tensor = self.buffer[start:start + nbytes].view(dtype).view(shape)
        return MemoryObj(self, slab, tensor, nbytes)

    def allocate_bytes(self, nbytes: int) -> MemoryObj | None:
        """An object for an encoded payload of ``nbytes`` bytes, or ``None`` when full.

        ``meta["encoded_len"]`` is set to ``nbytes``; fill it through
        `MemoryObj.view_bytes`.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        obj = self.allocate((nbytes,), torch.uint8)
        if obj is not None:
            obj.meta["encoded_len"] = nbytes
        return obj

    def _take_slab(self, nbytes: int) -> int | None:
        if nbytes > self.slab_bytes:
            raise ValueError(f"object of {nbytes} B does not fit a slab of {self.slab_bytes} B; "
                             "raise slab_bytes to at least one full chunk")
        with self._lock:
            return self._free_slabs.pop() if self._free_slabs else None

    def _release(self, slab: int) -> None:
        # Called with self._lock held, by MemoryObj.ref_down.
        self._free_slabs.append(slab)

    def __repr__(self) -> str:
        return (f"<MemoryArena {self.num_slabs} x {self.slab_bytes} B on {self.device}"
                f"{' pinned' if self.pinned else ''}, {self.free_slabs} free>")


# --------------------------------------------------------------------------
# The tier
# --------------------------------------------------------------------------


@attrs.frozen
class MemoryTierStats:
    """A snapshot of a `MemoryTier`'s counters."""

    #: entries held
    entries: int
    #: bytes of slabs in use in the arena (tier entries and objects still being filled)
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


class MemoryTier:
    """Keys (`flowkv.keys.CacheKey.to_str` strings) to `MemoryObj`s, in LRU order.

    Eviction takes the least recently used entry that is neither pinned nor
    referenced by anyone but the tier. Thread-safe: one lock, held only for
    bookkeeping, never across a tensor copy.
    """

    name = "memory"

    def __init__(self, arena: MemoryArena) -> None:
        self.arena = arena
        # Oldest first; a hit moves an entry to the end.
        self._entries: OrderedDict[str, MemoryObj] = OrderedDict()
        # key -> {owner_id: deadline (monotonic seconds)}
        self._pins: dict[str, dict[Any, float]] = {}
        # owner_id -> keys it pinned, so release_owner does not scan every pin
        self._owner_keys: dict[Any, set[str]] = {}
        # Lock order: tier lock, then arena lock (inside MemoryObj methods); never reversed.
        self._lock = threading.Lock()
        self._evictions = 0
        self._allocation_failures = 0
        self._hits = 0
        self._misses = 0

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

    def get(self, key: str) -> MemoryObj | None:
        """The object under ``key`` with a reference taken for the caller (who must
        `MemoryObj.ref_down` it), or ``None``. Marks the entry most recently used."""
        with self._lock:
            obj = self._entries.get(key)
            if obj is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            obj.ref_up()
            return obj

    # -- writes ----------------------------------------------------------

    def put(self, key: str, obj: MemoryObj) -> bool:
        """Hold ``obj`` under ``key``, taking the tier's own reference.

        Returns False (and takes nothing) when ``key`` is already held. The
        caller keeps its own reference and drops it when done.
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        if obj.arena is not self.arena:
            raise ValueError("MemoryObj belongs to another arena; allocate it from this tier")
        with self._lock:
            if key in self._entries:
                return False
            obj.ref_up()
            self._entries[key] = obj
            return True

    def remove(self, key: str) -> bool:
        """Drop ``key`` and any pins on it; False when it is not held.

        Readers that hold a reference keep a valid object until they drop it.
        """
        with self._lock:
            obj = self._entries.pop(key, None)
            if obj is None:
                return False
            self._drop_pins_locked(key, obj)
            obj.ref_down()
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

    def expire_pins(self, now: float | None = None) -> int:
        """Release pins whose deadline has passed; returns how many.

        ``now`` is a `time.monotonic` reading (default: now).
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [(key, owner) for key, owners in self._pins.items()
                       for owner, deadline in owners.items() if deadline <= now]
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

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> MemoryObj | None:
        """Allocate from the arena, evicting LRU entries if needed; ``None`` when
        nothing evictable is left (every entry pinned or in use by a reader)."""
        return self._allocate_evicting(lambda: self.arena.allocate(shape, dtype))

    def allocate_bytes(self, nbytes: int) -> MemoryObj | None:
        """`MemoryArena.allocate_bytes`, evicting like `allocate`."""
        return self._allocate_evicting(lambda: self.arena.allocate_bytes(nbytes))

    def _allocate_evicting(self, allocate) -> MemoryObj | None:
        obj = allocate()
        if obj is not None:
            return obj
        with self._lock:
            while True:
                # Another thread may have freed a slab since the first try.
                obj = allocate()
                if obj is not None:
                    return obj
                if not self._evict_one_locked():
                    self._allocation_failures += 1
                    return None

    def _evict_one_locked(self) -> bool:
        victim = None
        for key, obj in self._entries.items():
            # ref_count == 1 means the tier's is the only reference. It cannot
            # rise under our feet: new references come from get() (which needs
            # this lock) or from a holder, and a holder would make it >= 2.
            if obj.pin_count == 0 and obj.ref_count == 1:
                victim = key
                break
        if victim is None:
            return False
        self._entries.pop(victim).ref_down()
        self._evictions += 1
        return True

    # -- counters --------------------------------------------------------

    def stats(self) -> MemoryTierStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return MemoryTierStats(
                entries=len(self._entries),
                used_bytes=self.arena.used_bytes,
                capacity_bytes=self.arena.capacity_bytes,
                evictions=self._evictions,
                allocation_failures=self._allocation_failures,
                pinned_objects=len(self._pins),
                hits=self._hits,
                misses=self._misses,
            )

    def clear(self) -> None:
        """Drop every entry and pin (readers keep their references)."""
        with self._lock:
            for key, obj in list(self._entries.items()):
                self._drop_pins_locked(key, obj)
                obj.ref_down()
            self._entries.clear()
