"""Tenants and cached-token counts through a real `vllm serve` and HTTP.

One server (pipeline ``cpu-disk``, chunks of 256 tokens, a memory tier of 8
chunks, a quota for tenant ``acme``) serves every test of this file.

Tenants: vLLM's ``cache_salt`` and the ``flowkv.tag.tenant`` tag. A document
asked twice with one ``cache_salt`` is loaded from flowkv the second time, and
``/metrics`` counts those chunks under that salt's ``tenant`` label; a tag in
``kv_transfer_params`` names the tenant over the salt, with its quota.

vLLM's cached-token count when a chunk on disk is corrupt: a user of the
OpenAI API reads ``usage.prompt_tokens_details.cached_tokens``; vLLM sets it
from the connector's answer to its lookup. A document stored by flowkv is
pushed out of memory by two others, and one of its chunk files on disk is then
corrupted. Asked again, flowkv answers the 7 chunks the disk index holds, as an
asynchronous load; reading them finds chunk 3 corrupt, so the load is reported
failed and vLLM looks the request up again: the count it reports is the 3
chunks that loaded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from node_servers import wait_for  # noqa: E402
from vllm_helpers import KV_BYTES_PER_TOKEN, random_tokens  # noqa: E402
from vllm_server import REFERENCE_ASK, VllmServer, metric_value, start_server  # noqa: E402

pytestmark = pytest.mark.vllm

CHUNK = 256
DOC = 3 * CHUNK + 40  # 3 whole chunks and a tail
QUOTA = 256 << 20
CORRUPT_DOC = 2000  # 7 whole chunks
# Until vLLM's logger process has recorded the interval that carried a request's numbers
# (a readiness wait, not a speed claim).
METRICS_WAIT_S = 120.0


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tenants-disk")


@pytest.fixture(scope="module")
def server(tmp_path_factory, disk) -> Iterator[VllmServer]:
    running = start_server(tmp_path_factory.mktemp("tenants-serve"), kv_extra={
        "pipeline": "cpu-disk", "chunk_size": CHUNK, "tiers.disk.path": str(disk),
        # 8 chunks of the tiny model: two more documents push a document of 7 out.
        "tiers.memory.capacity": 8 * CHUNK * KV_BYTES_PER_TOKEN,
        "tiers.memory.quotas": {"acme": "256MiB"},
    })
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


def disk_written(server) -> None:
    """Wait until the worker's disk tier wrote everything it was given."""
    def written() -> bool:
        disk = server.worker_stats()["tiers"]["disk"]
        return disk["write_queue"] == 0 and disk["write_done"] + disk["write_dropped"] >= disk["write_queued"]

    wait_for(written, "the disk tier's writes to finish", timeout_s=120)


def chunk_files(disk: Path) -> list[Path]:
    """The disk tier's files, oldest first (written behind in the order the chunks were stored)."""
    return sorted((p for p in disk.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)


def test_cached_tokens_count_what_loaded_when_a_chunk_on_disk_is_corrupt(server, disk):
    disk_written(server)
    before = set(chunk_files(disk))  # the other tests' documents
    doc = random_tokens(81, CORRUPT_DOC)
    server.complete(doc + [5, 6, 7], max_tokens=2)
    disk_written(server)
    files = [path for path in chunk_files(disk) if path not in before]
    assert len(files) == CORRUPT_DOC // CHUNK
    corrupt_before = server.worker_stats()["tiers"]["disk"]["corrupt"]
    for seed in (82, 83):
        server.complete(random_tokens(seed, CORRUPT_DOC), max_tokens=1)
    disk_written(server)
    # Chunk 3 of the document: its payload no longer matches its checksum.
    data = bytearray(files[3].read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    files[3].write_bytes(bytes(data))

    # The reference: the same prompt computed by the model alone (a tag of its own keys it apart, so
    # nothing is found; nothing is stored).
    alone = server.complete(doc + [8, 9], max_tokens=8, kv_transfer_params=REFERENCE_ASK)
    assert (alone["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0

    retrieved = server.metric("vllm:flowkv_retrieved_tokens_total")
    reply = server.complete(doc + [8, 9], max_tokens=8)
    # What vLLM reports as cached is what flowkv loaded, and flowkv counted it once.
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * CHUNK
    assert server.metric("vllm:flowkv_retrieved_tokens_total") - retrieved == 3 * CHUNK
    # The three good chunks loaded and the rest recomputed: the answer the model gives alone.
    assert reply["choices"][0]["text"] == alone["choices"][0]["text"]
    # The disk tier found chunk 3 corrupt once, and dropped it (the recomputed chunk may be written back).
    assert server.worker_stats()["tiers"]["disk"]["corrupt"] - corrupt_before == 1
    # (async_loads = "auto", the default, made that disk hit an asynchronous load: a synchronous
    # one that comes back short is recounted by the connector, the README's troubleshooting.)
