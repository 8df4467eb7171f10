"""The blend's attention (``cpu_packing.packed_attention``, vLLM's CPU attention op) against torch's SDPA.

The recompute never calls vLLM's ``attn`` module (it writes vLLM's cache and
re-enters the connector's hooks): the reused tokens attend over the fused KV,
which the blend writes into vLLM's blocks with vLLM's cache-write op, through
vLLM's CPU attention op, each run of consecutive positions a causal sequence
and each lone position a decode. Here that is held to
``torch.nn.functional.scaled_dot_product_attention`` over the same KV, for
queries at scattered positions (the selected tokens), runs of them, grouped
heads and blocks out of order: the facts of vLLM's op the blend relies on.
The end-to-end check is ``test_vllm_blend.py`` (ratio 1.0 gives vLLM's own
greedy tokens).
"""

from __future__ import annotations

import pytest
import torch

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from flowkv.integration.vllm.cpu_packing import packed_attention, packed_layout, write_tokens  # noqa: E402


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


def in_vllms_blocks(keys, values, block_size=32, seed=0):
    """``keys`` / ``values`` of positions 0.. written into a layer of vLLM's CPU cache through its op,
    in blocks out of order: (layer, block ids, isa)."""
    tokens, kv_heads, head_size = keys.shape
    blocks = -(-tokens // block_size)
    block_ids = (torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(seed))[:blocks]).tolist()
    layout = packed_layout(keys.dtype, block_size=block_size, head_size=head_size)
    layer = torch.zeros(blocks + 3, kv_heads, block_size, 2 * head_size, dtype=keys.dtype)
    positions = torch.arange(tokens)
    slots = torch.tensor(block_ids)[positions // block_size] * block_size + positions % block_size
    write_tokens(layout, layer, slots, keys, values)
    return layer, block_ids, layout.isa


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 8), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["scattered", "runs", "one run"])
def test_attention_over_vllms_blocks_equals_sdpa(heads, kv_heads, dtype, where) -> None:
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    head_size, tokens = 64, 700
    keys = torch.randn(tokens, kv_heads, head_size, generator=generator).to(dtype)
    values = torch.randn(tokens, kv_heads, head_size, generator=generator).to(dtype)
    positions = {
        "scattered": torch.sort(torch.randperm(tokens, generator=generator)[:300]).values,  # the selected tokens
        "runs": torch.cat([torch.arange(5, 9), torch.tensor([40]), torch.arange(100, 390), torch.tensor([699])]),
        "one run": torch.arange(130, 700),  # every reused token after an exact prefix
    }[where]
    q = torch.randn(len(positions), heads, head_size, generator=generator).to(dtype)
    scale = head_size ** -0.5
    layer, block_ids, isa = in_vllms_blocks(keys, values)
    got = packed_attention(q, layer, block_ids, positions, scale=scale, isa=isa)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q.reshape(len(q), -1), keys, values, positions, scale).view(q.shape)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance)


def test_a_query_sees_no_position_after_its_own() -> None:
    keys = torch.zeros(100, 1, 64)
    values = torch.arange(100, dtype=torch.float32)[:, None, None].expand(100, 1, 64).contiguous()
    layer, block_ids, isa = in_vllms_blocks(keys, values)
    # Equal scores everywhere: each query averages the values of positions 0..its own.
    out = packed_attention(torch.zeros(4, 1, 64), layer, block_ids, torch.tensor([0, 2, 3, 98]), scale=1.0, isa=isa)
    assert torch.allclose(out[:, 0, 0], torch.tensor([0.0, 1.0, 1.5, 49.0]))
