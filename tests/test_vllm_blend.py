"""CacheBlend through a real vLLM: documents reused in another order, a share of their tokens recomputed.

Two engines for the module, one after the other, both fp32 (greedy tokens do
not flip on rounding): an unconnected vLLM with vLLM's stock model classes
(``VLLM_PLUGINS`` without flowkv's ``flowkv-models``, in processes of its own,
vLLM's default layout) gives the reference tokens and logprobs of every prompt;
then one vLLM with the ``blend`` pipeline (flowkv's recorded model classes), in
the test's process (a start of seconds, not tens of seconds; ``vllm serve``
runs the blend in its engine core in tests/test_vllm_serve_blend.py), serves
them all (and one more, spawned, with two check layers). A request picks
its own ``recompute_ratio`` through ``kv_transfer_params``
(``flowkv.blend.recompute_ratio``), so one engine serves every ratio.

Prompts: ``[S][D1][D2][D3][Q1]`` stores the system prompt and the documents
(each closed by the separator), then ``[S][D3][D1][D2][Q2]`` and
``[S][D2][Q3]`` find them at other positions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from vllm_helpers import (
    BLOCK_SIZE,
    EVICT_TAG,
    KV_BYTES_PER_TOKEN,
    LOOKUP_TIMEOUT_MS,
    engine_processes,
    random_tokens,
    shutdown_llm,
    tiny_model_dir,
)

pytestmark = pytest.mark.vllm

# The tiny model's ids 1 and 2 (end of text, padding) never occur in random_tokens: a separator
# that no document holds.
SEPARATOR = [1, 2]
SYSTEM = random_tokens(240, 98) + SEPARATOR
DOCS = [random_tokens(241 + i, 298) + SEPARATOR for i in range(3)]
QUESTIONS = [random_tokens(250 + i, 40) for i in range(4)]
FIRST = SYSTEM + DOCS[0] + DOCS[1] + DOCS[2] + QUESTIONS[0]
REORDERED = SYSTEM + DOCS[2] + DOCS[0] + DOCS[1] + QUESTIONS[1]
ONE_DOC = SYSTEM + DOCS[1] + QUESTIONS[2]
# A document no request stored sits between two that are: the blend ends where it begins.
NEW_DOC = random_tokens(245, 298) + SEPARATOR
WITH_NEW = SYSTEM + DOCS[1] + NEW_DOC + DOCS[0] + QUESTIONS[3]
MAX_TOKENS = 8
# fp32: a chosen token's logprob moves by float rounding only; ties closer than this may flip.
TIE = 1e-3


# The blend pipeline, plus a stage that removes one chunk between lookup and load for requests
# tagged test_evict_chunk (vllm_helpers.evict_chunk) and one that flips a byte of a chunk's payload
# between get and decompress for requests tagged test_corrupt_chunk (blend_faults.corrupt_chunk);
# untagged requests pass untouched.
EVICTING_BLEND = """
extends = "blend"

[pipeline]
name = "blend-evict-test"

[retrieve]
replace = ["lookup", "get"]

[[retrieve.stages]]
use = "lookup"

[[retrieve.stages]]
use = "vllm_helpers:evict_chunk"

[[retrieve.stages]]
use = "get"
promote = true

[[retrieve.stages]]
use = "blend_faults:corrupt_chunk"

[telemetry]
exporter = "file"
folder = "{traces}"
"""


def start(pipeline: str | None = None, check_layers: tuple[int, ...] = (0,), *, separate: bool = True):
    """An fp32 engine: with flowkv and ``pipeline`` (a blend pipeline file), or unconnected; in vLLM's
    own processes (spawned: they load the plugins ``VLLM_PLUGINS`` names) or, not ``separate``, in
    this one (one such engine at a time)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if pipeline is not None:
        transfer = KVTransferConfig(
            kv_connector="FlowKVConnector", kv_connector_module_path="flowkv.integration.vllm", kv_role="kv_both",
            # Check layer 0: with the default (1), the last of the tiny model's two layers, every reused
            # token would be recomputed at every layer at any ratio above 0.
            kv_connector_extra_config={"pipeline": pipeline, "blend.separator": SEPARATOR, "blend.check_layers": list(check_layers),
                                       "lookup_timeout_ms": LOOKUP_TIMEOUT_MS})
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    try:
        # fp32 KV is twice the bf16 bytes the helpers' constant counts.
        with engine_processes(separate=separate):
            return LLM(model=str(tiny_model_dir()), dtype="float32", block_size=BLOCK_SIZE, max_model_len=4096,
                       seed=0, enable_prefix_caching=False, enforce_eager=True,
                       kv_cache_memory_bytes=256 * BLOCK_SIZE * 2 * KV_BYTES_PER_TOKEN, kv_transfer_config=transfer)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def run(llm, prompt: list[int], ratio: float | None = None, tags: dict[str, str] | None = None):
    """Greedy decoding of one prompt: (tokens, num_cached_tokens, top-5 logprobs per position)."""
    [result] = run_batch(llm, [prompt], ratio, tags)
    return result


def run_batch(llm, prompts: list[list[int]], ratio: float | None = None, tags: dict[str, str] | None = None):
    """``run`` of several prompts in one batch."""
    from vllm import SamplingParams

    transfer_params = {f"flowkv.tag.{name}": value for name, value in (tags or {}).items()}
    if ratio is not None:
        transfer_params["flowkv.blend.recompute_ratio"] = ratio
    extra = {"kv_transfer_params": transfer_params} if transfer_params else None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5, extra_args=extra)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    return [(list(out.outputs[0].token_ids), out.num_cached_tokens,
             [{token: lp.logprob for token, lp in position.items()} for position in out.outputs[0].logprobs])
            for out in outputs]


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], tuple]:
    """The unconnected, stock-class vLLM's greedy decoding of every prompt of the module."""
    from vllm.plugins import load_general_plugins

    # This process loads every plugin first (vLLM loads them once per process): the blend engines it
    # runs itself get flowkv's model classes, only the reference's spawned processes go without them.
    load_general_plugins()
    saved = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = "flowkv-logging"  # vLLM's own model classes in its processes
    try:
        llm = start()
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS")
        else:
            os.environ["VLLM_PLUGINS"] = saved
    try:
        return {tuple(prompt): run(llm, prompt) for prompt in (FIRST, REORDERED, ONE_DOC, WITH_NEW)}
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def blend_llm(reference, tmp_path_factory) -> Iterator:
    path = tmp_path_factory.mktemp("blend") / "blend-evict-test.toml"
    traces.append(tmp_path_factory.mktemp("traces"))
    path.write_text(EVICTING_BLEND.format(traces=traces[0]), encoding="utf-8")
    llm = start(str(path), separate=False)
    try:
        # Every test reuses these documents: stored here, whatever order the tests run in.
        cold_runs.append(run(llm, FIRST))
        yield llm
    finally:
        shutdown_llm(llm)


# The fixture's cold run of FIRST (it stored the documents), and the engine's trace folder.
cold_runs: list[tuple] = []
traces: list = []


def blend_counts(llm) -> tuple[int, int]:
    """The worker's blend counters (what vllm:flowkv_blend_*_tokens_total export)."""
    numbers = counters(llm)
    return numbers["blend_reused_tokens"], numbers["blend_recomputed_tokens"]


def counters(llm) -> dict[str, int]:
    from flowkv.integration.vllm.query import worker_stats

    numbers = worker_stats(llm.llm_engine.vllm_config)
    return {name: int(numbers.get(name, 0))
            for name in ("blend_reused_tokens", "blend_recomputed_tokens", "stores", "retrieve_short",
                         "stored_tokens", "corrupt_payloads", "blend_staging_tokens")}


def assert_same_greedy_up_to_ties(got, want, what: str) -> None:
    got_tokens, _, got_lps = got
    want_tokens, _, want_lps = want
    for position, (g, w) in enumerate(zip(got_tokens, want_tokens)):
        assert g in want_lps[position], f"{what}: token {position} ({g}) is not in the reference's top 5"
        if g != w:
            assert want_lps[position][w] - want_lps[position][g] <= TIE, (
                f"{what}: token {position} is {g}, the reference's {w}, and that was no tie")
            return


def first_token_gap(got, want) -> float:
    """Mean |Δlogprob| over the reference's top-5 first tokens that both runs list."""
    got_lps, want_lps = got[2][0], want[2][0]
    shared = [token for token in want_lps if token in got_lps]
    return sum(abs(got_lps[t] - want_lps[t]) for t in shared) / max(1, len(shared))


def test_a_cold_prompt_through_flowkvs_model_classes_equals_vllms_stock_classes(blend_llm, reference) -> None:
    [cold] = cold_runs
    assert cold[1] == 0
    want = reference[tuple(FIRST)]
    assert cold[0] == want[0]
    for got_lps, want_lps in zip(cold[2], want[2]):
        assert got_lps.keys() == want_lps.keys()
        assert all(abs(got_lps[t] - want_lps[t]) <= 1e-4 for t in want_lps)


def test_reordered_documents_are_reused_and_ratio_1_reproduces_a_full_prefill(blend_llm, reference) -> None:
    reused_before, recomputed_before = blend_counts(blend_llm)
    before = counters(blend_llm)
    warm = run(blend_llm, REORDERED, ratio=1.0)
    # The request's save runs after a blend too and stores nothing: the blended documents (approximate
    # KV) are kept as they were stored, and the question is closed by no separator.
    after = counters(blend_llm)
    assert (after["stores"] - before["stores"], after["stored_tokens"] - before["stored_tokens"]) == (1, 0)
    documents = len(REORDERED) - len(QUESTIONS[1])
    # Every segment is found; vLLM takes whole blocks and computes the last token itself.
    loaded = (documents // BLOCK_SIZE) * BLOCK_SIZE
    assert warm[1] == loaded >= 0.8 * documents
    reused, recomputed = blend_counts(blend_llm)
    assert reused - reused_before == loaded
    # All but the system prompt, which sits where it was stored (exact), is recomputed.
    assert recomputed - recomputed_before == loaded - len(SYSTEM)
    assert_same_greedy_up_to_ties(warm, reference[tuple(REORDERED)], "ratio 1.0")
    assert first_token_gap(warm, reference[tuple(REORDERED)]) <= 1e-3
    # The staging cache the engine loads and stores through is as large as the largest window so
    # far (FIRST's save: its blocks), not max_model_len (4,096) for every layer.
    assert -(-len(FIRST) // BLOCK_SIZE) * BLOCK_SIZE <= after["blend_staging_tokens"] < 4096


def test_the_default_ratio_recomputes_its_share_and_0_recomputes_nothing(blend_llm, reference) -> None:
    want = reference[tuple(ONE_DOC)]
    reused_before, recomputed_before = blend_counts(blend_llm)
    default = run(blend_llm, ONE_DOC)
    documents = len(ONE_DOC) - len(QUESTIONS[2])
    loaded = (documents // BLOCK_SIZE) * BLOCK_SIZE
    assert default[1] == loaded >= 0.8 * documents
    reused, recomputed = blend_counts(blend_llm)
    assert reused - reused_before == loaded
    # [blend] recompute_ratio = 0.15 of the reused tokens past the exact system prompt.
    share = -(-15 * (loaded - len(SYSTEM)) // 100)
    assert recomputed - recomputed_before == share
    plain = run(blend_llm, ONE_DOC, ratio=0.0)
    assert plain[1] == loaded
    reused_after, recomputed_after = blend_counts(blend_llm)
    assert (reused_after - reused, recomputed_after - recomputed) == (loaded, 0)
    full = run(blend_llm, ONE_DOC, ratio=1.0)
    gaps = {ratio: first_token_gap(result, want) for ratio, result in ((0.0, plain), (0.15, default), (1.0, full))}
    print(f"\nblend first-token mean |Δlogprob| against a full prefill, by recompute_ratio: {gaps}")
    # 1.0 is a full prefill; the default lies between it and plain concatenation.
    assert gaps[1.0] <= 1e-3 and gaps[1.0] < gaps[0.15] <= gaps[0.0]
    assert_same_greedy_up_to_ties(full, want, "ratio 1.0, one document")


def test_a_document_evicted_between_lookup_and_load_ends_the_blend_at_the_block_before_it(blend_llm, reference) -> None:
    # Keys carry the request's tags: the documents are stored under the eviction tag first.
    tags = {EVICT_TAG: "3"}  # chunk 3 of the reordered prompt: the first piece of D1
    assert run(blend_llm, FIRST, tags=tags)[1] == 0
    before = counters(blend_llm)
    evicted = run(blend_llm, REORDERED, ratio=1.0, tags=tags)
    after = counters(blend_llm)
    # S and D3 came (the load is short at D1): only their whole blocks are blended, vLLM computes
    # from the block holding D1's start, and num_cached_tokens counts what stayed (vLLM's own count is
    # what it accepted; the connector recounts it, see the test below).
    kept = (len(SYSTEM) + len(DOCS[2])) // BLOCK_SIZE * BLOCK_SIZE
    assert evicted[1] == kept
    assert after["retrieve_short"] - before["retrieve_short"] == 1
    assert (after["blend_reused_tokens"] - before["blend_reused_tokens"],
            after["blend_recomputed_tokens"] - before["blend_recomputed_tokens"]) == (kept, kept - len(SYSTEM))
    assert_same_greedy_up_to_ties(evicted, reference[tuple(REORDERED)], "ratio 1.0, D1 evicted")
    # The evicted piece (D1's first 256 tokens), recomputed by vLLM, was stored again.
    assert after["stored_tokens"] - before["stored_tokens"] == 256


TRACED_BLEND = """
extends = "blend"

[pipeline]
name = "blend-checks-test"

[telemetry]
exporter = "file"
folder = "{traces}"
"""


def test_several_check_layers_narrow_the_tokens_that_go_on_gradually(tmp_path) -> None:
    """``check_layers = [0, 1]`` at ratio 0.25: layer 0 keeps the half of the reused tokens whose K/V
    deviate most (0.25 ** (1/2)), layer 1 a quarter of them (the ratio), and the recomputed counter
    counts the last selection."""
    from flowkv.integration.vllm import flush_worker_traces
    from flowkv.otlp_json import load_spans

    folder = tmp_path / "traces"
    folder.mkdir()
    path = tmp_path / "blend-checks-test.toml"
    path.write_text(TRACED_BLEND.format(traces=folder), encoding="utf-8")
    llm = start(str(path), check_layers=(0, 1))  # in processes of its own: the module's engine may be in this one
    try:
        run(llm, FIRST)  # stores the system prompt and the three documents
        before = blend_counts(llm)
        run(llm, REORDERED, ratio=0.25)
        reused, recomputed = (after - was for after, was in zip(blend_counts(llm), before))
        flush_worker_traces(llm.llm_engine.vllm_config)
    finally:
        shutdown_llm(llm)
    spans = [span for file in sorted(folder.glob("*.json")) for span in load_spans(file)]
    selects = [span for span in spans if span.name == "flowkv.blend.select"]
    checks = sorted((span for span in spans if span.name == "flowkv.blend.check"),
                    key=lambda span: span.attributes["flowkv.layer"])
    assert [span.attributes["flowkv.layer"] for span in checks] == [0, 1]
    moved = reused - len(SYSTEM)  # the system prompt sits where it was stored: only the documents moved
    assert moved > 0 and [span.attributes["flowkv.tokens"] for span in checks] == [moved, -(-moved // 2)]
    assert sorted(span.attributes["flowkv.selected_tokens"] for span in selects) == [-(-moved // 4), -(-moved // 2)]
    assert recomputed == -(-moved // 4)


def test_every_blend_step_has_its_span_under_the_requests_span(blend_llm) -> None:
    from flowkv.integration.vllm import flush_worker_traces
    from flowkv.otlp_json import load_spans

    run(blend_llm, ONE_DOC, ratio=0.5)  # the only request of the module at this ratio
    flush_worker_traces(blend_llm.llm_engine.vllm_config)
    spans = [span for path in sorted(traces[0].glob("*.json")) for span in load_spans(path)]
    [select] = [span for span in spans
                if span.name == "flowkv.blend.select" and span.attributes.get("flowkv.recompute_ratio") == 0.5]
    request_spans = [span for span in spans if span.span_id == select.parent_span_id]
    assert [span.name for span in request_spans] == ["flowkv.request"]
    steps = sorted((span.name, span.attributes.get("flowkv.layer", -1)) for span in spans
                   if span.parent_span_id == select.parent_span_id and span.name.startswith("flowkv.blend."))
    # Two layers: every reused token recomputed at the check layer (0), which selects the tokens that
    # go on through layer 1; each layer's fused KV written into vLLM's blocks once recomputed,
    # attention (over those blocks) for the layers after which tokens go on (the last layer's output
    # is not needed), and a last write for the layers no recompute reached (none here).
    assert steps == [("flowkv.blend.attend", 0), ("flowkv.blend.check", 0), ("flowkv.blend.recompute", 0),
                     ("flowkv.blend.recompute", 1), ("flowkv.blend.rerotate", -1), ("flowkv.blend.select", -1),
                     ("flowkv.blend.stage", -1), ("flowkv.blend.write", -1), ("flowkv.blend.write", 0),
                     ("flowkv.blend.write", 1)]
    loaded = (len(ONE_DOC) - len(QUESTIONS[2])) // BLOCK_SIZE * BLOCK_SIZE
    assert select.attributes["flowkv.selected_tokens"] == -(-(loaded - len(SYSTEM)) // 2)
    mine = [span for span in spans if span.parent_span_id == select.parent_span_id]
    took = {name: round(sum(span.end_ns - span.start_ns for span in mine
                            if span.name == f"flowkv.blend.{name}") / 1e6, 2)
            for name in ("rerotate", "recompute", "attend", "check", "select", "write", "stage")}
    print(f"\nblend of {loaded} tokens at ratio 0.5, ms per step: {took}")


def test_two_blends_in_one_batch_each_reproduce_their_full_prefill(blend_llm, reference) -> None:
    """Loads of one step blend one after the other through the one staging cache."""
    before = counters(blend_llm)
    results = run_batch(blend_llm, [REORDERED, ONE_DOC], ratio=1.0)
    loaded = [(len(prompt) - len(question)) // BLOCK_SIZE * BLOCK_SIZE
              for prompt, question in ((REORDERED, QUESTIONS[1]), (ONE_DOC, QUESTIONS[2]))]
    assert [cached for _, cached, _ in results] == loaded
    assert counters(blend_llm)["blend_reused_tokens"] - before["blend_reused_tokens"] == sum(loaded)
    for prompt, result in zip((REORDERED, ONE_DOC), results):
        assert_same_greedy_up_to_ties(result, reference[tuple(prompt)], f"batched, {len(prompt)} tokens")


def test_a_corrupt_document_payload_is_never_loaded_and_the_blend_ends_at_the_block_before_it(
        blend_llm, reference) -> None:
    from blend_faults import CORRUPT_TAG

    tags = {CORRUPT_TAG: "3"}  # chunk 3 of the reordered prompt: the first piece of D1
    assert run(blend_llm, FIRST, tags=tags)[1] == 0  # the documents, stored under this tag
    before = counters(blend_llm)
    corrupted = run(blend_llm, REORDERED, ratio=1.0, tags=tags)
    after = counters(blend_llm)
    # decompress refused the payload (checksum), counted it and dropped it from the tier: the load is
    # short at D1, so only S and D3's whole blocks are blended and vLLM computes from the block holding
    # D1's start (num_cached_tokens counts what stayed).
    kept = (len(SYSTEM) + len(DOCS[2])) // BLOCK_SIZE * BLOCK_SIZE
    assert corrupted[1] == kept
    assert (after["corrupt_payloads"] - before["corrupt_payloads"],
            after["retrieve_short"] - before["retrieve_short"]) == (1, 1)
    assert (after["blend_reused_tokens"] - before["blend_reused_tokens"],
            after["blend_recomputed_tokens"] - before["blend_recomputed_tokens"]) == (kept, kept - len(SYSTEM))
    assert_same_greedy_up_to_ties(corrupted, reference[tuple(REORDERED)], "ratio 1.0, D1 corrupt")
    # The dropped piece (D1's first 256 tokens), computed by vLLM, was stored again.
    assert after["stored_tokens"] - before["stored_tokens"] == 256


def test_a_document_never_stored_ends_the_blend_and_is_stored_for_the_next_request(blend_llm, reference) -> None:
    before = counters(blend_llm)
    first = run(blend_llm, WITH_NEW, ratio=1.0)
    after = counters(blend_llm)
    # S and D2 are found; NEW_DOC is not, so D1 after it is not loaded either (vLLM computes from the
    # block holding NEW_DOC's start).
    kept = (len(SYSTEM) + len(DOCS[1])) // BLOCK_SIZE * BLOCK_SIZE
    assert first[1] == kept
    assert (after["blend_reused_tokens"] - before["blend_reused_tokens"],
            after["blend_recomputed_tokens"] - before["blend_recomputed_tokens"]) == (kept, kept - len(SYSTEM))
    assert_same_greedy_up_to_ties(first, reference[tuple(WITH_NEW)], "ratio 1.0, a document missing")
    # The request stored NEW_DOC (a closed document vLLM computed); asked again, every document is found.
    assert after["stored_tokens"] - before["stored_tokens"] >= len(NEW_DOC) - BLOCK_SIZE
    again = run(blend_llm, WITH_NEW, ratio=1.0)
    documents = len(WITH_NEW) - len(QUESTIONS[3])
    assert again[1] == documents // BLOCK_SIZE * BLOCK_SIZE > kept
    assert_same_greedy_up_to_ties(again, reference[tuple(WITH_NEW)], "ratio 1.0, every document found")


def test_vllm_keeps_the_count_it_accepted_after_a_failed_load_and_the_connector_recounts_it() -> None:
    """vLLM's facts behind ``num_cached_tokens`` after a short synchronous load: the scheduler sets a
    request's prefill stats when it accepts the connector's count, and its handling of the blocks
    that failed to load truncates the computed tokens but leaves those stats; the connector's
    ``recount_short_load`` (called from ``update_connector_output``) brings them down to what stayed."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from flowkv.integration.vllm.scheduler import recount_short_load

    request = Request("r", list(range(1000)), SamplingParams(max_tokens=1), None)
    request.prefill_stats.set(num_prompt_tokens=1000, num_local_cached_tokens=0, num_external_cached_tokens=896)
    request.num_computed_tokens = 1000  # after the step: 896 loaded, 104 computed
    blocks = [10, 11, 12, 13, 14, 15, 16, 17]
    scheduler = SimpleNamespace(block_size=128, kv_cache_manager=SimpleNamespace(get_block_ids=lambda _: (blocks,)))
    affected, _, _ = Scheduler._update_requests_with_invalid_blocks(scheduler, [request], {13}, {"r": 104})
    assert affected == {"r"} and request.num_computed_tokens == 3 * 128  # recomputed from the failed block
    assert request.prefill_stats.num_cached_tokens == 896  # vLLM's count: what it accepted
    recount_short_load(request, blocks, {13}, 128)
    assert (request.prefill_stats.num_cached_tokens, request.prefill_stats.num_computed_tokens) == (384, 616)
    recount_short_load(request, blocks, {99}, 128)  # a block not of this request: nothing changes
    assert request.prefill_stats.num_cached_tokens == 384
