"""flowkv's tiers in vLLM's own KV events, for routers that index them (llm-d, Dynamo).

How vLLM 0.32 carries a connector's events::

    worker process                          engine-core process
    FlowKVConnector(WORKER)                 FlowKVConnector(SCHEDULER)
      get_kv_connector_kv_cache_events()      update_connector_output(output)   <- output.kv_cache_events
        -> FlowKVEvents (BlockStored /          take_events()  -> BlockStored / BlockRemoved
           BlockRemoved of this step)              |
      (vLLM merges the workers' containers)       Scheduler: KVEventBatch(own + connector events)
                                                   -> ZmqEventPublisher (--kv-events-config)

The model runner asks the worker's connector after every step; vLLM's output
aggregator merges the containers of all workers (``add_events`` plus
``increment_workers``), and the scheduler hands the merged container to the
scheduler's connector, whose ``take_events`` vLLM publishes with its own
events in one batch. Like vLLM's aggregator, an event is published once every
worker reported it (each tensor-parallel rank stores its shard of a chunk).

Events carry vLLM's block hashes for the chunk's tokens: the scheduler reads
them from ``Request.block_hashes`` (the hashes vLLM's prefix cache uses,
extra keys such as ``cache_salt`` included) into each ``SaveSpec``; the worker
maps each stored chunk to its blocks. ``medium`` names the tier: ``CPU`` for
memory, ``DISK``, ``REDIS``, or the tier kind in upper case.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from flowkv.keys import chain_hashes

__all__ = ["FlowKVEvents", "TierBlockEvents", "medium_of"]

logger = logging.getLogger("flowkv.integration")

_MEDIUM_OF_KIND = {"memory": "CPU", "disk": "DISK", "redis": "REDIS"}


def medium_of(kind: str) -> str:
    """The ``medium`` of a tier kind in vLLM's events."""
    return _MEDIUM_OF_KIND.get(kind, kind.upper())


class FlowKVEvents(KVConnectorKVEvents):
    """The events of one or more workers, counted so that only those every worker saw are published."""

    def __init__(self, num_workers: int = 1) -> None:
        self._counts: collections.Counter[KVCacheEvent] = collections.Counter()
        self._order: list[KVCacheEvent] = []
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            if event not in self._counts:
                self._order.append(event)
            self._counts[event] += 1

    def aggregate(self) -> FlowKVEvents:
        common = self.pop_common()
        self.clear_events()
        self.add_events(common)
        self._num_workers = 1
        return self

    def pop_common(self) -> list[KVCacheEvent]:
        """The events every worker reported, in the order they were first seen; they leave the container."""
        common = [event for event in self._order if self._counts[event] >= self._num_workers]
        for event in common:
            del self._counts[event]
        self._order = [event for event in self._order if event in self._counts]
        return common

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return [event for event in self._order for _ in range(self._counts[event])]

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._counts.clear()
        self._order = []

    def __len__(self) -> int:
        return len(self._order)


@dataclass(frozen=True)
class _ChunkBlocks:
    """vLLM's view of one flowkv chunk: its blocks' hashes, the block before it, its tokens."""

    block_hashes: tuple[Any, ...]
    parent: Any
    token_ids: tuple[int, ...]


class TierBlockEvents:
    """A worker's tier events turned into vLLM ``BlockStored`` / ``BlockRemoved`` events.

    ``note_save`` (before a store) says which vLLM blocks each chunk of the
    save covers; ``on_tier_event`` (from the storage manager, any thread)
    turns an admit or evict of a known chunk into a vLLM event; ``take``
    hands this step's events to vLLM.
    """

    def __init__(self, *, chunk_size: int, block_size: int, hash_name: str, tier_kinds: dict[str, str]) -> None:
        self.enabled = chunk_size % block_size == 0
        if not self.enabled:
            logger.warning("flowkv: chunk size %d is not a multiple of vLLM's block size %d; flowkv's tiers "
                           "are not published in vLLM's KV events", chunk_size, block_size)
        self._chunk_size = chunk_size
        self._block_size = block_size
        self._hash_name = hash_name
        self._medium = {tier: medium_of(kind) for tier, kind in tier_kinds.items()}
        self._lock = threading.Lock()
        # chunk hash -> its blocks, while a tier holds it (or a store is about to put it)
        self._chunks: dict[bytes, _ChunkBlocks] = {}
        # chunk hash -> tiers holding it
        self._held: dict[bytes, set[str]] = {}
        self._pending: list[KVCacheEvent] = []

    def note_save(self, token_ids: list[int], block_hashes: list[Any] | None, skip_prefix: int, *,
                  token_start: int = 0, chunk_hashes: list[bytes] | None = None) -> None:
        """Map the chunks past ``skip_prefix`` of a store to the vLLM blocks they cover.

        ``token_ids`` are the request's tokens from ``token_start`` (a chunk boundary);
        ``chunk_hashes``, when the scheduler sent them, are their full chunks' hashes.
        """
        if not self.enabled or not block_hashes:
            return
        per_chunk = self._chunk_size // self._block_size
        first_chunk = token_start // self._chunk_size
        full = len(token_ids) // self._chunk_size
        if chunk_hashes is not None:
            hashes = list(chunk_hashes[:full])
        else:
            hashes = chain_hashes(token_ids, self._chunk_size, self._hash_name, partial=False)
        with self._lock:
            for local in range(max(0, skip_prefix - token_start) // self._chunk_size, len(hashes)):
                index = first_chunk + local
                first = index * per_chunk
                blocks = block_hashes[first:first + per_chunk]
                if len(blocks) < per_chunk:
                    break  # vLLM has not hashed these blocks (cannot happen for full chunks; be safe)
                start = local * self._chunk_size
                self._chunks.setdefault(hashes[local], _ChunkBlocks(
                    block_hashes=tuple(maybe_convert_block_hash(h) for h in blocks),
                    parent=maybe_convert_block_hash(block_hashes[first - 1]) if first else None,
                    token_ids=tuple(token_ids[start:start + self._chunk_size])))

    def on_tier_event(self, op: str, tier: str, key: str) -> None:
        """A tier admitted (``admit``) or let go of (``evict``, ``remove``) the chunk ``key``."""
        try:
            chunk_hash = bytes.fromhex(key.rsplit("/", 1)[-1])
        except ValueError:
            return
        medium = self._medium.get(tier, tier.upper())
        with self._lock:
            blocks = self._chunks.get(chunk_hash)
            if blocks is None:
                return  # stored before this process (or by a save we did not see): vLLM never hashed it here
            held = self._held.setdefault(chunk_hash, set())
            if op == "admit":
                if tier in held:
                    return
                held.add(tier)
                self._pending.append(BlockStored(
                    block_hashes=list(blocks.block_hashes), parent_block_hash=blocks.parent,
                    token_ids=list(blocks.token_ids), block_size=self._block_size, lora_id=None,
                    medium=medium, lora_name=None))
                return
            if tier not in held:
                return
            held.discard(tier)
            self._pending.append(BlockRemoved(block_hashes=list(blocks.block_hashes), medium=medium))
            if not held:
                del self._held[chunk_hash]
                del self._chunks[chunk_hash]

    def take(self) -> FlowKVEvents:
        """This step's events (an empty container still counts this worker, as vLLM expects)."""
        with self._lock:
            pending, self._pending = self._pending, []
        events = FlowKVEvents()
        events.add_events(pending)
        return events


def publishes_kv_events(vllm_config: Any, pipeline: Any) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config``) and the pipeline adds its tiers to them."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events and pipeline.controller.kv_events)


class PublishedEvents:
    """The scheduler's side: merged worker containers in, the events every worker saw out."""

    def __init__(self) -> None:
        self._merged: FlowKVEvents | None = None

    def absorb(self, events: Any) -> None:
        """``KVConnectorOutput.kv_cache_events`` of a step (vLLM merged the workers' containers)."""
        if not isinstance(events, FlowKVEvents):
            return
        if self._merged is None:
            self._merged = events
            return
        # Events some workers reported in an earlier step wait for the rest.
        self._merged._num_workers = max(self._merged.get_number_of_workers(), events.get_number_of_workers())
        self._merged.add_events(events.get_all_events())

    def take(self) -> list[KVCacheEvent]:
        if self._merged is None:
            return []
        common = self._merged.pop_common()
        if not len(self._merged):
            self._merged = None
        return common
