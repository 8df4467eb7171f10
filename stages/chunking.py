"""Cut a request into chunks (fixed-size, or segments that end at separators) and key them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

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
    Chunks that carry a ``segment_start`` (the ``segment`` stage with segment
    keys) get segment keys instead: the chain restarts at each segment, so a
    segment's key depends only on its own tokens (`flowkv.keys.segment_hashes`).

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
    starts = [c.segment_start for c in chunks]
    if any(start is not None for start in starts):
        if any(start is None for start in starts):
            raise ValueError("chunk-hash got chunks of one request with and without segment keys")
        keys = services.chunk_keys(chunks[0].request, spans, segment_starts=starts)
    else:
        keys = services.chunk_keys(chunks[0].request, spans)
    for chunk, key in zip(chunks, keys):
        chunk.key = key
        chunk.key_str = key.to_str()
        yield chunk


def segment_ends(tokens: Sequence[int], separator: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """``(segment start, chunk end)`` of every chunk: a segment closes right after each
    separator (its tokens belong to the segment they close, so the chunks leave no
    hole), and a segment longer than ``max_tokens`` is cut into pieces of that size.
    The tokens after the last separator form the last segment.

    >>> segment_ends([1, 2, 7, 7, 3, 4, 5], [7, 7], 100)
    [(0, 4), (4, 7)]
    >>> segment_ends([1, 2, 3, 7, 7, 4], [7, 7], 2)
    [(0, 2), (0, 4), (0, 5), (5, 6)]
    """
    sep = list(separator)
    width = len(sep)
    if width == 0:
        raise ValueError("the separator must hold at least one token id")
    closes: list[int] = []
    i, n = 0, len(tokens)
    while i < n:
        if list(tokens[i:i + width]) == sep:
            i += width
            closes.append(i)
        else:
            i += 1
    if not closes or closes[-1] < n:
        closes.append(n)
    cuts: list[tuple[int, int]] = []
    start = 0
    for end in closes:
        cuts += [(start, min(piece + max_tokens, end)) for piece in range(start, end, max_tokens)]
        start = end
    return cuts


@stage("segment", kinds=("store", "retrieve", "lookup"), needs={"request"}, gives={"span"}, reads=("blend",),
       role=Role.SEGMENTER)
def segment(
    requests: Iterator[Request],
    *,
    ctx: RunContext,
    max_tokens: int | None = None,
    keys: Literal["segment", "chain"] = "segment",
) -> Iterator[Chunk]:
    """Cut each request after every ``[blend] separator``: one segment per document.

    The separator's tokens belong to the segment they close, so the chunks
    cover the request without a hole. A segment longer than ``max_tokens``
    (default and at most ``[pipeline] chunk_size``: a chunk must fit one
    memory object) is cut into pieces. With ``keys = "segment"`` (the
    default) every chunk carries its segment's start and ``chunk-hash`` keys it
    by that segment's tokens alone, so a document hashes alike wherever it sits;
    ``keys = "chain"`` keeps the prefix chain over these boundaries. In a
    store the last segment, which no separator closes (the question), is
    kept only with ``save_partial_chunks``.

    TOML::

        [blend]
        separator = [271, 198]

        [[store.stages]]
        use = "segment"

        [[store.stages]]
        use = "chunk-hash"
    """
    services = ctx.services
    if services is None or services.blend is None:
        raise ValueError("stage 'segment' needs the pipeline's [blend] table (its separator)")
    separator = list(services.blend.separator)
    limit = services.chunk_size if max_tokens is None else min(max_tokens, services.chunk_size)
    if limit <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    keep_open_tail = ctx.kind != "store" or services.save_partial_chunks
    width = len(separator)
    for request in requests:
        if request.tokens is None:
            raise ValueError("stage 'segment' cuts at separator tokens: this request came as chunk hashes, "
                             "without its tokens")
        tokens = request.tokens.tolist()
        cuts = segment_ends(tokens, separator, limit)
        closed = len(tokens) >= width and tokens[len(tokens) - width:] == separator
        if cuts and not keep_open_tail and not closed:
            open_start = cuts[-1][0]
            cuts = [cut for cut in cuts if cut[0] != open_start]
        masked = request.masked
        start = 0
        for index, (segment_start, end) in enumerate(cuts):
            yield Chunk(request=request, index=index, start=start, end=end, skip=end <= masked,
                        segment_start=segment_start if keys == "segment" else None)
            start = end
        ctx.record(chunks=len(cuts))
