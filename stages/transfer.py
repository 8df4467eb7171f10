"""Move KV between the inference engine's paged cache and chunk buffers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from flowkv import kernels
from flowkv.items import Chunk, RunContext
from flowkv.registry import Role, stage


@stage("gather", kinds=("store",), needs={"buffer"}, gives={"kv"}, per_layer=True, role=Role.TRANSFER)
def gather(chunks: Iterator[Chunk], *, ctx: RunContext, impl: str | None = None,
           batch: bool = True) -> Iterator[Chunk]:
    """Copy each chunk's KV out of the paged cache into its memory object.

    With ``batch`` (the default) the run's chunks move together: memory
    objects that follow each other in the arena (a request's chunks, allocated
    back to back) are filled by one kernel call over all of them and all
    layers (`flowkv.kernels.gather_many`), instead of one call per chunk.
    That takes every chunk's room before the first is copied; a pipeline that
    compresses in memory sets ``batch = false``, so each chunk gives back what
    compression saved before the next one's room is taken (a full arena then
    holds more). ``impl`` forces the kernel: "torch" or "triton" (CUDA);
    default picks.

    TOML::

        [[store.stages]]
        use = "gather"
    """
    geometry = ctx.services.geometry
    staging = ctx.services.storage.staging
    layers = None if ctx.layer is None else [ctx.layer]
    probe = kernels.TransferProbe()  # page faults, CPU time, row length: why a transfer ran slow
    for run in _by_request(chunks) if batch else ([chunk] for chunk in chunks):
        request = run[0].request
        outs = [chunk.obj.tensor if layers is None else chunk.obj.tensor[ctx.layer : ctx.layer + 1]
                for chunk in run]
        with probe:
            kernels.gather_many(request.kv_caches, geometry,
                                [(request.slot_mapping[chunk.start:chunk.end], out) for chunk, out in zip(run, outs)],
                                layers=layers, impl=impl)
        for chunk, out in zip(run, outs):
            chunk.kv = chunk.obj.tensor
            chunk.layers_done += 1 if layers else geometry.num_layers
            ctx.record(bytes=out.nbytes, tier=staging, **probe.attributes())
            yield chunk


@stage("scatter", kinds=("retrieve",), needs={"kv"}, gives={"loaded"}, per_layer=True,
       role=Role.TRANSFER)
def scatter(chunks: Iterator[Chunk], *, ctx: RunContext, impl: str | None = None) -> Iterator[Chunk]:
    """Write each chunk's KV into the paged cache and mark its tokens in the request's ret_mask.

    The run's chunks move together, as ``gather``'s do (one kernel call for
    chunks that follow each other in memory).

    TOML::

        [[retrieve.stages]]
        use = "scatter"
    """
    geometry = ctx.services.geometry
    layers = None if ctx.layer is None else [ctx.layer]
    probe = kernels.TransferProbe()
    for run in _by_request(chunk for chunk in chunks if not chunk.skip):
        for chunk in run:
            if chunk.kv is None:
                raise ValueError(
                    f"chunk {chunk.index} reached scatter still encoded; add a 'decompress' stage before 'scatter'"
                )
        request = run[0].request
        kvs = [chunk.kv if layers is None else chunk.kv[ctx.layer : ctx.layer + 1] for chunk in run]
        with probe:
            kernels.scatter_many([(request.slot_mapping[chunk.start:chunk.end], kv) for chunk, kv in zip(run, kvs)],
                                 request.kv_caches, geometry, layers=layers, impl=impl)
        for chunk, kv in zip(run, kvs):
            if layers is None:
                chunk.layers_done = geometry.num_layers
                request.ret_mask[chunk.start:chunk.end] = True
            else:  # the layerwise run marks ret_mask once every layer of the chunk is in
                chunk.layers_done += 1
            ctx.record(bytes=kv.nbytes, hit_tokens=chunk.num_tokens, tier=chunk.tier, **probe.attributes())
            yield chunk


def _by_request(chunks: Iterable[Chunk]) -> Iterator[list[Chunk]]:
    """The run's chunks in runs of one request each, in order: each run moves in one kernel call.

    It reads the whole run first: upstream stages (allocate, get) stop where memory or
    the hit ends, so what arrives is what moves.
    """
    batch: list[Chunk] = []
    for chunk in chunks:
        if batch and chunk.request is not batch[0].request:
            yield batch
            batch = []
        batch.append(chunk)
    if batch:
        yield batch
