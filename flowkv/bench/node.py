"""The node server in the benchmarks: ``flowkv bench engine --via server`` and ``flowkv bench ttft --via server``.

``engine --via server`` measures, in one run and on the geometry of ``bench
engine`` (8 layers x 8 KV heads x 128, bf16), a plain copy of the KV bytes,
store and retrieve through an in-process ``local-cpu`` engine, and the same
through a ``flowkv server`` this benchmark starts (pipeline ``node``: gather
into and scatter from the server's mapped pages, control messages on its
socket), taking turns so a busy machine slows all alike; and one lookup of a
32k-token prompt's keys each way (the server's answers one round trip).
Every figure is the best of ``--repeats`` after a warm-up; ratios are to the
copy and to in-process.

``ttft --via server`` starts a server for the ``flowkv (node server)`` peer
and adds vLLM's own prefix cache as a peer (see ``flowkv.bench.ttft``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from flowkv.bench import expect_tokens

__all__ = ["measure_engine", "node_server", "print_engine"]


@contextlib.contextmanager
def node_server(memory_bytes: int, *, ready_s: float = 120.0, pipeline: Path | None = None) -> Iterator[Path]:
    """A ``flowkv server`` process on a fresh socket for the length of the block (with its own
    ``pipeline`` file when given); its socket path."""
    folder = Path(tempfile.mkdtemp(prefix="fkv-bench-"))
    socket = folder / "node.sock"
    extra = ["--pipeline", str(pipeline)] if pipeline is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "flowkv.cli", "server", "--socket", str(socket),
                             "--memory", str(memory_bytes), *extra], stdout=subprocess.PIPE,
                            stderr=open(folder / "server.log", "w", encoding="utf-8"), text=True,
                            start_new_session=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(ready_s)
    try:
        if not line or "ready" not in line[0]:
            raise RuntimeError(f"flowkv server did not start: {(folder / 'server.log').read_text()[-2000:]}")
        yield socket
    finally:
        from flowkv.bench.serve import stop_group

        stop_group(proc, timeout_s=60)
        shutil.rmtree(folder, ignore_errors=True)


def measure_engine(args: argparse.Namespace, *, shape: tuple[int, int, int, int],
                   lookup_tokens: int) -> dict[str, Any]:
    """The figures of ``bench engine --via server``: ``shape`` is ``bench engine``'s (layers, KV heads,
    head size, block size), ``lookup_tokens`` its lookup prompt's length."""
    from flowkv import CacheEngine, KVTransfer
    from flowkv._testing.paged import make_paged_kv, random_slot_mapping
    from flowkv.kernels import KVGeometry
    from flowkv.pipeline import load_pipeline

    layers, kv_heads, head_size, block_size = shape
    geometry = KVGeometry("cpu", layers, kv_heads, head_size, block_size, torch.bfloat16)
    chunk = load_pipeline("node").chunk_size
    n = args.tokens // chunk * chunk
    if n == 0:
        raise ValueError(f"--tokens {args.tokens} is less than one chunk ({chunk} tokens)")
    kv_bytes = n * geometry.token_bytes
    num_blocks = -(-n // block_size) + 1
    reps = args.repeats
    src = make_paged_kv(geometry, num_blocks, seed=0)
    dst = make_paged_kv(geometry, num_blocks, seed=1, fill=False)
    slots = random_slot_mapping(n, geometry, num_blocks, seed=2)
    generator = torch.Generator().manual_seed(3)
    results: dict[str, Any] = {"tokens": n, "chunk_size": chunk, "kv_bytes": kv_bytes, "lookup_tokens": lookup_tokens,
                               "geometry": geometry.fingerprint(), "torch_threads": torch.get_num_threads(),
                               "repeats": reps}

    a = torch.empty(kv_bytes, dtype=torch.uint8)
    b = torch.empty(kv_bytes, dtype=torch.uint8)
    a.fill_(1)
    copies = []
    for attempt in range(reps + 1):
        start = time.perf_counter()
        b.copy_(a)
        if attempt:
            copies.append(time.perf_counter() - start)
    del a, b
    copy_s = min(copies)

    # The server holds three stores: each new one evicts the oldest (steady state, as in a full arena).
    with node_server(3 * kv_bytes + (64 << 20)) as socket:
        local = CacheEngine.from_pipeline("local-cpu", geometry=geometry, model_name="bench", overrides={
            "tiers.memory.capacity": (n // chunk + 1) * geometry.token_bytes * chunk,
            "tiers.memory.pin_memory": False})
        node = CacheEngine.from_pipeline("node", geometry=geometry, model_name="bench",
                                         overrides={"tiers.node.socket": str(socket), "tiers.node.timeout_s": 30.0})
        engines = {"in-process": local, "server": node}
        times: dict[str, dict[str, list[float]]] = {name: {"store": [], "retrieve": []} for name in engines}
        last: dict[str, torch.Tensor] = {}
        for attempt in range(reps + 1):
            for name, engine in engines.items():
                if name == "in-process":
                    engine.memory.clear()
                tokens = torch.randint(0, 128_000, (n,), generator=generator)
                start = time.perf_counter()
                expect_tokens(engine.store(KVTransfer(tokens=tokens, kv_caches=src,
                                                      slot_mapping=slots)).stored_tokens, n, f"{name} store")
                if attempt:  # the first store into fresh pages pays first-touch faults
                    times[name]["store"].append(time.perf_counter() - start)
                last[name] = tokens
        for attempt in range(reps + 1):
            for name, engine in engines.items():
                start = time.perf_counter()
                loaded = int(engine.retrieve(KVTransfer(tokens=last[name], kv_caches=dst,
                                                        slot_mapping=slots)).ret_mask.sum())
                expect_tokens(loaded, n, f"{name} retrieve")
                if attempt:
                    times[name]["retrieve"].append(time.perf_counter() - start)
        # A lookup's keys (32k tokens) that the tier holds, hashed already: the tier's own cost.
        small = KVGeometry("cpu", 1, 1, head_size, block_size, torch.bfloat16)
        hash_tokens = torch.randint(0, 128_000, (lookup_tokens,), generator=generator)
        small_blocks = lookup_tokens // block_size
        small_kv = make_paged_kv(small, small_blocks, seed=4)
        small_slots = random_slot_mapping(lookup_tokens, small, small_blocks, seed=5)
        lookups: dict[str, float] = {}
        for name, pipeline, overrides in (
                ("in-process", "local-cpu", {"tiers.memory.capacity": "64MiB", "tiers.memory.pin_memory": False}),
                ("server", "node", {"tiers.node.socket": str(socket), "tiers.node.timeout_s": 30.0})):
            looker = CacheEngine.from_pipeline(pipeline, geometry=small, model_name="bench-lookup", overrides=overrides)
            hit = lookup_tokens // chunk * chunk
            expect_tokens(looker.store(KVTransfer(tokens=hash_tokens, kv_caches=small_kv,
                                                  slot_mapping=small_slots)).stored_tokens, hit, "lookup set-up")
            runs = []
            for attempt in range(reps + 1):
                start = time.perf_counter()
                expect_tokens(looker.lookup(hash_tokens), hit, f"{name} lookup")
                if attempt:
                    runs.append(time.perf_counter() - start)
            lookups[name] = min(runs)
            looker.close()
        node_tier = node.stats()["tiers"]["node"]
        local.close()
        node.close()
        # The server's segment, so a caller can see that it is removed when the server stops.
        from flowkv.tiers.node_protocol import NodeConnection

        conn = NodeConnection.connect(socket, timeout_s=30.0)
        results["server_segment"] = conn.hello("bench")["segment"]
        conn.close()

    gbps = lambda seconds: kv_bytes / seconds / 1e9  # noqa: E731
    results.update(copy_ms=copy_s * 1e3, copy_gbps=gbps(copy_s))
    for name in engines:
        for kind in ("store", "retrieve"):
            best = min(times[name][kind])
            results[f"{name}_{kind}_ms"] = best * 1e3
            results[f"{name}_{kind}_gbps"] = gbps(best)
            results[f"{name}_{kind}_vs_copy"] = copy_s / best
        results[f"{name}_lookup_ms"] = lookups[name] * 1e3
    for kind in ("store", "retrieve", "lookup"):
        results[f"server_vs_in_process_{kind}"] = results[f"server_{kind}_ms"] / results[f"in-process_{kind}_ms"]
    results["server_round_trips"] = node_tier["calls"]
    results["server_one_way_messages"] = node_tier["releases"]
    return results


def print_engine(r: dict[str, Any]) -> None:
    print(f"bench engine --via server: {r['geometry']}, {r['tokens']} tokens = {r['kv_bytes'] / 2**20:.0f} MiB of KV, "
          f"chunk {r['chunk_size']}, torch threads {r['torch_threads']}, best of {r['repeats']}")
    print(f"{'':28}{'ms':>9}{'GB/s':>8}{'x copy':>8}{'x in-proc':>11}")
    print(f"{'plain torch copy':28}{r['copy_ms']:9.1f}{r['copy_gbps']:8.2f}{1.0:8.2f}")
    for kind in ("store", "retrieve"):
        for name, label in (("in-process", f"{kind} in-process local-cpu"), ("server", f"{kind} via server (node)")):
            ratio = r[f"server_vs_in_process_{kind}"] if name == "server" else 1.0
            print(f"{label:28}{r[f'{name}_{kind}_ms']:9.1f}{r[f'{name}_{kind}_gbps']:8.2f}"
                  f"{r[f'{name}_{kind}_vs_copy']:8.2f}{ratio:11.2f}")
    print(f"lookup of {r['lookup_tokens'] // 1024}k tokens (keys known): in-process {r['in-process_lookup_ms']:.2f} ms, via server "
          f"{r['server_lookup_ms']:.2f} ms ({r['server_vs_in_process_lookup']:.2f}x)")
    print("x copy = GB/s against the plain copy of the same bytes; x in-proc = time via server / in-process time")


def run_engine(args: argparse.Namespace, **figures: Any) -> int:
    r = measure_engine(args, **figures)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print_engine(r)
    return 0
