"""The tier contract: what a storage tier implements, memory and yours alike.

A tier kind is a class registered with ``@flowkv.tier(KIND, config=ConfigCls)``
and built from its ``[tiers.NAME]`` table as ``Cls(name=NAME, config=cfg)``
by the storage manager (:mod:`flowkv.tiers.manager`), the one place that knows
the tiers' order. Keys are printable strings (``CacheKey.to_str()``, e.g.
``"model/1.0/bfloat16/fp/tags/3f9a..."``), opaque to a tier: they may contain
``/`` and any other printable character, so a tier maps them to its own names
(file names, namespaced Redis keys) safely. A tier is one of two sorts:

- a **byte tier** (:class:`Tier`; disk, Redis, a user's S3 or SQLite tier)
  stores encoded payloads (bytes with the :mod:`flowkv.payload` header). Its
  methods are ``async`` and run on the engine's anyio portal thread
  (:mod:`flowkv.tiers.portal`), each wrapped in a health guard
  (:class:`flowkv.tiers.GuardedTier`) and written behind a bounded queue, so
  a slow or failing tier never stalls inference. Blocking work (file I/O,
  checksums of large payloads) goes to ``anyio.to_thread.run_sync``.
- an **object tier** (:class:`ObjectTier`; ``memory``, and ``server``, a node
  server's shared arena) holds host-memory objects that the kernels gather into
  and scatter from directly. Its methods are synchronous and quick (no I/O
  wait; a remote one bounded by its timeout): store stages allocate there,
  fill the object, and commit it. Batches (``contains_many``, ``allocate_each``,
  ``put_many``, ``get_many``, ``release_objects``) make one call per request.

A user's own byte tier::

    import attrs
    import flowkv
    from flowkv.tiers import Tier

    @attrs.frozen(kw_only=True)
    class S3TierConfig:
        bucket: str

    @flowkv.tier("s3", config=S3TierConfig)
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
    timeout_s = 2.0              # the guard's keys, taken by every byte tier
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

import attrs
import torch

from flowkv import payload
from flowkv.tenants import DEFAULT_TENANT

__all__ = ["Entry", "Found", "ObjectTier", "Tier", "TierEvent", "TierEvents", "TierObject", "for_tenant", "verify_payload"]

log = logging.getLogger("flowkv.tiers")


class Tier(abc.ABC):
    """A byte tier: a storage tier for encoded chunk payloads.

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

    #: What the tier holds: encoded payloads (the storage manager guards it and writes behind).
    holds: ClassVar[Literal["bytes", "objects"]] = "bytes"
    #: Whether ``put`` takes ``(key, payload, tenant)`` entries (flowkv.tenants; else ``(key, payload)``).
    tenants: ClassVar[bool] = False
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


class TierObject(Protocol):
    """One object an :class:`ObjectTier` hands out: host memory a kernel reads or writes.

    ``flowkv.memory.MemoryObj`` is one. Reference counted: whoever got it from
    ``allocate``/``allocate_bytes``/``get`` holds one reference and drops it
    with ``ref_down``.
    """

    #: bytes of content
    nbytes: int
    #: content facts: ``{"codec": ..., "encoded_len": ...}`` for an encoded payload
    meta: dict[str, Any]

    @property
    def tensor(self) -> torch.Tensor:
        """The view, of the shape and dtype asked for, onto the object's memory."""

    def view_bytes(self) -> memoryview:
        """A writable view of the object's bytes."""

    def shrink_to_bytes(self, nbytes: int) -> None:
        """Keep only the first ``nbytes`` bytes (the sole holder only), giving the rest back."""

    def ref_down(self) -> None:
        """Drop one reference; the last one frees the memory."""


class ObjectTier(abc.ABC):
    """An object tier: holds :class:`TierObject` s that kernels gather into and scatter from.

    Contract, for every implementation (``memory``, and ``server``: a node
    server's shared arena reached over a socket, :mod:`flowkv.tiers.server`):

    - ``open(slab_bytes=...)`` is called once, before any other method, with
      the largest object the engine will allocate (one raw chunk and a margin
      for an encoding): size or attach the backing memory there.
    - ``allocate(shape, dtype)`` / ``allocate_bytes(nbytes)`` answer a new
      object (one reference, the caller's) or ``None`` when nothing can be
      evicted to make room: never wait. An object larger than a slab is a
      configuration error (``ValueError``).
    - ``put(key, obj)`` commits a filled object under ``key``, taking the
      tier's own reference; False (nothing taken) when ``key`` is held.
    - ``get(key)`` answers the object with a reference for the caller, or
      ``None``. ``contains`` answers without touching recency or references.
    - ``pin(key, owner, timeout_s=..., now=...)`` keeps an entry from
      eviction for ``owner`` until ``release_owner(owner)`` or the deadline
      (``expire_pins(now)``; ``now`` is the storage manager's clock);
      ``remove(key)`` drops an entry and its pins.
    - ``on_evict``, when set by the storage manager, is called with each
      evicted key after the tier's own lock is released.
    - ``stats()`` is synchronous and cheap: a flat dict of numbers (or an
      attrs instance of numbers).
    """

    holds: ClassVar[Literal["bytes", "objects"]] = "objects"
    #: Whether the allocation, batch and get calls take ``tenant=`` (flowkv.tenants): the
    #: storage manager passes it only to a tier that says so.
    tenants: ClassVar[bool] = False
    #: The tier's name from the pipeline file (``[tiers.NAME]``).
    name: str
    #: Called with each key the tier evicted (set by the storage manager when observed).
    on_evict: Any = None

    @abc.abstractmethod
    def open(self, *, slab_bytes: int) -> None:
        """Size (or attach) the backing memory; called once before use."""

    @abc.abstractmethod
    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> TierObject | None:
        """A new object holding a tensor of ``shape`` and ``dtype``, or ``None`` when full."""

    @abc.abstractmethod
    def allocate_bytes(self, nbytes: int) -> TierObject | None:
        """A new object for an encoded payload of ``nbytes``, or ``None`` when full."""

    @abc.abstractmethod
    def put(self, key: str, obj: TierObject) -> bool:
        """Commit ``obj`` under ``key`` (the tier takes its own reference); False when held."""

    @abc.abstractmethod
    def get(self, key: str) -> TierObject | None:
        """The object under ``key`` with a reference for the caller, or ``None``."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``key`` is held."""

    def contains_many(self, keys: list[str], *, pin_owner: Any = None, pin_timeout_s: float = 30.0,
                      pin_now: float | None = None) -> list[bool]:
        """One bool per key; with ``pin_owner``, every key held is pinned for it too.

        A remote object tier answers (and pins) in one round trip: this is its
        lookup+pin. The storage manager unpins what lies past the prefix hit.
        """
        held = [self.contains(key) for key in keys]
        if pin_owner is not None:
            held = [h and self.pin(key, pin_owner, timeout_s=pin_timeout_s, now=pin_now) for key, h in zip(keys, held)]
        return held

    @abc.abstractmethod
    def remove(self, key: str) -> bool:
        """Drop ``key`` and its pins; False when it was not held."""

    @abc.abstractmethod
    def pin(self, key: str, owner_id: Any, *, timeout_s: float, now: float | None = None) -> bool:
        """Keep ``key`` from eviction for ``owner_id`` until ``now + timeout_s``; False when it is not held.

        ``now`` is the storage manager's clock reading (default: `time.monotonic`).
        """

    @abc.abstractmethod
    def release_owner(self, owner_id: Any) -> int:
        """Drop every pin ``owner_id`` holds; how many."""

    @abc.abstractmethod
    def expire_pins(self, now: float | None = None) -> int:
        """Drop pins whose deadline is ``now`` or earlier (default: `time.monotonic`); how many."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Drop every entry and pin (readers keep their references)."""

    # -- batches: one call per request (a remote tier answers each in one round trip) --

    def allocate_many(self, shapes: Sequence[tuple[int, ...] | torch.Size], dtype: torch.dtype) -> list[TierObject]:
        """Objects for ``shapes`` in order, as many as fit: the list stops at the first that did not."""
        objects: list[TierObject] = []
        for shape in shapes:
            obj = self.allocate(shape, dtype)
            if obj is None:
                break
            objects.append(obj)
        return objects

    def allocate_each(self, shapes: Sequence[tuple[int, ...] | torch.Size],
                      dtype: torch.dtype) -> Iterator[TierObject]:
        """Objects for ``shapes``, one per ``next()``, ending at the first that does not fit.

        An in-process tier allocates as each is pulled: a store that commits
        (and compresses) chunk i before pulling chunk i+1 leaves it the room
        the encoding gave back. A remote tier asks for all of them at the
        first pull (one round trip).
        """
        for shape in shapes:
            obj = self.allocate(shape, dtype)
            if obj is None:
                return
            yield obj

    def put_many(self, entries: Sequence[tuple[str, TierObject]]) -> list[bool]:
        """``put`` each ``(key, obj)``; one bool per entry (False: the key was held)."""
        return [self.put(key, obj) for key, obj in entries]

    def get_many(self, wanted: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> list[TierObject | None]:
        """``get`` for each ``(key, shape, dtype)`` (the raw KV's shape: a remote tier views its
        pages so); one object with a reference for the caller, or None, per key."""
        return [self.get(key) for key, _, _ in wanted]

    def release_objects(self, objects: Sequence[TierObject]) -> None:
        """Drop the caller's reference on each object (a remote tier: one message)."""
        for obj in objects:
            obj.ref_down()

    def pin_many(self, keys: Sequence[str], owner_id: Any, *, timeout_s: float,
                 now: float | None = None) -> list[bool]:
        """``pin`` each key for ``owner_id``; one bool per key."""
        return [self.pin(key, owner_id, timeout_s=timeout_s, now=now) for key in keys]

    def holds_pins(self, owner_id: Any) -> bool:
        """Whether ``owner_id`` still pins anything here (a tier that cannot tell answers True)."""
        return True

    def unpin_many(self, keys: Sequence[str], owner_id: Any) -> int:
        """Drop ``owner_id``'s pins on ``keys``; how many. (A tier without single unpins
        keeps them until ``release_owner`` or their deadline.)"""
        unpin = getattr(self, "unpin", None)
        return sum(bool(unpin(key, owner_id)) for key in keys) if unpin is not None else 0

    def health(self) -> Any:
        """``flowkv.tiers.TierHealth``: an in-process tier is always healthy; a remote one
        is unhealthy while it cannot be reached (its calls then answer misses at once)."""
        return "healthy"

    def close(self) -> None:
        """Release the tier's resources; the tier is not used after."""
        self.clear()

    def stats(self) -> Any:
        """Counters for telemetry and tests."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={getattr(self, 'name', '?')!r})"


def verify_payload(blob: bytes, key: str | None = None) -> bool:
    """Whether ``blob`` is an intact flowkv payload (header and checksum good; with ``key``, written for it).

    ``flowkv.payload.verify`` checks header, length and body checksum without
    decoding; any ``PayloadError`` it raises makes the answer False. A tier
    that passes the key it read also refuses a payload moved or planted
    under another key.
    """
    try:
        payload.verify(blob, expect_key=key)
    except payload.PayloadError:
        return False
    return True


def for_tenant(tier: Any, tenant: str) -> dict[str, str]:
    """``tenant=`` for an object tier whose calls take it (``tenants = True``); nothing for one that
    predates tenants."""
    return {"tenant": tenant} if getattr(tier, "tenants", False) else {}


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


class TierEvents:
    """The observers of tier events, and the one way events reach them."""

    def __init__(self) -> None:
        self.observers: list[Callable[[TierEvent], None]] = []

    def emit(self, kind: Literal["admit", "evict", "remove"], tier: str, key: str) -> None:
        if not self.observers:
            return
        event = TierEvent(kind, tier, key)
        for observer in list(self.observers):
            try:
                observer(event)
            except Exception:  # an observer never breaks the data path
                log.debug("flowkv: tier event observer failed", exc_info=True)
