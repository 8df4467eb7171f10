"""What vLLM (0.32, CPU) does with a load it waits for between steps: the facts flowkv's async loads rest on.

One engine for the module, with the recording connector (``vllm_probe``)
and ``async_loads = "always"``, so every hit (here from memory) is answered
``(n, True)``. The pipeline is ``local-cpu`` plus ``vllm_helpers:evict_chunk``
in retrieve, which removes chunk 3 between lookup and load for requests
tagged with it: a load that comes back short, as a corrupt file on disk does.

Requests, one after another: a prompt of 2,020 tokens twice (cold, then an
asynchronous load of 7 chunks), a tagged prompt twice (its load comes back
short after 3 chunks and is reported failed), and a prompt whose short load
the probe reports by its blocks only (``QUIET_FAILURES_TAG``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import (  # noqa: E402
    BLOCK_SIZE,
    CHUNK_SIZE,
    EVICT_TAG,
    generate,
    make_llm,
    pipeline_file,
    random_tokens,
    request,
    shutdown_llm,
    stats,
)
from vllm_probe import LOG_ENV, QUIET_FAILURES_TAG  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = 2020
HIT = PROMPT // CHUNK_SIZE * CHUNK_SIZE  # 7 chunks: 1,792 tokens
GOOD = 3 * CHUNK_SIZE  # chunks 0-2 load when chunk 3 goes


@dataclass
class Run:
    records: list[dict[str, Any]]
    # Per request, in the order sent: (generated tokens, num_cached_tokens).
    outputs: dict[str, tuple[list[int], int]]
    retrieved: dict[str, int]  # flowkv's retrieved_tokens during each warm request
    req_ids: dict[str, str]  # name -> vLLM request id

    def of(self, role: str, hook: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["role"] == role and r["hook"] == hook]

    def lookups(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.of("scheduler", "get_num_new_matched_tokens") if r["req_id"] == self.req_ids[name]]

    def allocs(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.of("scheduler", "update_state_after_alloc") if r["req_id"] == self.req_ids[name]]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    folder = tmp_path_factory.mktemp("async")
    log = folder / "probe.jsonl"
    path = pipeline_file(folder, name="async-evict-test", retrieve_before_get=["vllm_helpers:evict_chunk"])
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv(LOG_ENV, str(log))
    plan = {
        # name: (prompt seed, tags); each is sent twice, cold then warm
        "memory": (61, None),
        "short": (62, {EVICT_TAG: "3"}),
        "quiet": (63, {EVICT_TAG: "3", QUIET_FAILURES_TAG: "1"}),
    }
    outputs, retrieved = {}, {}
    try:
        llm = make_llm({"pipeline": str(path), "async_loads": "always"}, connector=("FlowKVProbe", "vllm_probe"))
        try:
            for name, (seed, tags) in plan.items():
                prompt = random_tokens(seed, PROMPT)
                [outputs[f"{name}-cold"]] = generate(llm, [request(prompt, max_tokens=4, tags=tags)])
                before = stats(llm).get("retrieved_tokens", 0)
                [outputs[name]] = generate(llm, [request(prompt, max_tokens=4, tags=tags)])
                retrieved[name] = stats(llm).get("retrieved_tokens", 0) - before
        finally:
            shutdown_llm(llm)
    finally:
        monkeypatch.undo()
    records = sorted((json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()), key=lambda r: r["t"])
    # Requests come one at a time: the n-th request id vLLM looked up is the n-th request sent.
    seen: list[str] = []
    for record in records:
        if record["hook"] == "get_num_new_matched_tokens" and record["req_id"] not in seen:
            seen.append(record["req_id"])
    names = [n for name in plan for n in (f"{name}-cold", name)]
    assert len(seen) == len(names)
    return Run(records=records, outputs=outputs, retrieved=retrieved, req_ids=dict(zip(names, seen)))


def test_an_async_answer_gets_blocks_but_the_request_waits_for_its_load(run):
    [lookup] = run.lookups("memory")
    assert lookup["result"] == [HIT // BLOCK_SIZE * BLOCK_SIZE, True]
    [alloc, *_] = run.allocs("memory")
    # Blocks for the loaded tokens, allocated at once...
    assert alloc["num_external_tokens"] == lookup["result"][0]
    [group] = alloc["block_ids"]["tuple"]
    assert len(group) * BLOCK_SIZE >= alloc["num_external_tokens"]
    # ...and the load goes to the workers in a step that does not schedule the request.
    req_id = run.req_ids["memory"]
    [step] = [m for m in run.of("scheduler", "build_connector_meta") if any(l["req_id"] == req_id for l in m["loads"])]
    assert [l["load_async"] for l in step["loads"]] == [True]
    assert req_id not in [r["req_id"] for r in step["new_reqs"]] and req_id not in step["num_scheduled_tokens"]


def test_a_request_reported_finished_is_scheduled_from_its_loaded_tokens(run):
    req_id = run.req_ids["memory"]
    [finished] = [r for r in run.of("worker", "get_transfer_results") if req_id in r["finished_recving"]]
    scheduled = [r for m in run.of("scheduler", "build_connector_meta") if m["t"] > finished["t"]
                 for r in m["new_reqs"] if r["req_id"] == req_id]
    assert scheduled[0]["num_computed_tokens"] == run.lookups("memory")[0]["result"][0]
    # vLLM tells the connector about the blocks it adds then, with no external tokens.
    assert [a["num_external_tokens"] for a in run.allocs("memory")][1:] == [0]
    # The load was a real one: outputs as without it, every hit token from flowkv.
    assert run.outputs["memory"][0] == run.outputs["memory-cold"][0]
    assert run.outputs["memory"][1] == HIT == run.retrieved["memory"]


def test_a_failed_receive_makes_vllm_look_the_request_up_again_and_count_that_answer(run):
    req_id = run.req_ids["short"]
    [failed] = [r for r in run.of("scheduler", "update_connector_output") if req_id in r["failed_recving"]]
    # Reported finished in the same step, with the blocks past the good prefix.
    assert req_id in failed["finished_recving"] and failed["invalid_block_ids"]
    lookups = run.lookups("short")
    assert [l["num_computed_tokens"] for l in lookups] == [0, 0]
    assert lookups[1]["t"] > failed["t"]
    # The second answer holds what is left (chunks 0-2), loaded synchronously this time.
    assert lookups[1]["result"] == [GOOD, False]
    # vLLM's cached-token count is the answer it acted on: what loaded.
    assert run.outputs["short"][1] == GOOD
    assert run.outputs["short"][0] == run.outputs["short-cold"][0]
    # Chunks 0-2 were copied twice (the short load, then the load that counted).
    assert run.retrieved["short"] == 2 * GOOD


def test_load_error_blocks_alone_make_vllm_recompute_and_the_connector_recount_the_cached_tokens(run):
    req_id = run.req_ids["quiet"]
    [quiet] = [r for r in run.of("worker", "get_transfer_results") if req_id in r["quieted"]]
    [output] = [r for r in run.of("scheduler", "update_connector_output") if r["t"] > quiet["t"]][:1]
    assert req_id in output["finished_recving"] and req_id not in output["failed_recving"]
    assert output["invalid_block_ids"]
    # vLLM keeps the good prefix and recomputes the rest, without asking again...
    assert len(run.lookups("quiet")) == 1
    assert run.retrieved["quiet"] == GOOD
    assert run.outputs["quiet"][0] == run.outputs["quiet-cold"][0]
    # ...and its own count stays every promised token (test_vllm_blend pins that): the connector
    # brings it down to what stayed when the failed blocks come back (recount_short_load).
    assert run.outputs["quiet"][1] == GOOD


def test_steps_that_schedule_nothing_reach_the_workers_marked_idle(run):
    """vLLM steps on while a request waits for its load: alone, the step that hands the load to the
    workers schedules no token. The scheduler connector marks exactly such steps idle (on them the
    worker waits a moment for a load to land instead of answering at once and spinning the machine)."""
    steps = run.of("scheduler", "build_connector_meta")
    assert any(s["idle"] for s in steps) and not all(s["idle"] for s in steps)
    assert all(s["idle"] == (s["total_num_scheduled_tokens"] == 0) for s in steps)
    req_id = run.req_ids["memory"]
    [step] = [m for m in steps if any(load["req_id"] == req_id for load in m["loads"])]
    assert step["idle"] and step["num_scheduled_tokens"] == {}
