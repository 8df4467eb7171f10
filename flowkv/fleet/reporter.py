"""The holder's side of the controller protocol: registration, heartbeats, batched events, resyncs.

A ``Reporter`` runs in each process that holds chunks (a vLLM worker, a node
server). Tier events are offered to it from whichever thread made the change;
``offer`` only takes a lock, updates the reporter's mirror of what is held
and appends to a bounded queue, so reporting never blocks inference. A
thread of its own sends the queue in batches, numbered without gaps,
heartbeats, and runs the commands (clear, pin, prefetch) heartbeat replies
carry. When the queue is full an event is dropped and counted, and the next
message is a snapshot of the mirror, which puts the controller right again;
the same happens when the controller reports a gap, restarted, or declared
this holder down. A controller that cannot be reached costs a counter and a
retry with backoff, nothing else.

::

    reporter = Reporter(ReporterConfig(url="http://127.0.0.1:9100"), registration, run_command=...)
    reporter.start()
    reporter.offer("admit", "memory", key)     # from any thread, never blocks
    reporter.close()
"""

from __future__ import annotations

import collections
import http.client
import json
import logging
import os
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowkv.fleet.protocol import Command, CommandResult, Registration

__all__ = ["Reporter", "ReporterConfig", "new_session"]

log = logging.getLogger("flowkv.fleet")


def new_session() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class ReporterConfig:
    """Where and how a holder reports (the pipeline's ``[controller]`` table)."""

    url: str
    heartbeat_s: float = 2.0
    token_file: str | None = None
    # for an https:// controller: the CA bundle its certificate is checked against (default: the system's)
    ca_file: str | None = None
    # events waiting to be sent; past this they are dropped (and a snapshot follows)
    max_queue: int = 100_000
    # events per message
    batch: int = 2_000
    # how long an event may wait for others to share its message
    flush_s: float = 0.1
    # each HTTP call's bound
    timeout_s: float = 2.0

    def token(self) -> str | None:
        if not self.token_file:
            return None
        return Path(os.path.expanduser(self.token_file)).read_text(encoding="utf-8").strip() or None


class _Refused(Exception):
    """The controller refused a message (a bad token, a bad message): retrying the same will not help."""


class Reporter:
    """Reports one holder's chunks to the controller; see the module's docstring."""

    def __init__(
        self,
        config: ReporterConfig,
        registration: Registration,
        *,
        held: Mapping[str, Iterable[str]] | None = None,
        run_command: Callable[[Command], CommandResult] | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.registration = registration
        self._run_command = run_command
        self._stats = stats
        parsed = urllib.parse.urlsplit(config.url)
        if parsed.scheme not in ("http", "https", "") or not parsed.hostname:
            raise ValueError(f"controller url must be http(s)://HOST:PORT, got {config.url!r}")
        self._tls = parsed.scheme == "https"
        self._host, self._port = parsed.hostname, parsed.port or (443 if self._tls else 80)
        self._base = parsed.path.rstrip("/")
        self._token = config.token()
        self._lock = threading.Condition()
        # What this holder holds, as events said: snapshots are made from it.
        self._held: dict[str, set[str]] = {tier: set(keys) for tier, keys in (held or {}).items()}
        self._queue: collections.deque[tuple[int, str, str, str]] = collections.deque()
        self._next_seq = 0
        # the last sequence number the controller has (by an event or a snapshot)
        self._acked_seq = -1
        self._need_register = True
        self._need_snapshot = True
        self._done: list[CommandResult] = []
        self._latencies: dict[str, collections.deque[float]] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._heartbeat_s = config.heartbeat_s

    # -- from the data path -------------------------------------------------------

    def offer(self, op: str, tier: str, key: str = "") -> None:
        """Note that ``tier`` admitted (``admit``) or let go of (``evict``, ``remove``) ``key``,
        or dropped everything (``clear``). Never blocks on the network."""
        with self._lock:
            held = self._held.setdefault(tier, set())
            if op == "admit":
                held.add(key)
            elif op == "clear":
                held.clear()
            else:
                held.discard(key)
            if len(self._queue) >= self.config.max_queue:
                self.counters["events_dropped"] += 1
                self._need_snapshot = True
                return
            self._queue.append((self._next_seq, op, tier, key))
            self._next_seq += 1
            if len(self._queue) >= self.config.batch:
                self._lock.notify()

    def resync(self, held: Mapping[str, Iterable[str]]) -> None:
        """Replace what this holder holds (a source that lost its event stream, or restarted);
        the next message is a snapshot of it. Never blocks on the network."""
        with self._lock:
            self._held = {tier: set(keys) for tier, keys in held.items()}
            self._need_snapshot = True
            self._lock.notify()

    def observe_latencies(self, latencies: Mapping[str, Iterable[float]]) -> None:
        """Durations (ms) of lookups, stores and retrieves, for the percentiles heartbeats carry."""
        with self._lock:
            for kind, values in latencies.items():
                self._latencies.setdefault(kind, collections.deque(maxlen=2048)).extend(values)

    # -- life ---------------------------------------------------------------------

    def start(self) -> Reporter:
        self._thread = threading.Thread(target=self._loop, name="flowkv-reporter", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (briefly) and stop."""
        self._stop.set()
        with self._lock:
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._conn is not None:
            self._conn.close()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether everything offered so far reached the controller within ``timeout_s`` (tests, tools)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if (self._acked_seq == self._next_seq - 1 and not self._need_register
                        and not self._need_snapshot):
                    return True
                self._lock.notify()
            time.sleep(0.02)
        return False

    # -- the reporting thread --------------------------------------------------------

    def _loop(self) -> None:
        backoff = 0.0
        next_beat = 0.0
        while True:
            stopping = self._stop.is_set()
            try:
                if time.monotonic() >= next_beat or self._done:
                    self._heartbeat()
                    next_beat = time.monotonic() + self._heartbeat_s
                self._send_events()
                backoff = 0.0
            except (OSError, http.client.HTTPException, _Refused) as exc:
                self.counters["controller_errors"] += 1
                if self.counters["controller_errors"] in (1, 10) or self.counters["controller_errors"] % 100 == 0:
                    log.warning("flowkv: controller %s: %s (reporting goes on in the background)",
                                self.config.url, exc)
                self._drop_connection()
                backoff = min(max(0.2, backoff * 2), self._heartbeat_s)
                next_beat = time.monotonic() + backoff
            if stopping:
                return
            with self._lock:
                if not self._stop.is_set() and len(self._queue) < self.config.batch and not self._done:
                    wait = backoff if backoff else min(self.config.flush_s, max(0.0, next_beat - time.monotonic()))
                    self._lock.wait(wait)

    def _ensure_synced(self) -> None:
        if self._need_register:
            self._post("/v1/register", self.registration.model_dump(mode="json"))
            with self._lock:
                self._need_register = False
                self._need_snapshot = True
            self.counters["registrations"] += 1
        if self._need_snapshot:
            with self._lock:
                # The mirror and the sequence number together, under the lock that
                # offer() takes: events after this one continue from seq + 1.
                seq = self._next_seq - 1
                self._queue.clear()
                tiers = {tier: sorted(keys) for tier, keys in self._held.items()}
                self._need_snapshot = False
            ack = self._post("/v1/snapshot", {"instance_id": self.registration.instance_id,
                                              "rank": self.registration.rank,
                                              "session": self.registration.session, "seq": seq, "tiers": tiers})
            self.counters["snapshots"] += 1
            if self._handle(ack):
                with self._lock:
                    self._acked_seq = max(self._acked_seq, seq)

    def _send_events(self) -> None:
        self._ensure_synced()
        while True:
            with self._lock:
                if self._need_register or self._need_snapshot:
                    return
                batch = [self._queue[i] for i in range(min(len(self._queue), self.config.batch))]
            if not batch:
                return
            ack = self._post("/v1/events", {
                "instance_id": self.registration.instance_id, "rank": self.registration.rank,
                "session": self.registration.session, "seq_from": batch[0][0],
                "events": [{"op": op, "tier": tier, "key": key} for _, op, tier, key in batch]})
            with self._lock:
                # Drop what was sent (a snapshot in between may have cleared the queue already).
                while self._queue and self._queue[0][0] <= batch[-1][0]:
                    self._queue.popleft()
            self.counters["events_sent"] += len(batch)
            if self._handle(ack):
                with self._lock:
                    self._acked_seq = max(self._acked_seq, batch[-1][0])
            else:
                self._ensure_synced()

    def _heartbeat(self) -> None:
        self._ensure_synced()
        with self._lock:
            done, self._done = self._done, []
            seq = self._queue[0][0] - 1 if self._queue else self._next_seq - 1
        beat = {"instance_id": self.registration.instance_id, "rank": self.registration.rank,
                "session": self.registration.session, "seq": seq, "stats": self._collect_stats(),
                "done": [result.model_dump() for result in done]}
        try:
            ack = self._post("/v1/heartbeat", beat)
        except Exception:
            with self._lock:
                self._done = done + self._done
            raise
        self.counters["heartbeats"] += 1
        if ack.get("heartbeat_s"):
            self._heartbeat_s = float(ack["heartbeat_s"])
        self._handle(ack)
        for command in ack.get("commands") or []:
            self._run(Command.model_validate(command))

    def _run(self, command: Command) -> None:
        if self._run_command is None:
            result = CommandResult(id=command.id, ok=False, detail="this holder takes no commands")
        else:
            try:
                result = self._run_command(command)
            except Exception as exc:  # a failed command is an answer, not a dead reporter
                log.warning("flowkv: controller command %s failed", command.op, exc_info=True)
                result = CommandResult(id=command.id, ok=False, detail=f"{type(exc).__name__}: {exc}")
        self.counters[f"commands_{command.op}"] += 1
        with self._lock:
            self._done.append(result)
            if command.op == "clear":
                # What the clear removed went out as events; a snapshot settles any race with them.
                self._need_snapshot = True

    def _handle(self, ack: dict[str, Any]) -> bool:
        """Act on an acknowledgement; False when the holder must register or resync first."""
        status = ack.get("status")
        if status == "ok":
            return True
        with self._lock:
            if status == "register":
                self._need_register = True
            self._need_snapshot = True
        self.counters["resyncs"] += 1
        return False

    def _collect_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        if self._stats is not None:
            try:
                stats = dict(self._stats())
            except Exception:
                log.debug("flowkv: collecting stats for the controller failed", exc_info=True)
        with self._lock:
            latencies = {kind: sorted(values) for kind, values in self._latencies.items() if values}
            stats["reporter"] = dict(self.counters) | {"queued": len(self._queue)}
        stats["latency_ms"] = {kind: _percentiles(values) for kind, values in latencies.items()}
        return stats

    # -- HTTP -----------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._conn is None and self._tls:
            # Certificate and host name checked, as ssl's defaults do.
            context = ssl.create_default_context(cafile=os.path.expanduser(self.config.ca_file)
                                                 if self.config.ca_file else None)
            self._conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.config.timeout_s,
                                                     context=context)
        elif self._conn is None:
            self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self.config.timeout_s)
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        self._conn.request("POST", self._base + path, body=json.dumps(body).encode(), headers=headers)
        response = self._conn.getresponse()
        payload = response.read()
        if response.status != 200:
            self._drop_connection()
            raise _Refused(f"POST {path} answered {response.status}: {payload[:200]!r}")
        return json.loads(payload)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _percentiles(values: list[float]) -> dict[str, float]:
    def at(q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))], 3)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "n": len(values)}
