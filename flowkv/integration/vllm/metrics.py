"""flowkv's numbers in vLLM's connector stats and Prometheus metrics.

The worker-side connector hands vLLM a ``FlowKVStats`` each interval
(``get_kv_connector_stats``): counter increases since the last interval,
latency observations, and gauges. vLLM ships it to its logger process, where
``FlowKVPromMetrics.observe`` records it as ``vllm:flowkv_*`` metrics:

| metric | kind | labels |
|---|---|---|
| ``vllm:flowkv_requests_total`` | counter | ``op`` (lookup, lookup_repeat, store, retrieve, async_load) |
| ``vllm:flowkv_requested_tokens_total`` | counter | |
| ``vllm:flowkv_hit_tokens_total`` | counter | |
| ``vllm:flowkv_stored_tokens_total`` | counter | |
| ``vllm:flowkv_retrieved_tokens_total`` | counter | |
| ``vllm:flowkv_short_loads_total`` | counter | loads that came back short (vLLM recomputed the rest) |
| ``vllm:flowkv_blend_reused_tokens_total`` | counter | tokens a blend loaded from segments (CacheBlend) |
| ``vllm:flowkv_blend_recomputed_tokens_total`` | counter | of those, tokens recomputed past the check layer |
| ``vllm:flowkv_hit_rate`` | gauge | hit tokens / requested tokens in the interval |
| ``vllm:flowkv_tier_read_bytes_total`` / ``..._written_bytes_total`` | counter | ``tier`` |
| ``vllm:flowkv_evictions_total`` | counter | ``tier`` |
| ``vllm:flowkv_{lookup,store,retrieve}_seconds`` | histogram | |
| ``vllm:flowkv_pinned_objects`` | gauge | |
| ``vllm:flowkv_tier_healthy`` | gauge | ``tier`` (1 healthy, 0 skipped) |
| ``vllm:flowkv_tenant_{hits,misses,evictions}_total`` | counter | ``tier``, ``tenant`` (chunks read, not found, evicted) |
| ``vllm:flowkv_tenant_{bytes,entries,quota_bytes}`` | gauge | ``tier``, ``tenant`` |

The ``tenant`` label is a request's tenant (``flowkv.tag.tenant``, else
``cache_salt``, else ``default``); a tier gives its own label to the
tenants its quotas name and to the first ``tenant_labels`` others (16),
and counts the rest under ``default``, so the label set stays bounded.

A request's lookup counts once: ``op="lookup"`` and its prompt tokens when
first asked; should the scheduler ask again (a preemption, a miss stored
meanwhile), the repeat counts as ``op="lookup_repeat"`` and adds only tokens
and hits no earlier answer counted. ``op="async_load"`` counts the retrieves
vLLM waited for between steps (they count as ``retrieve`` too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# Engine counters that become Prometheus counters, by stats key.
_COUNTERS = ("lookups", "lookup_repeats", "stores", "retrieves", "async_loads", "retrieve_short",
             "lookup_requested_tokens", "lookup_hit_tokens", "stored_tokens", "retrieved_tokens",
             "blend_reused_tokens", "blend_recomputed_tokens")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def snapshot(stats: dict[str, Any]) -> dict[str, Any]:
    """The cumulative numbers of ``CacheEngine.stats()`` that metrics track, flat."""
    flat: dict[str, float] = {name: float(stats.get(name, 0)) for name in _COUNTERS}
    gauges: dict[str, float] = {}
    for tier, numbers in stats.get("tiers", {}).items():
        flat[f"tier.{tier}.read_bytes"] = float(stats.get(f"tier.{tier}.read_bytes", 0))
        flat[f"tier.{tier}.written_bytes"] = float(stats.get(f"tier.{tier}.written_bytes", 0))
        flat[f"tier.{tier}.evictions"] = float(numbers.get("evictions", 0))
        gauges[f"tier.{tier}.healthy"] = float(numbers.get("healthy", 1))
        if "pinned_objects" in numbers:
            gauges["pinned_objects"] = float(numbers["pinned_objects"])
        for label, tenant in (numbers.get("tenants") or {}).items():
            for what in _TENANT_COUNTERS:
                flat[_tenant_key(tier, label, what)] = float(tenant.get(what, 0))
            for what in _TENANT_GAUGES:
                gauges[_tenant_key(tier, label, what)] = float(tenant.get(what, 0))
    return {"counters": flat, "gauges": gauges}


# Per-tenant numbers of a tier (flowkv.tenants.TenantLedger.report): counters and gauges.
_TENANT_COUNTERS = ("hits", "misses", "evictions")
_TENANT_GAUGES = ("bytes", "entries", "quota")
# Joins tier, tenant label and field in a stats key: no tier name or tenant (printable) holds it.
_SEP = "\x00"


def _tenant_key(tier: str, label: str, what: str) -> str:
    return _SEP.join(("tenant", tier, label, what))


def _tenant_parts(key: str) -> tuple[str, str, str] | None:
    parts = key.split(_SEP)
    return (parts[1], parts[2], parts[3]) if len(parts) == 4 and parts[0] == "tenant" else None


@dataclass
class FlowKVStats(KVConnectorStats):
    """One interval of flowkv numbers: counter increases, latencies (ms), latest gauges."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})
        self.data.setdefault("latency_ms", {})

    @classmethod
    def between(cls, before: dict[str, Any], after: dict[str, Any],
                latency_ms: dict[str, list[float]]) -> FlowKVStats:
        counters = {k: v - before["counters"].get(k, 0.0) for k, v in after["counters"].items()}
        return cls(data={"counters": {k: v for k, v in counters.items() if v},
                         "gauges": dict(after["gauges"]), "latency_ms": latency_ms})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}, "latency_ms": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        data = other.data
        for key, value in data.get("counters", {}).items():
            self.data["counters"][key] = self.data["counters"].get(key, 0.0) + value
        self.data["gauges"].update(data.get("gauges", {}))
        for kind, values in data.get("latency_ms", {}).items():
            self.data["latency_ms"].setdefault(kind, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        counters = self.data["counters"]
        out: dict[str, int | float] = {k: v for k, v in counters.items()
                                       if not k.startswith("tier.") and _tenant_parts(k) is None}
        requested = counters.get("lookup_requested_tokens", 0.0)
        if requested:
            out["hit_rate"] = round(counters.get("lookup_hit_tokens", 0.0) / requested, 4)
        for kind, values in self.data["latency_ms"].items():
            if values:
                out[f"{kind}_ms_avg"] = round(sum(values) / len(values), 3)
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not any(self.data["latency_ms"].values())


class FlowKVPromMetrics(KVConnectorPromMetrics):
    """Registers the ``vllm:flowkv_*`` metrics and records each interval's stats."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labels = self._labelnames

        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> Any:
            return self._counter_cls(name=f"vllm:flowkv_{name}", documentation=text,
                                     labelnames=labels + list(extra))

        def gauge(name: str, text: str, extra: tuple[str, ...] = ()) -> Any:
            return self._gauge_cls(name=f"vllm:flowkv_{name}", documentation=text,
                                   labelnames=labels + list(extra), multiprocess_mode="mostrecent")

        self.requests = counter("requests", "flowkv engine calls, by operation", ("op",))
        self.requested_tokens = counter("requested_tokens", "Prompt tokens flowkv was asked to look up")
        self.hit_tokens = counter("hit_tokens", "Prompt tokens flowkv could serve (contiguous from 0)")
        self.stored_tokens = counter("stored_tokens", "Tokens whose KV flowkv stored")
        self.retrieved_tokens = counter("retrieved_tokens", "Tokens whose KV flowkv loaded into vLLM")
        self.short_loads = counter("short_loads", "Loads that came back short: vLLM recomputed the rest")
        self.blend_reused = counter("blend_reused_tokens", "Tokens a blend loaded from stored segments")
        self.blend_recomputed = counter("blend_recomputed_tokens",
                                        "Tokens of blended segments recomputed past the check layer")
        self.read_bytes = counter("tier_read_bytes", "Bytes read from each tier", ("tier",))
        self.written_bytes = counter("tier_written_bytes", "Bytes written to each tier", ("tier",))
        self.evictions = counter("evictions", "Entries evicted from each tier", ("tier",))
        self.hit_rate = gauge("hit_rate", "Hit tokens / requested tokens in the last interval")
        self.pinned = gauge("pinned_objects", "Memory-tier entries pinned by lookups")
        self.healthy = gauge("tier_healthy", "1 when the tier is used, 0 while it is skipped after failures",
                             ("tier",))
        self.tenant_counters = {
            what: counter(f"tenant_{what}", f"Chunks of each tenant {text}, per tier", ("tier", "tenant"))
            for what, text in (("hits", "read from the tier"), ("misses", "asked for and not found"),
                               ("evictions", "evicted (for room, or by its own quota)"))
        }
        self.tenant_gauges = {
            what: gauge(name, text, ("tier", "tenant"))
            for what, name, text in (("bytes", "tenant_bytes", "Bytes each tenant holds in each tier"),
                                     ("entries", "tenant_entries", "Entries each tenant holds in each tier"),
                                     ("quota", "tenant_quota_bytes", "Each tenant's quota in each tier (0: none)"))
        }
        self.latency = {
            kind: self._histogram_cls(name=f"vllm:flowkv_{kind}_seconds",
                                      documentation=f"Time of one flowkv {kind}", labelnames=labels,
                                      buckets=_LATENCY_BUCKETS)
            for kind in ("lookup", "store", "retrieve")
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        counters = transfer_stats_data.get("counters", {})
        for op, key in (("lookup", "lookups"), ("lookup_repeat", "lookup_repeats"), ("store", "stores"),
                        ("retrieve", "retrieves"), ("async_load", "async_loads")):
            if counters.get(key):
                self.requests.labels(*base, op).inc(counters[key])
        for metric, key in ((self.requested_tokens, "lookup_requested_tokens"),
                            (self.hit_tokens, "lookup_hit_tokens"),
                            (self.stored_tokens, "stored_tokens"),
                            (self.retrieved_tokens, "retrieved_tokens"),
                            (self.short_loads, "retrieve_short"),
                            (self.blend_reused, "blend_reused_tokens"),
                            (self.blend_recomputed, "blend_recomputed_tokens")):
            if counters.get(key):
                metric.labels(*base).inc(counters[key])
        for key, value in counters.items():
            tenant = _tenant_parts(key)
            if tenant is not None and value > 0 and tenant[2] in self.tenant_counters:
                self.tenant_counters[tenant[2]].labels(*base, tenant[0], tenant[1]).inc(value)
            if not key.startswith("tier.") or value <= 0:
                continue
            _, tier, what = key.split(".", 2)
            metric = {"read_bytes": self.read_bytes, "written_bytes": self.written_bytes,
                      "evictions": self.evictions}.get(what)
            if metric is not None:
                metric.labels(*base, tier).inc(value)
        requested = counters.get("lookup_requested_tokens", 0.0)
        if requested:
            self.hit_rate.labels(*base).set(counters.get("lookup_hit_tokens", 0.0) / requested)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            if key == "pinned_objects":
                self.pinned.labels(*base).set(value)
            elif key.startswith("tier.") and key.endswith(".healthy"):
                self.healthy.labels(*base, key.split(".")[1]).set(value)
            elif (tenant := _tenant_parts(key)) is not None and tenant[2] in self.tenant_gauges:
                self.tenant_gauges[tenant[2]].labels(*base, tenant[0], tenant[1]).set(value)
        for kind, values in transfer_stats_data.get("latency_ms", {}).items():
            histogram = self.latency.get(kind)
            if histogram is not None:
                for ms in values:
                    histogram.labels(*base).observe(ms / 1e3)
