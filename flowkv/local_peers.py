"""Trust between processes of one machine: folders only this user may use, and who is on a Unix socket.

flowkv's local sockets (a worker's lookup socket, the node server's socket)
live in folders that must be private: whoever may write the folder may
unlink a socket and bind their own in its place, then read what clients
send and answer what they like. :func:`private_folder` makes such a folder
0700, or checks that an existing one is this user's and no looser, and
refuses it otherwise with an error that says what to do.
:func:`peer_credentials` answers who (pid, uid, gid) holds the other end of
a connected Unix socket (``SO_PEERCRED``: set by the kernel, not claimed by
the peer); :func:`check_peer` refuses a peer of another user.
:func:`socket_path_fits` and :func:`listener` are what every Unix socket of
flowkv's needs before it binds or connects: the path length Linux allows,
and who (if anyone) listens on a path already there.
:func:`process_start` tells a live process from a later one that reuses its
pid (the node server keeps a gone client's pages from reuse while its
process lives).

::

    >>> from flowkv.local_peers import private_folder
    >>> private_folder("/tmp/flowkv-demo-folder")       # doctest: +SKIP
    PosixPath('/tmp/flowkv-demo-folder')
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "MAX_SOCKET_PATH",
    "PeerCredentials",
    "check_credentials",
    "check_peer",
    "listener",
    "peer_credentials",
    "private_folder",
    "process_start",
    "socket_path_fits",
]

_CREDENTIALS = struct.Struct("3i")
#: The longest path a Unix socket may have on Linux (``sun_path`` holds 108 bytes, the NUL included).
MAX_SOCKET_PATH = 107


class PeerCredentials(NamedTuple):
    """The process on the other end of a Unix socket, as the kernel names it."""

    pid: int
    uid: int
    gid: int


def private_folder(path: str | os.PathLike[str], *, what: str = "flowkv", group: int | None = None) -> Path:
    """``path`` as a folder only this user may use: made 0700 when missing, else checked.

    An existing folder must be a real folder (not a symlink), owned by this
    process's effective uid, and give others no access (with ``group``, that
    group may enter and read it: 0750). Anything else raises
    ``PermissionError`` naming the folder, its owner and mode, and the fix.
    """
    folder = Path(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    me = os.geteuid()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{what}: {folder} is not a folder (a symlink or a file): another user may have "
                              f"put it there; remove it, or choose another folder")
    if info.st_uid != me:
        raise PermissionError(f"{what}: {folder} belongs to uid {info.st_uid}, not to this process's uid {me}: "
                              f"its owner could replace the sockets in it and read or answer what is sent there; "
                              f"remove it, or choose a folder of your own")
    allowed = 0o050 if group is not None and info.st_gid == group else 0
    if info.st_mode & 0o077 & ~allowed:
        raise PermissionError(f"{what}: {folder} has mode {stat.S_IMODE(info.st_mode):o}: other users may "
                              f"replace the sockets in it; chmod 700 {folder}, or remove it")
    return folder


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """Who holds the other end of the connected Unix socket ``sock`` (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    return PeerCredentials(*_CREDENTIALS.unpack(raw))


def check_peer(sock: socket.socket, *, what: str, group: int | None = None) -> PeerCredentials:
    """The peer's credentials when it runs as this user (or in ``group``); ``PermissionError`` otherwise."""
    return check_credentials(peer_credentials(sock), what=what, group=group)


def check_credentials(peer: PeerCredentials, *, what: str, group: int | None = None) -> PeerCredentials:
    """``peer`` when it runs as this user (or in ``group``); ``PermissionError`` naming it otherwise."""
    if peer.uid == os.geteuid() or (group is not None and peer.gid == group):
        return peer
    allowed = f"uid {os.geteuid()}" + (f" or gid {group}" if group is not None else "")
    raise PermissionError(f"{what}: the process on the other end (pid {peer.pid}) runs as uid {peer.uid} "
                          f"gid {peer.gid}, not {allowed}: refusing to talk to it")


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat``), or None once it has
    exited (a zombie included: its memory is gone) or where it cannot be seen (pid 0: another pid
    namespace). Equal answers at two times mean the same process, not a later one given its pid."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read()
    except OSError:
        return None
    # The name in parentheses may hold spaces and parentheses: the fields start after the last ")".
    fields = text[text.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22, starttime


def socket_path_fits(path: str | os.PathLike[str], *, what: str, fix: str) -> Path:
    """``path`` as a Path, or ``ValueError`` when it is longer than a Unix socket's path may be (``fix``: how
    to get a shorter one)."""
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        raise ValueError(f"{what} {os.fspath(path)!r} is {size} bytes, over the {MAX_SOCKET_PATH} a Unix socket "
                         f"allows; {fix}")
    return Path(path)


def listener(path: str | os.PathLike[str], *, timeout_s: float = 1.0) -> PeerCredentials | None:
    """Who accepts connections on the Unix socket ``path`` (``SO_PEERCRED``), or None when nobody does
    (connection refused: a socket file whose process is gone, or no socket there).

    Any other failure (a timeout, a full backlog, no permission) raises
    ``OSError``: unsure, which a caller must not take for "nobody" (a busy
    live server's socket is never removed). The probe sends nothing.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout_s)
    try:
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        return peer_credentials(probe)
    finally:
        probe.close()
