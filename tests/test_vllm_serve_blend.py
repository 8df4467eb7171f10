"""CacheBlend through a real ``vllm serve``: concurrent HTTP clients whose documents sit in other orders.

One server for the module (eager, fp32): the ``blend`` pipeline. A first
request stores the system prompt and three documents; then three clients at
once ask with the documents reordered, one at ``recompute_ratio`` 1.0 (its
``kv_transfer_params``), two at the pipeline's 0.15. Each gets its documents
from flowkv (``cached_tokens``), the blend counters count exactly those, and
the same prompts asked again one by one give the same greedy tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import vllm  # noqa: F401 - a broken vLLM install fails this file, as the suite's other vLLM tests do
from vllm_helpers import BLOCK_SIZE, random_tokens
from vllm_server import VllmServer, start_server

pytestmark = pytest.mark.vllm

SEPARATOR = [1, 2]  # the tiny model's end-of-text and padding ids: in no document
SYSTEM = random_tokens(340, 98) + SEPARATOR
DOCS = [random_tokens(341 + i, 298) + SEPARATOR for i in range(3)]
QUESTIONS = [random_tokens(350 + i, 40) for i in range(4)]
FIRST = SYSTEM + DOCS[0] + DOCS[1] + DOCS[2] + QUESTIONS[0]
# (prompt, recompute_ratio or None for the pipeline's 0.15)
CLIENTS = [
    (SYSTEM + DOCS[2] + DOCS[0] + DOCS[1] + QUESTIONS[1], 1.0),
    (SYSTEM + DOCS[1] + DOCS[2] + QUESTIONS[2], None),
    (SYSTEM + DOCS[2] + QUESTIONS[3], None),
]
REUSED = "vllm:flowkv_blend_reused_tokens_total"
RECOMPUTED = "vllm:flowkv_blend_recomputed_tokens_total"


@pytest.fixture(scope="module")
def blend_server(tmp_path_factory) -> Iterator[VllmServer]:
    server = start_server(tmp_path_factory.mktemp("blend-serve"), compiled=False, dtype="float32",
                          kv_extra={"pipeline": "blend", "blend.separator": SEPARATOR})
    try:
        yield server
    finally:
        server.close()


def ask(server: VllmServer, prompt: list[int], ratio: float | None) -> dict:
    fields = {} if ratio is None else {"kv_transfer_params": {"flowkv.blend.recompute_ratio": ratio}}
    reply = server.complete(prompt, max_tokens=8, **fields)
    [choice] = reply["choices"]
    return {"tokens": choice["token_ids"], "cached": reply["usage"]["prompt_tokens_details"]["cached_tokens"]}


def loaded(prompt: list[int]) -> int:
    """What a blend of every document of `prompt` loads: the whole blocks before the question."""
    return (len(prompt) - len(QUESTIONS[0])) // BLOCK_SIZE * BLOCK_SIZE


def recomputed(prompt: list[int], ratio: float | None) -> int:
    """Reused tokens past the exact system prompt, the ratio's share of them (rounded up)."""
    moved = loaded(prompt) - len(SYSTEM)
    return moved if ratio == 1.0 else -(-15 * moved // 100)


def test_concurrent_clients_each_blend_their_documents_and_the_counters_add_up(blend_server) -> None:
    assert ask(blend_server, FIRST, None)["cached"] == 0  # stores S and the three documents
    reused_before, recomputed_before = blend_server.metric(REUSED), blend_server.metric(RECOMPUTED)
    with ThreadPoolExecutor(len(CLIENTS)) as pool:
        concurrent = list(pool.map(lambda client: ask(blend_server, *client), CLIENTS))
    for (prompt, _), got in zip(CLIENTS, concurrent):
        assert got["cached"] == loaded(prompt) >= 0.8 * (len(prompt) - len(QUESTIONS[0]))
        assert len(got["tokens"]) == 8
    assert blend_server.metric(REUSED) - reused_before == sum(loaded(p) for p, _ in CLIENTS)
    assert blend_server.metric(RECOMPUTED) - recomputed_before == sum(recomputed(p, r) for p, r in CLIENTS)
    # One by one, each prompt blends the same way and says the same (fp32: no near-tie flips with the batch).
    for (prompt, ratio), got in zip(CLIENTS, concurrent):
        assert ask(blend_server, prompt, ratio) == got


def test_the_server_log_says_no_quality_record_exists_for_the_model(blend_server) -> None:
    log = blend_server.log()
    assert "no quality record exists for this model" in log and "'flowkv quality" in log and "warn mode" in log
