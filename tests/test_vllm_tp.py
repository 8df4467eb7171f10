"""Tensor and pipeline parallel: ``vllm serve`` with two ranks and flowkv, one core per rank, each pipeline.

Every server starts from the README's "Tensor parallel" lines (their
``export VLLM_CPU_OMP_THREADS_BIND="0|1"``, flags and transfer config), eager
float32, two workers, one server per pipeline, each stopped when its tests end
(a TP=2 start costs 25-40 s on two cores). A hit's greedy tokens are compared
with the same prompt computed cold on the same server: asked with a tag of its
own and ``flowkv.skip_save``, so flowkv finds nothing for it and stores nothing
(the unconnected reference servers of test_vllm_serve and test_vllm_matrix show
that a connected engine computes what an unconnected one does; here a wrong
shard, rank or layer loaded shows as different tokens):

1. ``cpu-redis`` on a real redis-server, reporting to a real ``flowkv
   controller`` (plus a store stage that lets one rank keep less of a tagged
   request, ``rank_stages:rank_gap``): a repeated document loads whole from
   the ranks' memory tiers; the controller lists both ranks and answers the
   instance once; a chunk one rank lacks shortens the hit to what every rank
   holds; with both ranks' memory cleared (the controller's ``/clear``) and
   one rank's later chunks deleted in Redis, the hit is what both ranks find
   in Redis. (``local-cpu`` at TP=2 is this server's memory tier without
   Redis behind it: its README line differs in the pipeline's name only, so
   it gets no server of its own.)
2. ``--pipeline-parallel-size 2`` (``local-cpu`` and the rank-gap stage),
   compiled: vLLM 0.32's CPU backend fails eager pipeline parallel at its
   first request (pinned below without a server).
3. ``node`` on one ``flowkv server`` both ranks share (plus the
   ``node_servers:hold`` store stage for tagged requests): the document loads
   whole; one rank's entries removed from the server (its operator
   ``remove``) shorten the hit; a single-rank instance (a ``vllm.LLM`` in the
   test's process) shares the server with both ranks. Last, one rank's worker killed with SIGKILL
   while a request streams and another's store holds rooms in the server:
   vLLM's engine dies and its API server exits, as vLLM handles a dead
   worker, and the node server keeps no room, read or pin of theirs.

Every rank stores and loads its own shard of each chunk, under keys that carry
the world size and its rank; the scheduler's hit is the minimum over the
ranks' answers. One story in steps: the module keeps its order under --shuffle.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import vllm  # noqa: F401 - a broken vLLM install fails these tests; it never skips them

from fleet_helpers import ControllerProcess
from node_servers import HOLD_TAG, node_servers, wait_for  # noqa: F401 - pytest fixture
from rank_stages import RANK_GAP_TAG
from redis_servers import redis_server  # noqa: F401 - pytest fixture
from vllm_helpers import CHUNK_SIZE, random_tokens
from vllm_server import MODEL_NAME, README, REDIS_PATIENCE, VllmServer, _sse_events, shell_commands, start_server

from flowkv.integration.vllm.settings import SKIP_SAVE_KEY
from flowkv.keys import CacheKey, chain_hashes
from flowkv.pipeline import dumps_pipeline

pytestmark = [pytest.mark.vllm, pytest.mark.in_order]

TESTS = Path(__file__).resolve().parent
DOC_TOKENS = 2048  # eight chunks
QUESTIONS = [random_tokens(8100 + i, 40) for i in range(3)]
MAX_TOKENS = 12
LEASE_S = 5.0


def readme_line(flag: str, pipeline: str) -> tuple[dict[str, str], list[str], dict]:
    """The README's ``vllm serve`` command with ``flag`` (``--tensor-parallel-size``) and ``pipeline`` as a
    user types it: the variables the ``export`` line before it sets, the flags but the model and the transfer
    config, and that config."""
    commands = shell_commands(README.read_text(encoding="utf-8"))
    for at, (_, argv) in enumerate(commands):
        if argv[:2] != ["vllm", "serve"] or flag not in argv or "--kv-transfer-config" not in argv:
            continue
        transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        if transfer["kv_connector_extra_config"]["pipeline"] == pipeline:
            break
    else:
        raise LookupError(f"README.md has no vllm serve line with {flag} and pipeline {pipeline!r}")
    exported = next((argv for _, argv in reversed(commands[:at]) if argv[0] == "export"), [])
    env = dict(assignment.split("=", 1) for assignment in exported[1:])
    flags = []
    rest = iter(argv[3:])  # past "vllm serve MODEL"
    for name in rest:
        value = next(rest)
        if name != "--kv-transfer-config":
            flags += [name, value]
    return env, flags, transfer


def parallel_server(folder: Path, kv_extra: dict | None = None, *, pipeline: str = "local-cpu",
                    flag: str = "--tensor-parallel-size", compiled: bool = False) -> VllmServer:
    """The README's line with ``flag`` and ``pipeline`` (its environment, flags and transfer config; ``kv_extra``
    over that config), or without ``kv_extra`` the same server unconnected."""
    env, flags, transfer = readme_line(flag, pipeline)
    # the workers import the pipelines' test stages
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return start_server(folder, kv_extra=kv_extra, transfer=transfer, compiled=compiled, dtype="float32", env=env,
                        args=flags, worker_process=True)


@pytest.fixture(scope="module")
def reference():
    """``reference(server, prompt)``: the greedy answer of ``server`` to ``prompt`` computed cold (a tag no
    stored chunk carries, nothing saved), asked once per server and prompt."""
    answers: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def answer(server: VllmServer, prompt: list[int]) -> list[int]:
        key = (server.url, tuple(prompt))
        if key not in answers:
            output, cached = ask(server, prompt, {"reference": "cold"}, skip_save=True)
            assert cached == 0, "a reference answer must be computed, not loaded"
            answers[key] = output
        return answers[key]

    return answer


@pytest.fixture(scope="module")
def rank_gap_pipeline(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp-pipelines") / "local-cpu-rank-gap.toml"
    path.write_text(dumps_pipeline(
        pipeline={"name": "local-cpu-rank-gap", "chunk_size": CHUNK_SIZE},
        tiers={"memory": {"kind": "memory", "capacity": "256MiB"}},
        store=["tokenize", "chunk-hash", "rank_stages:rank_gap", "allocate", "gather", ("compress", {"codec": "none"}),
               "put"],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"]), encoding="utf-8")
    return path


def with_store_stage(folder: Path, base: str, *, after: str, stage: str) -> Path:
    """A pipeline file in ``folder``: built-in pipeline ``base`` with ``stage`` in its store right after ``after``."""
    name = f"{base}-{stage.split(':')[-1].replace('_', '-')}"
    path = folder / f"{name}.toml"
    path.write_text(f'extends = "{base}"\n\n[pipeline]\nname = "{name}"\n\n[store]\nreplace = ["{after}"]\n'
                    f'[[store.stages]]\nuse = "{after}"\n[[store.stages]]\nuse = "{stage}"\n', encoding="utf-8")
    return path


def ask(instance: VllmServer, prompt: list[int], tags: dict[str, str] | None = None, *,
        skip_save: bool = False) -> tuple[list[int], int]:
    """Greedy token ids and the prompt tokens flowkv loaded."""
    params: dict[str, object] = {f"flowkv.tag.{name}": value for name, value in (tags or {}).items()}
    if skip_save:
        params[SKIP_SAVE_KEY] = True
    reply = instance.complete(prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                              **({"kv_transfer_params": params} if params else {}))
    details = reply["usage"].get("prompt_tokens_details") or {}
    return reply["choices"][0]["token_ids"], details.get("cached_tokens") or 0


def repeat_loads_the_whole_document(instance: VllmServer, reference, seed: int) -> None:
    doc = random_tokens(seed, DOC_TOKENS)
    for n, question in enumerate(QUESTIONS):
        output, cached = ask(instance, doc + question)
        assert output == reference(instance, doc + question), n
        # The first ask computes the document; every later one loads all of it (>= 90 %: all eight chunks).
        assert cached == (0 if n == 0 else DOC_TOKENS), n
    assert instance.metric("vllm:flowkv_retrieved_tokens_total") >= 2 * DOC_TOKENS


def doc_keys(keys: list[str], doc: list[int]) -> dict[int, list[str]]:
    """The keys among ``keys`` of ``doc``'s eight chunks, per rank, in chunk order (flowkv's own chunk
    hashes: vLLM's sha256_cbor over 256-token chunks)."""
    hashes = chain_hashes(doc, CHUNK_SIZE, "sha256_cbor", partial=False)
    found: dict[int, dict[int, str]] = {}
    for key in keys:
        parsed = CacheKey.from_str(key)
        if parsed.chunk_hash in hashes:
            found.setdefault(parsed.prefix.worker_rank, {})[hashes.index(parsed.chunk_hash)] = key
    return {rank: [by_index[i] for i in sorted(by_index)] for rank, by_index in sorted(found.items())}


# -- cpu-redis, with the controller ----------------------------------------------------------


class TestCpuRedis:
    NAMESPACE = "tp-test"

    @pytest.fixture(scope="class")
    @classmethod
    def fleet(cls, tmp_path_factory, redis_server):  # noqa: F811 - the fixture imported above
        import redis

        folder = tmp_path_factory.mktemp("tp-redis")
        controller = ControllerProcess(folder / "controller", heartbeat_s=0.5, timeout_s=30.0).start()
        try:
            # The README's cpu-redis pipeline, with the rank-gap store stage (untagged requests pass).
            pipeline = with_store_stage(folder, "cpu-redis", after="chunk-hash", stage="rank_stages:rank_gap")
            server = parallel_server(folder / "serve", {
                "pipeline": str(pipeline), "tiers.redis.url": redis_server.url, "tiers.redis.namespace": cls.NAMESPACE,
                **REDIS_PATIENCE,
                "controller": {"url": controller.url, "instance_id": "tp-redis", "heartbeat_s": 0.5,
                               "token_file": str(controller.token_file)}}, pipeline="cpu-redis")
            try:
                yield {"server": server, "controller": controller, "redis": redis.Redis.from_url(redis_server.url)}
            finally:
                server.close()
        finally:
            controller.close()

    def in_redis(self, fleet, doc: list[int]) -> dict[int, list[str]]:
        """The Redis keys of ``doc``'s chunks per rank, in chunk order (each a flowkv key under the namespace)."""
        stored = {}
        for raw in fleet["redis"].scan_iter(match=f"{self.NAMESPACE}:*", count=1000):
            name = raw.decode()[len(self.NAMESPACE) + 1:]
            stored[name.replace("%7B", "{").replace("%7D", "}").replace("%25", "%")] = raw
        return {rank: [stored[key] for key in keys] for rank, keys in doc_keys(list(stored), doc).items()}

    def written_behind(self, fleet, doc: list[int]) -> dict[int, list[bytes]]:
        return wait_for(lambda: (held := self.in_redis(fleet, doc)) and [len(keys) for keys in held.values()] == [8, 8]
                        and held, "Redis to hold both ranks' shards of the document's eight chunks", timeout_s=120)

    def test_both_ranks_store_and_load_their_shards_and_the_controller_lists_each_rank(self, reference, fleet):
        repeat_loads_the_whole_document(fleet["server"], reference, 8004)
        doc = random_tokens(8004, DOC_TOKENS)
        self.written_behind(fleet, doc)
        controller = fleet["controller"]
        # Each rank a holder; the instance one: it holds what both ranks hold, and is answered once.
        listed = wait_for(lambda: (i := controller.instance("tp-redis")) and i["state"] == "up"
                          and all(h["tiers"].get("memory", 0) >= 8 for h in i["holders"]) and i,
                          "both ranks to report their chunks", timeout_s=120)
        assert (listed["world_size"], listed["ranks"], listed["missing_ranks"]) == (2, [0, 1], [])
        assert listed["chunks"] >= 8
        [holder] = controller.lookup(token_ids=doc)
        assert (holder["instance_id"], holder["matched_tokens"]) == ("tp-redis", DOC_TOKENS)

    def test_a_chunk_one_rank_lacks_shortens_the_hit_to_the_chunks_every_rank_holds(self, reference, fleet):
        server = fleet["server"]
        doc = random_tokens(8001, DOC_TOKENS)
        # Rank 1 keeps the document's first three chunks only (in memory and in Redis); rank 0 all eight.
        tags = {RANK_GAP_TAG: "1:3"}
        first, cached = ask(server, doc + QUESTIONS[0], tags)
        assert cached == 0 and first == reference(server, doc + QUESTIONS[0])
        output, cached = ask(server, doc + QUESTIONS[1], tags)
        assert cached == 3 * CHUNK_SIZE and output == reference(server, doc + QUESTIONS[1])
        # And the other way round: rank 0 lacking the chunks from the sixth on leaves five.
        tags = {RANK_GAP_TAG: "0:5"}
        ask(server, doc + QUESTIONS[0], tags)
        output, cached = ask(server, doc + QUESTIONS[1], tags)
        assert cached == 5 * CHUNK_SIZE and output == reference(server, doc + QUESTIONS[1])

    def test_a_chunk_one_rank_lacks_in_redis_shortens_the_hit_once_memory_is_cleared(self, reference, fleet):
        server, controller = fleet["server"], fleet["controller"]
        doc = random_tokens(8005, DOC_TOKENS)
        output, cached = ask(server, doc + QUESTIONS[0])
        assert cached == 0 and output == reference(server, doc + QUESTIONS[0])
        in_redis = self.written_behind(fleet, doc)
        # Both ranks' memory emptied (each rank runs the controller's clear on its own engine) ...
        cleared = controller.post("/clear", {"instance_id": "tp-redis", "tiers": ["memory"], "wait_s": 60})
        assert len(cleared["results"]) == 2 and all(r["ok"] for r in cleared["results"].values())
        # ... and rank 0's shards of the chunks from the sixth on deleted in Redis: rank 1 finds eight, rank 0 five.
        assert fleet["redis"].delete(*in_redis[0][5:]) == 3
        output, cached = ask(server, doc + QUESTIONS[1])
        assert cached == 5 * CHUNK_SIZE and output == reference(server, doc + QUESTIONS[1])


# -- pipeline parallel -------------------------------------------------------------------------


def test_vllm_cpu_skips_the_warm_up_that_eager_pipeline_parallel_needs():
    """Why the README's pipeline-parallel line runs compiled: vLLM 0.32's CPU model runner makes a
    later stage's buffer for the hidden states it receives (``intermediate_tensors``) only in the
    warm-up's dummy run, and skips that warm-up when eager; the first request of an eager
    ``--pipeline-parallel-size 2`` server then fails (``assert self.intermediate_tensors is not None`` in
    ``gpu_model_runner.sync_and_gather_intermediate_tensors``; seen on this machine). When this test
    fails, vLLM changed that: try the eager server again."""
    from types import SimpleNamespace

    from vllm.config import CompilationMode
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    ran = []
    runner = SimpleNamespace(profile_run=lambda: ran.append("profile_run"), vllm_config=SimpleNamespace(
        compilation_config=SimpleNamespace(mode=CompilationMode.NONE)))
    CPUModelRunner.warming_up_model(runner)
    assert ran == [], "vLLM's CPU runner now warms up eager engines: eager pipeline parallel may work"


class TestPipelineParallel:
    @pytest.fixture(scope="class")
    @classmethod
    def flowkv(cls, tmp_path_factory, rank_gap_pipeline):
        server = parallel_server(tmp_path_factory.mktemp("pp-local-cpu"), {"pipeline": str(rank_gap_pipeline)},
                                 flag="--pipeline-parallel-size", compiled=True)
        yield server
        server.close()

    def test_both_stages_store_and_load_their_layers_of_a_repeated_document(self, reference, flowkv):
        repeat_loads_the_whole_document(flowkv, reference, 8006)
        assert "Worker_PP1" in flowkv.log()

    def test_a_chunk_one_stage_lacks_shortens_the_hit(self, reference, flowkv):
        doc = random_tokens(8007, DOC_TOKENS)
        tags = {RANK_GAP_TAG: "1:3"}  # the second stage (rank 1) keeps the first three chunks only
        ask(flowkv, doc + QUESTIONS[0], tags)
        output, cached = ask(flowkv, doc + QUESTIONS[1], tags)
        assert cached == 3 * CHUNK_SIZE and output == reference(flowkv, doc + QUESTIONS[1])


# -- node, shared by both ranks; last: a rank's worker killed -------------------------------------


class TestNode:
    @pytest.fixture(scope="class")
    @classmethod
    def node(cls, node_servers):  # noqa: F811 - the fixture imported above
        return node_servers("tp", memory="256MiB", lease_timeout_s=LEASE_S)

    @pytest.fixture(scope="class")
    @classmethod
    def flowkv(cls, tmp_path_factory, node):
        folder = tmp_path_factory.mktemp("tp-node")
        # The README's node pipeline, with a store stage that holds tagged requests (untagged ones pass).
        pipeline = with_store_stage(folder, "node", after="gather", stage="node_servers:hold")
        server = parallel_server(folder / "serve", {"pipeline": str(pipeline), "tiers.node.socket": str(node.socket)},
                                 pipeline="node")
        yield server
        server.close()

    def test_both_ranks_store_and_load_their_shards_through_the_node_server(self, reference, node, flowkv):
        repeat_loads_the_whole_document(flowkv, reference, 8002)
        stored = doc_keys(self.snapshot(node), random_tokens(8002, DOC_TOKENS))
        assert [len(keys) for keys in stored.values()] == [8, 8]  # one server, both ranks' shards
        pids = {session["pid"] for session in node.status()["sessions"] if session["connected"]}
        assert len(pids & set(flowkv.live_processes())) == 2  # each rank's worker its own client

    @staticmethod
    def snapshot(node) -> list[str]:
        conn = node.connect("test-tp")
        try:
            return conn.call("snapshot")["keys"]
        finally:
            conn.close()

    def test_one_ranks_entries_removed_from_the_node_server_shorten_the_hit(self, reference, node, flowkv):
        doc = random_tokens(8003, DOC_TOKENS)
        output, cached = ask(flowkv, doc + QUESTIONS[0])
        assert cached == 0 and output == reference(flowkv, doc + QUESTIONS[0])
        # Rank 1's shards of the chunks from the fourth on removed (the operator's remove): three chunks left.
        stored = doc_keys(self.snapshot(node), doc)
        conn = node.connect("test-tp")
        try:
            assert conn.call("remove", keys=stored[1][3:])["removed"] == [True] * 5
        finally:
            conn.close()
        output, cached = ask(flowkv, doc + QUESTIONS[1])
        assert cached == 3 * CHUNK_SIZE and output == reference(flowkv, doc + QUESTIONS[1])

    def test_a_single_rank_instance_shares_the_node_server_with_both_ranks(self, reference, node, flowkv):
        """Another instance (one rank, a ``vllm.LLM`` in this process) on the same node server: each instance
        stores and loads its own entries beside the other's (its keys carry world size 1), and the TP
        instance still loads its document whole afterwards."""
        from vllm_helpers import generate, make_llm, request, shutdown_llm

        tp_doc, doc = random_tokens(8011, DOC_TOKENS), random_tokens(8010, DOC_TOKENS)
        assert ask(flowkv, tp_doc + QUESTIONS[0])[1] == 0
        llm = make_llm({"pipeline": "node", "tiers.node.socket": str(node.socket)})
        try:
            (cold, cold_cached), = generate(llm, [request(doc + QUESTIONS[0], max_tokens=MAX_TOKENS)])
            (warm, warm_cached), = generate(llm, [request(doc + QUESTIONS[0], max_tokens=MAX_TOKENS)])
        finally:
            shutdown_llm(llm)
        assert (cold_cached, warm_cached) == (0, DOC_TOKENS) and warm == cold
        held = collections.Counter((parsed.prefix.world_size, parsed.prefix.worker_rank)
                                   for parsed in map(CacheKey.from_str, self.snapshot(node)))
        # the single-rank instance's eight chunks, beside both ranks' shards of the TP instance's document
        assert held[(1, 0)] == 8 and held[(2, 0)] >= 8 and held[(2, 1)] >= 8 and set(held) == {(1, 0), (2, 0), (2, 1)}
        output, cached = ask(flowkv, tp_doc + QUESTIONS[1])
        assert cached == DOC_TOKENS and output == reference(flowkv, tp_doc + QUESTIONS[1])

    def test_a_ranks_worker_killed_mid_run_ends_the_engine_and_leaves_nothing_held_in_the_node_server(
            self, node, flowkv, tmp_path):
        streamed: list[dict | None] = []

        # As many greedy tokens as the model's length leaves (--max-model-len 4096): the stream must still run
        # when the second request's store holds (a store holds the engine's step, so the stream pauses there).
        stream_tokens = 4096 - 300

        def stream() -> None:
            body = {"model": MODEL_NAME, "prompt": random_tokens(8200, 300), "max_tokens": stream_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            request = urllib.request.Request(flowkv.url + "/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=600) as reply:
                    for event in _sse_events(reply):
                        streamed.append(event)
            except OSError:  # the connection broke: what the client saw is the assertion
                pass

        client = threading.Thread(target=stream)
        client.start()
        wait_for(lambda: streamed, "the stream's first tokens", timeout_s=300)
        # A second request whose store holds in both ranks after gathering its first chunk: rooms allocated in
        # the server, not committed, when a rank dies.
        holding = tmp_path / "holding"
        holding.mkdir()
        answers: list[BaseException | dict] = []

        def held() -> None:
            try:
                answers.append(flowkv.complete(random_tokens(8201, 700), max_tokens=4,
                                               kv_transfer_params={f"flowkv.tag.{HOLD_TAG}": str(holding)}))
            except Exception as exc:  # noqa: BLE001
                answers.append(exc)

        second = threading.Thread(target=held)
        second.start()
        pids = wait_for(lambda: len(found := {int(p.name) for p in holding.iterdir()}) == 2 and found,
                        "both ranks' stores to hold", timeout_s=300)
        assert node.status()["clients"]["allocations_held"] >= 2
        [victim] = [pid for pid in pids if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::Worker_TP1")]
        os.kill(victim, 9)
        client.join(600)
        second.join(600)
        # vLLM: the executor sees its worker die and shuts the other down, the engine core dies and every
        # request in flight fails, then the API server exits. A stream ends early, with an error event (code
        # 500) or a piece finished "abort"/"error" before its [DONE], or a broken connection; a plain request
        # answers 500 (or is finished the same way).
        print(f"the stream ended with {streamed[-2:]}; the other request got {answers}")
        pieces = [event for event in streamed if event is not None and "choices" in event]
        errors = [event["error"] for event in streamed if event is not None and "error" in event]
        reasons = {choice.get("finish_reason") for piece in pieces for choice in piece["choices"]} - {None}
        assert pieces
        if len(pieces) < stream_tokens or errors:
            # In flight at the kill (as in a quiet run): it ended early, with an error.
            assert "length" not in reasons
            assert [error["code"] for error in errors] == [500] or reasons & {"abort", "error"} or None not in streamed
        else:
            # On a loaded machine the held request's store has been seen to start only after the stream
            # finished (whole, with its [DONE]): the kill then finds only the held store in flight.
            assert reasons == {"length"} and streamed[-1] is None
        [answer] = answers
        assert (isinstance(answer, urllib.error.HTTPError) and answer.code == 500 or isinstance(answer, OSError)
                or answer["choices"][0]["finish_reason"] in ("abort", "error"))
        exit_code = flowkv.proc.wait(timeout=300)
        print(f"vllm serve exited with {exit_code}")
        assert not flowkv.wait_for_group_exit()
        assert "died unexpectedly" in flowkv.log()
        # Nothing of theirs is held: rooms, reads and pins of both ranks' connections reclaimed.
        clients = wait_for(lambda: (c := node.status()["clients"])["allocations_held"] == 0 and c["reads_held"] == 0
                           and c["disconnected"] == 0 and c, "the node server to reclaim the dead ranks' leases",
                           timeout_s=LEASE_S * 20)
        assert clients["pin_owners"] == 0 and node.status()["memory"]["pinned_entries"] == 0
        assert node.running
