"""CacheBlend in the vLLM worker: documents loaded wherever they sit, a share of their tokens recomputed.

A blend pipeline keys each document (segment) by its own tokens, so a load
may bring KV computed at another position and next to other documents. The
worker then, for each load, in ``start_load_kv`` (synchronously, before the
forward pass that reads it):

1. **load**: the engine retrieves the segments into a staging cache of true
   tokens (``flash_kv_nhd``, one slot per position): vLLM's CPU blocks are
   packed per ISA, and segments start and end inside blocks;
2. **re-rotate**: keys of a segment stored at another position are turned
   by the position delta with the layer's own ``rotary_emb``;
3. **recompute**: the reused tokens (all but an exact prefix: tokens vLLM
   computed, and the first segment when it sits where it was stored) run
   through the model's own modules. Layers before the first check layer and
   the check layer itself recompute every reused token; at the check layer the
   ``recompute_ratio`` share whose K/V deviates most from the loaded K/V is
   selected, and only those go on, layer by layer, attending over the fused KV
   (exact prefix, loaded segments, tokens recomputed so far) with flowkv's own
   attention at ``attn.impl.scale`` (`causal_attention`). vLLM's ``attn`` modules are never called
   (they write vLLM's cache and re-enter the connector's hooks), and weights
   are never read (vLLM's CPU backend empties them after packing);
4. **write**: every loaded token's K/V goes into vLLM's blocks through vLLM's
   own cache-write op (``cpu_packing.write_tokens``).

Saves go the other way: the tokens a save covers are read out of vLLM's
packed blocks (``PackedBlockLayout.read_tokens``) into the staging cache, and
the engine stores from there. What vLLM then computes for the question reads
the blended KV. ``recompute_ratio = 1.0`` recomputes every reused token at
every layer: a full prefill of the documents, up to float rounding.

Why synchronous in ``start_load_kv``: the recompute needs the model's weights
and the whole fused KV of every layer before vLLM's first layer reads it, and
on the CPU backend an asynchronous path would compete with vLLM's own OpenMP
workers for the same cores (see the README). It runs outside the engine's
lock, so lookups go on meanwhile. Each step has its span under the request's:
``flowkv.blend.stage`` (saves), ``.rerotate``, ``.recompute`` and ``.attend``
(per layer), ``.check``, ``.select``, ``.write``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry import trace

from flowkv.integration.vllm.cpu_packing import packed_layout, write_tokens
from flowkv.integration.vllm.metadata import ceil_to, slot_mapping
from flowkv.integration.vllm.models import BLENDABLE_ARCHITECTURES, loaded_model
from flowkv.integration.vllm.rope import rerotate_with
from flowkv.kernels import KVGeometry
from flowkv.stages.chunking import segment_ends

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from flowkv.pipeline_model import BlendSpec, Pipeline

logger = logging.getLogger("flowkv.integration")

__all__ = ["BlendCounts", "Blender", "causal_attention", "refuse_unblendable"]

# Queries per attention call: bounds the score matrix (queries x heads x keys) the recompute holds.
_QUERY_TILE = 256


def refuse_unblendable(vllm_config: VllmConfig, pipeline: Pipeline, *, cpu: bool = True) -> None:
    """Stop vLLM at start when a blend pipeline cannot blend in this engine, saying why
    (``cpu``: whether vLLM runs its CPU backend)."""
    if pipeline.blend is None:
        return
    where = f"flowkv: pipeline '{pipeline.name}' ({pipeline.source}) blends documents (CacheBlend)"
    if not cpu:
        raise ValueError(f"{where}, which flowkv does on vLLM's CPU backend only (it reads and writes single "
                         "tokens through the CPU cache-write op); use a prefix pipeline such as 'local-cpu' here")
    architectures = list(getattr(vllm_config.model_config, "architectures", None) or [])
    if not architectures or architectures[0] not in BLENDABLE_ARCHITECTURES:
        raise ValueError(f"{where}, which flowkv does for {', '.join(BLENDABLE_ARCHITECTURES)} only; this "
                         f"model is {', '.join(architectures) or 'of no named architecture'}. Use a prefix "
                         "pipeline such as 'local-cpu' with this model")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(f"{where}, which needs the whole model in one worker: tensor parallel size "
                         f"{parallel.tensor_parallel_size}, pipeline parallel size {parallel.pipeline_parallel_size} "
                         "(the recompute would run on a shard whose projections all-reduce across ranks). "
                         "Serve with tensor_parallel_size=1, or use a prefix pipeline such as 'local-cpu'")
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(f"{where}, whose blended blocks are approximate; vLLM's own prefix caching would "
                         "hand them to later requests as exact. Start vLLM with --no-enable-prefix-caching "
                         "(enable_prefix_caching=False)")
    if pipeline.layerwise.enabled:
        raise ValueError(f"{where}; a blend loads and recomputes before the forward pass, not layer by layer: "
                         "set [layerwise] enabled = false")


def _refuse_variant(layer: Any, name: str) -> None:
    """Refuse the variants of the blendable classes whose layer does more than the recompute
    replays (the steps ``tests/test_blend_models.py`` pins in vLLM's forward code)."""
    attn = layer.self_attn
    found = [what for what, on in (
        ("per-head q/k norm (qk_norm)", getattr(attn, "qk_norm", False)),
        ("Llama 4 attention scaling", getattr(attn, "do_llama_4_scaling", False)),
        ("adaptive RMS norm (ada_rms_norm_t_cond)", getattr(layer, "ada_rms_norm_t_cond", None) is not None),
        ("sliding-window attention", getattr(attn.attn, "sliding_window", None) is not None),
    ) if on]
    if found:
        raise RuntimeError(f"flowkv: layer {name!r} uses {', '.join(found)}, which flowkv's blend does not "
                           "recompute; use a prefix pipeline such as 'local-cpu' with this model")


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of queries ``q`` ``(n, heads * head_size)`` at ``positions`` over the KV of positions
    ``[0, len(keys))`` (``(tokens, kv_heads, head_size)``), each query seeing positions up to its own;
    grouped heads (query head ``h`` reads KV head ``h // (heads // kv_heads)``), in fp32, at ``scale``
    (vLLM's ``attn.impl.scale``). Returns ``(n, heads * head_size)`` in ``q``'s dtype."""
    kv_heads, head_size = keys.shape[1], keys.shape[2]
    heads = q.shape[-1] // head_size
    group = heads // kv_heads
    queries = q.reshape(len(q), kv_heads, group, head_size).float()
    k, v = keys.float(), values.float()
    out = torch.empty(len(q), kv_heads, group, head_size, dtype=torch.float32)
    key_positions = torch.arange(len(keys))
    for first in range(0, len(q), _QUERY_TILE):
        tile = slice(first, first + _QUERY_TILE)
        scores = torch.einsum("qhgd,khd->qhgk", queries[tile], k) * scale
        hidden = key_positions[None, :] > positions[tile, None]
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        out[tile] = torch.einsum("qhgk,khd->qhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(len(q), heads * head_size).to(q.dtype)


@dataclass
class BlendCounts:
    """What one blend did: tokens loaded from segments, and of them the ones recomputed past the check."""

    reused: int = 0
    recomputed: int = 0


@dataclass
class _Layer:
    """One decoder layer's modules, and its KV cache in vLLM (packed) and in the staging cache."""

    module: Any  # LlamaDecoderLayer / Qwen2DecoderLayer
    kv_cache: torch.Tensor
    staging: torch.Tensor  # (2, blocks, block_size, heads, head_size)


class Blender:
    """The worker's blend path for one vLLM engine (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, blend: BlendSpec, kv_caches: dict[str, torch.Tensor], *,
                 num_kv_heads: int, head_size: int, block_size: int) -> None:
        model = loaded_model()
        if model is None:
            raise RuntimeError("flowkv: a blend pipeline needs the model vLLM loaded, and flowkv's model plugin "
                               "did not record one in this worker (its vllm.general_plugins entry "
                               "'flowkv-models' was not loaded: is VLLM_PLUGINS set without it?)")
        self._blend = blend
        self._model = model
        self._block_size = block_size
        #: the tracer of the blend steps' spans: the engine's, set once the engine exists (it is
        #: built on this staging cache); OpenTelemetry's no-op tracer until then
        self.tracer: Any = trace.NoOpTracer()
        first = next(iter(kv_caches.values()))
        self._layout = packed_layout(first.dtype, block_size=block_size, head_size=head_size)
        num_blocks = ceil_to(vllm_config.model_config.max_model_len, block_size) // block_size
        by_name = {}
        for module in model.model.layers:
            by_name[module.self_attn.attn.layer_name] = module
        self._layers: list[_Layer] = []
        for name, kv_cache in kv_caches.items():
            if name not in by_name:
                raise RuntimeError(f"flowkv: vLLM's KV cache names layer {name!r}, which the model has not")
            _refuse_variant(by_name[name], name)
            staging = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=first.dtype)
            self._layers.append(_Layer(module=by_name[name], kv_cache=kv_cache, staging=staging))
        self.geometry = KVGeometry("flash_kv_nhd", num_layers=len(self._layers), num_kv_heads=num_kv_heads,
                                   head_size=head_size, block_size=block_size, dtype=first.dtype)
        #: the staging cache's blocks, in order: slot = position
        self.identity_blocks = list(range(num_blocks))
        self.staging = [layer.staging for layer in self._layers]
        self._num_kv_heads, self._head_size = num_kv_heads, head_size

    # -- saves ------------------------------------------------------------------------

    def stage_for_save(self, token_ids: Sequence[int], block_ids: list[int], skip_prefix: int) -> None:
        """Copy the true K/V of the segments a save stores (those ending past ``skip_prefix``)
        out of vLLM's packed blocks into the staging cache, where the engine stores from."""
        end = len(token_ids)
        start = 0
        for _, chunk_end in segment_ends(token_ids, self._blend.separator, max(end, 1)):
            if chunk_end > skip_prefix:
                break
            start = chunk_end
        if start >= end:
            return
        slots = slot_mapping(block_ids, self._block_size, start, end - start, start, end)
        with torch.inference_mode(), self._span("flowkv.blend.stage", {"flowkv.tokens": end - start}):
            for layer in self._layers:
                keys, values = self._layout.read_tokens(layer.kv_cache, slots)
                self._staged(layer, 0, start, end).copy_(keys)
                self._staged(layer, 1, start, end).copy_(values)

    # -- loads ------------------------------------------------------------------------

    def blend(self, token_ids: Sequence[int], block_ids: list[int], start: int, end: int,
              moved: Sequence[tuple[int, int, int]], ratio: float | None) -> BlendCounts:
        """Blend tokens ``[start, end)``, which the engine loaded into the staging cache, into
        vLLM's blocks ``block_ids``; ``moved`` are the loaded pieces stored at another position."""
        if end <= start:
            return BlendCounts()
        with torch.inference_mode():
            return self._blend_loaded(token_ids, block_ids, start, end, moved,
                                      self._blend.recompute_ratio if ratio is None else ratio)

    def _blend_loaded(self, token_ids: Sequence[int], block_ids: list[int], start: int, end: int,
                      moved: Sequence[tuple[int, int, int]], ratio: float) -> BlendCounts:
        keys = [self._staged(layer, 0, start, end).clone() for layer in self._layers]
        values = [self._staged(layer, 1, start, end).clone() for layer in self._layers]
        with self._span("flowkv.blend.rerotate", {"flowkv.pieces": len(moved)}):
            for piece_start, piece_end, stored_start in moved:
                lo, hi = max(piece_start, start), min(piece_end, end)
                if lo >= hi or piece_start == stored_start:
                    continue
                for layer, layer_keys in zip(self._layers, keys):
                    rotary = layer.module.self_attn.rotary_emb
                    layer_keys[lo - start:hi - start] = rerotate_with(rotary, layer_keys[lo - start:hi - start],
                                                                      piece_start - stored_start)
        reuse_from = self._exact_end(token_ids, start, end, moved)
        counts = BlendCounts(reused=end - start)
        if ratio > 0 and reuse_from < end:
            counts.recomputed = self._recompute(token_ids, block_ids, start, reuse_from, end, keys, values, ratio)
        with self._span("flowkv.blend.write", {"flowkv.tokens": end - start,
                                               "flowkv.blend.reused_tokens": counts.reused,
                                               "flowkv.blend.recomputed_tokens": counts.recomputed}):
            slots = slot_mapping(block_ids, self._block_size, start, end - start, start, end)
            for layer, layer_keys, layer_values in zip(self._layers, keys, values):
                write_tokens(self._layout, layer.kv_cache, slots, layer_keys, layer_values)
        return counts

    def _exact_end(self, token_ids: Sequence[int], start: int, end: int,
                   moved: Sequence[tuple[int, int, int]]) -> int:
        """Where the exact part of a load ends: the first segment is exact where it was stored
        (it attends to itself only); every later one was computed next to other documents."""
        if start > 0:
            return start
        first_end = segment_ends(token_ids, self._blend.separator, max(len(token_ids), 1))[0][1]
        if any(piece_start < first_end for piece_start, _, _ in moved):
            return start
        return min(first_end, end)

    def _recompute(self, token_ids: Sequence[int], block_ids: list[int], start: int, reuse_from: int, end: int,
                   keys: list[torch.Tensor], values: list[torch.Tensor], ratio: float) -> int:
        """Recompute reused tokens ``[reuse_from, end)`` into ``keys`` / ``values`` (the loaded
        ``[start, end)``), layer by layer; the number of tokens selected at the check layer."""
        model = self._model
        check_layer = min(min(self._blend.check_layers), len(self._layers) - 1)
        prefix_slots = slot_mapping(block_ids, self._block_size, 0, start, 0, start) if start > 0 else None
        ids = torch.tensor(list(token_ids[reuse_from:end]), dtype=torch.int64)
        positions = torch.arange(reuse_from, end, dtype=torch.int64)
        rows = positions - start  # rows of the reused tokens in keys / values
        hidden = model.model.embed_tokens(ids)
        residual = None
        for index, layer in enumerate(self._layers):
            with self._span("flowkv.blend.recompute", {"flowkv.layer": index, "flowkv.tokens": len(rows)}):
                attn = layer.module.self_attn
                if residual is None:
                    residual, normed = hidden, layer.module.input_layernorm(hidden)
                else:
                    normed, residual = layer.module.input_layernorm(hidden, residual)
                qkv, _ = attn.qkv_proj(normed)
                q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
                q, k = attn.rotary_emb(positions, q, k)
                k = k.reshape(len(rows), self._num_kv_heads, self._head_size).to(keys[index].dtype)
                v = v.reshape(len(rows), self._num_kv_heads, self._head_size).to(values[index].dtype)
            if index == check_layer and ratio < 1.0:
                with self._span("flowkv.blend.check", {"flowkv.layer": index, "flowkv.tokens": len(rows)}):
                    deviation = ((k.float() - keys[index][rows].float()).square().sum(dim=(1, 2))
                                 + (v.float() - values[index][rows].float()).square().sum(dim=(1, 2)))
                with self._span("flowkv.blend.select", {"flowkv.recompute_ratio": ratio}) as span:
                    keep = max(1, math.ceil(ratio * len(rows)))
                    selected = torch.sort(torch.topk(deviation, keep).indices).values
                    span.set_attribute("flowkv.selected_tokens", int(keep))
                    # From here on only the selected tokens go on.
                    q, k, v = q[selected], k[selected], v[selected]
                    rows, positions, residual = rows[selected], positions[selected], residual[selected]
            keys[index][rows] = k
            values[index][rows] = v
            if index == len(self._layers) - 1:
                break
            with self._span("flowkv.blend.attend", {"flowkv.layer": index, "flowkv.tokens": len(rows)}):
                fused_keys, fused_values = self._fused(layer, prefix_slots, keys[index], values[index])
                out = causal_attention(q, fused_keys, fused_values, positions, float(attn.attn.impl.scale))
                output, _ = attn.o_proj(out)
                hidden, residual = layer.module.post_attention_layernorm(output, residual)
                hidden = layer.module.mlp(hidden)
        return len(rows)

    def _fused(self, layer: _Layer, prefix_slots: torch.Tensor | None, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's KV of positions ``[0, end)``: the prefix vLLM holds, then the load's tokens."""
        if prefix_slots is None:
            return keys, values
        prefix_keys, prefix_values = self._layout.read_tokens(layer.kv_cache, prefix_slots)
        return torch.cat([prefix_keys, keys]), torch.cat([prefix_values, values])

    # -- helpers ----------------------------------------------------------------------

    def _staged(self, layer: _Layer, kind: int, start: int, end: int) -> torch.Tensor:
        """The staging cache's K (0) or V (1) of positions ``[start, end)``, ``(tokens, heads, head_size)``."""
        return layer.staging[kind].view(-1, self._num_kv_heads, self._head_size)[start:end]

    def _span(self, name: str, attributes: dict[str, Any]) -> Any:
        return self.tracer.start_as_current_span(name, attributes=attributes)
