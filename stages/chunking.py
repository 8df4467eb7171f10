"""Cut a request into chunks and give each chunk its chained key."""

from __future__ import annotations

from collections.abc import Iterator

from flowkv.items import Chunk, Request, RunContext, Services
from flowkv.keys import chunk_spans
from flowkv.registry import Role, stage


@stage("tokenize", kinds=("store", "retrieve", "lookup"), needs={"request"}, gives={"span"},
       role=Role.CHUNKER, accepts_hashes=True)
def tokenize(requests: Iterator[Request], *, ctx: RunContext) -> Iterator[Chunk]:
    """Cut each request's tokens into chunks of the pipeline's ``chunk_size``.

    Chunks inside the request's ``mask`` (the prefix the inference engine
    already holds) come out with ``skip`` set: they stay in the hash chain but
    move no data. A last partial chunk comes out only in retrieve and lookup,
    or in store when ``[pipeline] save_partial_chunks`` is on.

    TOML::

        [[store.stages]]
        use = "tokenize"
    """
    services = ctx.services
    size = services.chunk_size
    partial = ctx.kind != "store" or services.save_partial_chunks
    for request in requests:
        masked = request.masked
        spans = chunk_spans(request.num_tokens, size, save_partial=partial)
        for index, (start, end) in enumerate(spans):
            yield Chunk(request=request, index=index, start=start, end=end, skip=end <= masked)
        ctx.record(chunks=len(spans))


@stage("chunk-hash", kinds=("store", "retrieve", "lookup"), needs={"span"}, gives={"key"},
       role=Role.KEYER, accepts_hashes=True)
def chunk_hash(chunks: Iterator[Chunk], *, ctx: RunContext) -> Iterator[Chunk]:
    """Give every chunk its key: the chained hash of its tokens under the request's key prefix.

    A chunk's hash depends on every chunk before it, so each request's chunks
    are hashed together in one call, with the hash function named by
    ``[pipeline] hash``. Chunks need not be ``chunk_size`` long: a segmenter
    before this stage may cut them anywhere, as long as they are consecutive.

    TOML::

        [[store.stages]]
        use = "chunk-hash"
    """
    services = ctx.services
    batch: list[Chunk] = []
    for chunk in chunks:
        if batch and chunk.request is not batch[0].request:
            yield from _keyed(services, batch)
            batch = []
        batch.append(chunk)
    yield from _keyed(services, batch)


def _keyed(services: Services, chunks: list[Chunk]) -> Iterator[Chunk]:
    if not chunks:
        return
    spans = [(c.start, c.end) for c in chunks]
    if spans[0][0] != 0:
        raise ValueError(f"chunk-hash got chunks starting at token {spans[0][0]}; the chain starts at 0")
    keys = services.chunk_keys(chunks[0].request, spans)
    for chunk, key in zip(chunks, keys):
        chunk.key = key
        chunk.key_str = key.to_str()
        yield chunk
