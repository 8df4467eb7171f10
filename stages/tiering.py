"""Stages that talk to tiers: allocate and put on the store side, lookup and get on retrieve.

They reach the tiers through ``ctx.services.storage`` (``flowkv.tiers.chain.StorageManager``),
which walks them in the order the pipeline file declares them. What a stage
may choose is its own option: which tiers ``put`` writes and ``lookup`` asks,
whether ``lookup`` prefetches hits below memory, whether ``get`` promotes
them. The memory tier holds objects (raw KV, or an encoded payload when a
codec ran before ``put``); slower tiers hold encoded payloads behind their
health guard, written behind so inference never waits for them.
"""

from __future__ import annotations

from collections.abc import Iterator

from flowkv.items import Chunk, RunContext
from flowkv.registry import stage
from flowkv.tiers.chain import Entry


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
    services = ctx.services
    storage = services.storage
    geometry = services.geometry
    for chunk in chunks:
        if chunk.skip or storage.contains(chunk.key_str):
            continue
        obj = storage.allocate(geometry.chunk_shape(chunk.num_tokens), geometry.dtype)
        if obj is None:
            services.count("store_backpressure_stops")
            ctx.record(stopped="memory full")
            return
        ctx.defer(obj.ref_down)
        chunk.obj = obj
        ctx.record(bytes=obj.nbytes, tier=storage.staging)
        yield chunk


@stage("put", kinds=("store",), needs={"kv"}, gives={"stored"})
def put(chunks: Iterator[Chunk], *, ctx: RunContext, tiers: list[str] | None = None) -> Iterator[Chunk]:
    """Store each chunk in the named tiers (default: all, in declaration order).

    The memory tier takes the chunk at once; slower tiers get its encoded
    payload through their bounded write-behind queue, so inference never
    waits for a disk or a network.

    TOML::

        [[store.stages]]
        use = "put"
        tiers = ["memory", "disk"]
    """
    services = ctx.services
    storage = services.storage
    names = tiers or storage.order
    for chunk in chunks:
        for name in names:
            nbytes = storage.put(name, chunk.key_str, obj=chunk.obj, kv=chunk.kv, payload=chunk.payload)
            if chunk.obj is not None and "codec" in chunk.obj.meta:
                chunk.kv = None  # memory keeps the encoding in the chunk's own pages: the raw view is gone
            services.count(f"tier.{name}.written_bytes", nbytes)
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

    A chunk counts when any tier (of ``tiers``, default all) holds it; the
    first chunk none holds ends the run. No payload is read. In a lookup with
    pinning on, memory hits are pinned for the request's lookup id; with
    ``prefetch`` on, hits in slower tiers start loading into memory at once
    so that retrieve only copies.

    TOML::

        [[retrieve.stages]]
        use = "lookup"
        tiers = ["memory", "disk"]
        prefetch = true
    """
    services = ctx.services
    storage = services.storage
    pending = list(chunks)
    if not pending:
        return
    request = pending[0].request
    found = storage.find([c.key_str for c in pending], skip=[c.skip for c in pending], tiers=tiers)
    hit: list[Chunk] = []
    for chunk, tier_name in zip(pending, found):
        if tier_name is None and not chunk.skip:
            break
        chunk.tier = tier_name
        hit.append(chunk)
    request.hit_tokens = hit[-1].end if hit else 0
    if ctx.kind == "lookup":
        owner = request.lookup_id
        if request.pin and owner is not None:
            storage.pin([(c.key_str, c.tier) for c in hit], owner)
        below = [c for c in hit if c.tier is not None and not storage.holds_objects(c.tier)]
        if prefetch and below:
            dtype = services.geometry.dtype
            storage.prefetch([Entry(c.key_str, c.tier, services.chunk_shape(c.num_tokens), dtype)
                              for c in below], owner)
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
    services = ctx.services
    read = services.storage.read
    chunk_shape = services.geometry.chunk_shape
    dtype = services.geometry.dtype
    for chunk in chunks:
        if chunk.skip:
            yield chunk
            continue
        found = read(Entry(chunk.key_str, chunk.tier, chunk_shape(chunk.num_tokens), dtype), promote=promote)
        if found is None:
            chunk.request.fail_from(chunk)
            services.count("retrieve_missing_chunks")
            ctx.record(stopped=f"chunk {chunk.index} gone from tier {chunk.tier}")
            return
        if found.obj is not None:
            ctx.defer(found.obj.ref_down)
            chunk.obj = found.obj
        chunk.tier = found.tier
        if found.kv is not None:
            chunk.kv = found.kv
        else:
            chunk.payload = found.payload
        nbytes = chunk.kv.nbytes if chunk.kv is not None else len(chunk.payload)
        services.count(f"tier.{chunk.tier}.read_bytes", nbytes)
        ctx.record(bytes=nbytes, tier=chunk.tier)
        yield chunk
