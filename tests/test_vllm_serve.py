"""`vllm serve` with flowkv, as the README runs it: real HTTP on loopback, the OpenAI completions API.

Two servers, compiled (vLLM's default) and started side by side: one with
flowkv (pipeline cpu-disk, chunks of 256 tokens, the README's shutdown
settings), one without a KV connector (the reference outputs). Both run the
tiny model with vLLM's own prefix caching off, so every reused token comes
from flowkv. Outputs are greedy and must equal those of the server without
flowkv, streamed or not. One story in steps (the module keeps its order under
--shuffle): the last test stops the flowkv server with SIGTERM.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from vllm_server import VllmServer, metric_value, start_all

pytestmark = [pytest.mark.vllm, pytest.mark.in_order]

CHUNK = 256  # the flowkv server's chunk size
DOC = 1000  # tokens of the shared document: 3 whole chunks
DRAINED_TENANT = "drained"  # the SIGTERM test's request: its disk files carry the tenant's name


def token_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


DOCUMENT = token_ids(DOC, seed=1)
FIRST = DOCUMENT + token_ids(24, seed=2)   # stores the document
SECOND = DOCUMENT + token_ids(24, seed=3)  # shares the document, asks something else
PROMPTS = [FIRST, SECOND, FIRST]


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory) -> Iterator[dict]:
    """The two servers, and what the SIGTERM test checks: the flowkv server's disk folder, and two socket
    files put in its IPC folder before it starts (one a killed server left, one a live server listens on)."""
    folder = tmp_path_factory.mktemp("serve")
    disk = folder / "disk"
    # vLLM gives a worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s) to exit before it kills it: on a loaded
    # two-core machine a worker's exit (flowkv's flush and close, then the interpreter's) was seen to take
    # longer, and vLLM then logs no "all workers exited gracefully". The README tells users to raise it there.
    servers = {
        "flowkv": VllmServer(folder / "flowkv", compiled=True, args=["--shutdown-timeout", "60"],
                             env={"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"},
                             kv_extra={"pipeline": "cpu-disk", "chunk_size": CHUNK, "tiers.disk.path": str(disk)}),
        "plain": VllmServer(folder / "plain", compiled=True),
    }
    ipc_dir = servers["flowkv"].ipc_dir
    stale, live = ipc_dir / "flowkv-1234567890-dp0-r0.sock", ipc_dir / "flowkv-other-dp0-r0.sock"
    sockets = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        sockets[0].bind(str(stale))
        sockets[0].close()  # the file stays behind, as a killed process leaves it
        sockets[1].bind(str(live))
        sockets[1].listen()
        for path in (stale, live):
            os.utime(path, (time.time() - 3600,) * 2, follow_symlinks=False)
        start_all(servers)  # stops both if either fails
        try:
            yield {**servers, "disk": disk, "stale": stale, "live": live}
        finally:
            for server in servers.values():
                server.close()
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture(scope="module")
def flowkv_server(served_pair) -> VllmServer:
    return served_pair["flowkv"]


@pytest.fixture(scope="module")
def plain_server(served_pair) -> VllmServer:
    return served_pair["plain"]


def cached(reply: dict) -> int:
    """Prompt tokens vLLM took from a cache (here only flowkv's), as the API reports them."""
    details = reply["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def test_completions_reuse_flowkv_and_match_a_server_without_it(flowkv_server, plain_server):
    hits_before = flowkv_server.metric("vllm:flowkv_hit_tokens_total")
    with_flowkv = [flowkv_server.complete(prompt) for prompt in PROMPTS]
    without = [plain_server.complete(prompt) for prompt in PROMPTS]

    for ours, reference in zip(with_flowkv, without):
        assert ours["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
        assert ours["choices"][0]["text"] == reference["choices"][0]["text"]
    # The document's whole chunks came from flowkv for every request after the first.
    assert [cached(reply) for reply in with_flowkv][0] == 0
    assert all(cached(reply) >= 3 * CHUNK for reply in with_flowkv[1:]), [cached(r) for r in with_flowkv]
    assert [cached(reply) for reply in without] == [0, 0, 0]
    # ... and /metrics says so: flowkv's own counters and vLLM's connector counter.
    text = flowkv_server.metrics()
    assert metric_value(text, "vllm:flowkv_hit_tokens_total") - hits_before >= 2 * 3 * CHUNK
    assert metric_value(text, "vllm:flowkv_retrieved_tokens_total") >= 2 * 3 * CHUNK
    assert metric_value(text, "vllm:flowkv_stored_tokens_total") >= 3 * CHUNK
    assert metric_value(text, "vllm:flowkv_tier_healthy", tier="memory") == 1
    assert metric_value(text, "vllm:external_prefix_cache_hits_total") >= 2 * 3 * CHUNK
    assert plain_server.metric("vllm:external_prefix_cache_hits_total") == 0


def test_a_streamed_completion_equals_the_whole_one(flowkv_server, plain_server):
    # A document of its own (the module's tests run in any order), stored by a first request here.
    document = token_ids(DOC, seed=5)
    assert cached(flowkv_server.complete(document + token_ids(24, seed=6))) == 0
    prompt = document + token_ids(40, seed=4)
    streamed = flowkv_server.complete(prompt, max_tokens=24, stream=True)
    whole = plain_server.complete(prompt, max_tokens=24)

    assert streamed["done"] and streamed["chunks"] > 1
    assert streamed["token_ids"] == whole["choices"][0]["token_ids"]
    assert streamed["text"] == whole["choices"][0]["text"]
    assert cached(streamed) >= 3 * CHUNK  # the document, loaded from flowkv


def test_flowkv_lines_in_the_log_carry_time_and_process(flowkv_server):
    # (Worker pid=4711) INFO 11-30 10:04:11 [vllm.py:704] flowkv: worker rank 0 serving lookups on ...
    line = re.compile(r"^\((\w+)(?:_\w+)? pid=(\d+)\) (INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] flowkv: (.*)$")
    found = {}
    for text in flowkv_server.log().splitlines():
        match = line.match(text)
        if match:
            found.setdefault(match.group(1), (int(match.group(2)), match.group(4)))
    assert "Worker" in found and found["Worker"][1].startswith("worker rank 0 serving lookups on"), found
    assert "EngineCore" in found, found
    # The pids are the server's own worker and engine-core processes, not the API server.
    pids = {pid for pid, _ in found.values()}
    assert flowkv_server.proc.pid not in pids
    assert pids <= set(flowkv_server.live_processes())
    # No flowkv line went out without vLLM's prefix (the bare message Python prints by default).
    assert not [t for t in flowkv_server.log().splitlines() if t.startswith("flowkv:")]


def test_sigterm_with_a_shutdown_timeout_drains_stores_and_leaves_no_socket(served_pair):
    """The README's setting, `--shutdown-timeout`: a request in flight at SIGTERM finishes, its
    document reaches the disk tier, the worker exits on its own (no force kill) and takes its
    socket file along. At start, the socket file a killed server left was removed; a live one stays."""
    server, stale, live = served_pair["flowkv"], served_pair["stale"], served_pair["live"]
    assert not stale.exists() and live.exists()
    (own,) = set(server.ipc_dir.iterdir()) - {live}

    prompt = token_ids(3000, seed=9)
    events = server.stream_events(prompt, max_tokens=32, kv_transfer_params={"flowkv.tag.tenant": DRAINED_TENANT})
    assert next(events) is not None
    server.proc.send_signal(signal.SIGTERM)  # the request is in flight
    rest = list(events)
    finished = [c["finish_reason"] for e in rest if e for c in e["choices"] if c.get("finish_reason")]
    assert finished == ["length"], f"the request was not drained: {finished}"
    assert server.stop() == 0

    log = server.log()
    assert "all workers exited gracefully" in log
    assert "force killing" not in log
    assert server.wait_for_group_exit() == [], "a process of the server outlived its stop"
    assert not own.exists(), "the worker's socket file was left behind"
    assert live.exists()
    # The document's whole chunks reached the disk tier: the files of its tenant (the name in hex).
    drained = list(served_pair["disk"].rglob(f"*.{DRAINED_TENANT.encode().hex()}.kv"))
    assert len(drained) == len(prompt) // CHUNK
