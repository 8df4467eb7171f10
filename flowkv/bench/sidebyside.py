"""``flowkv bench side-by-side``: the floor, no connector, flowkv's configurations and LMCache's MP mode, one table.

Every configuration runs the same workload (`flowkv.bench.rounds`:
``--docs`` documents of ``--doc-tokens`` tokens; round 1 asks each its first
question, cold, and a connector stores it; round 2 asks each a second
question, a hit) in a process of its own, with vLLM in its own processes as
a user runs it. Configurations take turns, ``--repeats`` times over (the
order rotates each round), so a machine that slows down slows them alike.

=======================  ====================================================
``floor``                no connector, vLLM's prefix cache on and a pool that
                         holds every document: the best a hit can be
``no connector``         no connector, vLLM's pool of ``--pool-docs`` documents
``local-cpu``            flowkv's memory tier (pre-fault in the background)
``local-cpu off``        the same, ``prefault = "off"``
``local-cpu now``        the same, ``prefault = "now"``
``node``                 flowkv through a node server started before vLLM
``cpu-disk``             flowkv with a memory tier of ``--memory-docs``
                         documents in front of a disk tier: hits read files
``LMCache MP``           LMCache's MP mode (``lmcache server`` and vLLM's
                         ``LMCacheMPConnector``), run by the Python of its own
                         virtual environment (``--lmcache-python``; see
                         ``examples/peers/setup-lmcache.sh``)
=======================  ====================================================

The table gives, per configuration, the median over the rounds of each
round's median TTFT with its range; round 1 as a ratio to no connector and
round 2 to the floor, each ratio taken within a round (so both sides ran
minutes apart) and shown as median [range]; the fewest tokens vLLM reported
cached in round 2; and how many greedy tokens equal no connector's. The load
average is printed beside each round. ``--trace DIR`` makes flowkv's
configurations write traces there, and the table then gives the transfer
stages' GB/s (``flowkv trace summarize``) against a 2-thread copy measured
by this process between the rounds::

    flowkv bench side-by-side                                 # the 4k table, 5 rounds
    flowkv bench side-by-side --docs 4 --doc-tokens 12288     # 12k documents
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
from pathlib import Path
from typing import Any

from flowkv.bench import chosen, positive, report
from flowkv.bench.rounds import Workload, kv_bytes_per_token

__all__ = ["CONFIGS", "add_arguments", "run", "summarize"]

FLOOR, NONE, MEMORY, LMCACHE = "floor", "no connector", "local-cpu", "LMCache MP"
CONFIGS = (FLOOR, NONE, MEMORY, "local-cpu off", "local-cpu now", "node", "cpu-disk", LMCACHE)
# flowkv's configurations: pipeline and overrides (the disk tier's folder and the node socket are
# added per run).
_FLOWKV = {
    MEMORY: ("local-cpu", {}),
    "local-cpu off": ("local-cpu", {"tiers.memory.prefault": "off"}),
    "local-cpu now": ("local-cpu", {"tiers.memory.prefault": "now"}),
    "node": ("node", {}),
    "cpu-disk": ("cpu-disk", {}),
}
# Hit rows held against another row than the floor too: the goal of each (node <= 1.1x in-process,
# disk <= 1.3x a memory hit).
_AGAINST = {"node": MEMORY, "cpu-disk": MEMORY}
PEER_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "peers" / "lmcache_mp_ttft.py"
DEFAULT_LMCACHE_PYTHON = Path.home() / ".cache" / "flowkv" / "peers" / "lmcache" / "bin" / "python"
# A child that has not answered by then is stuck (a bound, not a speed claim).
_CHILD_S = 1800.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench side-by-side``."""
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    for flag, default, what in (("--docs", 8, "documents"), ("--doc-tokens", 4096, "tokens per document"),
                                ("--question-tokens", 32, "tokens per question"),
                                ("--repeats", 5, "rounds of every configuration")):
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    parser.add_argument("--pool-docs", type=float, default=2.5,
                        help="vLLM's own KV pool, in documents (default 2.5; the floor's holds them all)")
    parser.add_argument("--memory-docs", type=float, default=2.5,
                        help="cpu-disk: documents its memory tier holds (default 2.5): hits come from disk")
    parser.add_argument("--model-dir", default=None, help="the model folder (default: the demo model)")
    parser.add_argument("--lmcache-python", default=str(DEFAULT_LMCACHE_PYTHON),
                        help="the Python of LMCache's own virtual environment (default: where "
                             "examples/peers/setup-lmcache.sh makes it); without it the row says why")
    parser.add_argument("--trace", metavar="DIR", help="flowkv's configurations write traces here; the table "
                                                       "gives their transfer stages' GB/s")
    parser.add_argument("--eager", action="store_true", help="vLLM without compiling (a quick look, not figures)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one configuration, in this process
    parser.add_argument("--workload", help=argparse.SUPPRESS)


def _model(args: argparse.Namespace) -> Path:
    from flowkv.integration.harness import model_folder

    return model_folder(args.model_dir)


def _workload(args: argparse.Namespace, model: Path) -> Workload:
    from flowkv.integration.harness import model_config

    vocab = model_config(model)["vocab_size"]
    return Workload(docs=args.docs, doc_tokens=args.doc_tokens, question_tokens=args.question_tokens, vocab=vocab,
                    pool_docs=args.pool_docs)


def run(args: argparse.Namespace) -> int:
    """Run the table (or, with the hidden ``--child``, one configuration); print it. Returns the exit status."""
    if args.child:
        return _run_child(args)
    try:
        configs = chosen(args.configs, CONFIGS, "--configs")
        positive(args, ("docs", "doc_tokens", "question_tokens", "repeats"))
        if not 1 <= args.pool_docs < args.docs:
            raise ValueError("--pool-docs must be at least 1 (one request) and fewer than --docs (else vLLM alone hits)")
    except ValueError as exc:
        print(f"flowkv bench side-by-side: {exc}", file=sys.stderr)
        return 2
    from flowkv.integration.harness import setup_environment

    setup_environment()
    model = _model(args)
    workload = _workload(args, model)
    results: dict[str, Any] = {"workload": json.loads(workload.to_json()), "configs": configs,
                               "repeats": args.repeats, "runs": {name: [] for name in configs},
                               "failed": {}, "load": [], "copy_gbps": [], "trace": args.trace}
    with tempfile.TemporaryDirectory(prefix="flowkv-side-by-side-") as tmp:
        workload_file = Path(tmp) / "workload.json"
        workload_file.write_text(workload.to_json(), encoding="utf-8")
        for round_index in range(args.repeats):
            if args.trace:
                results["copy_gbps"].append(_copy_gbps())
            order = configs[round_index % len(configs):] + configs[:round_index % len(configs)]
            for name in order:
                load = os.getloadavg()[0]
                print(f"bench side-by-side: round {round_index + 1}/{args.repeats}: {name} (load {load:.2f})",
                      file=sys.stderr)
                results["load"].append(load)
                answer = _one(name, args, model, workload_file, round_index)
                if "error" in answer:
                    results["failed"].setdefault(name, []).append(answer["error"])
                    answer = None
                results["runs"][name].append(answer)
    summarize(results)
    return report(results, args, table=_print)


# -- one configuration, in a process of its own --------------------------------------------------------


def _one(name: str, args: argparse.Namespace, model: Path, workload_file: Path, round_index: int) -> dict[str, Any]:
    """Run configuration ``name`` in a child process: its answer (see `flowkv.bench.rounds`), or
    ``{"error": why}``."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # the workload sizes the pool
    if name == LMCACHE:
        python = Path(args.lmcache_python)
        if not python.exists():
            return {"error": f"no LMCache environment at {python} (examples/peers/setup-lmcache.sh makes one)"}
        if not PEER_SCRIPT.exists():
            return {"error": f"the peer script {PEER_SCRIPT} is not here (it ships with the source tree)"}
        command = [str(python), str(PEER_SCRIPT), "--rounds", str(workload_file), "--model-dir", str(model)]
        # Nothing of this tree on the peer's path: its libraries probe for modules by name (transformers
        # imports a top-level "kernels" where it finds one), and this tree's would pull in flowkv there.
        env.pop("PYTHONPATH", None)
    else:
        command = [sys.executable, "-m", "flowkv.cli", "bench", "side-by-side", "--child", name,
                   "--workload", str(workload_file), "--model-dir", str(model),
                   "--memory-docs", str(args.memory_docs)]
        if args.trace and name in _FLOWKV:
            command += ["--trace", str(Path(args.trace) / f"{name.replace(' ', '-')}-{round_index + 1}")]
    if args.eager:
        command.append("--eager")
    # Output to files, not pipes: the child's engine processes inherit its stdout, and a pipe would
    # stay open (the parent waiting on it) as long as they outlive a child that was killed.
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out, \
            tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=out, stderr=log, text=True, env=env, start_new_session=True)
        try:
            proc.wait(timeout=_CHILD_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            from flowkv.bench.serve import stop_group

            stop_group(proc, timeout_s=30)  # vLLM's engine processes too
        out.seek(0)
        lines = [line for line in out.read().splitlines() if line.startswith("{")]
        if proc.returncode == 0 and lines:
            return json.loads(lines[-1])
        log.seek(0)
        tail = " ".join(log.read().split())[-400:]
        return {"error": f"exit {proc.returncode}: {tail}"}


def _run_child(args: argparse.Namespace) -> int:
    from flowkv.bench.rounds import ask_rounds, build_engine, print_result
    from flowkv.integration.harness import setup_environment, shutdown

    setup_environment()
    model = Path(args.model_dir)
    workload = Workload.from_json(Path(args.workload).read_text(encoding="utf-8"))
    name = args.child
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flowkv-side-")))
        transfer, hooks = None, {}
        if name in _FLOWKV:
            pipeline, extra = _FLOWKV[name]
            extra = dict(extra)
            doc_bytes = workload.doc_tokens * kv_bytes_per_token(model)
            if name == "node":
                from flowkv.bench.node import node_server

                socket = stack.enter_context(node_server(2 * workload.docs * doc_bytes + (256 << 20)))
                extra["tiers.node.socket"] = str(socket)
            if name == "cpu-disk":
                extra["tiers.disk.path"] = str(folder / "disk")
                extra["tiers.memory.capacity"] = max(1 << 20, int(args.memory_docs * doc_bytes))
            if args.trace:
                extra.update({"telemetry.exporter": "file", "telemetry.folder": args.trace})
            transfer = {"kv_connector": "FlowKVConnector", "kv_connector_module_path": "flowkv.integration.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {"pipeline": pipeline, **extra}}
        started = time.perf_counter()
        llm = build_engine(model, workload, kv_transfer_config=transfer, prefix_caching=name == FLOOR,
                           floor=name == FLOOR, eager=args.eager)
        start_s = time.perf_counter() - started
        if name == "cpu-disk":
            from flowkv.bench.capacity import wait_written

            hooks["between"] = lambda: wait_written(llm)
        try:
            result = ask_rounds(llm, workload, **hooks)
        finally:
            shutdown(llm)
        result["start_s"] = start_s
        print_result(result)
    return 0


# -- the table ------------------------------------------------------------------------------------------


def _copy_gbps() -> float:
    """A plain torch copy of 64 MiB with 2 threads, now (the yardstick of the transfer stages)."""
    import torch

    from flowkv.kernels import copy_gbps

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return round(copy_gbps(cached=False), 2)
    finally:
        torch.set_num_threads(threads)


def _median_range(values: list[float]) -> list[float] | None:
    return [statistics.median(values), min(values), max(values)] if values else None


def summarize(results: dict[str, Any]) -> None:
    """Add ``rows``: per configuration, each round's median TTFT over the rounds [median, min, max] in
    seconds, ratios within a round to no connector (round 1), the floor (round 2) and the row named in
    ``_AGAINST``, the fewest tokens cached in round 2, and greedy tokens equal to no connector's."""
    runs = results["runs"]

    def per_round(name: str, index: int) -> list[float | None]:
        return [statistics.median(a["ttft_s"] for a in answer["rounds"][index]) if answer else None
                for answer in runs.get(name, [])]

    def ratios(name: str, index: int, base: str) -> list[float] | None:
        if base not in runs or name == base:
            return None
        pairs = [(a, b) for a, b in zip(per_round(name, index), per_round(base, index)) if a and b]
        return _median_range([a / b for a, b in pairs])

    rows: dict[str, Any] = {}
    for name in results["configs"]:
        answers = [a for a in runs[name] if a]
        row: dict[str, Any] = {"runs": len(answers)}
        for index, key in ((0, "round1_s"), (1, "round2_s")):
            row[key] = _median_range([t for t in per_round(name, index) if t is not None])
        row["round1_vs_no_connector"] = ratios(name, 0, NONE)
        row["round2_vs_floor"] = ratios(name, 1, FLOOR)
        if name in _AGAINST:
            row[f"round2_vs_{_AGAINST[name]}"] = ratios(name, 1, _AGAINST[name])
        row["cached_tokens"] = min((a["cached_tokens"] for answer in answers for a in answer["rounds"][1]),
                                   default=None)
        row["start_s"] = _median_range([answer["start_s"] for answer in answers if "start_s" in answer])
        same = total = 0
        for answer, base in zip(runs[name], runs.get(NONE, [])):
            if answer and base:
                for ours, theirs in zip(sum(answer["rounds"], []), sum(base["rounds"], [])):
                    same += ours["token"] == theirs["token"]
                    total += 1
        row["tokens_equal"] = [same, total]
        rows[name] = row
    results["rows"] = rows
    if results.get("copy_gbps"):
        results["transfers"] = _transfers(results)


def _transfers(results: dict[str, Any]) -> dict[str, Any]:
    """Per flowkv configuration traced: each transfer stage's GB/s over the rounds [median, min, max],
    and as a share of the 2-thread copy (the median of those measured between rounds)."""
    from flowkv.otlp_json import load_spans
    from flowkv.tracetools.summarize import summarize as summarize_trace

    copy = statistics.median(results["copy_gbps"])
    out: dict[str, Any] = {"copy_gbps": _median_range(results["copy_gbps"])}
    trace_root = Path(results.get("trace") or "")
    for name in results["configs"]:
        if name not in _FLOWKV:
            continue
        stages: dict[str, list[float]] = {}
        for folder in sorted(trace_root.glob(f"{name.replace(' ', '-')}-*")):
            spans = [span for path in sorted(folder.glob("*.json")) for span in load_spans(path)]
            if not spans:
                continue
            for stage in summarize_trace(spans, copy_gbps=copy).stages:
                if stage.transfer and stage.gbps:
                    stages.setdefault(f"{stage.kind}/{stage.stage}", []).append(stage.gbps)
        out[name] = {stage: {"gbps": _median_range(v), "x_copy": statistics.median(v) / copy}
                     for stage, v in stages.items()}
    return out


def _ms(cell: list[float] | None) -> str:
    return "-" if cell is None else f"{cell[0] * 1e3:.1f} ({cell[1] * 1e3:.0f}-{cell[2] * 1e3:.0f})"


def _x(cell: list[float] | None) -> str:
    return "" if cell is None else f"{cell[0]:.2f}x [{cell[1]:.2f}-{cell[2]:.2f}]"


def _print(results: dict[str, Any]) -> None:
    w = results["workload"]
    loads = results["load"]
    print(f"{w['docs']} documents x {w['doc_tokens']} tokens + {w['question_tokens']}-token questions; vLLM's pool "
          f"{w['pool_docs']} documents; {results['repeats']} rounds; load average "
          f"{min(loads, default=0):.2f}-{max(loads, default=0):.2f}")
    header = ("configuration", "round 1: cold + save", "vs no connector", "round 2: hit", "vs floor",
              "tokens from cache", "greedy = no connector")
    print(" | ".join(header))
    for name, row in results["rows"].items():
        hit = _x(row["round2_vs_floor"])
        for key, value in row.items():
            if key.startswith("round2_vs_") and key != "round2_vs_floor" and value:
                hit += f"; {_x(value)} {key[len('round2_vs_'):]}"
        same, total = row["tokens_equal"]
        print(" | ".join((name, _ms(row["round1_s"]), _x(row["round1_vs_no_connector"]), _ms(row["round2_s"]), hit,
                          "-" if row["cached_tokens"] is None else str(row["cached_tokens"]),
                          f"{same}/{total}" if total else "-")))
    print("(ms: median over the rounds of each round's median TTFT, (range); ratios taken within a round, "
          "median [range])")
    transfers = results.get("transfers")
    if transfers:
        copy = transfers["copy_gbps"]
        print(f"transfer stages in vLLM (traces), against a 2-thread copy of {copy[0]:.1f} GB/s "
              f"({copy[1]:.1f}-{copy[2]:.1f}):")
        for name, stages in transfers.items():
            if name == "copy_gbps":
                continue
            for stage, cell in stages.items():
                gbps = cell["gbps"]
                print(f"  {name:14} {stage:20} {gbps[0]:.2f} GB/s ({gbps[1]:.2f}-{gbps[2]:.2f}) "
                      f"{cell['x_copy']:.2f}x copy")
    for name, why in results["failed"].items():
        print(f"{name}: failed {len(why)} of {results['repeats']} rounds: {why[-1]}")
