"""vLLM through one node server (``flowkv server``): real vLLM processes, greedy outputs compared.

In order, sharing one server (and vLLM engines where they can):

1. vLLM A, a process of its own, answers each document with question 2 under a
   tag (a cold run: no key of it is stored yet), then with question 1, and exits;
   its last request holds its store in the worker until A is killed with SIGKILL:
   the server reclaims those rooms after its lease timeout.
2. vLLM B, a new process, asks each document with question 2: the document
   (the common prefix, 1,024 tokens) comes from the server, the output is A's cold one.
3. B stops; vLLM C starts against the running server: its first request per
   document hits in the server's memory.
4. The server is killed: C serves with misses, outputs unchanged; a new server
   comes on the socket and C reconnects, maps its segment, stores and hits.
   C prefills at most ``BUDGET`` tokens a step (vLLM's chunked prefill).
4b. The server is killed during a long request of C (its prefix loaded from the server, the rest
   prefilled over several steps), while that request's store holds rooms: the request is answered
   as a cold run answers it, the next is a miss, and a new server brings the hits back.
5. A layerwise vLLM starts with no server on its socket: misses; then the server
   comes, and it hits with identical outputs (per-layer scatter from the mapped pages).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from node_servers import GO_TAG, HOLD_STORE, HOLD_TAG, ROOT, node_pipeline, node_servers, wait_for  # noqa: E402,F401
from vllm_helpers import CHUNK_SIZE, generate, make_llm, random_tokens, request, shutdown_llm, stats  # noqa: E402

# One story in steps (the docstring): --shuffle moves the module whole.
pytestmark = [pytest.mark.vllm, pytest.mark.in_order]

DOC_TOKENS = 1024  # four chunks: the common prefix of a document's two questions
DOCS = {f"doc{i}": random_tokens(300 + i, DOC_TOKENS) for i in range(3)}
QUESTIONS = {"q1": random_tokens(91, 40), "q2": random_tokens(92, 40)}
COLD = {"run": "cold"}  # a tag: keys of their own, so the run computes every token
LEASE_S = 5.0
BUDGET = 512  # vLLM C's token budget a step: a longer prompt is prefilled over several steps
LONG_TAIL = random_tokens(93, 1024)  # after a document and a question: a prompt of 2,088 tokens


def prompt(doc: str, question: str) -> list[int]:
    return DOCS[doc] + QUESTIONS[question]


def stop(llm) -> None:
    """Shut a vLLM down once (a later test may take over from a fixture's engine)."""
    if not getattr(llm, "_flowkv_test_stopped", False):
        llm._flowkv_test_stopped = True
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def server(node_servers):
    return node_servers("vllm", memory="256MiB", lease_timeout_s=LEASE_S)


@pytest.fixture(scope="module")
def pipelines(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipelines")
    return {
        "plain": node_pipeline(folder, server.socket, name="node-vllm", chunk_size=CHUNK_SIZE),
        "hold": node_pipeline(folder, server.socket, name="node-vllm-hold", chunk_size=CHUNK_SIZE,
                              store=HOLD_STORE),
    }


@pytest.fixture(scope="module")
def process_a(server, pipelines, tmp_path_factory):
    """vLLM A's outputs; A itself killed with SIGKILL while its last store held rooms."""
    folder = tmp_path_factory.mktemp("process-a")
    requests = [{"name": f"{doc}-q2-cold", "tokens": prompt(doc, "q2"), "tags": COLD} for doc in DOCS]
    requests += [{"name": f"{doc}-q1", "tokens": prompt(doc, "q1")} for doc in DOCS]
    (folder / "requests.json").write_text(json.dumps(requests), encoding="utf-8")
    holding, out = folder / "holding", folder / "out.json"
    holding.mkdir()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "node_vllm_client.py"),
                             "--pipeline", str(pipelines["hold"]), "--requests", str(folder / "requests.json"),
                             "--out", str(out), "--hold", str(holding)],
                            cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(folder / "a.log", "w", encoding="utf-8"))
    try:
        wait_for(lambda: any(holding.iterdir()) or proc.poll() is not None, "vLLM A to hold its last store",
                 timeout_s=600)
        assert proc.poll() is None, (folder / "a.log").read_text()[-3000:]
        held = server.status()["clients"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # A, its engine core and its worker
        proc.wait()
    return {"outputs": json.loads(out.read_text(encoding="utf-8")), "held": held}


def test_vllm_a_exits_killed_and_its_held_rooms_are_reclaimed_after_the_lease(server, process_a):
    outputs = process_a["outputs"]
    assert all(outputs[f"{doc}-q2-cold"]["cached"] == 0 for doc in DOCS)
    assert all(outputs[f"{doc}-q1"]["cached"] == 0 for doc in DOCS)  # the cold runs stored other keys
    # The held request (1,100 tokens): four chunks' rooms, gathered into, never committed.
    assert process_a["held"]["allocations_held"] == 4
    after = wait_for(lambda: (s := server.status())["clients"]["reclaimed_allocations"] == 4 and s,
                     "the server to reclaim vLLM A's rooms", timeout_s=LEASE_S * 20)
    assert after["clients"]["allocations_held"] == 0 and after["clients"]["reads_held"] == 0
    assert after["memory"]["pinned_entries"] == 0
    # What A stored: per document the cold run's and question 1's four chunks each.
    assert after["memory"]["entries"] == 3 * 2 * 4
    assert after["requests"].get("request_errors", 0) == 0


@pytest.fixture(scope="module")
def vllm_b(server, pipelines, process_a):
    llm = make_llm({"pipeline": str(pipelines["plain"])})
    yield llm
    stop(llm)


def test_a_new_vllm_gets_the_common_prefix_from_the_server_with_outputs_of_a_cold_run(server, process_a, vllm_b):
    before = server.status()["requests"]
    for doc in DOCS:
        [(output, cached)] = generate(vllm_b, [request(prompt(doc, "q2"))])
        assert cached >= 0.9 * DOC_TOKENS
        assert cached == DOC_TOKENS
        assert output == process_a["outputs"][f"{doc}-q2-cold"]["output"]
    after = server.status()["requests"]
    assert after["get_hits"] - before.get("get_hits", 0) == 3 * 4
    tier = stats(vllm_b)["tiers"]["node"]
    assert tier["read_hits"] == 3 * 4 and tier["failures"] == 0 and tier["connects"] == 1


@pytest.fixture(scope="module")
def vllm_c(server, pipelines, process_a, vllm_b):
    stop(vllm_b)  # B is done: C is the restarted vLLM
    # Its stores pass node_servers.hold (a tagged request's store holds until told to go).
    llm = make_llm({"pipeline": str(pipelines["hold"])}, max_num_batched_tokens=BUDGET)
    yield llm
    stop(llm)


def test_a_restarted_vllm_hits_from_server_memory_on_its_first_request(server, process_a, vllm_c):
    before = server.status()
    for doc in DOCS:
        [(output, cached)] = generate(vllm_c, [request(prompt(doc, "q1"))])
        assert cached == DOC_TOKENS
        assert output == process_a["outputs"][f"{doc}-q1"]["output"]
    after = server.status()
    assert list(after["tiers"]) == ["memory"]  # the server has no other tier: the hits are its memory's
    assert after["memory"]["hits"] - before["memory"]["hits"] == 3 * 4
    assert stats(vllm_c)["tiers"]["node"]["read_hits"] == 3 * 4


def test_vllm_serves_misses_while_the_server_is_gone_then_reconnects_to_the_new_one(server, process_a, vllm_c):
    cold = process_a["outputs"]
    server.kill()
    [(output, cached)] = generate(vllm_c, [request(prompt("doc0", "q1"))])
    assert cached == 0 and output == cold["doc0-q1"]["output"]
    tier = stats(vllm_c)["tiers"]["node"]
    assert tier["healthy"] == 0 and tier["failures"] >= 1

    server.start()  # a new server on the socket: an empty arena in a new segment
    def hit() -> int:
        [(out, got)] = generate(vllm_c, [request(prompt("doc1", "q1"))])
        assert out == cold["doc1-q1"]["output"]
        return got == DOC_TOKENS
    wait_for(hit, "vLLM to reconnect, store into the new server and hit", timeout_s=300)
    tier = stats(vllm_c)["tiers"]["node"]
    assert tier["remaps"] == 1 and tier["healthy"] == 1
    assert server.status()["requests"].get("committed_chunks", 0) >= 4


def test_the_server_killed_between_prefill_steps_of_a_long_request_costs_misses_only(server, process_a, vllm_c,
                                                                                     tmp_path):
    long = prompt("doc2", "q1") + LONG_TAIL
    assert len(long) > 2 * BUDGET + DOC_TOKENS  # after the loaded prefix, three prefill steps
    holding, go = tmp_path / "holding", tmp_path / "go"
    holding.mkdir()
    tags = {HOLD_TAG: str(holding), GO_TAG: str(go)}  # the keys of every request below
    go.touch()  # no hold yet: the document and question go to the server under these tags
    [(output, cached)] = generate(vllm_c, [request(prompt("doc2", "q1"), tags=tags)])
    assert cached == 0 and output == process_a["outputs"]["doc2-q1"]["output"]
    go.unlink()
    for left in holding.iterdir():
        left.unlink()
    failures = stats(vllm_c)["tiers"]["node"]["failures"]

    # The long request: its first 1,024 tokens load from the server in its first step, which
    # then prefills 512 more and stores two chunks; that store holds its rooms (allocated and
    # gathered into, not committed) until the server is dead. Its later steps go on without one.
    killed: list[bool] = []
    answered = threading.Event()

    def kill_while_held() -> None:
        try:
            wait_for(lambda: any(holding.iterdir()) or answered.is_set(), "the long request's store to hold",
                     timeout_s=600)
            if not answered.is_set():
                server.kill()
                killed.append(True)
        finally:
            go.touch()

    killer = threading.Thread(target=kill_while_held)
    killer.start()
    try:
        [(answer, cached)] = generate(vllm_c, [request(long, tags=tags)])
    finally:
        answered.set()
        killer.join()
    assert killed == [True], "the long request was answered without its store holding"
    assert not server.running
    assert cached == DOC_TOKENS  # loaded before the kill
    tier = stats(vllm_c)["tiers"]["node"]
    assert tier["healthy"] == 0 and tier["failures"] > failures

    # The server gone: a miss, so vLLM computes the whole prompt: the reference answer. The long
    # request's is the same: nothing wrong loaded, nothing lost but its stores.
    [(reference, cached)] = generate(vllm_c, [request(long, tags=tags)])
    assert cached == 0
    assert answer == reference

    server.start()  # a new server on the socket: an empty arena

    def hit() -> bool:
        [(out, got)] = generate(vllm_c, [request(long, tags=tags)])
        assert out == reference
        return got == len(long) // CHUNK_SIZE * CHUNK_SIZE
    wait_for(hit, "vLLM to reconnect, store the long prompt into the new server and hit it whole", timeout_s=300)
    assert stats(vllm_c)["tiers"]["node"]["healthy"] == 1
    assert server.status()["requests"].get("committed_chunks", 0) >= len(long) // CHUNK_SIZE


def test_layerwise_vllm_starts_without_a_server_then_hits_through_it(node_servers, process_a, vllm_c, tmp_path):
    stop(vllm_c)
    late = node_servers.folder / "late.sock"  # nobody listens there yet
    path = node_pipeline(tmp_path, late, name="node-layerwise", chunk_size=CHUNK_SIZE,
                         sections={"layerwise": {"enabled": True}})
    llm = make_llm({"pipeline": str(path)})
    try:
        cold = process_a["outputs"]
        [(output, cached)] = generate(llm, [request(prompt("doc2", "q1"))])
        assert cached == 0 and output == cold["doc2-q1"]["output"]
        assert stats(llm)["tiers"]["node"]["connects"] == 0
        node_servers("late")

        def hit() -> bool:
            [(out, got)] = generate(llm, [request(prompt("doc2", "q1"))])
            assert out == cold["doc2-q1"]["output"]
            return got == DOC_TOKENS
        wait_for(hit, "the layerwise vLLM to reach the server, store and hit", timeout_s=300)
        tier = stats(llm)["tiers"]["node"]
        assert tier["connects"] == 1 and tier["read_hits"] >= 4
    finally:
        stop(llm)
