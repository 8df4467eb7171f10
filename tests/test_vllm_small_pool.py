"""flowkv inside a real vLLM whose own KV pool is small: preemption, aborts, short loads.

One engine for the module: vLLM's pool holds 40 blocks of 128 tokens, so two
requests of 2,100 tokens that decode a few hundred tokens each do not fit and
vLLM preempts one (frees its blocks and recomputes it later). The pipeline is
``local-cpu`` plus two test stages in retrieve: ``vllm_helpers:evict_chunk``,
that removes one chunk from the memory tier between lookup and get for
requests tagged with it (a chunk evicted between vLLM's lookup and its load),
and ``vllm_helpers:wrong_kv``, the canary that hands vLLM wrong KV for tagged
requests (every "outputs equal after a hit" test rests on it changing them).
"""

from __future__ import annotations

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import (  # noqa: E402
    EVICT_TAG,
    WRONG_KV_TAG,
    generate,
    make_llm,
    pipeline_file,
    random_tokens,
    request,
    shutdown_llm,
    stats,
)

pytestmark = pytest.mark.vllm

POOL_BLOCKS = 40


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipelines")
    path = pipeline_file(
        folder,
        name="local-cpu-evict-test",
        retrieve_before_get=["vllm_helpers:evict_chunk"],
        retrieve_before_scatter=["vllm_helpers:wrong_kv"],
    )
    # Pins outlast any wait here: the scheduler gives a waiting request's answer again only within
    # half the pin timeout, and on a loaded machine a 300-token decode outlasts the default's 15 s.
    engine = make_llm({"pipeline": str(path), "pin_timeout_s": 600}, kv_cache_blocks=POOL_BLOCKS,
                      max_num_batched_tokens=1024)
    yield engine
    shutdown_llm(engine)


def counter(llm, name: str) -> int:
    return int(stats(llm).get(name, 0))


@pytest.mark.parametrize("wrong", ["shift", "stale"])
def test_wrong_kv_loaded_changes_the_tiny_models_greedy_tokens(llm, wrong):
    """The canary: the right KV reproduces the cold tokens, and KV of the wrong blocks (shifted by one
    block, or another chunk's) does not, on the model every equality test runs. Without it an
    "identical outputs" test could pass with any load at all. (The tag is part of the key, so the
    tagged prompt is stored cold under it and its hit is the one handed wrong KV.)"""
    prompt = random_tokens(400 + len(wrong), 4 * 256 + 20)
    plain = {"suite": f"canary-{wrong}"}
    canary = {**plain, WRONG_KV_TAG: wrong}
    [(cold, cold_cached), (tagged_cold, tagged_cold_cached)] = [
        generate(llm, [request(prompt, max_tokens=16, tags=tags)])[0] for tags in (plain, canary)]
    [(right, right_cached)] = generate(llm, [request(prompt, max_tokens=16, tags=plain)])
    [(bad, bad_cached)] = generate(llm, [request(prompt, max_tokens=16, tags=canary)])

    assert cold_cached == tagged_cold_cached == 0 and tagged_cold == cold
    assert right_cached == bad_cached == 4 * 256
    assert right == cold
    assert bad != cold, f"KV loaded {wrong} gave the cold greedy tokens: equal outputs prove nothing"


def test_preempted_request_reloads_its_prompt_from_flowkv(llm):
    prompts = [random_tokens(200, 2100), random_tokens(201, 2100)]

    def run(tags, skip_save):
        before = counter(llm, "retrieved_tokens")
        results = generate(llm, [request(p, max_tokens=400, tags=tags, skip_save=skip_save) for p in prompts])
        return [tokens for tokens, _ in results], counter(llm, "retrieved_tokens") - before

    # Same schedule twice: once with flowkv storing the prompts, once with
    # flowkv out of the way, so the preempted request is recomputed by vLLM.
    with_flowkv, retrieved = run({"suite": "preempt-a"}, skip_save=False)
    recomputed, retrieved_without = run({"suite": "preempt-b"}, skip_save=True)

    # Both prompts were new, so flowkv could only serve them back to a
    # request that vLLM preempted and resumed: 8 stored chunks of 256.
    assert retrieved >= 2048
    assert retrieved_without == 0
    assert with_flowkv == recomputed


def test_aborted_waiting_request_leaves_no_pin(llm):
    engine = llm.llm_engine
    shared = random_tokens(300, 2000)
    generate(llm, [request(shared + [7], max_tokens=1)])

    # A long request takes most of vLLM's pool, so the next one is looked up
    # (its chunks pinned) but cannot get blocks and keeps waiting.
    hog_prompt, hog_params = request(random_tokens(301, 3200), max_tokens=800)
    engine.add_request("hog", hog_prompt, hog_params)
    while engine.has_unfinished_requests():
        if any(out.outputs and out.outputs[0].token_ids for out in engine.step()):
            break
    waiting_prompt, waiting_params = request(shared + [9, 10], max_tokens=4)
    engine.add_request("waiting", waiting_prompt, waiting_params)

    pinned_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        pinned_seen = stats(llm)["tiers"]["memory"]["pinned_objects"]
        if pinned_seen:
            break
    assert pinned_seen == 7, "the waiting request's lookup should pin its 7 chunks"

    engine.abort_request(["waiting", "hog"])
    while engine.has_unfinished_requests():
        engine.step()
    # vLLM's engine core takes the abort after the front end forgot the
    # requests. A request after it is looked up over the same socket that
    # carried the abort's release, so once it is done the release is too.
    generate(llm, [request(random_tokens(302, 600), max_tokens=1)])
    assert stats(llm)["tiers"]["memory"]["pinned_objects"] == 0


def test_chunk_evicted_between_lookup_and_load_gives_identical_output(llm):
    prompt = random_tokens(400, 2040)
    tags = {EVICT_TAG: "3"}
    [(cold, cold_cached)] = generate(llm, [request(prompt, max_tokens=24, tags=tags)])
    before = stats(llm)
    [(short, _)] = generate(llm, [request(prompt, max_tokens=24, tags=tags)])
    after = stats(llm)

    assert cold_cached == 0
    assert after.get("retrieve_short", 0) - before.get("retrieve_short", 0) == 1
    # Chunks 0-2 loaded; vLLM recomputed from chunk 3 on and got the same tokens.
    assert after.get("retrieved_tokens", 0) - before.get("retrieved_tokens", 0) == 3 * 256
    assert short == cold

    # vLLM recomputed chunk 3 and flowkv stored it again: the next lookup
    # finds all 7 chunks (then the stage evicts chunk 3 once more).
    [(third, _)] = generate(llm, [request(prompt, max_tokens=24, tags=tags)])
    assert stats(llm).get("lookup_hit_tokens", 0) - after.get("lookup_hit_tokens", 0) == 1792
    assert third == cold


def test_a_request_waiting_for_blocks_is_looked_up_once_however_long_it_waits(llm):
    engine = llm.llm_engine
    shared = random_tokens(310, 2000)
    generate(llm, [request(shared + [7], max_tokens=1)])

    # A long request holds most of vLLM's pool: the next one is looked up
    # and then waits for blocks, step after step, until the long one is done.
    hog_prompt, hog_params = request(random_tokens(311, 3200), max_tokens=300)
    engine.add_request("hog-2", hog_prompt, hog_params)
    while engine.has_unfinished_requests():
        if any(out.request_id == "hog-2" and out.outputs[0].token_ids for out in engine.step()):
            break
    before = stats(llm)
    waiting_prompt, waiting_params = request(shared + [11, 12], max_tokens=4)
    engine.add_request("waits-long", waiting_prompt, waiting_params)
    steps_waited = 0
    while not any(out.request_id == "waits-long" and out.outputs[0].token_ids for out in engine.step()):
        steps_waited += 1
    while engine.has_unfinished_requests():
        engine.step()
    after = stats(llm)

    def grew(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    # vLLM asked flowkv at every one of those steps; flowkv's workers were asked once.
    assert steps_waited >= 50
    assert (grew("lookups"), grew("lookup_repeats")) == (1, 0)
    assert grew("lookup_requested_tokens") == 2002 // 256 * 256
    assert grew("retrieved_tokens") == 1792
