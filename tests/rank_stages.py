"""A stage for the tensor-parallel tests: one rank of an instance keeps less of a request than the others.

It lives in a module of its own so that ``vllm serve``'s worker processes can
import it (``PYTHONPATH`` names ``tests/``) without importing a test module.
"""

from __future__ import annotations

from collections.abc import Iterator

from flowkv import stage
from flowkv.items import Chunk
from flowkv.keys import CacheKey

RANK_GAP_TAG = "test_rank_gap"  # "RANK:CHUNK": that rank stores none of the request's chunks from CHUNK on


@stage("test-rank-gap", kinds=("store",), needs={"key"}, gives={"key"})
def rank_gap(chunks: Iterator[Chunk], *, ctx) -> Iterator[Chunk]:
    """Store nothing from a chunk on for requests tagged ``test_rank_gap`` ``"RANK:CHUNK"``, on that rank only:
    what a rank-local miss looks like (that rank's entries gone, the other ranks' there). Requests without
    the tag pass untouched.

    TOML::

        [[store.stages]]
        use = "rank_stages:rank_gap"
    """
    for chunk in chunks:
        target = chunk.request.tags.get(RANK_GAP_TAG)
        if target is not None and chunk.key_str is not None:
            rank, first = (int(part) for part in target.split(":"))
            if CacheKey.from_str(chunk.key_str).prefix.worker_rank == rank and chunk.index >= first:
                return
        yield chunk
