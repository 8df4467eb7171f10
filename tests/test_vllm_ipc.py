"""The scheduler-to-worker lookup channel, over real Unix sockets (no vLLM engine started).

vLLM's scheduler must never wait on a worker longer than the lookup timeout,
and an answer that comes late must never be taken for a newer question's.
"""

from __future__ import annotations

import os
import shutil
import socket as stdlib_socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from flowkv.integration._ipc import LookupClient, LookupServer, query_worker, socket_path


class Worker:
    """A LookupServer whose handler records what it was asked and can be held back."""

    def __init__(self, path, hit_tokens: int = 0):
        self.hit_tokens = hit_tokens
        self.seen: list[tuple[str, str | None]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.server = LookupServer(path, self.handle)

    def handle(self, header, tokens):
        self.gate.wait()
        self.seen.append((header["op"], header.get("lookup_id")))
        if header["op"] == "boom":
            raise RuntimeError("engine exploded")
        return {"hit_tokens": self.hit_tokens, "lookup_id": header.get("lookup_id"),
                "num_tokens": int(tokens.size), "last_token": int(tokens[-1]) if tokens.size else None}


@pytest.fixture
def ipc_dir():
    # Unix socket paths must stay short; pytest's tmp paths can be long.
    folder = Path(tempfile.mkdtemp(prefix="fkv-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def workers(ipc_dir):
    started = []

    def start(*hits: int):
        for rank, hit in enumerate(hits):
            worker = Worker(socket_path(ipc_dir, "inst", 0, rank), hit_tokens=hit)
            worker.server.start()
            started.append(worker)
        return started

    yield start
    for worker in started:
        worker.gate.set()
        worker.server.close()


def short_timeout_client(path, timeout_ms=50):
    """A client already connected (asked once with a generous timeout), then set
    to a short one, so the test's first timeout is the worker's, not the connect's."""
    client = LookupClient([path], timeout_ms=30_000)
    assert client.ask({"op": "ping"}) is not None
    client.timeout_ms = timeout_ms
    return client


def ask_until_answered(client, header, attempts=200):
    """Ask again while the client is waiting for a worker to come back.

    The short timeout has done its part by now; a generous one keeps a busy
    machine from turning this question into one more timeout (and a resend)."""
    client.timeout_ms = 30_000
    for _ in range(attempts):
        replies = client.ask(header, [1, 2, 3])
        if replies is not None:
            return replies
        time.sleep(0.01)
    raise AssertionError("no answer after the worker came back")


def test_every_rank_answers_in_rank_order_with_the_tokens_sent(ipc_dir, workers):
    workers(512, 256)
    client = LookupClient([socket_path(ipc_dir, "inst", 0, r) for r in range(2)], timeout_ms=5000)
    try:
        tokens = np.array([5, 2**40, 7], dtype=np.int64)
        replies = client.ask({"op": "lookup", "lookup_id": "r1#0"}, tokens)
    finally:
        client.close()
    assert [r["hit_tokens"] for r in replies] == [512, 256]
    assert all(r["ok"] and r["num_tokens"] == 3 and r["last_token"] == 7 for r in replies)


def test_a_late_answer_is_never_taken_for_a_newer_question(ipc_dir, workers):
    [worker] = workers(256)
    client = short_timeout_client(socket_path(ipc_dir, "inst", 0, 0))
    try:
        worker.gate.clear()
        assert client.ask({"op": "lookup", "lookup_id": "old"}, [1]) is None
        assert client.timeouts == 1
        worker.gate.set()  # the old answer is now on its way back
        replies = ask_until_answered(client, {"op": "lookup", "lookup_id": "new"})
    finally:
        client.close()
    assert replies[0]["lookup_id"] == "new"


def test_an_unresponsive_worker_is_not_waited_for_again_until_it_answers(ipc_dir, workers):
    [worker] = workers(256)
    client = short_timeout_client(socket_path(ipc_dir, "inst", 0, 0))
    try:
        worker.gate.clear()
        assert client.ask({"op": "lookup", "lookup_id": "a"}, [1]) is None
        assert client.ask({"op": "lookup", "lookup_id": "b"}, [1]) is None
        assert client.timeouts == 1  # the second question was not sent, only a ping
        worker.gate.set()
        ask_until_answered(client, {"op": "lookup", "lookup_id": "c"})
    finally:
        client.close()
    assert [lookup_id for op, lookup_id in worker.seen if op == "lookup"] == ["a", "c"]


def test_a_release_sent_after_a_lookup_is_handled_after_it(ipc_dir, workers):
    [worker] = workers(256)
    client = short_timeout_client(socket_path(ipc_dir, "inst", 0, 0))
    try:
        worker.gate.clear()
        assert client.ask({"op": "lookup", "lookup_id": "x"}, [1]) is None
        client.tell({"op": "release", "lookup_id": "x"})
        worker.gate.set()
        ask_until_answered(client, {"op": "ping"})
    finally:
        client.close()
    assert [seen for seen in worker.seen if seen[0] != "ping"][:2] == [("lookup", "x"), ("release", "x")]


def test_no_worker_listening_answers_none(ipc_dir):
    client = LookupClient([socket_path(ipc_dir, "nobody", 0, 0)], timeout_ms=30)
    try:
        assert client.ask({"op": "lookup", "lookup_id": "a"}, [1]) is None
    finally:
        client.close()
    with pytest.raises(TimeoutError, match="no flowkv worker answered"):
        query_worker(socket_path(ipc_dir, "nobody", 0, 0), timeout_ms=30)


def test_a_failing_handler_is_reported_and_the_server_goes_on(ipc_dir, workers):
    workers(128)
    path = socket_path(ipc_dir, "inst", 0, 0)
    with pytest.raises(RuntimeError, match="engine exploded"):
        query_worker(path, "boom")
    assert query_worker(path, "lookup", lookup_id="again")["hit_tokens"] == 128


def test_socket_path_too_long_names_the_setting_to_change(tmp_path):
    with pytest.raises(ValueError, match="ipc_dir"):
        socket_path(tmp_path / ("x" * 120), "inst", 0, 0)


def test_extra_config_splits_into_connector_keys_and_pipeline_overrides():
    from flowkv.integration.vllm import ConnectorSettings

    settings = ConnectorSettings.from_extra_config(
        {
            "pipeline": "cpu-disk",
            "model_name": "llama-8b",
            "ipc_dir": "/tmp/fkv",
            "save_decode": True,
            "lookup_timeout_ms": 50,
            "chunk_size": 128,
            "tiers.memory.capacity": "1GiB",
        },
        default_model="/models/llama",
    )
    assert settings.pipeline == "cpu-disk"
    assert settings.model_name == "llama-8b"
    assert str(settings.ipc_dir) == "/tmp/fkv"
    assert settings.overrides == {
        "vllm.save_decode": True,
        "vllm.lookup_timeout_ms": 50,
        "chunk_size": 128,
        "tiers.memory.capacity": "1GiB",
    }
    assert ConnectorSettings.from_extra_config(None, default_model="/models/llama").pipeline == "local-cpu"
    with pytest.raises(ValueError, match="model_name"):
        ConnectorSettings.from_extra_config({"model_name": ""}, default_model="m")


# -- socket files: none left behind ------------------------------------------------

# Starts a lookup server and then exits as asked: "return" (end of the script),
# "exit" (sys.exit in a multiprocessing child, forked as vLLM forks its workers),
# or "hang" (waits to be killed).
_SERVER_SCRIPT = """
import multiprocessing, sys, time
from flowkv.integration._ipc import LookupServer

def serve(path, ending):
    server = LookupServer(path, lambda header, tokens: {})
    server.start()
    print("serving", flush=True)
    if ending == "hang":
        time.sleep(3600)

path, ending = sys.argv[1], sys.argv[2]
if ending == "exit":
    child = multiprocessing.get_context("fork").Process(target=serve, args=(path, ending))
    child.start()
    child.join()
    sys.exit(child.exitcode)
serve(path, ending)
"""


def run_server_process(path: Path, ending: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, str(path), ending],
                            stdout=subprocess.PIPE, text=True)


def unix_socket_file(path: Path, *, listening: bool) -> stdlib_socket.socket:
    """A socket file at ``path``: listened on, or left behind by a process that is gone."""
    sock = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen()
    else:
        sock.close()  # the file stays; connecting to it is refused
    return sock


def age(path: Path) -> None:
    """Make ``path`` look older than a server that is still between bind and listen."""
    os.utime(path, (time.time() - 3600, time.time() - 3600), follow_symlinks=False)


@pytest.mark.parametrize("ending", ["return", "exit"])
def test_a_process_that_ends_without_closing_removes_its_socket_file(ipc_dir, ending):
    path = socket_path(ipc_dir, "ended", 0, 0)
    process = run_server_process(path, ending)
    assert process.stdout.readline().strip() == "serving"
    assert process.wait() == 0
    assert not path.exists()


def test_stale_socket_files_are_removed_when_a_server_starts(ipc_dir):
    killed = socket_path(ipc_dir, "killed", 0, 0)
    process = run_server_process(killed, "hang")
    assert process.stdout.readline().strip() == "serving"
    process.kill()  # what vLLM's default --shutdown-timeout 0 does to its workers
    process.wait()
    assert killed.exists(), "a killed process cannot clean up: its file stays until the next start"
    gone = socket_path(ipc_dir, "gone", 0, 1)
    unix_socket_file(gone, listening=False)
    live = socket_path(ipc_dir, "live", 0, 0)
    listener = unix_socket_file(live, listening=True)
    just_bound = socket_path(ipc_dir, "starting", 0, 0)
    unix_socket_file(just_bound, listening=False)
    not_a_socket = ipc_dir / "flowkv-notes-dp0-r0.sock"
    not_a_socket.write_text("not a socket")
    for path in (killed, gone, live, not_a_socket):
        age(path)

    worker = Worker(socket_path(ipc_dir, "new", 0, 0))
    worker.server.start()
    try:
        left = sorted(p.name for p in ipc_dir.iterdir())
        assert left == sorted(p.name for p in (live, just_bound, not_a_socket, worker.server.path))
    finally:
        worker.server.close()
        listener.close()
    assert not worker.server.path.exists()
