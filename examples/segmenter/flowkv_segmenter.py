"""A segmenter stage: chunks end at document boundaries, not every ``chunk_size`` tokens.

RAG prompts are documents one after another. With fixed-size chunks, the
chunk that holds the end of document A also holds the start of whatever
follows it, so a later prompt "A, then C" reuses A only up to the last
chunk boundary inside it. This stage cuts a chunk right after every
separator (the token ids that end a document), and splits long documents at
``max_tokens``: "A, then C" then reuses all of A.

Use it in place of ``tokenize`` in the store, retrieve and lookup lists of a
pipeline (see ``rag-segments.toml``)::

    [[store.stages]]
    use = "flowkv_segmenter:segment"
    separator = [271, 198]      # the ids your tokenizer gives "\\n\\n"
    max_tokens = 512

Store and retrieve must use the same segmenter settings: the chunk keys
depend on where chunks end.
"""

from __future__ import annotations

from collections.abc import Iterator

import flowkv
from flowkv.items import Chunk, Request, RunContext


def boundaries(tokens: list[int], separator: list[int], max_tokens: int) -> list[int]:
    """Chunk ends: after each separator, and every ``max_tokens`` inside a long segment."""
    ends: list[int] = []
    start = 0
    width = len(separator)
    i = 0
    while i < len(tokens):
        if i - start + 1 > max_tokens:
            ends.append(i)
            start = i
        if width and tokens[i : i + width] == separator:
            i += width
            ends.append(i)
            start = i
            continue
        i += 1
    if start < len(tokens):
        ends.append(len(tokens))
    return ends


@flowkv.stage("segment", kinds=("store", "retrieve", "lookup"), needs={"request"}, gives={"span"},
              role=flowkv.Role.SEGMENTER)
def segment(
    requests: Iterator[Request],
    *,
    ctx: RunContext,
    separator: list[int],
    max_tokens: int = 512,
) -> Iterator[Chunk]:
    """Cut each request into chunks that end at separators (and at most ``max_tokens`` long).

    In a store, the trailing segment that no separator closes (the question
    after the documents) is not stored unless ``save_partial_chunks`` is on.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    keep_open_tail = ctx.kind != "store" or ctx.services.save_partial_chunks
    # A chunk must fit the largest memory object, which holds chunk_size tokens.
    limit = min(max_tokens, ctx.services.chunk_size)
    for request in requests:
        tokens = request.tokens.tolist()
        ends = boundaries(tokens, list(separator), limit)
        closed = len(tokens) >= len(separator) > 0 and tokens[-len(separator):] == list(separator)
        if ends and not keep_open_tail and not closed:
            ends = ends[:-1]
        masked = request.masked
        start = 0
        for index, end in enumerate(ends):
            yield Chunk(request=request, index=index, start=start, end=end, skip=end <= masked)
            start = end
        ctx.record(chunks=len(ends))
