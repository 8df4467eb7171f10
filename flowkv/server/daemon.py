"""The node server: one flowkv storage manager per node, shared by every vLLM on it.

::

    flowkv server --socket /run/flowkv/node.sock --memory 64GiB [--pipeline node-server-disk]

    vLLM A worker ─┐                      ┌───────────── flowkv server ──────────────┐
    vLLM B worker ─┼─ Unix socket ───────▶│ asyncio loop: sessions, leases, requests │
    flowkv status ─┘  (framed JSON)       │ StorageManager: [memory] -> disk, Redis   │
          │                               │   memory = MemoryTier over the segment    │
          └── mmap ── /dev/shm/flowkv-node-<socket hash>-<pid>-<rand> (the arena) ───┘

The arena lives in one named shared-memory file (a
:class:`flowkv.resident.ResidentBuffer`, pre-faulted as ``--prefault`` says);
clients map it once and move KV in and out of its pages themselves. The loop thread owns the
sessions, handles and pins (:mod:`flowkv.server.leases`); requests that
need a lower tier (a lookup or read that reaches disk or Redis) run on a
small thread pool, so one slow disk read holds up no other client.
Committed chunks go to the lower tiers from a writer thread (encoded with
the server pipeline's ``compress`` codec, then written behind). SIGTERM or
SIGINT stops accepting, drains the writer and the write-behind queues,
closes the tiers and removes the socket and the segment.

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
import queue
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowkv import payload as payloads
from flowkv.memory import MemoryArena
from flowkv.pipeline_model import Pipeline, TelemetrySpec
from flowkv.resident import PREFAULT_MODES, ResidentBuffer
from flowkv.tiers import node_protocol as wire
from flowkv.tiers.chain import Entry, StorageManager, TierEvent
from flowkv.tiers.memory import MemoryTier
from flowkv.server.leases import LeaseTable, Session
from flowkv.tenants import DEFAULT_TENANT, clean_tenant

__all__ = ["NodeServer", "ServerOptions"]

log = logging.getLogger("flowkv.server")

_MAX_KEY = 4096  # characters: keys are short printable strings
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

    def __init__(self, *, socket_path: str | os.PathLike[str], memory_bytes: int, pipeline: Pipeline | None = None,
                 lease_timeout_s: float = 30.0, max_pin_s: float = 60.0, slab_bytes: int | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 shm_dir: str | os.PathLike[str] = "/dev/shm", workers: int = 4, name: str | None = None,
                 prefault: str = "background") -> None:
        self.socket_path = Path(socket_path)
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
        self.shm_dir = Path(shm_dir)
        self.workers = workers
        if prefault not in PREFAULT_MODES:
            raise ValueError(f"prefault must be one of {', '.join(PREFAULT_MODES)}; got {prefault!r}")
        #: how the arena's pages are made resident at start (flowkv.resident): background, now or off
        self.prefault = prefault


class NodeServer:
    """The server's state and request handlers; ``serve()`` runs it until SIGTERM."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.server_id = secrets.token_hex(8)
        self.started = time.time()
        self.counters = _Counters()
        self.leases = LeaseTable(lease_timeout_s=options.lease_timeout_s)
        self._remove_stale_segments()
        self.segment = self._create_segment()
        self.segment_path = self.segment.path
        self.buffer = self.segment.tensor
        self.inode = os.stat(self.segment_path).st_ino
        try:
            self.memory = MemoryTier.on_arena(MemoryArena(options.memory_bytes, slab_bytes=options.slab_bytes,
                                                          backing=self.segment), **_arena_tenants(options.pipeline))
            self.storage = self._storage()
        except BaseException:
            self._remove_segment()
            raise
        self.storage.subscribe(self._on_event)
        self.codec, self.codec_params = _codec_of(options.pipeline)
        self.lower = [name for name in self.storage.order if not self.storage.holds_objects(name)]
        self.tracer = _tracer(options.pipeline.telemetry if options.pipeline else TelemetrySpec())
        self._traced = options.pipeline is not None and options.pipeline.telemetry.exporter != "none"
        self._pool = concurrent.futures.ThreadPoolExecutor(options.workers, thread_name_prefix="flowkv-node")
        # Committed chunks on their way to the lower tiers: (key, obj with a reference, its tenant).
        self._to_lower: queue.Queue[tuple[str, Any, str] | None] = queue.Queue(maxsize=1024)
        self._writer = threading.Thread(target=self._write_lower, name="flowkv-node-lower", daemon=True)
        self._writer.start()
        self._events: collections.deque[tuple[int, str, str, str]] = collections.deque(maxlen=_EVENTS_KEPT)
        self._event_seq = 0
        self._event_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event_waiters = 0
        self._new_events: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._stopping: asyncio.Event | None = None
        self.metrics_url: str | None = None

    # -- the segment -----------------------------------------------------------

    def _create_segment(self) -> ResidentBuffer:
        """The arena's named shared memory, pre-faulted (``--prefault``) within the machine's free memory.

        A shared-memory file is sparse: one larger than the room left in its
        filesystem (a container's 64 MiB ``/dev/shm``) is created without
        complaint, and the first write past that room kills the writer with
        SIGBUS — a vLLM gathering into it. So the room is checked first.
        """
        room = _free_bytes(self.options.shm_dir)
        if room is not None and room < self.options.memory_bytes:
            raise ValueError(f"--memory {self.options.memory_bytes / 2**30:.2f} GiB does not fit "
                             f"{self.options.shm_dir}: {room / 2**30:.2f} GiB free there (df -h "
                             f"{self.options.shm_dir}; in a container, --shm-size)")
        prefix = wire.segment_prefix(self.options.socket_path)
        path = self.options.shm_dir / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            return ResidentBuffer.shared(path, self.options.memory_bytes, prefault=self.options.prefault)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def _remove_stale_segments(self) -> None:
        """Segments left by servers on this socket that died without cleaning up (kill -9)."""
        prefix = wire.segment_prefix(self.options.socket_path)
        try:
            names = [p for p in self.options.shm_dir.iterdir() if p.name.startswith(prefix)]
        except OSError:
            return
        for path in names:
            pid_text = path.name[len(prefix):].split("-", 1)[0]
            if pid_text.isdigit() and not _alive(int(pid_text)):
                log.warning("flowkv server: removing %s, left by server pid %s", path, pid_text)
                path.unlink(missing_ok=True)
                self.counters.count("stale_segments_removed")

    def _remove_segment(self) -> None:
        self.segment.stop()
        self.segment.unlink()

    # -- the tiers -------------------------------------------------------------

    def _storage(self) -> StorageManager:
        pipeline = self.options.pipeline
        tiers: dict[str, Any] = {"memory": self.memory}
        guards: dict[str, Any] = {}
        pin_timeout_s = self.options.max_pin_s
        if pipeline is not None:
            pin_timeout_s = min(pin_timeout_s, pipeline.section.pin_timeout_s)
            for name, spec in pipeline.tiers.items():
                if spec.info.holds == "objects":
                    continue  # the server's own arena is the memory tier (sized by --memory)
                if name == "memory":
                    raise ValueError(f"tier {name!r} of {pipeline.source}: the name 'memory' is the server's arena")
                tiers[name] = spec.info.cls(name=name, config=spec.config)
                guards[name] = spec.guard
        return StorageManager(tiers, slab_bytes=self.options.slab_bytes, pin_timeout_s=pin_timeout_s,
                              guards=guards, counters=self.counters)

    # -- events for a fleet controller ------------------------------------------

    def _on_event(self, event: TierEvent) -> None:
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
        _claim_socket_path(path)
        server = await asyncio.start_unix_server(self._client, path=str(path))
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

    def close(self) -> None:
        """Drain committed chunks to the lower tiers, flush write-behind, close tiers, remove the segment."""
        self._to_lower.put(None)
        self._writer.join()
        drained = self.storage.flush(timeout_s=60.0)
        if not drained:
            log.warning("flowkv server: write-behind not drained within 60 s")
        self.storage.close()
        self._pool.shutdown(wait=True)
        self._remove_segment()
        log.info("flowkv server: closed (write-behind %s)", "drained" if drained else "not drained")

    async def _reap(self) -> None:
        """Reclaim the leases of clients gone longer than the lease timeout; expire pins."""
        while True:
            await asyncio.sleep(min(0.25, self.options.lease_timeout_s / 4))
            handles, owners = self.leases.expired()
            for handle in handles:
                handle.obj.ref_down()
            for owner in owners:
                self.leases.reclaimed["pins"] += self.memory.release_owner(owner)
                self.storage.release(owner)
            if handles or owners:
                log.info("flowkv server: reclaimed %d handles and the pins of %d owners of clients gone "
                         "over %.1f s", len(handles), len(owners), self.options.lease_timeout_s)
            self.storage.expire_pins()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = self.leases.open()
        session.pid = _peer_pid(writer)
        self._writers.add(writer)
        try:
            while True:
                prefix = await reader.readexactly(4)
                message = wire.decode_body(await reader.readexactly(wire.frame_length(prefix)))
                reply = await self._handle(session, message)
                if message.get("id"):
                    writer.write(wire.encode_frame({"id": message["id"], **reply}))
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client hung up (exited, killed, or gave up on a call)
        except ValueError as exc:
            log.warning("flowkv server: dropping client %s (session %d): unreadable message: %s",
                        session.client, session.id, exc)
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
        except (RequestError, KeyError, TypeError, ValueError) as exc:
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
        session.client = _text(message.get("client"), "client")
        if session.pid is None and isinstance(message.get("pid"), int):
            session.pid = message["pid"]
        self.counters.count("hellos")
        return {"version": wire.PROTOCOL_VERSION, "server": self.server_id, "name": self.options.name,
                "segment": str(self.segment_path),
                "segment_bytes": self.options.memory_bytes, "inode": self.inode,
                "page_bytes": self.memory.arena.page_bytes, "slab_bytes": self.memory.arena.slab_bytes,
                "lease_timeout_s": self.options.lease_timeout_s}

    async def _lookup(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        keys = _keys(message)
        owner = message.get("pin")
        pin_s = min(float(message.get("pin_s", self.options.max_pin_s)), self.options.max_pin_s)
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
        pin_s = min(float(message.get("pin_s", self.options.max_pin_s)), self.options.max_pin_s)
        return {"held": self.memory.pin_many(_keys(message), owner, timeout_s=pin_s)}

    async def _unpin(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        owner = self.leases.owner(session, _text(message.get("owner"), "owner"))
        for key in _keys(message):
            self.memory.unpin(key, owner)
        return {}

    async def _release_owner(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        self.storage.release(self.leases.owner(session, _text(message.get("owner"), "owner")))
        return {}

    async def _alloc(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        sizes = message.get("sizes")
        if not isinstance(sizes, list) or not all(isinstance(n, int) and 0 <= n for n in sizes):
            raise RequestError("alloc needs 'sizes': a list of byte counts")
        tenant = clean_tenant(message.get("tenant"))  # a bad name is the default tenant, never a refusal
        base = self.buffer.data_ptr()
        objs = []
        for nbytes in sizes:
            obj = self.memory.allocate_bytes(nbytes, tenant=tenant)  # evicts (quota first); never waits
            if obj is None:
                self.counters.count("alloc_shortfalls")
                break
            objs.append([self.leases.add(session, "alloc", obj), obj.tensor.data_ptr() - base])
        self.counters.count("allocs")
        self.counters.count("alloc_chunks", len(objs))
        if span is not None:
            span.set_attributes({"flowkv.chunks": len(sizes), "flowkv.allocated": len(objs)})
        return {"objs": objs}

    async def _commit(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        items = message.get("items")
        if not isinstance(items, list):
            raise RequestError("commit needs 'items': [handle, key, nbytes, meta] each")
        admitted = []
        for item in items:
            try:
                handle_id, key, nbytes, meta = item
            except (TypeError, ValueError):
                handle_id = key = nbytes = meta = None
            handle = self.leases.take(session, handle_id, "alloc") if isinstance(handle_id, int) else None
            if handle is None:
                self.counters.count("commit_unknown_handles")
                admitted.append(False)
                continue
            obj = handle.obj
            try:
                _describe(obj, _text(key, "key"), nbytes, meta)
            except (ValueError, KeyError, TypeError) as exc:
                obj.ref_down()
                self.counters.count("commit_refused")
                log.warning("flowkv server: refusing a commit of %s from %s: %s", key, session.client, exc)
                admitted.append(False)
                continue
            taken = self.storage.put("memory", key, obj=obj) > 0
            if taken and self.lower:
                obj.ref_up()  # the writer's, until the chunk is encoded for the lower tiers
                try:
                    self._to_lower.put_nowait((key, obj, self.memory.tenant_of(key) or DEFAULT_TENANT))
                except queue.Full:
                    obj.ref_down()
                    self.counters.count("lower_dropped")
            obj.ref_down()  # the allocation's: the index holds it now (or it goes back when not taken)
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
        found: list[Any] = [self.memory.get(key, tenant=tenant) for key in keys]
        missing = [i for i, obj in enumerate(found) if obj is None]
        if missing and self.lower:
            read = await asyncio.get_running_loop().run_in_executor(
                self._pool, lambda: [self.storage.read(Entry(keys[i], None, None, None, tenant or DEFAULT_TENANT),
                                                       promote=True)
                                     for i in missing])
            for i, hit in zip(missing, read):
                if hit is not None and hit.obj is not None:
                    found[i] = hit.obj
        objs = []
        for obj in found:
            if obj is None:
                objs.append(None)
                continue
            handle = self.leases.add(session, "read", obj)
            objs.append([handle, obj.tensor.data_ptr() - base, obj.nbytes, _meta(obj)])
        hits = sum(o is not None for o in objs)
        self.counters.count("gets")
        self.counters.count("get_hits", hits)
        self.counters.count("get_misses", len(keys) - hits)
        if span is not None:
            span.set_attributes({"flowkv.chunks": len(keys), "flowkv.hit_chunks": hits})
        return {"objs": objs}

    async def _release(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        handles = message.get("handles")
        if not isinstance(handles, list):
            raise RequestError("release needs 'handles'")
        for handle_id in handles:
            handle = self.leases.take(session, handle_id)
            if handle is not None:
                handle.obj.ref_down()
        self.counters.count("releases", len(handles))
        return {}

    async def _remove(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        return {"removed": [self.storage.remove(key) for key in _keys(message)]}

    async def _stats(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        return self.status()

    async def _events_since(self, session: Session, message: dict[str, Any], span: Any) -> dict[str, Any]:
        """Tier events after ``since`` (at most ``max``), waiting up to ``wait_s`` for one."""
        since = int(message.get("since", 0))
        limit = max(1, min(int(message.get("max", 4096)), _EVENTS_KEPT))
        wait_s = min(float(message.get("wait_s", 0.0)), 30.0)
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
        with self._event_lock:
            seq = self._event_seq
            keys = self.memory.keys()
        return {"seq": seq, "tier": "memory", "keys": keys}

    _handlers: dict[str, Callable[..., Any]] = {
        "hello": _hello, "lookup": _lookup, "pin": _pin, "unpin": _unpin, "release_owner": _release_owner,
        "alloc": _alloc, "commit": _commit, "get": _get, "release": _release, "remove": _remove,
        "stats": _stats, "events": _events_since, "snapshot": _snapshot,
    }

    # -- lower tiers -----------------------------------------------------------------

    def _write_lower(self) -> None:
        """Encode committed chunks (the pipeline's codec) and offer them to each lower tier's write-behind."""
        while True:
            item = self._to_lower.get()
            if item is None:
                return
            key, obj, tenant = item
            try:
                if "codec" in obj.meta:
                    blob = bytes(obj.view_bytes()[: obj.meta["encoded_len"]])
                else:
                    kv = wire.view(self.buffer, obj.tensor.data_ptr() - self.buffer.data_ptr(), obj.meta["shape"],
                                   wire.dtype_from_name(obj.meta["dtype"]), obj.meta.get("order"))
                    blob = payloads.encode(kv, self.codec, **self.codec_params)
                for name in self.lower:
                    if self.storage.put(name, key, payload=blob, tenant=tenant):
                        self.counters.count(f"lower.{name}.offered")
                    else:
                        self.counters.count(f"lower.{name}.dropped")
            except Exception:  # one chunk that cannot be encoded is a later miss, never a stop
                log.exception("flowkv server: writing %s to the lower tiers failed", key)
                self.counters.count("lower_errors")
            finally:
                obj.ref_down()

    # -- status --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        memory = self.memory.stats()
        arena = self.memory.arena
        return {
            "server": self.server_id,
            "name": self.options.name,
            "pid": os.getpid(),
            "socket": str(self.options.socket_path),
            "segment": str(self.segment_path),
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
            "lower": {"codec": self.codec, "queued": self._to_lower.qsize(), "tiers": self.lower},
            "events": {"seq": self._event_seq},
        }


# -- helpers -----------------------------------------------------------------------------


def _free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged file may still take in ``folder``'s filesystem (None: unknown)."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def _describe(obj: Any, key: str, nbytes: Any, meta: Any) -> None:
    """Check a commit's description against its room and put it on the object (``meta``)."""
    if not isinstance(meta, dict) or not isinstance(nbytes, int):
        raise ValueError("meta must be an object and nbytes an int")
    if len(key) > _MAX_KEY:
        raise ValueError(f"key of {len(key)} characters")
    if "codec" in meta:
        encoded_len = int(meta["encoded_len"])
        if not 0 < encoded_len <= obj.nbytes or encoded_len != nbytes:
            raise ValueError(f"encoded_len {encoded_len} does not fit a room of {obj.nbytes} B")
        if encoded_len < obj.nbytes:
            obj.shrink_to_bytes(encoded_len)  # the rest of the pages go back
        obj.meta.clear()
        obj.meta.update(codec=str(meta["codec"]), encoded_len=encoded_len)
        return
    shape = [int(d) for d in meta["shape"]]
    dtype = wire.dtype_from_name(meta["dtype"])
    order = [int(d) for d in meta.get("order", range(len(shape)))]
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
    if not isinstance(keys, list) or not all(isinstance(k, str) and 0 < len(k) <= _MAX_KEY for k in keys):
        raise RequestError("'keys' must be a list of non-empty strings")
    return keys


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_KEY:
        raise RequestError(f"'{what}' must be a non-empty string")
    return value


def _leading(held: list[bool]) -> int:
    return next((i for i, h in enumerate(held) if not h), len(held))


def _codec_of(pipeline: Pipeline | None) -> tuple[str, dict[str, Any]]:
    """The codec (and its parameters) of the server pipeline's first ``compress`` stage."""
    for spec in pipeline.store if pipeline is not None else ():
        if spec.name == "compress":
            settings = spec.settings()
            return settings.get("codec", "none"), {k: v for k, v in settings.items() if k != "codec" and v is not None}
    return "none", {}


def _tracer(spec: TelemetrySpec) -> Any:
    from flowkv import telemetry

    if spec.exporter != "none" and spec.service_name == "flowkv":
        import attrs

        spec = attrs.evolve(spec, service_name="flowkv-server")
    return telemetry.tracer_for(spec)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _peer_pid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except (OSError, AttributeError):
        return None


def _claim_socket_path(path: Path) -> None:
    """Refuse a path a live server listens on; remove one a dead server left."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        log.warning("flowkv server: removing %s, left by a server that is gone", path)
        path.unlink()
        return
    finally:
        probe.close()
    raise RuntimeError(f"a flowkv server already listens on {path}")
