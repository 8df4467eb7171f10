"""The disk tier on a machine with other users: private modes, no links followed, no foreign folder used.

The other user is ``nobody`` (``local_users``): root ignores file modes, so
"cannot read" is shown by a process that is not root.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import anyio
import pytest

from flowkv.tiers import DiskTier, DiskTierConfig, GuardedTier
from flowkv.tiers.disk import key_digest
from local_users import NOBODY, as_nobody, needs_root, shared_folder  # noqa: F401 - shared_folder is a fixture
from redis_servers import make_payload

pytestmark = pytest.mark.anyio

KIB = 1024
READ_AS_NOBODY = """
import os, sys
root = sys.argv[1]
found = []
for folder, _, files in os.walk(root):
    found.append(folder)
    for name in files:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                print("READ", name, len(f.read()))
        except OSError as exc:
            print("DENIED", name, exc.errno)
try:
    os.listdir(root)
    print("LISTED")
except OSError as exc:
    print("NOT LISTED", exc.errno)
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def disk_tier(path: Path, **options) -> DiskTier:
    return DiskTier(name="disk", config=DiskTierConfig(path=str(path), capacity=1 << 26, **options))


def file_of(root: Path, key: str) -> Path:
    digest = key_digest(key)
    return root / digest[:2] / f"{digest}.kv"


def entry(i: int) -> tuple[str, bytes]:
    key = f"m/1.0/bfloat16/private/{i:064x}"
    return key, make_payload(4 * KIB, seed=i, key=key)


@needs_root
async def test_folders_are_0700_and_files_0600_whatever_the_umask_and_nobody_reads_them(shared_folder):
    root = shared_folder / "cache"
    old = os.umask(0)  # the loosest umask: modes are the tier's own
    try:
        tier = disk_tier(root)
        entries = [entry(i) for i in range(4)]
        await tier.put(entries)
    finally:
        os.umask(old)
    files = sorted(root.rglob("*.kv"))
    assert len(files) == 4
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.parent.stat().st_mode) for f in files} == {0o700}
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    done = as_nobody(READ_AS_NOBODY, str(root))
    assert done.returncode == 0, done.stderr
    assert "READ" not in done.stdout and "NOT LISTED 13" in done.stdout  # EACCES
    # The honest reader (this user) is served.
    assert await tier.get([k for k, _ in entries]) == [p for _, p in entries]


@needs_root
async def test_an_existing_folder_of_this_user_made_loose_is_tightened(shared_folder):
    root = shared_folder / "cache"
    first = disk_tier(root)
    await first.put([entry(1)])
    root.chmod(0o755)  # as an older flowkv made it
    file_of(root, entry(1)[0]).parent.chmod(0o755)
    second = disk_tier(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(file_of(root, entry(1)[0]).parent.stat().st_mode) == 0o700
    assert await second.get([entry(1)[0]]) == [entry(1)[1]]


@needs_root
async def test_a_folder_owned_by_another_user_is_refused_with_a_clear_error(shared_folder, caplog):
    root = shared_folder / "theirs"
    root.mkdir(mode=0o777)
    planted_key, planted = entry(7)
    file_of(root, planted_key).parent.mkdir(mode=0o777)
    file_of(root, planted_key).write_bytes(planted)  # KV they want served into this user's model
    os.chown(root, NOBODY.pw_uid, NOBODY.pw_gid)
    with caplog.at_level(logging.ERROR, logger="flowkv.tiers"):
        tier = GuardedTier(disk_tier(root), timeout_s=30.0)
    assert f"{root} is owned by uid {NOBODY.pw_uid}" in caplog.text and "refusing" in caplog.text
    assert await tier.get([planted_key]) == [None]
    await tier.put([entry(8)])
    assert not file_of(root, entry(8)[0]).exists()  # nothing of this user's written where they can read it
    stats = tier.stats()
    assert stats["refused_folder"] == 1 and stats["entries"] == 0
    assert tier.state.value == "healthy"  # a miss, not a failing tier: inference goes on


@pytest.mark.parametrize("plant", ["symlink", "fifo", "bigger", "hardlink-elsewhere"])
async def test_an_entry_replaced_by_a_link_fifo_or_bigger_file_is_a_miss_that_never_hangs(tmp_path, plant):
    root = tmp_path / "cache"
    tier = GuardedTier(disk_tier(root), timeout_s=30.0)
    (victim_key, victim), (other_key, other) = entry(1), entry(2)
    await tier.put([(victim_key, victim), (other_key, other)])
    path = file_of(root, victim_key)
    outside = tmp_path / "outside.kv"
    path.unlink()
    if plant == "symlink":
        outside.write_bytes(victim)  # an intact payload for this very key: only following the link reads it
        path.symlink_to(outside)
    elif plant == "fifo":
        os.mkfifo(path)  # nobody ever writes it: a plain open() would wait forever
    elif plant == "bigger":
        with open(path, "wb") as f:  # a 256 MiB sparse file under the entry's name
            f.truncate(256 << 20)
    else:
        outside.write_bytes(victim + b"\0" * KIB)
        os.link(outside, path)
    read_before = _bytes_read()
    with anyio.fail_after(60):  # a liveness bound for the FIFO case, not a speed claim
        got = await tier.get([victim_key, other_key])
    assert got == [None, other]
    if plant == "bigger":  # refused by its size, not read whole first (this process's read() bytes)
        assert _bytes_read() - read_before < 16 << 20
    assert tier.tier.stats()["corrupt"] == 1
    assert not os.path.lexists(path)  # the planted thing is gone from the folder; what it pointed at stays
    if plant in ("symlink", "hardlink-elsewhere"):
        assert outside.exists()
    assert tier.state.value == "healthy"
    await tier.put([(victim_key, victim)])  # stored again, served again
    assert await tier.get([victim_key]) == [victim]


async def test_a_restart_never_indexes_links_or_fifos(tmp_path):
    root = tmp_path / "cache"
    first = disk_tier(root)
    await first.put([entry(1)])
    planted_key, planted = entry(5)
    outside = tmp_path / "outside.kv"
    outside.write_bytes(planted)
    file_of(root, planted_key).parent.mkdir(exist_ok=True, mode=0o700)
    file_of(root, planted_key).symlink_to(outside)
    fifo_key = entry(6)[0]
    file_of(root, fifo_key).parent.mkdir(exist_ok=True, mode=0o700)
    os.mkfifo(file_of(root, fifo_key))
    second = disk_tier(root)
    assert second.stats()["entries"] == 1
    assert await second.exists([entry(1)[0], planted_key, fifo_key]) == [True, False, False]
    with anyio.fail_after(60):
        assert await second.get([planted_key, fifo_key, entry(1)[0]]) == [None, None, entry(1)[1]]



def _bytes_read() -> int:
    """Bytes this process has read with read() and its kin, all threads (``/proc/self/io``)."""
    with open("/proc/self/io", encoding="ascii") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))
