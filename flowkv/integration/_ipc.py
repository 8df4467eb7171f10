"""Local IPC between vLLM's scheduler process and its worker processes.

vLLM asks the connector how many prompt tokens are cached from the scheduler
(engine-core) process, but flowkv's engine and its memory tier live in each
worker process. Every worker therefore serves lookups on a Unix socket of its
own, and the scheduler asks all of them, waiting at most a timeout::

    scheduler (DEALER per worker) ── ipc://DIR/flowkv-<instance>-dp<d>-r<rank>.sock ──▶ worker (ROUTER, thread)

Messages are two ZeroMQ frames, a JSON header and a raw body (token ids as
little-endian int64), so neither side unpickles anything it receives. Every
request carries a sequence number that its reply echoes: a reply that arrives
after the scheduler gave up on it is recognised and dropped, never taken for
the answer to a newer question.

Trust: the folder is this user's own (0700; an existing one of another
owner, or with a looser mode, is refused with an error that says so), so no
other user can unlink a worker's socket and bind an impostor there; and the
scheduler checks who listens on each worker socket (``SO_PEERCRED``: the
same uid) before its lookup socket connects to it, so nothing is sent to a
listener of another user whatever put it there.

Socket files: each vLLM start has a new instance id, so a worker that did not
get to close its socket (killed: vLLM's default ``--shutdown-timeout 0``
kills its workers) leaves a file no later start would reuse. A server
removes its own file when it closes and when its process exits; when it
starts, it removes the ``flowkv-*.sock`` files in its folder that nobody
listens on any more (connecting is refused).
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing.util
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from flowkv.local_peers import check_credentials, listener, private_folder, socket_path_fits

logger = logging.getLogger("flowkv.integration")

__all__ = [
    "LookupClient",
    "LookupServer",
    "default_ipc_dir",
    "socket_path",
    "query_worker",
    "remove_stale_sockets",
]

# A handler gets the request header and its token ids and returns the reply header.
Handler = Callable[[dict[str, Any], np.ndarray], dict[str, Any]]

# How often the server thread wakes to notice that it should stop.
_SERVER_POLL_MS = 100
# A socket file younger than this may be one another server has bound but not yet listens on.
_STALE_MIN_AGE_S = 10.0
# Run at process exit before multiprocessing's own clean-up (higher runs first).
_EXIT_PRIORITY = 10


def default_ipc_dir() -> Path:
    """Where the sockets live unless the connector config names a folder."""
    return Path(tempfile.gettempdir()) / f"flowkv-{os.getuid()}"


def socket_path(ipc_dir: str | os.PathLike[str], instance_id: str, dp_rank: int, rank: int) -> Path:
    """The socket one worker serves on: one per vLLM instance, data-parallel rank and worker rank."""
    safe_instance = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(instance_id))
    return socket_path_fits(Path(ipc_dir) / f"flowkv-{safe_instance}-dp{dp_rank}-r{rank}.sock",
                            what="IPC socket path", fix="set a shorter 'ipc_dir' in kv_connector_extra_config")


def remove_stale_sockets(ipc_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove the ``flowkv-*.sock`` files in ``ipc_dir`` that nobody listens on; return them.

    A socket file whose server is gone refuses connections. Files younger than
    a few seconds are left alone (a server may be between bind and listen),
    and so is anything that is not a socket.
    """
    removed: list[Path] = []
    now = time.time()
    try:
        candidates = sorted(Path(ipc_dir).glob("flowkv-*.sock"))
    except OSError:
        return removed
    for path in candidates:
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(info.st_mode) or now - info.st_mtime < _STALE_MIN_AGE_S:
            continue
        if _listening(path):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.debug("flowkv IPC: cannot remove stale socket %s: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        logger.info("flowkv IPC: removed %d stale socket file(s) in %s (their processes are gone)",
                    len(removed), ipc_dir)
    return removed


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket ``path`` (unsure counts as yes)."""
    try:
        return listener(path) is not None
    except OSError:
        return True


def _unlink_if_same(path: Path, identity: tuple[int, int] | None) -> None:
    """Remove ``path`` if it is still the file this process bound (device, inode)."""
    try:
        info = path.lstat()
        if identity is None or (info.st_dev, info.st_ino) == identity:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.debug("flowkv IPC: cannot remove %s: %s", path, exc)


def _encode_tokens(tokens: Sequence[int] | np.ndarray | None) -> bytes:
    if tokens is None:
        return b""
    return np.ascontiguousarray(np.asarray(tokens, dtype="<i8")).tobytes()


def _decode_tokens(body: bytes) -> np.ndarray:
    if len(body) % 8:
        raise ValueError(f"token body of {len(body)} bytes is not a whole number of int64")
    return np.frombuffer(body, dtype="<i8")


def _json_bytes(value: dict[str, Any]) -> bytes:
    # Engine stats may hold values JSON does not know (paths, enums): show them as text.
    return json.dumps(value, default=str, separators=(",", ":")).encode()


class LookupServer:
    """Serves requests on one Unix socket from a daemon thread (worker side).

    ``handler(header, tokens) -> reply_header`` runs on the server thread; a
    header with ``"oneway": true`` gets no reply. An exception in the handler
    becomes ``{"ok": false, "error": "..."}`` and the server goes on.
    """

    def __init__(self, path: str | os.PathLike[str], handler: Handler) -> None:
        self.path = Path(path)
        self._handler = handler
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._context = zmq.Context()
        self._thread = threading.Thread(target=self._serve, name=f"flowkv-ipc-{self.path.name}", daemon=True)
        self._identity: tuple[int, int] | None = None  # (device, inode) of the socket file bound
        self._at_exit: multiprocessing.util.Finalize | None = None

    def start(self) -> None:
        """Bind the socket and start serving; raises if the socket cannot be bound."""
        private_folder(self.path.parent, what="flowkv IPC")  # refused when another user could write it
        remove_stale_sockets(self.path.parent)
        if self.path.exists():
            # A leftover of a crashed process with the same instance id; binding would fail.
            self.path.unlink()
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"flowkv could not serve lookups on {self.path}: {self._error}") from self._error
        try:
            info = self.path.lstat()
            self._identity = (info.st_dev, info.st_ino)
        except OSError:
            pass
        # A process that exits without close() still takes its file along. multiprocessing runs
        # these finalizers at exit in the main process and in its children (fork or spawn),
        # where atexit alone would not run; a killed process leaves the file to the next start.
        self._at_exit = multiprocessing.util.Finalize(
            None, _unlink_if_same, args=(self.path, self._identity), exitpriority=_EXIT_PRIORITY
        )

    def _serve(self) -> None:
        try:
            socket = self._context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(f"ipc://{self.path}")
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_SERVER_POLL_MS):
                    continue
                frames = socket.recv_multipart()
                if len(frames) < 2:
                    continue
                identity, header_bytes = frames[0], frames[1]
                body = frames[2] if len(frames) > 2 else b""
                reply = self._answer(header_bytes, body)
                if reply is not None:
                    socket.send_multipart([identity, _json_bytes(reply)])
        finally:
            socket.close(linger=0)

    def _answer(self, header_bytes: bytes, body: bytes) -> dict[str, Any] | None:
        try:
            header = json.loads(header_bytes)
        except ValueError:
            logger.warning("flowkv IPC: dropped a message whose header is not JSON")
            return None
        try:
            reply = self._handler(header, _decode_tokens(body))
            reply.setdefault("ok", True)
        except Exception as exc:
            logger.exception("flowkv IPC: %s request failed", header.get("op"))
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if header.get("oneway"):
            return None
        reply["seq"] = header.get("seq")
        return reply

    def close(self) -> None:
        """Stop the thread, close the socket and remove the socket file."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._context.term()
        if self._at_exit is not None:
            self._at_exit.cancel()
            self._at_exit = None
        _unlink_if_same(self.path, self._identity)


class LookupClient:
    """Asks every worker of one vLLM instance (scheduler side).

    A question goes to all workers at once; the answer is the minimum over the
    workers, since a token is only cached when every tensor-parallel shard of
    its KV is. A worker that does not answer within ``timeout_ms`` makes the
    answer 0. Until that worker answers something again (a late reply counts),
    it is not asked and waited for: a dead worker costs one timeout, not one
    per request.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], *, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError(f"lookup timeout must be positive, got {timeout_ms} ms")
        self.timeout_ms = timeout_ms
        self._paths = [Path(path) for path in paths]
        for folder in dict.fromkeys(path.parent for path in self._paths):
            private_folder(folder, what="flowkv IPC")
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        for _ in self._paths:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            # Queue nothing for a worker that is not connected: a send fails at once.
            socket.setsockopt(zmq.IMMEDIATE, 1)
            socket.setsockopt(zmq.SNDHWM, 1024)
            self._sockets.append(socket)  # connected once its listener is checked (_trusted)
        # (device, inode) of the socket file whose listener was checked, per worker
        self._checked: list[tuple[int, int] | None] = [None] * len(self._paths)
        self._refused: set[tuple[int, int]] = set()  # socket files refused (logged once each)
        self._responsive = [True] * len(self._sockets)
        self._seq = itertools.count(1)
        # vLLM's scheduler is single-threaded, but a test or tool may share a client.
        self._lock = threading.Lock()
        self.timeouts = 0

    def ask(
        self, header: dict[str, Any], tokens: Sequence[int] | np.ndarray | None = None
    ) -> list[dict[str, Any]] | None:
        """Send ``header`` (and ``tokens``) to every worker and return their
        replies in rank order, or None if any worker did not answer in time."""
        body = _encode_tokens(tokens)
        with self._lock:
            self._drain()
            if not all(self._responsive):
                self._ping_unresponsive()
                return None
            seq = next(self._seq)
            message = _json_bytes({**header, "seq": seq})
            deadline = time.monotonic() + self.timeout_ms / 1000
            replies: list[dict[str, Any] | None] = [None] * len(self._sockets)
            sent = [self._trusted(rank) and self._send(socket, [message, body], deadline)
                    for rank, socket in enumerate(self._sockets)]
            poller = zmq.Poller()
            for socket in self._sockets:
                poller.register(socket, zmq.POLLIN)
            while any(reply is None and ok for reply, ok in zip(replies, sent)):
                left_ms = (deadline - time.monotonic()) * 1000
                if left_ms <= 0:
                    break
                for socket, _ in poller.poll(left_ms):
                    rank = self._sockets.index(socket)
                    while True:
                        reply = self._receive(socket)
                        if reply is None:
                            break
                        if reply.get("seq") == seq:
                            replies[rank] = reply
            missing = [rank for rank, reply in enumerate(replies) if reply is None]
            if missing:
                self.timeouts += 1
                for rank in missing:
                    self._responsive[rank] = False
                logger.warning(
                    "flowkv: worker rank(s) %s did not answer a %s within %d ms%s; "
                    "not waiting for them until they answer again",
                    missing, header.get("op"), self.timeout_ms,
                    "" if all(sent) else " (not connected)",
                )
                return None
            return replies  # type: ignore[return-value]

    def tell(self, header: dict[str, Any], tokens: Sequence[int] | np.ndarray | None = None) -> None:
        """Send ``header`` to every worker without waiting for an answer."""
        message = _json_bytes({**header, "oneway": True})
        body = _encode_tokens(tokens)
        with self._lock:
            for rank, socket in enumerate(self._sockets):
                if not self._trusted(rank):
                    continue
                try:
                    socket.send_multipart([message, body], flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # that worker is gone; its pins time out there

    def _trusted(self, rank: int) -> bool:
        """Whether worker ``rank``'s socket is served by a process of this user; connects it the first time.

        Checked again whenever the socket file changes (a restarted worker):
        a lookup socket is connected only to a listener whose credentials
        (``SO_PEERCRED``) were seen, so not even ZeroMQ's greeting goes to
        anyone else. One ``lstat`` per question when nothing changed.
        """
        path = self._paths[rank]
        try:
            info = os.lstat(path)
        except OSError:
            return False  # not bound yet (or gone): like a worker not connected
        identity = (info.st_dev, info.st_ino)
        if self._checked[rank] == identity:
            return True
        if identity in self._refused:
            return False
        try:
            if not stat.S_ISSOCK(info.st_mode):
                raise PermissionError(f"flowkv IPC: {path} is not a socket")
            peer = listener(path)
            if peer is None:
                return False  # not listening yet
            check_credentials(peer, what=f"flowkv IPC {path}")
        except PermissionError as exc:
            self._refused.add(identity)
            logger.error("%s; worker rank %d answers no lookups", exc, rank)
            return False
        except OSError:
            return False  # not listening yet
        if self._checked[rank] is not None:
            self._sockets[rank].disconnect(f"ipc://{path}")
        self._sockets[rank].connect(f"ipc://{path}")
        self._checked[rank] = identity
        return True

    @staticmethod
    def _send(socket: zmq.Socket, frames: list[bytes], deadline: float) -> bool:
        # IMMEDIATE makes a socket unwritable until its worker is connected;
        # wait for that no longer than the question's deadline.
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not socket.poll(left_ms, zmq.POLLOUT):
            return False
        try:
            socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _receive(self, socket: zmq.Socket) -> dict[str, Any] | None:
        try:
            frames = socket.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return json.loads(frames[0])
        except ValueError:
            return {}

    def _drain(self) -> None:
        """Drop stale replies; any reply at all shows that its worker is alive again."""
        for rank, socket in enumerate(self._sockets):
            while self._receive(socket) is not None:
                self._responsive[rank] = True

    def _ping_unresponsive(self) -> None:
        ping = _json_bytes({"op": "ping", "seq": 0})
        for rank, socket in enumerate(self._sockets):
            if not self._responsive[rank] and self._trusted(rank):
                try:
                    socket.send_multipart([ping, b""], flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass

    def close(self) -> None:
        """Close the sockets."""
        with self._lock:
            for socket in self._sockets:
                socket.close(linger=0)
            self._context.term()


def query_worker(
    path: str | os.PathLike[str], op: str = "stats", *, timeout_ms: int = 5000, **fields: Any
) -> dict[str, Any]:
    """Ask one worker's flowkv connector directly and return its reply.

    For tools and tests: ``query_worker(path, "stats")`` returns the worker
    engine's statistics. Raises ``TimeoutError`` when the worker does not
    answer and ``RuntimeError`` when it answers with an error.
    """
    client = LookupClient([path], timeout_ms=timeout_ms)
    try:
        replies = client.ask({"op": op, **fields})
    finally:
        client.close()
    if replies is None:
        raise TimeoutError(f"no flowkv worker answered on {path} within {timeout_ms} ms")
    reply = replies[0]
    if not reply.get("ok", False):
        raise RuntimeError(f"flowkv worker on {path} failed '{op}': {reply.get('error')}")
    return reply
