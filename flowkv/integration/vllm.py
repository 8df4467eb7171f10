"""flowkv as a vLLM KV connector (vLLM v1 connector API, checked on vLLM 0.32).

Select it with::

    from vllm.config import KVTransferConfig
    KVTransferConfig(
        kv_connector="FlowKVConnector",
        kv_connector_module_path="flowkv.integration.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"pipeline": "local-cpu", "chunk_size": 256},
    )

or ``vllm serve MODEL --kv-transfer-config '{"kv_connector":"FlowKVConnector",
"kv_connector_module_path":"flowkv.integration.vllm","kv_role":"kv_both",
"kv_connector_extra_config":{"pipeline":"local-cpu"}}'``.

``kv_connector_extra_config`` keys
----------------------------------
``pipeline``
    A built-in pipeline name (``local-cpu``) or a path to a pipeline TOML
    file. Default ``local-cpu``.
``model_name``
    The model name cache keys carry. Default: vLLM's ``model`` (the path or
    hub name it loaded). Set it when one model is served from several paths.
``ipc_dir``
    Folder of the scheduler-to-worker lookup sockets. Default
    ``$TMPDIR/flowkv-<uid>``.
``save_decode``, ``lookup_timeout_ms``
    The pipeline's ``[vllm]`` settings: also store the KV of generated
    tokens (default false); how long the scheduler waits for the workers'
    lookup answer before it answers 0 hits (default 200).
any other key
    Overrides a pipeline setting by its dotted path, e.g.
    ``"tiers.memory.capacity": "2GiB"``, ``"telemetry.exporter": "file"``; a
    bare key is one of ``[pipeline]``, e.g. ``"chunk_size": 256``.

A pipeline with errors stops vLLM at start-up with every error listed
(``FILE:LINE:COL: message``), not at the first request.

Per-request settings come in ``SamplingParams(extra_args={"kv_transfer_params":
{...}})``: ``"flowkv.tag.<name>": "<value>"`` adds a cache-key tag (requests
only share KV with requests that carry the same tags), ``"flowkv.skip_save":
true`` stores nothing for the request. vLLM's ``cache_salt`` and the LoRA
adapter name are tags too.

A failed load is a cache miss: flowkv sets vLLM's ``kv_load_failure_policy``
to ``"recompute"``, so vLLM recomputes the blocks a load could not fill
instead of failing the request.

How it fits vLLM
----------------
::

    engine-core process                         worker process (one per rank)
    FlowKVConnector(role=SCHEDULER)             FlowKVConnector(role=WORKER)
      get_num_new_matched_tokens ──IPC lookup──▶  LookupServer ─▶ CacheEngine.lookup(pin)
      update_state_after_alloc                    register_kv_caches: layout, engine
      build_connector_meta ──FlowKVMetadata──▶    start_load_kv: retrieve into pages
      request_finished ───IPC release────▶        wait_for_save: store full chunks

Layerwise (``[layerwise] enabled = true``, or ``"layerwise.enabled": true`` in
the extra config): ``start_load_kv`` runs each load's retrieve up to the
per-layer stages and queues every layer's scatter on the transfer worker;
``wait_for_layer_load(layer)`` (vLLM calls it on entry to each attention
layer) blocks until that layer landed for every load of the step. The first
``save_kv_layer`` starts the step's stores, and each ``save_kv_layer(layer)``
queues that layer's gather while the model computes the next layer;
``wait_for_save`` finishes the loads (masks, load-error blocks: vLLM reads
them right after it) and then the stores. A layer that fails to land is
known only after the forward pass used it: the load is cut there, vLLM
recomputes from that block, and the request's store of that step is dropped
(the scheduler asks for it again after the rollback). A layer's index is its
position in ``register_kv_caches``' dict.

Traces: each engine step with flowkv work is one ``flowkv.step`` span, with
one ``flowkv.request`` span per request under it (``flowkv.request_id``,
``flowkv.load.start``/``flowkv.load.end``, ``flowkv.hit_tokens`` loaded,
``flowkv.stored_tokens``); the request's retrieve and store runs, their
stages, layers and ``flowkv.wait`` spans nest under it.

Facts checked on vLLM 0.32.0 (CPU backend, 2 layers, 2 KV heads x 64, bf16):

- The worker connector is built (and ``register_kv_caches`` called) before the
  scheduler connector; both see the same ``vllm_config.instance_id``, which
  names the IPC sockets.
- ``register_kv_caches`` gets ``{layer_name: tensor}`` in model order; on CPU
  each tensor is ``(num_blocks, num_kv_heads, block_size, 2*head_size)``, all
  views of one buffer (layer stride = half of it with 2 layers).
- ``get_num_new_matched_tokens(request, num_computed_tokens)``: with prefix
  caching off ``num_computed_tokens`` is 0; vLLM passes the block-aligned
  local hit. ``request.kv_transfer_params`` is what the caller put in
  ``SamplingParams.extra_args["kv_transfer_params"]``; ``request.cache_salt``
  and ``request.lora_request`` are there too. It is called again for a
  request that could not be scheduled (no free blocks) and after preemption.
- ``update_state_after_alloc(request, blocks, n)`` follows at once with
  ``blocks.get_block_ids() == ([...],)`` (one KV-cache group) and ``n`` the
  external tokens vLLM accepted (0 when it did not take them).
- ``build_connector_meta``: ``scheduled_new_reqs[i].block_ids`` is a tuple of
  per-group lists; ``scheduled_cached_reqs.new_block_ids[i]`` is None or the
  blocks added this step (all blocks when resumed after preemption);
  ``num_scheduled_tokens`` maps request id to this step's token count.
  Decode steps carry no token ids (``new_token_ids`` is empty without
  pipeline parallelism), so generated tokens are read from the scheduler's
  ``Request.all_token_ids``.
- ``start_load_kv`` runs *before* the forward pass only when the scheduler
  set ``has_sync_kv_loads`` (a request with external tokens and
  ``load_kv_async=False``), otherwise after it; ``forward_context.attn_metadata``
  is a dict per layer, or None on the empty step that reports finished ids.
- ``save_kv_layer`` gets the layer's paged tensor and a
  ``CPUAttentionMetadata`` (``slot_mapping`` int64 of this step's tokens).
  It and ``wait_for_layer_load`` come from the decorator around the
  attention op, with the layer name; both are skipped while no connector
  metadata is bound (profiling runs).
- ``get_block_ids_with_load_errors`` is read after ``wait_for_save`` (and
  after ``start_load_kv`` when that runs after the forward): loads may finish
  as late as ``wait_for_save``. A request reported there is skipped in that
  step's output and rescheduled from the first bad block, so a layer that
  failed during the forward costs a recompute, not a wrong token.
  ``wait_for_save`` runs once per step after the forward pass, metadata still
  bound.
- ``request_finished(request, block_ids)`` runs for finished and aborted
  requests (also ones aborted while waiting); returning False frees the
  blocks at once. ``get_finished`` then sees the id in ``finished_req_ids``.
- ``get_block_ids_with_load_errors`` is read after every step; vLLM cuts the
  request's computed tokens at the first reported block and recomputes from
  there, but only when ``kv_load_failure_policy == "recompute"`` (the
  default ``"fail"`` ends the request with an error). The scheduler reads
  that policy after constructing the connector.
- ``RequestOutput.num_cached_tokens`` counts tokens loaded by the connector
  (with prefix caching off, exactly those).
- An abort reaches the scheduler (and ``request_finished``) after the front
  end has already dropped the request: ``LLMEngine.has_unfinished_requests()``
  can be False while the engine core has yet to release the request's pins.
- The CPU platform turns async scheduling off, so a step's lookups, loads and
  saves never overlap another step's: lookups find the worker idle.
- ``get_kv_connector_stats`` is called after every step; with
  ``disable_log_stats=False`` what it returns reaches ``LLM.get_metrics()``
  through ``build_prom_metrics`` (``vllm:flowkv_*``).

``kv_role``: ``kv_both`` loads and stores, ``kv_producer`` only stores,
``kv_consumer`` only loads.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from flowkv.calls import KVTransfer
from flowkv.integration._ipc import (
    LookupClient,
    LookupServer,
    default_ipc_dir,
    query_worker,
    socket_path,
)

if TYPE_CHECKING:
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
    from vllm.v1.request import Request

logger = logging.getLogger("flowkv.integration")

__all__ = [
    "ConnectorSettings",
    "FlowKVConnector",
    "FlowKVMetadata",
    "flush_worker_traces",
    "worker_socket",
    "worker_stats",
]

DEFAULT_PIPELINE = "local-cpu"
TAG_PREFIX = "flowkv.tag."
SKIP_SAVE_KEY = "flowkv.skip_save"
# Extra-config keys the connector reads itself; every other key overrides the pipeline.
_CONNECTOR_KEYS = ("pipeline", "model_name", "ipc_dir")
# Bare extra-config keys that live in the pipeline's [vllm] table.
_VLLM_SECTION_KEYS = ("save_decode", "lookup_timeout_ms")


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector takes from ``kv_connector_extra_config``."""

    pipeline: str
    # Pipeline settings by dotted path, passed on to the pipeline loader.
    overrides: dict[str, Any]
    model_name: str
    ipc_dir: Path

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, default_model: str) -> ConnectorSettings:
        """Split the extra config into connector keys and pipeline overrides."""
        extra = dict(extra or {})
        pipeline = extra.get("pipeline", DEFAULT_PIPELINE)
        if not isinstance(pipeline, (str, os.PathLike)) or not str(pipeline):
            raise ValueError(
                f"kv_connector_extra_config 'pipeline' must be a built-in pipeline name or a TOML path, "
                f"got {pipeline!r}"
            )
        model_name = extra.get("model_name", default_model)
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"kv_connector_extra_config 'model_name' must be a non-empty string, got {model_name!r}")
        overrides: dict[str, Any] = {}
        for key, value in extra.items():
            if key in _CONNECTOR_KEYS:
                continue
            overrides[f"vllm.{key}" if key in _VLLM_SECTION_KEYS else key] = value
        return cls(
            pipeline=str(pipeline),
            overrides=overrides,
            model_name=model_name,
            ipc_dir=Path(extra["ipc_dir"]) if extra.get("ipc_dir") else default_ipc_dir(),
        )


# -- what the scheduler sends the workers each step ----------------------------


@dataclass
class LoadSpec:
    """Load ``[start, end)`` of a request's tokens from flowkv into its blocks.

    ``token_ids`` runs to the end of the last chunk the load touches, so the
    engine can key every chunk; tokens outside ``[start, end)`` get slot -1
    and are not written (vLLM holds them already, or will compute them).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    # The chunk-aligned prefix the engine need not read at all.
    skip_prefix: int
    lookup_id: str | None
    tags: dict[str, str]


@dataclass
class SaveSpec:
    """Store the chunks of ``token_ids`` past ``skip_prefix`` (flowkv has those already)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_prefix: int
    tags: dict[str, str]


@dataclass
class FlowKVMetadata(KVConnectorMetadata):
    """One step's loads and saves, built by the scheduler connector."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# -- scheduler-side bookkeeping -------------------------------------------------


@dataclass
class _RequestState:
    # vLLM's live object: all_token_ids grows as it decodes; a slice of it is a new list.
    request: Request
    tags: dict[str, str]
    skip_save: bool
    block_ids: list[int] = field(default_factory=list)
    # Pins held in the workers for this request's latest lookup.
    lookup_id: str | None = None
    # Tokens the latest lookup found (chunk-aligned) and the vLLM-computed
    # tokens it was asked beyond.
    hit_tokens: int = 0
    lookup_base: int = 0
    # A load vLLM accepted and the next step must carry out.
    pending_load: tuple[int, int] | None = None
    # Tokens (chunk-aligned) this request asked flowkv to store.
    stored_end: int = 0
    # Tokens vLLM will have computed after the last scheduled step; fewer at
    # the next step means vLLM rolled the request back (failed load, preemption).
    expected_computed: int = 0


def request_tags(request: Request) -> tuple[dict[str, str], bool]:
    """Cache-key tags and the skip-save flag of a vLLM request."""
    tags: dict[str, str] = {}
    params = request.kv_transfer_params or {}
    for key, value in params.items():
        if isinstance(key, str) and key.startswith(TAG_PREFIX):
            name = key[len(TAG_PREFIX):]
            if not name:
                # Raising here would take down vLLM's engine core, not just this request.
                logger.warning("flowkv: ignoring kv_transfer_params key %r: it names no tag", key)
                continue
            tags[name] = str(value)
    if getattr(request, "cache_salt", None):
        tags["cache_salt"] = str(request.cache_salt)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        tags["lora"] = str(getattr(lora, "lora_name", None) or getattr(lora, "lora_int_id", ""))
    return tags, bool(params.get(SKIP_SAVE_KEY, False))


def _floor(value: int, multiple: int) -> int:
    return value // multiple * multiple


def _ceil(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# -- worker-side state of one step ----------------------------------------------


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


class _StepTrace:
    """One engine step's spans: a ``flowkv.step`` root and one ``flowkv.request`` per request under it.

    Every run flowkv makes for a request in the step (its retrieve and store,
    their stages, layers and waits) nests under that request's span, so a
    trace viewer shows a step as one tree. Telemetry never breaks the data
    path: span failures are swallowed.
    """

    def __init__(self, tracer: Any, index: int, meta: FlowKVMetadata, *, layerwise: bool) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = tracer
        self._requests: dict[str, Any] = {}
        self.span = tracer.start_span("flowkv.step", attributes={
            "flowkv.step.index": index,
            "flowkv.step.loads": len(meta.loads),
            "flowkv.step.saves": len(meta.saves),
            "flowkv.step.requests": len({spec.req_id for spec in (*meta.loads, *meta.saves)}),
            "flowkv.layerwise": layerwise,
        })

    def request(self, req_id: str) -> Any:
        span = self._requests.get(req_id)
        if span is None:
            span = self._tracer.start_span(
                "flowkv.request", context=self._trace.set_span_in_context(self.span),
                attributes={"flowkv.request_id": req_id},
            )
            self._requests[req_id] = span
        return span

    def active(self, req_id: str) -> Any:
        """A context in which flowkv's runs for ``req_id`` nest under its request span."""
        return self._trace.use_span(self.request(req_id), end_on_exit=False)

    def annotate(self, req_id: str, attributes: dict[str, Any]) -> None:
        try:
            self.request(req_id).set_attributes(attributes)
        except Exception:
            logger.debug("flowkv: annotating the step trace failed", exc_info=True)

    def end(self) -> None:
        try:
            for span in self._requests.values():
                span.end()
            self.span.end()
        except Exception:
            logger.debug("flowkv: ending the step trace failed", exc_info=True)


def worker_socket(vllm_config: VllmConfig, rank: int = 0) -> Path:
    """The lookup socket of one worker of a running vLLM instance."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else None
    settings = ConnectorSettings.from_extra_config(extra, default_model=vllm_config.model_config.model)
    return socket_path(settings.ipc_dir, vllm_config.instance_id, vllm_config.parallel_config.data_parallel_rank, rank)


def flush_worker_traces(vllm_config: VllmConfig, rank: int = 0, *, timeout_ms: int = 10000) -> None:
    """Make one worker of a running vLLM instance export every span it finished.

    Trace files (``[telemetry] exporter = "file"``) are complete up to now
    when this returns; for tools and tests that read them while vLLM runs.
    """
    query_worker(worker_socket(vllm_config, rank), "flush_traces", timeout_ms=timeout_ms)


def worker_stats(vllm_config: VllmConfig, rank: int = 0, *, timeout_ms: int = 5000) -> dict[str, Any]:
    """The flowkv engine statistics of one worker of a running vLLM instance.

    >>> llm = vllm.LLM(model=..., kv_transfer_config=...)          # doctest: +SKIP
    >>> worker_stats(llm.llm_engine.vllm_config)["tiers"]["memory"]["pinned_objects"]  # doctest: +SKIP
    0
    """
    return query_worker(worker_socket(vllm_config, rank), "stats", timeout_ms=timeout_ms)["stats"]


class FlowKVConnector(KVConnectorBase_V1):
    """flowkv's vLLM KV connector; see the module docstring for its settings."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from flowkv.pipeline import load_pipeline

        self._settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config,
            default_model=vllm_config.model_config.model,
        )
        # Loading checks the whole pipeline: a bad one stops vLLM here, in
        # both processes, with every error listed.
        self._pipeline = load_pipeline(self._settings.pipeline, overrides=self._settings.overrides)
        # A [quality] gate holds only for the model its record measured.
        from flowkv.quality import check_served_model

        if (warning := check_served_model(self._pipeline, vllm_config.model_config.model)) is not None:
            logger.warning("flowkv: %s", warning)
        self._chunk_size = self._pipeline.chunk_size
        self._block_size = vllm_config.cache_config.block_size
        self._save_decode = self._pipeline.vllm.save_decode
        self._partial_chunks = self._pipeline.section.save_partial_chunks
        self._loads = self._kv_transfer_config.is_kv_consumer
        self._saves = self._kv_transfer_config.is_kv_producer
        parallel = vllm_config.parallel_config
        self._world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self._dp_rank = parallel.data_parallel_rank
        self._instance_id = vllm_config.instance_id

        # scheduler side
        self._lookup_client: LookupClient | None = None
        self._requests: dict[str, _RequestState] = {}
        self._lookup_seq = itertools.count()
        # worker side
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
        # Layerwise: a layer's index is its position in register_kv_caches' dict.
        self._layer_index: dict[str, int] = {}
        self._unknown_layers: set[str] = set()
        self._layer_loads: list[_LayerwiseLoad] = []
        # None until the step's first save_kv_layer starts the saves.
        self._layer_saves: list[_LayerwiseSave] | None = None
        self._step: _StepTrace | None = None
        self._step_seq = itertools.count()

        if role == KVConnectorRole.SCHEDULER:
            policy = self._kv_transfer_config.kv_load_failure_policy
            if policy != "recompute":
                logger.info("flowkv: kv_load_failure_policy %r -> 'recompute' (a failed load is a cache miss)", policy)
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            paths = [
                socket_path(self._settings.ipc_dir, self._instance_id, self._dp_rank, rank)
                for rank in range(self._world_size)
            ]
            self._lookup_client = LookupClient(paths, timeout_ms=self._pipeline.vllm.lookup_timeout_ms)

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save dropped by preemption is only a future miss.
        return False

    # ==========================================================================
    # Scheduler side
    # ==========================================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` flowkv can load: whole vLLM
        blocks, never the request's last token, 0 when the workers do not
        answer in time."""
        state = self._state_for(request)
        self._release(state)
        state.hit_tokens = 0
        state.lookup_base = num_computed_tokens
        num_tokens = request.num_tokens
        # The last token is always computed: its logits are the next token's.
        ceiling = _floor(num_tokens - 1, self._block_size)
        if not self._loads or ceiling <= num_computed_tokens or request.prompt_token_ids is None:
            return 0, False
        # Only whole chunks can hit unless the pipeline stores partial ones.
        lookup_end = num_tokens if self._partial_chunks else _floor(num_tokens, self._chunk_size)
        if lookup_end <= num_computed_tokens:
            return 0, False
        assert self._lookup_client is not None
        token_ids = request.all_token_ids[:lookup_end]
        lookup_id = f"{request.request_id}#{next(self._lookup_seq)}"
        replies = self._lookup_client.ask(
            {"op": "lookup", "lookup_id": lookup_id, "tags": state.tags}, np.asarray(token_ids, dtype=np.int64)
        )
        if replies is None or not all(reply.get("ok") for reply in replies):
            for reply in replies or ():
                if not reply.get("ok"):
                    logger.warning("flowkv: lookup failed on a worker: %s", reply.get("error"))
            # Pins a late answer may have taken are dropped by this release,
            # which each worker handles after the lookup it follows.
            self._lookup_client.tell({"op": "release", "lookup_id": lookup_id})
            return 0, False
        state.lookup_id = lookup_id
        state.hit_tokens = min(int(reply["hit_tokens"]) for reply in replies)
        # Whole vLLM blocks only: a partial block would be written by the
        # load and again by the forward pass, or shared with another request.
        usable = _floor(min(state.hit_tokens, num_tokens - 1), self._block_size)
        if usable <= num_computed_tokens:
            self._release(state)
            return 0, False
        return usable - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        """Record the load vLLM accepted, or drop the pins when it took none."""
        state = self._state_for(request)
        if num_external_tokens > 0:
            start = state.lookup_base
            state.pending_load = (start, start + num_external_tokens)
        else:
            self._release(state)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads (accepted in ``update_state_after_alloc``) and
        saves (chunks that this step's forward pass completes)."""
        meta = FlowKVMetadata()
        steps: list[tuple[_RequestState, int]] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new_req.req_id)
            if state is None:
                continue
            state.block_ids = list(new_req.block_ids[0])
            steps.append((state, new_req.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            steps.append((state, cached.num_computed_tokens[index]))

        for state, num_computed in steps:
            req_id = state.request.request_id
            if num_computed < state.expected_computed:
                # Stores asked for past this point may have been cut short
                # (a failed load poisons the rest of its step); ask again.
                # The engine skips chunks it already holds.
                state.stored_end = min(state.stored_end, _floor(num_computed, self._chunk_size))
            if state.pending_load is not None:
                start, end = state.pending_load
                state.pending_load = None
                skip_prefix = _floor(start, self._chunk_size)
                meta.loads.append(
                    LoadSpec(
                        req_id=req_id,
                        # To the end of the chunk holding the last loaded token
                        # (a stored partial chunk ends at the hit).
                        token_ids=state.request.all_token_ids[
                            :min(_ceil(end, self._chunk_size), max(state.hit_tokens, end))
                        ],
                        block_ids=list(state.block_ids),
                        start=start,
                        end=end,
                        skip_prefix=skip_prefix,
                        lookup_id=state.lookup_id,
                        tags=state.tags,
                    )
                )
                # The retrieve releases the lookup's pins.
                state.lookup_id = None
                # Chunks flowkv serves are chunks it holds. Should the load
                # come back short, vLLM rolls the request back and the check
                # above lowers this again.
                state.stored_end = max(state.stored_end, _floor(end, self._chunk_size))
            computed_after_step = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            state.expected_computed = computed_after_step
            if state.skip_save or not self._saves:
                continue
            known_tokens = state.request.num_tokens if self._save_decode else state.request.num_prompt_tokens
            store_end = _floor(min(computed_after_step, known_tokens), self._chunk_size)
            if store_end > state.stored_end:
                meta.saves.append(
                    SaveSpec(
                        req_id=req_id,
                        token_ids=state.request.all_token_ids[:store_end],
                        block_ids=list(state.block_ids),
                        skip_prefix=state.stored_end,
                        tags=state.tags,
                    )
                )
                state.stored_end = store_end
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Drop the request's pins; saves are done by the time it finishes, so
        its blocks can be freed at once."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._release(state)
        return False, None

    def _state_for(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            tags, skip_save = request_tags(request)
            state = _RequestState(request=request, tags=tags, skip_save=skip_save)
            self._requests[request.request_id] = state
        return state

    def _release(self, state: _RequestState) -> None:
        if state.lookup_id is not None and self._lookup_client is not None:
            self._lookup_client.tell({"op": "release", "lookup_id": state.lookup_id})
        state.lookup_id = None

    # ==========================================================================
    # Worker side
    # ==========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Detect the paged cache's layout, build the engine, serve lookups."""
        from flowkv.engine import CacheEngine
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
        rank = self._worker_rank()
        self._engine = CacheEngine.from_pipeline(
            self._pipeline,
            geometry=geometry,
            model_name=self._settings.model_name,
            world_size=self._world_size,
            rank=rank,
        )
        if self._engine.chunk_size % self._block_size and self._block_size % self._engine.chunk_size:
            logger.warning(
                "flowkv: chunk size %d and vLLM block size %d do not divide each other; "
                "hits are cut to whole blocks", self._engine.chunk_size, self._block_size,
            )
        self._server = LookupServer(
            socket_path(self._settings.ipc_dir, self._instance_id, self._dp_rank, rank), self._serve
        )
        self._server.start()
        logger.info(
            "flowkv: worker rank %d serving lookups on %s; pipeline %s, layout %s",
            rank, self._server.path, self._pipeline.name, geometry.fingerprint(),
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

    def _serve(self, header: dict[str, Any], tokens: np.ndarray) -> dict[str, Any]:
        """Answer one IPC request from the scheduler (runs on the server thread)."""
        op = header.get("op")
        if op == "lookup":
            with self._engine_lock:
                hit = self._engine.lookup(
                    torch.from_numpy(tokens.copy()), pin=True, tags=header.get("tags") or None,
                    lookup_id=header["lookup_id"],
                )
            return {"hit_tokens": int(hit)}
        if op == "release":
            with self._engine_lock:
                self._engine.release(header["lookup_id"])
            return {}
        if op == "stats":
            with self._engine_lock:
                return {"stats": self._engine.stats(), "healthy": bool(self._engine.is_healthy())}
        if op == "flush_traces":
            from flowkv import telemetry

            telemetry.flush()
            return {}
        if op == "ping":
            return {}
        raise ValueError(f"unknown flowkv IPC op {op!r}")

    def _slot_mapping(self, block_ids: list[int], num_tokens: int, start: int, end: int) -> torch.Tensor:
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)
        needed = _ceil(min(end, num_tokens), self._block_size) // self._block_size
        if needed > len(blocks):
            raise ValueError(f"{len(blocks)} blocks cannot hold {end} tokens of block size {self._block_size}")
        slots = torch.full((num_tokens,), -1, dtype=torch.int64)
        inside = torch.arange(start, min(end, num_tokens), dtype=torch.int64)
        slots[start:end] = blocks[inside // self._block_size] * self._block_size + inside % self._block_size
        return slots

    def _chunk_mask(self, num_tokens: int, skip_prefix: int) -> torch.Tensor | None:
        if skip_prefix <= 0:
            return None
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        mask[:skip_prefix] = True
        return mask

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's loads and saves; a step with any opens its ``flowkv.step`` span.

        vLLM binds the metadata before the forward pass, so the span covers
        the whole step whichever hook does flowkv's work.
        """
        super().bind_connector_metadata(connector_metadata)
        if self._step is not None:  # a step that never reached wait_for_save
            self._step.end()
            self._step = None
        if (
            self._engine is not None
            and isinstance(connector_metadata, FlowKVMetadata)
            and (connector_metadata.loads or connector_metadata.saves)
        ):
            self._step_trace(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Retrieve this step's loads into vLLM's pages, before the forward pass.

        Layerwise pipelines only start the loads here (find and read the
        chunks); each layer lands on the transfer worker and the forward pass
        waits for it in ``wait_for_layer_load``.
        """
        meta = self._connector_metadata
        if not isinstance(meta, FlowKVMetadata) or not meta.loads:
            return
        step = self._step_trace(meta)
        for load in meta.loads:
            if self._engine.layerwise:
                self._start_layerwise_load(load, step)
                continue
            loaded_to = load.start
            try:
                transfer = self._transfer(load, load.token_ids, load.start, load.end, lookup_id=load.lookup_id)
                with self._engine_lock, step.active(load.req_id):
                    result = self._engine.retrieve(transfer)
                loaded_to = result.loaded_within(load.start, load.end)
            except Exception:
                self._load_failed(load)
            self._loaded(load, loaded_to, step)

    def _transfer(self, spec: LoadSpec | SaveSpec, token_ids: list[int], start: int, end: int,
                  lookup_id: str | None = None) -> KVTransfer:
        """The engine call for ``token_ids`` of a load or save (whole or layerwise).

        Slots outside ``[start, end)`` are -1: vLLM holds those tokens, or computes them this step.
        """
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        return KVTransfer(tokens=tokens, kv_caches=self._kv_layers,
                          slot_mapping=self._slot_mapping(spec.block_ids, len(tokens), start, end),
                          mask=self._chunk_mask(len(tokens), spec.skip_prefix), tags=spec.tags or None,
                          request_id=spec.req_id, lookup_id=lookup_id)

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

    def _start_layerwise_load(self, load: LoadSpec, step: _StepTrace) -> None:
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
                                                expected_to=handle.found_within(load.start, load.end)))

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
                loaded_to = pending.handle.result.loaded_within(load.start, load.end)
            except Exception:
                self._load_failed(load)
            pending.loaded_to = loaded_to
            self._loaded(load, loaded_to, step)

    def _loaded(self, load: LoadSpec, loaded_to: int, step: _StepTrace | None) -> None:
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

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Queue the copy of ``layer_name``'s KV for this step's saves (layerwise pipelines).

        vLLM calls this on exit from each attention layer, once the layer wrote
        its KV; the copy runs on the transfer worker while the model goes on.
        Without layerwise, saves happen once per step in ``wait_for_save``.
        """
        meta = self._connector_metadata
        if not self._engine.layerwise or not isinstance(meta, FlowKVMetadata) or not meta.saves:
            return
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
                transfer = self._transfer(save, token_ids, 0, len(token_ids))
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
            token_ids = token_ids[:_floor(loaded_to, self._chunk_size)]
            if len(token_ids) <= save.skip_prefix:
                return None
        return token_ids

    def wait_for_save(self):
        """Finish this step's loads and store the chunks it completed; they are in flowkv when this returns."""
        try:
            self._finish_layerwise_loads()
            self._finish_saves()
        finally:
            if self._step is not None:
                self._step.end()
            self._step = None
            self._layer_loads = []
            self._layer_saves = None
            self._short_loads = {}

    def _finish_saves(self) -> None:
        meta = self._connector_metadata
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
                transfer = self._transfer(save, token_ids, 0, len(token_ids))
                with self._engine_lock, step.active(save.req_id):
                    stored = self._engine.store(transfer).stored_tokens
                step.annotate(save.req_id, {"flowkv.stored_tokens": stored})
            except Exception:
                # A store that fails is a later miss; inference goes on.
                logger.exception("flowkv: store for request %s failed", save.req_id)

    def _step_trace(self, meta: FlowKVMetadata) -> _StepTrace:
        """This step's trace root, opened by the first hook of the step that has work."""
        if self._step is None:
            self._step = _StepTrace(self._engine.tracer, next(self._step_seq), meta,
                                    layerwise=bool(self._engine.layerwise))
        return self._step

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads and saves are synchronous: nothing is ever pending."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load came back short since the last call (vLLM recomputes them)."""
        failed, self._load_error_blocks = self._load_error_blocks, set()
        return failed

    # ==========================================================================
    # Stats: worker numbers -> vLLM's stats loggers and Prometheus
    # ==========================================================================

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What the worker's engine did since the last call (vLLM asks after every step)."""
        if self._engine is None:
            return None
        from flowkv.integration.metrics import FlowKVStats, snapshot

        with self._engine_lock:
            now = snapshot(self._engine.stats())
            latencies = self._engine.drain_latencies()
        interval = FlowKVStats.between(self._stats_at_last_report or {"counters": {}}, now, latencies)
        self._stats_at_last_report = now
        return None if interval.is_empty() else interval

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuild the stats a worker sent (vLLM calls this where it aggregates them)."""
        from flowkv.integration.metrics import FlowKVStats

        return FlowKVStats(data=dict(data) if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """The ``vllm:flowkv_*`` Prometheus metrics (see ``flowkv.integration.metrics``)."""
        from flowkv.integration.metrics import FlowKVPromMetrics

        return FlowKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        """Stop serving lookups, close the engine, write out its traces."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._engine is not None:
            with self._engine_lock:
                self._engine.close()
            self._engine = None
            from flowkv import telemetry

            telemetry.flush()
        if self._lookup_client is not None:
            self._lookup_client.close()
            self._lookup_client = None
