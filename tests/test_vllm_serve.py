"""`vllm serve` with flowkv, as the README runs it: real HTTP on loopback, the OpenAI completions API.

The servers run the tiny model with vLLM's own prefix caching off, so every
reused token comes from flowkv. Outputs are greedy and must equal those of
the same server without flowkv, streamed or not.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import time

import pytest

from vllm_server import VllmServer, flowkv_server, metric_value, plain_server, served_pair  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.vllm

CHUNK = 256  # flowkv_server's chunk size
DOC = 1000  # tokens of the shared document: 3 whole chunks


def token_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


DOCUMENT = token_ids(DOC, seed=1)
FIRST = DOCUMENT + token_ids(24, seed=2)   # stores the document
SECOND = DOCUMENT + token_ids(24, seed=3)  # shares the document, asks something else
PROMPTS = [FIRST, SECOND, FIRST]


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


def test_sigterm_with_a_shutdown_timeout_drains_stores_and_leaves_no_socket(tmp_path):
    """The README's setting, `--shutdown-timeout`: a request in flight at SIGTERM finishes, its
    document reaches the disk tier, the worker exits on its own (no force kill) and takes its
    socket file along. At start, the socket file a killed server left is removed; a live one stays."""
    disk = tmp_path / "disk"
    # vLLM gives a worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s) to exit before it kills it: on a loaded
    # two-core machine a worker's exit (flowkv's flush and close, then the interpreter's) was seen to take
    # longer, and vLLM then logs no "all workers exited gracefully". The README tells users to raise it there.
    server = VllmServer(tmp_path / "server", args=["--shutdown-timeout", "60"],
                        env={"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"}, worker_process=True,
                        kv_extra={"pipeline": "cpu-disk", "chunk_size": CHUNK, "tiers.disk.path": str(disk)})
    stale = server.ipc_dir / "flowkv-1234567890-dp0-r0.sock"
    live = server.ipc_dir / "flowkv-other-dp0-r0.sock"
    sockets = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        sockets[0].bind(str(stale))
        sockets[0].close()  # the file stays behind, as a killed process leaves it
        sockets[1].bind(str(live))
        sockets[1].listen()
        for path in (stale, live):
            os.utime(path, (time.time() - 3600,) * 2, follow_symlinks=False)
        server.start()
        assert not stale.exists() and live.exists()
        (own,) = set(server.ipc_dir.iterdir()) - {live}

        prompt = token_ids(3000, seed=9)
        events = server.stream_events(prompt, max_tokens=32)
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
        # The document's whole chunks reached the disk tier.
        assert len(list(disk.rglob("*.kv"))) == len(prompt) // CHUNK
    finally:
        for sock in sockets:
            sock.close()
        server.close()
