"""flowkv's tier events as vLLM KV events: the chunk-to-block mapping and the merge across workers.

The path through a real vLLM and its ZMQ publisher is in ``test_controller_vllm.py``; here the
pieces run the way vLLM drives them (its aggregator's calls, in its order), with vLLM's own classes.
"""

from __future__ import annotations

import pickle

from flowkv.integration.vllm.kv_events import FlowKVEvents, PublishedEvents, TierBlockEvents, medium_of
from flowkv.keys import KeyPrefix, chain_hashes

CHUNK, BLOCK = 256, 128
TOKENS = list(range(100, 100 + 3 * CHUNK + 50))
VLLM_HASHES = [bytes([n]) * 32 for n in range(len(TOKENS) // BLOCK)]  # stand-ins for Request.block_hashes


def keys(rank: int = 0) -> list[str]:
    prefix = KeyPrefix.build(model="m", world_size=2, worker_rank=rank, dtype="bfloat16", layout="l")
    return [prefix.key(h).to_str() for h in chain_hashes(TOKENS, CHUNK, "sha256", partial=False)]


def worker() -> TierBlockEvents:
    return TierBlockEvents(chunk_size=CHUNK, block_size=BLOCK, hash_name="sha256",
                           tier_kinds={"memory": "memory", "disk": "disk", "cold": "redis", "mine": "sqlite"})


def test_a_stored_chunk_becomes_block_stored_with_vllms_hashes_of_its_blocks_and_the_tier_as_medium():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    events = worker()
    events.note_save(TOKENS, VLLM_HASHES, skip_prefix=0)
    chunk_keys = keys()
    events.on_tier_event("admit", "memory", chunk_keys[1])
    events.on_tier_event("admit", "memory", chunk_keys[1])  # admitted twice: one event
    events.on_tier_event("admit", "disk", chunk_keys[1])
    events.on_tier_event("evict", "memory", chunk_keys[1])
    events.on_tier_event("admit", "memory", "m/1.0/x/y/notags/" + "ab" * 32)  # a chunk no save mapped
    taken = events.take().get_all_events()
    assert [type(e) for e in taken] == [BlockStored, BlockStored, BlockRemoved]
    stored = taken[0]
    # As vLLM publishes its own: maybe_convert_block_hash (64-bit ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    external = [maybe_convert_block_hash(h) for h in VLLM_HASHES]
    assert stored.block_hashes == external[2:4] and stored.parent_block_hash == external[1]
    assert stored.token_ids == TOKENS[CHUNK:2 * CHUNK] and stored.block_size == BLOCK
    assert [e.medium for e in taken] == ["CPU", "DISK", "CPU"]
    assert taken[2].block_hashes == external[2:4]
    assert events.take().get_all_events() == []
    assert [medium_of(k) for k in ("memory", "disk", "redis", "sqlite")] == ["CPU", "DISK", "REDIS", "SQLITE"]


def test_only_events_every_worker_reported_are_published_as_vllm_merges_them():
    first, second = worker(), worker()
    for events in (first, second):
        events.note_save(TOKENS, VLLM_HASHES, skip_prefix=0)
    # Rank 0 stored chunks 0 and 1 this step, rank 1 only chunk 0 (its chunk 1 comes a step later).
    first.on_tier_event("admit", "memory", keys(0)[0])
    first.on_tier_event("admit", "memory", keys(0)[1])
    second.on_tier_event("admit", "memory", keys(1)[0])
    published = PublishedEvents()
    # vLLM's KVOutputAggregator: the first worker's container, then add_events + increment_workers;
    # containers cross process boundaries pickled.
    merged = pickle.loads(pickle.dumps(first.take()))
    other = pickle.loads(pickle.dumps(second.take()))
    merged.add_events(other.get_all_events())
    merged.increment_workers(1)
    published.absorb(merged)
    step_one = published.take()
    assert [e.token_ids for e in step_one] == [TOKENS[:CHUNK]]
    # Next step: rank 1 catches up; an empty container from rank 0 still counts it.
    second.on_tier_event("admit", "memory", keys(1)[1])
    merged = first.take()
    merged.add_events(second.take().get_all_events())
    merged.increment_workers(1)
    published.absorb(merged)
    assert [e.token_ids for e in published.take()] == [TOKENS[CHUNK:2 * CHUNK]]
    assert published.take() == []


def test_no_events_when_chunks_do_not_cover_whole_blocks():
    events = TierBlockEvents(chunk_size=96, block_size=128, hash_name="sha256", tier_kinds={"memory": "memory"})
    events.note_save(TOKENS, VLLM_HASHES, skip_prefix=0)
    prefix = KeyPrefix.build(model="m", world_size=1, worker_rank=0, dtype="bfloat16", layout="l")
    events.on_tier_event("admit", "memory", prefix.key(chain_hashes(TOKENS, 96, "sha256")[0]).to_str())
    assert isinstance(events.take(), FlowKVEvents) and events.take().get_all_events() == []


def test_a_save_of_a_later_step_maps_its_own_chunks_from_the_hashes_the_scheduler_sent():
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    # The scheduler's save of the second step: chunk 1 only, its tokens and hash, nothing before it.
    events = worker()
    hashes = chain_hashes(TOKENS, CHUNK, "sha256", partial=False)
    events.note_save(TOKENS[CHUNK:2 * CHUNK], VLLM_HASHES, skip_prefix=CHUNK, token_start=CHUNK,
                     chunk_hashes=hashes[1:2])
    events.on_tier_event("admit", "memory", keys()[0])  # chunk 0: not this save's
    events.on_tier_event("admit", "memory", keys()[1])
    [stored] = events.take().get_all_events()
    external = [maybe_convert_block_hash(h) for h in VLLM_HASHES]
    assert stored.block_hashes == external[2:4] and stored.parent_block_hash == external[1]
    assert stored.token_ids == TOKENS[CHUNK:2 * CHUNK]
