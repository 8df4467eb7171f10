"""Move KV between the inference engine's paged cache and chunk buffers."""

from __future__ import annotations

from collections.abc import Iterator

from flowkv import kernels
from flowkv.items import Chunk, RunContext
from flowkv.registry import stage


@stage("gather", kinds=("store",), needs={"buffer"}, gives={"kv"})
def gather(chunks: Iterator[Chunk], *, ctx: RunContext, impl: str | None = None) -> Iterator[Chunk]:
    """Copy each chunk's KV out of the paged cache (all layers, one kernel call) into its slab.

    ``impl`` forces the kernel: "torch" or "triton" (CUDA); default picks.

    TOML::

        [[store.stages]]
        use = "gather"
    """
    engine = ctx.engine
    for chunk in chunks:
        request = chunk.request
        out = chunk.obj.tensor
        kernels.gather(request.kv_caches, engine.geometry, request.slot_mapping[chunk.start:chunk.end],
                       out, layers=engine.layers_of(chunk), impl=impl)
        chunk.kv = out
        ctx.record(bytes=out.nbytes)
        yield chunk


@stage("scatter", kinds=("retrieve",), needs={"kv"}, gives={"loaded"})
def scatter(chunks: Iterator[Chunk], *, ctx: RunContext, impl: str | None = None) -> Iterator[Chunk]:
    """Write each chunk's KV into the paged cache and mark its tokens in the request's ret_mask.

    TOML::

        [[retrieve.stages]]
        use = "scatter"
    """
    engine = ctx.engine
    for chunk in chunks:
        if chunk.skip:
            continue
        if chunk.kv is None:
            raise ValueError(
                f"chunk {chunk.index} reached scatter still encoded; add a 'decompress' stage before 'scatter'"
            )
        request = chunk.request
        kernels.scatter(chunk.kv, request.kv_caches, engine.geometry,
                        request.slot_mapping[chunk.start:chunk.end], layers=engine.layers_of(chunk), impl=impl)
        request.ret_mask[chunk.start:chunk.end] = True
        ctx.record(bytes=chunk.kv.nbytes, hit_tokens=chunk.num_tokens)
        yield chunk
