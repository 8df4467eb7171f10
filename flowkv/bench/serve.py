"""``flowkv bench serve``: vLLM's OpenAI server under concurrent load, without a connector, with flowkv, with a peer.

For each configuration one ``vllm serve`` of the demo model starts on
loopback, as a user runs it (vLLM's own prefix caching on, its KV pool sized
to ``--pool-docs`` documents), and vLLM's own client, ``vllm bench serve``
(run in this process: no interpreter start and vLLM import per run), drives it
with its ``prefix_repetition`` dataset: ``--docs`` documents of
``--doc-tokens`` tokens, each asked ``--asks`` times with a different
``--question-tokens`` question, in shuffled order, greedy. There are more
documents than vLLM's pool holds, so its own prefix cache cannot serve them all.

=================  ============================================================
``none``           vLLM alone (its prefix cache only)
``ceiling``        vLLM alone with a KV pool that holds every document: its own
                   prefix cache serves every repeat — the best any KV cache
                   can do on this workload
``local-cpu``      flowkv, the memory tier
``cpu-disk``       flowkv, a memory tier of ``--memory-docs`` documents in front
                   of a disk tier (hits past memory are read from disk,
                   asynchronously)
``example``        vLLM's ``ExampleConnector`` (safetensors files)
=================  ============================================================

Every concurrency level gets documents of its own (another dataset seed),
so each starts cold. ``--repeats`` rounds (default 3) each start every
configuration's server afresh, configurations in turn, so a machine that
slows down slows them alike; the table gives medians over the rounds with
the range of requests/s and p99 TTFT: requests/s, TTFT p50 and p99, ITL p50,
the prompt tokens the connector served (flowkv's ``retrieved_tokens``;
vLLM's external prefix-cache hits for the peer), and requests/s and p99 TTFT
as ratios to ``none`` and to ``ceiling`` at the same concurrency::

    flowkv bench serve
    flowkv bench serve --configs none,local-cpu --concurrency 8 --repeats 3 --plot serve.png
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowkv.bench import chosen, positive, report
from flowkv.integration.harness import default_model_dir, kv_bytes_per_token, model_folder, setup_environment

__all__ = ["CONFIGS", "ClientFailed", "EAGER_HELP", "Server", "add_arguments", "add_workload_arguments", "answers",
           "client", "figures", "median_run", "model_len", "positive_ints", "round_range", "run",
           "group_running", "start_side_by_side", "stop_group", "summarize", "transfer_config"]

CONFIGS = ("none", "ceiling", "local-cpu", "cpu-disk", "example")
# Configurations without a connector: vLLM's own prefix cache, a small pool or one holding every document.
_NO_CONNECTOR = ("none", "ceiling")
SERVED_NAME = "bench"
# A server that has not answered /health by then is not coming up (a readiness bound, not a speed claim).
_READY_S = 900.0
# Metrics of the prompt tokens a connector served: flowkv's own count, and vLLM's.
_FLOWKV_TOKENS = "vllm:flowkv_retrieved_tokens"
_EXTERNAL_TOKENS = "vllm:external_prefix_cache_hits"
# --eager, for every benchmark that starts vllm serve.
EAGER_HELP = ("start each vllm serve with --enforce-eager: sooner, but not the compiled engine users serve "
              "with (for a quick look, not for figures)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench serve``."""
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    add_workload_arguments(parser, concurrency="1,4,8,16", docs=48, output_tokens=16, pool_docs=16)
    parser.add_argument("--memory-docs", type=int, default=8,
                        help="cpu-disk: documents its memory tier holds; the rest come from disk (default 8)")
    parser.add_argument("--chunk-size", type=int, default=256, help="flowkv's chunk size (default 256)")
    parser.add_argument("--plot", metavar="FILE.png", help="write requests/s and p99 TTFT against concurrency")


def add_workload_arguments(parser: argparse.ArgumentParser, *, concurrency: str, docs: int, output_tokens: int,
                           pool_docs: int) -> None:
    """The options of the workload, its rounds and its servers (``bench serve``'s, and ``bench pd``'s),
    with these defaults."""
    parser.add_argument("--concurrency", default=concurrency,
                        help=f"comma-separated client concurrency levels (default {concurrency})")
    for flag, default, what in (("--docs", docs, "documents per run"), ("--asks", 3, "requests per document"),
                                ("--doc-tokens", 1024, "tokens per document"),
                                ("--question-tokens", 32, "tokens after the document"),
                                ("--output-tokens", output_tokens, "tokens generated per request")):
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    parser.add_argument("--pool-docs", type=int, default=pool_docs,
                        help=f"vLLM's KV pool (each server's), in requests of one document each (default {pool_docs})")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of every configuration; the table shows medians and ranges (default 3)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn vLLM's own prefix cache off (every reuse then comes from the connector)")
    parser.add_argument("--eager", action="store_true", help=EAGER_HELP)
    parser.add_argument("--model-dir", default=str(default_model_dir()), help="the model folder (default: the demo model)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--keep-logs", metavar="DIR",
                        help="keep each server's log and each client's result (its outputs too, in bench pd) here")


def positive_ints(text: str, what: str) -> list[int]:
    """The positive integers of a comma-separated option ``what``; ValueError otherwise."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


# -- one server --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _vllm_command() -> list[str]:
    """The ``vllm`` console script of this interpreter's environment."""
    script = Path(sys.executable).parent / "vllm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def transfer_config(config: str, folder: Path, *, chunk_size: int | None, memory_bytes: int, kv_role: str = "kv_both",
                    extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of a configuration (None: no connector); its files go under ``folder``.
    A flowkv configuration is the pipeline of that name in ``kv_role``, with ``extra`` settings on top
    (``chunk_size`` None: the pipeline's own)."""
    if config in _NO_CONNECTOR:
        return None
    if config == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(folder / "example")}}
    # Unix socket paths are limited to 107 bytes: the lookup sockets get a short folder of their own.
    ipc_dir = tempfile.mkdtemp(prefix="fkv-", dir=folder if len(str(folder)) < 40 else None)
    # Lookups wait for an idle worker; on a machine shared with other work 200 ms can pass first.
    settings: dict[str, Any] = {"pipeline": config, "ipc_dir": ipc_dir, "lookup_timeout_ms": 2000,
                                **({"chunk_size": chunk_size} if chunk_size is not None else {}), **(extra or {})}
    if config == "cpu-disk":
        settings["tiers.disk.path"] = str(folder / "disk")
        settings["tiers.memory.capacity"] = memory_bytes
    return {"kv_connector": "FlowKVConnector", "kv_connector_module_path": "flowkv.integration.vllm",
            "kv_role": kv_role, "kv_connector_extra_config": settings}


class Server:
    """One ``vllm serve`` on loopback, in a process group of its own, its output in ``log``; ``env``
    adds to its environment (e.g. ``VLLM_CPU_OMP_THREADS_BIND``)."""

    def __init__(self, model: Path, folder: Path, *, transfer: dict[str, Any] | None, pool_bytes: int,
                 max_model_len: int, prefix_caching: bool = True, eager: bool = False, dtype: str = "bfloat16",
                 env: dict[str, str] | None = None, name: str = "server") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"{name}.log"
        self.env = env or {}
        self.command = [*_vllm_command(), "serve", str(model), "--served-model-name", SERVED_NAME,
                        "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                        "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(pool_bytes),
                        "--seed", "0"]
        if not prefix_caching:
            self.command.append("--no-enable-prefix-caching")
        if eager:
            self.command.append("--enforce-eager")
        if transfer is not None:
            self.command += ["--kv-transfer-config", json.dumps(transfer)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        return self.launch().ready()

    def launch(self) -> Server:
        """Start the process, without waiting for it to answer (``ready`` does)."""
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), **self.env}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._deadline = time.monotonic() + _READY_S
        return self

    def ready(self) -> Server:
        """Wait until the launched server answers ``/health``; one that exits or never answers is
        stopped, and a ``RuntimeError`` carries its log's tail."""
        while not self.answered():
            time.sleep(0.5)
        return self

    def answered(self) -> bool:
        """Whether the launched server answers ``/health`` yet; ``RuntimeError`` (the server stopped) once it
        exited or its time to start is up."""
        assert self.proc is not None, "launch() first"
        if self._healthy():
            return True
        if self.proc.poll() is not None or time.monotonic() > self._deadline:
            self.__exit__()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vllm serve did not come up:\n{tail}")
        return False

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            stop_group(self.proc)

    def _healthy(self) -> bool:
        return answers(self.url + "/health")

    def flowkv_stats(self) -> dict[str, Any]:
        """The flowkv engine statistics of the server's worker (rank 0), over its lookup socket."""
        from flowkv.integration._ipc import query_worker

        extra = json.loads(self.command[self.command.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        [socket_file] = Path(extra["ipc_dir"]).glob("*-r0.sock")
        return query_worker(socket_file, "stats")["stats"]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus counter's samples (``name`` or ``name_total``) on /metrics, of those
        with ``labels`` when given."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as reply:
            text = reply.read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(?:\{{([^}}]*)\}})?\s+(\S+)$")
        wanted = {f'{key}="{value}"' for key, value in labels.items()}
        return sum(float(m.group(2)) for line in text.splitlines()
                   if (m := pattern.match(line)) and wanted <= set((m.group(1) or "").split(",")))


def start_side_by_side(stack: contextlib.ExitStack, servers: Sequence[Server]) -> list[Server]:
    """Launch every server, then wait for each (stopped with ``stack``): a start is mostly one process
    importing vLLM on one core, so several side by side take little longer than one."""
    for server in servers:
        stack.callback(server.__exit__)
        server.launch()
    waiting = list(servers)
    while waiting:  # every one watched: the first to fail ends the wait
        waiting = [server for server in waiting if not server.answered()]
        if waiting:
            time.sleep(0.5)
    return list(servers)


def answers(url: str) -> bool:
    """Whether ``url`` answers a GET with 200 (within seconds)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_group(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything in its process group:
    SIGTERM, then SIGKILL for what is left once the leader exited or ``timeout_s`` passed (vLLM's
    engine core and workers outlive a front process that was killed alone)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # A signal is sent, not yet acted on: wait (bounded) until no member of the group is still running,
    # so the next configuration does not start beside an engine still tearing down its memory.
    deadline = time.monotonic() + 10.0
    while group_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def group_running(pgid: int) -> list[int]:
    """The processes of group ``pgid`` not yet dead (a zombie left for its new parent to reap counts as
    dead), from ``/proc``."""
    running = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # After the command name's closing parenthesis: state, ppid, pgrp, ...
            state, _ppid, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # gone while we looked
        if int(pgrp) == pgid and state not in ("Z", "X"):
            running.append(int(entry.name))
    return running


# -- the client ------------------------------------------------------------------------------------


class ClientFailed(RuntimeError):
    """``vllm bench serve`` stopped with an error (its log has the rest)."""


def client(url: str, args: argparse.Namespace, *, model: Path, concurrency: int, seed: int,
           result_file: Path, detailed: bool = False) -> dict[str, Any]:
    """One ``vllm bench serve`` run of the workload in ``args`` against ``url``, greedy; its result JSON
    (``detailed``: with each request's ``generated_texts``, ``input_lens``, ``ttfts``, ``itls``). Its
    output goes to ``result_file``'s ``.log``; ``ClientFailed`` if it stops with an error."""
    argv = [
        "--backend", "vllm", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(model),
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.doc_tokens),
        "--prefix-repetition-suffix-len", str(args.question_tokens),
        "--prefix-repetition-num-prefixes", str(args.docs),
        "--prefix-repetition-output-len", str(args.output_tokens),
        "--num-prompts", str(args.docs * args.asks), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--num-warmups", "0",
        # The servers answered /health already; its "initial test run" would be one request more, uncounted.
        "--ready-check-timeout-sec", "0",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
        "--save-result", "--result-dir", str(result_file.parent), "--result-filename", result_file.name,
        *(["--save-detailed"] if detailed else []),
    ]
    log_path = result_file.with_suffix(".log")
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            _vllm_bench_serve(argv, log)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any stop of vLLM's client is a failed run
            raise ClientFailed(f"vllm bench serve failed: {exc!r} (its log: {log_path})") from exc
    return json.loads(result_file.read_text())


def _vllm_bench_serve(argv: list[str], log: Any) -> None:
    """``vllm bench serve ARGV`` in this process, as its command line runs it (vLLM's parser and main),
    everything it prints or logs written to ``log``: a run costs no interpreter start and vLLM import
    (~5-8 s of CPU each, the server's cores' time)."""
    vllm_logger = logging.getLogger("vllm")
    handlers, propagate = vllm_logger.handlers[:], vllm_logger.propagate
    to_log = logging.StreamHandler(log)
    to_log.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            from vllm.benchmarks.serve import add_cli_args, main  # what vLLM prints on import: to the log too
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            vllm_logger.handlers, vllm_logger.propagate = [to_log], False
            parser = FlexibleArgumentParser(prog="vllm bench serve")
            add_cli_args(parser)
            main(parser.parse_args(argv))
    finally:
        vllm_logger.handlers, vllm_logger.propagate = handlers, propagate
        # It freezes the heap for its run (vllm.utils.gc_utils.freeze_gc_heap): unfrozen, what it left is
        # collected (the objects of modules it loaded too, at exit: else nanobind reports them leaked).
        gc.unfreeze()


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of a ``vllm bench serve`` result that the tables show."""
    return {
        "requests_per_s": result["request_throughput"],
        "ttft_p50_ms": result["p50_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "itl_p50_ms": result["p50_itl_ms"],
        "itl_p99_ms": result["p99_itl_ms"],
        "completed": result["completed"],
        "failed": result.get("failed", 0),
    }


def drive(server: Server, args: argparse.Namespace, *, model: Path, concurrency: int, seed: int,
          result_file: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``server``; its figures, and the connector's tokens."""
    before = {name: server.metric(name) for name in (_FLOWKV_TOKENS, _EXTERNAL_TOKENS)}
    result = client(server.url, args, model=model, concurrency=concurrency, seed=seed, result_file=result_file)
    return figures(result) | {
        "flowkv_tokens": server.metric(_FLOWKV_TOKENS) - before[_FLOWKV_TOKENS],
        "connector_tokens": server.metric(_EXTERNAL_TOKENS) - before[_EXTERNAL_TOKENS],
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over the rounds of each figure of a run."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


# The figures whose spread over the rounds the table shows.
_SPREAD = ("requests_per_s", "ttft_p99_ms", "itl_p50_ms")


def round_range(runs: list[dict[str, Any]], keys: tuple[str, ...] = _SPREAD) -> dict[str, list[float]]:
    """[min, max] over the rounds of each figure in ``keys``."""
    return {key: [min(run[key] for run in runs), max(run[key] for run in runs)] for key in keys}


# -- the benchmark ------------------------------------------------------------------------------------


def model_len(args: argparse.Namespace) -> int:
    """The servers' ``--max-model-len`` for the workload in ``args``: one request, with room for the
    re-tokenized prompt (vLLM's dataset decodes and re-encodes it), in whole blocks."""
    request_tokens = args.doc_tokens + args.question_tokens + args.output_tokens
    return -(-(request_tokens + 64) // 128) * 128


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    try:
        configs = chosen(args.configs, CONFIGS, "--configs")
        levels = positive_ints(args.concurrency, "--concurrency")
        positive(args, ("docs", "asks", "doc_tokens", "question_tokens", "output_tokens", "pool_docs", "memory_docs",
                        "repeats"))
    except ValueError as exc:
        print(f"flowkv bench serve: {exc}", file=sys.stderr)
        return 2
    setup_environment()
    model = model_folder(args.model_dir)
    max_model_len = model_len(args)
    token_bytes = kv_bytes_per_token(model)
    results: dict[str, Any] = {"model": str(model), "configs": configs, "concurrency": levels,
                               "workload": {k: getattr(args, k) for k in ("docs", "asks", "doc_tokens",
                                            "question_tokens", "output_tokens", "pool_docs", "memory_docs",
                                            "repeats")} | {"vllm_prefix_caching": not args.no_prefix_caching,
                                                          "eager": args.eager},
                               "runs": {}, "median": {}, "failed": {}}
    # The ceiling's pool holds every document of every level (each level has documents of its own).
    pools = {config: (args.docs * len(levels) + args.pool_docs if config == "ceiling" else args.pool_docs)
             for config in configs}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {config: {} for config in configs}
    with tempfile.TemporaryDirectory(prefix="fkv-bench-serve-") as tmp:
        logs = Path(args.keep_logs) if args.keep_logs else Path(tmp)
        for repeat in range(args.repeats):
            for config in configs:
                if config in results["failed"]:
                    continue
                folder = Path(tempfile.mkdtemp(prefix=f"{config}-", dir=tmp))
                log_folder = logs / config / f"round{repeat}"
                log_folder.mkdir(parents=True, exist_ok=True)
                transfer = transfer_config(config, folder, chunk_size=args.chunk_size,
                                           memory_bytes=args.memory_docs * args.doc_tokens * token_bytes)
                print(f"bench serve: {config}, round {repeat + 1} of {args.repeats}...", file=sys.stderr)
                level = None
                try:
                    server = Server(model, log_folder, transfer=transfer, max_model_len=max_model_len,
                                    pool_bytes=pools[config] * max_model_len * token_bytes,
                                    prefix_caching=config == "ceiling" or not args.no_prefix_caching,
                                    eager=args.eager)
                    with server:
                        for index, level in enumerate(levels):
                            run = drive(server, args, model=model, concurrency=level, seed=1000 * repeat + index,
                                        result_file=log_folder / f"c{level}.json")
                            runs[config].setdefault(level, []).append(run)
                            print(f"bench serve: {config} c={level}: {run}", file=sys.stderr)
                # A peer that fails (to start, or mid-run: its server died) is reported with the
                # rounds it finished, and not started again.
                except (RuntimeError, OSError) as exc:
                    where = f"at concurrency {level}: " if level is not None else ""
                    results["failed"][config] = where + " ".join(str(exc).split())[-400:]
                    for level_runs in runs[config].values():  # keep whole rounds only
                        del level_runs[repeat:]
    summarize(results, runs)
    return report(results, args, table=_print, plot=_plot)


def summarize(results: dict[str, Any], runs: dict[str, dict[int, list[dict[str, Any]]]]) -> None:
    """Fill ``results``' ``runs``, ``median`` and ``range`` from each configuration's rounds at each
    concurrency (a configuration with no whole round left out), then the ratios between the medians."""
    for config, by_level in runs.items():
        by_level = {level: level_runs for level, level_runs in by_level.items() if level_runs}
        if by_level:
            results["runs"][config] = by_level
            results["median"][config] = {lvl: median_run(level_runs) for lvl, level_runs in by_level.items()}
            results.setdefault("range", {})[config] = {lvl: round_range(level_runs)
                                                       for lvl, level_runs in by_level.items()}
    _ratios(results)


def _ratios(results: dict[str, Any]) -> None:
    """Requests/s, p99 TTFT and ITL p50 of each configuration against ``none`` and ``ceiling`` at the
    same concurrency (medians over the rounds)."""
    for name in _NO_CONNECTOR:
        base = results["median"].get(name)
        if not base:
            continue
        for rows in results["median"].values():
            for level, row in rows.items():
                ref = base.get(level)
                if ref:
                    row[f"requests_per_s_vs_{name}"] = row["requests_per_s"] / ref["requests_per_s"]
                    row[f"ttft_p99_vs_{name}"] = row["ttft_p99_ms"] / ref["ttft_p99_ms"]
                    row[f"itl_p50_vs_{name}"] = row["itl_p50_ms"] / ref["itl_p50_ms"]


def _print(results: dict[str, Any]) -> None:
    work = results["workload"]
    print(f"{work['docs']} documents x {work['asks']} asks, {work['doc_tokens']}+{work['question_tokens']} prompt "
          f"tokens, {work['output_tokens']} generated; vLLM's pool holds {work['pool_docs']} requests "
          f"(its prefix cache {'on' if work['vllm_prefix_caching'] else 'off'}; ceiling: every document, prefix cache on); "
          f"median and range of {work['repeats']} round(s), configurations in turn")
    header = (f"{'config':<10} {'conc':>4} {'req/s':>7} {'range':>11} {'x none':>7} {'x ceil':>7} {'TTFT p50':>9} "
              f"{'TTFT p99':>9} {'range':>11} {'x none':>7} {'x ceil':>7} {'ITL p50':>8} {'x none':>7} "
              f"{'connector tokens':>17} {'done':>5}")
    print(header)
    print("-" * len(header))

    def ratio(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:6.2f}x" if key in row else "      -"

    for config, rows in results["median"].items():
        for level, row in rows.items():
            tokens = row["flowkv_tokens"] if config in ("local-cpu", "cpu-disk") else row["connector_tokens"]
            spread = results.get("range", {}).get(config, {}).get(level, {})
            low, high = spread.get("requests_per_s", [row["requests_per_s"]] * 2)
            p99_low, p99_high = spread.get("ttft_p99_ms", [row["ttft_p99_ms"]] * 2)
            print(f"{config:<10} {level:>4} {row['requests_per_s']:>7.2f} {f'{low:.2f}-{high:.2f}':>11} "
                  f"{ratio(row, 'requests_per_s_vs_none')} {ratio(row, 'requests_per_s_vs_ceiling')} "
                  f"{row['ttft_p50_ms']:>7.0f}ms {row['ttft_p99_ms']:>7.0f}ms {f'{p99_low:.0f}-{p99_high:.0f}':>11} "
                  f"{ratio(row, 'ttft_p99_vs_none')} {ratio(row, 'ttft_p99_vs_ceiling')} "
                  f"{row['itl_p50_ms']:>6.1f}ms {ratio(row, 'itl_p50_vs_none')} {tokens:>17,.0f} "
                  f"{row['completed']:>5.0f}")
    print("(connector tokens: flowkv's retrieved tokens; for the peer, vLLM's external prefix-cache hits)")
    for config, why in results["failed"].items():
        print(f"{config}: failed: {why}")


def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config, runs in results["runs"].items():
        levels = sorted(runs)
        for ax, key in ((left, "requests_per_s"), (right, "ttft_p99_ms")):
            values = [[run[key] for run in runs[level]] for level in levels]
            medians = [statistics.median(v) for v in values]
            spread = [[m - min(v) for m, v in zip(medians, values)], [max(v) - m for m, v in zip(medians, values)]]
            ax.errorbar(levels, medians, yerr=spread, marker="o", capsize=3, label=config)
    left.set_ylabel("requests / s")
    right.set_ylabel("TTFT p99 (ms)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("vllm serve (CPU) on a shared-prefix workload: median and range of repeats")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)
