"""``flowkv bench engine``: the cache engine's store and retrieve against plain copies.

For a paged KV cache of 8 layers x 8 KV heads x head size 128, bf16, block
size ``--block-size`` (default 16) in layout ``--layout`` (default ``cpu``,
vLLM's CPU backend; the ``flash_*`` layouts are the CUDA backends' layouts
on the CPU reference kernels; ``mla`` has one 512-wide latent head), and
``--tokens`` tokens (default 8,192, i.e. 256 MiB of KV), it measures in one run:

- store and retrieve through the pipeline (ms, GB/s of KV bytes), each
  against a plain ``torch`` copy of the same number of bytes between two
  contiguous tensors — the ratio is the figure that matters;
- a store into a fresh engine's arena, pre-faulted as the engine does at
  start (``[tiers.memory] prefault``), and one into a fresh arena that is
  not (every page faults on first touch), next to the steady-state store
  into pages the arena used before;
- the pipeline's own overhead: the same kernel calls in a hand-fused loop
  (hash, then per chunk allocate + gather into its memory object + the first
  compress stage's codec + memory-tier put; retrieve: memory get + decode +
  scatter), without stages, items or a runner. That loop is the work of a
  memory-only pipeline (``local-cpu``, ``local-cpu-lz4``); against a pipeline
  that also writes slower tiers, the ratio compares different work;
- hashing throughput of every chunk hash function (Mtokens/s);
- lookup latency for a 32k-token prompt: a hit (its chunk keys hashed, and
  already known from a previous call) and a miss.

Every store goes into an emptied memory tier and hashes fresh tokens, so it
measures a real store, not "already present". Times are the best of
``--repeats`` (fresh-arena stores: best and median, one new engine each). Numbers depend on the machine's memory bandwidth and on how
many cores torch may use (printed).

    flowkv bench engine
    flowkv bench engine --layout flash_kv_hnd --block-size 128
    flowkv bench engine --tokens 4096 --pipeline local-cpu-lz4 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from flowkv import kernels
from flowkv import payload as payloads
from flowkv.bench import best_seconds, expect_tokens
from flowkv.keys import chain_hashes

__all__ = ["add_arguments", "run"]

_LAYERS, _KV_HEADS, _HEAD_SIZE, _BLOCK_SIZE = 8, 8, 128, 16
_MLA_HEAD_SIZE = 512
_LOOKUP_TOKENS = 32 * 1024
# Longest wait for a fresh arena's background pre-fault (it takes well under a second here).
_PREFAULT_WAIT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's command-line options."""
    parser.add_argument("--tokens", type=int, default=8192,
                        help="tokens stored and retrieved per call (default 8192 = 256 MiB of KV)")
    parser.add_argument("--layout", default="cpu", choices=kernels.LAYOUTS,
                        help="KV cache layout (default cpu: vLLM's CPU backend)")
    parser.add_argument("--block-size", type=int, default=_BLOCK_SIZE,
                        help=f"tokens per KV block (default {_BLOCK_SIZE}; vLLM's CPU backend uses 128)")
    parser.add_argument("--pipeline", default="local-cpu",
                        help="built-in pipeline name or path to a pipeline file (default local-cpu)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per measurement; the best counts (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--worker-conditions", action="store_true",
                        help="measure store/retrieve as they run inside vLLM's worker too: 1 torch thread, "
                             "pinned to the first core, a forward-like load on the others "
                             "(flowkv.bench.worker), next to the standalone figure and a 2-thread copy")
    parser.add_argument("--via", choices=("process", "server"), default="process",
                        help="server: store and retrieve through a flowkv node server next to in-process "
                             "local-cpu (flowkv.bench.node)")


def _codec_of(pipeline: Any) -> tuple[str, dict[str, Any]]:
    """The codec and the parameters set for it of the pipeline's first codec stage
    (``"none"`` when it has none), so the hand-fused loop encodes exactly alike."""
    return pipeline.store_codec()


class _FusedLoop:
    """The engine's work as one hand-written loop: the same kernels, memory tier and keys, no stages."""

    def __init__(self, engine: Any, codec: str, params: dict[str, Any]) -> None:
        self.engine = engine
        self.codec = codec
        self.params = params

    def _chunks(self, tokens: torch.Tensor) -> Iterator[tuple[str, slice]]:
        """Each whole chunk's key and token range, in order."""
        e = self.engine
        size = e.chunk_size
        keys = e.key_prefix({}).keys(chain_hashes(tokens, size, e.hash_fn, partial=False))
        for index, key in enumerate(keys):
            yield key.to_str(), slice(index * size, (index + 1) * size)

    def store(self, tokens: torch.Tensor, kv_caches: list[torch.Tensor], slots: torch.Tensor) -> int:
        e = self.engine
        stored = 0
        for key, span in self._chunks(tokens):
            obj = e.memory.allocate(e.geometry.chunk_shape(e.chunk_size), e.geometry.dtype)
            if obj is None:
                break
            kernels.gather(kv_caches, e.geometry, slots[span], obj.tensor)
            if self.codec != "none":
                blob = payloads.encode(obj.tensor, self.codec, **self.params)
                if len(blob) <= obj.nbytes:
                    obj.view_bytes()[: len(blob)] = blob
                    obj.meta["codec"] = self.codec
                    obj.meta["encoded_len"] = len(blob)
            e.memory.put(key, obj)
            obj.ref_down()
            stored += e.chunk_size
        return stored

    def retrieve(self, tokens: torch.Tensor, kv_caches: list[torch.Tensor], slots: torch.Tensor) -> int:
        e = self.engine
        loaded = 0
        for key, span in self._chunks(tokens):
            obj = e.memory.get(key)
            if obj is None:
                break
            try:
                if "codec" in obj.meta:
                    kv = payloads.decode(obj.view_bytes()[: obj.meta["encoded_len"]])
                else:
                    kv = obj.tensor
                kernels.scatter(kv, kv_caches, e.geometry, slots[span])
            finally:
                obj.ref_down()
            loaded += e.chunk_size
        return loaded


def _fill_like_real_kv(kv_caches: list[torch.Tensor], geometry: Any, slots: torch.Tensor) -> None:
    """Write KV with a trained model's statistics at ``slots``, so a codec compresses as it would."""
    from flowkv.bench.codecs import synthetic_kv

    step = 1024
    for start in range(0, len(slots), step):
        part = slots[start:start + step]
        chunk = synthetic_kv(num_layers=geometry.num_layers, num_tokens=len(part),
                             num_kv_heads=geometry.num_kv_heads, head_size=geometry.head_size,
                             dtype=geometry.dtype, seed=start)
        kernels.scatter(chunk, kv_caches, geometry, part)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the benchmark, as a flat dict."""
    from tqdm import tqdm

    from flowkv import CacheEngine, KVTransfer
    from flowkv.kernels import KVGeometry
    from flowkv.keys import HASH_FUNCTIONS
    from flowkv.pipeline import load_pipeline
    from flowkv._testing.paged import make_paged_kv, random_slot_mapping

    if args.layout == "mla":
        geometry = KVGeometry("mla", _LAYERS, 1, _MLA_HEAD_SIZE, args.block_size, torch.bfloat16)
    else:
        geometry = KVGeometry(args.layout, _LAYERS, _KV_HEADS, _HEAD_SIZE, args.block_size, torch.bfloat16)
    pipeline = load_pipeline(args.pipeline)
    chunk = pipeline.chunk_size
    n = args.tokens // chunk * chunk  # whole chunks: partial ones are not stored by default
    if n == 0:
        raise ValueError(f"--tokens {args.tokens} is less than one chunk ({chunk} tokens)")
    chunks = n // chunk
    # Room for the whole store and one chunk more: a raw chunk of this geometry is whole
    # 4 KiB pages of the memory arena, and the arena's largest object is one chunk plus a header.
    capacity = (chunks + 1) * geometry.token_bytes * chunk
    overrides = {"tiers.memory.capacity": capacity, "tiers.memory.pin_memory": False}
    engine = CacheEngine.from_pipeline(args.pipeline, geometry=geometry, model_name="bench", overrides=overrides)
    # Steady state: the arena's pre-fault is over (a store that ran beside it would measure the pre-fault).
    engine.memory.arena.wait_resident(timeout=_PREFAULT_WAIT_S)
    codec, params = _codec_of(engine.pipeline)
    kv_bytes = n * geometry.token_bytes
    num_blocks = -(-n // args.block_size) + 1

    reps = args.repeats
    if getattr(args, "worker_conditions", False):
        return _measure_worker_conditions(args, engine, geometry, n, chunk, kv_bytes, num_blocks)
    hash_tokens = torch.randint(0, 128_000, (_LOOKUP_TOKENS,), generator=torch.Generator().manual_seed(7))
    steps = 5 * (reps + 1) + 2 * reps + len(HASH_FUNCTIONS) * (reps + 1) + 3 * (reps + 1)
    progress = tqdm(total=steps, desc="bench engine", file=sys.stderr, leave=False, unit="run")

    def tick() -> None:
        progress.update(1)

    src = make_paged_kv(geometry, num_blocks, seed=0)
    dst = make_paged_kv(geometry, num_blocks, seed=1, fill=False)
    slots = random_slot_mapping(n, geometry, num_blocks, seed=2)
    if codec != "none":
        _fill_like_real_kv(src, geometry, slots)
    generator = torch.Generator().manual_seed(3)

    def fresh_tokens() -> torch.Tensor:
        return torch.randint(0, 128_000, (n,), generator=generator)

    results: dict[str, Any] = {}

    # Baseline: one contiguous copy of the same bytes.
    a = torch.empty(kv_bytes, dtype=torch.uint8)
    b = torch.empty(kv_bytes, dtype=torch.uint8)
    a.fill_(1)
    copy_s = best_seconds(lambda: b.copy_(a), reps, after=tick)
    del a, b

    # Pipeline and hand-fused loop take turns, so a busy machine slows both alike.
    fused = _FusedLoop(engine, codec, params)
    store_times: list[float] = []
    fused_store_times: list[float] = []
    for attempt in range(reps + 1):
        for runs, step in ((store_times, lambda t: engine.store(KVTransfer(tokens=t, kv_caches=src,
                                                                           slot_mapping=slots)).stored_tokens),
                           (fused_store_times, lambda t: fused.store(t, src, slots))):
            engine.memory.clear()
            fresh = fresh_tokens()
            start = time.perf_counter()
            expect_tokens(step(fresh), n, "store")
            if attempt:  # the first run pays first-touch page faults
                runs.append(time.perf_counter() - start)
        progress.update(2)
    # Memory now holds the fused loop's last store; both retrieves read it.
    retrieve_times: list[float] = []
    fused_retrieve_times: list[float] = []
    for attempt in range(reps + 1):
        for runs, step in ((retrieve_times,
                            lambda: int(engine.retrieve(KVTransfer(tokens=fresh, kv_caches=dst,
                                                                   slot_mapping=slots)).ret_mask.sum())),
                           (fused_retrieve_times, lambda: fused.retrieve(fresh, dst, slots))):
            start = time.perf_counter()
            expect_tokens(step(), n, "retrieve")
            if attempt:
                runs.append(time.perf_counter() - start)
        progress.update(2)
    engine.memory.clear()

    # Fresh engines: the first store into an arena pre-faulted as the engine does at
    # start, and into one that is not. Each its own engine, alternating.
    fresh_times: dict[str, list[float]] = {"background": [], "off": []}
    fresh_state = ""
    for _ in range(reps):
        for prefault, runs in fresh_times.items():
            fresh = CacheEngine.from_pipeline(args.pipeline, geometry=geometry, model_name="bench",
                                              overrides={**overrides, "tiers.memory.prefault": prefault})
            try:
                # A server stores its first request seconds after start: the pre-fault is over then.
                fresh.memory.arena.wait_resident(timeout=_PREFAULT_WAIT_S)
                if prefault != "off":
                    fresh_state = fresh.memory.arena.prefault_state
                tokens = fresh_tokens()
                start = time.perf_counter()
                expect_tokens(fresh.store(KVTransfer(tokens=tokens, kv_caches=src,
                                                     slot_mapping=slots)).stored_tokens, n, "fresh-arena store")
                runs.append(time.perf_counter() - start)
            finally:
                fresh.close()
                del fresh
                gc.collect()  # unmaps the arena before the next one
            progress.update(1)

    store_s, store_med = min(store_times), statistics.median(store_times)
    fused_store_s = min(fused_store_times)
    retrieve_s, retrieve_med = min(retrieve_times), statistics.median(retrieve_times)
    fused_retrieve_s = min(fused_retrieve_times)
    engine.memory.clear()

    # Hashing a 32k-token prompt, every function.
    hashing = {}
    for name, fn in HASH_FUNCTIONS.items():
        seconds = best_seconds(lambda fn=fn: chain_hashes(hash_tokens, chunk, fn, partial=True), reps, after=tick)
        hashing[name] = _LOOKUP_TOKENS / seconds / 1e6

    # Lookup on a 32k-token prompt: keys exist in memory, no payload is read. The
    # KV size does not enter a lookup, so a one-layer, one-head geometry holds the chunks.
    small = KVGeometry("cpu", 1, 1, _HEAD_SIZE, _BLOCK_SIZE, torch.bfloat16)  # a codec group must divide the head
    # (the lookup does not depend on the layout or block size measured above)
    looker = CacheEngine.from_pipeline(args.pipeline, geometry=small, model_name="bench",
                                       overrides={"tiers.memory.capacity": "64MiB",
                                                  "tiers.memory.pin_memory": False})
    small_blocks = _LOOKUP_TOKENS // _BLOCK_SIZE
    set_up = KVTransfer(tokens=hash_tokens, kv_caches=make_paged_kv(small, small_blocks, seed=4),
                        slot_mapping=random_slot_mapping(_LOOKUP_TOKENS, small, small_blocks, seed=5))
    expect_tokens(looker.store(set_up).stored_tokens, _LOOKUP_TOKENS // chunk * chunk, "lookup set-up store")
    hit = _LOOKUP_TOKENS // chunk * chunk
    # The engine remembers the keys of recent token lists (lookup, then retrieve,
    # hash once); forgetting them before each call times a first lookup.
    hit_cold_s = best_seconds(lambda: expect_tokens(looker.lookup(hash_tokens), hit, "lookup"), reps,
                              before=looker._key_cache.clear, after=tick)
    hit_warm_s = best_seconds(lambda: expect_tokens(looker.lookup(hash_tokens), hit, "lookup"), reps, after=tick)
    misses = torch.randint(0, 128_000, (reps + 1, _LOOKUP_TOKENS), generator=generator)
    miss_iter = iter(misses)
    miss_s = best_seconds(lambda: expect_tokens(looker.lookup(next(miss_iter)), 0, "lookup miss"), reps, after=tick)
    progress.close()
    engine.close()
    looker.close()

    gbps = lambda seconds: kv_bytes / seconds / 1e9  # noqa: E731
    results.update({
        "pipeline": engine.pipeline.name,
        "codec": codec,
        "data": "synthetic trained-model statistics" if codec != "none" else "random normal",
        "tokens": n,
        "chunk_size": chunk,
        "kv_bytes": kv_bytes,
        "geometry": geometry.fingerprint(),
        "layout": geometry.layout,
        "block_size": geometry.block_size,
        "torch_threads": torch.get_num_threads(),
        "repeats": reps,
        "copy_ms": copy_s * 1e3,
        "copy_gbps": gbps(copy_s),
        "store_ms": store_s * 1e3,
        "store_median_ms": store_med * 1e3,
        "store_gbps": gbps(store_s),
        "store_vs_copy": gbps(store_s) / gbps(copy_s),
        "store_fresh_ms": min(fresh_times["background"]) * 1e3,
        "store_fresh_median_ms": statistics.median(fresh_times["background"]) * 1e3,
        "store_fresh_gbps": gbps(min(fresh_times["background"])),
        "store_fresh_vs_copy": gbps(min(fresh_times["background"])) / gbps(copy_s),
        "store_fresh_prefault_state": fresh_state,
        "store_fresh_no_prefault_ms": min(fresh_times["off"]) * 1e3,
        "store_fresh_no_prefault_median_ms": statistics.median(fresh_times["off"]) * 1e3,
        "store_fresh_no_prefault_gbps": gbps(min(fresh_times["off"])),
        "store_fresh_no_prefault_vs_copy": gbps(min(fresh_times["off"])) / gbps(copy_s),
        "retrieve_ms": retrieve_s * 1e3,
        "retrieve_median_ms": retrieve_med * 1e3,
        "retrieve_gbps": gbps(retrieve_s),
        "retrieve_vs_copy": gbps(retrieve_s) / gbps(copy_s),
        "fused_store_ms": fused_store_s * 1e3,
        "fused_retrieve_ms": fused_retrieve_s * 1e3,
        "store_overhead_vs_fused": store_s / fused_store_s,
        "retrieve_overhead_vs_fused": retrieve_s / fused_retrieve_s,
        "hash_mtokens_per_s": hashing,
        "hash_function": engine.hash_fn.name,
        "lookup_tokens": _LOOKUP_TOKENS,
        "lookup_hit_ms": hit_cold_s * 1e3,
        "lookup_hit_keys_known_ms": hit_warm_s * 1e3,
        "lookup_miss_ms": miss_s * 1e3,
    })
    return results


def _measure_worker_conditions(args: argparse.Namespace, engine: Any, geometry: Any, n: int, chunk: int,
                               kv_bytes: int, num_blocks: int) -> dict[str, Any]:
    from flowkv._testing.paged import make_paged_kv, random_slot_mapping
    from flowkv.bench.worker import measure_worker

    src = make_paged_kv(geometry, num_blocks, seed=0)
    dst = make_paged_kv(geometry, num_blocks, seed=1, fill=False)
    slots = random_slot_mapping(n, geometry, num_blocks, seed=2)
    generator = torch.Generator().manual_seed(3)
    try:
        figures = measure_worker(args, engine=engine, src=src, dst=dst, slots=slots, kv_bytes=kv_bytes,
                                 fresh_tokens=lambda: torch.randint(0, 128_000, (n,), generator=generator))
    finally:
        engine.close()
    return {"pipeline": engine.pipeline.name, "tokens": n, "chunk_size": chunk, "kv_bytes": kv_bytes,
            "geometry": geometry.fingerprint(), "layout": geometry.layout, "block_size": geometry.block_size,
            "repeats": args.repeats, "worker_conditions": figures}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON with ``--json``). Returns the exit status."""
    if args.tokens <= 0 or args.repeats <= 0:
        print("flowkv bench engine: --tokens and --repeats must be positive", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.via == "server":
        from flowkv.bench import node

        return node.run_engine(args, shape=(_LAYERS, _KV_HEADS, _HEAD_SIZE, _BLOCK_SIZE), lookup_tokens=_LOOKUP_TOKENS)
    try:
        r = measure(args)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"flowkv bench engine: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    if "worker_conditions" in r:
        from flowkv.bench.worker import print_worker

        print_worker(r)
        return 0
    print(f"pipeline {r['pipeline']} (codec {r['codec']}), {r['geometry']}, {r['tokens']} tokens "
          f"= {r['kv_bytes'] / 2**20:.0f} MiB of KV ({r['data']}), chunk {r['chunk_size']}, "
          f"torch threads {r['torch_threads']}, best of {r['repeats']}")
    print(f"{'':22}{'ms':>10}{'GB/s':>9}{'x copy':>9}{'x fused':>9}")
    print(f"{'plain torch copy':22}{r['copy_ms']:10.1f}{r['copy_gbps']:9.2f}{1.0:9.2f}")
    print(f"{'store':22}{r['store_ms']:10.1f}{r['store_gbps']:9.2f}{r['store_vs_copy']:9.2f}"
          f"{r['store_overhead_vs_fused']:9.2f}")
    print(f"{'store, fresh arena':22}{r['store_fresh_ms']:10.1f}{r['store_fresh_gbps']:9.2f}"
          f"{r['store_fresh_vs_copy']:9.2f}{'':9}  median {r['store_fresh_median_ms']:.1f} ms, "
          f"pre-fault {r['store_fresh_prefault_state']}")
    print(f"{'  not pre-faulted':22}{r['store_fresh_no_prefault_ms']:10.1f}{r['store_fresh_no_prefault_gbps']:9.2f}"
          f"{r['store_fresh_no_prefault_vs_copy']:9.2f}{'':9}  median {r['store_fresh_no_prefault_median_ms']:.1f} ms")
    print(f"{'retrieve':22}{r['retrieve_ms']:10.1f}{r['retrieve_gbps']:9.2f}{r['retrieve_vs_copy']:9.2f}"
          f"{r['retrieve_overhead_vs_fused']:9.2f}")
    print(f"{'hand-fused store':22}{r['fused_store_ms']:10.1f}")
    print(f"{'hand-fused retrieve':22}{r['fused_retrieve_ms']:10.1f}")
    print("x copy = GB/s against the plain copy of the same bytes; x fused = pipeline time / hand-fused loop time;")
    print("store = into arena pages used before (steady state); fresh arena = the first store of a new engine")
    print("hashing, Mtokens/s: " + ", ".join(f"{name} {rate:.1f}" for name, rate in r["hash_mtokens_per_s"].items())
          + f" (the pipeline uses {r['hash_function']})")
    print(f"lookup of {r['lookup_tokens']} tokens: hit {r['lookup_hit_ms']:.2f} ms "
          f"(keys already known {r['lookup_hit_keys_known_ms']:.2f} ms), miss {r['lookup_miss_ms']:.2f} ms")
    return 0
