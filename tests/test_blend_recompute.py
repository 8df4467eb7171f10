"""The blend's own attention (``blend.causal_attention``) against torch's scaled-dot-product attention.

The recompute never calls vLLM's ``attn`` module (it writes vLLM's cache and
re-enters the connector's hooks): the reused tokens attend over the fused KV
with flowkv's attention. Here it is held to ``torch.nn.functional.
scaled_dot_product_attention`` over the same KV, for queries at scattered
positions (the selected tokens) and grouped heads; the end-to-end check is
``test_vllm_blend.py`` (ratio 1.0 gives vLLM's own greedy tokens).
"""

from __future__ import annotations

import pytest
import torch

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from flowkv.integration.vllm.blend import causal_attention  # noqa: E402


def reference(q, keys, values, positions, scale):
    """SDPA with an explicit mask: query i sees positions <= positions[i]; KV heads repeated per group."""
    n, kv_heads, head_size = len(q), keys.shape[1], keys.shape[2]
    heads = q.shape[-1] // head_size
    queries = q.reshape(n, heads, head_size).transpose(0, 1).double()
    k = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1).double()
    v = values.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1).double()
    allowed = torch.arange(len(keys))[None, :] <= positions[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(queries, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1).reshape(n, heads * head_size)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 8), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_over_the_fused_kv_equals_sdpa(heads, kv_heads, dtype) -> None:
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    head_size, tokens = 32, 700  # more queries than one tile of 256
    keys = torch.randn(tokens, kv_heads, head_size, generator=generator).to(dtype)
    values = torch.randn(tokens, kv_heads, head_size, generator=generator).to(dtype)
    positions = torch.sort(torch.randperm(tokens, generator=generator)[:300]).values
    q = torch.randn(len(positions), heads * head_size, generator=generator).to(dtype)
    scale = head_size ** -0.5
    got = causal_attention(q, keys, values, positions, scale)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, keys, values, positions, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance)


def test_a_query_sees_no_position_after_its_own() -> None:
    keys = torch.zeros(5, 1, 4)
    values = torch.arange(5, dtype=torch.float32)[:, None, None].expand(5, 1, 4).contiguous()
    # Equal scores everywhere: each query averages the values of positions 0..its own.
    out = causal_attention(torch.zeros(3, 4), keys, values, torch.tensor([0, 2, 4]), 1.0)
    assert torch.allclose(out[:, 0], torch.tensor([0.0, 1.0, 2.0]))
