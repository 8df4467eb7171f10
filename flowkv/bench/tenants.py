"""``flowkv bench tenants``: a two-tenant flood, with and without quotas, on the memory tier and a node server.

Tenant B stores a few documents and reads them back after tenant A has
stored many new documents into the same cache (a memory tier of
``--capacity`` in this process, then a ``flowkv server`` of the same size
this benchmark starts, its quotas in its own pipeline file). Without quotas
one LRU serves both, and A's flood evicts B; with quotas (each tenant half
the capacity) A evicts only its own entries. The table prints B's hit rate,
A's and B's evictions and the most A held, per cache and setting; the
"no quotas" row is the baseline of the same run.

    flowkv bench tenants --a-docs 40 --b-docs 4
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowkv import KVTransfer

__all__ = ["DOC_CHUNKS", "CHUNK_TOKENS", "flood", "flood_geometry", "run"]

#: tokens per chunk, and chunks per document, of the flood
CHUNK_TOKENS = 64
DOC_CHUNKS = 4
_BLOCKS = 64


def flood_geometry() -> Any:
    """2 layers x 2 KV heads x 64, bf16, blocks of 16: a chunk of 64 tokens is 64 KiB."""
    from flowkv.kernels import KVGeometry

    return KVGeometry("cpu", 2, 2, 64, 16, torch.bfloat16)


def flood(engine: Any, tenant_stats: Callable[[], dict[str, dict[str, int]]], *, a_docs: int, b_docs: int,
          tenant_key: str = "tenant") -> dict[str, Any]:
    """B stores ``b_docs`` documents, A ``a_docs`` new ones, then B reads each of its own once.

    ``tenant_stats`` answers the cache's per-tenant numbers (`TenantLedger.report`).
    Requests name their tenant by the tag ``tenant_key`` (``tenant``, or ``cache_salt``).
    Answers B's chunks and hit chunks (from the retrieve masks), the tier's
    per-tenant numbers after the flood, and the most bytes A held after any store.
    """
    from flowkv._testing.paged import make_paged_kv, random_slot_mapping

    geometry = flood_geometry()
    doc_tokens = CHUNK_TOKENS * DOC_CHUNKS
    kv_caches = make_paged_kv(geometry, _BLOCKS, seed=1)
    slots = random_slot_mapping(doc_tokens, geometry, _BLOCKS, seed=2)

    def document(tenant: str, index: int) -> torch.Tensor:
        seed = (1 if tenant == "B" else 2) * 100_003 + index
        return torch.randint(0, 32000, (doc_tokens,), generator=torch.Generator().manual_seed(seed))

    def tags(tenant: str) -> dict[str, str]:
        return {tenant_key: tenant}

    for index in range(b_docs):
        engine.store(KVTransfer(tokens=document("B", index), kv_caches=kv_caches, slot_mapping=slots,
                                tags=tags("B")))
    a_most = 0
    for index in range(a_docs):
        engine.store(KVTransfer(tokens=document("A", index), kv_caches=kv_caches, slot_mapping=slots,
                                tags=tags("A")))
        a_most = max(a_most, tenant_stats().get("A", {}).get("bytes", 0))
    before = tenant_stats()
    b_hit_tokens = 0
    scratch = make_paged_kv(geometry, _BLOCKS, seed=3)
    for index in range(b_docs):
        mask = engine.retrieve(KVTransfer(tokens=document("B", index), kv_caches=scratch, slot_mapping=slots,
                                          tags=tags("B"))).ret_mask
        b_hit_tokens += int(mask.sum())
    after = tenant_stats()
    return {
        "b_chunks": b_docs * DOC_CHUNKS,
        "b_hit_chunks": b_hit_tokens // CHUNK_TOKENS,
        "a_chunks": a_docs * DOC_CHUNKS,
        "a_most_bytes": a_most,
        "before_reads": before,
        "tenants": after,
    }


def memory_engine(capacity: str, quotas: dict[str, str] | None) -> Any:
    """An in-process ``local-cpu`` engine of ``capacity`` with ``quotas`` on its memory tier."""
    from flowkv import CacheEngine

    overrides: dict[str, Any] = {"chunk_size": CHUNK_TOKENS, "tiers.memory.capacity": capacity,
                                 "tiers.memory.prefault": "off"}
    if quotas:
        overrides["tiers.memory.quotas"] = quotas
    return CacheEngine.from_pipeline("local-cpu", geometry=flood_geometry(), model_name="flood", overrides=overrides)


def memory_tenants(engine: Any) -> Callable[[], dict[str, dict[str, int]]]:
    return lambda: engine.storage.stats()["memory"]["tenants"]


def server_pipeline(folder: Path, quotas: dict[str, str] | None) -> Path:
    """A node server's own pipeline file: ``quotas`` on its arena (``[tiers.memory]``)."""
    text = '[pipeline]\nname = "node-server-tenants"\n\n[tiers.memory]\nkind = "memory"\n'
    if quotas:
        text += "quotas = { " + ", ".join(f'{name} = "{size}"' for name, size in quotas.items()) + " }\n"
    path = folder / "server.toml"
    path.write_text(text, encoding="utf-8")
    return path


def node_engine(socket: Path) -> Any:
    """An engine on the built-in ``node`` pipeline, on ``socket``, with the flood's chunks."""
    from flowkv import CacheEngine

    return CacheEngine.from_pipeline("node", geometry=flood_geometry(), model_name="flood",
                                     overrides={"chunk_size": CHUNK_TOKENS, "tiers.node.socket": str(socket)})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity", default="4MiB", help="the cache's size (each tenant's quota is half)")
    parser.add_argument("--a-docs", type=int, default=40, help="documents tenant A floods the cache with")
    parser.add_argument("--b-docs", type=int, default=4, help="documents tenant B stores and reads back")
    parser.add_argument("--no-server", action="store_true", help="the memory tier only (no flowkv server)")


def run(args: argparse.Namespace) -> int:
    from flowkv.sizes import format_size, parse_size

    half = format_size(parse_size(args.capacity) // 2)
    settings = [("no quotas", None), (f"quotas A={half} B={half}", {"A": half, "B": half})]
    rows = []
    for label, quotas in settings:
        engine = memory_engine(args.capacity, quotas)
        try:
            rows.append(("memory tier", label, flood(engine, memory_tenants(engine), a_docs=args.a_docs,
                                                     b_docs=args.b_docs)))
        finally:
            engine.close()
    if not args.no_server:
        for label, quotas in settings:
            rows.append(("node server", label, _through_server(args, quotas)))
    print(f"two-tenant flood: B stores {args.b_docs} documents ({args.b_docs * DOC_CHUNKS} chunks), "
          f"A then {args.a_docs} new ones ({args.a_docs * DOC_CHUNKS} chunks); cache {args.capacity}")
    print(f"{'cache':<12} {'setting':<32} {'B hit rate':>10} {'B evicted':>9} {'A evicted':>9} {'A held most':>12}")
    for cache, label, result in rows:
        tenants = result["tenants"]
        a, b = tenants.get("A", {}), tenants.get("B", {})
        rate = result["b_hit_chunks"] / result["b_chunks"] if result["b_chunks"] else 0.0
        print(f"{cache:<12} {label:<32} {rate:>10.0%} {b.get('evictions', 0):>9} {a.get('evictions', 0):>9} "
              f"{format_size(result['a_most_bytes']):>12}")
    return 0


def _through_server(args: argparse.Namespace, quotas: dict[str, str] | None) -> dict[str, Any]:
    from flowkv.bench.node import node_server
    from flowkv.sizes import parse_size
    from flowkv.tiers.node_protocol import NodeConnection

    with tempfile.TemporaryDirectory(prefix="fkv-tn-") as tmp:
        with node_server(parse_size(args.capacity), pipeline=server_pipeline(Path(tmp), quotas)) as socket:
            engine = node_engine(socket)
            conn = NodeConnection.connect(socket, timeout_s=10.0)
            try:
                return flood(engine, lambda: conn.call("stats")["memory"]["tenants"], a_docs=args.a_docs,
                             b_docs=args.b_docs)
            finally:
                conn.close()
                engine.close()
