"""Encode chunks for storage, and decode them back; corrupt data never reaches the model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flowkv import payload as payloads
from flowkv.items import Chunk, RunContext
from flowkv.registry import stage


@stage("compress", kinds=("store",), needs={"kv"}, gives={"payload"})
def compress(
    chunks: Iterator[Chunk],
    *,
    ctx: RunContext,
    codec: str = "none",
    level: int | None = None,
) -> Iterator[Chunk]:
    """Encode each chunk's KV with ``codec`` (a header with a checksum, then the body).

    Codecs: ``none`` (the chunk stays raw; byte tiers get a plain payload),
    ``lz4``, ``zstd`` (``level``), ``lz4-shuffle``, ``zstd-shuffle``, and the
    lossy ``fp8``, ``int8``, ``int4``. Tiers that a later ``put`` writes get
    the encoded payload.

    TOML::

        [[store.stages]]
        use = "compress"
        codec = "zstd"
        level = 3
    """
    params: dict[str, Any] = {} if level is None else {"level": level}
    payloads.encode  # noqa: B018 - fail at first use, not per chunk, if the module is broken
    if codec != "none":
        from flowkv import codecs

        codecs.get_codec(codec)  # an unknown codec fails the first run, naming this stage
    for chunk in chunks:
        if codec != "none":
            chunk.payload = payloads.encode(chunk.kv, codec, **params)
            ctx.record(bytes=len(chunk.payload))
        yield chunk


@stage("decompress", kinds=("retrieve",), needs={"payload"}, gives={"kv"})
def decompress(chunks: Iterator[Chunk], *, ctx: RunContext) -> Iterator[Chunk]:
    """Decode each encoded chunk, checking its header and checksum; raw chunks pass.

    A payload that fails any check (corrupt, truncated, another codec or
    shape) is a miss: it is dropped from its tier, counted, and the run ends
    there so the mask keeps only the good prefix.

    TOML::

        [[retrieve.stages]]
        use = "decompress"
    """
    engine = ctx.engine
    for chunk in chunks:
        if chunk.skip or chunk.kv is not None:
            yield chunk
            continue
        try:
            chunk.kv = payloads.decode(
                chunk.payload,
                expect_shape=engine.chunk_shape(chunk),
                expect_dtype=engine.geometry.dtype,
            )
        except payloads.PayloadError as exc:
            engine.discard_corrupt(chunk, exc)
            request = chunk.request
            request.failed_range = (chunk.start, max(request.hit_tokens or 0, chunk.end))
            ctx.record(stopped=f"corrupt payload for chunk {chunk.index}: {exc}")
            return
        ctx.record(bytes=chunk.kv.nbytes)
        yield chunk
