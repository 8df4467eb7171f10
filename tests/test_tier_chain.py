"""Chained tiers through the cache engine: memory -> disk -> Redis, as one store and one retrieve.

Every test goes through ``CacheEngine`` (lookup / store / retrieve) and checks
the paged cache bit for bit with ``flowkv.kernels.gather``. Where a test needs
a chunk in one tier only, it stores through the whole chain and then takes
the chunk out of the other tiers the way an operator or an eviction would:
``engine.memory.remove``, deleting the disk tier's file, ``DEL`` of the
namespaced Redis key. Redis servers are real (``tests/redis_servers.py``).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest
import redis
import torch

from flowkv import CacheEngine, KVTransfer
from flowkv.items import Request
from flowkv.kernels import KVGeometry, gather
from flowkv.tiers.disk import key_digest
from flowkv._testing.paged import make_paged_kv, random_slot_mapping
from redis_servers import redis_cluster, redis_server  # noqa: F401 - pytest fixtures

CHUNK = 64
NUM_BLOCKS = 64
NUM_CHUNKS = 3
NUM_TOKENS = NUM_CHUNKS * CHUNK
GEOMETRY = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
# How long a background write or prefetch may take to land: readiness, not a performance claim.
SETTLE_S = 30.0
HEALTHY_TIMEOUT_S = 10.0

_namespaces = itertools.count()


def fresh_namespace() -> str:
    """A Redis namespace no other test (or earlier run on the same server) uses."""
    return f"chain-{os.getpid()}-{time.monotonic_ns()}-{next(_namespaces)}"


def make_engine(
    pipeline: str | Path,
    *,
    disk: Path | None = None,
    redis_url: str | None = None,
    namespace: str | None = None,
    **overrides: object,
) -> CacheEngine:
    """A small engine on a built-in pipeline (or a file), pointed at this test's disk folder and Redis."""
    settings: dict[str, object] = {"chunk_size": CHUNK, "tiers.memory.capacity": "8MiB"}
    # A busy test machine must not turn a healthy call into a guard timeout (and a
    # skipped tier); the tests about timeouts set their own.
    if disk is not None:
        settings["tiers.disk.path"] = str(disk)
        settings["tiers.disk.timeout_s"] = HEALTHY_TIMEOUT_S
    if redis_url is not None:
        settings["tiers.redis.url"] = redis_url
        settings["tiers.redis.namespace"] = namespace or fresh_namespace()
        settings["tiers.redis.timeout_s"] = HEALTHY_TIMEOUT_S
    settings.update(overrides)
    return CacheEngine.from_pipeline(pipeline, geometry=GEOMETRY, model_name="tiny", overrides=settings)


def make_tokens(n: int = NUM_TOKENS, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed))


class Workload:
    """One request's tokens, a filled source paged cache, an empty destination and the slots."""

    def __init__(self, n: int = NUM_TOKENS, seed: int = 0, num_blocks: int = NUM_BLOCKS) -> None:
        self.tokens = make_tokens(n, seed)
        self.src = make_paged_kv(GEOMETRY, num_blocks, seed=seed + 100)
        self.dst = make_paged_kv(GEOMETRY, num_blocks, seed=0, fill=False)
        self.slots = random_slot_mapping(n, GEOMETRY, num_blocks, seed=seed + 200)

    def store(self, engine: CacheEngine) -> int:
        return engine.store(KVTransfer(tokens=self.tokens, kv_caches=self.src, slot_mapping=self.slots)).stored_tokens

    def retrieve(self, engine: CacheEngine, **kwargs: object) -> torch.Tensor:
        return engine.retrieve(self.transfer(**kwargs)).ret_mask

    def transfer(self, **kwargs: object) -> KVTransfer:
        """This request's retrieve as a value (``engine.retrieve(it)`` answers a RetrieveResult)."""
        return KVTransfer(tokens=self.tokens, kv_caches=self.dst, slot_mapping=self.slots, **kwargs)

    def keys(self, engine: CacheEngine) -> list[str]:
        """The tier keys of this request's chunks, as the engine computes them."""
        return [k.to_str() for k in engine.chunk_keys(Request(tokens=self.tokens))]

    def assert_loaded(self, ret_mask: torch.Tensor, loaded_tokens: int) -> None:
        """Exactly the first ``loaded_tokens`` came back, bit for bit; the rest of ``dst`` is untouched."""
        expected = torch.zeros(len(self.tokens), dtype=torch.bool)
        expected[:loaded_tokens] = True
        assert torch.equal(ret_mask, expected), f"mask loads {int(ret_mask.sum())} tokens, expected {loaded_tokens}"
        if loaded_tokens:
            head = self.slots[:loaded_tokens]
            assert torch.equal(region(self.dst, head).view(torch.int16), region(self.src, head).view(torch.int16))
        tail = self.slots[loaded_tokens:]
        if len(tail):
            assert not region(self.dst, tail).view(torch.int16).any(), "tokens not loaded were written"


def region(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The KV at ``slots``, gathered out of a paged cache."""
    out = torch.empty(GEOMETRY.chunk_shape(len(slots)), dtype=GEOMETRY.dtype)
    return gather(kv_caches, GEOMETRY, slots, out)


def disk_file(folder: Path, key: str) -> Path:
    """Where the disk tier keeps ``key``'s payload."""
    digest = key_digest(key)
    return folder / digest[:2] / f"{digest}.kv"


def redis_key(engine: CacheEngine, key: str, tier: str = "redis") -> str:
    """The namespaced Redis key holding ``key`` (what ``DEL`` takes)."""
    return engine.slow[tier].tier.storage_key(key)


def tier_stats(engine: CacheEngine, name: str) -> dict:
    return engine.stats()["tiers"][name]


def drop_from_memory(engine: CacheEngine, keys: list[str]) -> None:
    for key in keys:
        assert engine.memory.remove(key), f"{key} was not in memory"


def settle(condition, what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.01)


@pytest.fixture
def redis_client(redis_server):  # noqa: F811 - the fixture imported above
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


# -- round trips ----------------------------------------------------------------


@pytest.mark.parametrize("pipeline", ["local-cpu", "cpu-disk", "cpu-redis", "cpu-disk-redis"])
def test_round_trip_from_memory(pipeline, tmp_path, redis_server):  # noqa: F811
    work = Workload()
    engine = make_engine(pipeline, disk=tmp_path / "disk" if "disk" in pipeline else None,
                         redis_url=redis_server.url if "redis" in pipeline else None)
    try:
        assert work.store(engine) == NUM_TOKENS
        assert engine.lookup(work.tokens) == NUM_TOKENS
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)
        assert tier_stats(engine, "memory")["hits"] == NUM_CHUNKS
    finally:
        engine.close()


@pytest.mark.parametrize("pipeline, tier", [("cpu-disk", "disk"), ("cpu-redis", "redis")])
def test_round_trip_through_one_slow_tier(pipeline, tier, tmp_path, redis_server):  # noqa: F811
    """Stored, written behind, dropped from memory: retrieve reads the slow tier and loads exact bits."""
    work = Workload()
    if tier == "disk":
        engine = make_engine(pipeline, disk=tmp_path / "disk")
    else:
        engine = make_engine(pipeline, redis_url=redis_server.url)
    try:
        assert work.store(engine) == NUM_TOKENS
        assert engine.flush(SETTLE_S)
        assert tier_stats(engine, tier)["writes"] == NUM_CHUNKS
        drop_from_memory(engine, work.keys(engine))
        assert engine.lookup(work.tokens) == NUM_TOKENS
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)
        assert tier_stats(engine, tier)["hits"] == NUM_CHUNKS
    finally:
        engine.close()


def test_round_trip_through_the_chain_each_tier_in_turn(tmp_path, redis_server, redis_client):  # noqa: F811
    """One store fills memory, disk and Redis; each lower tier then serves the request alone."""
    work = Workload()
    disk = tmp_path / "disk"
    namespace = fresh_namespace()
    engine = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_server.url, namespace=namespace)
    try:
        assert work.store(engine) == NUM_TOKENS
        assert engine.flush(SETTLE_S)
        keys = work.keys(engine)
        assert all(disk_file(disk, key).exists() for key in keys)
        assert all(redis_client.exists(redis_key(engine, key)) for key in keys)
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)  # memory
        assert tier_stats(engine, "disk")["hits"] == 0
    finally:
        engine.close()

    # Restarted: memory is empty, so disk serves (and promotes) every chunk.
    work.dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=0, fill=False)
    engine = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_server.url, namespace=namespace)
    try:
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)
        assert tier_stats(engine, "disk")["hits"] == NUM_CHUNKS
        assert tier_stats(engine, "redis")["hits"] == 0
    finally:
        engine.close()

    # Disk emptied too: Redis serves.
    for key in keys:
        disk_file(disk, key).unlink()
    work.dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=0, fill=False)
    engine = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_server.url, namespace=namespace)
    try:
        assert engine.lookup(work.tokens) == NUM_TOKENS
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)
        assert tier_stats(engine, "redis")["hits"] == NUM_CHUNKS
        assert tier_stats(engine, "disk")["hits"] == 0
    finally:
        engine.close()


def test_restarted_engine_hits_from_disk(tmp_path):
    work = Workload()
    disk = tmp_path / "disk"
    first = make_engine("cpu-disk", disk=disk)
    assert work.store(first) == NUM_TOKENS
    first.close()  # close flushes the write-behind queue

    second = make_engine("cpu-disk", disk=disk)
    try:
        assert tier_stats(second, "memory")["entries"] == 0
        assert tier_stats(second, "disk")["entries"] == NUM_CHUNKS
        assert second.lookup(work.tokens) == NUM_TOKENS
        work.assert_loaded(work.retrieve(second), NUM_TOKENS)
    finally:
        second.close()


# -- promotion and prefetch -----------------------------------------------------


def test_hit_below_memory_is_promoted_then_served_from_memory(tmp_path):
    work = Workload()
    disk = tmp_path / "disk"
    first = make_engine("cpu-disk", disk=disk)
    work.store(first)
    first.close()

    engine = make_engine("cpu-disk", disk=disk)
    try:
        keys = work.keys(engine)
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)
        assert engine.stats()["promotions"] == NUM_CHUNKS
        assert all(engine.memory.contains(key) for key in keys)
        disk_reads = tier_stats(engine, "disk")["hits"]
        memory_hits = tier_stats(engine, "memory")["hits"]

        work.dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=0, fill=False)
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)
        assert tier_stats(engine, "disk")["hits"] == disk_reads  # not read again
        assert tier_stats(engine, "memory")["hits"] == memory_hits + NUM_CHUNKS
    finally:
        engine.close()


def test_prefetch_after_lookup_then_retrieve_reads_memory(tmp_path, redis_server):  # noqa: F811
    work = Workload()
    disk = tmp_path / "disk"
    namespace = fresh_namespace()
    first = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_server.url, namespace=namespace)
    work.store(first)
    first.close()

    engine = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_server.url, namespace=namespace)
    try:
        keys = work.keys(engine)
        assert engine.lookup(work.tokens, pin=True, lookup_id="req-1") == NUM_TOKENS
        assert engine.stats()["prefetches"] == NUM_CHUNKS
        settle(lambda: not engine.prefetch_pending("req-1"), "the prefetch")
        assert all(engine.memory.contains(key) for key in keys)
        assert engine.stats()["promotions"] == NUM_CHUNKS
        disk_reads = tier_stats(engine, "disk")["hits"]
        assert disk_reads == NUM_CHUNKS

        work.assert_loaded(work.retrieve(engine, lookup_id="req-1"), NUM_TOKENS)
        assert tier_stats(engine, "disk")["hits"] == disk_reads  # retrieve only copied from memory
        assert tier_stats(engine, "memory")["hits"] == NUM_CHUNKS
        assert tier_stats(engine, "memory")["pinned_objects"] == 0  # retrieve released the prefetch pins
    finally:
        engine.close()


# -- prefix contiguity across tiers ---------------------------------------------


def spread_over_tiers(tmp_path, redis_url, redis_client, *, gap: bool):
    """Chunk 0 in memory only, chunk 1 on disk only (unless ``gap``), chunk 2 in Redis only.

    One engine stores the request through the whole chain and closes; the disk
    file of chunk 2 and the Redis keys of chunks 0 and 1 are deleted; a second
    engine (so the disk index is rebuilt from the folder) retrieves chunk 0,
    which promotes it to memory, and then chunk 0 is deleted from disk and
    Redis. The returned engine holds each chunk in exactly one tier.
    """
    work = Workload()
    disk = tmp_path / "disk"
    namespace = fresh_namespace()
    first = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_url, namespace=namespace)
    assert work.store(first) == NUM_TOKENS
    assert first.flush(SETTLE_S)
    k0, k1, k2 = work.keys(first)
    redis_keys = [redis_key(first, key) for key in (k0, k1, k2)]
    first.close()

    disk_file(disk, k2).unlink()
    if gap:
        disk_file(disk, k1).unlink()
    assert redis_client.delete(redis_keys[1]) == 1

    engine = make_engine("cpu-disk-redis", disk=disk, redis_url=redis_url, namespace=namespace)
    warm = Workload()  # the same request's first chunk, loaded into a scratch cache
    warm.tokens = work.tokens[:CHUNK]
    warm.slots = work.slots[:CHUNK]
    warm.retrieve(engine)
    assert engine.memory.contains(k0)
    disk_file(disk, k0).unlink()
    assert redis_client.delete(redis_keys[0]) == 1

    assert engine.memory.keys() == [k0]
    assert not disk_file(disk, k0).exists() and not disk_file(disk, k2).exists()
    assert disk_file(disk, k1).exists() is not gap
    assert [bool(redis_client.exists(k)) for k in redis_keys] == [False, False, True]
    return engine, work


def test_chunks_spread_over_three_tiers_are_one_full_hit(tmp_path, redis_server, redis_client):  # noqa: F811
    engine, work = spread_over_tiers(tmp_path, redis_server.url, redis_client, gap=False)
    try:
        disk_reads = tier_stats(engine, "disk")["hits"]
        assert engine.lookup(work.tokens) == NUM_TOKENS
        work.assert_loaded(work.retrieve(engine), NUM_TOKENS)
        assert tier_stats(engine, "disk")["hits"] == disk_reads + 1  # chunk 1
        assert tier_stats(engine, "redis")["hits"] == 1  # chunk 2
    finally:
        engine.close()


def test_a_gap_in_the_middle_tier_stops_the_hit(tmp_path, redis_server, redis_client):  # noqa: F811
    """Chunk 1 is nowhere: chunk 2, though in Redis, is not a hit and is not loaded."""
    engine, work = spread_over_tiers(tmp_path, redis_server.url, redis_client, gap=True)
    try:
        assert engine.lookup(work.tokens) == CHUNK
        work.assert_loaded(work.retrieve(engine), CHUNK)
        assert tier_stats(engine, "redis")["hits"] == 0
        assert engine.stats().get("prefetches", 0) == 0  # nothing below memory was in the hit
    finally:
        engine.close()


# -- Redis deployments ----------------------------------------------------------


def test_cluster_spreads_keys_over_all_masters(tmp_path, redis_cluster):  # noqa: F811
    # 32 keys: the chance that one of three masters gets none is 3 * (2/3)**32, about 1e-5.
    chunks = 32
    work = Workload(chunks * CHUNK, seed=5, num_blocks=chunks * CHUNK // GEOMETRY.block_size)
    engine = make_engine("cpu-redis", redis_url=redis_cluster.url)
    try:
        assert work.store(engine) == chunks * CHUNK
        assert engine.flush(SETTLE_S)
        assert tier_stats(engine, "redis")["writes"] == chunks
        per_master = [int(node.cli("DBSIZE")) for node in redis_cluster.nodes]
        assert sum(per_master) == chunks
        assert all(count > 0 for count in per_master), per_master

        drop_from_memory(engine, work.keys(engine))
        work.assert_loaded(work.retrieve(engine), chunks * CHUNK)
        assert tier_stats(engine, "redis")["hits"] == chunks
    finally:
        engine.close()


def test_two_namespaces_on_one_server_never_see_each_other(redis_server):  # noqa: F811
    work = Workload()
    ours = make_engine("cpu-redis", redis_url=redis_server.url, namespace=fresh_namespace())
    theirs = make_engine("cpu-redis", redis_url=redis_server.url, namespace=fresh_namespace())
    try:
        assert work.store(ours) == NUM_TOKENS
        assert ours.flush(SETTLE_S)
        # Same model, same tokens, same server: only the namespace differs.
        assert theirs.lookup(work.tokens) == 0
        work.assert_loaded(work.retrieve(theirs), 0)
        assert tier_stats(theirs, "redis")["hits"] == 0

        drop_from_memory(ours, work.keys(ours))
        assert ours.lookup(work.tokens) == NUM_TOKENS
        work.assert_loaded(work.retrieve(ours), NUM_TOKENS)
    finally:
        ours.close()
        theirs.close()


# -- flowkv bench tiers -------------------------------------------------------------


def bench_tiers(capsys, *argv: str) -> tuple[int, str, str]:
    import argparse

    from flowkv.bench import tiers as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    status = bench.run(parser.parse_args(list(argv)))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_bench_tiers_measures_every_tier_against_its_raw_medium(capsys, tmp_path, redis_server):  # noqa: F811
    status, out, err = bench_tiers(capsys, "--tokens", "256", "--repeats", "1", "--json",
                                   "--dir", str(tmp_path), "--redis-url", redis_server.url)
    assert status == 0, err
    report = json.loads(out)
    assert report["chunks"] == 1 and report["chunk_bytes"] == 8 << 20
    assert list(report["tiers"]) == ["memory", "disk", "redis"]
    for name, row in report["tiers"].items():
        for figure in ("put_gbps", "get_gbps", "raw_put_gbps", "raw_get_gbps", "lookup_ms"):
            assert row[figure] > 0, (name, figure, row)
        assert row["put_vs_raw"] == pytest.approx(row["put_gbps"] / row["raw_put_gbps"])
    assert list(tmp_path.iterdir()) == []  # its files and its Redis namespace are gone
    client = redis.Redis.from_url(redis_server.url)
    assert not client.keys("flowkv-bench-*")
    client.close()


def test_bench_tiers_without_redis_server_skips_redis_with_a_note(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server to start
    status, out, err = bench_tiers(capsys, "--tokens", "256", "--repeats", "1", "--dir", str(tmp_path))
    assert status == 0, err
    assert "redis   skipped: no --redis-url and no redis-server on PATH" in out
    assert "x raw" in out and out.count("GB/s") >= 2


def test_bench_tiers_rejects_less_than_a_chunk(capsys):
    status, _out, err = bench_tiers(capsys, "--tokens", "100", "--repeats", "1")
    assert status == 1
    assert "--tokens 100 is less than one chunk (256 tokens)" in err
