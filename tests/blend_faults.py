"""A fault the CacheBlend tests inject inside vLLM's worker: a segment payload corrupted on its way from the tier."""

from __future__ import annotations

from collections.abc import Iterator

from flowkv import payload as payloads
from flowkv import stage
from flowkv.items import Chunk

CORRUPT_TAG = "test_corrupt_chunk"


@stage("test-corrupt-chunk", kinds=("retrieve",), needs={"hit"}, gives={"payload"})
def corrupt_chunk(chunks: Iterator[Chunk], *, ctx) -> Iterator[Chunk]:
    """Hand ``decompress`` a corrupt payload for one chunk, after ``get`` read it.

    The chunk is the one whose index the request's ``test_corrupt_chunk`` tag
    names: what a bit flipped in a tier looks like to the rest of the
    retrieve pipeline. A memory tier hands over tensors, not bytes: their
    payload (as ``compress`` writes it, bound to the chunk's key) stands in,
    with its last byte (KV body) flipped. Requests without the tag pass
    untouched.

    TOML::

        [[retrieve.stages]]
        use = "blend_faults:corrupt_chunk"
    """
    for chunk in chunks:
        target = chunk.request.tags.get(CORRUPT_TAG)
        if target is not None and chunk.index == int(target) and not chunk.skip:
            payload = chunk.payload if chunk.kv is None else payloads.encode(chunk.kv, key=chunk.key_str)
            flipped = bytearray(payload)
            flipped[-1] ^= 0xFF
            chunk.payload, chunk.kv = bytes(flipped), None
        yield chunk
