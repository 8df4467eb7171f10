"""CacheBlend in the vLLM worker: documents loaded wherever they sit, a share of their tokens recomputed.

A blend pipeline keys each document (segment) by its own tokens, so a load
may bring KV computed at another position and next to other documents. The
worker then, for each load, in ``start_load_kv`` (synchronously, before the
forward pass that reads it):

1. **load**: the engine retrieves the segments into a staging cache of true
   tokens (``flash_kv_nhd``; one slot per position of the transfer's window,
   from the block holding its first token): vLLM's CPU blocks are packed per
   ISA, and segments start and end inside blocks. The staging cache is as large
   as the largest load or save so far (``window``), not ``max_model_len``;
2. **re-rotate**: keys of a segment stored at another position are turned
   by the position delta with the layer's own ``rotary_emb``;
3. **recompute**: the reused tokens (all but an exact prefix: tokens vLLM
   computed, and the first segment when it sits where it was stored) run
   through the model's own modules. Layers before the first check layer and
   the first check layer recompute every reused token (and keep what they
   recompute); each check layer (``check_layers``) keeps the tokens whose K/V
   deviates most from the loaded K/V, narrowing to the ``recompute_ratio``
   share at the last one (``ratio ** (i / n)`` after the i-th of n), and only
   those go on, layer by layer, attending over the fused KV
   (exact prefix, loaded segments, tokens recomputed so far). vLLM's ``attn``
   modules are never called (they write vLLM's cache and re-enter the
   connector's hooks), and weights are never read (vLLM's CPU backend empties
   them after packing);
4. **write**: each layer's fused K/V goes into vLLM's blocks through vLLM's
   own cache-write op (``cpu_packing.write_tokens``) as soon as the layer is
   recomputed; the attention of the tokens that go on then reads it there,
   through vLLM's own CPU attention op at ``attn.impl.scale``
   (``cpu_packing.packed_attention``: each run of consecutive selected
   positions one causal sequence, a lone one a decode). Layers no recompute
   reached are written at the end.

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
``flowkv.blend.stage`` (saves), ``.rerotate``, ``.recompute``, ``.write`` and
``.attend`` (per layer), ``.check``, ``.select``, and a last ``.write`` for the
layers no recompute reached.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from opentelemetry import trace

from flowkv.integration.vllm.cpu_packing import packed_attention, packed_layout, write_tokens
from flowkv.integration.vllm.metadata import ceil_to, slot_mapping
from flowkv.integration.vllm.models import BLENDABLE_ARCHITECTURES, loaded_model
from flowkv.integration.vllm.rope import rerotate_with
from flowkv.kernels import KVGeometry
from flowkv.stages.chunking import segment_ends

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from flowkv.pipeline_model import BlendSpec, Pipeline

logger = logging.getLogger("flowkv.integration")

__all__ = ["BlendCounts", "Blender", "refuse_unblendable"]


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


@dataclass
class BlendCounts:
    """What one blend did: tokens loaded from segments, and of them the ones recomputed past the check."""

    reused: int = 0
    recomputed: int = 0


@dataclass
class _Layer:
    """One decoder layer's modules, and its KV cache in vLLM (packed)."""

    module: Any  # LlamaDecoderLayer / Qwen2DecoderLayer
    kv_cache: torch.Tensor


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
        self._max_blocks = ceil_to(vllm_config.model_config.max_model_len, block_size) // block_size
        by_name = {}
        for module in model.model.layers:
            by_name[module.self_attn.attn.layer_name] = module
        self._layers: list[_Layer] = []
        for name, kv_cache in kv_caches.items():
            if name not in by_name:
                raise RuntimeError(f"flowkv: vLLM's KV cache names layer {name!r}, which the model has not")
            _refuse_variant(by_name[name], name)
            self._layers.append(_Layer(module=by_name[name], kv_cache=kv_cache))
        self.geometry = KVGeometry("flash_kv_nhd", num_layers=len(self._layers), num_kv_heads=num_kv_heads,
                                   head_size=head_size, block_size=block_size, dtype=first.dtype)
        #: the staging cache, one ``(2, blocks, block_size, heads, head_size)`` tensor per layer, where the
        #: engine loads and stores; grown in place (this list) by `window`
        self.staging = [torch.empty(2, 0, block_size, num_kv_heads, head_size, dtype=first.dtype)
                        for _ in self._layers]
        self._base = 0  # the position the staging cache's first slot holds (the window's first block)
        self._reported_tokens = 0  # the staging cache's size as `staging_growth` last told it
        self._num_kv_heads, self._head_size = num_kv_heads, head_size

    def window(self, start: int, end: int) -> list[int]:
        """Make the staging cache the window of positions from the block holding ``start`` to ``end``
        (growing it if it is smaller); the block ids that put a position's slot there, for
        ``slot_mapping`` (the ids of blocks before the window are never used)."""
        first = start // self._block_size
        blocks = ceil_to(end, self._block_size) // self._block_size - first
        if blocks > self.staging[0].shape[1]:
            # Grown to the largest window so far (with room to spare), never past max_model_len.
            size = min(max(blocks, self.staging[0].shape[1] * 3 // 2), max(blocks, self._max_blocks))
            self.staging[:] = [torch.empty(2, size, *staged.shape[2:], dtype=staged.dtype) for staged in self.staging]
        self._base = first * self._block_size
        return [0] * first + list(range(blocks))

    def staging_growth(self) -> int:
        """Tokens the staging cache grew by since the last call (their sum: its size)."""
        size = self.staging[0].shape[1] * self._block_size
        grown, self._reported_tokens = size - self._reported_tokens, size
        return grown

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
        start = max(start, self._base)  # before the save's window: not stored, so not staged
        if start >= end:
            return
        slots = slot_mapping(block_ids, self._block_size, start, end - start, start, end)
        with torch.inference_mode(), self._span("flowkv.blend.stage", {"flowkv.tokens": end - start}):
            for index, layer in enumerate(self._layers):
                keys, values = self._layout.read_tokens(layer.kv_cache, slots)
                self._staged(index, 0, start, end).copy_(keys)
                self._staged(index, 1, start, end).copy_(values)

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
        # Worked on in place: nothing reads the staging cache after the blend.
        keys = [self._staged(index, 0, start, end) for index in range(len(self._layers))]
        values = [self._staged(index, 1, start, end) for index in range(len(self._layers))]
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
        slots = slot_mapping(block_ids, self._block_size, start, end - start, start, end)
        written = 0  # layers whose fused KV is in vLLM's blocks
        if ratio > 0 and reuse_from < end:
            counts.recomputed, written = self._recompute(token_ids, block_ids, slots, start, reuse_from, end, keys,
                                                         values, ratio)
        with self._span("flowkv.blend.write", {"flowkv.tokens": end - start,
                                               "flowkv.layers": len(self._layers) - written,
                                               "flowkv.blend.reused_tokens": counts.reused,
                                               "flowkv.blend.recomputed_tokens": counts.recomputed}):
            for layer, layer_keys, layer_values in zip(self._layers[written:], keys[written:], values[written:]):
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

    def _recompute(self, token_ids: Sequence[int], block_ids: list[int], slots: torch.Tensor, start: int,
                   reuse_from: int, end: int, keys: list[torch.Tensor], values: list[torch.Tensor],
                   ratio: float) -> tuple[int, int]:
        """Recompute reused tokens ``[reuse_from, end)`` into ``keys`` / ``values`` (the loaded
        ``[start, end)``, at ``slots`` of vLLM's blocks), layer by layer, writing each layer's fused
        KV into vLLM's blocks; the number of tokens selected at the last check layer, and of layers written.

        Each of the ``n`` check layers keeps the reused tokens whose K/V deviate most from the loaded
        ones, narrowing gradually: after the i-th, ``ratio ** (i / n)`` of them go on (one check layer:
        ``ratio``)."""
        model = self._model
        checks = [] if ratio >= 1.0 else sorted({min(layer, len(self._layers) - 1)
                                                 for layer in self._blend.check_layers})
        ids = torch.tensor(list(token_ids[reuse_from:end]), dtype=torch.int64)
        positions = torch.arange(reuse_from, end, dtype=torch.int64)
        rows = positions - start  # rows of the reused tokens in keys / values
        reused = len(rows)
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
            if index in checks:
                with self._span("flowkv.blend.check", {"flowkv.layer": index, "flowkv.tokens": len(rows)}):
                    deviation = ((k.float() - keys[index][rows].float()).square().sum(dim=(1, 2))
                                 + (v.float() - values[index][rows].float()).square().sum(dim=(1, 2)))
            # Every token that got here has this layer's K/V recomputed, and kept (up to the first check
            # every layer recomputed them all: at a check layer they are a full prefill's, not the loaded ones).
            keys[index][rows] = k
            values[index][rows] = v
            if index in checks:
                with self._span("flowkv.blend.select", {"flowkv.recompute_ratio": ratio}) as span:
                    share = ratio ** ((checks.index(index) + 1) / len(checks))
                    keep = min(len(rows), max(1, math.ceil(share * reused)))
                    selected = torch.sort(torch.topk(deviation, keep).indices).values
                    span.set_attribute("flowkv.selected_tokens", int(keep))
                    # From here on only the selected tokens go on.
                    q, k, v = q[selected], k[selected], v[selected]
                    rows, positions, residual = rows[selected], positions[selected], residual[selected]
            with self._span("flowkv.blend.write", {"flowkv.layer": index, "flowkv.tokens": end - start}):
                # The fused KV of this layer (vLLM's prefix is there already): what the attention reads.
                write_tokens(self._layout, layer.kv_cache, slots, keys[index], values[index])
            if index == len(self._layers) - 1:
                break
            with self._span("flowkv.blend.attend", {"flowkv.layer": index, "flowkv.tokens": len(rows)}):
                queries = q.reshape(len(rows), -1, self._head_size).to(layer.kv_cache.dtype)
                out = packed_attention(queries, layer.kv_cache, block_ids, positions,
                                       scale=float(attn.attn.impl.scale), isa=self._layout.isa)
                output, _ = attn.o_proj(out.view(len(rows), -1).to(q.dtype))
                hidden, residual = layer.module.post_attention_layernorm(output, residual)
                hidden = layer.module.mlp(hidden)
        return len(rows), index + 1

    # -- helpers ----------------------------------------------------------------------

    def _staged(self, layer: int, kind: int, start: int, end: int) -> torch.Tensor:
        """Layer ``layer``'s K (0) or V (1) of positions ``[start, end)`` in the staging cache's window,
        ``(tokens, heads, head_size)``."""
        tokens = self.staging[layer][kind].view(-1, self._num_kv_heads, self._head_size)
        return tokens[start - self._base:end - self._base]

    def _span(self, name: str, attributes: dict[str, Any]) -> Any:
        return self.tracer.start_as_current_span(name, attributes=attributes)
