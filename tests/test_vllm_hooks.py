"""What vLLM (0.32, CPU) does with a KV connector: the facts flowkv's connector is built on.

Each test states one behaviour of vLLM that ``flowkv.integration.vllm`` relies
on, checked against a recording connector (``vllm_probe.FlowKVProbe``: flowkv's
connector, logging every hook call from every vLLM process). Should vLLM
change one of them, its test fails here first, naming it, rather than as a
wrong hit count elsewhere.

One engine serves the module: a cold request of 700 prompt tokens (stored),
then a warm one sharing its first 700 tokens (loads two chunks, 512 tokens),
both decoding three tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import BLOCK_SIZE, CHUNK_SIZE, generate, make_llm, random_tokens, request, shutdown_llm  # noqa: E402
from vllm_probe import LOG_ENV, layer_index  # noqa: E402

TAGS = {"suite": "hooks"}
SALT = "hooks-salt"
PREFIX = 700


@dataclass
class Run:
    records: list[dict[str, Any]]
    # (generated tokens, num_cached_tokens) of the cold and the warm request.
    cold: tuple[list[int], int]
    warm: tuple[list[int], int]

    def of(self, role: str, hook: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records if r["role"] == role and (hook is None or r["hook"] == hook)]

    def worker_steps(self) -> list[list[dict[str, Any]]]:
        """The worker's hook calls from each bind_connector_metadata to the next."""
        steps: list[list[dict[str, Any]]] = []
        for record in self.of("worker"):
            if record["hook"] == "bind_connector_metadata":
                steps.append([])
            if steps:
                steps[-1].append(record)
        return steps


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    log = tmp_path_factory.mktemp("hooks") / "hooks.jsonl"
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv(LOG_ENV, str(log))  # vLLM's processes inherit it
    try:
        llm = make_llm({"pipeline": "local-cpu", "chunk_size": CHUNK_SIZE, "tiers.memory.capacity": "64MiB"},
                       connector=("FlowKVProbe", "vllm_probe"),
                       # the subject is which process builds which side: vLLM's own process layout
                       separate_processes=True)
        try:
            prefix = random_tokens(41, PREFIX)
            [cold] = generate(llm, [request(prefix + random_tokens(42, 20), max_tokens=3, tags=TAGS, cache_salt=SALT)])
            [warm] = generate(llm, [request(prefix + random_tokens(43, 30), max_tokens=3, tags=TAGS, cache_salt=SALT)])
        finally:
            shutdown_llm(llm)
    finally:
        monkeypatch.undo()
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    return Run(records=sorted(records, key=lambda r: r["t"]), cold=cold, warm=warm)


pytestmark = pytest.mark.vllm


def test_the_connector_is_built_once_per_process_worker_first_with_one_instance_id(run):
    [worker] = run.of("worker", "init")
    [scheduler] = run.of("scheduler", "init")
    [register] = run.of("worker", "register_kv_caches")
    assert worker["pid"] != scheduler["pid"]
    # The worker's lookup socket exists before the scheduler connects to it.
    assert worker["t"] < register["t"] < scheduler["t"]
    # Both name the IPC sockets after it.
    assert worker["instance_id"] == scheduler["instance_id"]


def test_register_kv_caches_gets_one_view_per_layer_of_one_buffer_in_model_order(run):
    [register] = run.of("worker", "register_kv_caches")
    [init] = run.of("worker", "init")
    names = register["names"]
    # A layer's index (layerwise pipelines) is its position in this dict.
    assert [layer_index(name) for name in names] == list(range(len(names))) and len(names) == 2
    # CPU backend: (num_blocks, num_kv_heads, block_size, 2 * head_size); inside a block and head,
    # the keys of every token, then the values (test_kernels checks that against vLLM's own write).
    for shape in register["shapes"]:
        assert shape[1:] == [init["num_kv_heads"], BLOCK_SIZE, 2 * init["head_size"]]
    assert all(register["contiguous"])
    # Every layer is a view into one storage, one after the other.
    assert len(set(register["storages"])) == 1
    assert register["offsets_bytes"] == [i * register["layer_bytes"][0] for i in range(len(names))]
    assert register["storage_bytes"] == sum(register["layer_bytes"])


def test_lookups_see_no_computed_tokens_and_the_requests_own_params(run):
    lookups = run.of("scheduler", "get_num_new_matched_tokens")
    assert len({r["req_id"] for r in lookups}) == 2
    for lookup in lookups:
        # Prefix caching off: vLLM computed nothing of a new request.
        assert lookup["num_computed_tokens"] == 0
        # SamplingParams(extra_args={"kv_transfer_params": ...}) reaches the request as is.
        assert lookup["kv_transfer_params"] == {f"flowkv.tag.{k}": v for k, v in TAGS.items()}
        assert lookup["cache_salt"] == SALT
    # Loads are synchronous: (tokens, load_kv_async=False).
    assert [r["result"] for r in lookups] == [[0, False], [2 * CHUNK_SIZE, False]]


def test_update_state_after_alloc_follows_each_lookup_with_one_block_group(run):
    scheduler = run.of("scheduler")
    for position, record in enumerate(scheduler):
        if record["hook"] != "get_num_new_matched_tokens":
            continue
        after = scheduler[position + 1]
        assert after["hook"] == "update_state_after_alloc" and after["req_id"] == record["req_id"]
        [group] = after["block_ids"]["tuple"]  # one KV-cache group: the hybrid manager is off
        # The external tokens vLLM took: all the lookup offered.
        assert after["num_external_tokens"] == record["result"][0]
        if after["num_external_tokens"]:
            assert len(group) * BLOCK_SIZE >= after["num_external_tokens"]


def test_build_connector_meta_sees_per_group_blocks_and_decode_steps_carry_no_token_ids(run):
    metas = run.of("scheduler", "build_connector_meta")
    new = [r for meta in metas for r in meta["new_reqs"]]
    assert len(new) == 2
    for entry in new:
        [blocks] = entry["block_ids"]["tuple"]
        assert blocks
    # Without pipeline parallelism decode steps carry no token ids: flowkv reads Request.all_token_ids.
    decode_steps = [meta for meta in metas if meta["cached_reqs"]]
    assert decode_steps
    assert all(meta["cached_new_token_ids"] == [] for meta in decode_steps)
    for meta in decode_steps:
        for entry in meta["cached_reqs"]:
            assert meta["num_scheduled_tokens"][entry["req_id"]] == 1
            assert entry["new_block_ids"] is None or len(entry["new_block_ids"]["tuple"]) == 1


def test_worker_hooks_come_in_this_order_each_step(run):
    [register] = run.of("worker", "register_kv_caches")
    layers = register["names"]
    steps = run.worker_steps()
    assert steps
    load_steps = empty_steps = 0
    for step in steps:
        hooks = [r["hook"] for r in step]
        [start] = [r for r in step if r["hook"] == "start_load_kv"]
        forward = [(r["hook"], r["layer"]) for r in step if r["hook"] in ("wait_for_layer_load", "save_kv_layer")]
        if start["attn_metadata"] is None:
            # The step that only reports finished requests runs no model: no attention metadata, no layer hooks.
            empty_steps += 1
            assert forward == [] and not step[0]["loads"]
        else:
            # Each attention layer: wait for its load on entry, save on exit, in model order;
            # forward_context.attn_metadata holds one entry per layer.
            assert start["attn_metadata"] == "dict"
            assert forward == [(hook, name) for name in layers for hook in ("wait_for_layer_load", "save_kv_layer")]
        if step[0]["loads"]:
            # A step with a synchronous load starts it before the forward pass...
            load_steps += 1
            assert hooks[1] == "start_load_kv"
        elif forward:
            # ...any other step after it.
            assert hooks.index("start_load_kv") > hooks.index("save_kv_layer")
        tail = [h for h in hooks if h in ("start_load_kv", "wait_for_save", "get_block_ids_with_load_errors",
                                          "get_kv_connector_stats", "clear_connector_metadata")]
        # Load errors are read after wait_for_save, so loads may finish as late as that;
        # stats are asked for once per step.
        assert tail[-4:] == ["wait_for_save", "get_block_ids_with_load_errors", "get_kv_connector_stats",
                             "clear_connector_metadata"]
        assert hooks.count("get_kv_connector_stats") == 1
    assert load_steps == 1 and empty_steps >= 1


def test_the_worker_calls_from_a_thread_pinned_to_one_core_and_flowkvs_threads_run_off_it(run):
    """vLLM binds its OpenMP threads one per core of VLLM_CPU_OMP_THREADS_BIND (0-1 here) and calls the
    connector from the master, pinned to the first: the threads flowkv starts there (lookup server,
    pre-fault refill, pin expiry, tier I/O) would inherit that core; they run on the others."""
    saves = run.of("worker", "wait_for_save")
    assert saves
    last = saves[-1]
    assert last["caller_cores"] == [0]
    flowkv_threads = {name: cores for name, cores in last["threads"].items() if name.startswith("flowkv")}
    # (the pre-fault of this 64 MiB arena is done by now: its thread has ended)
    assert any(name.startswith("flowkv-ipc") for name in flowkv_threads) and "flowkv-pin-timer" in flowkv_threads
    for name, cores in flowkv_threads.items():
        assert cores == [1], (name, last["threads"])
    # The thread that drives the model is vLLM's: its name is the process's main thread's.
    assert last["threads"]["MainThread"] == [0]


def test_torch_runs_one_thread_per_bound_core_in_the_worker_and_one_in_the_engine_core(run):
    """"Reducing Torch threads from 2 to 1 for serving" is the engine-core process's (where the
    scheduler-side connector runs): in the worker a torch op (a copy, index_select) still runs on vLLM's
    OpenMP team, one thread pinned to each core of VLLM_CPU_OMP_THREADS_BIND, the other cores' threads
    idle between forward passes. (A parallel region there waits at its barrier for every one of them.)"""
    assert {save["torch_threads"] for save in run.of("worker", "wait_for_save")} == {2}
    assert {meta["torch_threads"] for meta in run.of("scheduler", "build_connector_meta")} == {1}


def test_save_kv_layer_gets_the_layers_paged_tensor_and_cpu_attention_metadata(run):
    [register] = run.of("worker", "register_kv_caches")
    saves = run.of("worker", "save_kv_layer")
    assert saves
    for save in saves:
        position = register["names"].index(save["layer"])
        # The very tensor register_kv_caches got for that layer.
        assert save["shape"] == register["shapes"][position]
        assert save["kv_layer_ptr"] == register["storages"][position] + register["offsets_bytes"][position]
        assert save["attn_metadata"] == "CPUAttentionMetadata"
        assert save["slot_mapping_dtype"] == "torch.int64"


def test_num_cached_tokens_is_what_the_connector_loaded(run):
    [load] = [spec for step in run.worker_steps() for spec in step[0]["loads"]]
    # Prefix caching off: RequestOutput.num_cached_tokens counts exactly the connector's tokens.
    assert run.cold[1] == 0
    assert run.warm[1] == load["end"] - load["start"] == 2 * CHUNK_SIZE


def test_request_finished_comes_once_per_request_after_its_last_step(run):
    finished = run.of("scheduler", "request_finished")
    lookups = run.of("scheduler", "get_num_new_matched_tokens")
    assert sorted(r["req_id"] for r in finished) == sorted({r["req_id"] for r in lookups})
    for record in finished:
        assert record["block_ids"]  # the request's blocks, freed at once since flowkv returns False
        assert record["result"] == [False, None]


def test_the_scheduler_runs_one_step_at_a_time_so_lookups_find_the_worker_idle(run):
    [scheduler] = run.of("scheduler", "init")
    # The CPU platform turns async scheduling off.
    assert scheduler["async_scheduling"] is False
    busy = [(step[0]["t"], step[-1]["t"]) for step in run.worker_steps()]
    for lookup in run.of("scheduler", "get_num_new_matched_tokens"):
        assert not any(start < lookup["t"] < end for start, end in busy)
    # flowkv sets the policy under which vLLM recomputes a failed load instead of failing the request.
    assert scheduler["kv_load_failure_policy"] == "recompute"


def test_a_connector_without_supports_hma_turns_the_hybrid_manager_off(run):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = KVTransferConfig(kv_connector="FlowKVConnector", kv_connector_module_path="flowkv.integration.vllm",
                              kv_role="kv_both")
    # flowkv handles one KV-cache group (block_ids[0]): vLLM must not run the hybrid manager with it.
    assert KVConnectorFactory.supports_hma_config(config) is False
    [scheduler] = run.of("scheduler", "init")
    assert scheduler["disable_hybrid_kv_cache_manager"] is True
