"""vLLM's CPU cache-write op and ISA choice, for `flowkv.kernels.PackedBlockLayout`.

The layout table is drawn from vLLM's own op, so it follows whatever packing
the installed vLLM uses; this module is the only place that names the op and
the ISA rule, so that the kernels stay free of vLLM.

    >>> layout = packed_layout(torch.bfloat16, block_size=128, head_size=64)   # doctest: +SKIP
    >>> keys, values = layout.read_tokens(kv_caches[0], slots)                 # doctest: +SKIP
    >>> write_tokens(layout, kv_caches[0], slots, keys, values)                 # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging

import torch

from flowkv.kernels import KVGeometry, PackedBlockLayout

__all__ = ["CPU_ISAS", "backend_isa", "cache_write", "engine_packing", "packed_attention", "packed_layout",
           "write_tokens"]

logger = logging.getLogger("flowkv.integration")

#: the ISAs vLLM's CPU attention names (which of them this machine's build accepts varies)
CPU_ISAS = ("amx", "vec", "vec16", "neon", "rvv", "vxe", "vsx")


def cache_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slot_mapping: torch.Tensor, isa: str) -> None:
    """vLLM's cache-write op, as ``do_kv_cache_update`` calls it (scales 1, cache dtype ``auto``)."""
    from vllm import _custom_ops as ops

    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)


def backend_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's CPU attention backend picks for this geometry on this machine."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


@functools.lru_cache(maxsize=16)
def packed_layout(dtype: torch.dtype, *, block_size: int, head_size: int, isa: str | None = None) -> PackedBlockLayout:
    """The packing of vLLM's CPU cache for this geometry (the backend's ISA unless ``isa`` is given)."""
    isa = isa or backend_isa(dtype, block_size, head_size)
    return PackedBlockLayout.draw(cache_write, isa=isa, block_size=block_size, head_size=head_size, dtype=dtype)


def engine_packing(geometry: KVGeometry) -> PackedBlockLayout | None:
    """How vLLM packs tokens inside the blocks of a cache of ``geometry``, for the engine's lossy
    codecs: None for layouts whose block rows are tokens, and (with a warning) when the op packs in
    a way the table cannot read; lossy codecs then quantize the blocks' bytes as they lie."""
    if geometry.layout != "cpu":
        return None
    try:
        return packed_layout(geometry.dtype, block_size=geometry.block_size, head_size=geometry.head_size)
    except RuntimeError as exc:  # PackingError, or the op refusing this geometry
        logger.warning("flowkv: cannot read single tokens in vLLM's CPU blocks (%s); lossy codecs will quantize "
                       "the packed blocks as they lie, not per key channel", exc)
        return None


def write_tokens(layout: PackedBlockLayout, layer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
    """Write single tokens' ``keys`` / ``values`` ``(n, heads, head_size)`` at ``slots`` through vLLM's op."""
    num_blocks, num_heads, block_size, width = layer.shape
    key_cache, value_cache = layer.view(num_blocks, num_heads, 2 * block_size, width // 2).chunk(2, dim=2)
    cache_write(keys.to(layer.dtype).contiguous(), values.to(layer.dtype).contiguous(), key_cache, value_cache,
                slots.to(torch.int64), layout.isa)


def packed_attention(query: torch.Tensor, layer: torch.Tensor, block_ids: list[int], positions: torch.Tensor, *,
                     scale: float, isa: str) -> torch.Tensor:
    """Queries ``(n, heads, head_size)`` at ascending ``positions``, each attending causally over the
    K/V that ``layer`` (a layer of vLLM's CPU cache) holds for positions ``[0, position]`` in the
    blocks ``block_ids``, through vLLM's own CPU attention op (grouped heads, fp32 softmax).

    A run of consecutive positions is one sequence whose queries are its last tokens (vLLM's causal
    prefill); a lone position is a sequence of one query (a decode).
    """
    from vllm import _custom_ops as ops
    from vllm import envs

    positions = positions.to(torch.int64)
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    ends = torch.cat([breaks, torch.tensor([len(positions)])])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)
    seq_lens = (positions[ends - 1] + 1).to(torch.int32)
    block_size = layer.shape[2]
    needed = -(-int(seq_lens.max()) // block_size)
    table = torch.as_tensor(block_ids[:needed], dtype=torch.int32)[None, :].expand(len(ends), -1).contiguous()
    num_blocks, num_kv_heads, _, width = layer.shape
    key_cache, value_cache = layer.view(num_blocks, num_kv_heads, 2 * block_size, width // 2).chunk(2, dim=2)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(ends), num_heads=query.shape[1], num_kv_heads=num_kv_heads, head_dim=query.shape[2],
        seq_lens=seq_lens, dtype=query.dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    output = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query.contiguous(), key_cache=key_cache, value_cache=value_cache, output=output,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    return output
