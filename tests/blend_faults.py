"""A fault the CacheBlend tests inject inside vLLM's worker: a segment payload corrupted on its way from the tier."""

from __future__ import annotations

from collections.abc import Iterator

from flowkv import stage
from flowkv.items import Chunk

CORRUPT_TAG = "test_corrupt_chunk"


@stage("test-corrupt-chunk", kinds=("retrieve",), needs={"payload"}, gives={"payload"})
def corrupt_chunk(chunks: Iterator[Chunk], *, ctx) -> Iterator[Chunk]:
    """Flip the last byte (KV body) of one chunk's payload after ``get`` read it, before ``decompress``.

    The chunk is the one whose index the request's ``test_corrupt_chunk`` tag
    names: what a bit flipped in a tier looks like to the rest of the
    retrieve pipeline. The tier's copy is left alone (the payload is copied
    first). Requests without the tag pass untouched.

    TOML::

        [[retrieve.stages]]
        use = "blend_faults:corrupt_chunk"
    """
    for chunk in chunks:
        target = chunk.request.tags.get(CORRUPT_TAG)
        if target is not None and chunk.index == int(target) and chunk.payload is not None:
            flipped = bytearray(chunk.payload)
            flipped[-1] ^= 0xFF
            chunk.payload = bytes(flipped)
        yield chunk
