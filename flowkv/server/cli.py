"""``flowkv server``: run a node server, or ask one for its status.

::

    flowkv server --memory 64GiB [--socket PATH] [--pipeline FILE] [--metrics-port 9464] [--group NAME]
    flowkv server status [--socket PATH] [--json]

Without ``--socket`` both use the private default (``node_protocol.default_socket_path``:
``$XDG_RUNTIME_DIR/flowkv/node.sock``, else ``/run/flowkv-UID/`` or ``~/.cache/flowkv/run/``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

__all__ = ["add_commands"]


def add_commands(sub: Any) -> None:
    """Add ``server`` to the ``flowkv`` command's subcommands."""
    parser = sub.add_parser(
        "server", help="run the node server (one cache per node, shared by every vLLM on it), or ask for its status",
        description="flowkv server --memory SIZE [--socket PATH] [--pipeline FILE] [--metrics-port N]\n"
                    "flowkv server status [--socket PATH] [--json]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", nargs="?", choices=("run", "status"), default="run",
                        help="run (default) or status")
    parser.add_argument("--socket", help="the Unix socket the server listens on (default: a private one, "
                        "$XDG_RUNTIME_DIR/flowkv/node.sock or /run/flowkv-UID/node.sock or "
                        "~/.cache/flowkv/run/node.sock; the server tier finds it the same way)")
    parser.add_argument("--group", help="a group whose members may use the server too (run; default: its own "
                        "user only)")
    parser.add_argument("--memory", help="size of the shared arena, e.g. 64GiB (run)")
    parser.add_argument("--pipeline", help="server pipeline file or built-in name: its lower tiers "
                        "(disk, Redis), its [server] stage list run on each committed chunk (e.g. compress, "
                        "put), [telemetry] (run)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free one)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics listen on (default loopback)")
    parser.add_argument("--lease-timeout", type=float, default=30.0,
                        help="seconds a gone client's rooms, reads and pins are kept before they are reclaimed")
    parser.add_argument("--quarantine-max",
                        help="a live client whose dropped connections hold this much of the arena (kept from "
                             "reuse until it exits) gets no new rooms, e.g. 4GiB (default: a quarter of --memory)")
    parser.add_argument("--max-pin", type=float, default=60.0, help="longest a lookup's pin may last, seconds")
    parser.add_argument("--slab", help="the largest chunk, e.g. 256MiB (default: the smaller of that and --memory)")
    parser.add_argument("--prefault", choices=("background", "now", "off"), default="background",
                        help="make the arena's pages resident before stores write them: background (default) keeps "
                             "256 MiB resident ahead of the highest page handed out, refilled when no client has "
                             "allocated for 50 ms; now: all of it before listening; off: first touch. Never below "
                             "the machine's free-memory reserve")
    parser.add_argument("--name", help="a stable name for this cache (a fleet controller's holder id); "
                        "default HOST:SOCKET")
    parser.add_argument("--json", action="store_true", help="status: print JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="status: seconds to wait for the server")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "status":
        return _status(args)
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from flowkv.sizes import parse_size

    from flowkv.logs import LEVEL_ENV, setup_logging

    setup_logging()  # flowkv's line format (the flowkv command has set it up already)
    if not os.environ.get(LEVEL_ENV, "").strip():
        logging.getLogger("flowkv").setLevel(logging.INFO)  # a daemon says when it starts, reclaims, stops
    if not args.memory:
        print("flowkv server: --memory SIZE is required (the shared arena, e.g. 16GiB)", file=sys.stderr)
        return 2
    try:
        memory = parse_size(args.memory)
        slab = parse_size(args.slab) if args.slab else None
        quarantine = parse_size(args.quarantine_max) if args.quarantine_max else None
    except ValueError as exc:
        print(f"flowkv server: {exc}", file=sys.stderr)
        return 2
    pipeline = None
    if args.pipeline:
        from flowkv.pipeline import PipelineError, load_pipeline

        try:
            pipeline = load_pipeline(args.pipeline)
        except PipelineError as exc:
            print("\n".join(str(d) for d in exc.diagnostics), file=sys.stderr)
            return 1
        except FileNotFoundError as exc:
            print(f"flowkv server: {exc}", file=sys.stderr)
            return 1
    from flowkv.server.daemon import NodeServer, ServerOptions

    group = None
    if args.group:
        import grp

        try:
            group = int(args.group) if args.group.isdigit() else grp.getgrnam(args.group).gr_gid
        except KeyError:
            print(f"flowkv server: no group {args.group!r}", file=sys.stderr)
            return 2

    options = ServerOptions(socket_path=args.socket, memory_bytes=memory, pipeline=pipeline,
                            lease_timeout_s=args.lease_timeout, max_pin_s=args.max_pin, slab_bytes=slab,
                            metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                            name=args.name, prefault=args.prefault, group=group, quarantine_bytes=quarantine)
    try:
        server = NodeServer(options)
    except (OSError, ValueError, MemoryError) as exc:  # PermissionError: a folder another user could write
        print(f"flowkv server: cannot start: {exc}", file=sys.stderr)
        return 1

    def ready(node: NodeServer) -> None:
        print(f"flowkv server: ready socket={options.socket_path} segment=memfd:{node.segment_name} "
              f"memory={options.memory_bytes} server={node.server_id} metrics={node.metrics_url or '-'}",
              flush=True)

    try:
        asyncio.run(server.serve(ready=ready))
    except RuntimeError as exc:  # a live server on the socket
        print(f"flowkv server: {exc}", file=sys.stderr)
        server.close()
        return 1
    return 0


def _status(args: argparse.Namespace) -> int:
    from flowkv.tiers.node_protocol import NodeConnection, NodeError, NodeUnavailable, default_socket_path
    from flowkv.tiers.node_protocol import read_operator_token

    path = args.socket or default_socket_path()
    try:
        conn = NodeConnection.connect(path, timeout_s=args.timeout)
        conn.hello("flowkv-server-status", operator_token=read_operator_token(path))
        status = conn.call("stats")
        conn.close()
    except (NodeUnavailable, NodeError, ValueError) as exc:
        print(f"flowkv server status: {exc}", file=sys.stderr)
        return 1
    status.pop("id", None)
    status.pop("ok", None)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    memory, clients, requests = status["memory"], status["clients"], status["requests"]
    gib = 2**30
    print(f"flowkv server {status['server']} (pid {status['pid']}), up {status['uptime_s']:.0f} s, "
          f"socket {status['socket']}")
    print(f"  memory   {memory['entries']} entries, {memory['used_bytes'] / gib:.2f} of "
          f"{memory['capacity_bytes'] / gib:.2f} GiB used ({memory['free_bytes'] / gib:.2f} free), "
          f"{memory['pinned_entries']} pinned, {memory['evictions']} evicted; "
          f"{memory['resident_bytes'] / gib:.2f} GiB resident (pre-fault {memory['prefault']})")
    print(f"  clients  {clients['connected']} connected, {clients['disconnected']} gone within the lease timeout; "
          f"held: {clients['allocations_held']} rooms, {clients['reads_held']} reads; reclaimed: "
          f"{clients['reclaimed_allocations']} rooms, {clients['reclaimed_reads']} reads, "
          f"{clients['reclaimed_pins']} pins; kept from live clients' dropped connections: "
          f"{clients.get('quarantined_bytes', 0) / gib:.2f} GiB in {clients.get('quarantined_sessions', 0)}")
    lookups = requests.get("lookup_keys", 0)
    print(f"  lookups  {requests.get('lookups', 0)}: {requests.get('lookup_hits', 0)} of {lookups} chunks hit; "
          f"reads {requests.get('get_hits', 0)} hits, {requests.get('get_misses', 0)} misses; "
          f"{requests.get('committed_chunks', 0)} chunks committed "
          f"({requests.get('duplicate_commits', 0)} already held)")
    _print_tenants(memory.get("tenants", {}))
    for name, numbers in status["tiers"].items():
        health = status["health"].get(name, "?")
        shown = ", ".join(f"{k} {v}" for k, v in numbers.items() if isinstance(v, (int, float)) and v)
        print(f"  tier {name} ({health}): {shown or 'nothing yet'}")
    if status.get("metrics"):
        print(f"  metrics  {status['metrics']}")
    return 0


def _print_tenants(tenants: dict[str, dict[str, int]]) -> None:
    """One line per tenant label of the arena: what it holds against its quota, and its reads."""
    mib = 2**20
    for label, numbers in tenants.items():
        quota = f" of {numbers['quota'] / mib:.1f} MiB quota" if numbers.get("quota") else ""
        print(f"  tenant {label}: {numbers['entries']} entries, {numbers['bytes'] / mib:.1f} MiB{quota}; "
              f"{numbers['hits']} hits, {numbers['misses']} misses, {numbers['evictions']} evicted, "
              f"{numbers['quota_refusals']} refused at quota")
