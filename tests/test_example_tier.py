"""The example third-party tier (examples/sqlite_tier), installed by pip and named in a pipeline file.

pip builds the example's wheel and installs it into a temporary folder (never
the project's venv); the tests put that folder on ``sys.path`` or
``PYTHONPATH``, so flowkv finds ``kind = "sqlite"`` through the real
``flowkv.plugins`` entry point of an installed distribution, and runs the
example's own pipeline file through the cache engine.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from flowkv import CacheEngine
from flowkv.pipeline import PipelineError, load_pipeline
from flowkv.registry import available
from test_tier_chain import (
    CHUNK,
    GEOMETRY,
    HEALTHY_TIMEOUT_S,
    NUM_CHUNKS,
    NUM_TOKENS,
    Workload,
    drop_from_memory,
    tier_stats,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sqlite_tier"
PIPELINE = EXAMPLE / "cpu-sqlite.toml"
DISTRIBUTION = "flowkv-sqlite-tier"


def _installed_in_venv() -> bool:
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the example as pip installed it (dist-info with its entry points)."""
    root = tmp_path_factory.mktemp("sqlite-tier")
    source = root / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    target = root / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
           "--no-index", "--target", str(target), str(source)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    (entry_points,) = target.glob("flowkv_sqlite_tier-0.1.0.dist-info/entry_points.txt")
    assert "sqlite = flowkv_sqlite_tier:SqliteTier" in entry_points.read_text()
    return target


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The installed example importable in this process, for one test."""
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in [m for m in sys.modules if m == "flowkv_sqlite_tier" or m.startswith("flowkv_sqlite_tier.")]:
        del sys.modules[name]


def make_engine(database: Path, **overrides: object) -> CacheEngine:
    settings = {"chunk_size": CHUNK, "tiers.memory.capacity": "8MiB", "tiers.sqlite.path": str(database),
                "tiers.sqlite.timeout_s": HEALTHY_TIMEOUT_S, **overrides}
    return CacheEngine.from_pipeline(PIPELINE, geometry=GEOMETRY, model_name="tiny", overrides=settings)


def test_pipeline_file_needs_the_distribution_installed():
    if _installed_in_venv():
        pytest.skip(f"{DISTRIBUTION} is installed in this venv")
    with pytest.raises(PipelineError, match="unknown tier kind 'sqlite'"):
        load_pipeline(PIPELINE)


def test_entry_point_names_the_tier(installed):
    assert ("sqlite", f"'{DISTRIBUTION}': flowkv_sqlite_tier:SqliteTier") in available()["installed"]
    pipeline = load_pipeline(PIPELINE, overrides={"tiers.sqlite.capacity": "1MiB"})
    spec = pipeline.tiers["sqlite"]
    assert spec.info.cls.__module__ == "flowkv_sqlite_tier"
    assert str(installed) in spec.info.origin
    assert spec.config.capacity == 1 << 20


def test_the_example_pipeline_extends_local_cpu_to_what_it_was_as_a_whole_copy(installed):
    import json

    from pipeline_snapshots import effective, read_snapshot

    assert json.loads(json.dumps(effective(load_pipeline(PIPELINE)))) == read_snapshot("cpu-sqlite")


def test_round_trip_through_the_example_pipeline(installed, tmp_path):
    """Store, restart, retrieve: every chunk comes back from SQLite, bit for bit."""
    database = tmp_path / "kv.sqlite3"
    work = Workload()
    first = make_engine(database)
    assert work.store(first) == NUM_TOKENS
    assert first.flush(30.0)
    assert tier_stats(first, "sqlite")["writes"] == NUM_CHUNKS
    first.close()
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT COUNT(*) FROM chunks").fetchone() == (NUM_CHUNKS,)

    second = make_engine(database)
    try:
        assert tier_stats(second, "memory")["entries"] == 0
        assert second.lookup(work.tokens) == NUM_TOKENS
        work.assert_loaded(work.retrieve(second), NUM_TOKENS)
        assert tier_stats(second, "sqlite")["hits"] == NUM_CHUNKS
        assert second.stats()["promotions"] == NUM_CHUNKS
    finally:
        second.close()


def test_damaged_row_is_a_miss_and_is_deleted(installed, tmp_path):
    database = tmp_path / "kv.sqlite3"
    work = Workload()
    first = make_engine(database)
    work.store(first)
    keys = work.keys(first)
    first.close()
    with sqlite3.connect(database) as db:
        (payload,) = db.execute("SELECT payload FROM chunks WHERE key = ?", (keys[1],)).fetchone()
        damaged = bytes(payload[:-1]) + bytes([payload[-1] ^ 0x01])
        db.execute("UPDATE chunks SET payload = ? WHERE key = ?", (damaged, keys[1]))

    second = make_engine(database)
    try:
        work.assert_loaded(work.retrieve(second), CHUNK)
        assert tier_stats(second, "sqlite")["corrupt"] == 1
        assert second.lookup(work.tokens) == CHUNK  # the damaged row is gone, not promised again
    finally:
        second.close()


def test_capacity_evicts_least_recently_read(installed, tmp_path):
    """Room for two chunks: a third evicts the one read longest ago, not the one written first."""
    database = tmp_path / "kv.sqlite3"
    engine = make_engine(database)
    try:
        probe = Workload(seed=9)
        probe.store(engine)
        assert engine.flush(30.0)
        chunk_bytes = tier_stats(engine, "sqlite")["bytes_used"] // NUM_CHUNKS
    finally:
        engine.close()
    database.unlink()

    engine = make_engine(database, **{"tiers.sqlite.capacity": 2 * chunk_bytes + chunk_bytes // 2})
    try:
        older = Workload(seed=1)  # chunks a0, a1
        older.tokens, older.slots = older.tokens[:2 * CHUNK], older.slots[:2 * CHUNK]
        older.store(engine)
        assert engine.flush(30.0)
        a0, a1 = older.keys(engine)
        drop_from_memory(engine, [a0, a1])
        first_chunk = Workload(seed=1)
        first_chunk.tokens, first_chunk.slots = older.tokens[:CHUNK], older.slots[:CHUNK]
        assert int(first_chunk.retrieve(engine).sum()) == CHUNK  # reads a0 from SQLite: a1 is now the oldest

        newer = Workload(seed=2)
        newer.tokens, newer.slots = newer.tokens[:CHUNK], newer.slots[:CHUNK]
        newer.store(engine)
        assert engine.flush(30.0)
        stats = tier_stats(engine, "sqlite")
        assert stats["writes"] == 3 and stats["evictions"] == 1
        assert stats["bytes_used"] <= stats["capacity"]
        drop_from_memory(engine, [a0])
        assert engine.lookup(older.tokens) == CHUNK  # a0 kept, a1 evicted
    finally:
        engine.close()


def test_cli_shows_the_installed_tier(site, tmp_path):
    """A fresh process with only PYTHONPATH set: ``flowkv pipeline show`` resolves the example's file."""
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    shown = subprocess.run([sys.executable, "-m", "flowkv.cli", "pipeline", "show", "--json", str(PIPELINE)],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0, shown.stderr
    sqlite_tier = json.loads(shown.stdout)["tiers"]["sqlite"]
    assert sqlite_tier["kind"] == "sqlite"
    assert sqlite_tier["implementation"].startswith(f"flowkv_sqlite_tier.SqliteTier ({site}")
    assert sqlite_tier["capacity"] == 10 << 30
