"""Real ``flowkv server`` processes for the node-server tests, and what their clients need.

- ``NodeServerProcess``: one server process (``python -m flowkv.cli server``) on a
  socket in a short temporary folder, started, stopped (SIGTERM), killed
  (SIGKILL) and restarted on the same socket; ``status()`` asks it over the
  socket; ``segments()`` the arenas (memfds) it holds. ``node_servers``
  (fixture factory) starts them and, at the end, stops them.
- ``node_pipeline``: a pipeline file whose tiers include a ``server`` tier.
- ``hold`` (stage ``node_servers:hold``): holds a store after ``gather`` until a
  file exists, so a test can kill a client, or let two clients commit at once,
  while their rooms are allocated and not committed.
- ``geometry``, ``kv_for``: the small KV geometry and deterministic paged KV
  the engine-level clients share (two processes with one seed see the same KV);
  ``engine`` and ``keys_of`` for the tests' own engines.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from flowkv import stage
from flowkv.items import Chunk
from flowkv.pipeline import dumps_pipeline
from flowkv.tiers.node_protocol import SEGMENT_NAME_PREFIX, NodeConnection, read_operator_token

ROOT = Path(__file__).resolve().parent.parent
# How long a server may take to say it is ready (python start and torch import): a readiness
# wait, not a performance claim.
READY_S = 60.0
CHUNK = 16  # tokens per chunk in the engine-level tests


class NodeServerProcess:
    """One ``flowkv server`` process on ``socket``; restartable on the same socket."""

    def __init__(self, socket: Path, *, memory: str = "64MiB", pipeline: str | Path | None = None,
                 lease_timeout_s: float = 30.0, metrics: bool = True, log: Path | None = None,
                 extra: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.socket = socket
        self.extra = list(extra)  # more `flowkv server` arguments
        self.env = env  # the server's environment (default: this process's)
        self.memory = memory
        self.pipeline = pipeline
        self.lease_timeout_s = lease_timeout_s
        self.metrics = metrics
        self.log = log or socket.with_suffix(".log")
        self.proc: subprocess.Popen[str] | None = None
        self.ready_line = ""
        self.starts = 0

    @property
    def fields(self) -> dict[str, str]:
        """``key=value`` pairs of the ready line (socket, segment, server, metrics)."""
        return dict(part.split("=", 1) for part in self.ready_line.split()[2:] if "=" in part)

    def start(self) -> NodeServerProcess:
        args = [sys.executable, "-m", "flowkv.cli", "server", "--memory", self.memory,
                "--lease-timeout", str(self.lease_timeout_s), *self.extra]
        if "--default-socket" in args:  # the test means: no --socket, the private default
            args.remove("--default-socket")
        else:
            args += ["--socket", str(self.socket)]
        if self.pipeline is not None:
            args += ["--pipeline", str(self.pipeline)]
        if self.metrics:
            args += ["--metrics-port", "0"]
        self.starts += 1
        with open(self.log, "a", encoding="utf-8") as log:
            log.write(f"--- start {self.starts}\n")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(self.log, "a", encoding="utf-8"),
                                     text=True, cwd=ROOT, start_new_session=True, env=self.env)
        found: list[str] = []
        reader = threading.Thread(target=lambda: found.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(READY_S)
        if not found or "ready" not in found[0]:
            self.kill()
            raise RuntimeError(f"flowkv server did not start: {found}\n{self.log.read_text()}")
        self.ready_line = found[0].strip()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int:
        """SIGTERM and wait: the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(READY_S)

    def kill(self) -> None:
        """SIGKILL: nothing is cleaned up (the segment stays until a server on this socket starts)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(READY_S)

    def connect(self, client: str = "test", *, operator: bool = True) -> NodeConnection:
        """A connection, with the operator token (read from beside the socket) unless ``operator`` is False."""
        conn = NodeConnection.connect(self.socket, timeout_s=10.0)
        conn.hello(client, operator_token=read_operator_token(self.socket) if operator else None)
        return conn

    def status(self) -> dict[str, Any]:
        conn = self.connect("test-status")
        try:
            return conn.call("stats")
        finally:
            conn.close()

    def segments(self) -> list[Path]:
        """The arenas (memfds) the server process holds now, as ``/proc/PID/fd/N`` paths (opening one
        opens the arena); none once it has exited."""
        return held_arenas(self.pid) if self.running else []


@pytest.fixture(scope="module")
def node_servers() -> Iterator[Any]:
    """``start(**kwargs)`` -> a running ``NodeServerProcess`` on a fresh socket; all stopped at the end."""
    folder = Path(tempfile.mkdtemp(prefix="fkvn-"))  # short: a socket path must fit 107 bytes
    started: list[NodeServerProcess] = []

    def start(name: str = "node", **kwargs: Any) -> NodeServerProcess:
        server = NodeServerProcess(folder / f"{name}.sock", **kwargs).start()
        started.append(server)
        return server

    start.folder = folder  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for server in started:
            if server.running:
                server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def held_arenas(pid: int) -> list[Path]:
    """The node-server arenas (memfds) process ``pid`` holds a descriptor of, one ``/proc/PID/fd/N`` path
    each (Python's mmap holds a second descriptor of what it maps)."""
    found: dict[str, Path] = {}
    for fd in sorted(Path(f"/proc/{pid}/fd").iterdir()):
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith(f"/memfd:{SEGMENT_NAME_PREFIX}"):
            found.setdefault(target, fd)
    return list(found.values())


def mapped_arenas(pid: int | str = "self") -> set[str]:
    """The arenas process ``pid`` maps, by name (``memfd:flowkv-node-...``, as the server calls them)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        return {"memfd:" + line.split("/memfd:", 1)[1].split()[0] for line in maps
                if f"/memfd:{SEGMENT_NAME_PREFIX}" in line}


def arena_name(path: Path) -> str:
    """``memfd:flowkv-node-...``: what the server's ready line and status call the arena ``path`` opens."""
    return os.readlink(path).removeprefix("/").split(" ", 1)[0]


def wait_for(predicate: Any, what: str, timeout_s: float = READY_S) -> Any:
    """Poll ``predicate`` until it answers something true (generous timeout: readiness, not speed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last: {value!r}")
        time.sleep(0.05)


# -- pipelines ------------------------------------------------------------------------

STORE = ["tokenize", "chunk-hash", "allocate", "gather", ("compress", {"codec": "none"}), "put"]
RETRIEVE = ["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"]


def node_pipeline(folder: Path, socket: Path, *, name: str = "node-test", chunk_size: int = CHUNK,
                  memory: str | None = None, disk: Path | None = None, timeout_s: float = 2.0,
                  store: Sequence[Any] = STORE, retrieve: Sequence[Any] = RETRIEVE,
                  sections: dict[str, dict[str, Any]] | None = None) -> Path:
    """A pipeline file: [memory ->] node (server tier on ``socket``) [-> disk]."""
    tiers: dict[str, dict[str, Any]] = {}
    if memory is not None:
        tiers["memory"] = {"kind": "memory", "capacity": memory}
    tiers["node"] = {"kind": "server", "socket": str(socket), "timeout_s": timeout_s, "backoff_max_s": 0.5}
    if disk is not None:
        tiers["disk"] = {"kind": "disk", "path": str(disk), "capacity": "256MiB", "timeout_s": 2.0}
    path = folder / f"{name}.toml"
    path.write_text(dumps_pipeline(pipeline={"name": name, "chunk_size": chunk_size}, tiers=tiers,
                                   store=list(store), retrieve=list(retrieve), sections=sections), encoding="utf-8")
    return path


def server_pipeline(folder: Path, disk: Path, *, codec: str = "none", traces: Path | None = None) -> Path:
    """A server pipeline file: the arena, then a disk tier (chunks written behind in ``codec``)."""
    store = [s if s != ("compress", {"codec": "none"}) else ("compress", {"codec": codec}) for s in STORE]
    sections = {"telemetry": {"exporter": "file", "folder": str(traces)}} if traces is not None else None
    path = folder / "server-disk.toml"
    path.write_text(dumps_pipeline(
        pipeline={"name": "server-disk", "chunk_size": CHUNK},
        tiers={"memory": {"kind": "memory", "capacity": "64MiB"},
               "disk": {"kind": "disk", "path": str(disk), "capacity": "256MiB", "timeout_s": 2.0}},
        store=store, retrieve=RETRIEVE, sections=sections), encoding="utf-8")
    return path


# -- engine-level clients ---------------------------------------------------------------


def scraped(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A ``/metrics`` page's samples, read by prometheus_client's parser: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def geometry() -> Any:
    from flowkv.kernels import KVGeometry

    return KVGeometry("cpu", 2, 2, 64, 16, torch.bfloat16)


def kv_for(seed: int, num_blocks: int = 64) -> list[torch.Tensor]:
    """Paged KV every process with ``seed`` fills alike."""
    from flowkv._testing.paged import make_paged_kv

    return make_paged_kv(geometry(), num_blocks, seed=seed)


def slots_for(num_tokens: int, num_blocks: int = 64) -> torch.Tensor:
    from flowkv._testing.paged import random_slot_mapping

    return random_slot_mapping(num_tokens, geometry(), num_blocks, seed=99)


def engine(pipeline: Path, model: str = "m") -> Any:
    """An engine on ``pipeline`` with the tests' geometry."""
    from flowkv import CacheEngine

    return CacheEngine.from_pipeline(pipeline, geometry=geometry(), model_name=model)


def keys_of(engine: Any, ids: torch.Tensor, tags: dict[str, str] | None = None) -> list[str]:
    """The tier keys of ``ids``' chunks under ``engine``'s key prefix."""
    return [k.to_str() for k in engine.keys.of(ids, tags or {}, None)]


def chunk_kv(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The KV at ``slots`` as one chunk buffer (to compare what two caches hold)."""
    from flowkv import kernels

    g = geometry()
    out = torch.empty(g.chunk_shape(len(slots)), dtype=g.dtype)
    kernels.gather(kv_caches, g, slots, out)
    return out


HOLD_TAG = "test_hold"  # a folder: the holding process writes <pid> there
GO_TAG = "test_go"  # a file: the store goes on once it exists (absent tag: holds until killed)


@stage("test-hold", kinds=("store",), needs={"kv"}, gives={"kv"})
def hold(chunks: Iterator[Chunk], *, ctx: Any) -> Iterator[Chunk]:
    """Hold a tagged store after ``gather`` of its first chunk: its rooms are allocated, not committed.

    TOML::

        [[store.stages]]
        use = "node_servers:hold"
    """
    for chunk in chunks:
        folder = chunk.request.tags.get(HOLD_TAG)
        if folder is not None and chunk.index == 0:
            Path(folder, str(os.getpid())).write_text(json.dumps({"pid": os.getpid()}), encoding="utf-8")
            go = chunk.request.tags.get(GO_TAG)
            while go is None or not Path(go).exists():
                time.sleep(0.01)
        yield chunk


HOLD_STORE = ["tokenize", "chunk-hash", "allocate", "gather", "node_servers:hold", ("compress", {"codec": "none"}),
              "put"]
