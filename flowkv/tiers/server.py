"""The ``server`` tier: a node server's shared arena, as an object tier of this process.

::

    [tiers.node]
    kind = "server"
    # socket = "/run/flowkv/node.sock" # where `flowkv server --socket ...` listens (default: the server's
    #                                  # private default, node_protocol.default_socket_path)
    timeout_s = 2.0                    # every call bounded; then misses until it is back

Before it sends anything the tier checks that the listener runs as this
user (or ``trust_group``), and it maps only an arena descriptor of that user
(:mod:`flowkv.tiers.node_protocol`); it connects with the server's operator
token when it can read it (the server's own user can), which lets it carry a
controller's ``clear`` to entries other clients wrote.

The tier maps the server's shared memory once (a memfd it gets over the socket:
:mod:`flowkv.tiers.node_protocol`)
and hands out objects whose tensors are views of the mapped pages: a store
allocates there, gathers from the paged KV straight into them and commits;
a retrieve takes read references, scatters straight from the pages and
releases them. Only control messages cross the socket, one per request and
kind (``allocate_each``, ``put_many``, ``get_many``, ``contains_many`` with
its pin, ``release_objects``), never one per token.

Faults are misses, never errors or waits: every call is bounded by
``timeout_s``; a server that is absent, hangs or died makes the tier
unhealthy, and until the back-off has passed (``backoff_max_s`` at most)
every call answers at once (no hits, no room). The next call after it
reconnects by itself; a new server (another id) has a new segment, which
the tier maps, and objects of the old connection are refused (their
handles died with it), so nothing is read through a stale mapping. What a
client held when it died, the server reclaims after its lease timeout; what
it held on a connection it lost while it lives (a call cut off by its
timeout: a gather may still be writing those pages) the server keeps from
reuse until this process exits, or until the tier gives it back: objects of
a lost connection to the same server, once released here, are released on
the next connection.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from flowkv.registry import tier
from flowkv.tenants import DEFAULT_TENANT
from flowkv.tiers import node_protocol as wire
from flowkv.tiers.base import ObjectTier

__all__ = ["RemoteObj", "ServerTier", "ServerTierConfig"]

log = logging.getLogger("flowkv.tiers")

_BACKOFF_INITIAL_S = 0.25
_MAX_GIVEN_BACK = 1 << 16  # handles one release carries (the server's bound on a request's items)


@attrs.frozen(kw_only=True)
class ServerTierConfig:
    """``[tiers.NAME] kind = "server"``: the node server's socket, and how long a call may take."""

    # the server's Unix socket (`flowkv server --socket PATH`); default: the private one both sides compute
    socket: str = attrs.field(factory=lambda: str(wire.default_socket_path()))
    timeout_s: float = 2.0  # every call to the server is cut off after this; then misses
    backoff_max_s: float = 5.0  # an unreachable server is tried again after at most this long
    client_id: str | None = None  # a label in the server's status (it names clients by uid, pid, connection)
    trust_group: int | None = None  # a gid whose server this client trusts too (`flowkv server --group`)

    def __attrs_post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        if self.backoff_max_s < _BACKOFF_INITIAL_S:
            raise ValueError(f"backoff_max_s must be at least {_BACKOFF_INITIAL_S}, got {self.backoff_max_s!r}")
        if not self.socket:
            raise ValueError("socket must name the server's Unix socket")


class RemoteObj:
    """A run of pages in the server's arena, viewed through this process's mapping.

    ``handle`` names the server's reference (an allocation not committed yet,
    or a read). ``ref_down`` gives it back; a committed allocation was handed
    to the server's index, and ``ref_down`` then does nothing.
    """

    __slots__ = ("_tier", "_session", "handle", "offset", "nbytes", "meta", "_tensor", "_buffer", "state")

    def __init__(self, tier: ServerTier, session: int, handle: int, offset: int, nbytes: int,
                 buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        self._tier = tier
        self._session = session
        self.handle = handle
        self.offset = offset
        #: bytes of content
        self.nbytes = nbytes
        self.meta: dict[str, Any] = {}
        self._buffer = buffer
        self._tensor: torch.Tensor | None = tensor
        #: "held" (this process holds the server's reference), "committed" or "released"
        self.state = "held"

    @property
    def tensor(self) -> torch.Tensor:
        tensor = self._tensor
        if tensor is None:
            raise RuntimeError("RemoteObj used after it was released")
        return tensor

    def view_bytes(self) -> memoryview:
        """The object's bytes in the mapped pages (writable)."""
        self.tensor  # noqa: B018 - raises once released
        return memoryview(self._buffer[self.offset:self.offset + self.nbytes].numpy()).cast("B")

    def shrink_to_bytes(self, nbytes: int) -> None:
        """Keep the first ``nbytes`` bytes (an encoding written over the raw KV); the server
        gives the rest of the pages back when the object is committed."""
        if not 0 <= nbytes <= self.nbytes:
            raise ValueError(f"cannot shrink an object of {self.nbytes} B to {nbytes} B")
        self.nbytes = nbytes
        self._tensor = self._buffer[self.offset:self.offset + nbytes]

    def ref_down(self) -> None:
        self._tier.release_objects([self])

    def __repr__(self) -> str:
        return f"<RemoteObj handle={self.handle} offset={self.offset} nbytes={self.nbytes} {self.state} meta={self.meta}>"


@tier("server", config=ServerTierConfig)
class ServerTier(ObjectTier):
    """Object tier backed by a node server (``flowkv server``) over its Unix socket and shared arena."""

    tenants = True  # rooms and reads name their tenant on the wire: the server keeps and counts it

    def __init__(self, *, name: str = "node", config: ServerTierConfig) -> None:
        self.name = name
        self.config = config
        self.client_id = config.client_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()  # connection state; calls are serialized by the connection
        self._conn: wire.NodeConnection | None = None
        self._segment: wire.Segment | None = None
        self._server_id: str | None = None
        self._session = 0  # bumps on every connection: handles of an older one are dead
        self._server_first_session = 0  # the first connection to the current server (its handles count)
        self._given_back: list[int] = []  # handles of lost connections to it, released by this process
        self._healthy = True
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._closed = False
        self._server_slab = 0
        self.last_error: str | None = None
        self._counters: dict[str, int] = dict.fromkeys((
            "calls", "failures", "timeouts", "skipped", "connects", "remaps", "errors",
            "lookups", "lookup_hits", "lookup_misses", "allocated", "allocation_shortfalls",
            "commits", "admitted", "not_admitted", "stale_objects", "reads", "read_hits", "read_misses",
            "releases", "shape_mismatches", "bad_entries",
        ), 0)

    # -- connection ------------------------------------------------------------

    def open(self, *, slab_bytes: int) -> None:
        """Connect now if the server is there; if not, the tier answers misses until it is."""
        self.slab_bytes = slab_bytes
        with self._lock:
            self._connection()

    def _connection(self) -> wire.NodeConnection | None:
        """The live connection, connecting (and mapping) when the back-off allows; None while down."""
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._closed or time.monotonic() < self._retry_at:
            return None
        try:
            conn = wire.NodeConnection.connect(self.config.socket, timeout_s=self.config.timeout_s,
                                               group=self.config.trust_group)
            reply = conn.hello(self.client_id, operator_token=wire.read_operator_token(self.config.socket), map=True)
            fd = conn.take_segment_fd()
            new_server = reply["server"] != self._server_id or self._segment is None
            if not new_server:
                os.close(fd)  # the same server: its arena is mapped already
            else:
                owner = conn.peer.uid if conn.peer is not None else None
                segment = wire.map_segment(fd, int(reply["segment_bytes"]), owner=owner)
                if self._segment is not None:
                    self._counters["remaps"] += 1
                    log.warning("flowkv: node server %s restarted (now %s); mapped its new arena",
                                self._server_id, reply["server"])
                    self._segment.close()
                self._segment, self._server_id = segment, reply["server"]
            self._server_slab = int(reply.get("slab_bytes", 0))
        except (wire.NodeUnavailable, wire.NodeError, OSError, KeyError, ValueError) as exc:
            if conn is not None:
                conn.close()  # and any descriptor that came with it
            self._failed(f"connect: {exc}")
            return None
        self._conn = conn
        self._session += 1
        if new_server:  # a lost connection's handles died with the old server
            self._server_first_session, self._given_back = self._session, []
        self._counters["connects"] += 1
        if not self._healthy:
            log.warning("flowkv: node server on %s reachable again", self.config.socket)
        self._healthy, self._backoff_s = True, 0.0
        if self._given_back:
            self._give_back(conn, [])
        return self._conn

    def _failed(self, why: str) -> None:
        self._counters["failures"] += 1
        if "timed out" in why or "timeout" in why:
            self._counters["timeouts"] += 1
        self.last_error = why
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._backoff_s = _BACKOFF_INITIAL_S if self._healthy else min(self._backoff_s * 2, self.config.backoff_max_s)
        self._retry_at = time.monotonic() + self._backoff_s
        if self._healthy:
            log.warning("flowkv: node server on %s unavailable (%s); misses for %.2g s", self.config.socket, why,
                        self._backoff_s)
        self._healthy = False

    def _call(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """A request's reply, or None (down, timed out, refused): the caller answers a miss."""
        with self._lock:
            conn = self._connection()
            if conn is None:
                self._counters["skipped"] += 1
                return None
            self._counters["calls"] += 1
            carrier = _trace_context()
            if carrier:
                fields["trace"] = carrier
            try:
                reply = conn.call(op, **fields)
                # The handles and offsets in the reply belong to this connection and its segment.
                reply["_session"], reply["_segment"] = self._session, self._segment
                return reply
            except wire.NodeUnavailable as exc:
                self._failed(str(exc))
            except wire.NodeError as exc:
                self._counters["errors"] += 1
                self.last_error = str(exc)
                log.warning("flowkv: node server refused %s: %s", op, exc)
            return None

    def _send(self, op: str, **fields: Any) -> bool:
        with self._lock:
            conn = self._connection()
            if conn is None:
                self._counters["skipped"] += 1
                return False
            try:
                conn.send(op, **fields)
                return True
            except wire.NodeUnavailable as exc:
                self._failed(str(exc))
                return False

    def health(self) -> str:
        return "healthy" if self._healthy else "unhealthy"

    def server_stats(self) -> dict[str, Any] | None:
        """The server's own status (``flowkv server status``), or None when it cannot be reached."""
        return self._call("stats")

    # -- lookups and pins ------------------------------------------------------

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[str], *, pin_owner: Any = None, pin_timeout_s: float = 30.0,
                      pin_now: float | None = None) -> list[bool]:
        """Held per key, in one round trip; with ``pin_owner`` the server pins the leading run it holds."""
        if not keys:
            return []
        fields: dict[str, Any] = {"keys": list(keys)}
        if pin_owner is not None:
            fields.update(pin=str(pin_owner), pin_s=pin_timeout_s)
        reply = self._call("lookup", **fields)
        held = [bool(h) for h in reply["held"]] if reply is not None else [False] * len(keys)
        self._counters["lookups"] += 1
        hits = sum(held)
        self._counters["lookup_hits"] += hits
        self._counters["lookup_misses"] += len(keys) - hits
        return held

    def pin(self, key: str, owner_id: Any, *, timeout_s: float, now: float | None = None) -> bool:
        return self.pin_many([key], owner_id, timeout_s=timeout_s)[0]

    def pin_many(self, keys: Sequence[str], owner_id: Any, *, timeout_s: float,
                 now: float | None = None) -> list[bool]:
        """Pins for ``timeout_s`` of the server's own clock (``now``, the caller's, does not apply)."""
        if not keys:
            return []
        reply = self._call("pin", keys=list(keys), owner=str(owner_id), pin_s=timeout_s)
        return [bool(h) for h in reply["held"]] if reply is not None else [False] * len(keys)

    def unpin_many(self, keys: Sequence[str], owner_id: Any) -> int:
        if keys:
            self._send("unpin", keys=list(keys), owner=str(owner_id))
        return len(keys)

    def release_owner(self, owner_id: Any) -> int:
        """Drop ``owner_id``'s pins (one-way: the count is the server's to know)."""
        self._send("release_owner", owner=str(owner_id))
        return 0

    def expire_pins(self, now: float | None = None) -> int:
        return 0  # the server expires its pins itself

    # -- allocation and commit -------------------------------------------------

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *,
                 tenant: str = DEFAULT_TENANT) -> RemoteObj | None:
        objs = self.allocate_many([shape], dtype, tenant=tenant)
        return objs[0] if objs else None

    def allocate_bytes(self, nbytes: int, *, tenant: str = DEFAULT_TENANT) -> RemoteObj | None:
        obj = self.allocate((nbytes,), torch.uint8, tenant=tenant)
        if obj is not None:
            obj.meta["encoded_len"] = nbytes
        return obj

    def allocate_many(self, shapes: Sequence[tuple[int, ...] | torch.Size], dtype: torch.dtype, *,
                      tenant: str = DEFAULT_TENANT) -> list[RemoteObj]:
        """Room for each shape in the server's arena, in order, as many as fit (one round trip);
        the rooms are ``tenant``'s (the server's quota for it bounds them)."""
        if not shapes:
            return []
        sizes = [math.prod(int(d) for d in shape) * dtype.itemsize for shape in shapes]
        if self._server_slab and max(sizes) > self._server_slab:
            raise ValueError(f"object of {max(sizes)} B does not fit the node server's largest object "
                             f"({self._server_slab} B); start it with a larger --slab")
        reply = self._call("alloc", sizes=sizes, tenant=tenant)
        if reply is None:
            return []
        session, segment = reply["_session"], reply["_segment"]
        objs = []
        for (handle, offset), shape, nbytes in zip(reply["objs"], shapes, sizes):
            tensor = wire.view(segment.buffer, int(offset), shape, dtype)
            objs.append(RemoteObj(self, session, int(handle), int(offset), nbytes, segment.buffer, tensor))
        self._counters["allocated"] += len(objs)
        if len(objs) < len(shapes):
            self._counters["allocation_shortfalls"] += 1
        return objs

    def allocate_each(self, shapes: Sequence[tuple[int, ...] | torch.Size], dtype: torch.dtype, *,
                      tenant: str = DEFAULT_TENANT) -> Iterator[RemoteObj]:
        """All the rooms at the first pull (one round trip); rooms never pulled go back."""
        objs = self.allocate_many(shapes, dtype, tenant=tenant)
        given = 0
        try:
            for obj in objs:
                given += 1
                yield obj
        finally:
            if given < len(objs):
                self.release_objects(objs[given:])

    def put(self, key: str, obj: RemoteObj) -> bool:  # type: ignore[override]
        return self.put_many([(key, obj)])[0]

    def put_many(self, entries: Sequence[tuple[str, RemoteObj]]) -> list[bool]:  # type: ignore[override]
        """Commit filled objects under their keys, in one round trip; False where a key was held.

        The server takes each allocation into its index (or frees it, when the
        key was held): the objects are spent either way.
        """
        answers = [False] * len(entries)
        items, where = [], []
        for index, (key, obj) in enumerate(entries):
            if not self._current(obj) or obj.state != "held":
                continue
            items.append([obj.handle, key, obj.nbytes, _meta_of(obj)])
            where.append(index)
        if not items:
            return answers
        reply = self._call("commit", items=items)
        for index in where:
            entries[index][1].state = "committed"  # the server took it, or it died with the connection
        if reply is None:
            return answers
        for index, ok in zip(where, reply["admitted"]):
            answers[index] = bool(ok)
        admitted = sum(answers)
        self._counters["commits"] += 1
        self._counters["admitted"] += admitted
        self._counters["not_admitted"] += len(items) - admitted
        return answers

    def _current(self, obj: Any) -> bool:
        if isinstance(obj, RemoteObj) and obj._tier is self and obj._session == self._session:
            return True
        self._counters["stale_objects"] += 1
        return False

    # -- reads -----------------------------------------------------------------

    def get(self, key: str) -> RemoteObj | None:
        return self.get_many([(key, None, None)])[0]

    def get_many(self, wanted: Sequence[tuple[str, Any, Any]], *,
                 tenant: str | None = None) -> list[RemoteObj | None]:
        """Read references to each key's pages, in one round trip; None where the server has none.

        A raw entry is viewed with the shape, dtype and byte order it was
        committed with; one whose shape is not the ``shape`` asked for is a
        miss (a key names its geometry, so this is a defect, counted).
        """
        if not wanted:
            return []
        fields = {"tenant": tenant} if tenant is not None else {}  # whose hits and misses these are
        reply = self._call("get", keys=[key for key, _, _ in wanted], **fields)
        if reply is None:
            self._counters["read_misses"] += len(wanted)
            return [None] * len(wanted)
        session, segment = reply["_session"], reply["_segment"]
        out: list[RemoteObj | None] = []
        mismatched: list[RemoteObj] = []
        unusable: list[RemoteObj] = []
        for (key, shape, dtype), found in zip(wanted, reply["objs"]):
            if found is None:
                out.append(None)
                continue
            handle, offset, nbytes, meta = int(found[0]), int(found[1]), int(found[2]), found[3]
            try:
                tensor = _reply_view(segment.buffer, offset, nbytes, meta)
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                # An entry whose description makes no view (another client's bad commit): a miss, and
                # the read reference goes back now rather than when this connection ends.
                self._counters["bad_entries"] += 1
                log.warning("flowkv: node server entry %.80s has no usable layout (%s); a miss", key, exc)
                unusable.append(RemoteObj(self, session, handle, offset, 0, segment.buffer, segment.buffer[:0]))
                out.append(None)
                continue
            obj = RemoteObj(self, session, handle, offset, nbytes, segment.buffer, tensor)
            if "codec" in meta:
                obj.meta.update(codec=meta["codec"], encoded_len=int(meta["encoded_len"]))
            elif shape is not None and (tuple(tensor.shape) != tuple(int(d) for d in shape) or tensor.dtype != dtype):
                mismatched.append(obj)
                out.append(None)
                continue
            out.append(obj)
        self._counters["shape_mismatches"] += len(mismatched)
        if mismatched or unusable:
            self.release_objects(mismatched + unusable)
        hits = sum(o is not None for o in out)
        self._counters["reads"] += 1
        self._counters["read_hits"] += hits
        self._counters["read_misses"] += len(out) - hits
        return out

    def release_objects(self, objects: Sequence[Any]) -> None:
        """Give the server's references back: one one-way message for all of them."""
        handles = []
        for obj in objects:
            if obj.state != "held":
                continue
            obj.state = "released"
            obj._tensor = None
            if obj._session >= self._server_first_session:
                # This process's: of this connection, or of one it lost to the same server (which keeps
                # such rooms from reuse while this process lives, until they are given back).
                handles.append(obj.handle)
        if not handles:
            return
        self._counters["releases"] += len(handles)
        with self._lock:
            conn = self._connection()
            if conn is None:
                self._keep_for_later(handles)
            else:
                self._give_back(conn, handles)

    def _give_back(self, conn: wire.NodeConnection, handles: list[int]) -> None:
        """Release ``handles`` and those kept from a lost connection (one one-way message)."""
        handles, self._given_back = self._given_back + handles, []
        try:
            conn.send("release", handles=handles)
        except wire.NodeUnavailable as exc:
            self._failed(str(exc))
            self._keep_for_later(handles)

    def _keep_for_later(self, handles: list[int]) -> None:
        # Bounded by what one release may carry; any dropped stay the server's until this process exits.
        self._given_back = (self._given_back + handles)[-_MAX_GIVEN_BACK:]

    def remove(self, key: str) -> bool:
        reply = self._call("remove", keys=[key])
        return bool(reply and reply["removed"][0])

    def clear(self) -> None:
        """Nothing: a node server's entries belong to every client on the node, not to this one."""

    def close(self) -> None:
        """Disconnect (the server's entries stay; what this client held is released with it)."""
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._segment is not None:
                self._segment.close()
                self._segment = None

    def stats(self) -> dict[str, Any]:
        """This client's counters (no round trip: vLLM asks for them every step)."""
        return {**self._counters, "healthy": int(self._healthy), "backoff_s": self._backoff_s,
                "session": self._session}


def _reply_view(buffer: torch.Tensor, offset: int, nbytes: int, meta: dict[str, Any]) -> torch.Tensor:
    """The tensor a ``get`` reply describes, inside the mapped segment (``ValueError`` when it is not)."""
    if not 0 <= offset <= offset + nbytes <= buffer.numel():
        raise ValueError(f"{nbytes} B at offset {offset} lie outside the segment")
    if "codec" in meta:
        return buffer[offset:offset + nbytes]
    if not all(isinstance(d, int) and d > 0 for d in meta["shape"]):
        raise ValueError(f"shape {meta['shape']!r:.80} has a dim below 1")
    return wire.view(buffer, offset, meta["shape"], wire.dtype_from_name(meta["dtype"]), meta.get("order"))


def _meta_of(obj: RemoteObj) -> dict[str, Any]:
    """What the server indexes with a committed object: its encoding, or its raw layout."""
    if "codec" in obj.meta:
        return {"codec": obj.meta["codec"], "encoded_len": int(obj.meta["encoded_len"])}
    tensor = obj.tensor
    return {"shape": list(tensor.shape), "dtype": wire.dtype_name(tensor.dtype), "order": wire.dense_order(tensor)}


def _trace_context() -> dict[str, str]:
    """The current span's W3C trace context, when a span is recording (a few microseconds)."""
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.get_span_context().is_valid:
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier
