"""Move KV between the inference engine's paged cache and chunk buffers."""

from __future__ import annotations

from collections.abc import Iterator

from flowkv import kernels
from flowkv.items import Chunk, RunContext
from flowkv.registry import Role, stage


@stage("gather", kinds=("store",), needs={"buffer"}, gives={"kv"}, per_layer=True, role=Role.TRANSFER)
def gather(chunks: Iterator[Chunk], *, ctx: RunContext, impl: str | None = None) -> Iterator[Chunk]:
    """Copy each chunk's KV out of the paged cache (all layers, one kernel call) into its memory object.

    ``impl`` forces the kernel: "torch" or "triton" (CUDA); default picks.

    TOML::

        [[store.stages]]
        use = "gather"
    """
    geometry = ctx.services.geometry
    staging = ctx.services.storage.staging
    layers = None if ctx.layer is None else [ctx.layer]
    probe = kernels.TransferProbe()  # page faults, CPU time, row length: why a transfer ran slow
    for chunk in chunks:
        request = chunk.request
        out = chunk.obj.tensor if layers is None else chunk.obj.tensor[ctx.layer : ctx.layer + 1]
        with probe:
            kernels.gather(request.kv_caches, geometry, request.slot_mapping[chunk.start:chunk.end],
                           out, layers=layers, impl=impl)
        chunk.kv = chunk.obj.tensor
        chunk.layers_done += 1 if layers else geometry.num_layers
        ctx.record(bytes=out.nbytes, tier=staging, **probe.attributes())
        yield chunk


@stage("scatter", kinds=("retrieve",), needs={"kv"}, gives={"loaded"}, per_layer=True,
       role=Role.TRANSFER)
def scatter(chunks: Iterator[Chunk], *, ctx: RunContext, impl: str | None = None) -> Iterator[Chunk]:
    """Write each chunk's KV into the paged cache and mark its tokens in the request's ret_mask.

    TOML::

        [[retrieve.stages]]
        use = "scatter"
    """
    geometry = ctx.services.geometry
    layers = None if ctx.layer is None else [ctx.layer]
    probe = kernels.TransferProbe()
    for chunk in chunks:
        if chunk.skip:
            continue
        if chunk.kv is None:
            raise ValueError(
                f"chunk {chunk.index} reached scatter still encoded; add a 'decompress' stage before 'scatter'"
            )
        request = chunk.request
        kv = chunk.kv if layers is None else chunk.kv[ctx.layer : ctx.layer + 1]
        with probe:
            kernels.scatter(kv, request.kv_caches, geometry,
                            request.slot_mapping[chunk.start:chunk.end], layers=layers, impl=impl)
        if layers is None:
            chunk.layers_done = geometry.num_layers
            request.ret_mask[chunk.start:chunk.end] = True
        else:  # the layerwise run marks ret_mask once every layer of the chunk is in
            chunk.layers_done += 1
        ctx.record(bytes=kv.nbytes, hit_tokens=chunk.num_tokens, tier=chunk.tier, **probe.attributes())
        yield chunk
