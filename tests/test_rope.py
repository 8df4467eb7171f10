"""Re-rotating a segment's keys by a position delta (issue 24, step 3), against vLLM's own RoPE.

vLLM's ``get_rope`` builds the rotary module a Llama / Qwen2 / Mistral layer
holds (``rotary_emb``); no engine runs. Keys rotated at positions ``p`` and
then moved by ``d`` must equal the same raw keys rotated at ``p + d``: in
fp32 to the rounding of the model's own fp32 cos/sin table, in bf16 to two
bf16 steps of the keys' magnitude.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

from flowkv.integration.vllm.rope import rerotate_with  # noqa: E402
from flowkv.kernels.rope import rerotate_keys  # noqa: E402

HEADS, HEAD_SIZE, TOKENS = 4, 128, 64
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024, "rope_theta": 500000},
    "partial": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.5},
}


@pytest.fixture(scope="module", autouse=True)
def vllm_config():
    with set_current_vllm_config(VllmConfig()):
        yield


def rotated(rope, raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``raw`` keys as vLLM's module rotates them at ``positions``."""
    flat = raw.reshape(len(raw), -1).clone()
    _, keys = rope.forward_native(positions, torch.zeros_like(flat), flat)
    return keys.view(raw.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("kind", list(ROPES))
def test_keys_moved_by_a_delta_equal_keys_computed_there(kind, neox, dtype) -> None:
    rope = get_rope(HEAD_SIZE, 4096, is_neox_style=neox, rope_parameters=ROPES[kind], dtype=dtype)
    raw = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(0)).to(dtype)
    start = torch.arange(100, 100 + TOKENS)
    stored = rotated(rope, raw, start)
    # fp32: the rounding of angles near position 1,600 in the model's own fp32 table;
    # bf16: two steps of bf16 at the keys' magnitude.
    tolerance = 5e-4 if dtype == torch.float32 else 2 * 2**-7 * float(raw.abs().max())
    for delta in (1500, 7, -60):
        want = rotated(rope, raw, start + delta)
        got = rerotate_with(rope, stored, delta)
        assert got.dtype == dtype and got.shape == stored.shape
        error = (got.float() - want.float()).abs()
        assert float(error.max()) <= tolerance, (kind, delta, float(error.max()))
    # Dims past rotary_dim carry no position: untouched.
    assert torch.equal(rerotate_with(rope, stored, 33)[..., rope.rotary_dim:], stored[..., rope.rotary_dim:])


def test_a_delta_per_token_and_the_zero_delta() -> None:
    rope = get_rope(HEAD_SIZE, 4096, rope_parameters=ROPES["default"], dtype=torch.float32)
    raw = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(1))
    start = torch.arange(TOKENS) + 100
    deltas = torch.arange(TOKENS) * 3 - 20
    got = rerotate_with(rope, rotated(rope, raw, start), deltas)
    assert torch.allclose(got, rotated(rope, raw, start + deltas), atol=5e-4, rtol=0)
    stored = rotated(rope, raw, start)
    assert torch.equal(rerotate_with(rope, stored, 0), stored)


def test_what_cannot_be_rerotated_is_refused() -> None:
    rope = get_rope(HEAD_SIZE, 256, rope_parameters=ROPES["default"], dtype=torch.float32)
    keys = torch.zeros(2, HEADS, HEAD_SIZE)
    with pytest.raises(ValueError, match="past the rotary table"):
        rerotate_with(rope, keys, 256)
    with pytest.raises(ValueError, match=r"\(tokens, heads, head_size\)"):
        rerotate_with(rope, keys.view(2, -1), 1)

    class OtherRope(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="cannot move keys rotated by vLLM's OtherRope"):
        rerotate_with(OtherRope(), keys, 1)
    with pytest.raises(ValueError, match="rotary_dim"):
        rerotate_keys(keys, 1, rope.cos_sin_cache, rotary_dim=64, neox_style=True)
