"""``flowkv bench runner``: what the runner adds per item and per stage.

A chain of ``--stages`` ``pass-through`` stages (loaded from TOML like any
pipeline) moves ``--items`` integers, in runs of ``--run-items``, four ways
in the same process, interleaved within each repeat:

- ``hand``: a hand-written loop chaining the same generator function over
  the same source: the baseline, the cost of the generators themselves;
- ``off``: ``Runner`` with OpenTelemetry's no-op tracer (its bare path);
- ``sampled``: an SDK ``TracerProvider`` sampling ``--sampling`` of the runs
  (sampling is per run, so short runs give the expected mix of traced and
  bare ones);
- ``on``: an SDK ``TracerProvider`` tracing every run.

The traced providers have one span processor that discards every span, so
the numbers are the runner's and the SDK's cost without any exporter I/O.
Each mode's best repeat is reported as overhead per item per stage against
the hand loop, and as a ratio to it.

    flowkv bench runner
    flowkv bench runner --items 20000 --stages 3 --json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, TraceIdRatioBased

from flowkv.pipeline import loads_pipeline
from flowkv.runner import Runner

__all__ = ["add_arguments", "measure", "run"]

MODES = ("hand", "off", "sampled", "on")


class _DiscardingProcessor(SpanProcessor):
    """Drops every span; counts the run roots it saw end, to report the sampled share."""

    def __init__(self) -> None:
        self.roots = 0

    def on_end(self, span: ReadableSpan) -> None:
        if span.parent is None:
            self.roots += 1


def _traced(sampler: Any) -> tuple[trace.Tracer, _DiscardingProcessor]:
    processor = _DiscardingProcessor()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(processor)
    return provider.get_tracer("flowkv.bench"), processor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench runner``."""
    parser.add_argument("--items", type=int, default=100_000, help="items per measurement (default 100000)")
    parser.add_argument("--stages", type=int, default=6, help="pass-through stages in the chain (default 6)")
    parser.add_argument("--run-items", type=int, default=1_000,
                        help="items per run; each run is one root span when traced (default 1000)")
    parser.add_argument("--sampling", type=float, default=0.5,
                        help="fraction of runs the 'sampled' mode traces (default 0.5)")
    parser.add_argument("--repeat", type=int, default=5, help="measurements per mode; the best is kept (default 5)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def measure(
    *, items: int = 100_000, stages: int = 6, run_items: int = 1_000, sampling: float = 0.5, repeat: int = 5
) -> dict[str, Any]:
    """Seconds per mode (best of ``repeat``) and the derived overheads and ratios."""
    if items <= 0 or stages <= 0 or run_items <= 0 or repeat <= 0:
        raise ValueError("--items, --stages, --run-items and --repeat must be positive")
    if not 0.0 <= sampling <= 1.0:
        raise ValueError(f"--sampling must be between 0 and 1, got {sampling}")
    runs = max(1, items // run_items)
    items = runs * run_items  # whole runs only
    text = "\n".join('[[store.stages]]\nuse = "pass-through"\n' for _ in range(stages))
    pipeline = loads_pipeline(text, file="<bench runner>")
    pass_through = pipeline.store[0].info.func

    def hand() -> None:
        for _ in range(runs):
            iterator: Any = iter(range(run_items))
            for _ in range(stages):
                iterator = pass_through(iterator)
            for _ in iterator:
                pass

    def with_runner(tracer: trace.Tracer) -> Callable[[], None]:
        chain = Runner(pipeline.store, kind="store", pipeline="bench", tracer=tracer)

        def go() -> None:
            for _ in range(runs):
                chain.run(range(run_items))

        return go

    sampled_tracer, sampled_seen = _traced(TraceIdRatioBased(sampling))
    on_tracer, on_seen = _traced(ALWAYS_ON)
    bodies = {
        "hand": hand,
        "off": with_runner(trace.NoOpTracer()),
        "sampled": with_runner(sampled_tracer),
        "on": with_runner(on_tracer),
    }
    for body in bodies.values():  # warm up: imports, caches, first spans
        body()
    sampled_seen.roots = on_seen.roots = 0
    best = {mode: float("inf") for mode in MODES}
    for _ in range(repeat):
        for mode in MODES:  # interleaved, so a noisy neighbour hits every mode alike
            start = time.perf_counter()
            bodies[mode]()
            best[mode] = min(best[mode], time.perf_counter() - start)
    per_step = items * stages
    results = {
        mode: {
            "seconds": best[mode],
            "us_per_item_per_stage": best[mode] / per_step * 1e6,
            "overhead_us_per_item_per_stage": (best[mode] - best["hand"]) / per_step * 1e6,
            "ratio_to_hand": best[mode] / best["hand"],
        }
        for mode in MODES
    }
    return {
        "items": items,
        "stages": stages,
        "run_items": run_items,
        "runs": runs,
        "repeat": repeat,
        "sampling": sampling,
        "sampled_share_traced": sampled_seen.roots / (runs * repeat),
        "results": results,
    }


def run(args: argparse.Namespace) -> int:
    """``flowkv bench runner``: print the table (or JSON); 0 on success."""
    try:
        report = measure(items=args.items, stages=args.stages, run_items=args.run_items,
                         sampling=args.sampling, repeat=args.repeat)
    except ValueError as exc:
        print(f"flowkv bench runner: {exc}")
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"runner overhead: {report['stages']} pass-through stages, {report['items']} items "
          f"in {report['runs']} runs of {report['run_items']}, best of {report['repeat']}")
    print(f"{'mode':<10}{'total s':>10}{'us/item/stage':>16}{'overhead us':>14}{'x hand':>9}")
    for mode, row in report["results"].items():
        print(f"{mode:<10}{row['seconds']:>10.4f}{row['us_per_item_per_stage']:>16.4f}"
              f"{row['overhead_us_per_item_per_stage']:>14.4f}{row['ratio_to_hand']:>9.2f}")
    print(f"sampled: {report['sampled_share_traced']:.0%} of runs traced (asked {report['sampling']:.0%})")
    return 0
