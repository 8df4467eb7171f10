"""A flowkv storage tier in one SQLite file: the example of a tier written outside flowkv.

Installed, this distribution names the tier kind ``sqlite`` through the
``flowkv.plugins`` entry-point group, so a pipeline file says::

    [tiers.sqlite]
    kind = "sqlite"
    path = "~/.cache/flowkv/kv.sqlite3"
    capacity = "10GiB"       # payload bytes; the least recently read go first
    timeout_s = 2.0          # the engine's health guard: a slower call is a miss

The tier keeps one row per chunk payload (``key``, ``payload``, ``size``,
``used``). Like every flowkv tier it stores encoded payloads under opaque
string keys, never returns data that fails :func:`flowkv.tiers.verify_payload`
(a damaged row is a miss, counted and deleted), and does its blocking work in
worker threads so the engine's I/O loop stays free for the other tiers.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio.to_thread
import attrs

from flowkv.registry import tier
from flowkv.sizes import parse_size
from flowkv.tiers import Tier, verify_payload

__all__ = ["SqliteTier", "SqliteTierConfig"]

# SQLite allows 999 bound parameters per statement in older builds; stay under it.
_BATCH = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    key     TEXT PRIMARY KEY,
    payload BLOB NOT NULL,
    size    INTEGER NOT NULL,
    used    REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_use ON chunks (used);
"""


def _positive_size(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ValueError(f"sqlite tier {attribute.name} must be positive, got {value!r}")


@attrs.define(frozen=True, kw_only=True)
class SqliteTierConfig:
    """Settings of a :class:`SqliteTier` (the keys of its ``[tiers.NAME]`` table)."""

    #: The database file; its folder is created when missing. One engine process per file.
    path: str = attrs.field(converter=os.fspath)
    #: Payload bytes the file may hold ("10GiB" in a pipeline file).
    capacity: int = attrs.field(converter=parse_size, validator=_positive_size)


@tier("sqlite", config=SqliteTierConfig)
class SqliteTier(Tier):
    """Chunk payloads as rows of one SQLite table, evicted least-recently-read first."""

    def __init__(
        self,
        *,
        name: str,
        config: SqliteTierConfig,
    ) -> None:
        self.name = name
        self.config = config
        self.path = Path(config.path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection used from anyio's worker threads, one statement at a time.
        self._db: sqlite3.Connection | None = sqlite3.connect(self.path, check_same_thread=False,
                                                              isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            (used,) = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM chunks").fetchone()
        self._bytes_used = int(used)
        self._counters = dict.fromkeys(("hits", "misses", "corrupt", "writes", "written_bytes", "evictions"), 0)

    # -- the Tier contract -------------------------------------------------

    async def exists(self, keys: list[str]) -> list[bool]:
        present = await anyio.to_thread.run_sync(self._present, keys)
        return [key in present for key in keys]

    async def get(self, keys: list[str]) -> list[bytes | None]:
        found = await anyio.to_thread.run_sync(self._read, keys)
        results: list[bytes | None] = []
        for key in keys:
            blob = found.get(key)
            self._counters["hits" if blob is not None else "misses"] += 1
            results.append(blob)
        return results

    async def put(self, entries: list[tuple[str, bytes]]) -> None:
        for key, payload in entries:
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise TypeError(f"sqlite tier {self.name!r}: payload for {key!r} is "
                                f"{type(payload).__name__}, not bytes")
        await anyio.to_thread.run_sync(self._write, entries)

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self._close)

    def stats(self) -> dict[str, int | float]:
        return {**self._counters, "bytes_used": self._bytes_used, "capacity": self.config.capacity}

    # -- SQLite (worker threads) -------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"sqlite tier {self.name!r} is closed")
        return self._db

    def _present(self, keys: list[str]) -> set[str]:
        present: set[str] = set()
        with self._lock:
            db = self._connection()
            for batch in _batches(keys):
                marks = ",".join("?" * len(batch))
                present.update(row[0] for row in db.execute(f"SELECT key FROM chunks WHERE key IN ({marks})", batch))
        return present

    def _read(self, keys: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        with self._lock:
            db = self._connection()
            for batch in _batches(list(dict.fromkeys(keys))):
                marks = ",".join("?" * len(batch))
                for key, payload in db.execute(f"SELECT key, payload FROM chunks WHERE key IN ({marks})", batch):
                    found[key] = bytes(payload)
            damaged = [key for key, blob in found.items() if not verify_payload(blob)]
            for key in damaged:
                # A damaged row would be promised by exists() forever: remove it.
                del found[key]
                self._delete(db, key)
                self._counters["corrupt"] += 1
            if found:
                # Recency drives eviction: a chunk read now is kept longer.
                now = time.time()
                db.executemany("UPDATE chunks SET used = ? WHERE key = ?", [(now, key) for key in found])
        return found

    def _write(self, entries: list[tuple[str, bytes]]) -> None:
        with self._lock:
            db = self._connection()
            now = time.time()
            db.execute("BEGIN")
            try:
                for key, payload in entries:
                    size = len(payload)
                    if size > self.config.capacity:
                        continue
                    self._make_room(db, size)
                    # The same key always carries the same payload: an existing row is kept.
                    cursor = db.execute(
                        "INSERT OR IGNORE INTO chunks (key, payload, size, used) VALUES (?, ?, ?, ?)",
                        (key, bytes(payload), size, now),
                    )
                    if cursor.rowcount:
                        self._bytes_used += size
                        self._counters["writes"] += 1
                        self._counters["written_bytes"] += size
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                (used,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM chunks").fetchone()
                self._bytes_used = int(used)
                raise

    def _make_room(self, db: sqlite3.Connection, size: int) -> None:
        while self._bytes_used + size > self.config.capacity:
            row = db.execute("SELECT key FROM chunks ORDER BY used, rowid LIMIT 1").fetchone()
            if row is None:
                return
            self._delete(db, row[0])
            self._counters["evictions"] += 1

    def _delete(self, db: sqlite3.Connection, key: str) -> None:
        row = db.execute("DELETE FROM chunks WHERE key = ? RETURNING size", (key,)).fetchone()
        if row is not None:
            self._bytes_used -= int(row[0])

    def _close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _batches(keys: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(keys), _BATCH):
        yield keys[start:start + _BATCH]
