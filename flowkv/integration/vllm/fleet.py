"""A vLLM worker's link to the fleet: its tier events to the controller and into vLLM's KV events.

``FleetLink.start`` (from ``register_kv_caches``, once the engine is built)
subscribes to the storage manager's admit / evict / remove events and hands
each to

- a :class:`flowkv.fleet.holder.EngineHolder` when the pipeline's
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

from flowkv.fleet.holder import EngineHolder
from flowkv.fleet.reporter import ReporterConfig
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
        kinds = {name: spec.kind for name, spec in pipeline.tiers.items()}
        self.kv_events = TierBlockEvents(
            chunk_size=pipeline.chunk_size, block_size=vllm_config.cache_config.block_size,
            hash_name=engine.hash_fn.name, tier_kinds=kinds) if wants_kv_events else None
        self.holder: EngineHolder | None = None
        spec = pipeline.controller
        if spec.url:
            model = vllm_config.model_config.served_model_name
            if isinstance(model, (list, tuple)):
                model = model[0]
            self.holder = EngineHolder(
                engine, engine_lock,
                ReporterConfig(url=spec.url, heartbeat_s=spec.heartbeat_s, token_file=spec.token_file,
                               ca_file=spec.ca_file, max_queue=spec.max_queue),
                instance_id=spec.instance_id or default_instance_id(spec.advertise_url, instance.instance_id),
                rank=rank, world_size=instance.world_size, kind="vllm", url=spec.advertise_url,
                model=str(model or settings.model_name), key_model=settings.model_name,
                tokenizer=vllm_config.model_config.tokenizer)
        engine.storage.subscribe(self._on_tier_event)
        if self.holder is not None:
            self.holder.start()
            logger.info("flowkv: reporting to the controller at %s as %s rank %d", spec.url,
                        self.holder.reporter.registration.instance_id, rank)

    # -- from the data path -------------------------------------------------------

    def _on_tier_event(self, event: Any) -> None:
        if self.holder is not None:
            self.holder.on_tier_event(event)
        if self.kv_events is not None:
            self.kv_events.on_tier_event(event.kind, event.tier, event.key)

    def note_save(self, save: SaveSpec, token_ids: list[int]) -> None:
        """Before a store: which of vLLM's blocks each chunk covers (for vLLM's KV events)."""
        if self.kv_events is not None:
            self.kv_events.note_save(token_ids, save.block_hashes, save.skip_prefix,
                                     token_start=save.token_start, chunk_hashes=save.chunk_hashes)

    def observe_latencies(self, latencies: dict[str, list[float]]) -> None:
        if self.holder is not None and latencies:
            self.holder.reporter.observe_latencies(latencies)

    def take_kv_events(self) -> FlowKVEvents | None:
        return self.kv_events.take() if self.kv_events is not None else None

    def close(self) -> None:
        if self.holder is not None:
            self.holder.close()
