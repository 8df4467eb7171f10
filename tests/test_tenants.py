"""Tenants sharing one cache: who a tenant is, quotas, and the per-tenant numbers.

Tenant A floods a cache with new documents while tenant B's few documents
stay within B's quota: B reads all of them back (exact hit counts), A's
evictions are counted, and A never holds more than its quota. The same
flood without quotas evicts B (the contrast). On the memory tier in this
process, and through a real ``flowkv server`` with quotas in its own
pipeline file.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
import types
import urllib.request
from pathlib import Path

import anyio
import pytest
import torch

from flowkv import payload as payloads
from flowkv.pipeline import load_pipeline
from flowkv.tiers.disk import DiskTier

from flowkv import KVTransfer
from flowkv._testing.paged import make_paged_kv, random_slot_mapping
from flowkv.bench.tenants import (CHUNK_TOKENS, DOC_CHUNKS, flood, flood_geometry, memory_engine, memory_tenants,
                                  node_engine, server_pipeline)
from flowkv.tenants import tenant_of
from flowkv.tiers.node_protocol import NodeConnection

from node_servers import node_servers, scraped  # noqa: F401  (fixture)

MIB = 2**20
A_DOCS, B_DOCS = 40, 4
CAPACITY = 4 * MIB
QUOTA = 2 * MIB


def chunk_bytes() -> int:
    return math.prod(flood_geometry().chunk_shape(CHUNK_TOKENS)) * flood_geometry().dtype.itemsize


def check_quota_flood(result: dict) -> None:
    """B untouched, A held at its quota by evicting only its own entries: exact counts."""
    a, b = result["tenants"]["A"], result["tenants"]["B"]
    assert result["b_hit_chunks"] == B_DOCS * DOC_CHUNKS
    # Every read of B's came after the flood: its hits are exactly its chunks, none missed.
    assert b["hits"] - result["before_reads"]["B"]["hits"] == B_DOCS * DOC_CHUNKS
    assert b["misses"] == 0 and b["evictions"] == 0
    assert b["entries"] == B_DOCS * DOC_CHUNKS
    a_fits = QUOTA // chunk_bytes()
    assert a["entries"] == a_fits
    assert a["evictions"] == A_DOCS * DOC_CHUNKS - a_fits
    assert result["a_most_bytes"] <= QUOTA == a["quota"]


def check_plain_flood(result: dict) -> None:
    """One LRU for both: the flood took every chunk of B's."""
    b = result["tenants"]["B"]
    assert result["b_hit_chunks"] == 0
    assert b["evictions"] == B_DOCS * DOC_CHUNKS and b["entries"] == 0
    assert result["tenants"]["A"]["bytes"] == CAPACITY


def test_tenant_is_the_tag_then_the_cache_salt_then_default():
    assert tenant_of({"tenant": "acme", "cache_salt": "s"}) == "acme"
    assert tenant_of({"cache_salt": "s", "lora": "x"}) == "s"
    assert tenant_of({"lora": "x"}) == tenant_of(None) == "default"


def test_memory_tier_flood_within_quotas_leaves_b_alone():
    engine = memory_engine("4MiB", {"A": "2MiB", "B": "2MiB"})
    try:
        check_quota_flood(flood(engine, memory_tenants(engine), a_docs=A_DOCS, b_docs=B_DOCS))
    finally:
        engine.close()


def test_memory_tier_flood_without_quotas_evicts_b():
    engine = memory_engine("4MiB", None)
    try:
        check_plain_flood(flood(engine, memory_tenants(engine), a_docs=A_DOCS, b_docs=B_DOCS))
    finally:
        engine.close()


def test_cache_salt_names_the_tenant_when_no_tag_does():
    engine = memory_engine("4MiB", {"A": "2MiB", "B": "2MiB"})
    try:
        check_quota_flood(flood(engine, memory_tenants(engine), a_docs=A_DOCS, b_docs=B_DOCS,
                                tenant_key="cache_salt"))
    finally:
        engine.close()


def test_unnamed_tenants_take_the_default_quota_and_fold_past_the_label_limit():
    engine = memory_engine("4MiB", {"default": "128KiB"})
    geometry = flood_geometry()
    kv = make_paged_kv(geometry, 64, seed=1)
    slots = random_slot_mapping(CHUNK_TOKENS * DOC_CHUNKS, geometry, 64, seed=2)
    try:
        for index in range(20):  # 20 tenants, one document each: the label limit is 16
            ids = torch.randint(0, 32000, (CHUNK_TOKENS * DOC_CHUNKS,), generator=torch.Generator().manual_seed(index))
            engine.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots, tags={"tenant": f"t{index}"}))
        tenants = engine.storage.stats()["memory"]["tenants"]
        assert sorted(tenants) == sorted(["default", *(f"t{i}" for i in range(16))])
        # 128 KiB is 2 chunks: a document of 4 keeps its first 2 (the store stops at the quota, as at
        # a full memory: backpressure), and nobody's entry was evicted for it.
        for label, numbers in tenants.items():
            folded = 4 if label == "default" else 1
            assert (numbers["entries"], numbers["quota_refusals"], numbers["evictions"]) == (
                2 * folded, folded, 0), label
        assert tenants["t3"]["quota"] == tenants["default"]["quota"] == 128 * 1024
    finally:
        engine.close()


def test_a_tenant_at_quota_with_nothing_evictable_stops_at_once_and_others_still_store():
    """Fair under pressure: A's pinned entries stop A's store (backpressure), never B's."""
    engine = memory_engine("4MiB", {"A": "1MiB", "B": "1MiB"})
    geometry = flood_geometry()
    kv = make_paged_kv(geometry, 64, seed=1)
    tokens = CHUNK_TOKENS * DOC_CHUNKS
    slots = random_slot_mapping(tokens, geometry, 64, seed=2)

    def doc(seed: int) -> torch.Tensor:
        return torch.randint(0, 32000, (tokens,), generator=torch.Generator().manual_seed(seed))

    try:
        for seed in range(4):  # 16 chunks of 64 KiB: A is at its quota
            assert engine.store(KVTransfer(tokens=doc(seed), kv_caches=kv, slot_mapping=slots,
                                           tags={"tenant": "A"})).stored_tokens == tokens
            # Pin each document as a lookup would: nothing of A's can be evicted any more.
            assert engine.lookup(doc(seed), pin=True, tags={"tenant": "A"}, lookup_id=f"hold-{seed}") == tokens
        assert engine.store(KVTransfer(tokens=doc(99), kv_caches=kv, slot_mapping=slots,
                                       tags={"tenant": "A"})).stored_tokens == 0
        assert engine.store(KVTransfer(tokens=doc(100), kv_caches=kv, slot_mapping=slots,
                                       tags={"tenant": "B"})).stored_tokens == tokens
        tenants = engine.storage.stats()["memory"]["tenants"]
        assert tenants["A"]["quota_refusals"] == 1 and tenants["A"]["entries"] == 4 * DOC_CHUNKS
        assert tenants["B"]["entries"] == DOC_CHUNKS
    finally:
        engine.close()


def test_a_promoted_chunk_is_the_readers():
    """A chunk read back into memory from a lower tier lands as the reading tenant's entry."""
    engine = memory_engine("4MiB", {"B": "1MiB"})
    geometry = flood_geometry()
    kv = make_paged_kv(geometry, 64, seed=1)
    slots = random_slot_mapping(CHUNK_TOKENS, geometry, 64, seed=2)
    ids = torch.arange(CHUNK_TOKENS)
    try:
        engine.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots, tags={"tenant": "B"}))
        mask = engine.retrieve(KVTransfer(tokens=ids, kv_caches=make_paged_kv(geometry, 64, seed=3),
                                          slot_mapping=slots, tags={"tenant": "B"})).ret_mask
        assert int(mask.sum()) == CHUNK_TOKENS
        tier = engine.storage.tier("memory")
        assert [tier.tenant_of(key) for key in tier.keys()] == ["B"]
    finally:
        engine.close()


# -- through a node server -------------------------------------------------------------


def server_flood(node_servers, quotas, name: str):  # noqa: F811
    folder = node_servers.folder
    server = node_servers(name, memory="4MiB",
                          pipeline=server_pipeline(folder, quotas) if quotas else None)
    engine = node_engine(server.socket)
    conn = NodeConnection.connect(server.socket, timeout_s=10.0)
    try:
        return server, flood(engine, lambda: conn.call("stats")["memory"]["tenants"], a_docs=A_DOCS, b_docs=B_DOCS)
    finally:
        conn.close()
        engine.close()


@pytest.fixture(scope="module")
def quota_flood(node_servers):  # noqa: F811
    """A server with quotas for A and B, flooded once: (server, the flood's result). Its tests only read it."""
    return server_flood(node_servers, {"A": "2MiB", "B": "2MiB"}, "quotas")


def test_node_server_flood_within_quotas_leaves_b_alone(quota_flood):
    server, result = quota_flood
    check_quota_flood(result)
    # flowkv server status shows each tenant, as text and as JSON.
    cli = [sys.executable, "-m", "flowkv.cli", "server", "status", "--socket", str(server.socket)]
    text = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
    assert f"tenant B: {B_DOCS * DOC_CHUNKS} entries" in text and "of 2.0 MiB quota" in text
    shown = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True).stdout)
    assert shown["memory"]["tenants"]["A"]["evictions"] == result["tenants"]["A"]["evictions"]


def test_node_server_flood_without_quotas_evicts_b(node_servers):  # noqa: F811
    _, result = server_flood(node_servers, None, "plain")
    check_plain_flood(result)


def test_a_server_tenant_from_the_wire_is_cleaned_not_refused(node_servers):  # noqa: F811
    server = node_servers("wire", memory="4MiB")
    conn = server.connect()
    try:
        conn.hello("t")
        reply = conn.call("alloc", sizes=[4096], tenant={"not": "a name"})
        assert len(reply["objs"]) == 1
        assert "default" in conn.call("stats")["memory"]["tenants"]
    finally:
        conn.close()


# -- the disk tier ---------------------------------------------------------------------

DISK_ENTRY = torch.zeros(1024, dtype=torch.uint8)  # each file holds one payload of this


def disk_pipeline(folder, quotas: str | None) -> Path:
    """A pipeline file whose disk tier has ``quotas`` (a TOML inline table, or none)."""
    size = len(payloads.encode(DISK_ENTRY, "none"))
    text = (f'[tiers.memory]\nkind = "memory"\ncapacity = "1MiB"\n\n[tiers.disk]\nkind = "disk"\n'
            f'path = "{folder / "disk"}"\ncapacity = {64 * size}\n')
    if quotas is not None:
        text += f"quotas = {quotas}\n"
    path = folder / "disk.toml"
    path.write_text(text, encoding="utf-8")
    return path


def disk_tier(pipeline: Path) -> DiskTier:
    spec = load_pipeline(pipeline).tiers["disk"]
    return DiskTier(name="disk", config=spec.config)


def disk_flood(tier: DiskTier, *, a_entries: int = 100, b_entries: int = 8) -> dict:
    def blob(key: str) -> bytes:  # a payload is bound to the key it is stored under
        return payloads.encode(DISK_ENTRY, "none", key=key)

    async def flood_and_read() -> int:
        await tier.put([(f"b/{i}", blob(f"b/{i}"), "B") for i in range(b_entries)])
        for i in range(a_entries):
            await tier.put([(f"a/{i}", blob(f"a/{i}"), "A")])
        found = await tier.get([f"b/{i}" for i in range(b_entries)] + ["b/never-stored"], tenant="B")
        return sum(blob is not None for blob in found)

    b_hits = anyio.run(flood_and_read)
    return {"b_hits": b_hits, "tenants": tier.stats()["tenants"], "size": len(blob("a/0"))}


def test_disk_tier_flood_within_quotas_leaves_b_alone(tmp_path):
    size = len(payloads.encode(DISK_ENTRY, "none"))
    tier = disk_tier(disk_pipeline(tmp_path, f'{{ A = {32 * size}, B = {32 * size} }}'))
    result = disk_flood(tier)
    a, b = result["tenants"]["A"], result["tenants"]["B"]
    assert result["b_hits"] == b["hits"] == 8 and b["evictions"] == 0 and b["entries"] == 8
    assert b["misses"] == 1  # the reader is told: its miss counts for it
    assert a["entries"] == 32 and a["evictions"] == 100 - 32 and a["bytes"] <= a["quota"] == 32 * size


def test_disk_tier_flood_without_quotas_evicts_b(tmp_path):
    result = disk_flood(disk_tier(disk_pipeline(tmp_path, None)))
    b = result["tenants"]["B"]
    assert result["b_hits"] == b["hits"] == 0 and b["evictions"] == 8 and b["entries"] == 0


def test_disk_tier_keeps_each_entrys_tenant_across_a_restart_and_a_new_quota_applies_at_start(tmp_path):
    size = len(payloads.encode(DISK_ENTRY, "none"))
    pipeline = disk_pipeline(tmp_path, f'{{ A = {32 * size}, B = {32 * size} }}')
    disk_flood(disk_tier(pipeline))
    restarted = disk_tier(pipeline)  # a new process would read the same folder the same way
    tenants = restarted.stats()["tenants"]
    assert (tenants["A"]["entries"], tenants["B"]["entries"]) == (32, 8)
    # A's quota lowered in the pipeline file: the next start sheds A's oldest, and only A's.
    pipeline = disk_pipeline(tmp_path, f'{{ A = {16 * size}, B = {32 * size} }}')
    lowered = disk_tier(pipeline).stats()["tenants"]
    assert (lowered["A"]["entries"], lowered["A"]["evictions"], lowered["B"]["entries"]) == (16, 16, 8)
    files = sorted(p.name for p in (tmp_path / "disk").rglob("*.kv"))
    assert len(files) == 24
    assert sum(name.endswith(".41.kv") for name in files) == 16  # "A" in hex, in the file's name


def test_a_node_server_writes_each_tenant_to_its_disk(node_servers, tmp_path):  # noqa: F811
    """The server's lower tier gets each chunk's tenant with it (and keeps it in the file name)."""
    folder = node_servers.folder
    disk = folder / "lower"
    server_file = folder / "server-disk.toml"
    server_file.write_text(f'[pipeline]\nname = "s"\n\n[tiers.memory]\nkind = "memory"\n\n'
                           f'[tiers.disk]\nkind = "disk"\npath = "{disk}"\ncapacity = "64MiB"\n', encoding="utf-8")
    server = node_servers("lower", memory="4MiB", pipeline=server_file)
    engine = node_engine(server.socket)
    geometry = flood_geometry()
    kv = make_paged_kv(geometry, 64, seed=1)
    slots = random_slot_mapping(CHUNK_TOKENS * DOC_CHUNKS, geometry, 64, seed=2)
    try:
        engine.store(KVTransfer(tokens=torch.arange(CHUNK_TOKENS * DOC_CHUNKS), kv_caches=kv, slot_mapping=slots,
                                tags={"tenant": "B"}))
    finally:
        engine.close()
    server.stop()  # drains the lower queue and flushes the disk's writes
    names = [p.name for p in disk.rglob("*.kv")]
    assert len(names) == DOC_CHUNKS and all(name.endswith(".42.kv") for name in names)  # "B" in hex


def test_node_server_metrics_carry_a_tenant_label(quota_flood):
    server, result = quota_flood
    url = server.status()["metrics"]
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    a, b = result["tenants"]["A"], result["tenants"]["B"]
    samples = scraped(text)
    assert samples[("flowkv_server_tenant_evictions_total", (("tenant", "A"),))] == a["evictions"]
    assert samples[("flowkv_server_tenant_hits_total", (("tenant", "B"),))] == b["hits"]
    assert samples[("flowkv_server_tenant_quota_bytes", (("tenant", "B"),))] == QUOTA
    assert samples[("flowkv_server_tenant_entries", (("tenant", "B"),))] == B_DOCS * DOC_CHUNKS


def test_vllm_metrics_count_each_tenant_under_its_label():
    """The connector's ``vllm:flowkv_tenant_*`` series, from one interval of an engine's stats."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from flowkv.integration.vllm.metrics import FlowKVPromMetrics, FlowKVStats, snapshot

    engine = memory_engine("4MiB", {"A": "2MiB", "B": "2MiB"})
    try:
        before = snapshot(engine.stats())
        engine.drain_latencies()
        result = flood(engine, memory_tenants(engine), a_docs=A_DOCS, b_docs=B_DOCS)
        stats = FlowKVStats.between(before, snapshot(engine.stats()), engine.drain_latencies())
    finally:
        engine.close()
    registry = CollectorRegistry()
    metric_types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = FlowKVPromMetrics(types.SimpleNamespace(kv_transfer_config=None), metric_types, ["engine"], {0: ["0"]})
    metrics.observe(stats.data, engine_idx=0)

    def value(name: str, tenant: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", "tier": "memory", "tenant": tenant})

    a, b = result["tenants"]["A"], result["tenants"]["B"]
    assert value("vllm:flowkv_tenant_hits_total", "B") == b["hits"] == B_DOCS * DOC_CHUNKS
    assert value("vllm:flowkv_tenant_evictions_total", "A") == a["evictions"] > 0
    assert value("vllm:flowkv_tenant_evictions_total", "B") is None  # never counted: B lost nothing
    assert value("vllm:flowkv_tenant_bytes", "A") == a["bytes"] <= QUOTA
    assert value("vllm:flowkv_tenant_quota_bytes", "B") == QUOTA
    assert all(key.isprintable() for key in stats.reduce())  # per-tenant keys stay out of vLLM's log line


# -- the fleet ---------------------------------------------------------------------------


def test_the_controller_sums_each_tenant_over_the_fleet(quota_flood, tmp_path):
    """A node server (through flowkv node-report) and an in-process engine both hold tenant B's
    chunks: the controller's /tenants, /metrics and dashboard table show their sum."""
    from fleet_helpers import ControllerProcess, wait_for
    from test_controller_node import holder, node_report

    controller = ControllerProcess(tmp_path / "controller", token="t", heartbeat_s=0.3, timeout_s=2.0).start()
    server, result = quota_flood
    follower = node_report(controller, server.socket, tmp_path)
    local = memory_engine("4MiB", None)
    reporting = holder(controller, local, "local")
    try:
        geometry = flood_geometry()
        local.store(KVTransfer(tokens=torch.arange(CHUNK_TOKENS * 2), kv_caches=make_paged_kv(geometry, 64, seed=1),
                               slot_mapping=random_slot_mapping(CHUNK_TOKENS * 2, geometry, 64, seed=2),
                               tags={"tenant": "B"}))
        expected_b = B_DOCS * DOC_CHUNKS + 2
        fleet = wait_for(lambda: (lambda t: t if t.get("B", {}).get("entries") == expected_b else None)(
            controller.get("/tenants")), "both holders' tenant numbers reach the controller")
        assert fleet["A"]["evictions"] == result["tenants"]["A"]["evictions"]
        assert fleet["B"]["hits"] == result["tenants"]["B"]["hits"]  # the local engine read nothing
        text = controller.get("/metrics")  # a reader's call (every endpoint but /health needs a token)
        assert f'flowkv_fleet_tenant_entries{{tenant="B"}} {expected_b}' in text
    finally:
        reporting.close()
        local.close()
        follower.terminate()
        follower.wait()
        controller.close()


def test_bench_tenants_prints_the_flood_table_with_and_without_quotas():
    """``flowkv bench tenants`` as the README runs it (memory tier only, small): the rows follow from the sizes."""
    out = subprocess.run([sys.executable, "-m", "flowkv.cli", "bench", "tenants", "--no-server", "--capacity", "1MiB",
                          "--a-docs", "10", "--b-docs", "2"], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("memory tier")]
    assert len(rows) == 2, out
    plain, quotas = rows
    per_tenant = (MIB // 2) // chunk_bytes()  # each tenant's quota is half of 1 MiB
    # no quotas: 16 chunks of room, B's 8 go first under A's 40; with quotas A keeps its newest 8.
    assert plain[4:7] == ["0%", "8", str(10 * DOC_CHUNKS + 2 * DOC_CHUNKS - MIB // chunk_bytes() - 8)], out
    assert quotas[-5:-2] == ["100%", "0", str(10 * DOC_CHUNKS - per_tenant)], out


def test_a_quota_changed_in_the_servers_pipeline_file_applies_at_its_next_start(node_servers):  # noqa: F811
    folder = node_servers.folder / "requota"
    folder.mkdir()
    server_pipeline(folder, {"A": "1MiB"})
    server = node_servers("requota", memory="4MiB", pipeline=folder / "server.toml")
    assert server.status()["memory"]["tenants"]["A"]["quota"] == MIB
    server_pipeline(folder, {"A": "3MiB", "B": "512KiB"})
    assert server.status()["memory"]["tenants"]["A"]["quota"] == MIB  # read at start only
    server.stop()
    server.start()
    tenants = server.status()["memory"]["tenants"]
    assert (tenants["A"]["quota"], tenants["B"]["quota"]) == (3 * MIB, MIB // 2)


def test_a_room_given_back_unfilled_is_no_longer_charged_to_its_tenant():
    engine = memory_engine("4MiB", {"A": "1MiB"})
    try:
        tier = engine.storage.tier("memory")
        room = tier.allocate(flood_geometry().chunk_shape(CHUNK_TOKENS), flood_geometry().dtype, tenant="A")
        assert tier.stats().tenants["A"]["bytes"] == chunk_bytes()  # a room being filled counts
        room.ref_down()  # the store stopped before its put
        assert tier.stats().tenants["A"]["bytes"] == 0
    finally:
        engine.close()


def test_a_flooding_tenant_never_stops_another_tenants_stores_running_beside_it():
    """Two threads on one memory tier: A stores far past its quota while B stores within its own."""
    import threading

    from flowkv.tiers.memory import MemoryTier, MemoryTierConfig

    room = 64 * 1024
    tier = MemoryTier(config=MemoryTierConfig(capacity=64 * room, pin_memory=False, prefault="off",
                                              quotas={"A": 32 * room, "B": 32 * room}))
    tier.open(slab_bytes=room)
    refused: dict[str, int] = {"A": 0, "B": 0}
    a_most = [0]

    def store(tenant: str, count: int) -> None:
        for i in range(count):
            obj = tier.allocate_bytes(room, tenant=tenant)
            if obj is None:
                refused[tenant] += 1
                continue
            tier.put(f"{tenant}/{i}", obj)
            obj.ref_down()
            if tenant == "A":
                a_most[0] = max(a_most[0], tier.stats().tenants["A"]["bytes"])

    flood = threading.Thread(target=store, args=("A", 2000))
    flood.start()
    store("B", 32)
    flood.join()
    tenants = tier.stats().tenants
    assert refused == {"A": 0, "B": 0}
    assert (tenants["B"]["entries"], tenants["B"]["evictions"]) == (32, 0)
    assert tenants["A"]["entries"] == 32 and tenants["A"]["evictions"] == 2000 - 32
    assert a_most[0] <= 32 * room
    assert all(tier.contains(f"B/{i}") for i in range(32))
    tier.close()
