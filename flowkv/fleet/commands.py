"""``flowkv controller``, ``flowkv node-report`` and ``flowkv route``: arguments here, servers imported only when run."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path

__all__ = ["add_commands", "read_token"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    controller = sub.add_parser("controller", help="the fleet's controller: who holds which prefix, commands, "
                                                   "metrics, dashboard")
    controller.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    controller.add_argument("--port", type=int, default=9100, help="port (0: a free one, printed at start)")
    controller.add_argument("--instance-token-file", type=Path, default=None,
                            help="tokens of instances (their reports), one a line; 'TOKEN ID...' fixes the ids "
                                 "a token may report for")
    controller.add_argument("--reader-token-file", type=Path, default=None,
                            help="tokens of readers (lookups, instances, metrics, the dashboard), one a line")
    controller.add_argument("--operator-token-file", type=Path, default=None,
                            help="tokens of operators (clear, pin, prefetch, and what a reader may), one a line")
    controller.add_argument("--token-file", type=Path, default=None,
                            help="one token for every role a role's own file does not set (one user's fleet)")
    controller.add_argument("--insecure", action="store_true",
                            help="no tokens at all: anyone who reaches the port may clear caches (loopback only)")
    controller.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                            help="a host name clients may use in Host/Origin besides the loopback names and "
                                 "--host (repeat for each)")
    controller.add_argument("--max-body-bytes", type=int, default=4 << 20,
                            help="larger lookups and commands are refused (413)")
    controller.add_argument("--max-report-bytes", type=int, default=256 << 20,
                            help="larger reports (an instance's snapshot lists all it holds) are refused (413)")
    controller.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate (PEM)")
    controller.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    controller.add_argument("--heartbeat-s", type=float, default=2.0, help="heartbeat interval asked of instances")
    controller.add_argument("--timeout-s", type=float, default=10.0,
                            help="an instance silent this long is marked down")
    controller.add_argument("--log-level", default="info")
    controller.set_defaults(func=run_controller)

    node = sub.add_parser("node-report", help="report a node server's chunks (flowkv server) to the controller")
    node.add_argument("--socket", required=True, help="the node server's Unix socket")
    node.add_argument("--controller", required=True, metavar="URL", help="the controller's URL")
    node.add_argument("--token-file", default=None, help="file holding the controller's bearer token")
    node.add_argument("--heartbeat-s", type=float, default=2.0)
    node.add_argument("--name", default=None,
                      help="the server's holder id (default: the name the server gives, else HOST:SOCKET)")
    node.add_argument("--log-level", default="info")
    node.set_defaults(func=run_node_report)

    route = sub.add_parser("route", help="an OpenAI-compatible proxy that sends each request to the vLLM "
                                         "instance holding its longest cached prefix")
    route.add_argument("--backend", action="append", default=None, metavar="URL",
                       help="a vLLM server's URL (repeat for each)")
    route.add_argument("--prefill", action="append", default=None, metavar="URL",
                       help="disaggregated prefill: a prefill instance (kv_role kv_producer) that computes each "
                            "prompt first (repeat for each; with --decode, instead of --backend)")
    route.add_argument("--decode", action="append", default=None, metavar="URL",
                       help="disaggregated prefill: a decode instance (kv_role kv_consumer) that loads the "
                            "prompt's KV from the shared tier and generates (repeat for each)")
    route.add_argument("--prefill-retry-s", type=float, default=5.0,
                       help="a prefill instance that cannot be reached is passed over this long")
    route.add_argument("--controller", default=None, metavar="URL",
                       help="the controller to ask (without it: round-robin)")
    route.add_argument("--policy", choices=("prefix", "round-robin"), default=None,
                       help="prefix (the default; needs --controller): longest cached prefix, ties and overload by "
                            "in-flight requests; round-robin (the default of --prefill/--decode without "
                            "--controller)")
    route.add_argument("--tokenizer", default=None, help="tokenizer name or path (default: the backends' model)")
    route.add_argument("--host", default="127.0.0.1")
    route.add_argument("--port", type=int, default=9200)
    route.add_argument("--lookup-timeout-s", type=float, default=2.0,
                       help="route by load when the controller has not answered by then")
    route.add_argument("--affinity-s", type=float, default=60.0,
                       help="send a prompt nobody holds yet where the same opening went this long ago")
    route.add_argument("--max-in-flight-gap", type=int, default=8,
                       help="skip a holder with this many more requests in flight than the least loaded backend")
    route.add_argument("--token-file", type=Path, default=None,
                       help="file holding a reader token of the controller (for its /lookup)")
    route.add_argument("--controller-ca-file", default=None,
                       help="the CA bundle an https:// controller's (and https backends') certificate is "
                            "checked against (default: the system's)")
    route.add_argument("--connect-timeout-s", type=float, default=10.0, help="bound on connecting to a backend")
    route.add_argument("--read-timeout-s", type=float, default=600.0,
                       help="a backend silent this long (before its first byte or between two) answers 504")
    route.add_argument("--max-body-bytes", type=int, default=16 << 20,
                       help="larger request bodies are refused (413) before a backend is asked")
    route.add_argument("--log-level", default="info")
    route.set_defaults(func=run_route)


def read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_controller(args: argparse.Namespace) -> int:
    from flowkv.fleet.access import ROLES, Access, allowed_hosts, read_tokens
    from flowkv.fleet.controller import create_app, serve
    from flowkv.fleet.directory import Directory

    try:
        tokens = {}
        for role in ROLES:
            path = getattr(args, f"{role}_token_file") or args.token_file
            if path is not None:
                tokens[role] = read_tokens(path)
    except (OSError, ValueError) as exc:
        print(f"flowkv controller: {exc}", file=sys.stderr)
        return 2
    if tokens and args.insecure:
        print("flowkv controller: --insecure and token files exclude each other", file=sys.stderr)
        return 2
    if not tokens and not args.insecure:
        print("flowkv controller: give token files (--instance-token-file, --reader-token-file, "
              "--operator-token-file, or --token-file for all three), or --insecure for a loopback-only "
              "controller anyone on this machine may use", file=sys.stderr)
        return 2
    if args.insecure and not _is_loopback(args.host):
        print(f"flowkv controller: --insecure binds loopback only, not {args.host}", file=sys.stderr)
        return 2
    missing = [role for role in ROLES if role not in tokens]
    if missing and not args.insecure:
        print(f"flowkv controller: warning: no token for the {', '.join(missing)} role: nobody can use it",
              file=sys.stderr)
    if bool(args.tls_key) and not args.tls_cert:
        print("flowkv controller: --tls-key needs --tls-cert", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    directory = Directory(heartbeat_s=args.heartbeat_s, timeout_s=args.timeout_s)
    access = Access(tokens=tokens, allowed_hosts=allowed_hosts(args.host, args.allow_host),
                    max_body_bytes=args.max_body_bytes, max_report_bytes=args.max_report_bytes)
    serve(create_app(directory, access=access), args.host, args.port, name="flowkv controller",
          log_level=args.log_level, tls_cert=args.tls_cert, tls_key=args.tls_key)
    return 0


def run_node_report(args: argparse.Namespace) -> int:
    import signal
    import threading

    from flowkv.fleet.node import NodeFollower
    from flowkv.fleet.reporter import ReporterConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ReporterConfig(url=args.controller, heartbeat_s=args.heartbeat_s, token_file=args.token_file)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    follower = NodeFollower(args.socket, config, name=args.name).start()
    print(f"flowkv node-report: following {args.socket} as {follower.name} for {args.controller}", flush=True)
    stop.wait()
    follower.close()
    return 0


def run_route(args: argparse.Namespace) -> int:
    from flowkv.fleet.controller import serve
    from flowkv.fleet.route import Router, create_app

    if bool(args.prefill) != bool(args.decode) or bool(args.backend) == bool(args.prefill):
        print("flowkv route: give --backend URL (each instance does it all), or --prefill URL and --decode URL "
              "(disaggregated prefill), not both", file=sys.stderr)
        return 2
    if args.policy is None:
        args.policy = "round-robin" if args.prefill and not args.controller else "prefix"
    if args.policy == "prefix" and not args.controller:
        print("flowkv route: --policy prefix needs --controller URL", file=sys.stderr)
        return 2
    try:
        token = read_token(args.token_file)
    except (OSError, ValueError) as exc:
        print(f"flowkv route: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(args.backend or args.decode, prefill=args.prefill, prefill_retry_s=args.prefill_retry_s,
                    controller=args.controller, policy=args.policy, tokenizer=args.tokenizer,
                    max_in_flight_gap=args.max_in_flight_gap, lookup_timeout_s=args.lookup_timeout_s,
                    affinity_s=args.affinity_s, controller_token=token, connect_timeout_s=args.connect_timeout_s,
                    read_timeout_s=args.read_timeout_s, max_body_bytes=args.max_body_bytes,
                    controller_ca_file=args.controller_ca_file)
    serve(create_app(router), args.host, args.port, name="flowkv route", log_level=args.log_level)
    return 0
