"""Payloads read back from real disk files and a real redis-server are untrusted input.

A payload moved or planted under another key, or one whose codec
parameters do not parse (nested past the parser's limit, wrong types), is
a corrupt entry: counted, removed where the tier can, a miss — and the tier
stays healthy, so the honest entries around it keep being served.
"""

from __future__ import annotations

import shutil
import struct
import uuid
from pathlib import Path

import pytest
import torch
import xxhash

from node_servers import CHUNK, chunk_kv, engine, keys_of, kv_for, slots_for
from redis_servers import RedisServer, redis_server  # noqa: F401 - redis_server is a fixture

from flowkv import KVTransfer, payload
from flowkv.pipeline import dumps_pipeline
from flowkv.tiers import DiskTier, DiskTierConfig, GuardedTier, RedisTier, RedisTierConfig
from flowkv.tiers.disk import key_digest

TOKENS = 160  # 10 chunks
STORE = ["tokenize", "chunk-hash", "allocate", "gather", ("compress", {"codec": "zstd"}), "put"]
RETRIEVE = ["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pipeline(folder: Path, name: str, tier: dict) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(dumps_pipeline(pipeline={"name": name, "chunk_size": CHUNK},
                                   tiers={"memory": {"kind": "memory", "capacity": "8MiB"}, "lower": tier},
                                   store=STORE, retrieve=RETRIEVE), encoding="utf-8")
    return path


def stored(path: Path) -> tuple[list[str], torch.Tensor]:
    """Ten chunks stored through an engine and written behind to its lower tier; their keys."""
    e = engine(path)
    ids = torch.arange(TOKENS)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(11),
                              slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS
    keys = keys_of(e, ids)
    assert e.storage.flush(timeout_s=60.0)
    e.close()
    return keys, ids


def retrieved(path: Path, ids: torch.Tensor) -> tuple[int, dict]:
    """A fresh engine (empty memory) loads what it can from the lower tier: tokens loaded, its stats."""
    e = engine(path)
    slots = slots_for(TOKENS)
    dst = kv_for(12)
    loaded = int(e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask.sum())
    assert torch.equal(chunk_kv(dst, slots[:loaded]), chunk_kv(kv_for(11), slots[:loaded]))
    stats = e.stats()
    stats["health"] = {name: state.value for name, state in e.storage.health().items()}
    e.close()
    return loaded, stats


def nested_params(blob: bytes) -> bytes:
    """``blob`` re-signed (as a forger with write access would) with codec parameters nested
    30,000 deep: past the JSON parser's recursion limit."""
    prefix = struct.Struct("<4sHHBBHIQQ")
    values = list(prefix.unpack_from(blob))
    header = payload.read_header(blob)
    params = b"[" * 30_000 + b"]" * 30_000
    head = bytearray(blob[:header.header_length - 8 - values[5]]) + params
    values[5], values[6] = len(params), len(head) + 8
    head[:prefix.size] = prefix.pack(*values)
    return bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head))) + blob[header.header_length:]


def disk_file(root: Path, key: str) -> Path:
    digest = key_digest(key)
    return root / digest[:2] / f"{digest}.kv"


def test_a_disk_payload_moved_under_another_key_is_a_removed_miss_and_the_rest_is_served(tmp_path):
    disk = tmp_path / "disk"
    path = pipeline(tmp_path, "disk-moved", {"kind": "disk", "path": str(disk), "capacity": "64MiB"})
    keys, ids = stored(path)
    # Chunk 3's file copied over chunk 5's (a rename, or a plant by someone who can write the folder).
    shutil.copyfile(disk_file(disk, keys[3]), disk_file(disk, keys[5]))
    loaded, stats = retrieved(path, ids)
    assert loaded == 5 * CHUNK  # chunks 0-4, then the refused one ends the prefix
    assert stats["tiers"]["lower"]["corrupt"] == 1
    assert not disk_file(disk, keys[5]).exists() and disk_file(disk, keys[3]).exists()
    assert stats["health"]["lower"] == "healthy"
    # Chunk 5 stored again (its file was removed), then all ten are served.
    stored(path)
    assert retrieved(path, ids)[0] == TOKENS


@pytest.mark.anyio
async def test_a_disk_payload_whose_params_nest_too_deep_is_corrupt_and_the_tier_stays_healthy(tmp_path):
    tier = GuardedTier(DiskTier(name="disk", config=DiskTierConfig(path=str(tmp_path), capacity=1 << 26)),
                       timeout_s=30.0)
    kv = torch.ones(2, 2, 16, 4, 8, dtype=torch.bfloat16)
    good = [(f"k{i}", payload.encode(kv * i, "zstd", key=f"k{i}")) for i in range(3)]
    await tier.put(good)
    disk_file(tmp_path, "k1").write_bytes(nested_params(good[1][1]))
    # Before this was fixed, the read raised RecursionError: a tier failure, the file kept, the next read the same.
    assert await tier.get(["k0", "k1", "k2"]) == [good[0][1], None, good[2][1]]
    assert tier.state.value == "healthy" and tier.stats().get("failures", 0) == 0
    assert tier.tier.stats()["corrupt"] == 1 and not disk_file(tmp_path, "k1").exists()
    assert await tier.get(["k1", "k2"]) == [None, good[2][1]]
    await tier.aclose()


def test_a_redis_value_copied_under_another_key_is_a_counted_miss(redis_server: RedisServer, tmp_path):
    import redis

    namespace = f"trust-{uuid.uuid4().hex[:8]}"
    path = pipeline(tmp_path, "redis-moved", {"kind": "redis", "url": redis_server.url, "namespace": namespace})
    keys, ids = stored(path)
    names = RedisTier(name="lower", config=RedisTierConfig(url=redis_server.url, namespace=namespace))
    client = redis.Redis.from_url(redis_server.url)
    client.set(names.storage_key(keys[4]), client.get(names.storage_key(keys[2])))
    loaded, stats = retrieved(path, ids)
    assert loaded == 4 * CHUNK
    assert stats["corrupt_payloads"] == 1
    assert stats["health"]["lower"] == "healthy"
    # The honest value written back, all ten load again.
    client.delete(names.storage_key(keys[4]))
    stored(path)
    assert retrieved(path, ids)[0] == TOKENS
    client.close()


@pytest.mark.anyio
async def test_a_redis_value_whose_params_nest_too_deep_is_corrupt_and_the_tier_stays_healthy(
        redis_server: RedisServer):
    config = RedisTierConfig(url=redis_server.url, namespace=f"trust-{uuid.uuid4().hex[:8]}")
    tier = GuardedTier(RedisTier(name="remote", config=config), timeout_s=10.0)
    kv = torch.ones(2, 2, 16, 4, 8, dtype=torch.bfloat16)
    good = payload.encode(kv, "zstd", key="k0")
    await tier.put([("k0", good), ("k1", nested_params(payload.encode(kv, "zstd", key="k1")))])
    for _ in range(3):
        assert await tier.get(["k0", "k1"]) == [good, None]
    assert tier.state.value == "healthy" and tier.stats().get("failures", 0) == 0
    assert tier.tier.stats()["corrupt"] == 3
    await tier.aclose()
