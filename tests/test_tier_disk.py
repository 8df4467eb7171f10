"""The disk tier: files, restart, eviction, admission, corruption, broken folders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import attrs
import pytest

from flowkv.registry import resolve_tier
from flowkv.tiers import DiskTier, DiskTierConfig, GuardedTier
from flowkv.tiers.disk import key_digest
from local_users import needs_root
from redis_servers import make_payload

pytestmark = pytest.mark.anyio

KIB = 1024


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def disk_tier(path: Path, *, capacity: int = 1 << 20, **options) -> DiskTier:
    config = DiskTierConfig(path=str(path), capacity=capacity, **options)
    return DiskTier(name="disk", config=config)


def chunk_key(i: int) -> str:
    return f"tiny-llama/1.0/bfloat16/fp/-/{i:064x}"


def payload_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv"))


def file_of(root: Path, key: str) -> Path:
    digest = key_digest(key)
    return root / digest[:2] / f"{digest}.kv"


async def test_round_trip_keeps_bytes_and_counts_hits(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    entries = [(chunk_key(i), make_payload(10 * KIB + i, seed=i, key=chunk_key(i))) for i in range(5)]
    await tier.put(entries)

    assert await tier.exists([chunk_key(0), chunk_key(99), chunk_key(4)]) == [True, False, True]
    got = await tier.get([key for key, _ in entries] + [chunk_key(99)])
    assert got[:5] == [payload for _, payload in entries]
    assert got[5] is None
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (5, 1, 5)
    assert stats["bytes_used"] == sum(len(p) for _, p in entries)
    assert len(payload_files(tmp_path)) == 5


async def test_keys_are_opaque_and_never_escape_the_folder(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = disk_tier(root)
    hostile = ["../../etc/passwd", "/abs/path", "a/b/../c", "with space/ü/\\", "." , ""]
    entries = [(key, make_payload(1 * KIB, seed=i, key=key)) for i, key in enumerate(hostile)]
    await tier.put(entries)

    assert await tier.get(hostile) == [payload for _, payload in entries]
    everything = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert everything and all(root in p.parents for p in everything)
    # One shard level named by the digest's first byte.
    assert {p.parent.name for p in everything} == {key_digest(k)[:2] for k in hostile}


async def test_restarted_tier_finds_the_cache_warm(tmp_path: Path) -> None:
    entries = [(chunk_key(i), make_payload(4 * KIB, seed=i, key=chunk_key(i))) for i in range(8)]
    first = disk_tier(tmp_path)
    await first.put(entries)
    await first.aclose()

    second = disk_tier(tmp_path)
    assert second.stats()["entries"] == 8
    assert second.stats()["bytes_used"] == sum(len(p) for _, p in entries)
    assert await second.get([key for key, _ in entries]) == [payload for _, payload in entries]


async def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    size = 10 * KIB
    tier = disk_tier(tmp_path, capacity=3 * size)
    a, b, c, d = (chunk_key(i) for i in range(4))
    await tier.put([(k, make_payload(size, seed, key=k)) for k, seed in ((a, 1), (b, 2), (c, 3))])
    assert await tier.get([a]) != [None]  # a is now more recent than b

    await tier.put([(d, make_payload(size, 4, key=d))])

    assert await tier.exists([a, b, c, d]) == [True, False, True, True]
    assert not file_of(tmp_path, b).exists()
    stats = tier.stats()
    assert stats["evictions"] == 1 and stats["bytes_used"] <= 3 * size
    assert len(payload_files(tmp_path)) == 3


async def test_recency_survives_a_restart(tmp_path: Path) -> None:
    size = 10 * KIB
    a, b, c, d = (chunk_key(i) for i in range(4))
    first = disk_tier(tmp_path, capacity=3 * size)
    for key, seed in ((a, 1), (b, 2), (c, 3)):
        await first.put([(key, make_payload(size, seed, key=key))])
    await first.get([a])
    # Reading a stamps its file; give the stamps distinct times whatever the clock's grain.
    os.utime(file_of(tmp_path, b), (1_000_000, 1_000_000))
    os.utime(file_of(tmp_path, c), (1_000_001, 1_000_001))

    second = disk_tier(tmp_path, capacity=3 * size)
    await second.put([(d, make_payload(size, 4, key=d))])
    assert await second.exists([a, b, c, d]) == [True, False, True, True]


async def test_smaller_capacity_on_restart_sheds_oldest(tmp_path: Path) -> None:
    size = 10 * KIB
    first = disk_tier(tmp_path, capacity=10 * size)
    for i in range(4):
        await first.put([(chunk_key(i), make_payload(size, i, key=chunk_key(i)))])
        os.utime(file_of(tmp_path, chunk_key(i)), (1_000_000 + i, 1_000_000 + i))

    second = disk_tier(tmp_path, capacity=2 * size)
    assert await second.exists([chunk_key(i) for i in range(4)]) == [False, False, True, True]
    assert len(payload_files(tmp_path)) == 2


async def test_payload_larger_than_capacity_is_declined(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path, capacity=4 * KIB)
    await tier.put([(chunk_key(0), make_payload(8 * KIB, key=chunk_key(0)))])
    assert await tier.exists([chunk_key(0)]) == [False]
    assert tier.stats()["too_large"] == 1


async def test_admission_writes_only_keys_offered_twice(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path, admit_after=2)
    once, twice = chunk_key(1), chunk_key(2)
    await tier.put([(once, make_payload(KIB, 1, key=once)), (twice, make_payload(KIB, 2, key=twice))])
    assert await tier.exists([once, twice]) == [False, False]
    assert payload_files(tmp_path) == []

    await tier.put([(twice, make_payload(KIB, 2, key=twice))])
    assert await tier.exists([once, twice]) == [False, True]
    assert tier.stats()["admission_declined"] == 2


async def test_flipped_byte_is_a_miss_and_the_file_goes(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    key, payload = chunk_key(7), make_payload(16 * KIB, 7, key=chunk_key(7))
    await tier.put([(key, payload)])
    path = file_of(tmp_path, key)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))

    assert await tier.get([key]) == [None]
    assert tier.stats()["corrupt"] == 1
    assert not path.exists()
    assert await tier.exists([key]) == [False]
    assert tier.stats()["bytes_used"] == 0


async def test_truncated_file_is_a_miss(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    key, payload = chunk_key(8), make_payload(16 * KIB, 8, key=chunk_key(8))
    await tier.put([(key, payload)])
    path = file_of(tmp_path, key)
    with open(path, "r+b") as file:
        file.truncate(len(payload) // 3)

    restarted = disk_tier(tmp_path)  # a crash before fsync looks like this after restart
    assert await restarted.get([key]) == [None]
    assert restarted.stats()["corrupt"] == 1
    assert not path.exists()


async def test_leftover_temp_files_are_removed_on_start(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path)
    key = chunk_key(3)
    await tier.put([(key, make_payload(KIB, 3, key=key))])
    shard = file_of(tmp_path, key).parent
    digest = key_digest(chunk_key(4))
    leftover = shard / f".{digest}.4242.deadbeef.tmp"
    leftover.write_bytes(make_payload(KIB, 4)[:100])  # a write cut short by a kill

    restarted = disk_tier(tmp_path)
    assert not leftover.exists()
    assert restarted.stats()["temp_files_removed"] == 1
    assert restarted.stats()["entries"] == 1
    assert await restarted.get([key, chunk_key(4)]) == [make_payload(KIB, 3, key=key), None]


async def test_folder_that_is_a_file_degrades_to_misses(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("occupied")
    tier = disk_tier(blocker)

    await tier.put([(chunk_key(1), make_payload(KIB, 1, key=chunk_key(1)))])
    assert await tier.get([chunk_key(1)]) == [None]
    assert await tier.exists([chunk_key(1)]) == [False]
    assert tier.stats()["write_errors"] == 1


async def test_folder_lost_while_running_degrades_to_misses(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = GuardedTier(disk_tier(root), timeout_s=5.0)
    await tier.put([(chunk_key(1), make_payload(KIB, 1, key=chunk_key(1)))])
    shutil.rmtree(root)
    root.write_text("the disk went away")

    assert await tier.get([chunk_key(1)]) == [None]
    await tier.put([(chunk_key(2), make_payload(KIB, 2, key=chunk_key(2)))])
    assert await tier.get([chunk_key(2)]) == [None]
    stats = tier.stats()
    assert stats["read_errors"] == 1 and stats["write_errors"] == 1
    # The tier answered every call itself: the guard saw no failure.
    assert stats["failures"] == 0 and stats["healthy"] == 1


async def test_folder_removed_while_running_is_made_again_by_the_next_write(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = disk_tier(root)
    await tier.put([(chunk_key(1), make_payload(KIB, 1, key=chunk_key(1)))])
    shutil.rmtree(root)  # an operator or a cleaner, not a lost disk

    # A key in the same shard folder as the lost one: its write makes the folders again, first time.
    same_shard = next(chunk_key(i) for i in range(2, 10_000) if key_digest(chunk_key(i))[:2] == key_digest(chunk_key(1))[:2])
    await tier.put([(same_shard, make_payload(KIB, 2, key=same_shard))])
    assert await tier.get([same_shard]) == [make_payload(KIB, 2, key=same_shard)]
    assert await tier.get([chunk_key(1)]) == [None]
    assert tier.stats()["write_errors"] == 0 and file_of(root, same_shard).exists()


_PERMISSION_CHILD = """
import json, os, sys
from pathlib import Path
import anyio
sys.path.insert(0, sys.argv[1])
from test_tier_disk import KIB, chunk_key, disk_tier, file_of, make_payload

root = Path(sys.argv[2])

async def main():
    tier = disk_tier(root)
    await tier.put([(chunk_key(1), make_payload(KIB, 1, key=chunk_key(1)))])
    os.chmod(file_of(root, chunk_key(1)), 0)
    root.chmod(0o500)
    try:
        await tier.put([(chunk_key(2), make_payload(KIB, 2, key=chunk_key(2)))])
        got = await tier.get([chunk_key(1), chunk_key(2)])
        return {**tier.stats(), "answers": [blob is None for blob in got]}
    finally:
        root.chmod(0o700)

print(json.dumps(anyio.run(main)))
"""


@needs_root
def test_permission_denied_degrades_to_misses(tmp_path: Path) -> None:
    # Root ignores file modes: the tier runs in a process of root without the capabilities that let
    # it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so a file of mode 0 and a folder of 0500 refuse it
    # as they refuse any user. (A new process, not a fork of this multi-threaded one.)
    root = tmp_path / "cache"
    done = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c",
                           _PERMISSION_CHILD, str(Path(__file__).parent), str(root)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["answers"] == [True, True]  # both misses
    assert stats["write_errors"] == 1 and stats["read_errors"] == 1


async def test_fsync_mode_round_trips(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path, fsync=True)
    await tier.put([(chunk_key(1), make_payload(KIB, 1, key=chunk_key(1)))])
    assert await tier.get([chunk_key(1)]) == [make_payload(KIB, 1, key=chunk_key(1))]
    assert [p.name for p in file_of(tmp_path, chunk_key(1)).parent.iterdir()] == [file_of(tmp_path, chunk_key(1)).name]


def test_config_rejects_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        DiskTierConfig(path=str(tmp_path), capacity=0)
    with pytest.raises(ValueError, match="admit_after must be a positive integer"):
        DiskTierConfig(path=str(tmp_path), capacity=1, admit_after=0)
    with pytest.raises(TypeError, match="fsync"):
        DiskTierConfig(path=str(tmp_path), capacity=1, fsync="yes")


def test_disk_is_a_registered_tier_kind(tmp_path: Path) -> None:
    info = resolve_tier("disk")
    assert info.cls is DiskTier and info.config_cls is DiskTierConfig
    assert {f.name for f in attrs.fields(DiskTierConfig)} == {"path", "capacity", "admit_after", "fsync", "quotas", "tenant_labels"}


async def test_real_payloads_are_checked_by_default(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from flowkv import payload

    tier = DiskTier(name="disk", config=DiskTierConfig(path=str(tmp_path), capacity=1 << 20))
    kv = torch.arange(2 * 2 * 16 * 4 * 8, dtype=torch.float32).reshape(2, 2, 16, 4, 8).half()
    keys = [chunk_key(i) for i in range(3)]
    blobs = [payload.encode(kv + i, "zstd", key=keys[i]) for i in range(3)]
    await tier.put(list(zip(keys, blobs)))
    flipped = bytearray(blobs[1])
    flipped[-3] ^= 0x10
    file_of(tmp_path, keys[1]).write_bytes(bytes(flipped))
    file_of(tmp_path, keys[2]).write_bytes(blobs[2][: len(blobs[2]) - 1])

    got = await tier.get(keys)
    assert got[1:] == [None, None] and tier.stats()["corrupt"] == 2
    assert torch.equal(payload.decode(got[0]), kv)
