"""Stages that talk to tiers: allocate and put on the store side, lookup and get on retrieve.

They reach the tiers through ``ctx.services.storage`` (``flowkv.tiers.manager.StorageManager``),
which walks them in the order the pipeline file declares them. What a stage
may choose is its own option: which tiers ``put`` writes and ``lookup`` asks,
whether ``lookup`` prefetches hits below memory, whether ``get`` promotes
them. The memory tier holds objects (raw KV, or an encoded payload when a
codec ran before ``put``); slower tiers hold encoded payloads behind their
health guard, written behind so inference never waits for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flowkv import payload as payloads
from flowkv.items import Chunk, RunContext, Services
from flowkv.registry import Role, stage
from flowkv.tiers.manager import Entry


@stage("allocate", kinds=("store",), needs={"key"}, gives={"buffer"}, role=Role.ALLOCATOR)
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
    # One call each for the request's chunks: a node server answers in one round trip.
    wanted = [chunk for chunk in chunks if not chunk.skip]
    held = storage.contains_many([chunk.key_str for chunk in wanted]) if wanted else []
    wanted = [chunk for chunk, present in zip(wanted, held) if not present]
    if not wanted:
        return
    staging = storage.staging
    objs: list = []
    ctx.defer(lambda: storage.release_objects([(staging, obj) for obj in objs]))
    # Each chunk's room is taken when the chunk is pulled (a compressed chunk gives
    # the rest back before the next is allocated); a node server gives all at once.
    rooms = storage.allocate_each([geometry.chunk_shape(chunk.num_tokens) for chunk in wanted], geometry.dtype,
                                  tenant=wanted[0].request.tenant)
    ctx.defer(rooms.close)  # rooms taken for chunks never pulled go back
    for chunk in wanted:
        obj = next(rooms, None)
        if obj is None:
            services.count("store_backpressure_stops")
            ctx.record(stopped="memory full")
            return
        objs.append(obj)
        chunk.obj = obj
        ctx.record(bytes=obj.nbytes, tier=staging)
        yield chunk


@stage("put", kinds=("store", "server"), needs={"kv"}, gives={"stored"}, role=Role.TIER_IO)
def put(chunks: Iterator[Chunk], *, ctx: RunContext, tiers: list[str] | None = None) -> Iterator[Chunk]:
    """Store each chunk in the named tiers (default: all, in declaration order).

    The memory tier takes the chunk at once; slower tiers get its encoded
    payload through their bounded write-behind queue, so inference never
    waits for a disk or a network. A chunk is not put back into the tier it
    is in (a node server's ``[server]`` list: its chunks are in the arena).

    TOML::

        [[store.stages]]
        use = "put"
        tiers = ["memory", "disk"]
    """
    services = ctx.services
    storage = services.storage
    names = tiers or storage.order
    # Object tiers commit the run's chunks together (one call each) at the end of this
    # stage's input, in its span; a run that ends before (a failed stage, a downstream
    # stage that stops pulling) commits at its end, through ctx.defer: every chunk that
    # reached this stage is whole. Deferred once the first chunk is here, so that commit
    # runs before upstream cleanups (allocate's release of the store's own references).
    batch = None
    for chunk in chunks:
        if batch is None:
            batch = storage.batch()
            ctx.defer(lambda batch=batch: _count_written(services, batch.commit()))
        for name in names:
            if name == chunk.tier:
                continue
            nbytes = batch.put(name, chunk.key_str, obj=chunk.obj, kv=chunk.kv, payload=chunk.payload,
                               tenant=chunk.request.tenant)
            if chunk.obj is not None and "codec" in chunk.obj.meta:
                chunk.kv = None  # memory keeps the encoding in the chunk's own pages: the raw view is gone
            if nbytes:
                services.count(f"tier.{name}.written_bytes", nbytes)
                ctx.record(bytes=nbytes, tier=name)
        yield chunk
        # Downstream stages (a later put for other tiers) are done with this chunk
        # once the yield returns; a payload kept per chunk until the run ends
        # would double a store's memory.
        chunk.payload = None
    if batch is not None:
        _count_written(services, batch.commit())


def _count_written(services: Services, written: dict[str, int]) -> None:
    for name, nbytes in written.items():
        services.count(f"tier.{name}.written_bytes", nbytes)


@stage("lookup", kinds=("retrieve", "lookup"), needs={"key"}, gives={"hit"}, role=Role.LOOKUP)
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
    owner = request.lookup_id
    pin = owner if ctx.kind == "lookup" and request.pin and owner is not None else None
    # Lookup and pin in one call per tier (one round trip to a node server).
    found = storage.find([c.key_str for c in pending], skip=[c.skip for c in pending], tiers=tiers, pin=pin)
    hit: list[Chunk] = []
    for chunk, tier_name in zip(pending, found):
        if tier_name is None and not chunk.skip:
            break
        chunk.tier = tier_name
        hit.append(chunk)
    request.hit_tokens = hit[-1].end if hit else 0
    request.lookup_chunks, request.hit_chunks = len(pending), len(hit)
    # What of the hit object tiers hold (masked chunks count): a load of it only copies.
    request.memory_tokens = 0
    for chunk in hit:
        if not (chunk.skip or storage.holds_objects(chunk.tier)):
            break
        request.memory_tokens = chunk.end
    if request.prefetch is not None:
        prefetch = request.prefetch  # the caller's choice (a check before a load, a controller's command)
    if ctx.kind == "lookup":
        below = [c for c in hit if c.tier is not None and not storage.holds_objects(c.tier)]
        if prefetch and below:
            dtype = services.geometry.dtype
            storage.prefetch([Entry(c.key_str, c.tier, services.chunk_shape(c.num_tokens), dtype, request.tenant)
                              for c in below], owner)
    ctx.record(hit_tokens=request.hit_tokens - request.masked, chunks=len(hit))
    yield from hit


@stage("get", kinds=("retrieve",), needs={"hit"}, gives={"kv", "payload"}, role=Role.TIER_IO)
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
    storage = services.storage
    chunk_shape = services.geometry.chunk_shape
    dtype = services.geometry.dtype
    pending = list(chunks)
    wanted = [chunk for chunk in pending if not chunk.skip]
    # Object tiers are asked once for every chunk (one round trip to a node server);
    # byte tiers chunk by chunk as they are pulled.
    reads = storage.read_many([Entry(c.key_str, c.tier, chunk_shape(c.num_tokens), dtype, c.request.tenant)
                               for c in wanted], promote=promote)
    held: list[tuple[str, object]] = []
    ctx.defer(lambda: storage.release_objects(held))
    ctx.defer(reads.close)  # releases what was read for chunks never pulled
    for chunk in pending:
        if chunk.skip:
            yield chunk
            continue
        found = next(reads)
        if found is None:
            chunk.request.fail_from(chunk)
            services.count("retrieve_missing_chunks")
            ctx.record(stopped=f"chunk {chunk.index} gone from tier {chunk.tier}")
            return
        if found.obj is not None:
            held.append((found.tier, found.obj))
            chunk.obj = found.obj
        chunk.tier = found.tier
        if found.kv is not None:
            chunk.kv = found.kv
        else:
            chunk.payload = found.payload
        if chunk.segment_start is not None:
            _note_stored_start(chunk, found)
        nbytes = chunk.kv.nbytes if chunk.kv is not None else len(chunk.payload)
        services.count(f"tier.{chunk.tier}.read_bytes", nbytes)
        ctx.record(bytes=nbytes, tier=chunk.tier)
        yield chunk


def _note_stored_start(chunk: Chunk, found: Any) -> None:
    """A segment chunk's stored position (object meta, else its payload's header); a chunk
    found at another position than it sits now goes on the request's ``moved`` list."""
    stored = found.obj.meta.get("start_position") if found.obj is not None else None
    if stored is None and found.payload is not None:
        try:
            stored = payloads.read_header(found.payload).segment_start
        except payloads.PayloadError:
            return  # decompress refuses it, and the run ends there
    chunk.stored_start = stored
    if stored is not None and stored != chunk.start:
        chunk.request.moved.append((chunk.start, chunk.end, stored))
