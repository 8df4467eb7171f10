"""Prometheus metrics of a node server (``--metrics-port``), in the text exposition format.

Served on loopback by default from a thread of its own at ``/metrics``;
every scrape reads the server's status (written out by ``prometheus_client``,
:mod:`flowkv.exposition`). Names: ``flowkv_server_*``.
"""

from __future__ import annotations

import http.server
import threading
from typing import Any

from flowkv.exposition import exposition, family

__all__ = ["render", "serve_metrics"]

# (metric, type, help, where in status())
_GAUGES = (
    ("memory_capacity_bytes", "gauge", "Bytes of the shared arena", ("memory", "capacity_bytes")),
    ("memory_used_bytes", "gauge", "Bytes of the arena in use (entries and rooms being filled)", ("memory", "used_bytes")),
    ("memory_entries", "gauge", "Chunks held in the arena", ("memory", "entries")),
    ("memory_pinned_entries", "gauge", "Chunks pinned by lookups", ("memory", "pinned_entries")),
    ("memory_evictions_total", "counter", "Chunks evicted to make room", ("memory", "evictions")),
    ("memory_allocation_failures_total", "counter", "Allocations that found no room", ("memory", "allocation_failures")),
    ("memory_resident_bytes", "gauge", "Bytes of the arena the pre-fault made resident (from its start)", ("memory", "resident_bytes")),
    ("clients_connected", "gauge", "Client connections open", ("clients", "connected")),
    ("clients_disconnected", "gauge", "Connections ended within the lease timeout", ("clients", "disconnected")),
    ("allocations_held", "gauge", "Rooms handed out and not committed yet", ("clients", "allocations_held")),
    ("reads_held", "gauge", "Read references clients hold", ("clients", "reads_held")),
    ("reclaimed_allocations_total", "counter", "Rooms of gone clients reclaimed", ("clients", "reclaimed_allocations")),
    ("reclaimed_reads_total", "counter", "Read references of gone clients reclaimed", ("clients", "reclaimed_reads")),
    ("reclaimed_pins_total", "counter", "Pins of gone clients reclaimed", ("clients", "reclaimed_pins")),
    ("quarantined_sessions", "gauge", "Dropped connections of live processes whose rooms and reads are kept from "
     "reuse", ("clients", "quarantined_sessions")),
    ("quarantined_bytes", "gauge", "Arena bytes those connections hold", ("clients", "quarantined_bytes")),
    ("uptime_seconds", "gauge", "Seconds since the server started", ("uptime_s",)),
)
# counters of status()["requests"]
_REQUESTS = (
    ("lookups", "Lookup requests"), ("lookup_keys", "Chunks asked for in lookups"),
    ("lookup_hits", "Chunks of the prefix hits lookups found"), ("allocs", "Allocation requests"),
    ("alloc_chunks", "Rooms allocated"), ("alloc_shortfalls", "Allocation requests that found no room for all"),
    ("commits", "Commit requests"), ("committed_chunks", "Chunks committed into the index"),
    ("duplicate_commits", "Commits of a chunk already held (another client stored it)"),
    ("gets", "Read requests"), ("get_hits", "Chunks read"), ("get_misses", "Chunks asked for and not held"),
    ("corrupt_payloads", "Lower-tier payloads that failed their checks (misses)"),
    ("promotions", "Lower-tier hits copied into the arena"), ("request_errors", "Requests refused"),
    ("alloc_refused_quarantined", "Allocation requests refused: the process's dropped connections hold too much"),
)


def _dig(status: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = status
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def render(status: dict[str, Any]) -> str:
    """The status as Prometheus text."""
    families = [family(kind, f"flowkv_server_{name}", text, [({}, _dig(status, path))])
                for name, kind, text, path in _GAUGES]
    requests = status.get("requests", {})
    families += [family("counter", f"flowkv_server_{name}_total", text, [({}, requests.get(name, 0))])
                 for name, text in _REQUESTS]
    tenants = (status.get("memory") or {}).get("tenants") or {}
    families += [family(kind, f"flowkv_server_{name}", text,
                        [({"tenant": label}, numbers.get(field, 0)) for label, numbers in tenants.items()])
                 for field, name, kind, text in _TENANT_METRICS]
    tiers = status.get("tiers", {})
    healthy = status.get("health", {})
    families.append(family("gauge", "flowkv_server_tier_healthy", "1 while a tier is called, 0 while it is skipped",
                           [({"tier": tier}, int(healthy.get(tier) == "healthy")) for tier in tiers]))
    families.append(family("gauge", "flowkv_server_tier_stat",
                           "Counters each tier reports (disk, Redis: guard, write-behind)",
                           [({"tier": tier, "stat": key}, value)
                            for tier, numbers in tiers.items() for key, value in sorted(numbers.items())]))
    return exposition(families)


# (status field, metric, type, help) of each tenant label of the arena (flowkv.tenants): one series per
# tenant label (a bounded set)
_TENANT_METRICS = (
    ("bytes", "tenant_bytes", "gauge", "Bytes of the arena each tenant holds (rooms being filled included)"),
    ("entries", "tenant_entries", "gauge", "Chunks each tenant holds in the arena"),
    ("quota", "tenant_quota_bytes", "gauge", "Each tenant's quota in the arena (0: none)"),
    ("hits", "tenant_hits_total", "counter", "Chunks each tenant read from the arena"),
    ("misses", "tenant_misses_total", "counter", "Chunks each tenant asked for and the arena did not hold"),
    ("evictions", "tenant_evictions_total", "counter", "Chunks of each tenant evicted (room, or its own quota)"),
    ("quota_refusals", "tenant_quota_refusals_total", "counter",
     "Allocations refused: the tenant was at its quota with nothing of its own to evict"),
)


def serve_metrics(server: Any, host: str, port: int) -> http.server.ThreadingHTTPServer:
    """Serve ``render(server.status())`` at ``http://host:port/metrics`` (``port`` 0: any free port)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = render(server.status()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence per-request logs
            pass

    httpd = http.server.ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="flowkv-node-metrics", daemon=True).start()
    return httpd
