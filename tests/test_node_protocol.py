"""The node server's wire protocol without a server: frames, views of the shared pages, the client's rules."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from flowkv.tiers import node_protocol as wire


def test_frames_round_trip_and_refuse_what_is_not_a_message():
    frame = wire.encode_frame({"op": "lookup", "id": 3, "keys": ["a/b", "c"]})
    assert wire.frame_length(frame[:4]) == len(frame) - 4
    assert wire.decode_body(frame[4:]) == {"op": "lookup", "id": 3, "keys": ["a/b", "c"]}
    with pytest.raises(ValueError, match="JSON object"):
        wire.decode_body(b"[1, 2]")
    with pytest.raises(ValueError, match="over the"):
        wire.frame_length((wire.MAX_FRAME + 1).to_bytes(4, "little"))
    with pytest.raises(ValueError):
        wire.encode_frame({"x": float("nan")})  # not JSON


def test_dtypes_come_from_a_whitelist_never_from_getattr():
    assert wire.dtype_from_name("bfloat16") is torch.bfloat16
    assert wire.dtype_name(torch.float16) == "float16"
    for name in ("Tensor", "load", "__class__", "", None):
        with pytest.raises(ValueError):
            wire.dtype_from_name(name)


def test_a_view_of_the_pages_follows_the_byte_order_it_was_committed_in():
    logical = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    order = [1, 0, 2]  # the bytes lie as (3, 2, 4)
    physical = logical.permute(order).contiguous()
    buffer = torch.zeros(4096, dtype=torch.uint8)
    buffer[128:128 + physical.numel() * 4] = physical.view(torch.uint8).reshape(-1)
    view = wire.view(buffer, 128, (2, 3, 4), torch.float32, order)
    assert torch.equal(view, logical)
    assert wire.dense_order(view) == order
    assert wire.dense_order(logical) == [0, 1, 2]
    view[1, 2, 3] = -1.0  # a view, not a copy
    assert wire.view(buffer, 128, (2, 3, 4), torch.float32, order)[1, 2, 3] == -1.0
    with pytest.raises(ValueError, match="outside"):
        wire.view(buffer, 4050, (2, 3, 4), torch.float32)


def _one_reply_server(path, reply: bytes) -> threading.Thread:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        prefix = conn.recv(4)
        conn.recv(wire.frame_length(prefix))
        if reply:
            conn.sendall(reply)
        conn.recv(1)  # until the client hangs up
        conn.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_reply_to_another_request_or_none_in_time_closes_the_connection(tmp_path):
    path = tmp_path / "s.sock"
    server = _one_reply_server(path, wire.encode_frame({"id": 99, "ok": True}))
    conn = wire.NodeConnection.connect(path, timeout_s=5.0)
    with pytest.raises(wire.NodeUnavailable, match="reply 99 to request 1"):
        conn.call("stats")
    assert conn.closed
    server.join(5)

    path = tmp_path / "t.sock"
    server = _one_reply_server(path, b"")  # never answers
    conn = wire.NodeConnection.connect(path, timeout_s=0.2)
    with pytest.raises(wire.NodeUnavailable, match="timed out"):
        conn.call("stats")
    assert conn.closed
    with pytest.raises(wire.NodeUnavailable, match="closed"):
        conn.send("release", handles=[1])
    server.join(5)

    with pytest.raises(wire.NodeUnavailable, match="no flowkv server"):
        wire.NodeConnection.connect(tmp_path / "nobody.sock", timeout_s=1.0)


def test_an_error_the_server_answers_keeps_the_connection(tmp_path):
    path = tmp_path / "e.sock"
    server = _one_reply_server(path, wire.encode_frame({"id": 1, "ok": False, "error": "unknown op 'x'"}))
    conn = wire.NodeConnection.connect(path, timeout_s=5.0)
    with pytest.raises(wire.NodeError, match="unknown op"):
        conn.call("x")
    assert not conn.closed
    conn.close()
    server.join(5)
