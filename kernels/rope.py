"""Move rotary-embedded keys to another position: re-rotation by a position delta.

A key computed at position ``p`` carries the rotation ``R(p)`` of rotary
position embedding (RoPE). Every RoPE variant whose angle is ``position *
inv_freq`` (plain, linear, dynamic-NTK, YaRN, Llama-3 scaling: only the
frequencies differ) composes additively, ``R(d) R(p) = R(p + d)``, so a
segment stored at position ``p`` and loaded at ``p + d`` needs its keys
rotated by ``d`` alone, with the model's own cos/sin table::

    cos_sin_cache[pos] = [cos(pos * f_0 .. f_{r/2-1}) | sin(...)] * mscale   (r = rotary_dim)

YaRN scales cos and sin by ``mscale``; the rotation for ``d`` is taken with
that magnitude divided out, so the keys' norm is kept. Values carry no
position and are never touched.
"""

from __future__ import annotations

import torch

__all__ = ["rerotate_keys"]


def rerotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, cos_sin_cache: torch.Tensor, *,
                  rotary_dim: int, neox_style: bool) -> torch.Tensor:
    """``keys`` ``(tokens, heads, head_size)`` rotated by
    ``delta`` positions (an int, or one per token; negative moves them earlier).

    ``cos_sin_cache`` is the model's table (``(max_positions, rotary_dim)``, cos then
    sin); ``neox_style`` says whether the rotated pairs are the two halves of the
    rotary dims (GPT-NeoX, Llama) or neighbours (GPT-J). Dims past ``rotary_dim``
    stay as they are. The arithmetic runs in fp32; the result has ``keys``' dtype.
    """
    if keys.dim() != 3:
        raise ValueError(f"keys must be (tokens, heads, head_size), got shape {tuple(keys.shape)}")
    tokens = keys.shape[0]
    if not isinstance(delta, torch.Tensor):
        delta = torch.tensor([int(delta)])
    delta = delta.to(torch.int64).reshape(-1)
    if delta.numel() not in (1, tokens):
        raise ValueError(f"delta must be one int or one per token ({tokens}), got {delta.numel()}")
    reach = int(delta.abs().max()) if delta.numel() else 0
    if reach >= cos_sin_cache.shape[0]:
        raise ValueError(f"a position delta of {reach} is past the rotary table ({cos_sin_cache.shape[0]} positions)")
    if rotary_dim % 2 or cos_sin_cache.shape[-1] != rotary_dim:
        raise ValueError(f"rotary_dim {rotary_dim} does not match the cos/sin table's {cos_sin_cache.shape[-1]}")
    table = cos_sin_cache.index_select(0, delta.abs()).to(torch.float32)
    cos, sin = table.chunk(2, dim=-1)
    magnitude = torch.sqrt(cos * cos + sin * sin)  # 1, or YaRN's mscale
    cos, sin = cos / magnitude, sin / magnitude * delta.sign().unsqueeze(-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (tokens or 1, 1 head, rotary_dim / 2)
    work = keys.to(torch.float32)
    rotary = work[..., :rotary_dim]
    if neox_style:
        first, second = rotary.chunk(2, dim=-1)
    else:
        first, second = rotary[..., 0::2], rotary[..., 1::2]
    new_first = first * cos - second * sin
    new_second = second * cos + first * sin
    out = work.clone()
    if neox_style:
        out[..., :rotary_dim] = torch.cat((new_first, new_second), dim=-1)
    else:
        out[..., 0:rotary_dim:2] = new_first
        out[..., 1:rotary_dim:2] = new_second
    return out.to(keys.dtype)
