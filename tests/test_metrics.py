"""Connector stats and Prometheus metrics from a real engine's numbers."""

from __future__ import annotations

import functools
import types

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flowkv import CacheEngine, KVTransfer
from flowkv.integration.vllm.metrics import FlowKVPromMetrics, FlowKVStats, snapshot
from flowkv.kernels import KVGeometry
from flowkv.testing import make_paged_kv, random_slot_mapping


def run_engine() -> tuple[CacheEngine, dict, dict]:
    g = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    engine = CacheEngine.from_pipeline("local-cpu", geometry=g, model_name="tiny",
                                       overrides={"chunk_size": 32, "tiers.memory.capacity": "4MiB"})
    before = snapshot(engine.stats())
    engine.drain_latencies()
    src = make_paged_kv(g, 16, seed=0)
    dst = make_paged_kv(g, 16, seed=1, fill=False)
    tokens = torch.arange(100)
    slots = random_slot_mapping(100, g, 16, seed=2)
    engine.lookup(tokens)  # miss
    engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    engine.lookup(tokens, pin=True, lookup_id="a")  # 96 of 100
    engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots, lookup_id="a"))
    return engine, before, snapshot(engine.stats())


def test_interval_stats_are_counter_increases_and_latencies() -> None:
    engine, before, after = run_engine()
    stats = FlowKVStats.between(before, after, engine.drain_latencies())
    counters = stats.data["counters"]
    assert counters["lookups"] == 2 and counters["stores"] == 1 and counters["retrieves"] == 1
    assert counters["lookup_requested_tokens"] == 200
    assert counters["lookup_hit_tokens"] == 96
    assert counters["stored_tokens"] == 96 and counters["retrieved_tokens"] == 96
    chunk_bytes = 32 * 2 * 2 * 2 * 16 * 2
    assert counters["tier.memory.written_bytes"] == 3 * chunk_bytes
    assert counters["tier.memory.read_bytes"] == 3 * chunk_bytes
    assert len(stats.data["latency_ms"]["lookup"]) == 2
    reduced = stats.reduce()
    assert reduced["hit_rate"] == 0.48
    assert reduced["store_ms_avg"] > 0
    assert not stats.is_empty()

    # Two workers' intervals add up; an interval with nothing in it is empty.
    total = FlowKVStats(data={"counters": {}, "gauges": {}, "latency_ms": {}})
    assert total.is_empty()
    total.aggregate(stats).aggregate(stats)
    assert total.data["counters"]["lookup_hit_tokens"] == 192
    assert len(total.data["latency_ms"]["retrieve"]) == 2
    total.reset()
    assert total.is_empty()


def test_prometheus_metrics_record_an_interval() -> None:
    engine, before, after = run_engine()
    stats = FlowKVStats.between(before, after, engine.drain_latencies())
    registry = CollectorRegistry()
    metric_types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = types.SimpleNamespace(kv_transfer_config=None)
    metrics = FlowKVPromMetrics(config, metric_types, ["model_name", "engine"], {0: ["tiny", "0"]})

    metrics.observe(stats.data, engine_idx=0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})

    assert value("vllm:flowkv_requests_total", op="lookup") == 2
    assert value("vllm:flowkv_requests_total", op="retrieve") == 1
    assert value("vllm:flowkv_hit_tokens_total") == 96
    assert value("vllm:flowkv_requested_tokens_total") == 200
    assert value("vllm:flowkv_hit_rate") == 0.48
    assert value("vllm:flowkv_tier_written_bytes_total", tier="memory") == 3 * 32 * 2 * 2 * 2 * 16 * 2
    assert value("vllm:flowkv_tier_healthy", tier="memory") == 1
    assert value("vllm:flowkv_pinned_objects") == 0
    assert value("vllm:flowkv_store_seconds_count") == 1
    assert value("vllm:flowkv_lookup_seconds_count") == 2


def test_the_blend_counters_become_prometheus_counters() -> None:
    engine, _, before = run_engine()
    # What the worker counts after each blend (flowkv.integration.vllm.worker._blended).
    engine.count("blend_reused_tokens", 896)
    engine.count("blend_recomputed_tokens", 120)
    stats = FlowKVStats.between(before, snapshot(engine.stats()), engine.drain_latencies())
    assert stats.reduce()["blend_reused_tokens"] == 896
    registry = CollectorRegistry()
    metric_types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = FlowKVPromMetrics(types.SimpleNamespace(kv_transfer_config=None), metric_types, ["engine"], {0: ["0"]})
    metrics.observe(stats.data, engine_idx=0)
    assert registry.get_sample_value("vllm:flowkv_blend_reused_tokens_total", {"engine": "0"}) == 896
    assert registry.get_sample_value("vllm:flowkv_blend_recomputed_tokens_total", {"engine": "0"}) == 120
