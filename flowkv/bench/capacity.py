"""``flowkv bench capacity``: documents a fixed disk holds, and the TTFT of reading them back, per codec.

For each codec (default: raw ``none``, the best lossless ``zstd-shuffle``
level 1 and the best lossy ``int8``, as ``flowkv bench codecs`` measured on
real KV), one vLLM (CPU) with flowkv runs a pipeline whose **only hit source
is a disk tier** of ``--disk-capacity`` bytes:

- the store list ends ``compress(codec) -> put(tiers = ["disk"])``: the memory
  tier only stages chunks while they are stored, and holds no hits;
- the retrieve list reads with ``lookup(prefetch = false)`` and
  ``get(promote = false)``, so nothing read from disk is kept in memory.

``--documents`` standard-library source documents are each asked a first
question (cold: vLLM computes the prefill, flowkv stores it on disk; the disk
evicts the least recently used documents when full), then each is asked a
second question without storing anything: a document counts as held when its
whole text comes back from disk. Before each of these warm requests the
disk tier's files are written back and dropped from the OS page cache
(``fsync`` + ``posix_fadvise`` DONTNEED; ``--page-cache keep`` leaves them),
so a hit reads the device. Each warm request runs ``--repeats`` times and
the fastest counts; a cold request's TTFT is its only run.
The table gives, per codec: payload bytes per document, documents held,
mean TTFT of the cold requests (the baseline, same run) and of the warm
requests served from disk, and their ratio.

    flowkv bench capacity
    flowkv bench capacity --codecs none,lz4-shuffle,int4 --disk-capacity 64MiB --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flowkv.integration.harness import (
    QUESTIONS,
    build_llm,
    default_model_dir,
    flowkv_config,
    kv_bytes_per_token,
    model_folder,
    setup_environment,
    shutdown,
)
from flowkv.sizes import parse_size
from flowkv.pipeline import dumps_pipeline

__all__ = ["add_arguments", "capacity_pipeline", "drop_page_cache", "run", "wait_written"]

DEFAULT_CODECS = "none,zstd-shuffle:level=1,int8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench capacity``."""
    parser.add_argument("--codecs", default=DEFAULT_CODECS,
                        help=f"comma-separated codecs, NAME or NAME:level=N (default {DEFAULT_CODECS})")
    parser.add_argument("--documents", type=int, default=8, help="documents stored, in order (default 8)")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document (default 2048)")
    parser.add_argument("--disk-capacity", default="32MiB",
                        help="the disk tier's capacity (default 32MiB: about 4 raw documents of the demo model)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    parser.add_argument("--page-cache", choices=("drop", "keep"), default="drop",
                        help="drop the disk tier's files from the OS page cache before each warm request (default)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="warm requests per document; the fastest counts (default 3)")
    parser.add_argument("--disk-path", help="folder for the disk tiers (default: a temporary folder)")
    parser.add_argument("--model-dir", default=str(default_model_dir()), help="the benchmark model folder")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def capacity_pipeline(folder: Path, *, codec: str, params: dict[str, Any], disk_path: Path,
                      disk_capacity: int, staging_bytes: int, chunk_size: int) -> Path:
    """Write the benchmark's pipeline file: disk as the only hit source, `codec` on disk."""
    path = folder / f"capacity-{codec}.toml"
    path.write_text(dumps_pipeline(
        pipeline={"name": f"capacity-{codec}", "chunk_size": chunk_size},
        tiers={
            "memory": {"kind": "memory", "capacity": staging_bytes},
            "disk": {"kind": "disk", "path": str(disk_path), "capacity": disk_capacity, "timeout_s": 10.0},
        },
        store=["tokenize", "chunk-hash", "allocate", "gather", ("compress", {"codec": codec, **params}),
               ("put", {"tiers": ["disk"]})],
        retrieve=["tokenize", "chunk-hash", ("lookup", {"prefetch": False}), ("get", {"promote": False}),
                  "decompress", "scatter"],
    ), encoding="utf-8")
    return path


def drop_page_cache(folder: Path) -> int:
    """Ask the OS to drop the cached pages of every file under `folder`; returns the files seen.

    Only clean pages go, and only these files' — nothing else on the machine
    is touched.
    """
    count = 0
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # evicted between the listing and the open
        try:
            # Pages not yet written back are dirty and would stay cached: write them first.
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


def wait_written(llm: Any, timeout_s: float = 120.0) -> dict[str, Any]:
    """Wait until the disk tier's write-behind queue is drained; returns the worker's stats."""
    from flowkv.integration.vllm import worker_stats

    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(llm.llm_engine.vllm_config)
        disk = stats["tiers"]["disk"]
        if disk["write_queue"] == 0 and disk["write_done"] + disk["write_dropped"] >= disk["write_queued"]:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"disk writes did not finish in {timeout_s:.0f} s: {disk}")
        time.sleep(0.05)


def _one_codec(model: Path, docs: list[list[int]], questions: list[list[int]], *, codec: str,
               params: dict[str, Any], folder: Path, args: argparse.Namespace, disk_capacity: int) -> dict[str, Any]:
    from flowkv.integration.harness import time_to_first_token

    per_token = kv_bytes_per_token(model)
    disk_path = folder / f"disk-{codec}"
    # The memory tier only stages one document's chunks while they are stored.
    staging = 2 * (args.doc_tokens + args.chunk_size) * per_token
    path = capacity_pipeline(folder, codec=codec, params=params, disk_path=disk_path, disk_capacity=disk_capacity,
                             staging_bytes=staging, chunk_size=args.chunk_size)
    longest = args.doc_tokens + max(len(q) for q in questions) + 8
    llm = build_llm(model, kv_transfer_config=flowkv_config(str(path)), max_model_len=128 * (longest // 128 + 1))
    try:
        cold = [time_to_first_token(llm, doc + questions[0]) for doc in docs]
        stats = wait_written(llm)
        warm = []
        for doc in docs:
            best, served = float("inf"), 0
            for _ in range(args.repeats):  # the best of a few: other load on the machine only adds time
                if args.page_cache == "drop":
                    drop_page_cache(disk_path)
                ttft, served = time_to_first_token(llm, doc + questions[1], skip_save=True)
                best = min(best, ttft)
            warm.append((best, served))
    finally:
        shutdown(llm)
    disk = stats["tiers"]["disk"]
    full = (args.doc_tokens // args.chunk_size) * args.chunk_size
    held = [i for i, (_, served) in enumerate(warm) if served >= full]
    return {
        "codec": codec + "".join(f" {k}={v}" for k, v in params.items()),
        "payload_bytes_per_document": disk["written_bytes"] / max(disk["writes"], 1) * (full // args.chunk_size),
        "raw_bytes_per_document": full * per_token,
        "disk_bytes_used": disk["bytes_used"],
        "disk_evictions": disk["evictions"],
        "documents_held": len(held),
        "held": held,
        "served_tokens": [served for _, served in warm],
        "cold_ttft_s": sum(t for t, _ in cold) / len(cold),
        "warm_ttft_s": sum(warm[i][0] for i in held) / len(held) if held else None,
        "cold_ttft_each_s": [t for t, _ in cold],
        "warm_ttft_each_s": [t for t, _ in warm],
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    from flowkv.bench.codecs import parse_codecs

    try:
        codecs = parse_codecs(args.codecs)
        disk_capacity = parse_size(args.disk_capacity)
        if args.documents <= 0 or args.repeats <= 0 or args.chunk_size <= 0 or args.doc_tokens < args.chunk_size:
            raise ValueError("--documents and --repeats must be positive and --doc-tokens at least --chunk-size")
    except ValueError as exc:
        print(f"flowkv bench capacity: {exc}", file=sys.stderr)
        return 2
    setup_environment()
    from transformers import AutoTokenizer

    from flowkv.integration.harness import documents
    model = model_folder(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    docs = documents(tokenizer, args.documents, args.doc_tokens)
    questions = [tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    rows = []
    with tempfile.TemporaryDirectory(prefix="flowkv-bench-capacity-", dir=args.disk_path) as tmp:
        for codec, params in codecs:
            print(f"bench capacity: {codec} {params or ''}...", file=sys.stderr)
            rows.append(_one_codec(model, docs, questions, codec=codec, params=params, folder=Path(tmp),
                                   args=args, disk_capacity=disk_capacity))
    base = rows[0]
    for row in rows:
        row["documents_vs_first"] = row["documents_held"] / base["documents_held"] if base["documents_held"] else None
        row["warm_speedup_vs_cold"] = row["cold_ttft_s"] / row["warm_ttft_s"] if row["warm_ttft_s"] else None
    result = {
        "model": str(model),
        "documents": args.documents,
        "doc_tokens": args.doc_tokens,
        "disk_capacity_bytes": disk_capacity,
        "page_cache": args.page_cache,
        "codecs": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.documents} documents of {args.doc_tokens} tokens; disk tier {disk_capacity / 2**20:.0f} MiB, "
          f"the only hit source; page cache: {args.page_cache}")
    header = (f"{'codec':<24} {'MiB/doc':>8} {'held':>5} {'x ' + rows[0]['codec'][:6]:>9} {'cold TTFT':>10} "
              f"{'warm TTFT':>10} {'cold/warm':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        warm = f"{row['warm_ttft_s'] * 1e3:8.0f}ms" if row["warm_ttft_s"] else "       -  "
        speed = f"{row['warm_speedup_vs_cold']:8.1f}x" if row["warm_speedup_vs_cold"] else "        -"
        ratio = f"{row['documents_vs_first']:8.2f}x" if row["documents_vs_first"] is not None else "        -"
        print(f"{row['codec']:<24} {row['payload_bytes_per_document'] / 2**20:>8.2f} "
              f"{row['documents_held']:>2}/{args.documents:<2} {ratio} {row['cold_ttft_s'] * 1e3:8.0f}ms {warm} {speed}")
    print("(held: documents whose whole text came back from disk; warm TTFT: mean over those; "
          "cold: the same run computing every token)")
    return 0
