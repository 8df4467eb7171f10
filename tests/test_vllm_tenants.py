"""Tenants through a real `vllm serve`: vLLM's ``cache_salt`` and the ``flowkv.tag.tenant`` tag.

One server (pipeline ``local-cpu``, chunks of 256 tokens, a quota for tenant
``acme``) serves every test of this file. A document asked twice with one
``cache_salt`` is loaded from flowkv the second time, and ``/metrics`` counts
those chunks under that salt's ``tenant`` label; a tag in
``kv_transfer_params`` names the tenant over the salt, with its quota.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from vllm_helpers import random_tokens  # noqa: E402
from vllm_server import VllmServer, metric_value, start_server  # noqa: E402

pytestmark = pytest.mark.vllm

CHUNK = 256
DOC = 3 * CHUNK + 40  # 3 whole chunks and a tail
QUOTA = 256 << 20
# Until vLLM's logger process has recorded the interval that carried a request's numbers
# (a readiness wait, not a speed claim).
METRICS_WAIT_S = 120.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[VllmServer]:
    running = start_server(tmp_path_factory.mktemp("tenants-serve"),
                           kv_extra={"chunk_size": CHUNK, "tiers.memory.quotas": {"acme": "256MiB"}})
    yield running
    running.close()


def cached(reply: dict) -> int:
    return (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def metric_reaches(server: VllmServer, name: str, want: float, **labels: str) -> str:
    """/metrics once ``name`` with ``labels`` reads ``want`` (fails with the last value seen)."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        text = server.metrics()
        seen = metric_value(text, name, **labels)
        if seen == want:
            return text
        assert time.monotonic() < deadline, f"{name}{labels} is {seen}, not {want}"
        time.sleep(0.5)


def test_cache_salt_names_the_tenant_and_counts_its_hits(server):
    doc = random_tokens(41, DOC)
    first = server.complete(doc + random_tokens(42, 8), max_tokens=2, cache_salt="team-red")
    second = server.complete(doc + random_tokens(43, 8), max_tokens=2, cache_salt="team-red")
    assert (cached(first), cached(second)) == (0, 3 * CHUNK)
    text = metric_reaches(server, "vllm:flowkv_tenant_hits_total", 3, tier="memory", tenant="team-red")
    assert metric_value(text, "vllm:flowkv_tenant_entries", tier="memory", tenant="team-red") == 3
    assert metric_value(text, "vllm:flowkv_tenant_bytes", tier="memory", tenant="team-red") > 0
    # Another salt shares nothing (its key differs) and is its own tenant.
    other = server.complete(doc + random_tokens(42, 8), max_tokens=2, cache_salt="team-blue")
    assert cached(other) == 0
    text = metric_reaches(server, "vllm:flowkv_tenant_entries", 3, tier="memory", tenant="team-blue")
    assert metric_value(text, "vllm:flowkv_tenant_hits_total", tier="memory", tenant="team-blue") == 0


def test_the_tenant_tag_wins_over_the_cache_salt_and_has_its_quota(server):
    doc = random_tokens(51, DOC)
    tag = {"flowkv.tag.tenant": "acme"}
    first = server.complete(doc + random_tokens(52, 8), max_tokens=2, cache_salt="acme-salt", kv_transfer_params=tag)
    second = server.complete(doc + random_tokens(53, 8), max_tokens=2, cache_salt="acme-salt",
                             kv_transfer_params=tag)
    assert (cached(first), cached(second)) == (0, 3 * CHUNK)
    text = metric_reaches(server, "vllm:flowkv_tenant_hits_total", 3, tier="memory", tenant="acme")
    assert metric_value(text, "vllm:flowkv_tenant_quota_bytes", tier="memory", tenant="acme") == QUOTA
    assert metric_value(text, "vllm:flowkv_tenant_entries", tier="memory", tenant="acme") == 3
    assert metric_value(text, "vllm:flowkv_tenant_entries", tier="memory", tenant="acme-salt") == 0
