"""The node server: one flowkv storage manager per node, shared by every vLLM on it.

::

    flowkv server --socket /run/flowkv/node.sock --memory 64GiB [--pipeline node-server-disk]

    vLLM A worker ─┐                      ┌───────────── flowkv server ──────────────┐
    vLLM B worker ─┼─ Unix socket ───────▶│ asyncio loop: sessions, leases, requests │
    flowkv status ─┘  (framed JSON)       │ StorageManager: [memory] -> disk, Redis   │
          │                               │   memory = MemoryTier over the segment    │
          └── mmap ── memfd "flowkv-node-<server id>", passed over the socket ───────┘

The arena is one anonymous shared-memory file (``memfd_create``: a
:class:`flowkv.resident.ResidentBuffer`, pre-faulted as ``--prefault`` says)
that has no name in any folder: a client gets its descriptor in the
``hello`` reply (``SCM_RIGHTS``), maps it once and moves KV in and out of
its pages itself. Nobody can plant or squat a segment, nothing is left in
``/dev/shm`` when the server is killed, and the arena is not bound by the
size of ``/dev/shm`` (a container's 64 MiB); its pages live until the last
process that maps it lets go. The loop thread owns the
sessions, handles and pins (:mod:`flowkv.server.leases`); requests that
need a lower tier (a lookup or read that reaches disk or Redis) run on a
small thread pool, so one slow disk read holds up no other client.
Committed chunks go to the lower tiers from a writer thread that runs the
server pipeline's ``[server]`` list on each (:mod:`flowkv.server.writer`:
e.g. compress, then put, written behind). SIGTERM or
SIGINT stops accepting, drains the writer and the write-behind queues,
closes the tiers and removes the socket.

Why asyncio streams and not ZeroMQ: a stream per client is what leases hang
on — the server sees each connection end the moment its process dies
(``kill -9`` included) and starts that client's lease clock; a client whose
call fails gets a clean error, drops the connection and reconnects (a
restarted server is a new connection with a new segment), where a ZeroMQ
REQ socket would wait for a reply that never comes; ``SO_PEERCRED`` names
the peer's pid; and the client side needs nothing but the standard library.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowkv.local_peers import (
    PeerCredentials,
    listener,
    peer_credentials,
    private_folder,
    process_start,
    socket_path_fits,
)
from flowkv.memory import MemoryArena
from flowkv.pipeline_model import Pipeline, TelemetrySpec
from flowkv.resident import PREFAULT_MODES, ResidentBuffer
from flowkv.tiers import node_protocol as wire
from flowkv.tiers.manager import Entry, StorageManager, TierEvent
from flowkv.tiers.memory import MemoryTier
from flowkv.server.leases import LeaseTable, Session
from flowkv.server.writer import ServerWriter
from flowkv.tenants import DEFAULT_TENANT, clean_tenant

__all__ = ["NodeServer", "ServerOptions"]

log = logging.getLogger("flowkv.server")

_MAX_KEY = 4096  # characters: keys are short printable strings
_MAX_ITEMS = 1 << 16  # keys, sizes, items or handles in one request (a 16M-token prompt in 256-token chunks)
_MAX_DIMS = 8  # dims of a chunk's shape (flowkv's have 5 or 6)
_MAX_SECONDS = 1e9  # the largest pin or wait a client may ask for before it is clamped
_EVENTS_KEPT = 65536


class RequestError(ValueError):
    """A request the server refuses (answered with ``ok: false``; the connection stays)."""


class _Counters:
    """Counters the storage manager and the request handlers add to (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = collections.defaultdict(float)

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.values[name] += n

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: (int(v) if float(v).is_integer() else v) for k, v in self.values.items()}


class ServerOptions:
    """What ``flowkv server`` was started with."""

    def __init__(self, *, socket_path: str | os.PathLike[str] | None = None, memory_bytes: int,
                 pipeline: Pipeline | None = None,
                 lease_timeout_s: float = 30.0, max_pin_s: float = 60.0, slab_bytes: int | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 workers: int = 4, name: str | None = None,
                 prefault: str = "background", group: int | None = None,
                 quarantine_bytes: int | None = None) -> None:
        #: the default (``node_protocol.default_socket_path``) lives in a folder only this user may use
        self.default_socket = socket_path is None
        self.socket_path = wire.default_socket_path() if socket_path is None else Path(socket_path)
        #: a group whose members may use the server too (its socket 0660; they get the arena over it)
        self.group = group
        #: a stable name for this node's cache (a fleet controller's holder id); the id changes every start
        self.name = name or f"{socket.gethostname()}:{self.socket_path}"
        self.memory_bytes = int(memory_bytes)
        self.pipeline = pipeline
        self.lease_timeout_s = float(lease_timeout_s)
        self.max_pin_s = float(max_pin_s)
        # The largest object: a chunk of the largest model served (80 layers x 8 heads x 128 x
        # bf16 x 256 tokens is 80 MiB), never more than the arena.
        self.slab_bytes = int(slab_bytes) if slab_bytes else min(256 << 20, self.memory_bytes)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.workers = workers
        if prefault not in PREFAULT_MODES:
            raise ValueError(f"prefault must be one of {', '.join(PREFAULT_MODES)}; got {prefault!r}")
        #: how the arena's pages are made resident at start (flowkv.resident): background, now or off
        self.prefault = prefault
        #: a live process whose dropped connections hold this much (quarantined) gets no new rooms
        self.quarantine_bytes = self.memory_bytes // 4 if quarantine_bytes is None else int(quarantine_bytes)
        if self.quarantine_bytes < 0:
            raise ValueError(f"quarantine bytes must be at least 0, got {quarantine_bytes!r}")


class NodeServer:
    """The server's state and request handlers; ``serve()`` runs it until SIGTERM."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        socket_path_fits(options.socket_path, what="--socket",  # before the arena is made, not at bind
                         fix="choose a shorter one, or leave it out for the private default")
        self.server_id = secrets.token_hex(8)
        self.started = time.time()
        self.counters = _Counters()
        self.leases = LeaseTable(lease_timeout_s=options.lease_timeout_s)
        self.operator_token = secrets.token_hex(32)
        #: the arena's name (memfd_create's: shown in /proc/PID/fd and maps, never a file anyone could open)
        self.segment_name = f"{wire.SEGMENT_NAME_PREFIX}{self.server_id}"
        self.segment = ResidentBuffer.memfd(self.segment_name, options.memory_bytes, prefault=options.prefault)
        self.buffer = self.segment.tensor
        try:
            self.memory = MemoryTier.on_arena(MemoryArena(options.memory_bytes, slab_bytes=options.slab_bytes,
                                                          backing=self.segment), **_arena_tenants(options.pipeline))
            self.storage = self._storage()
        except BaseException:
            self._remove_segment()
            raise
        self.storage.subscribe(self._on_event)
        self.lower = [name for name in self.storage.order if not self.storage.holds_objects(name)]
        self.tracer = _tracer(options.pipeline.telemetry if options.pipeline else TelemetrySpec())
        self._traced = options.pipeline is not None and options.pipeline.telemetry.exporter != "none"
        self._pool = concurrent.futures.ThreadPoolExecutor(options.workers, thread_name_prefix="flowkv-node")
        # Committed chunks on their way to the lower tiers, through the pipeline's [server] list.
        self._writer = ServerWriter(options.pipeline, storage=self.storage, arena=self.buffer,
                                    counters=self.counters, tracer=self.tracer)
        self._events: collections.deque[tuple[int, str, str, str]] = collections.deque(maxlen=_EVENTS_KEPT)
        self._event_seq = 0
        self._event_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event_waiters = 0
        self._new_events: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._stopping: asyncio.Event | None = None
        self.metrics_url: str | None = None
        self._malformed_logged = False
        self._written_by: dict[str, int | None] = {}  # key -> the uid that committed it (arena entries)

    # -- the segment -----------------------------------------------------------

    def _remove_segment(self) -> None:
        self.segment.stop()
        self.segment.unlink()

    # -- the tiers -------------------------------------------------------------

    def _storage(self) -> StorageManager:
        """The server's arena as the memory tier, then the pipeline's byte tiers (its object tiers: the arena)."""
        pipeline = self.options.pipeline
        pin_timeout_s = self.options.max_pin_s
        if pipeline is not None:
            pin_timeout_s = min(pin_timeout_s, pipeline.section.pin_timeout_s)
        return StorageManager.from_specs(pipeline.tiers if pipeline is not None else {},
                                         slab_bytes=self.options.slab_bytes, pin_timeout_s=pin_timeout_s,
                                         counters=self.counters, arena=self.memory)

    # -- events for a fleet controller ------------------------------------------

    def _on_event(self, event: TierEvent) -> None:
        if event.kind != "admit" and event.tier == "memory":
            self._written_by.pop(event.key, None)
        with self._event_lock:
            self._event_seq += 1
            self._events.append((self._event_seq, event.kind, event.tier, event.key))
        if self._event_waiters and self._loop is not None and self._new_events is not None:
            self._loop.call_soon_threadsafe(self._new_events.set)

    # -- serving -----------------------------------------------------------------

    async def serve(self, *, ready: Callable[[NodeServer], None] | None = None) -> None:
        """Accept clients until SIGTERM/SIGINT, then shut down cleanly."""
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._new_events = asyncio.Event()
        path = self.options.socket_path
        if self.options.default_socket:
            private_folder(path.parent, what="flowkv server socket", group=self.options.group)
        _claim_socket_path(path)
        server = await asyncio.start_unix_server(self._client, path=str(path))
        # 0600 (0660 with a group) whatever the umask; the default folder is private besides.
        if self.options.group is not None:
            os.chown(path, -1, self.options.group)
        os.chmod(path, 0o660 if self.options.group is not None else 0o600)
        token_file = wire.operator_token_path(path)
        _write_private(token_file, self.operator_token)
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(signum, self._stopping.set)
        metrics = None
        if self.options.metrics_port is not None:
            from flowkv.server.metrics import serve_metrics

            metrics = serve_metrics(self, self.options.metrics_host, self.options.metrics_port)
            self.metrics_url = f"http://{self.options.metrics_host}:{metrics.server_port}/metrics"
        reaper = asyncio.create_task(self._reap())
        try:
            if ready is not None:
                ready(self)
            await self._stopping.wait()
            log.info("flowkv server: stopping")
        finally:
            server.close()
            reaper.cancel()
            for writer in list(self._writers):
                writer.close()
            await asyncio.sleep(0)
            if metrics is not None:
                metrics.shutdown()
            await self._loop.run_in_executor(None, self.close)
            path.unlink(missing_ok=True)
            token_file.unlink(missing_ok=True)

    def close(self) -> None:
        """Drain committed chunks to the lower tiers, flush write-behind, close tiers, remove the segment."""
        self._writer.close()
        drained = self.storage.flush(timeout_s=60.0)
        if not drained:
            log.warning("flowkv server: write-behind not drained within 60 s")
        self.storage.close()
        self._pool.shutdown(wait=True)
        self._remove_segment()
        log.info("flowkv server: closed (write-behind %s)", "drained" if drained else "not drained")

    async def _reap(self) -> None:
        """Reclaim the leases of clients gone longer than the lease timeout (quarantine those of live
        processes, reclaim them once they exit); expire pins."""
        while True:
            await asyncio.sleep(min(0.25, self.options.lease_timeout_s / 4))
            handles, owners, quarantined = self.leases.expired()
            for handle in handles:
                handle.obj.ref_down()
            for session in quarantined:
                held = self.leases.quarantined_bytes(session)
                self.counters.count("quarantined_sessions")
                log.warning("flowkv server: %s (%s) dropped its connection %.1f s ago and its process still "
                            "runs: its %d rooms and reads (%d B from dropped connections) are kept from reuse "
                            "until it exits or gives them back%s", session.client, session.label,
                            self.options.lease_timeout_s, len(session.handles), held,
                            "; it gets no new rooms, over the bound of " f"{self.options.quarantine_bytes} B"
                            if held >= self.options.quarantine_bytes else "")
            for owner in owners:
                self.leases.reclaimed["pins"] += self.memory.release_owner(owner)
                self.storage.release(owner)
            # Owners whose pins all ran out (a client that never released them) leave the table too.
            self.leases.prune_owners(self.storage.holds_pins)
            if handles or owners:
                log.info("flowkv server: reclaimed %d handles and the pins of %d owners of clients gone "
                         "over %.1f s", len(handles), len(owners), self.options.lease_timeout_s)
            self.storage.expire_pins()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = self.leases.open()
        peer = _peer(writer)
        if peer is None or not (peer.uid == os.geteuid() or (self.options.group is not None
                                                              and peer.gid == self.options.group)):
            # The socket's mode keeps others out; this is the second lock (a socket path given in /tmp).
            log.warning("flowkv server: refusing a client of uid %s", None if peer is None else peer.uid)
            self.counters.count("clients_refused")
            self.leases.close(session)
            writer.close()
            return
        session.pid, session.uid = peer.pid, peer.uid
        session.started = process_start(peer.pid)  # tells this process from a later one with its pid
        # Named by its credentials and connection, never by what it declares.
        session.client = f"uid{peer.uid}:pid{peer.pid}:c{session.id}"
        self._writers.add(writer)
        try:
            while True:
                prefix = await reader.readexactly(4)
                message = wire.decode_body(await reader.readexactly(wire.frame_length(prefix)))
                reply = await self._handle(session, message)
                fds = reply.pop("_fds", None)
                if message.get("id"):
                    frame = wire.encode_frame({"id": message["id"], **reply})
                    if fds:
                        await _write_with_fds(writer, frame, fds)
                    else:
                        writer.write(frame)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client hung up (exited, killed, or gave up on a call)
        except ValueError as exc:  # not a frame, not strict JSON, or not an object: the client is dropped
            self.counters.count("malformed_frames")
            # One line the first time, no traceback: a client sending garbage in a loop must not fill the log.
            level = logging.DEBUG if self._malformed_logged else logging.WARNING
            self._malformed_logged = True
            log.log(level, "flowkv server: dropping client %s (session %d): unreadable message: %.200s "
                    "(further ones are counted in requests.malformed_frames)", session.client, session.id, exc)
        finally:
            self._writers.discard(writer)
            self.leases.close(session)
            writer.close()

    async def _handle(self, session: Session, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        handler = self._handlers.get(op) if isinstance(op, str) else None
        span = self._span(op, session, message)
        try:
            if handler is None:
                raise RequestError(f"unknown op {op!r}")
            reply = await handler(self, session, message, span)
            return {"ok": True, **reply}
        except (RequestError, KeyError, TypeError, ValueError, ArithmeticError) as exc:
            self.counters.count("request_errors")
            if span is not None:
                span.set_attribute("flowkv.error", f"{type(exc).__name__}: {exc}")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # a defect: answered and logged, the server and the connection go on
            log.exception("flowkv server: %s from %s failed", op, session.client)
            self.counters.count("request_failures")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            if span is not None:
                span.end()

    def _span(self, op: Any, session: Session, message: dict[str, Any]) -> Any:
        carrier = message.get("trace")
        if not isinstance(carrier, dict) or not self._traced:
            return None
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract({str(k): str(v) for k, v in carrier.items()})
        return self.tracer.start_span(f"flowkv.server.{op}", context=context, kind=SpanKind.SERVER,
                                      attributes={"flowkv.client": session.client, "flowkv.server": self.server_id})

    # -- requests ------------------------------------------------------------------

    async def _hello(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        session.label = _text(message.get("client"), "client")  # shown in stats; names nothing
        token = message.get("operator_token")
        if token is not None:
            if not isinstance(token, str) or not secrets.compare_digest(token, self.operator_token):
                raise RequestError("operator_token is not this server's")
            session.operator = True
        self.counters.count("hellos")
        # The arena goes over the socket as a descriptor (SCM_RIGHTS), to a client that asks to map it:
        # no name to squat, nothing to check but the descriptor itself, nothing left when all let go.
        fds = [self.segment.fd] if message.get("map") is True else []
        return {"version": wire.PROTOCOL_VERSION, "server": self.server_id, "name": self.options.name,
                "segment": f"memfd:{self.segment_name}", "_fds": fds,
                "segment_bytes": self.options.memory_bytes,
                "page_bytes": self.memory.arena.page_bytes, "slab_bytes": self.memory.arena.slab_bytes,
                "lease_timeout_s": self.options.lease_timeout_s}

    async def _lookup(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        keys = _keys(message)
        owner = message.get("pin")
        pin_s = self._pin_s(message)
        owner_name = self.leases.owner(session, _text(owner, "pin")) if owner is not None else None
        if self.lower:
            held = await asyncio.get_running_loop().run_in_executor(self._pool, self._find, keys, owner_name, pin_s)
        else:
            held = self._find(keys, owner_name, pin_s)
        hits = _leading(held)
        self.counters.count("lookups")
        self.counters.count("lookup_keys", len(keys))
        self.counters.count("lookup_hits", hits)
        if span is not None:
            span.set_attributes({"flowkv.chunks": len(keys), "flowkv.hit_chunks": hits})
        return {"held": held}

    def _find(self, keys: list[str], owner: str | None, pin_s: float) -> list[bool]:
        """Held per key; with ``owner``, the leading run of hits pinned (memory) or prefetched (lower tiers)."""
        found = self.storage.find(keys)
        held = [tier is not None for tier in found]
        if owner is None:
            return held
        lead = _leading(held)
        in_memory = [i for i in range(lead) if found[i] == "memory"]
        pinned = self.memory.pin_many([keys[i] for i in in_memory], owner, timeout_s=pin_s)
        for i, ok in zip(in_memory, pinned):
            held[i] = ok  # evicted between the find and the pin: a miss
        below = [Entry(keys[i], found[i], None, None) for i in range(_leading(held)) if found[i] != "memory"]
        if below:
            self.storage.prefetch(below, owner)  # each lands pinned for the owner
        return held

    async def _pin(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        owner = self.leases.owner(session, _text(message.get("owner"), "owner"))
        pin_s = self._pin_s(message)
        return {"held": self.memory.pin_many(_keys(message), owner, timeout_s=pin_s)}

    def _pin_s(self, message: dict[str, Any]) -> float:
        """A pin's length: positive, clamped to ``--max-pin``."""
        pin_s = _number(message, "pin_s", self.options.max_pin_s, low=0.0, high=_MAX_SECONDS)
        if not pin_s > 0:
            raise RequestError("'pin_s' must be positive")
        return min(pin_s, self.options.max_pin_s)

    async def _unpin(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        owner = self.leases.owner(session, _text(message.get("owner"), "owner"))
        for key in _keys(message):
            self.memory.unpin(key, owner)
        return {}

    async def _release_owner(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        owner = self.leases.owner(session, _text(message.get("owner"), "owner"))
        self.storage.release(owner)
        self.leases.forget_owner(session, owner)  # its pins are gone: the table does not grow per request
        return {}

    async def _alloc(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        sizes = message.get("sizes")
        slab = self.memory.arena.slab_bytes
        if not isinstance(sizes, list) or len(sizes) > _MAX_ITEMS or not all(
                _is_int(n) and 0 < n <= slab for n in sizes):
            raise RequestError(f"alloc's 'sizes' must be at most {_MAX_ITEMS} byte counts, each from 1 to the "
                               f"{slab} B of the largest object")
        tenant = clean_tenant(message.get("tenant"))  # a bad name is the default tenant, never a refusal
        kept = self.leases.quarantined_bytes(session)
        if kept and kept >= self.options.quarantine_bytes:
            # Pages it may still write through its dropped connections are out of everyone's reach: a
            # client that drops connection after connection must not take the whole arena that way.
            self.counters.count("alloc_refused_quarantined")
            raise RequestError(f"process {session.pid} holds {kept} B of rooms and reads from connections "
                               f"it dropped (over the server's bound of {self.options.quarantine_bytes} B): "
                               f"no new rooms until it exits or releases them")
        base = self.buffer.data_ptr()
        objs: list[list[int]] = []
        try:
            for nbytes in sizes:
                obj = self.memory.allocate_bytes(nbytes, tenant=tenant)  # evicts (quota first); never waits
                if obj is None:
                    self.counters.count("alloc_shortfalls")
                    break
                try:
                    objs.append([self.leases.add(session, "alloc", obj), obj.tensor.data_ptr() - base])
                except BaseException:
                    obj.ref_down()
                    raise
        except BaseException:  # a room the client never hears of would stay held until it hangs up
            self._drop_handles(session, [handle for handle, _ in objs])
            raise
        self.counters.count("allocs")
        self.counters.count("alloc_chunks", len(objs))
        if span is not None:
            span.set_attributes({"flowkv.chunks": len(sizes), "flowkv.allocated": len(objs)})
        return {"objs": objs}

    async def _commit(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        items = message.get("items")
        if not isinstance(items, list) or len(items) > _MAX_ITEMS:
            raise RequestError(f"commit's 'items' must be at most {_MAX_ITEMS} of [handle, key, nbytes, meta]")
        admitted = []
        for item in items:
            handle_id = item[0] if isinstance(item, list) and len(item) == 4 else None
            handle = self.leases.take(session, handle_id, "alloc") if _is_int(handle_id) else None
            if handle is None:
                self.counters.count("commit_unknown_handles")
                admitted.append(False)
                continue
            _, key, nbytes, meta = item
            obj = handle.obj
            taken = False
            try:
                _describe(obj, _text(key, "key"), nbytes, meta)
                taken = self.storage.put("memory", key, obj=obj) > 0
                if taken:
                    self._written_by[key] = session.uid
                if taken and self.lower:
                    self._writer.offer(key, obj, self.memory.tenant_of(key) or DEFAULT_TENANT)
            except (RequestError, ValueError, KeyError, TypeError, ArithmeticError) as exc:
                self.counters.count("commit_refused")
                log.warning("flowkv server: refusing a commit of %.80r from %s: %s", key, session.client, exc)
            finally:
                # The allocation's reference, whatever happened: the index holds the room now, or it goes back.
                obj.ref_down()
            admitted.append(taken)
        took = sum(admitted)
        self.counters.count("commits")
        self.counters.count("committed_chunks", took)
        self.counters.count("duplicate_commits", len(items) - took)
        if span is not None:
            span.set_attributes({"flowkv.chunks": len(items), "flowkv.admitted": took})
        return {"admitted": admitted}

    async def _get(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        keys = _keys(message)
        base = self.buffer.data_ptr()
        tenant = message.get("tenant")
        tenant = clean_tenant(tenant) if tenant is not None else None
        # each with a reference for this request
        found: list[Any] = [self.memory.get(key, tenant=tenant) for key in keys]
        objs: list[Any] = []
        try:
            missing = [i for i, obj in enumerate(found) if obj is None]
            if missing and self.lower:
                read = await asyncio.get_running_loop().run_in_executor(
                    self._pool, lambda: [self.storage.read(Entry(keys[i], None, None, None,
                                                                 tenant or DEFAULT_TENANT), promote=True)
                                         for i in missing])
                for i, hit in zip(missing, read):
                    if hit is not None and hit.obj is not None:
                        found[i] = hit.obj
            for obj in found:
                if obj is None:
                    objs.append(None)
                    continue
                reply = [0, obj.tensor.data_ptr() - base, obj.nbytes, _meta(obj)]
                reply[0] = self.leases.add(session, "read", obj)
                objs.append(reply)
        except BaseException:  # references nobody will release: dropped here, not at the lease timeout
            self._drop_handles(session, [o[0] for o in objs if o is not None])
            for obj in found[len(objs):]:
                if obj is not None:
                    obj.ref_down()
            raise
        hits = sum(o is not None for o in objs)
        self.counters.count("gets")
        self.counters.count("get_hits", hits)
        self.counters.count("get_misses", len(keys) - hits)
        if span is not None:
            span.set_attributes({"flowkv.chunks": len(keys), "flowkv.hit_chunks": hits})
        return {"objs": objs}

    async def _release(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        handles = message.get("handles")
        if not isinstance(handles, list) or len(handles) > _MAX_ITEMS or not all(_is_int(h) for h in handles):
            raise RequestError(f"release's 'handles' must be at most {_MAX_ITEMS} handle numbers")
        # Its own, or its process's from a connection it dropped (a call cut off by its timeout).
        self._drop_handles(session, handles, own_process=True)
        self.counters.count("releases", len(handles))
        return {}

    def _drop_handles(self, session: Session, handles: list[int], *, own_process: bool = False) -> None:
        for handle_id in handles:
            handle = self.leases.take(session, handle_id, own_process=own_process)
            if handle is not None:
                handle.obj.ref_down()

    async def _remove(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        """Drop entries: a client's own user's, or any with the operator token."""
        keys = _keys(message)
        if not session.operator and any(self._written_by.get(key, session.uid) != session.uid for key in keys):
            self.counters.count("operator_refused")
            raise RequestError("removing entries another user wrote needs the operator token")
        return {"removed": [self.storage.remove(key) for key in keys]}

    async def _stats(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        status = self.status()
        if not session.operator:  # who else is connected is the operator's to know
            status["sessions"] = [s for s in status["sessions"] if s["session"] == session.id]
        return status

    def _operator(self, session: Session, op: str) -> None:
        if not session.operator:
            self.counters.count("operator_refused")
            raise RequestError(f"{op} needs the operator token (flowkv server status and node-report read it "
                               f"from the file beside the socket)")

    async def _events_since(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        """Tier events after ``since`` (at most ``max``), waiting up to ``wait_s`` for one."""
        self._operator(session, "events")
        since = _integer(message, "since", 0, low=0, high=1 << 63)
        limit = _integer(message, "max", 4096, low=1, high=1 << 63)
        limit = min(limit, _EVENTS_KEPT)
        wait_s = min(_number(message, "wait_s", 0.0, low=0.0, high=_MAX_SECONDS), 30.0)
        if wait_s > 0 and self._event_seq <= since:
            assert self._new_events is not None
            self._new_events.clear()
            self._event_waiters += 1
            try:
                await asyncio.wait_for(self._new_events.wait(), wait_s)
            except TimeoutError:
                pass
            finally:
                self._event_waiters -= 1
        with self._event_lock:
            oldest = self._events[0][0] if self._events else self._event_seq + 1
            events = [list(e) for e in self._events if e[0] > since][:limit]
            seq = self._event_seq
        # A gap: events after `since` were dropped from the ring; the caller resyncs from a snapshot.
        return {"events": events, "seq": seq, "gap": since + 1 < oldest and since < seq}

    async def _snapshot(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        """Every key the arena holds, and the event sequence number it is as of."""
        self._operator(session, "snapshot")
        with self._event_lock:
            seq = self._event_seq
            keys = self.memory.keys()
        return {"seq": seq, "tier": "memory", "keys": keys}

    _handlers: dict[str, Callable[..., Any]] = {
        "hello": _hello, "lookup": _lookup, "pin": _pin, "unpin": _unpin, "release_owner": _release_owner,
        "alloc": _alloc, "commit": _commit, "get": _get, "release": _release, "remove": _remove,
        "stats": _stats, "events": _events_since, "snapshot": _snapshot,
    }

    # -- status --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        memory = self.memory.stats()
        arena = self.memory.arena
        return {
            "server": self.server_id,
            "name": self.options.name,
            "pid": os.getpid(),
            "socket": str(self.options.socket_path),
            "segment": f"memfd:{self.segment_name}",
            "uptime_s": round(time.time() - self.started, 3),
            "metrics": self.metrics_url,
            "memory": {
                "entries": memory.entries, "capacity_bytes": memory.capacity_bytes, "used_bytes": memory.used_bytes,
                "free_bytes": arena.free_bytes, "evictions": memory.evictions,
                "allocation_failures": memory.allocation_failures, "pinned_entries": memory.pinned_objects,
                "hits": memory.hits, "misses": memory.misses, "tenants": memory.tenants,
                "resident_bytes": self.segment.resident_bytes, "prefault": self.segment.prefault_state,
            },
            "clients": self.leases.counts(),
            "sessions": self.leases.clients(),
            "requests": self.counters.snapshot(),
            "tiers": self.storage.stats(),
            "health": {name: str(state.value) for name, state in self.storage.health().items()},
            "lower": {"stages": [spec.name for spec in self._writer.stages],
                      "queued": self._writer.queued(), "tiers": self.lower},
            "events": {"seq": self._event_seq},
        }


# -- helpers -----------------------------------------------------------------------------



def _describe(obj: Any, key: str, nbytes: Any, meta: Any) -> None:
    """Check a commit's description against its room and put it on the object (``meta``)."""
    if not isinstance(meta, dict) or not _is_int(nbytes):
        raise ValueError("meta must be an object and nbytes an int")
    if len(key) > _MAX_KEY:
        raise ValueError(f"key of {len(key)} characters")
    if "codec" in meta:
        encoded_len, codec = meta["encoded_len"], meta["codec"]
        if not _is_int(encoded_len) or not 0 < encoded_len <= obj.nbytes or encoded_len != nbytes:
            raise ValueError(f"encoded_len {encoded_len!r:.40} does not fit a room of {obj.nbytes} B")
        if not isinstance(codec, str) or not 0 < len(codec) <= 64:
            raise ValueError("codec must be a short name")
        if encoded_len < obj.nbytes:
            obj.shrink_to_bytes(encoded_len)  # the rest of the pages go back
        obj.meta.clear()
        obj.meta.update(codec=codec, encoded_len=encoded_len)
        return
    shape, order = meta["shape"], meta.get("order")
    # Every dim at least 1: [-1, -4096] multiplies to a size that fits, and makes every reader's view fail.
    if not isinstance(shape, list) or not 0 < len(shape) <= _MAX_DIMS or not all(
            _is_int(d) and 0 < d <= obj.nbytes for d in shape):
        raise ValueError(f"shape {shape!r:.80} is not a list of up to {_MAX_DIMS} positive dims")
    dtype = wire.dtype_from_name(meta["dtype"])
    order = list(range(len(shape))) if order is None else order
    if not isinstance(order, list) or not all(_is_int(d) for d in order):
        raise ValueError(f"order {order!r:.80} is not a list of dims")
    size = dtype.itemsize
    for d in shape:
        size *= d
    if size != obj.nbytes or nbytes != obj.nbytes or sorted(order) != list(range(len(shape))):
        raise ValueError(f"shape {shape} {meta['dtype']} order {order} does not describe a room of {obj.nbytes} B")
    obj.meta.clear()
    obj.meta.update(shape=shape, dtype=meta["dtype"], order=order)


def _arena_tenants(pipeline: Pipeline | None) -> dict[str, Any]:
    """The arena's tenant quotas: from the server pipeline's object tier (``[tiers.memory]``), if any."""
    for spec in (pipeline.tiers.values() if pipeline is not None else ()):
        if spec.info.holds == "objects" and hasattr(spec.config, "quotas"):
            return {"quotas": spec.config.quotas, "tenant_labels": spec.config.tenant_labels}
    return {}


def _meta(obj: Any) -> dict[str, Any]:
    meta = obj.meta
    if "codec" in meta:
        return {"codec": meta["codec"], "encoded_len": meta["encoded_len"]}
    return {"shape": meta["shape"], "dtype": meta["dtype"], "order": meta["order"]}


def _keys(message: dict[str, Any]) -> list[str]:
    keys = message.get("keys")
    if not isinstance(keys, list) or len(keys) > _MAX_ITEMS or not all(
            isinstance(k, str) and 0 < len(k) <= _MAX_KEY for k in keys):
        raise RequestError(f"'keys' must be a list of at most {_MAX_ITEMS} non-empty strings")
    return keys


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(message: dict[str, Any], field: str, default: float, *, low: float, high: float) -> float:
    """``message[field]`` (or ``default``): a JSON number from ``low`` to ``high``, else a refused request."""
    value = message.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"'{field}' must be a number from {low:g} to {high:g}, got {value!r:.40}")
    return float(value)


def _integer(message: dict[str, Any], field: str, default: int | None = None, *, low: int, high: int) -> int:
    value = message.get(field, default)
    if not _is_int(value) or not low <= value <= high:
        raise RequestError(f"'{field}' must be an integer from {low} to {high}, got {value!r:.40}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_KEY:
        raise RequestError(f"'{what}' must be a non-empty string")
    return value


def _leading(held: list[bool]) -> int:
    return next((i for i, h in enumerate(held) if not h), len(held))


def _tracer(spec: TelemetrySpec) -> Any:
    from flowkv import telemetry

    if spec.exporter != "none" and spec.service_name == "flowkv":
        import attrs

        spec = attrs.evolve(spec, service_name="flowkv-server")
    return telemetry.tracer_for(spec)



def _peer(writer: asyncio.StreamWriter) -> PeerCredentials | None:
    try:
        return peer_credentials(writer.get_extra_info("socket"))
    except (OSError, AttributeError, TypeError):
        return None


async def _write_with_fds(writer: asyncio.StreamWriter, frame: bytes, fds: list[int]) -> None:
    """``frame`` with ``fds`` attached to its first bytes (``SCM_RIGHTS``), after all written before it."""
    while writer.transport.get_write_buffer_size():  # drain() returns below the high-water mark, not at 0
        await writer.drain()
        await asyncio.sleep(0.001)
    # asyncio's transport cannot pass descriptors: a duplicate of its socket sends this one frame.
    sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
    try:
        while True:
            try:
                sent = socket.send_fds(sock, [frame], fds)
                break
            except BlockingIOError:  # the client's receive buffer is full: it reads, or it hangs up
                await asyncio.sleep(0.01)
    finally:
        sock.close()
    if sent < len(frame):
        writer.write(frame[sent:])


def _write_private(path: Path, text: str) -> None:
    """``text`` in a new 0600 file at ``path`` (one a dead server left is replaced; a link is never followed)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(text + "\n")


def _claim_socket_path(path: Path) -> None:
    """Refuse a path a live server listens on (named: ours, or another user's squatting it), or one whose
    listener does not answer; remove one a dead server left."""
    if not os.path.lexists(path):
        if not path.parent.exists():
            os.makedirs(path.parent, mode=0o700, exist_ok=True)
        return
    try:
        listening = listener(path)
    except PermissionError as exc:
        raise RuntimeError(f"{path}: this user may not connect there (owner uid {path.lstat().st_uid}): another "
                           f"user's socket; refusing to start; choose another --socket, or leave it out for the "
                           f"private default") from exc
    except OSError as exc:  # a busy or hung server's socket is never taken over
        raise RuntimeError(f"{path}: the process listening there does not answer ({exc}): refusing to take its "
                           f"place; stop it, or choose another --socket") from exc
    if listening is None:
        log.warning("flowkv server: removing %s, left by a server that is gone", path)
        try:
            path.unlink()
        except PermissionError as exc:
            raise RuntimeError(f"{path} is left by another user (uid {path.lstat().st_uid}) and cannot be "
                               f"removed: choose another --socket, or the private default") from exc
        return
    if listening.uid != os.geteuid():
        raise RuntimeError(f"{path}: a process of uid {listening.uid} (pid {listening.pid}) already listens there, "
                           f"not a flowkv server of this user: refusing to start; choose another --socket, or "
                           f"leave it out for the private default")
    raise RuntimeError(f"a flowkv server already listens on {path}")
