"""CacheBlend through a real vLLM: documents reused in another order, a share of their tokens recomputed.

Two engines for the module, one after the other, both fp32 (greedy tokens do
not flip on rounding): an unconnected vLLM with vLLM's stock model classes
(``VLLM_PLUGINS`` without flowkv's ``flowkv-models``) gives the reference
tokens and logprobs of every prompt; then one vLLM with the ``blend``
pipeline (flowkv's recorded model classes) serves them all. A request picks
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

from vllm_helpers import BLOCK_SIZE, KV_BYTES_PER_TOKEN, LOOKUP_TIMEOUT_MS, random_tokens, shutdown_llm, tiny_model_dir

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
MAX_TOKENS = 8
# fp32: a chosen token's logprob moves by float rounding only; ties closer than this may flip.
TIE = 1e-3


def start(connected: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if connected:
        transfer = KVTransferConfig(
            kv_connector="FlowKVConnector", kv_connector_module_path="flowkv.integration.vllm", kv_role="kv_both",
            kv_connector_extra_config={"pipeline": "blend", "blend.separator": SEPARATOR,
                                       "lookup_timeout_ms": LOOKUP_TIMEOUT_MS})
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    try:
        # fp32 KV is twice the bf16 bytes the helpers' constant counts.
        return LLM(model=str(tiny_model_dir()), dtype="float32", block_size=BLOCK_SIZE, max_model_len=4096,
                   seed=0, enable_prefix_caching=False, enforce_eager=True,
                   kv_cache_memory_bytes=256 * BLOCK_SIZE * 2 * KV_BYTES_PER_TOKEN, kv_transfer_config=transfer)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def run(llm, prompt: list[int], ratio: float | None = None):
    """Greedy decoding of one prompt: (tokens, num_cached_tokens, top-5 logprobs per position)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"flowkv.blend.recompute_ratio": ratio}} if ratio is not None else None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5, extra_args=extra)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return (list(out.outputs[0].token_ids), out.num_cached_tokens,
            [{token: lp.logprob for token, lp in position.items()} for position in out.outputs[0].logprobs])


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], tuple]:
    """The unconnected, stock-class vLLM's greedy decoding of every prompt of the module."""
    saved = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = "flowkv-logging"  # vLLM's own model classes in its processes
    try:
        llm = start(connected=False)
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS")
        else:
            os.environ["VLLM_PLUGINS"] = saved
    try:
        return {tuple(prompt): run(llm, prompt) for prompt in (FIRST, REORDERED, ONE_DOC)}
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def blend_llm(reference) -> Iterator:
    llm = start(connected=True)
    try:
        yield llm
    finally:
        shutdown_llm(llm)


def blend_counts(llm) -> tuple[int, int]:
    """The worker's blend counters (what vllm:flowkv_blend_*_tokens_total export)."""
    numbers = counters(llm)
    return numbers["blend_reused_tokens"], numbers["blend_recomputed_tokens"]


def counters(llm) -> dict[str, int]:
    from flowkv.integration.vllm.query import worker_stats

    numbers = worker_stats(llm.llm_engine.vllm_config)
    return {name: int(numbers.get(name, 0)) for name in ("blend_reused_tokens", "blend_recomputed_tokens", "stores")}


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
    cold = run(blend_llm, FIRST)
    assert cold[1] == 0
    want = reference[tuple(FIRST)]
    assert cold[0] == want[0]
    for got_lps, want_lps in zip(cold[2], want[2]):
        assert got_lps.keys() == want_lps.keys()
        assert all(abs(got_lps[t] - want_lps[t]) <= 1e-4 for t in want_lps)


def test_reordered_documents_are_reused_and_ratio_1_reproduces_a_full_prefill(blend_llm, reference) -> None:
    reused_before, recomputed_before = blend_counts(blend_llm)
    stores_before = counters(blend_llm)["stores"]
    warm = run(blend_llm, REORDERED, ratio=1.0)
    # The request's save runs after a blend too (its documents are there already; the question is not kept).
    assert counters(blend_llm)["stores"] == stores_before + 1
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
    assert gaps[1.0] <= 1e-3 and gaps[1.0] <= gaps[0.0]
    assert_same_greedy_up_to_ties(full, want, "ratio 1.0, one document")
