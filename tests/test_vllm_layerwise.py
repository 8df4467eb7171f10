"""Layerwise flowkv inside a real vLLM: per-layer loads and saves, their traces.

One engine for the module, on a ``local-cpu``-like pipeline with
``[layerwise] enabled = true``: the connector starts each load in
``start_load_kv``, waits for layer i in ``wait_for_layer_load`` and queues
layer i's copy out in ``save_kv_layer``. Traces go to files in a temporary
folder. The retrieve list carries two test stages: ``evict_chunk`` (a chunk
gone between lookup and load, known before the forward pass) and
``drop_layer`` (one layer of one chunk never lands, known only after the
forward pass used it). Prefills are split at 1,024 tokens.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import (  # noqa: E402
    DROP_LAYER_TAG,
    EVICT_TAG,
    generate,
    make_llm,
    pipeline_file,
    random_tokens,
    request,
    shutdown_llm,
    stats,
)

from flowkv.otlp_json import load_spans  # noqa: E402
from flowkv.tracetools import summarize  # noqa: E402

pytestmark = pytest.mark.vllm

NUM_LAYERS = 2  # the tiny model's


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def llm(tmp_path_factory, traces):
    path = pipeline_file(
        tmp_path_factory.mktemp("pipelines"),
        name="local-cpu-layerwise-test",
        retrieve_before_get=["vllm_helpers:evict_chunk"],
        retrieve_before_scatter=["vllm_helpers:drop_layer"],
    )
    engine = make_llm(
        {
            "pipeline": str(path),
            "layerwise.enabled": True,
            "telemetry.exporter": "file",
            "telemetry.folder": str(traces),
        },
        max_num_batched_tokens=1024,
    )
    yield engine
    shutdown_llm(engine)


def counter(llm, name: str) -> int:
    return int(stats(llm).get(name, 0))


def read_trace(llm, traces):
    from flowkv.integration.vllm import flush_worker_traces

    flush_worker_traces(llm.llm_engine.vllm_config)
    spans = []
    for path in sorted(traces.glob("*.json")):
        spans.extend(load_spans(path))
    return spans


def test_layerwise_outputs_equal_no_cache_outputs_and_hits_are_served(llm):
    first = random_tokens(10, 2000)
    second = random_tokens(11, 2000)
    extended = first[:1100] + random_tokens(12, 200)

    # vLLM alone: a tag no stored KV carries, and nothing stored.
    alone = generate(llm, [request(p, tags={"suite": "alone"}, skip_save=True) for p in (first, second, extended)])
    assert [cached for _, cached in alone] == [0, 0, 0]

    cold = generate(llm, [request(first), request(second)])
    retrieved_before = counter(llm, "retrieved_tokens")
    # Three loads in one step, each waited for layer by layer; the third
    # request also computes and stores past its load in that step.
    warm = generate(llm, [request(first), request(second), request(extended)])

    assert [cached for _, cached in cold] == [0, 0]
    # 2,000 tokens hold 7 chunks of 256; 1,100 tokens of the first hold 4.
    assert [cached for _, cached in warm] == [1792, 1792, 1024]
    assert counter(llm, "retrieved_tokens") - retrieved_before == 1792 + 1792 + 1024
    assert [tokens for tokens, _ in cold] == [alone[0][0], alone[1][0]]
    assert [tokens for tokens, _ in warm] == [tokens for tokens, _ in alone]
    assert stats(llm)["tiers"]["memory"]["pinned_objects"] == 0

    # The extended request stored its 5th chunk while loading the first 4.
    [(again, again_cached)] = generate(llm, [request(extended)])
    assert again_cached == 1280
    assert again == alone[2][0]


def test_chunk_evicted_before_the_load_cuts_the_load_and_its_save(llm):
    # vLLM recomputes from chunk 3 in other prefill steps than the cold run
    # took; on some prompts that alone flips a near-tie in bf16 (seen with
    # layerwise off too), so this prompt is one without such a tie.
    prompt = random_tokens(400, 2040)
    tags = {EVICT_TAG: "3"}
    [(cold, _)] = generate(llm, [request(prompt, max_tokens=24, tags=tags)])
    before = stats(llm)
    [(short, _)] = generate(llm, [request(prompt, max_tokens=24, tags=tags)])
    after = stats(llm)

    assert after.get("retrieve_short", 0) - before.get("retrieve_short", 0) == 1
    # Chunks 0-2 landed in every layer; vLLM recomputed from chunk 3 on.
    assert after.get("retrieved_tokens", 0) - before.get("retrieved_tokens", 0) == 3 * 256
    assert short == cold

    # The recomputed chunk 3 was stored again: the next lookup finds all 7.
    [(third, _)] = generate(llm, [request(prompt, max_tokens=24, tags=tags)])
    assert stats(llm).get("lookup_hit_tokens", 0) - after.get("lookup_hit_tokens", 0) == 1792
    assert third == cold


def test_layer_missing_after_the_forward_began_shrinks_the_load_and_drops_the_save(llm):
    stored = random_tokens(30, 1100)
    prompt = stored[:1024] + random_tokens(31, 600)
    tags = {DROP_LAYER_TAG: f"{NUM_LAYERS - 1}:2"}
    [(alone, _)] = generate(llm, [request(prompt, tags={"suite": "drop-alone"}, skip_save=True)])
    generate(llm, [request(stored, tags=tags)])

    before = stats(llm)
    # One step loads chunks 0-3 and computes (and saves) tokens 1,024-1,623;
    # chunk 2 never gets its last layer, which the connector learns only
    # after the forward pass read it.
    [(out, _)] = generate(llm, [request(prompt, tags=tags)])
    after = stats(llm)

    assert out == alone
    assert after.get("retrieve_short", 0) - before.get("retrieve_short", 0) == 1
    # Only chunks 0-1 count; the step's store was dropped, and once vLLM
    # recomputed from chunk 2 on, flowkv stored chunks 4 and 5.
    assert after.get("retrieved_tokens", 0) - before.get("retrieved_tokens", 0) == 2 * 256
    assert after["tiers"]["memory"]["entries"] - before["tiers"]["memory"]["entries"] == 2
    [(again, _)] = generate(llm, [request(prompt, tags=tags)])
    assert stats(llm).get("lookup_hit_tokens", 0) - after.get("lookup_hit_tokens", 0) == 1536
    assert again == alone


def test_trace_has_per_layer_spans_and_waits_nested_per_request_and_step(llm, traces):
    prompts = [random_tokens(40, 1500), random_tokens(41, 1500)]
    generate(llm, [request(p, max_tokens=2) for p in prompts])
    generate(llm, [request(p, max_tokens=2) for p in prompts])
    spans = read_trace(llm, traces)
    by_id = {span.span_id: span for span in spans}
    children = defaultdict(list)
    for span in spans:
        children[span.parent_span_id].append(span)

    def parent(span):
        return by_id.get(span.parent_span_id or "")

    def stages(run, stage):
        return [s for s in spans if s.attributes.get("flowkv.stage") == stage and _ancestor(s, run, parent)]

    layerwise = [s for s in spans if s.name in ("flowkv.retrieve.layerwise", "flowkv.store.layerwise")]
    retrieves = [s for s in layerwise if s.name == "flowkv.retrieve.layerwise"]
    stores = [s for s in layerwise if s.name == "flowkv.store.layerwise"]
    assert retrieves and stores
    for run in layerwise:
        request_span = parent(run)
        assert request_span is not None and request_span.name == "flowkv.request"
        assert request_span.attributes["flowkv.request_id"] == run.attributes["flowkv.request_id"]
        step = parent(request_span)
        assert step is not None and step.name == "flowkv.step" and step.parent_span_id is None
        # One request span per request per step.
        siblings = [s for s in children[step.span_id]
                    if s.attributes.get("flowkv.request_id") == request_span.attributes["flowkv.request_id"]]
        assert siblings == [request_span]

    for run in retrieves:
        request_id = run.attributes["flowkv.request_id"]
        waits = [s for s in children[run.span_id] if s.name == "flowkv.wait"]
        assert sorted(s.attributes["flowkv.layer"] for s in waits) == list(range(NUM_LAYERS))
        scatters = stages(run, "scatter")
        assert sorted(s.attributes["flowkv.layer"] for s in scatters) == list(range(NUM_LAYERS))
        for scatter in scatters:
            assert scatter.attributes["flowkv.request_id"] == request_id
            assert scatter.attributes["flowkv.kind"] == "retrieve"
            assert scatter.attributes["flowkv.bytes"] > 0
    for run in stores:
        gathers = stages(run, "gather")
        # Every layer is gathered, unless allocate passed no chunk on (flowkv
        # held them all): then the store runs no per-layer block at all.
        allocated = sum(s.attributes["flowkv.items_out"] for s in stages(run, "allocate"))
        layers = list(range(NUM_LAYERS)) if allocated else []
        assert sorted(s.attributes["flowkv.layer"] for s in gathers) == layers
        # A store whose chunks flowkv already held gathers nothing.
        assert all(s.attributes["flowkv.bytes"] > 0 for s in gathers if s.attributes["flowkv.items_out"])
    assert any(s.attributes.get("flowkv.items_out") for run in stores for s in stages(run, "gather"))

    # The warm pair's loads: 5 chunks of 256 each, in every layer.
    warm_loads = [
        parent(run) for run in retrieves
        if parent(run).attributes.get("flowkv.load.end") == 1280
    ]
    assert len(warm_loads) >= 2
    assert all(span.attributes["flowkv.hit_tokens"] == 1280 for span in warm_loads)

    summary = summarize(spans)
    assert summary.overlap_ratio is not None
    assert 0.0 <= summary.overlap_ratio <= 1.0
    assert [layer.layer for layer in summary.layers] == list(range(NUM_LAYERS))
    assert all(layer.transfer_ns > 0 and layer.wait_ns > 0 for layer in summary.layers)


def _ancestor(span, candidate, parent) -> bool:
    current = parent(span)
    while current is not None:
        if current.span_id == candidate.span_id:
            return True
        current = parent(current)
    return False
