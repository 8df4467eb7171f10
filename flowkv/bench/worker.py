"""``flowkv bench engine --worker-conditions``: store and retrieve as they run inside vLLM's worker.

Inside vLLM's CPU worker the connector's copies run on the thread that drives
the model: the OpenMP master vLLM pinned to the first core of
``VLLM_CPU_OMP_THREADS_BIND``, with vLLM's other OpenMP workers pinned to the
other cores, computing or waiting, and vLLM's engine-core process spinning
(``sched_yield``) on its queue while the worker copies. (torch there keeps one
thread per bound core: "Reducing Torch threads from 2 to 1 for serving" is the
engine-core process's; tests/test_vllm_hooks.py pins both.) A standalone
benchmark with two torch threads and idle cores measures other conditions;
the ``worker`` condition below is a harsher stand-in (one torch thread, the
other cores computing), and ``flowkv bench side-by-side --trace`` gives the
figure of a real vLLM run. This mode measures both, taking turns in one run:

- ``copy``: a plain torch copy of the same bytes with two threads (or as
  many as the machine has), idle cores — the baseline every ratio is
  against, measured in every round;
- ``standalone``: store and retrieve as ``flowkv bench engine`` runs them
  (torch's own thread count, no load);
- ``worker``: store and retrieve with one torch thread, this thread pinned to
  the first core, while a forward-like load (a process of bf16 matrix
  products, one OpenMP thread pinned to each other core, as vLLM pins its
  workers; on a one-core machine, the same core) runs beside it.

Each round measures every condition once, in a rotating order; the figures
are medians over ``--repeats`` rounds with the spread (min-max) and the
median of each round's ratio to that round's copy.

    flowkv bench engine --worker-conditions --tokens 4096 --block-size 128
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from flowkv import KVTransfer
from flowkv.bench import expect_tokens
from flowkv.kernels import torch_kv

__all__ = ["LOAD_SOURCE", "ForwardLoad", "measure_worker", "print_worker"]

# The forward-like load: bf16 matrix products (a decoder layer's MLP at hidden 1,024) on
# OpenMP threads that the environment pins one per core, forever; "ready" once running.
LOAD_SOURCE = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(64, 1024, dtype=torch.bfloat16)
w = torch.randn(1024, 4096, dtype=torch.bfloat16)
x @ w
print("ready", flush=True)
while True:
    x @ w
"""


class ForwardLoad:
    """A process computing like a forward pass on ``cores`` (one pinned OpenMP thread each).

    It starts paused; `running` is a context in which it computes.
    """

    def __init__(self, cores: list[int]) -> None:
        self.cores = cores
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cores)), "OMP_PROC_BIND": "true",
               "OMP_PLACES": ",".join(f"{{{core}}}" for core in cores)}
        self._process = subprocess.Popen([sys.executable, "-c", LOAD_SOURCE, str(len(cores))], env=env,
                                         stdout=subprocess.PIPE, text=True)
        try:
            os.sched_setaffinity(self._process.pid, set(cores))
        except OSError:
            pass
        if self._process.stdout is None or self._process.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the forward-like load process did not start")
        self._process.send_signal(signal.SIGSTOP)

    def running(self) -> _Running:
        return _Running(self._process)

    def close(self) -> None:
        self._process.kill()
        self._process.wait()


class _Running:
    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process

    def __enter__(self) -> None:
        self._process.send_signal(signal.SIGCONT)
        time.sleep(0.02)  # its threads are back on their cores

    def __exit__(self, *exc: object) -> None:
        self._process.send_signal(signal.SIGSTOP)


def _timed(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_worker(args: argparse.Namespace, *, engine: Any, src: list[torch.Tensor], dst: list[torch.Tensor],
                   slots: torch.Tensor, fresh_tokens: Callable[[], torch.Tensor], kv_bytes: int) -> dict[str, Any]:
    """The ``copy``, ``standalone`` and ``worker`` conditions, ``args.repeats`` rounds (see the module)."""
    n = slots.numel()
    cores = sorted(os.sched_getaffinity(0))
    copy_threads = min(2, len(cores)) if len(cores) > 1 else 1
    standalone_threads = torch.get_num_threads()
    a = torch.ones(kv_bytes, dtype=torch.uint8)
    b = torch.empty(kv_bytes, dtype=torch.uint8)
    load = ForwardLoad(cores[1:] or cores[:1])
    conditions = ("copy", "standalone", "worker")
    # A copier of its own per condition: its helper threads are placed by the thread that
    # makes its first copy, so the worker's are started by the pinned thread, as vLLM's
    # worker thread starts them.
    copiers = {condition: torch_kv.RowCopier() for condition in conditions}
    kept_copier = torch_kv.copier
    times: dict[str, dict[str, list[float]]] = {c: {"store": [], "retrieve": [], "copy": []} for c in conditions}

    def store_and_retrieve(into: dict[str, list[float]]) -> None:
        engine.memory.clear()
        tokens = fresh_tokens()
        into["store"].append(_timed(lambda: expect_tokens(
            engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots)).stored_tokens, n, "store")))
        into["retrieve"].append(_timed(lambda: expect_tokens(
            int(engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst,
                                           slot_mapping=slots)).ret_mask.sum()), n, "retrieve")))

    def run(condition: str, record: bool) -> None:
        into = times[condition] if record else {"store": [], "retrieve": [], "copy": []}
        torch_kv.copier = copiers[condition]
        if condition == "copy":
            torch.set_num_threads(copy_threads)
            into["copy"].append(_timed(lambda: b.copy_(a)))
        elif condition == "standalone":
            torch.set_num_threads(standalone_threads)
            store_and_retrieve(into)
        else:
            torch.set_num_threads(1)
            os.sched_setaffinity(0, {cores[0]})  # this thread only: vLLM's OpenMP master
            try:
                with load.running():
                    into["copy"].append(_timed(lambda: b.copy_(a)))
                    store_and_retrieve(into)
            finally:
                os.sched_setaffinity(0, set(cores))

    try:
        for condition in conditions:  # warm-up: first-touch faults, thread pools
            run(condition, record=False)
        for round_ in range(args.repeats):
            shift = round_ % len(conditions)
            for condition in conditions[shift:] + conditions[:shift]:
                run(condition, record=True)
    finally:
        load.close()
        torch.set_num_threads(standalone_threads)
        torch_kv.copier = kept_copier

    gbps = lambda seconds: kv_bytes / seconds / 1e9  # noqa: E731
    copy_rounds = times["copy"]["copy"]
    result: dict[str, Any] = {
        "cores": len(cores),
        "copy_threads": copy_threads,
        "standalone_threads": standalone_threads,
        "load_cores": load.cores,
        # Where each condition's copy helpers ran (threads, cores; None: the creator's).
        "copy_helpers": {c: {"threads": copiers[c].helpers, "cores": copiers[c].cores,
                             "share": copiers[c].helper_pieces / max(1, copiers[c].pieces)}
                         for c in ("standalone", "worker")},
        "copy_gbps": {"median": gbps(statistics.median(copy_rounds)), "min": gbps(max(copy_rounds)),
                      "max": gbps(min(copy_rounds))},
    }
    for condition in ("standalone", "worker"):
        entry: dict[str, Any] = {}
        for op in ("store", "retrieve") + (("copy",) if condition == "worker" else ()):
            seconds = _spread(times[condition][op])
            entry[op] = {"median_gbps": gbps(seconds["median"]), "min_gbps": gbps(seconds["max"]),
                         "max_gbps": gbps(seconds["min"]),
                         "vs_copy": statistics.median(c / s for s, c in zip(times[condition][op], copy_rounds)),
                         "median_ms": seconds["median"] * 1e3}
        result[condition] = entry
    return result


def print_worker(r: dict[str, Any]) -> None:
    """The table of `measure_worker`'s figures (``r`` is ``flowkv bench engine``'s result)."""
    w = r["worker_conditions"]
    print(f"pipeline {r['pipeline']}, {r['geometry']}, {r['tokens']} tokens = {r['kv_bytes'] / 2**20:.0f} MiB "
          f"of KV, {r['repeats']} rounds (conditions interleaved; median [min-max])")
    c = w["copy_gbps"]
    print(f"copy baseline: plain torch copy, {w['copy_threads']} threads, idle cores: "
          f"{c['median']:.2f} GB/s [{c['min']:.2f}-{c['max']:.2f}]")
    print(f"{'':34}{'ms':>8}{'GB/s':>8}{'spread':>14}{'x copy':>8}")
    labels = {"standalone": f"standalone ({w['standalone_threads']} torch threads, no load)",
              "worker": f"worker (1 thread, load on cores {','.join(map(str, w['load_cores']))})"}
    for condition in ("standalone", "worker"):
        print(labels[condition])
        for op, figures in w[condition].items():
            name = "plain copy" if op == "copy" else op
            print(f"  {name:32}{figures['median_ms']:8.1f}{figures['median_gbps']:8.2f}"
                  f"{figures['min_gbps']:7.2f}-{figures['max_gbps']:<6.2f}{figures['vs_copy']:8.2f}")
    for condition, helpers in w.get("copy_helpers", {}).items():
        cores = ("the caller's cores" if helpers["cores"] is None
                 else "cores " + ",".join(map(str, sorted(helpers["cores"]))))
        print(f"{condition}: {helpers['threads']} copy helper thread(s) on {cores}, "
              f"{helpers['share']:.0%} of the pieces copied by them")
    print("x copy = median over rounds of GB/s / the same round's baseline copy")
