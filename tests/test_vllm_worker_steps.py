"""The connector's worker side in this process, on the steps of a decoding batch: no loads, no saves.

vLLM calls the worker's hooks on every step (and two per attention layer);
with nothing to load or save each must be a constant check that never
reaches the engine. A real ``CacheEngine`` over a synthetic paged cache,
behind a proxy that counts what the hooks touch; vLLM's own metadata and
result types; nothing starts vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from flowkv._testing.paged import make_paged_kv  # noqa: E402
from flowkv.integration.vllm.metadata import FlowKVMetadata  # noqa: E402
from flowkv.integration.vllm.settings import ConnectorSettings  # noqa: E402
from flowkv.integration.vllm.worker import ConnectorWorker  # noqa: E402
from flowkv.kernels import KVGeometry  # noqa: E402
from flowkv.pipeline import load_pipeline  # noqa: E402

BLOCK = 32
GEOMETRY = KVGeometry("cpu", num_layers=3, num_kv_heads=2, head_size=16, block_size=BLOCK, dtype=torch.bfloat16)


class CountingEngine:
    """Stands in front of the worker's engine, counting every attribute the hooks read off it."""

    def __init__(self, engine) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "reads", [])

    def __getattr__(self, name):
        self.reads.append(name)
        return getattr(self._engine, name)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    settings = ConnectorSettings.from_extra_config({"pipeline": "local-cpu", "tiers.memory.capacity": "16MiB",
                                                    "ipc_dir": str(tmp_path)}, default_model="tiny")
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1, pipeline_parallel_size=1),
        instance_id="test-worker", kv_transfer_config=None, kv_events_config=None,
        # the layers' attention backends (none here: the layout is found from the tensors)
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    spec = SimpleNamespace(num_kv_heads=GEOMETRY.num_kv_heads, head_size=GEOMETRY.head_size)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    worker = ConnectorWorker(config, kv_cache_config, settings,
                             load_pipeline(settings.pipeline, overrides=settings.overrides))
    monkeypatch.setattr(worker, "_worker_rank", lambda: 0)  # vLLM's process groups are not set up here
    layers = make_paged_kv(GEOMETRY, 16, seed=0)
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)})
    yield worker
    worker.shutdown()


def decode_step(worker, meta, layer_names) -> None:
    """The worker's hooks of one step, in vLLM's order (tests/test_vllm_hooks.py checks the order)."""
    worker.bind_connector_metadata(meta)
    for name in layer_names:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, meta)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    worker.take_transfer_results(set())
    worker.get_block_ids_with_load_errors()
    worker.get_kv_connector_stats()
    worker.get_kv_connector_kv_cache_events()


def test_steps_without_loads_or_saves_never_reach_the_engine(worker):
    names = list(worker._layer_index)
    decode_step(worker, FlowKVMetadata(), names)  # the first report of stats
    counting = CountingEngine(worker._engine)
    worker._engine = counting
    try:
        for _ in range(50):
            decode_step(worker, FlowKVMetadata(), names)
    finally:
        worker._engine = counting._engine
    # One read a step: the stats' change counter (vLLM asks for stats after every step).
    assert counting.reads == ["accounting"] * 50, sorted(set(counting.reads))
    assert worker._step is None and worker._layer_loads == [] and worker._layer_saves is None
