"""Stages that move items without looking at them: for tests, benchmarks and prototypes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flowkv.registry import Role, stage


@stage("pass-through", kinds=("store", "retrieve", "lookup", "server"), role=Role.FLOW, accepts_hashes=True)
def pass_through(items: Iterator[Any]) -> Iterator[Any]:
    """Yield every item unchanged.

    TOML::

        [[store.stages]]
        use = "pass-through"
    """
    yield from items


@stage("take", kinds=("store", "retrieve", "lookup", "server"), role=Role.FLOW, accepts_hashes=True)
def take(items: Iterator[Any], *, limit: int) -> Iterator[Any]:
    """Yield the first ``limit`` items, then stop the run early.

    TOML::

        [[store.stages]]
        use = "take"
        limit = 8
    """
    if limit <= 0:
        return
    for count, item in enumerate(items, start=1):
        yield item
        if count >= limit:
            return
