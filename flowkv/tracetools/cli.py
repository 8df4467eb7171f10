"""``flowkv trace summarize|timeline``: the commands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import attrs

from flowkv.otlp_json import SpanRecord, TraceFileError, load_spans
from flowkv.tracetools.summarize import summarize, trace_copy_gbps
from flowkv.tracetools.text import format_summary
from flowkv.tracetools.timeline import timeline



def _load(path: str) -> list[SpanRecord]:
    spans = load_spans(path)
    if not spans:
        raise TraceFileError(f"{path}: the file holds no spans")
    return spans


def _run_summarize(args: argparse.Namespace) -> int:
    spans = _load(args.file)
    if args.copy_gbps is not None:
        summary = summarize(spans, copy_gbps=args.copy_gbps, copy_gbps_source="given")
    elif trace_copy_gbps(spans) is None and not args.no_measure:
        # The trace predates the resource attribute (or came from elsewhere): measure here.
        from flowkv.kernels import copy_gbps

        summary = summarize(spans, copy_gbps=round(copy_gbps(), 2), copy_gbps_source="measured by summarize")
    else:
        summary = summarize(spans)
    if args.json:
        print(json.dumps(attrs.asdict(summary), indent=2))
    else:
        print(format_summary(summary))
    return 0


def _run_timeline(args: argparse.Namespace) -> int:
    out = timeline(_load(args.file), args.output)
    print(f"wrote {out}")
    return 0


def _guarded(command):
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (TraceFileError, ValueError, OSError) as exc:
            print(f"flowkv trace: error: {exc}", file=sys.stderr)
            return 2

    return run


def add_commands(subparsers) -> None:
    """Register ``trace summarize`` and ``trace timeline`` on a CLI's subparsers.

    ``subparsers`` is what ``ArgumentParser.add_subparsers()`` returned;
    each leaf command sets ``func(args) -> int``.
    """
    trace = subparsers.add_parser(
        "trace",
        help="summarize flowkv traces or draw their timeline",
        description="Read flowkv's OTLP/JSON trace files (traces/*.json, or OTLP JSON exported from Jaeger).",
    )
    commands = trace.add_subparsers(dest="trace_command", metavar="{summarize,timeline}", required=True)

    summarize_parser = commands.add_parser(
        "summarize",
        help="per-stage own time, per-layer overlap, and what to tune",
        description=(
            "Print per-stage own time, counts, bytes and bytes per second (transfer stages next to the "
            "machine's copy bandwidth); per-layer transfer vs compute; the overlap ratio "
            "(share of layer transfer time not spent with the inference thread blocked in flowkv.wait); "
            "the slowest stages; and suggested pipeline settings to change, with the likely cause of a slow "
            "transfer (first-touch page faults, thread contention, layout)."
        ),
    )
    summarize_parser.add_argument("file", metavar="FILE", help="OTLP/JSON trace file")
    summarize_parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    summarize_parser.add_argument(
        "--copy-gbps", type=float, default=None, metavar="GBPS",
        help="the copy bandwidth to hold transfers against (default: the one the trace recorded; "
             "for a trace without one, measured now on this machine)")
    summarize_parser.add_argument("--no-measure", action="store_true",
                                  help="never measure the copy bandwidth here")
    summarize_parser.set_defaults(func=_guarded(_run_summarize))

    timeline_parser = commands.add_parser(
        "timeline",
        help="write a timeline (Perfetto JSON or HTML), one lane per stage and layer",
        description=(
            "Write a timeline of the trace: OUT ending in .json gives Chrome trace-event JSON for "
            "ui.perfetto.dev or chrome://tracing; .html a self-contained page."
        ),
    )
    timeline_parser.add_argument("file", metavar="FILE", help="OTLP/JSON trace file")
    timeline_parser.add_argument("-o", "--output", metavar="OUT", required=True, help="output path (.json or .html)")
    timeline_parser.set_defaults(func=_guarded(_run_timeline))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trace ...`` commands without the ``flowkv`` console script.

    ``main(["trace", "summarize", "run.json", "--json"])``.
    """
    parser = argparse.ArgumentParser(prog="flowkv")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
