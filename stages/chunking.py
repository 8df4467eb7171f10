"""Cut a request into chunks and give each chunk its chained key."""

from __future__ import annotations

from collections.abc import Iterator

from flowkv.items import Chunk, Request, RunContext
from flowkv.registry import stage


@stage("tokenize", kinds=("store", "retrieve", "lookup"), needs={"request"}, gives={"span"})
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
    engine = ctx.engine
    size = engine.chunk_size
    partial = ctx.kind != "store" or engine.save_partial_chunks
    for request in requests:
        total = request.num_tokens
        masked = engine.masked_prefix(request)
        ends = list(range(size, total + 1, size))
        if partial and total % size:
            ends.append(total)
        start = 0
        chunks = 0
        for index, end in enumerate(ends):
            chunks += 1
            yield Chunk(request=request, index=index, start=start, end=end, skip=end <= masked)
            start = end
        ctx.record(chunks=chunks)


@stage("chunk-hash", kinds=("store", "retrieve", "lookup"), needs={"span"}, gives={"key"})
def chunk_hash(chunks: Iterator[Chunk], *, ctx: RunContext) -> Iterator[Chunk]:
    """Give every chunk its key: the chained hash of its tokens under the request's key prefix.

    The whole request is hashed in one call when its first chunk arrives
    (a chunk's hash depends on every chunk before it), with the hash function
    named by ``[pipeline] hash``.

    TOML::

        [[store.stages]]
        use = "chunk-hash"
    """
    engine = ctx.engine
    request = None
    keys: list = []
    for chunk in chunks:
        if chunk.request is not request:
            request = chunk.request
            keys = engine.chunk_keys(request)
        key = keys[chunk.index]
        chunk.key = key
        chunk.key_str = key.to_str()
        yield chunk
