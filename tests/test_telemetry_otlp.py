"""A real pipeline exporting to a real OTLP receiver (gRPC and HTTP), started by the test."""

from __future__ import annotations

import torch

from flowkv import CacheEngine, KVTransfer, telemetry
from flowkv.kernels import KVGeometry
from flowkv.testing import make_paged_kv, random_slot_mapping
from otlp_receiver import otlp_grpc_receiver, otlp_http_receiver  # noqa: F401 - fixtures

STORE = ["tokenize", "chunk-hash", "allocate", "gather", "compress", "put"]
RETRIEVE = ["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"]


def run_workload(endpoint: str, protocol: str) -> None:
    g = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    engine = CacheEngine.from_pipeline(
        "local-cpu-lz4",
        geometry=g,
        model_name="tiny",
        overrides={
            "chunk_size": 32,
            "tiers.memory.capacity": "4MiB",
            "telemetry.exporter": "otlp",
            "telemetry.endpoint": endpoint,
            "telemetry.protocol": protocol,
        },
    )
    src = make_paged_kv(g, 16, seed=0)
    dst = make_paged_kv(g, 16, seed=1, fill=False)
    tokens = torch.arange(100)
    slots = random_slot_mapping(100, g, 16, seed=2)
    engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots, request_id="r-store"))
    engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots, request_id="r-load"))
    telemetry.flush()


def check_spans(spans) -> None:
    roots = {s.span_id: s for s in spans if s.name in ("flowkv.store", "flowkv.retrieve")}
    assert {r.name for r in roots.values()} == {"flowkv.store", "flowkv.retrieve"}
    for root_name, stage_names, request_id in (("flowkv.store", STORE, "r-store"),
                                               ("flowkv.retrieve", RETRIEVE, "r-load")):
        [root] = [r for r in roots.values() if r.name == root_name]
        children = [s for s in spans if s.parent_span_id == root.span_id]
        # One span per stage, in the pipeline's order, each a child of its run's root.
        in_order = sorted(children, key=lambda s: s.attributes["flowkv.stage.index"])
        assert [s.name for s in in_order] == stage_names
        for span in children:
            attributes = span.attributes
            assert attributes["flowkv.stage"] == span.name
            assert attributes["flowkv.request_id"] == request_id
            assert attributes["flowkv.stage.source"].startswith(("/", ".")) and ".toml:" in attributes["flowkv.stage.source"]
            assert attributes["flowkv.own_time_ns"] >= 0
            assert "flowkv.items_in" in attributes and "flowkv.items_out" in attributes
        moved = {s.name: s.attributes for s in children}
        mover = "gather" if root_name == "flowkv.store" else "scatter"
        assert moved[mover]["flowkv.bytes"] == 3 * 32 * 2 * 2 * 2 * 16 * 2  # 3 chunks x tokens x layers x kv x heads x dim x 2 B
        assert moved[mover]["flowkv.items_out"] == 3
    [lookup] = [s for s in spans if s.parent_span_id in roots and s.name == "lookup"]
    assert lookup.attributes["flowkv.hit_tokens"] == 96
    assert lookup.attributes["flowkv.chunks"] == 3


def test_otlp_grpc_export_of_a_real_pipeline(otlp_grpc_receiver) -> None:
    run_workload(otlp_grpc_receiver.endpoint, "grpc")
    check_spans(otlp_grpc_receiver.wait_for_spans(14))


def test_otlp_http_export_of_a_real_pipeline(otlp_http_receiver) -> None:
    run_workload(otlp_http_receiver.endpoint.removesuffix("/v1/traces"), "http/protobuf")
    check_spans(otlp_http_receiver.wait_for_spans(14))
