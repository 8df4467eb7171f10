"""A vLLM worker's link to the fleet: its tier events to the controller and into vLLM's KV events.

``FleetLink.start`` (from ``register_kv_caches``, once the engine is built)
subscribes to the storage manager's admit / evict / remove events and hands
each to

- a :class:`flowkv.fleet.reporter.Reporter` when the pipeline's
  ``[controller]`` table has a ``url``: the worker registers as rank ``r``
  of the instance, heartbeats with its engine's numbers, and carries out the
  controller's commands (clear, pin, prefetch) on the engine;
- :class:`flowkv.integration.vllm.kv_events.TierBlockEvents` when vLLM
  publishes KV events (``--kv-events-config``): vLLM's ``BlockStored`` /
  ``BlockRemoved`` with the tier as ``medium``.

Both only queue: an observer runs on the thread that changed the tier and
must not wait. Without either, no link is made and nothing is subscribed.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from typing import TYPE_CHECKING, Any

from flowkv.fleet.protocol import Command, CommandResult, Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session
from flowkv.integration.vllm.kv_events import FlowKVEvents, TierBlockEvents, publishes_kv_events

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from flowkv.integration.vllm.metadata import SaveSpec
    from flowkv.integration.vllm.settings import ConnectorSettings, Instance
    from flowkv.pipeline_model import Pipeline

logger = logging.getLogger("flowkv.integration")

__all__ = ["FleetLink", "default_instance_id"]


def default_instance_id(advertise_url: str | None, vllm_instance_id: str) -> str:
    """``host:port`` of the URL the instance serves on, else the host name and vLLM's instance id."""
    if advertise_url:
        parsed = urllib.parse.urlsplit(advertise_url)
        if parsed.hostname:
            return f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"
    return f"{socket.gethostname()}-{vllm_instance_id[:12]}"


class FleetLink:
    """See the module's docstring."""

    @classmethod
    def start(cls, vllm_config: VllmConfig, settings: ConnectorSettings, pipeline: Pipeline, instance: Instance,
              rank: int, engine: Any, engine_lock: threading.Lock) -> FleetLink | None:
        """The link for this worker, or None when neither a controller nor vLLM's KV events want events."""
        wants_kv_events = publishes_kv_events(vllm_config, pipeline)
        if not pipeline.controller.url and not wants_kv_events:
            return None
        storage = getattr(engine, "storage", None)
        if storage is None or not hasattr(storage, "subscribe"):
            logger.warning("flowkv: this engine offers no tier events; no controller reports, no vLLM KV events")
            return None
        return cls(vllm_config, settings, pipeline, instance, rank, engine, engine_lock, wants_kv_events)

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, pipeline: Pipeline,
                 instance: Instance, rank: int, engine: Any, engine_lock: threading.Lock,
                 wants_kv_events: bool) -> None:
        self._engine = engine
        self._engine_lock = engine_lock
        self._storage = engine.storage
        kinds = {name: spec.kind for name, spec in pipeline.tiers.items()}
        self.kv_events = TierBlockEvents(
            chunk_size=pipeline.chunk_size, block_size=vllm_config.cache_config.block_size,
            hash_name=engine.hash_fn.name, tier_kinds=kinds) if wants_kv_events else None
        self.reporter: Reporter | None = None
        spec = pipeline.controller
        if spec.url:
            model = vllm_config.model_config.served_model_name
            if isinstance(model, (list, tuple)):
                model = model[0]
            registration = Registration(
                instance_id=spec.instance_id or default_instance_id(spec.advertise_url, instance.instance_id),
                rank=rank, world_size=instance.world_size, session=new_session(), kind="vllm",
                url=spec.advertise_url, model=str(model or settings.model_name), key_model=settings.model_name,
                tokenizer=vllm_config.model_config.tokenizer, pipeline=pipeline.name,
                tiers=[TierInfo(name=name, kind=tier.kind, capacity_bytes=_capacity(tier.config))
                       for name, tier in pipeline.tiers.items()],
                chunk_size=pipeline.chunk_size, hash=engine.hash_fn.name,
                shared=[str(tier.config.controller_id) for tier in pipeline.tiers.values()
                        if getattr(tier.config, "controller_id", None)])
            with engine_lock:
                held = {self._storage.staging: list(self._storage.memory.keys())}
            self.reporter = Reporter(
                ReporterConfig(url=spec.url, heartbeat_s=spec.heartbeat_s, token_file=spec.token_file,
                               max_queue=spec.max_queue),
                registration, held=held, run_command=self._run_command, stats=self._stats)
        self._storage.subscribe(self._on_tier_event)
        if self.reporter is not None:
            self.reporter.start()
            logger.info("flowkv: reporting to the controller at %s as %s rank %d", spec.url,
                        self.reporter.registration.instance_id, rank)

    # -- from the data path -------------------------------------------------------

    def _on_tier_event(self, event: Any) -> None:
        if self.reporter is not None:
            self.reporter.offer(event.kind, event.tier, event.key)
        if self.kv_events is not None:
            self.kv_events.on_tier_event(event.kind, event.tier, event.key)

    def note_save(self, save: SaveSpec, token_ids: list[int]) -> None:
        """Before a store: which of vLLM's blocks each chunk covers (for vLLM's KV events)."""
        if self.kv_events is not None:
            self.kv_events.note_save(token_ids, save.block_hashes, save.skip_prefix)

    def observe_latencies(self, latencies: dict[str, list[float]]) -> None:
        if self.reporter is not None and latencies:
            self.reporter.observe_latencies(latencies)

    def take_kv_events(self) -> FlowKVEvents | None:
        return self.kv_events.take() if self.kv_events is not None else None

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()

    # -- for the reporter (its own thread) ----------------------------------------------

    def _stats(self) -> dict[str, Any]:
        with self._engine_lock:
            stats = self._engine.stats()
        tiers = {}
        for name, numbers in (stats.get("tiers") or {}).items():
            tiers[name] = {key: numbers[key] for key in ("used_bytes", "capacity_bytes", "entries", "evictions")
                           if isinstance(numbers.get(key), (int, float))}
        counters = {key: value for key, value in stats.items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool)}
        return {"counters": counters, "tiers": tiers}

    def _run_command(self, command: Command) -> CommandResult:
        if command.op == "clear":
            return self._clear(command)
        if command.op in ("pin", "prefetch"):
            return self._pin_or_prefetch(command)
        return CommandResult(id=command.id, ok=False, detail=f"unknown command {command.op!r}")

    def _clear(self, command: Command) -> CommandResult:
        from flowkv.keys import tags_digest

        digest = tags_digest(command.tags) if command.tags else None
        storage = self._storage
        skipped = [name for name in (command.tiers or storage.order) if not storage.holds_objects(name)]
        removed = 0
        with self._engine_lock:
            for key in list(storage.memory.keys()):
                if digest is not None and key.rsplit("/", 2)[-2] != digest:
                    continue
                removed += bool(storage.remove(key))  # each removal goes out as an event
        detail = f"removed {removed} chunks from memory"
        if skipped:
            detail += f"; {', '.join(skipped)} not cleared (byte tiers keep their chunks until evicted)"
        return CommandResult(id=command.id, ok=True, detail=detail)

    def _pin_or_prefetch(self, command: Command) -> CommandResult:
        from flowkv.tiers.chain import Entry

        engine, storage = self._engine, self._storage
        with self._engine_lock:
            keys = [key.to_str() for key in engine.keys.of(command.token_ids, command.tags or None)]
            found = storage.find(keys)
            prefix = []
            for key, tier in zip(keys, found):
                if tier is None:
                    break
                prefix.append((key, tier))
            owner = ("flowkv-controller", command.op, command.id)
            if command.op == "pin":
                storage.pin(prefix, owner)
            else:
                dtype = engine.geometry.dtype
                shape = tuple(engine.geometry.chunk_shape(engine.chunk_size))
                storage.prefetch([Entry(key, tier, shape, dtype) for key, tier in prefix], owner)
        # Pins expire with the storage manager's pin timeout; prefetched chunks are released after ttl_s.
        timer = threading.Timer(command.ttl_s, self._release, args=(owner,))
        timer.daemon = True
        timer.start()
        return CommandResult(id=command.id, ok=True, detail=f"{command.op} {len(prefix)} of {len(keys)} chunks")

    def _release(self, owner: Any) -> None:
        with self._engine_lock:
            self._storage.release(owner)


def _capacity(config: Any) -> int | None:
    capacity = getattr(config, "capacity", None)
    return capacity if isinstance(capacity, int) else None
