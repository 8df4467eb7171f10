"""The node server's wire protocol: framed JSON control messages on a Unix socket, KV in shared memory.

::

    client (a vLLM worker's ``server`` tier)            flowkv server (one per node)
      |-- hello {client, map} ------------------------>|  reply: server id, arena bytes, lease timeout,
      |<-------------------------------------------- --|  and (map) the arena's memfd (SCM_RIGHTS)
      |   mmap(that descriptor) once                   |
      |-- lookup {keys, pin, pin_s} ------------------>|  held per key; the leading run pinned
      |-- alloc {sizes} ------------------------------>|  [handle, offset] per chunk that fits
      |   gather straight into the mapped pages        |
      |-- commit {items: [handle, key, nbytes, meta]} >|  admitted per item; allocations handed over
      |-- get {keys} --------------------------------->|  [handle, offset, nbytes, meta] or null
      |   scatter straight from the mapped pages       |
      |== release {handles} (one-way) ===============>|  read references and unused rooms dropped
      |== unpin / release_owner (one-way) ===========>|
      |-- stats / events {since, wait_s} / snapshot -->|  status, admit/evict stream for a controller

A frame is a 4-byte little-endian length, then that many bytes of UTF-8
JSON: an object with ``op`` and ``id`` (a request) or ``id`` and ``ok`` (its
reply; ``error`` when not ok). ``id`` 0 marks a one-way message, which gets
no reply; the socket's order guarantees a later request sees its effect.
Nothing on the socket or in the shared pages is ever unpickled: KV bytes
are only ever viewed as tensors of the dtype named in a whitelist. A
request may carry ``trace`` (W3C trace context of the client's current
span), under which the server opens its own span.

Trust (the README's "Security"): the server serves its own uid (and, with
``--group``, that group) and nobody else. With no socket named, both sides
use :func:`default_socket_path`, in a folder only that user may use. Before
it sends anything, a client checks who listens (``SO_PEERCRED``: this uid,
or the trusted group). The arena is a memfd with no name in any folder: it
comes as a descriptor with the ``hello`` reply of the checked listener, and
the client maps it only when it is a memfd named like a server's, of the
server's uid (nothing to squat, plant, or point at a file to overwrite).
Calls that touch
what other clients wrote (``remove`` of their entries, ``snapshot``,
``events``, others' sessions in ``stats``) need the operator token that the
server writes 0600 beside its socket (:func:`operator_token_path`); a
process that can read it is the server's own user.

:class:`NodeConnection` is the synchronous client every caller uses (the
``server`` tier, ``flowkv server status``, a fleet controller): one call at
a time per connection, each bounded by a timeout; any failure closes the
connection (a late reply can never be taken for the next call's).
:func:`map_segment` maps the server's arena; :func:`view` makes a chunk's
tensor from an offset in it.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import socket
import stat
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from flowkv.local_peers import PeerCredentials, check_peer, socket_path_fits

__all__ = [
    "MAX_FRAME",
    "PROTOCOL_VERSION",
    "NodeConnection",
    "NodeError",
    "NodeRefused",
    "NodeUnavailable",
    "SEGMENT_NAME_PREFIX",
    "Segment",
    "default_socket_path",
    "operator_token_path",
    "read_operator_token",
    "dense_order",
    "dtype_from_name",
    "dtype_name",
    "map_segment",
    "view",
]

PROTOCOL_VERSION = 2  # 2: the arena comes as a descriptor (hello's ``map``), not a path
#: The name (memfd_create's) of every server's arena starts with this.
SEGMENT_NAME_PREFIX = "flowkv-node-"
# Descriptors one message may carry (a hello reply has one): more are a protocol error.
_FDS_SPACE = socket.CMSG_SPACE(4 * struct.calcsize("i"))
#: The largest frame either side accepts (a request names keys, never KV bytes).
MAX_FRAME = 64 << 20
_LENGTH = struct.Struct("<I")

# The dtypes a chunk may have: a name from the wire is looked up here, never with getattr.
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64",
                 "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


class NodeUnavailable(ConnectionError):
    """The server cannot be reached, hung up, or did not answer in time."""


class NodeRefused(NodeUnavailable):
    """The listener (or the segment it names) is not one this client trusts: nothing was sent to it."""


def default_socket_path() -> Path:
    """Where ``flowkv server`` listens and the ``server`` tier connects when no socket is named.

    ``$XDG_RUNTIME_DIR/flowkv/node.sock`` when that is set; else
    ``/run/flowkv-UID/node.sock`` when that folder exists or ``/run`` lets
    this user make it; else ``~/.cache/flowkv/run/node.sock``. Both sides
    compute the same from the same user's environment; the folder is made
    (0700) and checked by :func:`flowkv.local_peers.private_folder`.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR", "").strip()
    if runtime:
        return Path(runtime) / "flowkv" / "node.sock"
    run = Path("/run") / f"flowkv-{os.geteuid()}"
    if run.is_dir() or os.access("/run", os.W_OK | os.X_OK):
        return run / "node.sock"
    return Path.home() / ".cache" / "flowkv" / "run" / "node.sock"


def operator_token_path(socket_path: str | os.PathLike[str]) -> Path:
    """The file (0600) beside the server's socket that holds its operator token."""
    return Path(f"{socket_path}.token")


def read_operator_token(socket_path: str | os.PathLike[str]) -> str | None:
    """The operator token of the server on ``socket_path``, or None where this process cannot read it."""
    try:
        fd = os.open(operator_token_path(socket_path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 256).decode("ascii", "replace").strip() or None
    finally:
        os.close(fd)


class NodeError(RuntimeError):
    """The server answered, with an error (a bad request; the connection stays usable)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored on a node server")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; any other string raises ``ValueError``."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype name {name!r}") from None


def dense_order(tensor: torch.Tensor) -> list[int]:
    """The order of ``tensor``'s dims, outermost first, in which its bytes lie (from its strides)."""
    return sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d) if tensor.shape[d] > 1 else 0, d))


# -- frames ------------------------------------------------------------------------


def encode_frame(message: dict[str, Any]) -> bytes:
    """One frame: length, then the message as compact UTF-8 JSON."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"message of {len(body)} B is over the {MAX_FRAME} B a frame may hold")
    return _LENGTH.pack(len(body)) + body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a message may hold")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise ValueError(f"{text[:32]} is not a finite number")
    return value


def decode_body(body: bytes) -> dict[str, Any]:
    """A frame's body as a message (a JSON object), or ``ValueError``.

    Strict JSON: ``NaN``, ``Infinity`` and numbers that overflow a float are
    refused (``int(inf)`` raises ``OverflowError`` in whatever handler meets
    one), and so is nesting deeper than the parser's recursion limit.
    """
    try:
        message = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("a message nested too deep") from None
    if not isinstance(message, dict):
        raise ValueError(f"a message is a JSON object, got {type(message).__name__}")
    return message


def frame_length(prefix: bytes) -> int:
    """The body length a frame's 4-byte prefix announces, checked against ``MAX_FRAME``."""
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_FRAME:
        raise ValueError(f"frame of {length} B announced, over the {MAX_FRAME} B limit")
    return length


class NodeConnection:
    """A synchronous connection to a node server: ``call`` (request and reply) and ``send`` (one-way).

    Thread-safe: one call at a time. Every call is bounded by ``timeout_s``;
    a timeout, a broken socket or an unreadable reply raises
    :class:`NodeUnavailable` and closes the connection for good (make a new
    one). An error the server answers raises :class:`NodeError` and leaves
    the connection open.

    >>> conn = NodeConnection.connect("/run/flowkv/node.sock", timeout_s=1.0)   # doctest: +SKIP
    >>> conn.call("stats")["entries"]                                             # doctest: +SKIP
    """

    def __init__(self, sock: socket.socket, *, timeout_s: float, peer: PeerCredentials | None = None) -> None:
        self._sock: socket.socket | None = sock
        self.timeout_s = timeout_s
        #: who listens (checked before anything was sent)
        self.peer = peer
        self._lock = threading.Lock()
        self._next_id = 1
        self._fds: list[int] = []  # descriptors that came with the reply being read
        self._segment_fd: int | None = None  # the arena's, from hello(map=True), until taken
        #: the server's ``hello`` answer, once ``hello`` was called
        self.hello_reply: dict[str, Any] | None = None

    @classmethod
    def connect(cls, path: str | os.PathLike[str] | None = None, *, timeout_s: float,
                group: int | None = None) -> NodeConnection:
        """Connect to the server listening on ``path`` (default: :func:`default_socket_path`).

        :class:`NodeUnavailable` when none listens; :class:`NodeRefused` when
        the listener runs as another user (not this uid, nor ``group``): then
        not a byte was sent to it.
        """
        path = socket_path_fits(default_socket_path() if path is None else path, what="node server socket path",
                                fix="choose a shorter one")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except OSError as exc:
            sock.close()
            raise NodeUnavailable(f"no flowkv server on {path}: {exc.strerror or exc}") from exc
        try:
            peer = check_peer(sock, what=f"flowkv server socket {path}", group=group)
        except (PermissionError, OSError) as exc:
            sock.close()
            raise NodeRefused(str(exc)) from exc
        return cls(sock, timeout_s=timeout_s, peer=peer)

    @property
    def closed(self) -> bool:
        return self._sock is None

    def hello(self, client: str, *, operator_token: str | None = None, map: bool = False,
              **fields: Any) -> dict[str, Any]:
        """Introduce this client (a label in the server's status; the server names it by its credentials).

        ``operator_token`` (:func:`read_operator_token`) makes this connection
        an operator's: it may remove any entry, take snapshots and events, and
        see every client in ``stats``. ``map`` asks for the arena's
        descriptor (:meth:`take_segment_fd`, then :func:`map_segment`).
        """
        if operator_token:
            fields["operator_token"] = operator_token
        if map:
            fields["map"] = True
        reply = self._call("hello", dict(client=client, version=PROTOCOL_VERSION, **fields), keep_fds=map)
        if reply.get("version") != PROTOCOL_VERSION:
            self.close()
            raise NodeUnavailable(f"server speaks protocol {reply.get('version')}, this client {PROTOCOL_VERSION}")
        self.hello_reply = reply
        return reply

    def take_segment_fd(self) -> int:
        """The arena's descriptor that came with ``hello(map=True)``, now the caller's to close;
        :class:`NodeRefused` when none came."""
        with self._lock:
            fd, self._segment_fd = self._segment_fd, None
        if fd is None:
            raise NodeRefused("the server's hello reply carried no arena descriptor")
        return fd

    def call(self, op: str, *, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request and wait for its reply (the reply's fields, ``ok`` and ``id`` included)."""
        return self._call(op, fields, timeout_s=timeout_s)

    def _call(self, op: str, fields: dict[str, Any], *, timeout_s: float | None = None,
              keep_fds: bool = False) -> dict[str, Any]:
        with self._lock:
            sock = self._usable()
            request_id = self._next_id
            self._next_id += 1
            try:
                sock.settimeout(timeout_s if timeout_s is not None else self.timeout_s)
                sock.sendall(encode_frame({"op": op, "id": request_id, **fields}))
                reply = decode_body(self._read_exactly(sock, frame_length(self._read_exactly(sock, 4))))
            except (OSError, ValueError) as exc:  # socket.timeout is an OSError
                self._drop()
                raise NodeUnavailable(f"{op}: {type(exc).__name__}: {exc}") from exc
            finally:
                fds, self._fds = self._fds, []
            if keep_fds and len(fds) == 1 and reply.get("ok"):
                _close_fds([self._segment_fd] if self._segment_fd is not None else [])
                self._segment_fd = fds.pop()
            _close_fds(fds)  # none asked for: never kept (a descriptor holds what it names alive)
            if reply.get("id") != request_id:
                self._drop()
                raise NodeUnavailable(f"{op}: reply {reply.get('id')} to request {request_id}")
        if not reply.get("ok"):
            raise NodeError(f"{op}: {reply.get('error', 'failed')}")
        return reply

    def send(self, op: str, **fields: Any) -> None:
        """A one-way message (no reply): its effect comes before any later request's."""
        with self._lock:
            sock = self._usable()
            try:
                sock.settimeout(self.timeout_s)
                sock.sendall(encode_frame({"op": op, "id": 0, **fields}))
            except (OSError, ValueError) as exc:
                self._drop()
                raise NodeUnavailable(f"{op}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _usable(self) -> socket.socket:
        if self._sock is None:
            raise NodeUnavailable("connection closed")
        return self._sock

    def _drop(self) -> None:
        fd, self._segment_fd = self._segment_fd, None
        _close_fds([fd] if fd is not None else [])
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _read_exactly(self, sock: socket.socket, n: int) -> bytes:
        """``n`` bytes; descriptors that come with them (``SCM_RIGHTS``) are kept in ``_fds``."""
        parts = bytearray()
        while len(parts) < n:
            got, ancillary, flags, _ = sock.recvmsg(n - len(parts), _FDS_SPACE, socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    count = len(data) // struct.calcsize("i")
                    self._fds.extend(struct.unpack(f"{count}i", data[:count * struct.calcsize("i")]))
            if flags & socket.MSG_CTRUNC:
                raise ValueError("the server sent more descriptors than a message may carry")
            if not got:
                raise ConnectionResetError("the server closed the connection")
            parts += got
        return bytes(parts)


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- the shared arena ------------------------------------------------------------------


@attrs.define(eq=False)
class Segment:
    """A server's arena as this process maps it (``buffer`` is a uint8 view of the whole segment)."""

    name: str
    nbytes: int
    buffer: torch.Tensor
    # The mapping stays alive as long as any tensor views it (torch.frombuffer keeps a reference).
    _mapping: Any = None

    def close(self) -> None:
        """Drop this object's references; views handed out keep the mapping until they go."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._mapping = None


def map_segment(fd: int, nbytes: int, *, owner: int | None = None) -> Segment:
    """Map the server's arena from its descriptor (:meth:`NodeConnection.take_segment_fd`), shared and
    writable; ``fd`` is closed either way.

    Mapped only when it is a memfd named like a server's arena, a regular
    file of ``owner`` (the server's uid from ``SO_PEERCRED``; default this
    user) of at least ``nbytes`` bytes. Any other descriptor — a file a
    server was tricked into passing, a device, a pipe — is refused
    (:class:`NodeRefused`): a root client never writes into what it was
    handed unless it is a server's own arena.
    """
    owner = os.geteuid() if owner is None else owner
    try:
        info = os.fstat(fd)
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = "?"
        if (not name.startswith(f"/memfd:{SEGMENT_NAME_PREFIX}") or not stat.S_ISREG(info.st_mode)
                or info.st_uid != owner):
            raise NodeRefused(f"the descriptor the server sent is not a flowkv arena of uid {owner} ({name}, mode "
                              f"{info.st_mode:o}, uid {info.st_uid})")
        if info.st_size < nbytes:
            raise NodeUnavailable(f"the arena {name} holds {info.st_size} B, not the {nbytes} B announced")
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) \
            if nbytes else None
    finally:
        os.close(fd)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return Segment(name=name.removeprefix("/").split(" ", 1)[0], nbytes=nbytes, buffer=buffer, mapping=mapping)


def view(buffer: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype,
         order: Sequence[int] | None = None) -> torch.Tensor:
    """The tensor of logical ``shape`` and ``dtype`` whose bytes start at ``offset`` of ``buffer``.

    The bytes lie in ``order`` (dims outermost first; default: ``shape``'s
    own order, or the ``dim_order`` a chunk shape carries): the view is then
    the strided logical view of them. No copy.
    """
    if order is None:
        order = getattr(shape, "dim_order", None)
    shape = tuple(int(d) for d in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if offset < 0 or offset + nbytes > buffer.numel():
        raise ValueError(f"{nbytes} B at offset {offset} lie outside the {buffer.numel()} B segment")
    data = buffer[offset:offset + nbytes].view(dtype)
    order = tuple(int(d) for d in order) if order is not None else tuple(range(len(shape)))
    if sorted(order) != list(range(len(shape))):
        raise ValueError(f"order {order} is not a permutation of the dims of {shape}")
    if order == tuple(range(len(shape))):
        return data.view(shape)
    return data.view(tuple(shape[d] for d in order)).permute(tuple(order.index(d) for d in range(len(shape))))
