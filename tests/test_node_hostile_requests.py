"""A node server under hostile or broken requests, from a real client process's socket.

Each test sends what a malicious or buggy client could (non-finite numbers,
wrong types, impossible shapes, endless pin owners, garbage frames) to a real
``flowkv server`` process, and checks both halves: the attack gains nothing
(no arena bytes lost, no table that grows, no reader broken) and an honest
engine on the same server keeps storing and loading.
"""

from __future__ import annotations

import socket
import struct

import pytest
import torch

from node_servers import (  # noqa: F401 - node_servers is a fixture
    CHUNK,
    chunk_kv,
    engine,
    kv_for,
    node_pipeline,
    node_servers,
    slots_for,
    wait_for,
)

from flowkv import KVTransfer
from flowkv.tiers import node_protocol as wire

TOKENS = 160  # 10 chunks of 1 KiB
MIB = 1 << 20
LEASE_S = 1.0


class RawClient:
    """A client that writes frame bodies of its own making (what NodeConnection would never send)."""

    def __init__(self, path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30.0)
        self.sock.connect(str(path))
        self.next_id = 1
        # The operator's token: every op is open to it, so only the request's own fields are refused.
        assert self.call({"op": "hello", "client": "raw", "operator_token": wire.read_operator_token(path)})["ok"]

    def send_body(self, body: bytes) -> None:
        self.sock.sendall(struct.pack("<I", len(body)) + body)

    def reply(self) -> dict | None:
        """The next reply, or None when the server hung up."""
        prefix = self._read(4)
        if prefix is None:
            return None
        body = self._read(wire.frame_length(prefix))
        return None if body is None else wire.decode_body(body)

    def call(self, message: dict) -> dict:
        message = {**message, "id": self.next_id}
        self.next_id += 1
        self.send_body(wire.encode_frame(message)[4:])
        reply = self.reply()
        assert reply is not None and reply["id"] == message["id"]
        return reply

    def call_text(self, text: str) -> dict | None:
        """A request written as JSON text (``{id}`` filled in): its reply, or None when dropped."""
        self.send_body(text.replace("{id}", str(self.next_id)).encode())
        self.next_id += 1
        return self.reply()

    def _read(self, n: int) -> bytes | None:
        parts = b""
        while len(parts) < n:
            try:
                got = self.sock.recv(n - len(parts))
            except ConnectionResetError:
                return None
            if not got:
                return None
            parts += got
        return parts

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def server(node_servers):
    return node_servers("hostile", lease_timeout_s=LEASE_S)


def honest_round_trip(server, tmp_path, first: int) -> None:
    """An engine stores 10 chunks and loads them back, byte for byte."""
    e = engine(node_pipeline(tmp_path, server.socket, name=f"honest-{first}"))
    ids, slots = torch.arange(first, first + TOKENS), slots_for(TOKENS)
    try:
        assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(first), slot_mapping=slots)).stored_tokens == TOKENS
        assert e.lookup(ids) == TOKENS
        dst = kv_for(first + 1)
        assert int(e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask.sum()) == TOKENS
        assert torch.equal(chunk_kv(dst, slots), chunk_kv(kv_for(first), slots))
    finally:
        e.close()


def free_bytes(server) -> int:
    return server.status()["memory"]["free_bytes"]


@pytest.mark.parametrize("number", ["Infinity", "-Infinity", "NaN", "1e400"])
def test_a_commit_with_a_non_finite_number_loses_no_arena_bytes(server, tmp_path, number):
    before = server.status()
    raw = RawClient(server.socket)
    rooms = raw.call({"op": "alloc", "sizes": [MIB] * 16})["objs"]
    assert len(rooms) == 16
    assert free_bytes(server) == before["memory"]["free_bytes"] - 16 * MIB
    items = ",".join(f'[{handle},"attack-{number}-{i}",{number},{{"codec":"none","encoded_len":{number}}}]'
                     for i, (handle, _) in enumerate(rooms))
    # Not strict JSON: the server drops the connection. This process lives on (it still maps the rooms),
    # so past the lease they are kept from reuse, until it exits or gives them back: it does, from a new one.
    assert raw.call_text('{"op":"commit","id":{id},"items":[' + items + "]}") is None
    raw.close()
    wait_for(lambda: server.status()["clients"]["quarantined_sessions"] == 1, "the dropped client's lease to end",
             timeout_s=LEASE_S * 30)
    assert free_bytes(server) == before["memory"]["free_bytes"] - 16 * MIB
    again = RawClient(server.socket)
    assert again.call({"op": "release", "handles": [handle for handle, _ in rooms]})["ok"]
    again.close()
    after = wait_for(lambda: (s := server.status())["clients"]["allocations_held"] == 0 and s,
                     "the dropped client's rooms to be given back", timeout_s=LEASE_S * 30)
    assert after["memory"]["free_bytes"] == before["memory"]["free_bytes"]
    assert after["memory"]["entries"] == before["memory"]["entries"]
    assert after["requests"]["malformed_frames"] == before["requests"].get("malformed_frames", 0) + 1
    assert after["requests"].get("request_failures", 0) == 0  # no handler ever saw it
    honest_round_trip(server, tmp_path, 10_000 + 1000 * len(number))


def test_a_negative_dimension_or_a_wrong_type_is_refused_and_its_room_goes_back_at_once(server, tmp_path):
    before = server.status()
    raw = RawClient(server.socket)
    attacks = [
        {"shape": [-1, -4096], "dtype": "int8"},  # multiplies to the room's 4096 B
        {"shape": [4096, True], "dtype": "int8"},
        {"shape": [4096.0], "dtype": "int8"},
        {"shape": [4096], "dtype": "int8", "order": "0"},
        {"shape": [4096], "dtype": "Tensor"},
        {"codec": "none", "encoded_len": 10**400},
        {"codec": ["none"], "encoded_len": 4096},
    ]
    rooms = raw.call({"op": "alloc", "sizes": [4096] * len(attacks)})["objs"]
    items = [[handle, f"neg-{i}", 4096, meta] for i, ((handle, _), meta) in enumerate(zip(rooms, attacks))]
    reply = raw.call({"op": "commit", "items": items})
    assert reply["ok"] and reply["admitted"] == [False] * len(attacks)
    status = server.status()
    # Refused on a live connection: every room is back now, not at the lease timeout.
    assert status["memory"]["free_bytes"] == before["memory"]["free_bytes"]
    assert status["clients"]["allocations_held"] == 0
    assert status["requests"]["commit_refused"] == before["requests"].get("commit_refused", 0) + len(attacks)
    assert raw.call({"op": "get", "keys": [f"neg-{i}" for i in range(len(attacks))]})["objs"] == [None] * len(attacks)
    raw.close()
    honest_round_trip(server, tmp_path, 20_000)


@pytest.mark.parametrize("request_", [
    {"op": "lookup", "keys": ["k"], "pin": "p", "pin_s": 10**400},  # float() of it overflows
    {"op": "lookup", "keys": ["k"], "pin": "p", "pin_s": -1},
    {"op": "pin", "keys": ["k"], "owner": "p", "pin_s": "30"},
    {"op": "events", "since": 10**400},
    {"op": "events", "since": 0, "wait_s": True},
    {"op": "alloc", "sizes": [0]},
    {"op": "alloc", "sizes": [-4096]},
    {"op": "alloc", "sizes": [True]},
    {"op": "alloc", "sizes": [4096] * ((1 << 16) + 1)},
    {"op": "release", "handles": ["1"]},
    {"op": "get", "keys": [7]},
    {"op": "hello", "client": ["raw"]},
], ids=lambda r: r["op"])
def test_a_field_of_the_wrong_type_or_range_is_an_error_reply_and_the_connection_stays(server, request_):
    before = server.status()["requests"]
    raw = RawClient(server.socket)
    reply = raw.call(request_)
    assert not reply["ok"] and "must" in reply["error"]
    assert raw.call({"op": "lookup", "keys": ["k"]})["held"] == [False]  # the same connection goes on
    raw.close()
    after = server.status()
    assert after["requests"]["request_errors"] == before.get("request_errors", 0) + 1
    assert after["requests"].get("request_failures", 0) == 0  # never a handler's defect (a traceback)
    assert after["clients"]["allocations_held"] == 0


def test_an_alloc_that_fails_part_way_keeps_none_of_its_rooms(server):
    before = server.status()
    raw = RawClient(server.socket)
    slab = raw.call({"op": "hello", "client": "raw"})["slab_bytes"]
    reply = raw.call({"op": "alloc", "sizes": [MIB, MIB, slab + 1]})
    assert not reply["ok"] and "largest object" in reply["error"]
    status = server.status()
    assert status["clients"]["allocations_held"] == 0
    assert status["memory"]["free_bytes"] == before["memory"]["free_bytes"]
    rooms = raw.call({"op": "alloc", "sizes": [MIB, MIB]})["objs"]
    assert len(rooms) == 2  # the arena is still there
    # Given back: a connection closed with rooms open leaves them kept from reuse while this process
    # lives, and the module's other tests (in any order) count the rooms held.
    assert raw.call({"op": "release", "handles": [handle for handle, _ in rooms]})["ok"]
    raw.close()


def test_pin_owners_are_forgotten_when_released_or_expired_over_10k_lookups(server, tmp_path):
    e = engine(node_pipeline(tmp_path, server.socket, name="owners"))
    ids, slots = torch.arange(30_000, 30_000 + TOKENS), slots_for(TOKENS)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(3), slot_mapping=slots)).stored_tokens == TOKENS
    keys = [k.to_str() for k in e.keys.of(ids, {}, None)]
    e.close()
    conn = server.connect("owners")
    rss_before = _rss(server.pid)
    for i in range(10_000):  # what vLLM does: a new owner per request, released when it finishes
        assert conn.call("lookup", keys=keys[:2], pin=f"request-{i}", pin_s=30.0)["held"] == [True, True]
        conn.send("release_owner", owner=f"request-{i}")
    status = server.status()
    assert status["clients"]["pin_owners"] == 0
    assert status["memory"]["pinned_entries"] == 0
    rss_after = _rss(server.pid)
    print(f"server RSS over 10k pinned lookups: {rss_before / MIB:.1f} -> {rss_after / MIB:.1f} MiB")
    # Owners that never release: their pins run out, then the owners leave the table too.
    for i in range(2_000):
        conn.call("lookup", keys=keys[:1], pin=f"forgotten-{i}", pin_s=0.2)
    assert server.status()["clients"]["pin_owners"] > 0
    wait_for(lambda: server.status()["clients"]["pin_owners"] == 0, "expired owners to be pruned")
    assert server.status()["memory"]["pinned_entries"] == 0
    # A live pin of the same connection is untouched by the pruning.
    assert conn.call("lookup", keys=keys, pin="live", pin_s=30.0)["held"] == [True] * 10
    assert server.status()["clients"]["pin_owners"] == 1
    conn.close()
    honest_round_trip(server, tmp_path, 40_000)


def test_garbage_frames_drop_the_client_with_one_log_line_and_no_traceback(server, tmp_path):
    before = server.status()["requests"].get("malformed_frames", 0)
    log_before = server.log.read_text()
    for body in (b"[" * 100_000, b"\xff\xfe not utf-8", b"[1]", b'{"op": "stats", "id": 1, "x": NaN}'):
        raw = RawClient(server.socket)
        raw.send_body(body)
        assert raw.reply() is None  # hung up on
        raw.close()
    assert server.status()["requests"]["malformed_frames"] == before + 4
    new_log = server.log.read_text()[len(log_before):]
    assert "Traceback" not in new_log
    assert new_log.count("unreadable message") <= 1
    honest_round_trip(server, tmp_path, 50_000)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
