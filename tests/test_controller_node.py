"""The controller with a node server: real ``flowkv controller``, ``flowkv server`` and ``flowkv node-report``.

In-process engines read through the node server's ``server`` tier and report
to the controller as instances (``EngineHolder``); ``flowkv node-report``
follows the server's events and reports its arena as a holder of kind
``server``. Lookups count the server's chunks for every instance that reads
through it, whoever stored them; a clear, a server killed and restarted, and
a follower killed are each seen by the controller. vLLM through a node
server is in ``test_vllm_node.py`` (server track); vLLM and the controller in
``test_controller_vllm.py``.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch



from fleet_helpers import ControllerProcess, wait_for  # noqa: E402
from flowkv import KVTransfer  # noqa: E402
from flowkv.fleet.holder import EngineHolder  # noqa: E402
from flowkv.fleet.node import default_server_name  # noqa: E402
from flowkv.fleet.reporter import ReporterConfig  # noqa: E402
from node_servers import ROOT, engine, keys_of, kv_for, node_pipeline, node_servers, slots_for  # noqa: E402, F401

TOKENS = 128  # 8 chunks of 16


def ids(first: int, n: int = TOKENS) -> torch.Tensor:
    return torch.arange(first, first + n)


def node_report(controller: ControllerProcess, socket, folder) -> subprocess.Popen:
    """``flowkv node-report`` in a process of its own; returns once it says what it follows."""
    log = open(folder / "node-report.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "flowkv.cli", "node-report", "--socket", str(socket),
                             "--controller", controller.url, "--token-file", str(controller.token_file),
                             "--heartbeat-s", "0.3", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=ROOT)
    line = proc.stdout.readline().decode()
    assert line.startswith("flowkv node-report: following"), line
    return proc


def holder(controller: ControllerProcess, e, instance_id: str) -> EngineHolder:
    h = EngineHolder(e, threading.Lock(), ReporterConfig(url=controller.url, heartbeat_s=0.3,
                                                         token_file=str(controller.token_file)),
                     instance_id=instance_id, model="m", url=f"http://{instance_id}.invalid")
    e.storage.subscribe(h.on_tier_event)
    return h.start()


@pytest.fixture
def controller(tmp_path):
    process = ControllerProcess(tmp_path / "controller", heartbeat_s=0.3, timeout_s=2.0).start()
    yield process
    process.close()


def answers(controller, tokens: torch.Tensor) -> dict[str, dict]:
    return {h["instance_id"]: h for h in controller.lookup(token_ids=tokens.tolist())}


def holding(got: dict[str, dict], matched: int) -> dict[str, dict] | None:
    """The answers when exactly A and B hold ``matched`` tokens (events arrive in batches)."""
    if set(got) == {"a", "b"} and all(got[i]["matched_tokens"] == matched for i in got):
        return got
    return None


def test_a_node_servers_chunks_count_for_every_instance_that_reads_through_it(controller, node_servers, tmp_path):
    server = node_servers("fleet", memory="1MiB")
    name = default_server_name(server.socket)
    follower = node_report(controller, server.socket, tmp_path)
    engines, holders = [], []
    try:
        a = engine(node_pipeline(tmp_path, server.socket, name="a"))
        engines.append(a)
        b = engine(node_pipeline(tmp_path, server.socket, name="b"))
        engines.append(b)
        holders += [holder(controller, a, "a"), holder(controller, b, "b")]
        # Registration: the server by its name, kind server; each instance lists it in `shared`.
        node = wait_for(lambda: controller.instance(name), "the node server is registered")
        assert node["kind"] == "server" and node["state"] == "up"
        wait_for(lambda: all(controller.instance(i) for i in ("a", "b")), "both instances are registered")
        assert controller.instance("a")["shared"] == controller.instance("b")["shared"] == [name]

        # A stores; B stored nothing but reads through the same server: both hold the prefix.
        tokens = ids(0)
        assert a.store(KVTransfer(tokens=tokens, kv_caches=kv_for(1),
                                  slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS
        got = wait_for(lambda: holding(answers(controller, tokens), TOKENS), "both instances hold the prefix")
        for instance_id in ("a", "b"):
            assert got[instance_id]["matched_tokens"] == TOKENS
            assert got[instance_id]["tier"] == f"{name}/memory"
            # A's own events for the server tier are left to the server's follower
            assert got[instance_id]["chunks_by_tier"] == {f"{name}/memory": TOKENS // 16}
        assert name not in got  # lookups name instances, never the server
        assert wait_for(lambda: (controller.instance(name)["tiers"] or [{}])[0].get("used_bytes"),
                        "the server's tier fill reaches the controller") > 0
        # What B retrieves through the server is what the controller said it holds.
        assert b.lookup(tokens) == TOKENS

        # Clear on the node server empties its arena, and lookups drop it.
        controller.post("/clear", {"instance_id": name})
        wait_for(lambda: not answers(controller, tokens), "the cleared prefix is gone from lookups")
        conn = server.connect("test-clear")  # snapshot is an operator's call: with the token beside the socket
        assert wait_for(lambda: conn.call("snapshot")["keys"] == [], "the server's arena is empty") is not None
        conn.close()

        # kill -9 of the server: what it held is gone, and so is it from lookups.
        assert b.store(KVTransfer(tokens=tokens, kv_caches=kv_for(1),
                                  slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS
        wait_for(lambda: answers(controller, tokens).get("a", {}).get("matched_tokens") == TOKENS,
                 "the prefix B stored counts for A")
        server.kill()
        wait_for(lambda: not answers(controller, tokens), "a killed server's chunks leave the directory")
        # Restarted on the same socket: the follower reconnects, new stores are seen again.
        server.start()
        other = ids(5000)
        wait_for(lambda: a.store(KVTransfer(tokens=other, kv_caches=kv_for(2),
                                            slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS,
                 "A stores through the restarted server")
        wait_for(lambda: holding(answers(controller, other), TOKENS), "the restarted server's chunks count again")

        # kill -9 of the follower: the server is marked down, and its chunks no longer count.
        follower.kill()
        follower.wait()
        wait_for(lambda: controller.instance(name)["state"] == "down", "the server's holder is marked down")
        wait_for(lambda: not answers(controller, other), "a down server's chunks do not count")
    finally:
        for h in holders:
            h.close()
        for e in engines:
            e.close()
        if follower.poll() is None:
            follower.terminate()
            follower.wait(timeout=30)


@pytest.mark.vllm
def test_vllm_through_a_node_server_is_found_by_the_controller_and_so_is_every_instance_sharing_it(
        controller, node_servers, tmp_path):
    from vllm_helpers import CHUNK_SIZE, generate, make_llm, random_tokens, request, shutdown_llm

    from flowkv.fleet.protocol import Registration, TierInfo
    from flowkv.fleet.reporter import Reporter, new_session

    server = node_servers("vllm-fleet", memory="64MiB")
    name = default_server_name(server.socket)
    follower = node_report(controller, server.socket, tmp_path)
    section = {"url": controller.url, "instance_id": "v", "heartbeat_s": 0.3,
               "token_file": str(controller.token_file), "advertise_url": "http://v.invalid"}
    pipeline = node_pipeline(tmp_path, server.socket, name="node-fleet", chunk_size=CHUNK_SIZE,
                             sections={"controller": section})
    llm = other = None
    try:
        llm = make_llm({"pipeline": str(pipeline)})
        registered = wait_for(lambda: controller.instance("v"), "the vLLM instance is registered")
        assert registered["shared"] == [name] and registered["kind"] == "vllm"
        doc = random_tokens(500, 4 * CHUNK_SIZE)
        generate(llm, [request(doc + random_tokens(501, 20))])
        got = wait_for(lambda: (lambda r: r if r.get("v", {}).get("matched_tokens") == len(doc) else None)(
            answers(controller, torch.tensor(doc))), "the controller knows the document vLLM served")
        assert got["v"]["chunks_by_tier"] == {f"{name}/memory": 4}
        # Another instance on the node, reading through the same server, holds it as well.
        other = Reporter(ReporterConfig(url=controller.url, heartbeat_s=0.3, token_file=str(controller.token_file)),
                         Registration(instance_id="w", session=new_session(), model=registered["model"],
                                      key_model=registered["key_model"], chunk_size=registered["chunk_size"],
                                      hash=registered["hash"], shared=[name],
                                      tiers=[TierInfo(name="node", kind="server")])).start()
        assert other.wait_idle(60)
        assert answers(controller, torch.tensor(doc))["w"]["matched_tokens"] == len(doc)
    finally:
        if other is not None:
            other.close()
        if llm is not None:
            shutdown_llm(llm)
        follower.terminate()
        follower.wait(timeout=30)
