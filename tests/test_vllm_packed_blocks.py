"""Chunks smaller than vLLM's CPU blocks: a block is never assembled from two requests' bytes.

vLLM's CPU backend packs a block's keys and values by ISA (tests/test_kernels.py checks that
with vLLM's own cache write), so a chunk that ends inside a block would carry parts of the
tokens after its end. Found by comparing against a cold run: A's prompt ends inside a block,
B shares the block's first tokens and stores the rest; C, loading that block, got 6 tokens'
keys from A (layer 0 off by up to 4.8, first-token logprob 0.096 off). The connector now keeps
chunks to whole blocks on the CPU backend; this replays that sequence.
"""

from __future__ import annotations

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import BLOCK_SIZE, make_llm, random_tokens, request, shutdown_llm  # noqa: E402

pytestmark = pytest.mark.vllm

CHUNK = BLOCK_SIZE // 2  # what the user asked for: two chunks per block


def first_token(llm, tokens: list[int], tags: dict[str, str] | None = None) -> tuple[int, float, int]:
    params, sampling = request(tokens, max_tokens=1, tags=tags)
    sampling.logprobs = 1
    [out] = llm.generate([params], [sampling], use_tqdm=False)
    token = out.outputs[0].token_ids[0]
    return token, out.outputs[0].logprobs[0][token].logprob, out.num_cached_tokens


def test_a_block_shared_up_to_a_chunk_boundary_is_never_mixed_from_two_requests():
    llm = make_llm({"pipeline": "local-cpu", "chunk_size": CHUNK, "tiers.memory.capacity": "256MiB"},
                   max_num_batched_tokens=1024)
    try:
        prompt = random_tokens(900, 13 * BLOCK_SIZE + 16)
        cut = 12 * BLOCK_SIZE - 6  # A ends 6 tokens short of block 11's end
        cold = first_token(llm, prompt, {"run": "cold"})
        first_token(llm, prompt[:cut])                 # A: stores what it computed of block 11
        first_token(llm, prompt[:cut + BLOCK_SIZE])    # B: shares block 11's first half, stores the rest
        token, logprob, cached = first_token(llm, prompt)  # C: loads block 11
        assert cached == 12 * BLOCK_SIZE
        assert token == cold[0]
        # The same KV up to bf16 rounding of a different batch shape (a mixed block moved it by 0.096).
        assert logprob == pytest.approx(cold[1], abs=0.02)
    finally:
        shutdown_llm(llm)
