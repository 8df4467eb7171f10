"""``flowkv bench tiers``: put, get and lookup through each tier, against the raw medium.

For 8,192 tokens (``--tokens``) of the engine benchmark's KV shape — 8 layers
x 8 KV heads x head size 128, bf16, chunks of 256 tokens, so 32 chunks and
256 MiB — it measures, in one run, through a ``CacheEngine`` whose pipeline
holds the memory tier and (for disk and Redis) one slower tier behind it:

=========  =================================================  ==========================================
tier       put / get through the engine                       baseline (the same bytes, same run)
=========  =================================================  ==========================================
memory     ``store``; ``retrieve`` from memory                a plain copy between two contiguous tensors
disk       ``store`` + write-behind until ``flush()`` returns;  one file per chunk written, then read back
           ``retrieve`` with memory emptied (read, promote,
           scatter)
redis      as disk, on a Redis server                         redis-py ``SET`` / ``GET`` of each chunk
=========  =================================================  ==========================================

GB/s counts KV bytes (not payload headers). ``x raw`` is flowkv's GB/s over
the baseline's. Lookup latency is ``engine.lookup`` of the whole request
when its chunks are only in that tier (prefetch off, so nothing moves).
Times are the best of ``--repeats`` after one warm-up. The disk figures read
back files the same run just wrote, so both sides read the page cache.

Without ``--redis-url`` a temporary ``redis-server`` is started on a free
loopback port when one is on ``PATH``; otherwise the Redis rows are skipped
with a note. Against a given server only this run's own namespace is written
and it is deleted afterwards.

    flowkv bench tiers
    flowkv bench tiers --tokens 2048 --redis-url redis://127.0.0.1:6379 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from flowkv import KVTransfer
from flowkv.bench import best_seconds, expect_tokens
from flowkv.pipeline import dumps_pipeline

__all__ = ["add_arguments", "measure", "run"]

_LAYERS, _KV_HEADS, _HEAD_SIZE, _BLOCK_SIZE, _CHUNK = 8, 8, 128, 16, 256
# A bulk write of a whole request may take seconds on a slow disk; the guard must not cut it off here.
_TIER_TIMEOUT_S = 120.0



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's command-line options."""
    parser.add_argument("--tokens", type=int, default=8192,
                        help="tokens per request, whole chunks of 256 (default 8192 = 256 MiB of KV)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best counts (default 3)")
    parser.add_argument("--redis-url", default=None,
                        help="Redis to measure (default: a temporary redis-server on a free loopback port, "
                             "when redis-server is on PATH)")
    parser.add_argument("--dir", default=None,
                        help="folder for the disk tier and the raw files (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- a temporary redis-server ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _redis_for_bench(url: str | None, folder: Path) -> Iterator[tuple[str | None, str]]:
    """(url, note): the given server, a temporary one, or (None, why not)."""
    if url is not None:
        yield url, f"given server {url}"
        return
    binary = shutil.which("redis-server")
    if binary is None:
        yield None, "skipped: no --redis-url and no redis-server on PATH"
        return
    import redis

    port = _free_port()
    workdir = folder / "redis"
    workdir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
         "--appendonly", "no", "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1.0)
        deadline = time.monotonic() + 20.0
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited: see {workdir / 'redis.log'}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not answer PING") from None
                time.sleep(0.05)
        client.close()
        yield url, f"temporary redis-server on port {port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(workdir, ignore_errors=True)  # --dir is the user's: leave it as it was


# -- the measurements --------------------------------------------------------------------


class _Request:
    """Tokens, a paged KV cache holding their KV, an empty one to load into, and the slots."""

    def __init__(self, geometry: Any, num_tokens: int) -> None:
        from flowkv._testing.paged import make_paged_kv, random_slot_mapping

        num_blocks = -(-num_tokens // _BLOCK_SIZE) + 1
        self.src = make_paged_kv(geometry, num_blocks, seed=1)
        self.dst = make_paged_kv(geometry, num_blocks, seed=0, fill=False)
        self.slots = random_slot_mapping(num_tokens, geometry, num_blocks, seed=2)
        self.num_tokens = num_tokens
        self._generator = torch.Generator().manual_seed(3)
        self.tokens = self.fresh_tokens()

    def fresh_tokens(self) -> torch.Tensor:
        """New tokens, so every store writes every chunk instead of finding it present."""
        self.tokens = torch.randint(0, 128_000, (self.num_tokens,), generator=self._generator)
        return self.tokens


def _engine_figures(engine_for: Callable[[], Any], request: _Request, repeats: int, *,
                    slow: str | None, cleanup: Callable[[Any], None] = lambda engine: None) -> dict[str, float]:
    """Put, get and lookup through a fresh engine per repeat (so every put really writes)."""
    n = request.num_tokens
    state: dict[str, Any] = {}

    def open_engine() -> None:
        state["engine"] = engine_for()
        request.fresh_tokens()

    def close_engine() -> None:
        engine = state.pop("engine")
        cleanup(engine)
        engine.close()

    def put() -> None:
        engine = state["engine"]
        expect_tokens(engine.store(KVTransfer(tokens=request.tokens, kv_caches=request.src,
                                              slot_mapping=request.slots)).stored_tokens, n, "store")
        if slow is not None:
            if not engine.flush(_TIER_TIMEOUT_S):
                raise RuntimeError(f"tier {slow} did not finish its writes in {_TIER_TIMEOUT_S} s")
            written = engine.stats()["tiers"][slow]
            if written.get("write_dropped") or written.get("dropped_puts"):
                raise RuntimeError(f"tier {slow} dropped writes: {written}")

    def store_and_empty_memory() -> None:
        open_engine()
        put()
        if slow is not None:
            state["engine"].memory.clear()

    def get() -> None:
        engine = state["engine"]
        mask = engine.retrieve(KVTransfer(tokens=request.tokens, kv_caches=request.dst,
                                          slot_mapping=request.slots)).ret_mask
        expect_tokens(int(mask.sum()), n, "retrieve")

    lookups: list[float] = []

    def lookup() -> None:
        engine = state["engine"]
        for _ in range(20):
            start = time.perf_counter()
            expect_tokens(engine.lookup(request.tokens), n, "lookup")
            lookups.append(time.perf_counter() - start)

    put_s = best_seconds(put, repeats, before=open_engine, after=close_engine)
    get_s = best_seconds(get, repeats, before=store_and_empty_memory, after=close_engine)
    store_and_empty_memory()
    try:
        lookup()
    finally:
        close_engine()
    return {"put_s": put_s, "get_s": get_s, "lookup_s": min(lookups)}


def _pipeline_text(tier: str, capacity: int, slow_tier: dict[str, Any] | None = None) -> str:
    """The benchmark's pipeline: memory in front of at most one slower tier, raw payloads,
    a lookup that does not prefetch (it would move data the lookup figure should not include)."""
    tiers: dict[str, dict[str, Any]] = {"memory": {"kind": "memory", "capacity": capacity, "pin_memory": False}}
    if slow_tier is not None:
        tiers[tier] = {"kind": tier, **slow_tier}
    return dumps_pipeline(
        pipeline={"name": f"bench-tiers-{tier}", "chunk_size": _CHUNK, "hash": "sha256"},
        tiers=tiers,
        store=["tokenize", "chunk-hash", "allocate", "gather", ("compress", {"codec": "none"}), "put"],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"],
        lookup=["tokenize", "chunk-hash", ("lookup", {"prefetch": False})],
        sections={"telemetry": {"exporter": "none"}},
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the benchmark, as a dict (``tiers`` holds one dict per tier)."""
    import uuid

    from flowkv import CacheEngine
    from flowkv.kernels import KVGeometry
    from flowkv.pipeline import loads_pipeline

    geometry = KVGeometry("cpu", _LAYERS, _KV_HEADS, _HEAD_SIZE, _BLOCK_SIZE, torch.bfloat16)
    n = args.tokens // _CHUNK * _CHUNK
    if n == 0:
        raise ValueError(f"--tokens {args.tokens} is less than one chunk ({_CHUNK} tokens)")
    chunks = n // _CHUNK
    chunk_bytes = _CHUNK * geometry.token_bytes
    kv_bytes = n * geometry.token_bytes
    # Room for the whole request and one chunk more: a raw chunk of this geometry is whole
    # 4 KiB pages of the memory arena, and the arena's largest object is one chunk plus a header.
    capacity = (chunks + 1) * chunk_bytes
    request = _Request(geometry, n)
    reps = args.repeats
    result: dict[str, Any] = {
        "tokens": n, "chunks": chunks, "chunk_bytes": chunk_bytes, "kv_bytes": kv_bytes,
        "geometry": geometry.fingerprint(), "repeats": reps, "torch_threads": torch.get_num_threads(),
        "tiers": {},
    }

    def engine_on(tier: str, slow_tier: dict[str, Any] | None = None) -> Callable[[], Any]:
        text = _pipeline_text(tier, capacity, slow_tier)
        return lambda: CacheEngine(loads_pipeline(text, file=f"<bench {tier}>"), geometry=geometry,
                                   model_name="bench-tiers")

    def say(text: str) -> None:
        print(f"flowkv bench tiers: {text}", file=sys.stderr, flush=True)

    # Raw bytes of each chunk, laid out as the engine gathers them, for the baselines.
    raw = torch.empty(kv_bytes, dtype=torch.uint8)
    raw.copy_(torch.randint(0, 256, (kv_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)))
    raw_chunks = [raw[i * chunk_bytes:(i + 1) * chunk_bytes].numpy() for i in range(chunks)]

    say(f"memory ({n} tokens, {kv_bytes / 2**20:.0f} MiB)")
    copy_dst = torch.empty_like(raw)
    copy_s = best_seconds(lambda: copy_dst.copy_(raw), reps)
    figures = _engine_figures(engine_on("memory"), request, reps, slow=None)
    result["tiers"]["memory"] = _row(figures, kv_bytes, base_put_s=copy_s, base_get_s=copy_s,
                                     baseline="torch copy of the same bytes")

    folder_cm = tempfile.TemporaryDirectory(prefix="flowkv-bench-tiers-") if args.dir is None else None
    root = Path(folder_cm.name if folder_cm is not None else args.dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    try:
        say(f"disk ({root})")
        disk_root = root / f"disk-{uuid.uuid4().hex[:8]}"
        counter = iter(range(1 << 30))

        def disk_engine() -> Any:
            folder = disk_root / str(next(counter))
            table = {"path": str(folder), "capacity": 2 * kv_bytes + (1 << 20),
                     "timeout_s": _TIER_TIMEOUT_S, "write_queue": chunks + 1}
            return engine_on("disk", table)()

        def remove_folder(engine: Any) -> None:
            shutil.rmtree(engine.slow["disk"].tier.root, ignore_errors=True)

        figures = _engine_figures(disk_engine, request, reps, slow="disk", cleanup=remove_folder)
        files = root / f"raw-{uuid.uuid4().hex[:8]}"
        files.mkdir()

        def write_files() -> None:
            for index, chunk in enumerate(raw_chunks):
                with open(files / f"{index}.bin", "wb") as file:
                    file.write(chunk)

        def read_files() -> None:
            for index in range(chunks):
                with open(files / f"{index}.bin", "rb") as file:
                    file.read()

        write_s = best_seconds(write_files, reps)
        read_s = best_seconds(read_files, reps)
        shutil.rmtree(files, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)
        result["tiers"]["disk"] = _row(figures, kv_bytes, base_put_s=write_s, base_get_s=read_s,
                                       baseline="one file per chunk: write, then read back")

        with _redis_for_bench(args.redis_url, root) as (url, note):
            if url is None:
                say(f"redis {note}")
                result["tiers"]["redis"] = {"skipped": note}
            else:
                say(f"redis ({note})")
                result["tiers"]["redis"] = _measure_redis(url, note, engine_on, request, raw_chunks,
                                                          kv_bytes, chunks, reps)
    finally:
        if folder_cm is not None:
            folder_cm.cleanup()
    return result


def _measure_redis(url: str, note: str, engine_on: Callable[..., Callable[[], Any]], request: _Request,
                   raw_chunks: list[Any], kv_bytes: int, chunks: int, reps: int) -> dict[str, Any]:
    import uuid

    import redis

    namespace = f"flowkv-bench-{uuid.uuid4().hex[:12]}"
    client = redis.Redis.from_url(url, socket_timeout=_TIER_TIMEOUT_S)

    def delete_namespace(engine: Any = None) -> None:
        # Only this run's keys: the server may be someone's real cache.
        batch = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        for start in range(0, len(batch), 1000):
            client.delete(*batch[start:start + 1000])

    table = {"url": url, "namespace": namespace, "timeout_s": _TIER_TIMEOUT_S,
             "socket_timeout_s": _TIER_TIMEOUT_S, "write_queue": chunks + 1}
    try:
        figures = _engine_figures(engine_on("redis", table), request, reps, slow="redis", cleanup=delete_namespace)
        raw_keys = [f"{namespace}:raw:{index}" for index in range(chunks)]

        def set_all() -> None:
            for key, chunk in zip(raw_keys, raw_chunks):
                client.set(key, memoryview(chunk))

        def get_all() -> None:
            for key in raw_keys:
                if client.get(key) is None:
                    raise RuntimeError(f"redis lost {key} during the benchmark")

        set_s = best_seconds(set_all, reps)
        get_s = best_seconds(get_all, reps)
    finally:
        delete_namespace()
        client.close()
    return _row(figures, kv_bytes, base_put_s=set_s, base_get_s=get_s,
                baseline=f"redis-py SET / GET of each chunk ({note})")


def _row(figures: dict[str, float], kv_bytes: int, *, base_put_s: float, base_get_s: float,
         baseline: str) -> dict[str, Any]:
    put_gbps, get_gbps = _gbps(kv_bytes, figures["put_s"]), _gbps(kv_bytes, figures["get_s"])
    raw_put_gbps, raw_get_gbps = _gbps(kv_bytes, base_put_s), _gbps(kv_bytes, base_get_s)
    return {
        "put_ms": figures["put_s"] * 1e3, "put_gbps": put_gbps,
        "get_ms": figures["get_s"] * 1e3, "get_gbps": get_gbps,
        "lookup_ms": figures["lookup_s"] * 1e3,
        "raw_put_ms": base_put_s * 1e3, "raw_put_gbps": raw_put_gbps,
        "raw_get_ms": base_get_s * 1e3, "raw_get_gbps": raw_get_gbps,
        "put_vs_raw": put_gbps / raw_put_gbps, "get_vs_raw": get_gbps / raw_get_gbps,
        "baseline": baseline,
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON with ``--json``). Returns the exit status."""
    if args.tokens <= 0 or args.repeats <= 0:
        print("flowkv bench tiers: --tokens and --repeats must be positive", file=sys.stderr)
        return 2
    try:
        r = measure(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"flowkv bench tiers: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['tokens']} tokens = {r['chunks']} chunks of {r['chunk_bytes'] / 2**20:.0f} MiB, {r['geometry']}, "
          f"best of {r['repeats']}, {r['torch_threads']} torch threads, pid {os.getpid()}")
    print(f"{'tier':8}{'put GB/s':>10}{'raw':>8}{'x raw':>7}{'get GB/s':>10}{'raw':>8}{'x raw':>7}"
          f"{'lookup ms':>11}  baseline")
    for name, row in r["tiers"].items():
        if "skipped" in row:
            print(f"{name:8}{row['skipped']}")
            continue
        print(f"{name:8}{row['put_gbps']:10.2f}{row['raw_put_gbps']:8.2f}{row['put_vs_raw']:7.2f}"
              f"{row['get_gbps']:10.2f}{row['raw_get_gbps']:8.2f}{row['get_vs_raw']:7.2f}"
              f"{row['lookup_ms']:11.3f}  {row['baseline']}")
    print("put: store (disk/redis: until written behind); get: retrieve, memory emptied for disk/redis; "
          "x raw = flowkv GB/s / baseline GB/s; lookup: whole request, chunks only in that tier")
    return 0
