"""Prometheus text of metric families, by ``prometheus_client`` (the node server's and the controller's ``/metrics``).

Each scrape builds its families from a status snapshot (nothing is kept
between scrapes), and ``prometheus_client`` writes them out: its escaping,
its ``_total`` names for counters, its number format.

>>> print(exposition([family("counter", "demo_requests_total", "Requests", [({"kind": "a"}, 2)])]), end="")
# HELP demo_requests_total Requests
# TYPE demo_requests_total counter
demo_requests_total{kind="a"} 2.0
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["exposition", "family", "is_number"]


def is_number(value: Any) -> bool:
    """Whether ``value`` is a metric value (an int or float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def family(kind: str, name: str, text: str, samples: Iterable[tuple[Mapping[str, str], Any]]) -> Metric:
    """A ``counter`` or ``gauge`` family ``name`` with one sample per ``(labels, value)``; labels in the
    order of the first sample's, values that are not numbers left out."""
    samples = [(labels, value) for labels, value in samples if is_number(value)]
    names = list(samples[0][0]) if samples else []
    metric = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=names)
    for labels, value in samples:
        metric.add_metric([str(labels[label]) for label in names], value)
    return metric


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = [f for f in families if f.samples]

    def collect(self) -> list[Metric]:
        return self._families


def exposition(families: Iterable[Metric]) -> str:
    """The Prometheus text exposition of ``families`` (those without a sample left out)."""
    return generate_latest(_Families(families)).decode()  # type: ignore[arg-type]
