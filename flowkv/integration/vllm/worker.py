"""The connector in each vLLM worker process: the flowkv engine, loads into and saves out of vLLM's pages.

``register_kv_caches`` detects the paged cache's layout, builds the
``CacheEngine`` and serves the scheduler's lookups on this worker's socket.
Each step the worker carries out the ``FlowKVMetadata`` bound to it:
loads in ``start_load_kv`` (or layer by layer, for layerwise pipelines,
until ``wait_for_layer_load``), saves in ``wait_for_save`` (or layer by layer
from ``save_kv_layer``). A load that comes back short becomes vLLM load
errors, so vLLM recomputes those blocks; a save whose request loaded short
is cut there or dropped. Loads vLLM waits for between steps are held in
``start_load_kv`` and finished in ``get_finished`` (``async_loads.py``).
Specs name their chunks by chained hash and carry only the tokens of the
chunks they touch (``token_start`` on): the engine call is made for those.
Blend pipelines move KV through the ``Blender``'s staging cache and blend
each load into vLLM's blocks before the forward pass (``blend.py``); a blend
that fails is a failed load (vLLM recomputes it).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flowkv.calls import KVTransfer
from flowkv.integration._ipc import LookupServer
from flowkv.integration.vllm.async_loads import AsyncLoads
from flowkv.integration.vllm.fleet import FleetLink
from flowkv.integration.vllm.metadata import FlowKVMetadata, LoadSpec, SaveSpec, chunk_mask, floor_to, slot_mapping
from flowkv.integration.vllm.query import answer
from flowkv.integration.vllm.settings import ConnectorSettings, Instance
from flowkv.integration.vllm.tracing import StepTrace
from flowkv.kernels.affinity import threads_elsewhere

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from flowkv.integration.vllm.kv_events import FlowKVEvents
    from flowkv.pipeline_model import Pipeline

logger = logging.getLogger("flowkv.integration")

__all__ = ["ConnectorWorker"]

# With nothing counted since the last report, the stats are taken again after this long anyway
# (the tiers' counters move in the background: write-behind, evictions by another engine).
_STATS_EVERY_S = 1.0
# The longest a step that schedules nothing waits for an asynchronous load to land (it returns as
# soon as one has): vLLM's step loop, spinning while requests wait for their loads, slowed to a pace.
_IDLE_STEP_WAIT_S = 0.01


@dataclass
class _LayerwiseLoad:
    """A load of this step whose layers land one by one."""

    spec: LoadSpec
    handle: Any  # flowkv.layerwise.LayerwiseRetrieve
    # Where the load ends if every layer lands (the chunks the retrieve found).
    expected_to: int
    # Where it did end, once finished.
    loaded_to: int | None = None


@dataclass
class _LayerwiseSave:
    """A save of this step whose layers are copied out as the model computes them."""

    spec: SaveSpec
    handle: Any  # flowkv.layerwise.LayerwiseStore
    # The load end the save was cut at when it started (None: not cut); a load
    # that ends up shorter than this makes the save wrong.
    cut_at: int | None


class ConnectorWorker:
    """The worker side of ``FlowKVConnector``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: ConnectorSettings,
        pipeline: Pipeline,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._settings = settings
        self._pipeline = pipeline
        self._instance = Instance.of(vllm_config)
        self._chunk_size = pipeline.chunk_size
        self._block_size = vllm_config.cache_config.block_size
        self._engine: Any = None
        self._kv_layers: list[torch.Tensor] = []
        self._server: LookupServer | None = None
        # The engine is driven from the inference thread and the IPC thread.
        self._engine_lock = threading.Lock()
        self._load_error_blocks: set[int] = set()
        # Requests whose load this step came back short -> tokens loaded; the
        # KV this step computes past that point is wrong and must not be stored.
        self._short_loads: dict[str, int] = {}
        self._stats_at_last_report: dict[str, Any] | None = None
        self._changes_reported = -1  # the engine's accounting.changes at the last report
        self._reported_at = 0.0  # time.monotonic() of the last report
        # Layerwise: a layer's index is its position in register_kv_caches' dict.
        self._layer_index: dict[str, int] = {}
        self._unknown_layers: set[str] = set()
        self._layer_loads: list[_LayerwiseLoad] = []
        # None until the step's first save_kv_layer starts the saves.
        self._layer_saves: list[_LayerwiseSave] | None = None
        self._step: StepTrace | None = None
        self._step_seq = itertools.count()
        self._async_loads = AsyncLoads(engine_lock=self._engine_lock, block_size=self._block_size,
                                       transfer=lambda load: self._transfer(load, load.token_ids, load.start,
                                                                            load.end, lookup_id=load.lookup_id),
                                       reached=self._reached, load_failed=self._load_failed,
                                       wait_limit_s=pipeline.section.pin_timeout_s / 2)
        self._fleet: FleetLink | None = None
        # The memory arena whose pre-fault refill keeps off vLLM's forward passes (None: the
        # engine stores into a node server's arena, or pinned memory); whether a step is open.
        self._arena: Any = None
        self._in_step = False
        self._idle_step = False
        # Blend pipelines: the recompute path, and the staging cache the engine moves KV through
        # (None: the engine moves KV straight between its tiers and vLLM's blocks).
        self._blender: Any = None
        self._engine_layers: list[torch.Tensor] = []

    # -- set-up and the scheduler's questions ---------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Detect the paged cache's layout, build the engine, serve lookups.

        vLLM calls this on the thread that drives the model, pinned to one core: the threads
        the engine, the lookup server and the fleet link start (and those they start later) run
        on the process's other cores (`flowkv.kernels.affinity`), not beside that thread."""
        with threads_elsewhere():
            self._register_kv_caches(kv_caches)

    def _register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from flowkv.engine import CacheEngine
        from flowkv.integration.vllm.cpu_packing import engine_packing
        from flowkv.kernels import detect_layout

        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self._kv_layers = list(kv_caches.values())
        self._layer_index = {name: index for index, name in enumerate(kv_caches)}
        geometry = detect_layout(
            kv_caches,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            block_size=self._block_size,
            backend_hint=self._backend_hints(kv_caches),
        )
        self._engine_layers = self._kv_layers
        if self._pipeline.blend is not None:
            from flowkv.integration.vllm.blend import Blender

            self._blender = Blender(self._vllm_config, self._pipeline.blend, kv_caches,
                                    num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                    block_size=self._block_size)
            geometry = self._blender.geometry
            self._engine_layers = self._blender.staging
        rank = self._worker_rank()
        self._engine = CacheEngine.from_pipeline(
            self._pipeline,
            geometry=geometry,
            model_name=self._settings.model_name,
            world_size=self._instance.world_size,
            rank=rank,
            packing=engine_packing(geometry),
        )
        self._arena = getattr(self._engine.memory, "arena", None)
        if self._blender is not None:
            self._blender.tracer = self._engine.tracer
        if self._engine.chunk_size % self._block_size and self._block_size % self._engine.chunk_size:
            logger.warning(
                "flowkv: chunk size %d and vLLM block size %d do not divide each other; "
                "hits are cut to whole blocks", self._engine.chunk_size, self._block_size,
            )
        self._server = LookupServer(
            self._instance.socket(self._settings.ipc_dir, rank),
            lambda header, tokens: answer(self._engine, self._engine_lock, header, tokens),
        )
        self._server.start()
        self._fleet = FleetLink.start(self._vllm_config, self._settings, self._pipeline, self._instance, rank,
                                      self._engine, self._engine_lock)
        logger.info(
            "flowkv: worker rank %d serving lookups on %s; pipeline %s, layout %s",
            rank, self._server.path, self._pipeline.name, self._engine.keys.layout,
        )

    def _backend_hints(self, kv_caches: Mapping[str, torch.Tensor]) -> list[str]:
        hints: list[str] = []
        layers = self._vllm_config.compilation_config.static_forward_context
        for name in kv_caches:
            backend = getattr(layers.get(name), "attn_backend", None)
            if backend is not None:
                hints.append(backend.get_name())
                break
        return hints

    def _worker_rank(self) -> int:
        from vllm.distributed.parallel_state import (
            get_pipeline_model_parallel_rank,
            get_tensor_model_parallel_rank,
        )

        tp_size = self._vllm_config.parallel_config.tensor_parallel_size
        return get_pipeline_model_parallel_rank() * tp_size + get_tensor_model_parallel_rank()

    # -- the engine's arguments -----------------------------------------------

    def _transfer(self, spec: LoadSpec | SaveSpec, token_ids: list[int], start: int, end: int,
                  lookup_id: str | None = None) -> KVTransfer:
        """The engine call for ``token_ids`` (the request's tokens from ``spec.token_start``)
        of a load or save, whole or layerwise.

        Slots outside ``[start, end)`` are -1: vLLM holds those tokens, or computes them this step.
        """
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        offset = spec.token_start
        # A blend moves KV through its staging cache, a window of positions from the block holding the first.
        block_ids = self._blender.window(max(start, offset), end) if self._blender is not None else spec.block_ids
        return KVTransfer(tokens=tokens, kv_caches=self._engine_layers,
                          slot_mapping=slot_mapping(block_ids, self._block_size, offset, len(tokens), start, end),
                          mask=chunk_mask(len(tokens), spec.skip_prefix - offset), tags=spec.tags or None,
                          request_id=spec.req_id, lookup_id=lookup_id, chunk_hashes=spec.chunk_hashes)

    @staticmethod
    def _reached(load: LoadSpec, relative_to: int) -> int:
        """Where a load of ``[start, end)`` got to, given how far into its tokens the engine got."""
        return min(max(load.token_start + relative_to, load.start), load.end)

    # -- a step ---------------------------------------------------------------

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        """A step with loads or saves opens its ``flowkv.step`` span.

        vLLM binds the metadata before the forward pass, so the span covers
        the whole step whichever hook does flowkv's work.
        """
        if self._step is not None:  # a step that never reached wait_for_save
            self._step.end()
            self._step = None
        if self._arena is not None and not self._in_step:
            # From here to wait_for_save the model computes: the arena's pre-fault waits.
            self._arena.begin_busy()
            self._in_step = True
        if self._engine is not None and isinstance(meta, FlowKVMetadata) and (meta.loads or meta.saves):
            self._step_trace(meta)
        self._idle_step = isinstance(meta, FlowKVMetadata) and meta.idle

    def _step_trace(self, meta: FlowKVMetadata) -> StepTrace:
        """This step's trace root, opened by the first hook of the step that has work."""
        if self._step is None:
            self._step = StepTrace(self._engine.tracer, next(self._step_seq), meta,
                                   layerwise=bool(self._engine.layerwise))
        return self._step

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        """Retrieve this step's loads into vLLM's pages, before the forward pass.

        Layerwise pipelines only start the loads here (find and read the
        chunks); each layer lands on the transfer worker and the forward pass
        waits for it in ``wait_for_layer_load``.
        """
        if not isinstance(meta, FlowKVMetadata) or not meta.loads:
            return
        step = self._step_trace(meta)
        for load in meta.loads:
            if load.load_async:
                # Not in this step's batch: finished between steps, whole (see async_loads.py).
                self._async_loads.add(load)
                continue
            if self._engine.layerwise:
                self._start_layerwise_load(load, step)
                continue
            loaded_to = load.start
            try:
                transfer = self._transfer(load, load.token_ids, load.start, load.end, lookup_id=load.lookup_id)
                with self._engine_lock, step.active(load.req_id):
                    result = self._engine.retrieve(transfer)
                reached = self._reached(load, result.loaded_to)
                if self._blender is not None:
                    # Outside the engine lock: lookups go on while the model recomputes (the
                    # staging cache is written by retrieves only, on this thread).
                    with step.active(load.req_id):
                        self._blended(load, reached, result.moved)
                loaded_to = reached
            except Exception:
                self._load_failed(load)
            self._loaded(load, loaded_to, step)

    def _blended(self, load: LoadSpec, loaded_to: int, moved: tuple[tuple[int, int, int], ...]) -> None:
        """Blend a blend pipeline's load into vLLM's blocks (see blend.py); counted in the engine's stats."""
        # A short load: vLLM recomputes from the block holding the first token not loaded
        # (``_loaded``), so only the whole blocks before it are blended.
        end = loaded_to if loaded_to >= load.end else max(load.start, floor_to(loaded_to, self._block_size))
        counts = self._blender.blend(load.token_ids, load.block_ids, load.start, end, moved, load.recompute_ratio)
        with self._engine_lock:
            self._engine.count("blend_reused_tokens", counts.reused)
            self._engine.count("blend_recomputed_tokens", counts.recomputed)
            self._engine.count("blend_staging_tokens", self._blender.staging_growth())

    def _load_failed(self, load: LoadSpec) -> None:
        """A retrieve that raised: drop the pins its lookup took; vLLM recomputes the load."""
        logger.exception("flowkv: retrieve for request %s failed; vLLM recomputes it", load.req_id)
        if load.lookup_id is None:
            return
        try:
            with self._engine_lock:
                self._engine.release(load.lookup_id)
        except Exception:
            logger.exception("flowkv: releasing lookup %s failed", load.lookup_id)

    def _start_layerwise_load(self, load: LoadSpec, step: StepTrace) -> None:
        try:
            transfer = self._transfer(load, load.token_ids, load.start, load.end, lookup_id=load.lookup_id)
            with self._engine_lock, step.active(load.req_id):
                handle = self._engine.retrieve_layerwise(transfer)
        except Exception:
            self._load_failed(load)
            self._loaded(load, load.start, step)
            return
        # The head found and read its chunks: unless a layer fails, the load ends where they end.
        self._layer_loads.append(_LayerwiseLoad(spec=load, handle=handle,
                                                expected_to=self._reached(load, handle.found_to)))

    def _finish_layerwise_loads(self) -> None:
        """Masks of this step's layerwise loads; a short one becomes vLLM load errors."""
        step = self._step
        for pending in self._layer_loads:
            if pending.loaded_to is not None:
                continue
            load = pending.spec
            loaded_to = load.start
            try:
                with self._engine_lock:
                    pending.handle.finish()
                loaded_to = self._reached(load, pending.handle.result.loaded_to)
            except Exception:
                self._load_failed(load)
            pending.loaded_to = loaded_to
            self._loaded(load, loaded_to, step)

    def _loaded(self, load: LoadSpec, loaded_to: int, step: StepTrace | None) -> None:
        """Record how far a load got; vLLM recomputes the blocks past that."""
        if step is not None:
            step.annotate(load.req_id, {"flowkv.load.start": load.start, "flowkv.load.end": load.end,
                                        "flowkv.hit_tokens": loaded_to - load.start})
        if loaded_to >= load.end:
            return
        self._short_loads[load.req_id] = loaded_to
        first_bad_block = loaded_to // self._block_size
        last_block = (load.end - 1) // self._block_size
        self._load_error_blocks.update(load.block_ids[first_bad_block:last_block + 1])
        logger.info(
            "flowkv: request %s loaded %d of %d tokens; vLLM recomputes the rest",
            load.req_id, loaded_to - load.start, load.end - load.start,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until every load of this step has put ``layer_name``'s KV in place.

        vLLM calls this on entry to each attention layer. Without layerwise,
        loads completed in ``start_load_kv`` and there is nothing to wait for.
        """
        if not self._layer_loads:
            return
        layer = self._layer_of(layer_name)
        if layer is None:
            return
        for pending in self._layer_loads:
            if pending.loaded_to is not None:
                continue
            try:
                pending.handle.wait(layer)
            except Exception:
                # The chunk misses that layer; finish() cuts the mask there.
                logger.exception("flowkv: layer %d of request %s failed to load", layer, pending.spec.req_id)
        if layer == len(self._kv_layers) - 1:
            self._finish_layerwise_loads()

    def _layer_of(self, layer_name: str) -> int | None:
        layer = self._layer_index.get(layer_name)
        if layer is None and layer_name not in self._unknown_layers:
            self._unknown_layers.add(layer_name)
            logger.warning("flowkv: vLLM named layer %r, which register_kv_caches did not; ignoring it", layer_name)
        return layer

    def save_kv_layer(self, layer_name: str, meta: KVConnectorMetadata | None) -> None:
        """Queue the copy of ``layer_name``'s KV for this step's saves (layerwise pipelines).

        vLLM calls this on exit from each attention layer, once the layer wrote
        its KV; the copy runs on the transfer worker while the model goes on.
        Without layerwise, saves happen once per step in ``wait_for_save``.
        """
        if not isinstance(meta, FlowKVMetadata) or not meta.saves or not self._engine.layerwise:
            return  # the metadata first: a decoding batch's steps read nothing else, per layer
        layer = self._layer_of(layer_name)
        if layer is None:
            return
        if self._layer_saves is None:
            self._start_layerwise_saves(meta)
        for pending in self._layer_saves or ():
            try:
                with self._engine_lock:
                    pending.handle.layer_ready(layer)
            except Exception:
                logger.exception("flowkv: layer %d of request %s failed to store", layer, pending.spec.req_id)

    def _start_layerwise_saves(self, meta: FlowKVMetadata) -> None:
        step = self._step_trace(meta)
        # A load already known short (a chunk gone at read time) cuts its
        # request's save before any layer is copied.
        expected = {pending.spec.req_id: pending.expected_to for pending in self._layer_loads
                    if pending.expected_to < pending.spec.end}
        expected.update(self._short_loads)
        self._layer_saves = []
        for save in meta.saves:
            cut_at = expected.get(save.req_id)
            token_ids = self._save_tokens(save, cut_at)
            if token_ids is None:
                continue
            try:
                transfer = self._transfer(save, token_ids, save.token_start, save.token_start + len(token_ids))
                if self._fleet is not None:
                    self._fleet.note_save(save, token_ids)
                with self._engine_lock, step.active(save.req_id):
                    handle = self._engine.store_layerwise(transfer)
            except Exception:
                logger.exception("flowkv: store for request %s failed", save.req_id)
                continue
            self._layer_saves.append(_LayerwiseSave(spec=save, handle=handle, cut_at=cut_at))

    def _save_tokens(self, save: SaveSpec, loaded_to: int | None) -> list[int] | None:
        """The tokens of ``save`` that are right to store, None when nothing new is left."""
        token_ids = save.token_ids
        if loaded_to is not None:
            # Only KV before the first missing token is right; vLLM
            # recomputes the rest and the scheduler asks again then.
            token_ids = token_ids[:max(0, floor_to(loaded_to, self._chunk_size) - save.token_start)]
            if save.token_start + len(token_ids) <= save.skip_prefix:
                return None
        return token_ids

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        """Finish this step's loads and store the chunks it completed; they are in flowkv when this returns."""
        try:
            self._finish_layerwise_loads()
            self._finish_saves(meta)
        finally:
            if self._in_step:
                self._arena.end_busy()
                self._in_step = False
            if self._step is not None:
                self._step.end()
            self._step = None
            self._layer_loads = []
            self._layer_saves = None
            self._short_loads = {}

    def _finish_saves(self, meta: KVConnectorMetadata | None) -> None:
        if not isinstance(meta, FlowKVMetadata) or not meta.saves:
            return
        short_loads = self._short_loads
        step = self._step_trace(meta)
        for pending in self._layer_saves or ():
            save = pending.spec
            loaded_to = short_loads.get(save.req_id)
            try:
                with self._engine_lock:
                    if loaded_to is not None and (pending.cut_at is None or loaded_to < pending.cut_at):
                        # A layer failed to load after the copies began: what the
                        # model computed past it is wrong. vLLM rolls the request
                        # back and the scheduler asks for the store again.
                        pending.handle.abort()
                        continue
                    stored = pending.handle.finish()
                step.annotate(save.req_id, {"flowkv.stored_tokens": stored})
            except Exception:
                logger.exception("flowkv: store for request %s failed", save.req_id)
        if self._layer_saves is not None:
            # Layerwise copies started for this step; saves they skipped had nothing to store.
            return
        for save in meta.saves:
            token_ids = self._save_tokens(save, short_loads.get(save.req_id))
            if token_ids is None:
                continue
            try:
                transfer = self._transfer(save, token_ids, save.token_start, save.token_start + len(token_ids))
                if self._fleet is not None:
                    self._fleet.note_save(save, token_ids)
                if self._blender is not None:
                    # The true K/V of the segments to store, out of vLLM's packed blocks (blend.py).
                    with step.active(save.req_id):
                        self._blender.stage_for_save(token_ids, save.block_ids, save.skip_prefix)
                with self._engine_lock, step.active(save.req_id):
                    stored = self._engine.store(transfer).stored_tokens
                step.annotate(save.req_id, {"flowkv.stored_tokens": stored})
            except Exception:
                # A store that fails is a later miss; inference goes on.
                logger.exception("flowkv: store for request %s failed", save.req_id)

    # -- loads vLLM waits for between steps (see async_loads.py) ---------------------

    def take_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The asynchronous loads that finished since the last step (``get_finished``)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        if not self._async_loads or self._engine is None:
            return KVConnectorTransferResults()
        if self._idle_step:
            # Nothing else to compute: vLLM's next step would follow at once, and its step loop (the
            # engine core and every rank's main thread) would take the cores and this process's GIL
            # from the tier I/O thread the load waits for. A short wait paces it.
            self._async_loads.wait_for_landing(self._engine, _IDLE_STEP_WAIT_S)
        done = self._async_loads.finish(self._engine, finished_req_ids)
        self._load_error_blocks |= done.error_blocks
        return KVConnectorTransferResults(finished_recving=done.recving, failed_recving=done.failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load came back short since the last call (vLLM recomputes them)."""
        failed, self._load_error_blocks = self._load_error_blocks, set()
        return failed

    # -- stats and the end ----------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What the worker's engine did since the last call (vLLM asks after every step)."""
        if self._engine is None:
            return None
        from flowkv.integration.vllm.metrics import FlowKVStats, snapshot

        # A decoding batch's steps change nothing flowkv counts: skip the snapshot (the tiers'
        # own counters, which write-behind moves in the background, at least once a second).
        changes = self._engine.accounting.changes
        now_s = time.monotonic()
        if changes == self._changes_reported and now_s - self._reported_at < _STATS_EVERY_S:
            return None
        self._changes_reported, self._reported_at = changes, now_s
        with self._engine_lock:
            now = snapshot(self._engine.stats())
            latencies = self._engine.drain_latencies()
        if self._fleet is not None:
            self._fleet.observe_latencies(latencies)
        interval = FlowKVStats.between(self._stats_at_last_report or {"counters": {}}, now, latencies)
        self._stats_at_last_report = now
        return None if interval.is_empty() else interval

    def get_kv_connector_kv_cache_events(self) -> FlowKVEvents | None:
        """This step's tier events for vLLM's KV event publisher (None unless it is on)."""
        return self._fleet.take_kv_events() if self._fleet is not None else None

    def shutdown(self) -> None:
        """Stop reporting and serving lookups, close the engine, write out its traces."""
        if self._fleet is not None:
            self._fleet.close()
            self._fleet = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._engine is not None:
            with self._engine_lock:
                self._engine.close()
            self._engine = None
            from flowkv import telemetry

            telemetry.flush()
