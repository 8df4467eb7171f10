"""A node server in the fleet: the chunks in its shared arena reported to the controller.

``flowkv server`` keeps its tier events in a ring and answers ``events
{since, wait_s}`` and ``snapshot`` on its Unix socket (see
:mod:`flowkv.tiers.node_protocol`). :class:`NodeFollower` connects to it as
any client does, registers the server with the controller as a holder of
kind ``server`` named by the server's name (``flowkv server --name``; by
default ``HOST:SOCKET``), follows the events into a :class:`Reporter`, and
turns a gap in the ring, a server that restarted or one that went away into a
resync from a snapshot (an unreachable server holds nothing). ``clear`` from
the controller removes the arena's chunks through the server. Run one next to
each node server::

    flowkv node-report --socket /run/flowkv/node.sock --controller http://10.0.0.5:9100

A vLLM instance whose pipeline has a ``server`` tier lists the server's name
in ``shared`` (:func:`shared_server_ids`), so lookups count the server's
chunks for every instance that reads through it.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

from flowkv.fleet.protocol import Command, CommandResult, Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session
from flowkv.keys import tags_digest
from flowkv.tenants import tier_reports

__all__ = ["NodeFollower", "default_server_name", "shared_server_ids"]

log = logging.getLogger("flowkv.fleet")

_BACKOFF_MAX_S = 5.0


def default_server_name(socket_path: str | os.PathLike[str]) -> str:
    """The name ``flowkv server`` takes without ``--name``."""
    return f"{socket.gethostname()}:{Path(socket_path)}"


def shared_server_ids(pipeline: Any, *, timeout_s: float = 1.0) -> list[str]:
    """The names of the node servers a pipeline's ``server`` tiers read through: each server is
    asked (``hello``); one that does not answer yet is named by the default name for its socket."""
    names = []
    for spec in pipeline.tiers.values():
        path = getattr(spec.config, "socket", None)
        if spec.kind != "server" or not path:
            continue
        names.append(_ask_name(path, timeout_s) or default_server_name(path))
    return names


def _ask_name(path: str, timeout_s: float) -> str | None:
    return _ask(path, timeout_s)[0]


def _ask(path: str, timeout_s: float) -> tuple[str | None, list[str]]:
    """The server's name and its lower tiers; (None, []) when it does not answer."""
    from flowkv.tiers.node_protocol import NodeConnection, NodeError, NodeUnavailable

    try:
        conn = NodeConnection.connect(path, timeout_s=timeout_s)
    except (NodeUnavailable, ValueError):
        return None, []
    try:
        name = str(conn.hello(f"flowkv-fleet:{os.getpid()}").get("name") or "") or None
        lower = (conn.call("stats").get("lower") or {}).get("tiers") or []
        return name, [str(tier) for tier in lower]
    except (NodeUnavailable, NodeError):
        return None, []
    finally:
        conn.close()


class NodeFollower:
    """Follows one node server's tier events into the controller; see the module's docstring."""

    def __init__(self, socket_path: str | os.PathLike[str], config: ReporterConfig, *, name: str | None = None,
                 timeout_s: float = 2.0, wait_s: float = 1.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.counters: collections.Counter[str] = collections.Counter()
        # events are followed on their own connection; stats and commands use another
        self._conn: Any = None
        self._side: Any = None
        self._side_lock = threading.Lock()
        self._server_id: str | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        asked, lower = _ask(self.socket_path, timeout_s)
        self.name = name or asked or default_server_name(self.socket_path)
        # The arena, then the server's lower tiers (when it answered at start).
        tiers = [TierInfo(name="memory", kind="memory")] + [TierInfo(name=tier, kind=tier) for tier in lower]
        registration = Registration(instance_id=self.name, kind="server", session=new_session(), model="*",
                                    pipeline="flowkv server", tiers=tiers, chunk_size=0, hash="")
        self.reporter = Reporter(config, registration, run_command=self._run_command, stats=self._stats)

    def start(self) -> NodeFollower:
        self.reporter.start()
        self._thread = threading.Thread(target=self._loop, name="flowkv-node-follower", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.wait_s + self.timeout_s + 1.0)
        for conn in (self._conn, self._side):
            if conn is not None:
                conn.close()
        self.reporter.close()

    # -- following the server's events -------------------------------------------------

    def _loop(self) -> None:
        from flowkv.tiers.node_protocol import NodeError, NodeUnavailable

        backoff = 0.25
        while not self._stop.is_set():
            try:
                if self._conn is None or self._conn.closed:
                    self._connect()
                reply = self._conn.call("events", since=self._seq, wait_s=self.wait_s, max=4096,
                                        timeout_s=self.wait_s + self.timeout_s)
                if reply.get("gap") or int(reply["seq"]) < self._seq:
                    self.counters["gaps"] += 1
                    self._resync()
                    continue
                for seq, kind, tier, key in reply["events"]:
                    self.reporter.offer(kind, tier, key)
                    self._seq = int(seq)
                self.counters["events"] += len(reply["events"])
                backoff = 0.25
            except (NodeUnavailable, NodeError, OSError, KeyError, ValueError) as exc:
                self.counters["node_errors"] += 1
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                if self._server_id is not None:
                    # The server is gone (or hung): what it held cannot be read through it.
                    log.warning("flowkv: node server %s: %s; reporting it empty until it answers",
                                self.socket_path, exc)
                    self._server_id = None
                    self.reporter.resync({})
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _connect(self) -> None:
        from flowkv.tiers.node_protocol import NodeConnection, read_operator_token

        conn = NodeConnection.connect(self.socket_path, timeout_s=self.timeout_s)
        try:
            hello = conn.hello(f"flowkv-fleet:{self.name}", operator_token=read_operator_token(self.socket_path))
        except Exception:
            conn.close()
            raise
        self._conn = conn
        if hello.get("server") != self._server_id:
            self.counters["connects"] += 1
            log.info("flowkv: following node server %s (%s) for the controller", self.name, hello.get("server"))
        self._server_id = hello.get("server")
        self._resync()

    def _resync(self) -> None:
        snapshot = self._conn.call("snapshot")
        self._seq = int(snapshot["seq"])
        self.reporter.resync({str(snapshot.get("tier") or "memory"): list(snapshot["keys"])})
        self.counters["snapshots"] += 1

    # -- on the reporter's thread ------------------------------------------------------------

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        from flowkv.tiers.node_protocol import NodeConnection, NodeUnavailable, read_operator_token

        with self._side_lock:
            if self._side is None or self._side.closed:
                self._side = NodeConnection.connect(self.socket_path, timeout_s=self.timeout_s)
                self._side.hello(f"flowkv-fleet:{self.name}:commands",
                                 operator_token=read_operator_token(self.socket_path))
            try:
                return self._side.call(op, **fields)
            except NodeUnavailable:
                self._side = None
                raise

    def _stats(self) -> dict[str, Any]:
        try:
            status = self._call("stats")
        except Exception:
            return {"counters": {"node_unreachable": 1}}
        memory = status.get("memory") or {}
        tiers = {"memory": {key: memory[key] for key in ("used_bytes", "capacity_bytes", "entries", "evictions")
                            if isinstance(memory.get(key), (int, float))}}
        for name, numbers in (status.get("tiers") or {}).items():
            if name != "memory" and isinstance(numbers, dict):
                tiers[name] = {key: numbers[key] for key in ("used_bytes", "capacity_bytes", "entries", "evictions")
                               if isinstance(numbers.get(key), (int, float))}
        counters = {key: value for key, value in (status.get("requests") or {}).items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool)}
        counters.update({f"clients_{key}": value for key, value in (status.get("clients") or {}).items()
                         if isinstance(value, (int, float))})
        tenants = tier_reports({**(status.get("tiers") or {}), "memory": memory})
        return {"counters": counters, "tiers": tiers, "tenants": tenants}

    def _run_command(self, command: Command) -> CommandResult:
        if command.op != "clear":
            return CommandResult(id=command.id, ok=False,
                                 detail=f"a node server takes clear only ({command.op} through its instances)")
        if command.tiers and "memory" not in command.tiers:
            return CommandResult(id=command.id, ok=True, detail="removed 0 chunks (the server's tier is memory)")
        digest = tags_digest(command.tags) if command.tags else None
        keys = [key for key in self._call("snapshot")["keys"]
                if digest is None or key.rsplit("/", 2)[-2] == digest]
        removed = sum(bool(r) for r in self._call("remove", keys=keys)["removed"]) if keys else 0
        return CommandResult(id=command.id, ok=True, detail=f"removed {removed} chunks from the node server")
