"""A synthetic paged KV cache, laid out the way an engine lays out its own.

Like vLLM's CPU backend, every layer is a view into one buffer (layer
outermost), so code that relies on that is exercised; ``shared_storage=False``
gives each layer its own tensor instead.
"""

from __future__ import annotations

import torch

from flowkv.kernels.geometry import KVGeometry

__all__ = ["make_paged_kv", "random_slot_mapping"]


def make_paged_kv(
    geometry: KVGeometry,
    num_blocks: int,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    shared_storage: bool = True,
    fill: bool = True,
) -> list[torch.Tensor]:
    """One tensor per layer, filled with values that depend only on ``seed``
    (zeros when ``fill`` is False).

    >>> g = KVGeometry("cpu", 2, 2, 64, 32, torch.bfloat16)
    >>> [tuple(t.shape) for t in make_paged_kv(g, 4, seed=0)]
    [(4, 2, 32, 128), (4, 2, 32, 128)]
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    shape = (geometry.num_layers, *geometry.layer_shape(num_blocks))
    if fill:
        generator = torch.Generator().manual_seed(seed)
        # Generated on CPU so the values are the same whatever the device.
        buffer = torch.randn(shape, generator=generator, dtype=torch.float32).to(geometry.dtype)
        buffer = buffer.to(device)
    else:
        buffer = torch.zeros(shape, dtype=geometry.dtype, device=device)
    if shared_storage:
        return list(buffer.unbind(0))
    return [layer.clone() for layer in buffer.unbind(0)]


def random_slot_mapping(
    num_tokens: int, geometry: KVGeometry, num_blocks: int, *, seed: int
) -> torch.Tensor:
    """Slots for ``num_tokens`` tokens of one request: distinct blocks in random
    order, each filled from offset 0 in order, the last one possibly partly,
    as vLLM's block table maps a sequence."""
    block_size = geometry.block_size
    needed = -(-num_tokens // block_size)
    if needed > num_blocks:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {block_size}, only {num_blocks} exist")
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=generator)[:needed]
    slots = (blocks.view(-1, 1) * block_size + torch.arange(block_size)).view(-1)
    return slots[:num_tokens].contiguous()
