"""Stages that talk to tiers: allocate and put on the store side, lookup and get on retrieve.

Tiers are walked in the order the pipeline file declares them. The memory
tier holds ``MemoryObj``s (raw KV, or an encoded payload when a codec ran
before ``put``); slower tiers hold encoded payloads and are reached through
the engine, which bounds every call and skips a tier that fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import attrs

from flowkv.items import Chunk, RunContext
from flowkv.registry import stage, tier


@attrs.frozen(kw_only=True)
class MemoryTierConfig:
    """``[tiers.NAME] kind = "memory"``: a pre-allocated arena; each entry costs its bytes in 4 KiB pages."""

    capacity: int = 1 << 30  # bytes; "4GiB" in the file
    eviction: Literal["lru"] = "lru"
    # Page-lock the arena when CUDA is present, for fast asynchronous copies.
    pin_memory: bool = True
    # Make the arena's pages resident before stores write them (flowkv/resident.py):
    # "background" (after start), "now" (before the engine starts) or "off".
    prefault: Literal["background", "now", "off"] = "background"


@tier("memory", config=MemoryTierConfig)
class MemoryTierKind:
    """The memory tier's registry entry; the engine builds the arena from the KV geometry."""


@stage("allocate", kinds=("store",), needs={"key"}, gives={"buffer"})
def allocate(chunks: Iterator[Chunk], *, ctx: RunContext) -> Iterator[Chunk]:
    """Give each chunk to store room in memory for its raw KV; stop the run when memory is full.

    Chunks the engine already holds (masked) or the memory tier already has
    are dropped. When there is no room even after eviction, the run stops and
    keeps what it stored so far (backpressure: never wait on memory).

    TOML::

        [[store.stages]]
        use = "allocate"
    """
    engine = ctx.engine
    memory = engine.memory
    for chunk in chunks:
        if chunk.skip or memory.contains(chunk.key_str):
            continue
        obj = memory.allocate(engine.geometry.chunk_shape(chunk.num_tokens), engine.geometry.dtype)
        if obj is None:
            engine.count("store_backpressure_stops")
            ctx.record(stopped="memory full")
            return
        ctx.defer(obj.ref_down)
        chunk.obj = obj
        ctx.record(bytes=obj.nbytes, tier=engine.memory_name)
        yield chunk


@stage("put", kinds=("store",), needs={"kv"}, gives={"stored"})
def put(chunks: Iterator[Chunk], *, ctx: RunContext, tiers: list[str] | None = None) -> Iterator[Chunk]:
    """Store each chunk in the named tiers (default: all, in declaration order).

    The memory tier takes the chunk at once; slower tiers get its encoded
    payload through the engine's bounded write-behind queue, so inference
    never waits for a disk or a network.

    TOML::

        [[store.stages]]
        use = "put"
        tiers = ["memory", "disk"]
    """
    engine = ctx.engine
    names = tiers or engine.tier_names
    for chunk in chunks:
        for name in names:
            if name == engine.memory_name:
                nbytes = engine.put_memory(chunk)
            else:
                nbytes = engine.put_behind(name, chunk)
            engine.count(f"tier.{name}.written_bytes", nbytes)
            ctx.record(bytes=nbytes, tier=name)
        yield chunk
        # Downstream stages (a later put for other tiers) are done with this chunk
        # once the yield returns; a payload kept per chunk until the run ends
        # would double a store's memory.
        chunk.payload = None


@stage("lookup", kinds=("retrieve", "lookup"), needs={"key"}, gives={"hit"})
def lookup(
    chunks: Iterator[Chunk],
    *,
    ctx: RunContext,
    tiers: list[str] | None = None,
    prefetch: bool = True,
) -> Iterator[Chunk]:
    """Find each chunk in the tiers and pass on the contiguous hit from chunk 0.

    A chunk counts when any tier holds it; the first chunk no tier holds ends
    the run. No payload is read. In a lookup with pinning on, memory hits are
    pinned for the request's lookup id; with ``prefetch`` on, hits in slower
    tiers start loading into memory at once so that retrieve only copies.

    TOML::

        [[retrieve.stages]]
        use = "lookup"
        tiers = ["memory", "disk"]
        prefetch = true
    """
    engine = ctx.engine
    pending = list(chunks)
    if not pending:
        return
    request = pending[0].request
    found = engine.find(
        [c.key_str for c in pending], skip=[c.skip for c in pending], tiers=tiers
    )
    hit: list[Chunk] = []
    for chunk, tier_name in zip(pending, found):
        if tier_name is None and not chunk.skip:
            break
        chunk.tier = tier_name
        hit.append(chunk)
    request.hit_tokens = hit[-1].end if hit else 0
    if ctx.kind == "lookup":
        if request.pin and request.lookup_id is not None:
            engine.pin([c.key_str for c in hit if c.tier == engine.memory_name], request.lookup_id)
        if prefetch:
            engine.prefetch([c for c in hit if c.tier not in (None, engine.memory_name)], request.lookup_id)
    ctx.record(hit_tokens=request.hit_tokens - request.masked, chunks=len(hit))
    yield from hit


@stage("get", kinds=("retrieve",), needs={"hit"}, gives={"kv", "payload"})
def get(chunks: Iterator[Chunk], *, ctx: RunContext, promote: bool = True) -> Iterator[Chunk]:
    """Read each hit chunk's data from the tier that holds it.

    A memory hit hands over its object (raw KV, or an encoded payload); a hit
    in a slower tier is read (waiting for its prefetch when one is running)
    and, with ``promote`` on, copied into memory. A chunk that is gone since
    lookup ends the run: what came before is the longest good prefix, and the
    request's ``failed_range`` says which tokens were promised but not loaded.

    TOML::

        [[retrieve.stages]]
        use = "get"
        promote = true
    """
    engine = ctx.engine
    for chunk in chunks:
        if chunk.skip:
            yield chunk
            continue
        if not engine.read(chunk, ctx, promote=promote):
            request = chunk.request
            request.failed_range = (chunk.start, max(request.hit_tokens or 0, chunk.end))
            engine.count("retrieve_missing_chunks")
            ctx.record(stopped=f"chunk {chunk.index} gone from tier {chunk.tier}")
            return
        nbytes = chunk.kv.nbytes if chunk.kv is not None else len(chunk.payload)
        engine.count(f"tier.{chunk.tier}.read_bytes", nbytes)
        ctx.record(bytes=nbytes, tier=chunk.tier)
        yield chunk
