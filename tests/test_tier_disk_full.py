"""The disk tier on a full filesystem: a real 20 MiB filesystem, mounted by the test.

Each test mounts its own small filesystem (tmpfs, and ext4 on a loop device:
block rounding and folders cost space there) under ``tmp_path`` and unmounts it
at the end; mounting needs root, as CI has. A "foreign" file written after the
tier started plays the other users of a shared disk.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flowkv import CacheEngine, KVTransfer
from flowkv.integration.vllm.metrics import snapshot
from flowkv.kernels import KVGeometry
from flowkv.tiers import DiskTier, DiskTierConfig, GuardedTier
from flowkv._testing.paged import make_paged_kv, random_slot_mapping
from redis_servers import make_payload

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root"),
]

MIB = 1 << 20
FS_BYTES = 20 * MIB
PAYLOAD = 256 * 1024
# The pipelines' default disk capacity: far more than the filesystem.
CAPACITY = 20 << 30


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request, tmp_path: Path) -> Iterator[Path]:
    """A 20 MiB filesystem mounted at a folder of ``tmp_path``; unmounted afterwards."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    if request.param == "tmpfs":
        command = ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES // MIB}m,mode=0700", "tmpfs", str(mount_point)]
    else:
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("mkfs.ext4 (e2fsprogs) is not installed")
        image = tmp_path / "fs.img"
        with open(image, "wb") as file:
            file.truncate(FS_BYTES)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
        command = ["mount", "-o", "loop", str(image), str(mount_point)]
    mounted = subprocess.run(command, capture_output=True, text=True)
    assert mounted.returncode == 0, f"{' '.join(command)} failed: {mounted.stderr.strip()}"
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


class Clock:
    """Monotonic seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fill(path: Path, *, leave: int = 0) -> Path:
    """Write a file at ``path`` until the filesystem has at most ``leave`` bytes free (or is full)."""
    block = b"\xa5" * 4096
    with open(path, "wb") as file:
        try:
            while True:
                fs = os.statvfs(path)
                if fs.f_bavail * fs.f_frsize <= leave:
                    break
                file.write(block)
                file.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return path


def key(i: int) -> str:
    return f"tiny-llama/1.0/bfloat16/fp/-/{i:064x}"


def bytes_in_files(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kv"))


def disk_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flowkv.tiers" and r.levelno >= logging.WARNING]


def test_capacity_beyond_the_filesystem_is_lowered_at_start(small_fs, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="flowkv.tiers")
    tier = DiskTier(name="disk", config=DiskTierConfig(path=str(small_fs / "cache"), capacity=CAPACITY))

    stats = tier.stats()
    assert stats["configured_capacity"] == CAPACITY
    assert 0 < stats["capacity"] < FS_BYTES
    assert stats["capacity_shrinks"] == 1 and stats["degraded"] == 0
    (warning,) = disk_warnings(caplog)
    assert "'disk'" in warning and "20.0 GiB" in warning and "using" in warning


async def test_a_filesystem_filled_by_others_evicts_instead_of_failing(small_fs, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="flowkv.tiers")
    root = small_fs / "cache"
    tier = DiskTier(name="disk", config=DiskTierConfig(path=str(root), capacity=CAPACITY), clock=Clock())
    caplog.clear()
    fill(small_fs / "foreign", leave=8 * MIB)  # after the start-up check: the tier learns by ENOSPC

    payloads = {key(i): make_payload(PAYLOAD, seed=i, key=key(i)) for i in range(80)}  # 20 MiB in all
    items = list(payloads.items())
    for start in range(0, len(items), 16):  # batches as write-behind sends them
        await tier.put(items[start:start + 16])

    stats = tier.stats()
    assert stats["nospace_errors"] >= 1, "the filesystem never said it was full"
    assert stats["write_errors"] == 0, "a write failed although older entries could make room"
    assert stats["writes"] == len(payloads)
    assert stats["evictions"] > 0 and stats["degraded"] == 0
    assert stats["capacity"] < 8 * MIB
    # Every byte counted as written is on disk now or was evicted; what is counted as held is on disk.
    assert stats["bytes_used"] == bytes_in_files(root) <= stats["capacity"]
    assert stats["written_bytes"] == stats["evicted_bytes"] + stats["bytes_used"]
    assert stats["written_bytes"] == stats["writes"] * PAYLOAD
    # The newest entries are there and intact.
    assert await tier.get([key(79)]) == [payloads[key(79)]]
    # Many out-of-space errors, one warning (rate-limited), saying what was done.
    (warning,) = disk_warnings(caplog)
    assert "full" in warning and "evicted" in warning and "capacity lowered" in warning


async def test_writes_that_cannot_fit_report_degraded_until_space_returns(small_fs, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="flowkv.tiers")
    clock = Clock()
    root = small_fs / "cache"
    tier = GuardedTier(DiskTier(name="disk", config=DiskTierConfig(path=str(root), capacity=CAPACITY), clock=clock),
                       timeout_s=30.0)
    kept = make_payload(PAYLOAD, seed=-1, key=key(-1))
    await tier.put([(key(-1), kept)])
    caplog.clear()
    foreign = fill(small_fs / "foreign")  # full: not even evicting everything makes room

    for i in range(5):
        await tier.put([(key(i), make_payload(PAYLOAD, seed=i, key=key(i)))])
    stats = tier.stats()
    assert stats["degraded"] == 1 and stats["healthy"] == 0
    assert stats["writes"] == 1 and stats["write_errors"] == 5
    assert stats["written_bytes"] == len(kept) and bytes_in_files(root) == stats["bytes_used"]
    assert stats["failures"] == 0, "a full disk is degraded, not a failing tier: reads go on"
    (warning,) = disk_warnings(caplog)
    assert "degraded" in warning and "1 write(s) failed" in warning

    clock.now += 61  # the next warning may go out, and counts the failures it did not report
    await tier.put([(key(5), make_payload(PAYLOAD, seed=5, key=key(5)))])
    assert "5 write(s) failed" in disk_warnings(caplog)[-1]

    foreign.unlink()
    clock.now += 31  # the tier measures the filesystem again
    caplog.clear()
    await tier.put([(key(6), make_payload(PAYLOAD, seed=6, key=key(6)))])
    stats = tier.stats()
    assert stats["degraded"] == 0 and stats["healthy"] == 1
    assert stats["capacity"] > 10 * MIB
    assert await tier.get([key(6)]) == [make_payload(PAYLOAD, seed=6, key=key(6))]
    assert any("writes succeed again" in line for line in disk_warnings(caplog))


def test_the_engine_reports_the_bytes_the_disk_stored(small_fs) -> None:
    geometry = KVGeometry("cpu", num_layers=4, num_kv_heads=4, head_size=64, block_size=16, dtype=torch.bfloat16)
    chunk = 64  # 64 tokens x 4 KiB: 256 KiB per chunk
    root = small_fs / "cache"
    engine = CacheEngine.from_pipeline("cpu-disk", geometry=geometry, model_name="tiny", overrides={
        "chunk_size": chunk, "tiers.memory.capacity": "8MiB", "tiers.disk.path": str(root),
        "tiers.disk.timeout_s": 30.0,  # a busy machine must not turn a write into a guard timeout
    })
    try:
        fill(small_fs / "foreign", leave=10 * MIB)
        kv = make_paged_kv(geometry, 64, seed=1)
        for doc in range(10):  # 80 chunks, 20 MiB
            tokens = torch.randint(0, 32000, (8 * chunk,), generator=torch.Generator().manual_seed(doc))
            engine.store(KVTransfer(tokens=tokens, kv_caches=kv,
                                    slot_mapping=random_slot_mapping(len(tokens), geometry, 64, seed=doc)))
            assert engine.flush(timeout_s=60.0)
        stats = engine.stats()
        disk = stats["tiers"]["disk"]
        assert disk["evictions"] > 0 and disk["write_errors"] == 0 and disk["healthy"] == 1
        assert stats["tier.disk.written_bytes"] == disk["written_bytes"] == disk["evicted_bytes"] + disk["bytes_used"]
        assert disk["bytes_used"] == bytes_in_files(root)
        # What Prometheus gets (vllm:flowkv_tier_written_bytes_total, tier_healthy).
        numbers = snapshot(stats)
        assert numbers["counters"]["tier.disk.written_bytes"] == disk["written_bytes"]
        assert numbers["gauges"]["tier.disk.healthy"] == 1
    finally:
        engine.close()
