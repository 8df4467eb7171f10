"""Encode chunks for storage, and decode them back; corrupt data never reaches the model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from flowkv import payload as payloads
from flowkv.codecs import prefix_window
from flowkv.items import Chunk, RunContext
from flowkv.registry import Role, stage


@attrs.frozen(kw_only=True)
class CompressConfig:
    """Settings of ``compress``: the codec and whichever of its parameters are set."""

    codec: str = "none"
    level: int | None = None  # zstd, zstd-shuffle
    acceleration: int | None = None  # lz4, lz4-shuffle
    group_size: int | None = None  # fp8, int8, int4: channels per scale group (0 = per token/head)
    key_group_size: int | None = None  # int8, int4: tokens per key group (0 = the whole chunk)
    scale_dtype: str | None = None  # int8, int4: "fp32" or "fp16" scales and zero points
    scaling: str | None = None  # fp8: "token" or "channel" (keys per channel)
    window: int | None = None  # fp8, int8, int4: the last N tokens of each stored prefix stay exact

    def params(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if k != "codec" and v is not None}

    def __attrs_post_init__(self) -> None:
        # Checked when the pipeline loads, so a wrong codec or parameter names its TOML line.
        from flowkv import codecs

        codecs.get_codec(self.codec).resolve_params(**self.params())


def _lossy(config: CompressConfig) -> bool:
    from flowkv import codecs

    return not codecs.get_codec(config.codec).lossless


@stage("compress", kinds=("store", "server"), needs={"kv"}, gives={"payload"}, config=CompressConfig, role=Role.CODEC,
       lossy=_lossy, encodings=lambda config: [(config.codec, config.params())])
def compress(chunks: Iterator[Chunk], *, ctx: RunContext, config: CompressConfig) -> Iterator[Chunk]:
    """Encode each chunk's KV with ``codec`` (a header with a checksum, then the body).

    Codecs: ``none`` (the chunk stays raw; byte tiers get a plain payload),
    ``lz4``, ``lz4-shuffle`` (``acceleration``), ``zstd``, ``zstd-shuffle``
    (``level``), and the lossy ``fp8`` (``group_size``, ``scaling``),
    ``int8``, ``int4`` (``group_size``, ``key_group_size``, ``scale_dtype``);
    with a lossy codec, ``window = N`` keeps the last N tokens of each stored
    prefix exact (`flowkv.codecs.prefix_window`). On an engine that packs
    tokens inside its blocks (vLLM's CPU cache) a lossy codec quantizes the
    chunk's true tokens (`encode_chunk`). Tiers that a later ``put`` writes get the encoded
    payload; ``flowkv bench codecs`` measures them on real KV. A chunk that
    comes encoded already (a node server's, committed by a client that
    compressed it) passes as it is.

    TOML::

        [[store.stages]]
        use = "compress"
        codec = "zstd-shuffle"
        level = 1
    """
    params = config.params()
    for chunk in chunks:
        if chunk.kv is None:
            yield chunk
            continue
        # A segment's KV was computed where it sat: record it (memory: the object's
        # meta; byte tiers: the payload header), so a load elsewhere re-rotates its keys.
        start = chunk.start if chunk.segment_start is not None else None
        if start is not None and chunk.obj is not None:
            chunk.obj.meta["start_position"] = start
        if config.codec != "none":
            if config.window:
                params["window"] = prefix_window(config.window, chunk.start, chunk.end,
                                                 stored_end(ctx.services, chunk.request))
            chunk.payload = encode_chunk(chunk, ctx.services, config.codec, params, segment_start=start)
            ctx.record(bytes=len(chunk.payload))
        yield chunk


def encode_chunk(chunk: Chunk, services: Any, codec: str, params: dict[str, Any], *,
                 segment_start: int | None = None) -> bytes:
    """``chunk``'s KV as a payload of ``codec``. A lossy codec gets the chunk's true tokens when the
    engine packs its blocks (``services.packing``) and the chunk is whole blocks of it: its key
    channels and value tokens, not the packed bytes a block's rows hold."""
    packing = services.packing if services is not None else None
    if packing is not None and chunk.start % packing.block_size:
        packing = None
    return payloads.encode(chunk.kv, codec, key=chunk.key_str, segment_start=segment_start, packing=packing,
                           **params)


def stored_end(services: Any, request: Any) -> int:
    """Where the prefix a store run keeps ends: its last chunk's end (``tokenize``'s chunks)."""
    if services.save_partial_chunks:
        return request.num_tokens
    return request.num_tokens - request.num_tokens % services.chunk_size


@stage("decompress", kinds=("retrieve",), needs={"payload"}, gives={"kv"}, role=Role.CODEC)
def decompress(chunks: Iterator[Chunk], *, ctx: RunContext) -> Iterator[Chunk]:
    """Decode each encoded chunk, checking its header and checksum; raw chunks pass.

    A chunk that comes with a room for its KV (``chunk.obj`` holding no
    payload: a byte-tier hit being promoted into memory, in an engine's
    ``flowkv.promote`` run) is decoded into it; any other into a new tensor.
    A payload of true tokens is packed back into the engine's blocks
    (``services.packing``). A payload that fails any check (corrupt,
    truncated, another codec or shape, true tokens and no packing) is a
    miss: it is dropped from its tier, counted, and the run ends
    there so the mask keeps only the good prefix.

    TOML::

        [[retrieve.stages]]
        use = "decompress"
    """
    services = ctx.services
    dtype = services.geometry.dtype
    for chunk in chunks:
        if chunk.skip or chunk.kv is not None:
            yield chunk
            continue
        room = chunk.obj if chunk.obj is not None and "codec" not in chunk.obj.meta else None
        try:
            if room is not None:
                chunk.kv = payloads.decode_into(chunk.payload, room.tensor, expect_key=chunk.key_str,
                                                packing=services.packing)
            else:
                chunk.kv = payloads.decode(
                    chunk.payload,
                    expect_shape=services.chunk_shape(chunk.num_tokens),
                    expect_dtype=dtype,
                    expect_key=chunk.key_str,
                    packing=services.packing,
                )
        except payloads.PayloadError as exc:
            services.storage.discard(chunk.key_str, chunk.tier, exc)
            chunk.request.fail_from(chunk)
            ctx.record(stopped=f"corrupt payload for chunk {chunk.index}: {exc}")
            return
        ctx.record(bytes=chunk.kv.nbytes)
        yield chunk
