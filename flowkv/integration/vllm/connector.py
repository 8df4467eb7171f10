"""``FlowKVConnector``: the class vLLM loads, one per process, delegating to its role's side.

vLLM builds the connector twice: in the engine-core process with role
``SCHEDULER`` and in each worker process with role ``WORKER``. Both load and
check the pipeline (a bad one stops vLLM at start in every process, with
every error listed); then the scheduler's connector hands each hook to a
``ConnectorScheduler`` and the worker's to a ``ConnectorWorker``. A hook
called in the wrong role is a caller bug and fails its assertion.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.platforms import current_platform

from flowkv.integration.vllm.kv_events import PublishedEvents
from flowkv.integration.vllm.metrics import FlowKVPromMetrics, FlowKVStats
from flowkv.integration.vllm.scheduler import ConnectorScheduler
from flowkv.integration.vllm.blend import refuse_unblendable
from flowkv.integration.vllm.settings import ConnectorSettings, whole_block_chunk_size
from flowkv.integration.vllm.worker import ConnectorWorker
from flowkv.pipeline import load_pipeline
from flowkv.quality_gate import gate_warnings

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("flowkv.integration")

__all__ = ["FlowKVConnector"]


class FlowKVConnector(KVConnectorBase_V1):
    """flowkv's vLLM KV connector; its settings are in the README ("Using it with vLLM")."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.of(vllm_config)
        # Loading checks the whole pipeline: a bad one stops vLLM here, in
        # both processes, with every error listed.
        pipeline = load_pipeline(settings.pipeline, overrides=settings.overrides)
        # A blend pipeline on a model, parallel layout or cache setting it cannot blend stops here.
        refuse_unblendable(vllm_config, pipeline, cpu=current_platform.is_cpu())
        block_size = vllm_config.cache_config.block_size
        chunk_size = whole_block_chunk_size(pipeline.chunk_size, block_size, packed_blocks=current_platform.is_cpu())
        if chunk_size != pipeline.chunk_size:
            if role == KVConnectorRole.WORKER:
                logger.warning("flowkv: chunk_size %d is not a multiple of vLLM's block size %d; on the CPU "
                               "backend blocks are packed, so flowkv uses chunks of %d tokens (whole blocks)",
                               pipeline.chunk_size, block_size, chunk_size)
            settings = replace(settings, overrides={**settings.overrides, "chunk_size": chunk_size})
            pipeline = load_pipeline(settings.pipeline, overrides=settings.overrides)
        # A [quality] gate holds only for the model its record measured; in warn mode (the built-in
        # blend) every refusal is logged here instead of stopping the load.
        for warning in gate_warnings(pipeline, vllm_config.model_config.model):
            logger.warning("flowkv: %s", warning)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._published = PublishedEvents()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(vllm_config, self._kv_transfer_config, settings, pipeline)
        elif role == KVConnectorRole.WORKER:
            self._worker = ConnectorWorker(vllm_config, kv_cache_config, settings, pipeline)
        else:
            raise ValueError(f"flowkv: unknown KV connector role {role!r}")

    @property
    def scheduler(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "a scheduler hook was called on flowkv's worker-side connector"
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        assert self._worker is not None, "a worker hook was called on flowkv's scheduler-side connector"
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save dropped by preemption is only a future miss.
        return False

    # -- scheduler side ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' output of a step: asynchronous loads that failed, and flowkv's tier
        events for vLLM's KV event publisher."""
        self.scheduler.update_connector_output(connector_output)
        self._published.absorb(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """flowkv's ``BlockStored`` / ``BlockRemoved`` events; vLLM publishes them with its own."""
        return self._published.take()

    # -- worker side --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, self._connector_metadata)

    def wait_for_save(self):
        self.worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Saves are synchronous; the asynchronous loads that finished since the last step."""
        results = self.worker.take_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``, with the asynchronous loads that came back short named as failed."""
        return self.worker.take_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """This step's tier events as vLLM events (None unless vLLM publishes KV events)."""
        return self.worker.get_kv_connector_kv_cache_events()

    # -- both sides -----------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker engine's numbers since the last call; None from the scheduler, which has no engine."""
        return self._worker.get_kv_connector_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuild the stats a worker sent (vLLM calls this where it aggregates them)."""
        return FlowKVStats(data=dict(data) if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """The ``vllm:flowkv_*`` Prometheus metrics (see ``flowkv.integration.vllm.metrics``)."""
        return FlowKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        """Stop serving lookups and close the engine (worker), or close the lookup client (scheduler)."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
