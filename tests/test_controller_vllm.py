"""Two real `vllm serve` instances with flowkv, a real controller and `flowkv route`, on loopback.

One module, so the two vLLM servers (the expensive part) are started once:
A publishes vLLM's KV events over ZMQ (``--kv-events-config``, with vLLM's
prefix cache on, so vLLM reports its own blocks too); B does not. The tests
run in file order and the last one kills A.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from fleet_helpers import ControllerProcess, status_of, wait_for
from flowkv.fleet.tokens import Tokenizers
from vllm_helpers import tiny_model_dir
from vllm_server import MODEL_NAME, VllmServer, free_port

# One story in steps (the docstring): --shuffle moves the module whole.
pytestmark = [pytest.mark.vllm, pytest.mark.in_order]

CHUNK = 256
# How long the controller waits for a heartbeat: generous, two vLLM servers share two cores.
TIMEOUT_S = 10.0


def documents(count: int, words: int = 420, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocabulary = ("river forest mountain valley city harbor engine signal garden library market bridge "
                  "winter summer storm light shadow stone glass paper copper silver").split()
    return [f"Document {n}. " + " ".join(rng.choice(vocabulary) for _ in range(words)) for n in range(count)]


def flowkv_instance(folder: Path, controller: ControllerProcess, instance_id: str, *, args=()) -> VllmServer:
    """A `vllm serve` with flowkv reporting to ``controller`` as ``instance_id`` at its own URL."""
    # A lookup that waits long for the worker: two servers and the tests share two cores.
    server = VllmServer(folder, kv_extra={"chunk_size": CHUNK, "lookup_timeout_ms": 10_000}, args=args)
    extra = {"controller": {"url": controller.url, "instance_id": instance_id, "advertise_url": server.url,
                            "heartbeat_s": 0.5, "token_file": str(controller.token_file)}}
    at = server.command.index("--kv-transfer-config") + 1
    config = json.loads(server.command[at])
    config["kv_connector_extra_config"].update(extra)
    server.command[at] = json.dumps(config)
    return server


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    controller = ControllerProcess(root / "controller", heartbeat_s=0.5, timeout_s=TIMEOUT_S).start()
    events_port = free_port()
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                 "endpoint": f"tcp://127.0.0.1:{events_port}"}
    # vLLM's publisher connects to a host:port endpoint: the subscriber (as a router would) binds it.
    subscriber = EventSubscriber(events_port)
    a = flowkv_instance(root / "a", controller, "A",
                        args=["--enable-prefix-caching", "--kv-events-config", json.dumps(kv_events)])
    b = flowkv_instance(root / "b", controller, "B")
    started: dict[str, BaseException | None] = {}

    def start(name, server):
        try:
            server.start()
            started[name] = None
        except BaseException as exc:
            started[name] = exc

    threads = [threading.Thread(target=start, args=pair) for pair in (("A", a), ("B", b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        for name, error in started.items():
            if error is not None:
                raise error
        wait_for(lambda: {i["instance_id"]: i["state"] for i in controller.get("/instances")} == {"A": "up",
                                                                                                 "B": "up"},
                 "both instances registered with the controller")
        yield {"controller": controller, "a": a, "b": b, "events": subscriber,
               "tokenizer": Tokenizers(), "root": root}
    finally:
        for server in (a, b):
            server.close()
        subscriber.close()
        controller.close()


class EventSubscriber:
    """A router's end of vLLM's KV events: ZMQ SUB, decoded with vLLM's own msgspec classes."""

    def __init__(self, port: int) -> None:
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.bind(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.batches = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            _topic, _seq, payload = self._socket.recv_multipart()
            self.batches.append(decoder.decode(payload))

    def events(self):
        return [event for batch in list(self.batches) for event in batch.events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()


def prompt_ids(fleet, text: str) -> list[int]:
    return fleet["tokenizer"].encode(str(tiny_model_dir()), prompt=text)


def holders(fleet, token_ids) -> dict[str, int]:
    return {h["instance_id"]: h["matched_tokens"] for h in fleet["controller"].lookup(token_ids=token_ids)}


DOCS = documents(6)


def test_lookup_names_the_instance_that_served_a_document_with_its_matched_tokens(fleet):
    a = fleet["a"]
    token_ids = prompt_ids(fleet, DOCS[0])
    a.complete(DOCS[0], max_tokens=2)
    stored = len(token_ids) // CHUNK * CHUNK
    assert stored >= 2 * CHUNK
    wait_for(lambda: holders(fleet, token_ids).get("A") == stored, "the controller knows what A stored")
    assert "B" not in holders(fleet, token_ids)
    # By text and model, as the dashboard's lookup box asks: the controller tokenizes as vLLM does.
    by_text = fleet["controller"].lookup(text=DOCS[0], model=MODEL_NAME)
    assert [(h["instance_id"], h["matched_tokens"], h["tier"]) for h in by_text] == [("A", stored, "memory")]
    assert by_text[0]["url"] == a.url
    # What the instance reports with its heartbeats.
    listed = fleet["controller"].instance("A")
    assert listed["model"] == MODEL_NAME and listed["pipeline"] == "local-cpu" and listed["chunk_size"] == CHUNK
    wait_for(lambda: fleet["controller"].instance("A")["stats"]["counters"].get("stored_tokens", 0) >= stored,
             "A's heartbeats carry its engine's counters")


def test_vllm_kv_events_carry_flowkv_tiers_with_the_hashes_vllm_publishes_for_its_own_blocks(fleet):
    from vllm.distributed.kv_events import BlockStored

    token_ids = prompt_ids(fleet, DOCS[1])
    fleet["a"].complete(DOCS[1], max_tokens=2)
    block = 128

    def stored(medium):
        return [e for e in fleet["events"].events() if isinstance(e, BlockStored) and e.medium == medium]

    def vllm_hashes():
        """vLLM's own blocks (medium GPU, even on the CPU backend): tokens of a block -> its hash."""
        hash_of = {}
        for event in stored("GPU"):
            for offset, block_hash in enumerate(event.block_hashes):
                hash_of[tuple(event.token_ids[offset * block:(offset + 1) * block])] = block_hash
        return hash_of

    full_chunks = len(token_ids) // CHUNK
    wait_for(lambda: tuple(token_ids[(2 * full_chunks - 1) * block:2 * full_chunks * block]) in vllm_hashes(),
             "vLLM publishes its own blocks of the document")
    wait_for(lambda: any(list(e.token_ids) == token_ids[(full_chunks - 1) * CHUNK:full_chunks * CHUNK]
                         for e in stored("CPU")),
             "flowkv's memory tier (medium CPU) is in vLLM's KV events")
    vllm_hash_of = vllm_hashes()
    mine = [e for e in stored("CPU") if tuple(e.token_ids) in {tuple(token_ids[i * CHUNK:(i + 1) * CHUNK])
                                                               for i in range(full_chunks)}]
    assert len(mine) == full_chunks
    for event in mine:
        assert event.block_size == block and len(event.block_hashes) == CHUNK // block
        for offset, block_hash in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[offset * block:(offset + 1) * block])
            assert vllm_hash_of[tokens] == block_hash  # the very hash vLLM published for those tokens
    first = next(e for e in mine if list(e.token_ids) == token_ids[:CHUNK])
    second = next(e for e in mine if list(e.token_ids) == token_ids[CHUNK:2 * CHUNK])
    assert first.parent_block_hash is None and second.parent_block_hash == first.block_hashes[-1]


def test_a_bad_token_is_refused_and_clear_on_a_removes_it_from_lookups(fleet):
    controller = fleet["controller"]
    token_ids = prompt_ids(fleet, DOCS[0])
    assert "A" in holders(fleet, token_ids)
    # No token, a wrong one, and the tokens of the roles that may not clear (a reader's, an instance's).
    for token in (None, "not-the-token", controller.tokens["reader"], controller.tokens["instance"]):
        assert status_of(lambda: controller.post("/clear", {"instance_id": "A"}, token=token)) == 401
    assert "A" in holders(fleet, token_ids)
    reply = controller.post("/clear", {"instance_id": "A", "wait_s": 60})
    assert reply["instances"] == ["A"]
    results = list(reply["results"].values())
    assert results and results[0]["ok"] and results[0]["detail"].startswith("removed ")
    assert "A" not in holders(fleet, token_ids)
    # The instance dropped them indeed: serving the document again stores it again, and A is back.
    fleet["a"].complete(DOCS[0], max_tokens=2)
    wait_for(lambda: holders(fleet, token_ids).get("A") == len(token_ids) // CHUNK * CHUNK,
             "A holds the document again after serving it")


def test_route_sends_every_repeat_of_a_document_to_the_instance_that_holds_it(fleet):
    controller, a, b = fleet["controller"], fleet["a"], fleet["b"]
    port = free_port()
    log = open(fleet["root"] / "route.log", "wb")
    route = subprocess.Popen([str(Path(sys.executable).parent / "flowkv"), "route", "--port", str(port),
                              "--backend", a.url, "--backend", b.url, "--controller", controller.url,
                              "--token-file", str(controller.token_files["reader"]), "--lookup-timeout-s", "30", "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: json.load(urllib.request.urlopen(url + "/health"))["status"] == "ok", "route is up")
        docs = documents(4, seed=7)
        asks = [n for n in range(len(docs)) for _ in range(3)]
        random.Random(3).shuffle(asks)
        served_by: dict[int, list[str]] = {}
        for n in asks:
            token_ids = prompt_ids(fleet, docs[n])
            first = n not in served_by
            reply, backend = route_complete(url, docs[n])
            served_by.setdefault(n, []).append(backend)
            if first:
                # Wait until the controller knows who stored it, as a later repeat would find it.
                wait_for(lambda: holders(fleet, token_ids).get({a.url: "A", b.url: "B"}[backend]),
                         "the controller knows the first server of the document")
            else:
                assert backend == served_by[n][0], f"document {n} went to {served_by[n]}"
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # Both backends got documents (the first asks went by load).
        assert {backend for backends in served_by.values() for backend in backends} == {a.url, b.url}
        stats = json.load(urllib.request.urlopen(url + "/stats"))
        assert stats["decisions"].get("longest-prefix", 0) == len(asks) - len(docs)

        # Streaming is passed through: SSE chunks and the final [DONE].
        body = {"model": MODEL_NAME, "prompt": docs[0], "max_tokens": 4, "temperature": 0, "stream": True}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            assert reply.headers["x-flowkv-backend"] == served_by[0][0]
            lines = [line.decode().strip() for line in reply if line.strip()]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    finally:
        route.terminate()
        route.wait()


def route_complete(url: str, prompt: str):
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply), reply.headers["x-flowkv-backend"]


def test_a_controller_restart_is_followed_by_a_resync_of_both_instances(fleet):
    controller = fleet["controller"]
    token_ids = prompt_ids(fleet, DOCS[0])
    before = holders(fleet, token_ids)
    assert before.get("A")
    controller.restart()  # SIGKILL, then a new process on the same port: an empty directory
    wait_for(lambda: {i["instance_id"]: i["state"] for i in controller.get("/instances")} == {"A": "up", "B": "up"},
             "both instances register again by themselves")
    wait_for(lambda: holders(fleet, token_ids) == before, "the instances resync after the restart")


def test_killing_an_instance_marks_it_down_within_the_timeout(fleet):
    controller, a = fleet["controller"], fleet["a"]
    token_ids = prompt_ids(fleet, DOCS[0])
    assert "A" in holders(fleet, token_ids)
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait()
    wait_for(lambda: controller.instance("A")["state"] == "down", "A is marked down")
    # Down, not dropped: listed with what it held, and no lookup sends anyone there.
    assert controller.instance("A")["last_seen_s"] > TIMEOUT_S
    assert "A" not in holders(fleet, token_ids)
    assert [h["state"] for h in controller.lookup(token_ids=token_ids, include_down=True)
            if h["instance_id"] == "A"] == ["down"]
    assert controller.instance("B")["state"] == "up"
