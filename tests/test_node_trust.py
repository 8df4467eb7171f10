"""Who may talk to a node server, and what a client may do to entries it did not write.

Real ``flowkv server`` processes; the other local user is ``nobody``
(``local_users``), whose helpers are stdlib-only scripts speaking the wire
protocol themselves.
"""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from local_users import (  # noqa: F401 - shared_folder is a fixture
    LISTENER,
    NOBODY,
    as_nobody,
    needs_root,
    shared_folder,
    spawn_as_nobody,
)
from node_servers import (  # noqa: F401 - node_servers is a fixture
    ROOT,
    NodeServerProcess,
    chunk_kv,
    engine,
    keys_of,
    kv_for,
    node_pipeline,
    node_servers,
    slots_for,
)

from flowkv import KVTransfer
from flowkv.tiers import node_protocol as wire

TOKENS = 160

# A group member's client: speaks the frames itself (nobody cannot import flowkv), prints each reply.
MEMBER = """
import json, mmap, socket, struct, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(30)
sock.connect(sys.argv[1])
def call(i, message):
    body = json.dumps(dict(message, id=i)).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)
    n = struct.unpack("<I", sock.recv(4, socket.MSG_WAITALL))[0]
    return json.loads(sock.recv(n, socket.MSG_WAITALL))
try:
    open(sys.argv[1] + ".token").read()
    token = "READ"
except OSError as exc:
    token = exc.errno
keys = json.loads(sys.argv[2])
body = json.dumps({"op": "hello", "client": "member", "map": True, "id": 1}).encode()
sock.sendall(struct.pack("<I", len(body)) + body)
prefix, fds, _, _ = socket.recv_fds(sock, 4, 4, socket.MSG_WAITALL)  # the arena comes with the reply
out = {"token": token, "hello": json.loads(sock.recv(struct.unpack("<I", prefix)[0], socket.MSG_WAITALL))}
arena = mmap.mmap(fds[0], out["hello"]["segment_bytes"])  # shared, writable: a member's worker maps it
out["mapped"] = len(arena)
arena.close()
out["lookup"] = call(2, {"op": "lookup", "keys": keys})
out["remove"] = call(3, {"op": "remove", "keys": keys[:1]})
out["snapshot"] = call(4, {"op": "snapshot"})
out["events"] = call(5, {"op": "events", "since": 0})
out["stats"] = call(6, {"op": "stats"})
print(json.dumps(out))
"""


def stored_by_an_engine(socket: Path, folder: Path, first: int = 0) -> tuple[list[str], torch.Tensor]:
    e = engine(node_pipeline(folder, socket, name=f"writer-{first}"))
    ids = torch.arange(first, first + TOKENS)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(5),
                              slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS
    keys = keys_of(e, ids)
    e.close()
    return keys, ids


def loads_back(pipeline: Path, ids: torch.Tensor) -> int:
    e = engine(pipeline)
    slots = slots_for(TOKENS)
    dst = kv_for(6)
    loaded = int(e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask.sum())
    assert torch.equal(chunk_kv(dst, slots[:loaded]), chunk_kv(kv_for(5), slots[:loaded]))
    e.close()
    return loaded


def test_with_no_socket_named_both_sides_find_the_same_private_one(tmp_path, monkeypatch):
    runtime = Path(tempfile.mkdtemp(prefix="fkvx-"))  # short: a socket path fits 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    expected = runtime / "flowkv" / "node.sock"
    assert wire.default_socket_path() == expected
    server = NodeServerProcess(expected, extra=["--default-socket"], env=env, log=tmp_path / "server.log")
    old = os.umask(0)  # the loosest: the modes are the server's own
    try:
        server.start()
    finally:
        os.umask(old)
    try:
        assert server.fields["socket"] == str(expected)
        modes = {path: stat.S_IMODE(os.lstat(path).st_mode) for path in
                 (expected.parent, expected, wire.operator_token_path(expected))}
        assert list(modes.values()) == [0o700, 0o600, 0o600]
        # The arena is a memfd handed over the socket: no file of it anywhere for anyone to plant or open.
        assert server.fields["segment"].startswith(f"memfd:{wire.SEGMENT_NAME_PREFIX}")
        # A pipeline with no socket line (as the shipped node pipelines are) reaches the same server.
        pipeline = tmp_path / "no-socket.toml"
        pipeline.write_text(node_pipeline(tmp_path, expected).read_text().replace(f'socket = "{expected}"\n', ""))
        assert "socket" not in pipeline.read_text()
        e = engine(pipeline)
        ids = torch.arange(TOKENS)
        assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(5),
                                  slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS
        e.close()
        assert loads_back(pipeline, ids) == TOKENS
        status = subprocess.run([sys.executable, "-m", "flowkv.cli", "server", "status", "--json"],
                                capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["memory"]["entries"] == 10
        assert server.stop() == 0
        assert not os.path.lexists(expected) and not wire.operator_token_path(expected).exists()
    finally:
        server.kill()


@needs_root
def test_a_squatter_of_another_user_hears_nothing_and_the_real_server_says_why_it_cannot_start(
        shared_folder, node_servers, tmp_path):
    path = shared_folder / "node.sock"  # a socket given in a folder others may write, like /tmp
    squatter = spawn_as_nobody(LISTENER, str(path), "12")
    try:
        assert squatter.stdout.readline().strip() == "listening"
        with pytest.raises(wire.NodeRefused, match=rf"runs as uid {NOBODY.pw_uid}.*refusing to talk to it"):
            wire.NodeConnection.connect(path, timeout_s=5.0)
        e = engine(node_pipeline(tmp_path, path, name="to-squatter"))
        ids = torch.arange(TOKENS)
        assert e.lookup(ids) == 0
        assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(5), slot_mapping=slots_for(TOKENS))).stored_tokens == 0
        tier = e.stats()["tiers"]["node"]
        assert tier["connects"] == 0 and tier["calls"] == 0
        e.close()
        refused = subprocess.run([sys.executable, "-m", "flowkv.cli", "server", "--socket", str(path),
                                  "--memory", "16MiB"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert refused.returncode == 1
        assert f"a process of uid {NOBODY.pw_uid}" in refused.stderr and "not a flowkv server" in refused.stderr
    finally:
        out, _ = squatter.communicate(timeout=60)
    assert "received 0 " in out  # clients connected, checked who listens, and hung up: no byte sent
    # The honest path: a server of this user on a socket of its own serves the same engine code.
    honest = node_servers("honest")
    keys, ids = stored_by_an_engine(honest.socket, tmp_path)
    assert loads_back(node_pipeline(tmp_path, honest.socket, name="honest"), ids) == TOKENS


def test_a_descriptor_is_mapped_only_when_it_is_a_flowkv_arena_of_the_servers_uid(tmp_path):
    victim = tmp_path / "victim"  # a file of this user a hostile server would like written over
    victim.write_bytes(b"precious" * 512)
    other = os.memfd_create("something-else")
    os.ftruncate(other, 4096)
    read, write = os.pipe()
    os.close(write)
    for fd in (os.open(victim, os.O_RDWR), other, read):
        with pytest.raises(wire.NodeRefused, match="not a flowkv arena"):
            wire.map_segment(fd, 4096)
        with pytest.raises(OSError):
            os.fstat(fd)  # closed, refused or not
    arena = os.memfd_create(f"{wire.SEGMENT_NAME_PREFIX}test")
    os.ftruncate(arena, 4096)
    with pytest.raises(wire.NodeRefused, match="not a flowkv arena of uid 12345"):
        wire.map_segment(os.dup(arena), 4096, owner=12345)
    with pytest.raises(wire.NodeUnavailable, match="not the 8192 B announced"):
        wire.map_segment(os.dup(arena), 8192)
    assert wire.map_segment(arena, 4096).nbytes == 4096
    assert victim.read_bytes() == b"precious" * 512


def test_only_a_client_that_asks_gets_the_arena_and_it_is_no_file(node_servers):
    server = node_servers("fds")
    plain = server.connect("plain", operator=False)  # a status client: no descriptor kept
    with pytest.raises(wire.NodeRefused, match="no arena descriptor"):
        plain.take_segment_fd()
    mapping = wire.NodeConnection.connect(server.socket, timeout_s=10.0)
    reply = mapping.hello("mapping", map=True)
    fd = mapping.take_segment_fd()
    assert os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{wire.SEGMENT_NAME_PREFIX}")
    segment = wire.map_segment(fd, int(reply["segment_bytes"]))
    assert segment.nbytes == reply["segment_bytes"] and f"memfd:{segment.name.split(':', 1)[1]}" == reply["segment"]
    for conn in (plain, mapping):
        conn.close()
    segment.close()


def test_without_the_operator_token_a_client_takes_no_snapshot_events_or_other_clients(node_servers, tmp_path):
    server = node_servers("operator")
    keys, ids = stored_by_an_engine(server.socket, tmp_path)
    watcher = server.connect("watcher")  # with the token: an operator
    plain = server.connect("plain", operator=False)
    for op in ("snapshot", "events"):
        with pytest.raises(wire.NodeError, match=f"{op} needs the operator token"):
            plain.call(op)
    stats = plain.call("stats")
    assert [s["label"] for s in stats["sessions"]] == ["plain"]  # itself only
    assert {s["label"] for s in watcher.call("stats")["sessions"]} >= {"watcher", "plain"}
    assert sorted(watcher.call("snapshot")["keys"]) == sorted(keys)
    # Clients are named by their credentials: a declared name is only a label.
    impostor = server.connect(stats["sessions"][0]["client"], operator=False)
    mine = impostor.call("stats")["sessions"]
    assert mine[0]["client"] != stats["sessions"][0]["client"] and mine[0]["client"].startswith(f"uid{os.geteuid()}:")
    with pytest.raises(wire.NodeError, match="operator_token is not"):
        server.connect("forger", operator=False).call("hello", client="forger", operator_token="0" * 64)
    assert server.status()["requests"]["operator_refused"] == 2
    for conn in (watcher, plain, impostor):
        conn.close()
    assert loads_back(node_pipeline(tmp_path, server.socket, name="after"), ids) == TOKENS


@needs_root
def test_a_group_member_reads_but_cannot_remove_snapshot_or_read_the_token(shared_folder, tmp_path):
    group = grp.getgrgid(NOBODY.pw_gid).gr_name
    folder = shared_folder / "srv"
    folder.mkdir(mode=0o755)
    socket = folder / "node.sock"
    server = NodeServerProcess(socket, extra=["--group", group], log=tmp_path / "group.log").start()
    try:
        assert stat.S_IMODE(socket.stat().st_mode) == 0o660 and socket.stat().st_gid == NOBODY.pw_gid
        keys, ids = stored_by_an_engine(socket, tmp_path)
        done = as_nobody(MEMBER, str(socket), json.dumps(keys))
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["token"] == 13  # EACCES: the token is the server's user's
        assert out["mapped"] == out["hello"]["segment_bytes"] > 0  # the arena, over the socket: no file mode
        assert out["lookup"]["held"] == [True] * 10  # a member uses the cache
        for op in ("remove", "snapshot", "events"):
            assert not out[op]["ok"] and "operator token" in out[op]["error"]
        assert [s["label"] for s in out["stats"]["sessions"]] == ["member"]
        assert loads_back(node_pipeline(tmp_path, socket, name="owner"), ids) == TOKENS  # nothing removed
    finally:
        server.stop()
