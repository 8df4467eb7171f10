"""The scheduler<->worker lookup sockets on a machine with other users.

The folder is this user's own (0700); one another user made, or one with a
looser mode, is refused with a clear error; and the scheduler talks only to
a worker socket whose listener runs as this user (``SO_PEERCRED``), so an
impostor bound there hears nothing, not even ZeroMQ's greeting. The other
user is ``nobody`` (``local_users``).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from flowkv.integration._ipc import LookupClient, LookupServer, default_ipc_dir, socket_path
from local_users import LISTENER, NOBODY, needs_root, shared_folder, spawn_as_nobody  # noqa: F401 - a fixture


def answer_hits(header: dict, tokens: np.ndarray) -> dict:
    return {"hits": int(tokens.size)}


def test_the_default_folder_is_made_0700_by_its_owner(monkeypatch, request):
    # A short temporary folder of its own: pytest's numbered one, under xdist's worker folder, can
    # leave no room for the socket's name in a Unix socket's 107 bytes.
    tmp_path = Path(tempfile.mkdtemp(prefix="fkv-ipc-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = default_ipc_dir()
    assert folder == tmp_path / f"flowkv-{os.getuid()}" and not folder.exists()
    old = os.umask(0)
    try:
        server = LookupServer(socket_path(folder, "default", 0, 0), answer_hits)
        server.start()
    finally:
        os.umask(old)
    try:
        info = folder.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        client = LookupClient([server.path], timeout_ms=5000)
        assert client.ask({"op": "lookup"}, [1, 2, 3]) == [{"hits": 3, "ok": True, "seq": 1}]
        client.close()
    finally:
        server.close()


def test_an_existing_folder_with_a_looser_mode_is_refused_on_both_sides(tmp_path):
    folder = tmp_path / "ipc"
    folder.mkdir()
    folder.chmod(0o777)  # pre-created by someone who wants to swap the sockets in it
    path = socket_path(folder, "loose", 0, 0)
    with pytest.raises(PermissionError, match=rf"{folder} has mode 777.*chmod 700"):
        LookupServer(path, answer_hits).start()
    with pytest.raises(PermissionError, match="has mode 777"):
        LookupClient([path], timeout_ms=1000)
    assert not path.exists()
    folder.chmod(0o700)  # the fix the error names
    server = LookupServer(path, answer_hits)
    server.start()
    client = LookupClient([path], timeout_ms=5000)
    assert client.ask({"op": "lookup"}, [7])[0]["hits"] == 1
    client.close()
    server.close()


@needs_root
def test_a_folder_owned_by_another_user_is_refused(shared_folder):
    folder = shared_folder / f"flowkv-{os.getuid()}"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY.pw_uid, NOBODY.pw_gid)
    path = socket_path(folder, "theirs", 0, 0)
    with pytest.raises(PermissionError, match=rf"belongs to uid {NOBODY.pw_uid}, not to this process's uid 0"):
        LookupServer(path, answer_hits).start()
    with pytest.raises(PermissionError, match="belongs to uid"):
        LookupClient([path], timeout_ms=1000)


@needs_root
def test_the_scheduler_sends_nothing_to_a_listener_of_another_user(shared_folder, tmp_path):
    ours = tmp_path / "ipc"  # private, this user's: passes the folder check
    honest = LookupServer(socket_path(ours, "mixed", 0, 0), answer_hits)
    honest.start()
    # An impostor's socket in this user's folder (however it got there: here root moves it in).
    theirs = shared_folder / "impostor.sock"
    impostor = spawn_as_nobody(LISTENER, str(theirs), "8")
    try:
        assert impostor.stdout.readline().strip() == "listening"
        planted = socket_path(ours, "mixed", 0, 1)
        os.rename(theirs, planted)
        client = LookupClient([honest.path, planted], timeout_ms=1000)
        assert client.ask({"op": "lookup"}, [1, 2]) is None  # rank 1 is no worker of ours: no answer
        assert client.ask({"op": "lookup"}, [1, 2]) is None
        client.tell({"op": "release"})
        # The honest rank alone is served as before.
        alone = LookupClient([honest.path], timeout_ms=5000)
        assert alone.ask({"op": "lookup"}, [1, 2])[0]["hits"] == 2
        alone.close()
        # The impostor is replaced by a real worker of this user: the same client asks it.
        planted.unlink()
        replacement = LookupServer(planted, answer_hits)
        replacement.start()
        try:
            answer = None
            deadline = time.monotonic() + 60  # readiness, not speed: the unresponsive rank is pinged first
            while answer is None and time.monotonic() < deadline:
                answer = client.ask({"op": "lookup"}, [1, 2, 3])
                time.sleep(0.05)
            assert [a["hits"] for a in answer] == [3, 3]
        finally:
            client.close()
            replacement.close()
    finally:
        out, err = impostor.communicate(timeout=60)
        honest.close()
    assert "received 0 " in out, (out, err)  # the probe connected and hung up: not a byte sent


def test_one_probe_tells_a_live_listener_from_a_socket_file_left_behind_and_one_length_limit(tmp_path):
    import socket

    from flowkv.integration._ipc import remove_stale_sockets
    from flowkv.local_peers import MAX_SOCKET_PATH, listener, socket_path_fits
    from flowkv.tiers.node_protocol import NodeConnection

    live, left = tmp_path / "flowkv-live.sock", tmp_path / "flowkv-left.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(live))
    listening.listen()
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(str(left))  # bound, then its process "died": the file stays, nobody listens
    gone.close()
    try:
        assert listener(live) == (os.getpid(), os.geteuid(), os.getegid())
        assert listener(left) is None and listener(tmp_path / "none.sock") is None
        old = time.time() - 3600  # past the age a socket between bind and listen is given
        for path in (live, left):
            os.utime(path, (old, old), follow_symlinks=False)
        assert remove_stale_sockets(tmp_path) == [left] and live.exists()
    finally:
        listening.close()
    too_long = tmp_path / ("x" * MAX_SOCKET_PATH)
    with pytest.raises(ValueError, match=f"over the {MAX_SOCKET_PATH} a Unix socket allows; shorter"):
        socket_path_fits(too_long, what="socket", fix="shorter")
    # The same limit, and message, from both socket users.
    with pytest.raises(ValueError, match=f"over the {MAX_SOCKET_PATH} a Unix socket allows"):
        socket_path(tmp_path / ("y" * MAX_SOCKET_PATH), "i", 0, 0)
    with pytest.raises(ValueError, match=f"over the {MAX_SOCKET_PATH} a Unix socket allows"):
        NodeConnection.connect(too_long, timeout_s=1.0)
