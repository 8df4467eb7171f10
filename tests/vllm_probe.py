"""A recording FlowKVConnector: what vLLM hands each connector hook, and when.

vLLM loads it like flowkv's own connector (``kv_connector="FlowKVProbe"``,
``kv_connector_module_path="vllm_probe"``); it behaves exactly as
``FlowKVConnector`` and appends one JSON line per hook call to the file named
by ``$FLOWKV_PROBE_LOG``, from every vLLM process. ``t`` is
``time.monotonic_ns()``, one clock for all processes of the machine.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from typing import Any

import torch

from flowkv.integration.vllm import FlowKVConnector, FlowKVMetadata

LOG_ENV = "FLOWKV_PROBE_LOG"
# A request tag: report this request's failed asynchronous load through its blocks only, never as a
# failed receive (what vLLM does then is a fact the tests check).
QUIET_FAILURES_TAG = "probe_quiet_failures"


def _record(role: str, hook: str, **fields: Any) -> None:
    line = json.dumps({"role": role, "hook": hook, "pid": os.getpid(), "t": time.monotonic_ns(), **fields})
    with open(os.environ[LOG_ENV], "a", encoding="utf-8") as log:
        log.write(line + "\n")


def _ids(block_ids: Any) -> Any:
    """Block ids as vLLM gave them, with tuples kept apart from lists."""
    if isinstance(block_ids, tuple):
        return {"tuple": [_ids(group) for group in block_ids]}
    return list(block_ids) if block_ids is not None else None


def _thread_cores() -> dict[str, list[int]]:
    """Each live thread of this process (by name) and the cores it may run on."""
    cores = {}
    for thread in threading.enumerate():
        try:
            cores[thread.name] = sorted(os.sched_getaffinity(thread.native_id))
        except (OSError, TypeError):  # ended meanwhile, or not started
            continue
    return cores


class FlowKVProbe(FlowKVConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self._role_name = role.name.lower()
        self._quiet_failures: set[str] = set()
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec if kv_cache_config else None
        _record(
            self._role_name, "init",
            instance_id=vllm_config.instance_id,
            kv_load_failure_policy=self._kv_transfer_config.kv_load_failure_policy,
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
            disable_hybrid_kv_cache_manager=vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=getattr(spec, "num_kv_heads", None),
            head_size=getattr(spec, "head_size", None),
        )

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        _record("scheduler", "get_num_new_matched_tokens", req_id=request.request_id,
                num_computed_tokens=num_computed_tokens, num_tokens=request.num_tokens,
                kv_transfer_params=request.kv_transfer_params, cache_salt=request.cache_salt,
                result=list(result))
        return result

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        _record("scheduler", "update_state_after_alloc", req_id=request.request_id,
                block_ids=_ids(blocks.get_block_ids()), num_external_tokens=num_external_tokens)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        _record(
            "scheduler", "build_connector_meta",
            new_reqs=[{"req_id": r.req_id, "block_ids": _ids(r.block_ids),
                       "num_computed_tokens": r.num_computed_tokens} for r in scheduler_output.scheduled_new_reqs],
            cached_reqs=[{"req_id": req_id, "new_block_ids": _ids(cached.new_block_ids[i]),
                          "num_computed_tokens": cached.num_computed_tokens[i]}
                         for i, req_id in enumerate(cached.req_ids)],
            cached_new_token_ids=[list(ids) for ids in cached.new_token_ids],
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
            loads=[{"req_id": s.req_id, "start": s.start, "end": s.end, "load_async": s.load_async}
                   for s in meta.loads],
            saves=len(meta.saves),
            idle=meta.idle,
            total_num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            torch_threads=torch.get_num_threads(),
        )
        return meta

    def update_connector_output(self, connector_output):
        _record("scheduler", "update_connector_output",
                finished_recving=sorted(connector_output.finished_recving or ()),
                failed_recving=sorted(connector_output.failed_recving or ()),
                invalid_block_ids=sorted(connector_output.invalid_block_ids or ()))
        super().update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        result = super().request_finished(request, block_ids)
        _record("scheduler", "request_finished", req_id=request.request_id, block_ids=_ids(block_ids),
                result=[result[0], result[1]])
        return result

    # -- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        first = next(iter(kv_caches.values()))
        _record(
            "worker", "register_kv_caches",
            names=list(kv_caches),
            shapes=[list(t.shape) for t in kv_caches.values()],
            contiguous=[t.is_contiguous() for t in kv_caches.values()],
            storages=[t.untyped_storage().data_ptr() for t in kv_caches.values()],
            storage_bytes=first.untyped_storage().nbytes(),
            offsets_bytes=[t.data_ptr() - t.untyped_storage().data_ptr() for t in kv_caches.values()],
            layer_bytes=[t.numel() * t.element_size() for t in kv_caches.values()],
        )
        super().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata):
        loads = connector_metadata.loads if isinstance(connector_metadata, FlowKVMetadata) else []
        _record("worker", "bind_connector_metadata", loads=[{"req_id": s.req_id, "start": s.start, "end": s.end,
                                                             "load_async": s.load_async} for s in loads])
        for load in loads:
            if load.tags.get(QUIET_FAILURES_TAG):
                self._quiet_failures.add(load.req_id)
        super().bind_connector_metadata(connector_metadata)

    def get_transfer_results(self, finished_req_ids):
        started = time.monotonic()
        results = super().get_transfer_results(finished_req_ids)
        took_s = time.monotonic() - started
        # A request tagged QUIET_FAILURES_TAG has its failed load reported by its blocks only.
        quiet = results.failed_recving & self._quiet_failures
        results.failed_recving -= quiet
        _record("worker", "get_transfer_results", finished_req_ids=sorted(finished_req_ids),
                finished_recving=sorted(results.finished_recving), failed_recving=sorted(results.failed_recving),
                quieted=sorted(quiet), took_s=took_s)
        return results

    def clear_connector_metadata(self):
        _record("worker", "clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs):
        attn = forward_context.attn_metadata
        _record("worker", "start_load_kv", attn_metadata=None if attn is None else type(attn).__name__)
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name):
        _record("worker", "wait_for_layer_load", layer=layer_name)
        super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        slots = getattr(attn_metadata, "slot_mapping", None)
        _record("worker", "save_kv_layer", layer=layer_name, shape=list(kv_layer.shape),
                kv_layer_ptr=kv_layer.data_ptr(), attn_metadata=type(attn_metadata).__name__,
                slot_mapping_dtype=str(slots.dtype) if slots is not None else None,
                num_actual_tokens=getattr(attn_metadata, "num_actual_tokens", None))
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        _record("worker", "wait_for_save", caller_cores=sorted(os.sched_getaffinity(0)), threads=_thread_cores(),
                torch_threads=torch.get_num_threads())
        super().wait_for_save()

    def get_block_ids_with_load_errors(self):
        _record("worker", "get_block_ids_with_load_errors")
        return super().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self):
        _record(self._role_name, "get_kv_connector_stats")
        return super().get_kv_connector_stats()


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    return int(re.search(r"\.(\d+)\.", name).group(1))
