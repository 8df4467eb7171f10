"""Tenants: who a cached chunk belongs to, what each may hold, and what each used.

A request's tenant is its ``flowkv.tag.tenant`` tag, else vLLM's
``cache_salt``, else ``default`` (:func:`tenant_of`). Keys carry only a
digest of the tags, so the tenant travels beside each entry as its own
field: through the storage manager, the memory tier, the node server's
protocol and index, and the disk tier's file names.

Quotas bound what one tenant may hold in one tier::

    [tiers.memory]
    kind = "memory"
    capacity = "16GiB"
    quotas = { default = "1GiB", acme = "8GiB" }   # default: every tenant not named
    tenant_labels = 16                               # tenants with their own metric label

A tenant at its quota evicts its own least recently used entries first; an
entry of a tenant within its quota is never evicted for another tenant's
sake while some tenant is over its quota; when the tier is full and every
tenant is within quota, plain LRU decides. Quotas may add up to more than
the capacity. Without ``quotas`` every tenant is unbounded (plain LRU).

:class:`TenantLedger` is the bookkeeping a tier keeps under its own lock:
bytes and entries held per tenant (exact, for the quotas) and hits,
misses and evictions; :meth:`TenantLedger.report` folds tenants beyond
``tenant_labels`` into ``default`` so a metric's label set stays bounded.

>>> tenant_of({"tenant": "acme", "cache_salt": "s1"}), tenant_of({"cache_salt": "s1"}), tenant_of({})
('acme', 's1', 'default')
>>> ledger = TenantLedger({"default": 100, "acme": 300})
>>> ledger.add("acme", 250); ledger.over_quota("acme", 60), ledger.over_quota("beta", 60)
(True, False)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["DEFAULT_TENANT", "TENANT_TAG", "TenantLedger", "TenantStats", "check_tenant_name", "sum_reports",
           "tenant_of", "tier_reports"]

#: The tenant of a request with neither a tenant tag nor a cache salt, and the quota of unnamed tenants.
DEFAULT_TENANT = "default"
#: The request tag naming the tenant (``"flowkv.tag.tenant"`` in vLLM's ``kv_transfer_params``).
TENANT_TAG = "tenant"
#: Tenants with their own metric label, unless a tier says otherwise.
DEFAULT_TENANT_LABELS = 16
# A tenant name in a pipeline file (a quota key): printable, short, no quoting needed in a label.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}")
# A tenant from a request (a cache salt may be anything): kept at most this long.
_MAX_TENANT_CHARS = 64


def tenant_of(tags: Mapping[str, str] | None) -> str:
    """The tenant of a request with ``tags``: its ``tenant`` tag, else ``cache_salt``, else ``default``."""
    if not tags:
        return DEFAULT_TENANT
    tenant = tags.get(TENANT_TAG) or tags.get("cache_salt") or DEFAULT_TENANT
    return clean_tenant(tenant)


def clean_tenant(value: Any) -> str:
    """A tenant as a tier keeps it: a non-empty str of printable characters, at most 64 of them.

    Anything else (from a wire, a file) is the default tenant: a bad name never fails a store.
    """
    if not isinstance(value, str) or not value or not value.isprintable():
        return DEFAULT_TENANT
    return value[:_MAX_TENANT_CHARS]


def check_tenant_name(name: Any) -> str | None:
    """Why ``name`` cannot be a quota's tenant name, or None when it can."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        return (f"tenant name {name!r} must be 1-64 characters of letters, digits and _ . : @ -, "
                "starting with a letter or digit")
    return None


@attrs.define
class TenantStats:
    """One tenant's numbers in one tier (a folded label sums its tenants)."""

    #: bytes its entries take (pages for the memory tier, file bytes for the disk tier)
    bytes: int = 0
    #: entries held
    entries: int = 0
    #: reads that found their chunk
    hits: int = 0
    #: reads that did not
    misses: int = 0
    #: its entries evicted (for room, or by its own quota)
    evictions: int = 0
    #: stores refused because nothing of its own could go to keep it within its quota
    quota_refusals: int = 0
    #: its quota in bytes; 0: none
    quota: int = 0


class TenantLedger:
    """Per-tenant bookkeeping of one tier; the tier serialises calls with its own lock.

    ``quotas`` maps tenant names to bytes (``default``: every tenant not
    named); empty means no quota at all. ``labels`` bounds how many tenants
    keep their own label in :meth:`report`: the tenants named in ``quotas``
    always do, others in the order they first came, the rest fold into
    ``default``.
    """

    def __init__(self, quotas: Mapping[str, int] | None = None, *, labels: int = DEFAULT_TENANT_LABELS) -> None:
        self.quotas: dict[str, int] = dict(quotas or {})
        self.labels = labels
        self._tenants: dict[str, TenantStats] = {}
        # Tenant -> label, fixed when first seen: a counter never moves between labels.
        self._label: dict[str, str] = {name: name for name in self.quotas}
        self._label.setdefault(DEFAULT_TENANT, DEFAULT_TENANT)

    def quota(self, tenant: str) -> int | None:
        """Bytes ``tenant`` may hold, or None (no quota)."""
        if not self.quotas:
            return None
        return self.quotas.get(tenant, self.quotas.get(DEFAULT_TENANT))

    def stats(self, tenant: str) -> TenantStats:
        stats = self._tenants.get(tenant)
        if stats is None:
            stats = self._tenants[tenant] = TenantStats()
            if tenant not in self._label:
                own = sum(1 for label in set(self._label.values()) if label != DEFAULT_TENANT)
                self._label[tenant] = tenant if own < self.labels else DEFAULT_TENANT
        return stats

    def held(self, tenant: str) -> int:
        stats = self._tenants.get(tenant)
        return stats.bytes if stats is not None else 0

    def over_quota(self, tenant: str, extra: int = 0) -> bool:
        """Whether ``tenant`` would hold more than its quota with ``extra`` bytes more."""
        quota = self.quota(tenant)
        return quota is not None and self.held(tenant) + extra > quota

    def add(self, tenant: str, nbytes: int, *, entries: int = 1) -> None:
        stats = self.stats(tenant)
        stats.bytes += nbytes
        stats.entries += entries

    def remove(self, tenant: str, nbytes: int, *, entries: int = 1, evicted: bool = False) -> None:
        stats = self.stats(tenant)
        stats.bytes -= nbytes
        stats.entries -= entries
        if evicted:
            stats.evictions += 1

    def hit(self, tenant: str, n: int = 1) -> None:
        self.stats(tenant).hits += n

    def miss(self, tenant: str, n: int = 1) -> None:
        self.stats(tenant).misses += n

    def refused(self, tenant: str) -> None:
        self.stats(tenant).quota_refusals += 1

    def clear_holdings(self) -> None:
        """Every entry gone (counters stay)."""
        for stats in self._tenants.values():
            stats.bytes = stats.entries = 0

    def report(self) -> dict[str, dict[str, int]]:
        """Label -> numbers (``TenantStats`` fields); tenants past ``labels`` summed into ``default``."""
        out: dict[str, TenantStats] = {}
        for name in self._label:
            if name in self.quotas or name == DEFAULT_TENANT:
                self.stats(name)  # named tenants show even before their first store
        for tenant, stats in self._tenants.items():
            label = self._label.get(tenant, DEFAULT_TENANT)
            into = out.setdefault(label, TenantStats())
            for field in ("bytes", "entries", "hits", "misses", "evictions", "quota_refusals"):
                setattr(into, field, getattr(into, field) + getattr(stats, field))
        for label, stats in out.items():
            stats.quota = self.quota(label) or 0
        return {label: attrs.asdict(stats) for label, stats in sorted(out.items())}


#: The most tenant labels a fleet-wide sum keeps (each holder bounds its own; their union is bounded here).
FLEET_TENANT_LABELS = 64
_SUMMED = ("bytes", "entries", "hits", "misses", "evictions", "quota_refusals")


def tier_reports(stats_by_tier: Mapping[str, Any]) -> dict[str, dict[str, dict[str, int]]]:
    """``{tier: report}`` of the tiers among ``stats_by_tier`` (a storage manager's ``stats()``) that keep tenants."""
    return {tier: dict(numbers["tenants"]) for tier, numbers in stats_by_tier.items()
            if isinstance(numbers, Mapping) and isinstance(numbers.get("tenants"), Mapping) and numbers["tenants"]}


def sum_reports(reports: list[Mapping[str, Any]], *, labels: int = FLEET_TENANT_LABELS) -> dict[str, dict[str, int]]:
    """Tenant label -> numbers summed over ``reports`` (each ``{tier: {label: numbers}}``, from untrusted
    holders: anything not a number is skipped); labels past ``labels`` (fewest bytes) fold into ``default``."""
    total: dict[str, dict[str, int]] = {}
    for report in reports:
        for tenants in (report.values() if isinstance(report, Mapping) else ()):
            for label, numbers in (tenants.items() if isinstance(tenants, Mapping) else ()):
                if not isinstance(label, str) or not isinstance(numbers, Mapping):
                    continue
                into = total.setdefault(clean_tenant(label), dict.fromkeys(_SUMMED, 0))
                for field in _SUMMED:
                    value = numbers.get(field)
                    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                        into[field] += value
    named = sorted((label for label in total if label != DEFAULT_TENANT), key=lambda label: -total[label]["bytes"])
    for label in named[labels:]:
        into = total.setdefault(DEFAULT_TENANT, dict.fromkeys(_SUMMED, 0))
        for field, value in total.pop(label).items():
            into[field] += value
    return dict(sorted(total.items()))
