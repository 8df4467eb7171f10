"""``flowkv bench NAME``: one module per benchmark, imported only when run.

Each module has ``add_arguments(parser)`` and ``run(args) -> int``. Every
benchmark measures a baseline in the same run and prints ratios against it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

BENCHMARKS: dict[str, tuple[str, str]] = {
    "runner": ("flowkv.bench.runner", "runner overhead per item and stage, against a hand loop"),
    "engine": ("flowkv.bench.engine", "store/retrieve throughput against a plain copy; hashing; lookup"),
    "tiers": ("flowkv.bench.tiers", "put/get throughput per tier against raw copy, file and redis-py"),
    "codecs": ("flowkv.bench.codecs", "compression ratio, speed and error per codec"),
    "capacity": ("flowkv.bench.capacity", "documents a fixed disk holds and warm TTFT from disk: raw, lossless, lossy"),
    "ttft": ("flowkv.bench.ttft", "vLLM time to first token: no cache, flowkv, ExampleConnector"),
    "serve": ("flowkv.bench.serve", "vllm serve under concurrent clients: requests/s, TTFT, ITL with and without flowkv"),
    "mix": ("flowkv.bench.mix", "vllm serve: memory-hit TTFT alone and beside disk hits, async loads on and off"),
    "tenants": ("flowkv.bench.tenants", "two tenants, one cache: B's hit rate under A's flood, with and without quotas"),
    "rag": ("flowkv.bench.rag", "RAG prompts, documents in any order: no cache, prefix keys, CacheBlend by ratio"),
    "route": ("flowkv.bench.route", "two vLLM servers: round-robin against flowkv route (hit rate, TTFT, req/s)"),
    "side-by-side": ("flowkv.bench.sidebyside", "the floor, no connector, flowkv's configurations and LMCache MP: "
                     "cold + save and hit TTFT, one table"),
    "pd": ("flowkv.bench.pd", "colocated vs disaggregated prefill on bench serve's workload: TTFT and ITL p50/p99"),
}


def chosen(text: str, known: Sequence[str], option: str) -> list[str]:
    """The names of a comma-separated option (``--configs``, ``--peers``), each one of ``known``;
    ValueError naming ``option`` and what it takes otherwise."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{option} takes {', '.join(known)}; got {text!r}")
    return names


def positive(args: argparse.Namespace, names: Sequence[str]) -> None:
    """Raise ValueError naming the first of the options ``names`` (attribute names) that is not positive."""
    for name in names:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")


def best_seconds(step: Callable[[], object], repeats: int, *, before: Callable[[], object] | None = None,
                 after: Callable[[], object] | None = None) -> float:
    """Best seconds of ``step`` over ``repeats`` runs after one untimed warm-up run;
    ``before`` and ``after`` run around every run, untimed (e.g. emptying memory)."""
    best = float("inf")
    for attempt in range(repeats + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if after is not None:
            after()
        if attempt:  # the warm-up pays first-touch page faults and connection set-up
            best = min(best, elapsed)
    return best


def expect_tokens(got: int, want: int, what: str) -> None:
    """Raise unless a run handled exactly ``want`` tokens: a run that moved less
    than asked would make its timing meaningless."""
    if got != want:
        raise RuntimeError(f"{what} handled {got} of {want} tokens: the measurement would be wrong")


def report(results: dict[str, Any], args: argparse.Namespace, *, table: Callable[[dict[str, Any]], None],
           plot: Callable[[dict[str, Any], str], None] | None = None) -> int:
    """A benchmark's ending: the plot when ``--plot`` names a file (for a benchmark that draws one),
    then the figures printed, as ``table`` prints them or (``--json``) as JSON. Returns 0, the exit status."""
    if plot is not None and args.plot:
        plot(results, args.plot)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        table(results)
    return 0
