"""The ``flowkv`` command."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

import attrs


def main(argv: list[str] | None = None) -> int:
    from flowkv.logs import setup_logging

    setup_logging()
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(fleet_only=bool(words) and words[0] in FLEET_COMMANDS)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


# The fleet's servers need none of torch: for them only their own commands' parser is built (the others'
# arguments import modules that import torch), so a controller or router process starts in ~0.4 s, not ~1.9 s.
FLEET_COMMANDS = ("controller", "node-report", "route")


def build_parser(*, fleet_only: bool = False) -> argparse.ArgumentParser:
    """The ``flowkv`` command's parser; ``fleet_only``: with only the ``FLEET_COMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="flowkv",
        description="flowkv: a KV-cache layer for LLM inference (pipelines of traced stages).",
    )
    sub = parser.add_subparsers(metavar="COMMAND")
    if fleet_only:
        from flowkv.fleet import commands as fleet

        fleet.add_commands(sub)
        return parser

    pipeline = sub.add_parser("pipeline", help="validate, show and list pipeline files")
    psub = pipeline.add_subparsers(metavar="ACTION")
    validate = psub.add_parser("validate", help="check a pipeline file; print every error as FILE:LINE:COL")
    validate.add_argument("source", help="a built-in pipeline name or a path to a .toml file")
    validate.set_defaults(func=cmd_validate)
    show = psub.add_parser("show", help="the resolved stages and tiers with every effective setting")
    show.add_argument("source", help="a built-in pipeline name or a path to a .toml file")
    for action in (validate, show):
        action.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                            help="override a setting by dotted key, as the vLLM extra config does "
                                 "(VALUE is JSON, else a string), e.g. --set 'blend.separator=[271]'")
    show.add_argument("--json", action="store_true", help="print as JSON")
    show.set_defaults(func=cmd_show)
    listing = psub.add_parser("list", help="built-in pipelines, built-in and installed stages and tiers")
    listing.add_argument("--json", action="store_true", help="print as JSON")
    listing.set_defaults(func=cmd_list)
    pipeline.set_defaults(func=lambda args: (pipeline.print_help(), 2)[1])

    from flowkv.bench import BENCHMARKS

    bench = sub.add_parser("bench", help="benchmarks that print ratios against a same-run baseline")
    bsub = bench.add_subparsers(metavar="NAME")
    for name, (module, text) in BENCHMARKS.items():
        bparser = bsub.add_parser(name, help=text, description=text)
        bparser.set_defaults(func=_bench_runner(module), _bench_module=module)
        try:
            importlib.import_module(module).add_arguments(bparser)
        except ImportError:
            bparser.set_defaults(func=_unavailable(name, module))
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    from flowkv import demo as demo_module
    from flowkv import quality, tracetools
    from flowkv.fleet import commands as fleet

    from flowkv.server import cli as server_cli

    tracetools.add_commands(sub)
    quality.add_commands(sub)
    fleet.add_commands(sub)
    server_cli.add_commands(sub)
    demo = sub.add_parser("demo", help="the main job: vLLM with flowkv on a long-document QA workload")
    demo_module.add_arguments(demo)
    demo.set_defaults(func=demo_module.run)
    return parser


def _bench_runner(module: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).run(args)

    return run


def _unavailable(name: str, module: str):
    def run(args: argparse.Namespace) -> int:
        print(f"flowkv: '{name}' is not available: {module} could not be imported", file=sys.stderr)
        return 2

    return run


# -- pipeline ---------------------------------------------------------------


def _overrides(pairs: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"flowkv: --set wants KEY=VALUE, got {pair!r}")
        try:
            overrides[key] = json.loads(text)
        except ValueError:
            overrides[key] = text
    return overrides


def _load(source: str, overrides: list[str] | None = None):
    """(the pipeline, None) or (None, [every error as FILE:LINE:COL: message])."""
    from flowkv.pipeline import PipelineError, load_pipeline

    try:
        return load_pipeline(source, overrides=_overrides(overrides or [])), None
    except PipelineError as exc:
        return None, [str(d) for d in exc.diagnostics]
    except FileNotFoundError as exc:
        return None, [f"{source}: {exc}"]


def cmd_validate(args: argparse.Namespace) -> int:
    pipeline, errors = _load(args.source, args.overrides)
    if pipeline is None:
        print("\n".join(errors), file=sys.stderr)
        count = len(errors)
        print(f"{args.source}: {count} error{'s' if count > 1 else ''}", file=sys.stderr)
        return 1
    counts = ", ".join(f"{len(pipeline.stages(kind))} {kind}" for kind in _lists(pipeline))
    print(f"{pipeline.source}: ok ({counts} stages; tiers: {', '.join(pipeline.tiers) or 'none'})")
    return 0


def _lists(pipeline) -> tuple[str, ...]:
    """The stage lists a pipeline runs: a node server's one, or an engine's three."""
    return ("server",) if pipeline.server else ("store", "retrieve", "lookup")


def describe(pipeline) -> dict[str, Any]:
    """Every effective setting of a loaded pipeline, defaults included."""

    def plain(value: Any) -> Any:
        if attrs.has(type(value)):
            return {f.name: shown(f, getattr(value, f.name)) for f in attrs.fields(type(value))}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        return str(value)

    def shown(field: attrs.Attribute, value: Any) -> Any:
        # A field kept out of repr (a password) is kept out of here too; one with a repr function
        # (a URL that may hold a password) is shown through it.
        if field.repr is False:
            return None if value is None else "***"
        if callable(field.repr) and value is not None:
            return field.repr(value)
        return plain(value)

    def stages(specs) -> list[dict[str, Any]]:
        return [
            {"use": s.use, "stage": s.info.origin, "at": s.location.short, **plain(s.config)}
            for s in specs
        ]

    return {
        "source": pipeline.source,
        "extends": list(pipeline.extends),
        # Where each setting a file wrote came from: "pipeline.name" -> "FILE:LINE".
        "from": {path: where for path, where in pipeline.origins.items() if path.count(".") >= 1},
        "pipeline": plain(pipeline.section),
        "tiers": {
            name: {"kind": t.kind, "implementation": t.info.origin, "at": t.location.short, **plain(t.config)}
            for name, t in pipeline.tiers.items()
        },
        **{kind: stages(pipeline.stages(kind)) for kind in _lists(pipeline)},
        "layerwise": plain(pipeline.layerwise),
        "telemetry": plain(pipeline.telemetry),
        "vllm": plain(pipeline.vllm),
        "quality": plain(pipeline.quality),
        "controller": plain(pipeline.controller),
    }


def cmd_show(args: argparse.Namespace) -> int:
    pipeline, errors = _load(args.source, args.overrides)
    if pipeline is None:
        print("\n".join(errors), file=sys.stderr)
        return 1
    info = describe(pipeline)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"# {info['source']}" + (f" (extends {' <- '.join(info['extends'])})" if info["extends"] else ""))
    origins = info["from"] if info["extends"] else {}

    def setting(path: str, key: str, value: Any) -> str:
        where = origins.get(f"{path}.{key}")
        return f"  {key} = {value!r}" + (f"  # from {where}" if where else "")

    for section in ("pipeline", "layerwise", "telemetry", "vllm", "quality", "controller"):
        print(f"[{section}]")
        for key, value in info[section].items():
            print(setting(section, key, value))
    for name, table in info["tiers"].items():
        print(f"[tiers.{name}]")
        for key, value in table.items():
            print(setting(f"tiers.{name}", key, value))
    for kind in _lists(pipeline):
        chain = " -> ".join(s["use"] for s in info[kind]) or "(none)"
        print(f"{kind}: {chain}")
        for stage_info in info[kind]:
            settings = {k: v for k, v in stage_info.items() if k not in ("use", "stage", "at")}
            print(f"  {stage_info['use']:<12} {stage_info['at']}  {settings or ''}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from flowkv.pipeline import builtin_pipelines
    from flowkv.registry import RegistryError, available

    try:
        known = available()
    except RegistryError as exc:
        print(f"flowkv: {exc}", file=sys.stderr)
        return 1
    pipelines = {name: str(path) for name, path in sorted(builtin_pipelines().items())}
    if args.json:
        print(json.dumps({"pipelines": pipelines, **{k: dict(v) for k, v in known.items()}}, indent=2))
        return 0
    print("built-in pipelines:")
    for name, path in pipelines.items():
        print(f"  {name:<18} {path}")
    print("built-in stages:")
    for name, target in known["stages"]:
        print(f"  {name:<18} {target}")
    print("built-in tier kinds:")
    for name, target in known["tiers"]:
        print(f"  {name:<18} {target}")
    print("installed (entry point group 'flowkv.plugins'; 'flowkv.stages' is deprecated):")
    for name, target in known["installed"] or [("(none)", "")]:
        print(f"  {name:<18} {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
