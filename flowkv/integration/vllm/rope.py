"""Re-rotating a segment's keys with the model's own ``rotary_emb`` (vLLM's RoPE module).

`flowkv.kernels.rerotate_keys` does the arithmetic from a cos/sin table; this
reads the table and the style from vLLM's module and refuses the RoPE kinds
whose angle is not ``position * inv_freq`` (they do not compose by a delta).
"""

from __future__ import annotations

import torch

from flowkv.kernels.rope import rerotate_keys

__all__ = ["REROTATABLE_ROPES", "rerotate_with"]

#: vLLM's RoPE classes whose rotation composes additively over positions (Llama, Qwen2, Mistral use these)
REROTATABLE_ROPES = ("RotaryEmbedding", "LinearScalingRotaryEmbedding", "DynamicNTKScalingRotaryEmbedding",
                     "YaRNScalingRotaryEmbedding", "Llama3RotaryEmbedding", "NTKScalingRotaryEmbedding")


def rerotate_with(rotary_emb: torch.nn.Module, keys: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
    """``keys`` ``(tokens, heads, head_size)`` computed at positions ``p`` as if computed at ``p + delta``."""
    kind = type(rotary_emb).__name__
    if kind not in REROTATABLE_ROPES:
        raise ValueError(f"flowkv cannot move keys rotated by vLLM's {kind} to another position (it re-rotates "
                         f"{', '.join(REROTATABLE_ROPES)})")
    return rerotate_keys(keys, delta, rotary_emb.cos_sin_cache, rotary_dim=rotary_emb.rotary_dim,
                         neox_style=rotary_emb.is_neox_style)
