"""``flowkv bench pd``: colocated against disaggregated prefill, on ``bench serve``'s workload.

Two set-ups of the demo model on this machine's cores (``--cores``), each
behind a ``flowkv route`` of its own, so that both pay the same proxy hop:

=================  ============================================================
``colocated``      one ``vllm serve`` with flowkv (pipeline ``node``, its own
                   ``flowkv server``) on all the cores, behind ``flowkv route
                   --backend``: it computes prompts and generates
``disaggregated``  a prefill instance (``kv_role`` ``kv_producer``) on the
                   first half of the cores and a decode instance
                   (``kv_consumer``) on the second half, both on pipeline
                   ``node-pd`` and one other ``flowkv server``, behind
                   ``flowkv route --prefill --decode``: the decode instance
                   loads each prompt but its last block from the server
=================  ============================================================

One core set per instance, as the README's "Disaggregated prefill" says: a
decode request waiting for its KV keeps vLLM stepping, and OpenMP threads
that share cores with another instance wait at every barrier.

``vllm bench serve`` (``bench serve``'s client, greedy) sends the workload of
``bench serve``: ``--docs`` documents asked ``--asks`` times each with
different questions, ``--concurrency`` requests at a time. All the servers
start once; every round and concurrency level gets documents of its own
(another dataset seed), so each run starts cold, and both set-ups get the
same documents in the same round, back to back, the one that goes first
alternating. The table gives, per level, TTFT and inter-token latency p50 and
p99 and requests/s of both side by side (medians and ranges over
``--repeats`` rounds), disaggregated / colocated as the median and range of
each round's ratio, the prompt tokens each side computed and loaded (vLLM's
``prompt_tokens_by_source`` counters), and how many outputs are the same in
both (all of them in float32; bf16 greedy tokens may flip with the batch)::

    flowkv bench pd
    flowkv bench pd --concurrency 4 --repeats 3 --plot pd.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from flowkv.bench import positive, report, serve
from flowkv.integration.harness import model_folder

__all__ = ["CONFIGS", "add_arguments", "run"]

CONFIGS = ("colocated", "disaggregated")
# The figures shown side by side, each with its range over the rounds and its ratio.
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "requests_per_s")
_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_BLOCK = 128  # vLLM's block on the CPU, and node-pd's chunk
# A run's last counters reach /metrics just after its last answer: how long to wait for them at most.
_COUNTED_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench pd``."""
    serve.add_workload_arguments(parser, concurrency="1,4", docs=16, output_tokens=32, pool_docs=8)
    parser.add_argument("--cores", default=None,
                        help="the cores to use, e.g. 0-15 (default: this process's): colocated gets all, "
                             "prefill the first half, decode the rest")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the servers' dtype (default bfloat16; float32 makes greedy outputs independent "
                             "of the batch, so both set-ups answer alike)")
    parser.add_argument("--plot", metavar="FILE.png", help="write TTFT and ITL p50/p99 of both set-ups")


def cores(text: str | None) -> list[int]:
    """The core ids of a list like ``0-3,6`` (None: the cores this process may run on)."""
    if text is None:
        return sorted(os.sched_getaffinity(0))
    ids: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            first, _, last = part.partition("-")
            ids.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"--cores takes core ids and ranges like 0-3,6; got {text!r}") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--cores takes core ids and ranges like 0-3,6; got {text!r}")
    return sorted(ids)


def _bind(ids: list[int]) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, ids))}


class Router:
    """``flowkv route`` with ``options`` on a free port, in a process group of its own."""

    def __init__(self, options: list[str], log: Path) -> None:
        self.command = [sys.executable, "-m", "flowkv.cli", "route", "--port", "0", "--log-level", "warning",
                        *options]
        self.log = log
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Router:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        line = self.proc.stdout.readline().decode()
        if "listening on http://" not in line:
            self.__exit__()
            raise RuntimeError(f"flowkv route did not start: {line}{self.log.read_text(errors='replace')[-2000:]}")
        self.url = line.split("listening on ")[1].strip()
        deadline = time.monotonic() + 60
        while not serve.answers(self.url + "/health"):  # the line can come before the socket accepts
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"flowkv route did not answer /health: {self.log}")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            serve.stop_group(self.proc, timeout_s=30)

    def decisions(self) -> dict[str, int]:
        with urllib.request.urlopen(self.url + "/stats", timeout=30) as reply:
            return json.load(reply)["decisions"]


def _counters(server: serve.Server) -> dict[str, float]:
    """An instance's prompt tokens by source, requests finished, and tokens flowkv loaded."""
    counts = {source: server.metric("vllm:prompt_tokens_by_source", source=source) for source in _SOURCES}
    counts["requests"] = server.metric("vllm:request_success")
    counts["retrieved"] = server.metric("vllm:flowkv_retrieved_tokens")
    return counts


def _counted(server: serve.Server, before: dict[str, float], requests: int) -> dict[str, float]:
    """The change in ``server``'s counters once it counted ``requests`` more finished requests."""
    deadline = time.monotonic() + _COUNTED_S
    while True:
        now = _counters(server)
        if now["requests"] - before["requests"] >= requests or time.monotonic() > deadline:
            return {key: now[key] - before[key] for key in now}
        time.sleep(0.1)


class _Setup:
    """One set-up: the router clients talk to, the instance that generates, and the prefill instance if any."""

    def __init__(self, router: Router, generates: serve.Server, prefill: serve.Server | None = None) -> None:
        self.router, self.generates, self.prefill = router, generates, prefill

    def measure(self, args: argparse.Namespace, *, model: Path, concurrency: int, seed: int,
                result_file: Path) -> tuple[dict[str, Any], list[str]]:
        """One client run: its figures with the instances' counters, and each request's output."""
        at = {"generates": _counters(self.generates), "router": self.router.decisions()}
        if self.prefill is not None:
            at["prefill"] = _counters(self.prefill)
        result = serve.client(self.router.url, args, model=model, concurrency=concurrency, seed=seed,
                              result_file=result_file, detailed=True)
        run = serve.figures(result)
        done = run["completed"]
        generated = _counted(self.generates, at["generates"], done)
        prefilled = _counted(self.prefill, at["prefill"], done) if self.prefill is not None else dict.fromkeys(
            (*_SOURCES, "requests", "retrieved"), 0.0)
        decisions = self.router.decisions()
        run |= {
            # on the instance that generates (the decode instance when disaggregated)
            "computed_tokens": generated["local_compute"], "cached_tokens": generated["local_cache_hit"],
            "loaded_tokens": generated["external_kv_transfer"], "retrieved_tokens": generated["retrieved"],
            "requests": generated["requests"],
            # on the prefill instance (none when colocated)
            "prefill_computed_tokens": prefilled["local_compute"],
            "prefill_cached_tokens": prefilled["local_cache_hit"],
            "prefill_loaded_tokens": prefilled["external_kv_transfer"], "prefill_requests": prefilled["requests"],
            "prefilled": decisions.get("prefilled", 0) - at["router"].get("prefilled", 0),
            "prefill_failed": decisions.get("prefill-failed", 0) - at["router"].get("prefill-failed", 0),
        }
        return run, result["generated_texts"]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    try:
        levels = serve.positive_ints(args.concurrency, "--concurrency")
        positive(args, ("docs", "asks", "doc_tokens", "question_tokens", "output_tokens", "pool_docs", "repeats"))
        ids = cores(args.cores)
        if len(ids) < 2:
            raise ValueError(f"disaggregated prefill needs two cores or more, one set per instance; got {ids}")
    except ValueError as exc:
        print(f"flowkv bench pd: {exc}", file=sys.stderr)
        return 2
    from flowkv.bench.node import node_server
    from flowkv.integration.harness import kv_bytes_per_token, setup_environment

    setup_environment()
    model = model_folder(args.model_dir)
    max_model_len = serve.model_len(args)
    token_bytes = kv_bytes_per_token(model) * (2 if args.dtype == "float32" else 1)
    pool_bytes = args.pool_docs * max_model_len * token_bytes
    # Each node server holds a run's documents twice over; earlier runs' are evicted, never asked again.
    node_bytes = max(256 << 20, 2 * args.docs * max_model_len * token_bytes)
    half = len(ids) // 2
    binds = {"colocated": ids, "prefill": ids[:half], "decode": ids[half:]}
    results: dict[str, Any] = {
        "model": str(model), "configs": list(CONFIGS), "concurrency": levels,
        "workload": {k: getattr(args, k) for k in ("docs", "asks", "doc_tokens", "question_tokens", "output_tokens",
                                                   "pool_docs", "repeats", "dtype", "eager")}
                    | {"vllm_prefix_caching": not args.no_prefix_caching},
        "cores": {name: ",".join(map(str, group)) for name, group in binds.items()},
        "runs": {config: {} for config in CONFIGS}, "outputs_equal": {}, "ratios": {},
    }
    with tempfile.TemporaryDirectory(prefix="fkv-bench-pd-") as tmp, contextlib.ExitStack() as stack:
        logs = Path(args.keep_logs) if args.keep_logs else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)

        def instance(name: str, pipeline: str, role: str, socket: Path) -> serve.Server:
            transfer = serve.transfer_config(pipeline, Path(tmp), chunk_size=None, memory_bytes=0, kv_role=role,
                                             extra={"tiers.node.socket": str(socket)})
            print(f"bench pd: starting {name} on cores {results['cores'][name]}...", file=sys.stderr)
            return serve.Server(model, logs, transfer=transfer, pool_bytes=pool_bytes, max_model_len=max_model_len,
                                prefix_caching=not args.no_prefix_caching, eager=args.eager, dtype=args.dtype,
                                env=_bind(binds[name]), name=name)

        try:
            colocated_node = stack.enter_context(node_server(node_bytes))
            pd_node = stack.enter_context(node_server(node_bytes))
            # The three start side by side (measuring starts only once all three answer).
            colocated, prefill, decode = serve.start_side_by_side(stack, [
                instance("colocated", "node", "kv_both", colocated_node),
                instance("prefill", "node-pd", "kv_producer", pd_node),
                instance("decode", "node-pd", "kv_consumer", pd_node)])
            setups = {
                "colocated": _Setup(stack.enter_context(Router(
                    ["--backend", colocated.url, "--policy", "round-robin"], logs / "route-colocated.log")), colocated),
                "disaggregated": _Setup(stack.enter_context(Router(
                    ["--prefill", prefill.url, "--decode", decode.url], logs / "route-disaggregated.log")),
                    decode, prefill),
            }
            for repeat in range(args.repeats):
                for index, level in enumerate(levels):
                    # The same documents for both, back to back; which goes first alternates.
                    order = CONFIGS if (repeat + index) % 2 == 0 else CONFIGS[::-1]
                    outputs = {}
                    for config in order:
                        print(f"bench pd: {config}, round {repeat + 1} of {args.repeats}, c={level}...",
                              file=sys.stderr)
                        figures, outputs[config] = setups[config].measure(
                            args, model=model, concurrency=level, seed=1000 * repeat + index,
                            result_file=logs / f"{config}-round{repeat}-c{level}.json")
                        results["runs"][config].setdefault(level, []).append(figures)
                        print(f"bench pd: {config} c={level}: {figures}", file=sys.stderr)
                    results["outputs_equal"].setdefault(level, []).append(
                        sum(a == b for a, b in zip(*outputs.values(), strict=True)))
        except (RuntimeError, OSError) as exc:
            where = f" (logs in {logs})" if args.keep_logs else " (--keep-logs DIR keeps the logs)"
            print(f"flowkv bench pd: failed: {' '.join(str(exc).split())[-800:]}{where}", file=sys.stderr)
            return 1
    _summarize(results)
    return report(results, args, table=_print, plot=_plot)


def _summarize(results: dict[str, Any]) -> None:
    """Medians and ranges over the rounds per set-up and level, and disaggregated / colocated of
    each round (the two ran back to back on the same documents), as a median and a range."""
    results["median"] = {config: {level: serve.median_run(runs) for level, runs in by_level.items()}
                         for config, by_level in results["runs"].items()}
    results["range"] = {config: {level: serve.round_range(runs, FIGURES) for level, runs in by_level.items()}
                        for config, by_level in results["runs"].items()}
    for level, base_runs in results["runs"]["colocated"].items():
        pairs = list(zip(base_runs, results["runs"]["disaggregated"][level], strict=True))
        ratios = {}
        for key in FIGURES:
            per_round = [split[key] / base[key] for base, split in pairs]
            ratios[key] = {"median": statistics.median(per_round), "range": [min(per_round), max(per_round)],
                           "rounds": per_round}
        results["ratios"][level] = ratios


_LABELS = {"ttft_p50_ms": "TTFT p50 (ms)", "ttft_p99_ms": "TTFT p99 (ms)", "itl_p50_ms": "ITL p50 (ms)",
           "itl_p99_ms": "ITL p99 (ms)", "requests_per_s": "requests/s"}


def _print(results: dict[str, Any]) -> None:
    work, where = results["workload"], results["cores"]
    print(f"{work['docs']} documents x {work['asks']} asks, {work['doc_tokens']}+{work['question_tokens']} prompt "
          f"tokens, {work['output_tokens']} generated, {work['dtype']}; each vLLM pool holds {work['pool_docs']} "
          f"requests (its prefix cache {'on' if work['vllm_prefix_caching'] else 'off'}); colocated on cores "
          f"{where['colocated']}, prefill on {where['prefill']}, decode on {where['decode']}; median [range] of "
          f"{work['repeats']} round(s), the two set-ups interleaved")

    def cell(value: float, spread: list[float] | None = None, digits: int = 1) -> str:
        text = f"{value:.{digits}f}"
        return text + (f" [{spread[0]:.{digits}f}-{spread[1]:.{digits}f}]" if spread else "")

    for level in results["ratios"]:
        print()
        header = f"{'c=' + str(level):<34} {'colocated':>24} {'disaggregated':>24} {'disagg / colocated':>22}"
        print(header)
        print("-" * len(header))
        rows = {config: results["median"][config][level] for config in CONFIGS}
        for key in FIGURES:
            digits = 2 if key == "requests_per_s" else 1
            ratio = results["ratios"][level][key]
            print(f"{_LABELS[key]:<34} "
                  + " ".join(f"{cell(rows[c][key], results['range'][c][level][key], digits):>24}" for c in CONFIGS)
                  + f" {cell(ratio['median'], ratio['range'], 2) + 'x':>22}")
        computed = {c: rows[c]["computed_tokens"] + rows[c]["prefill_computed_tokens"] for c in CONFIGS}
        for label, values in (
                ("prompt tokens computed", computed),
                ("  of them by the decode instance", {"colocated": None,
                                                      "disaggregated": rows["disaggregated"]["computed_tokens"]}),
                ("prompt tokens from vLLM's cache", {c: rows[c]["cached_tokens"] + rows[c]["prefill_cached_tokens"]
                                                     for c in CONFIGS}),
                ("prompt tokens loaded from flowkv", {c: rows[c]["loaded_tokens"] for c in CONFIGS}),
                ("requests done", {c: rows[c]["completed"] for c in CONFIGS})):
            print(f"{label:<34} " + " ".join(f"{'-' if v is None else f'{v:,.0f}':>24}" for v in values.values()))
        equal = results["outputs_equal"][level]
        print(f"{'outputs equal, per round':<34} {'':>24} {'/'.join(map(str, equal)):>24} "
              f"{'of ' + str(int(rows['colocated']['completed'])):>22}")


def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(results["ratios"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.38
    for ax, (title, keys) in zip(axes, (("time to first token", ("ttft_p50_ms", "ttft_p99_ms")),
                                        ("inter-token latency", ("itl_p50_ms", "itl_p99_ms")))):
        groups = [(level, key) for level in levels for key in keys]
        for n, (config, color) in enumerate(zip(CONFIGS, ("#999999", "#2f6fdb"))):
            medians = [results["median"][config][level][key] for level, key in groups]
            spread = [results["range"][config][level][key] for level, key in groups]
            errors = [[m - lo for m, (lo, _) in zip(medians, spread)], [hi - m for m, (_, hi) in zip(medians, spread)]]
            ax.bar([i + (n - 0.5) * width for i in range(len(groups))], medians, width, color=color, label=config,
                   yerr=errors, capsize=3)
        ax.set_xticks(range(len(groups)), [f"c={level}\n{key.split('_')[1]}" for level, key in groups])
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle("colocated vs disaggregated prefill (vllm serve on the CPU): median and range of rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}", file=sys.stderr)
