"""``flowkv bench mix``: memory-hit TTFT alone, and beside requests whose hits are on disk.

One ``vllm serve`` with flowkv ``cpu-disk`` per setting of ``async_loads``
(``auto``: disk hits load while the batch goes on; ``off``: each disk hit is
read in the step that needs it). Before measuring, ``--disk-docs`` documents
are stored and pushed out of memory (the disk holds them; their files are
dropped from the OS page cache), then ``--memory-docs`` documents are stored
and stay in memory. Then, with streaming requests (TTFT is the first token's
arrival):

- ``memory alone``: ``--memory-clients`` clients each ask memory documents,
  one request after another;
- ``with disk``: the same, while ``--disk-clients`` more clients each ask
  disk documents (each once, so each is a hit on disk).

The table gives the memory-hit requests' TTFT p50 and p99 in both phases,
their ratio, and the disk-hit requests' TTFT::

    flowkv bench mix
    flowkv bench mix --async-loads auto,off --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from flowkv.bench.serve import EAGER_HELP, SERVED_NAME, Server, transfer_config
from flowkv.integration.harness import (default_model_dir, kv_bytes_per_token, model_config, model_folder,
                                        setup_environment)

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench mix``."""
    parser.add_argument("--async-loads", default="auto,off", help="settings compared (default auto,off)")
    parser.add_argument("--memory-docs", type=int, default=4, help="documents kept in memory (default 4)")
    parser.add_argument("--disk-docs", type=int, default=24, help="documents only on disk (default 24)")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document (default 2048)")
    parser.add_argument("--memory-clients", type=int, default=2, help="clients asking memory documents (default 2)")
    parser.add_argument("--disk-clients", type=int, default=2, help="clients asking disk documents (default 2)")
    parser.add_argument("--requests", type=int, default=12,
                        help="requests per memory client and phase (default 12)")
    parser.add_argument("--output-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    parser.add_argument("--model-dir", default=str(default_model_dir()), help="the model folder (default: demo)")
    parser.add_argument("--eager", action="store_true", help=EAGER_HELP)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _ttft(url: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=600) as reply:
        for raw in reply:
            if first is None and raw.startswith(b"data: {"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("a streamed completion sent no token")
    return first


def _clients(url: str, work: list[list[list[int]]], max_tokens: int) -> list[list[float]]:
    """Each client (one list of prompts) sends its prompts one after another; TTFTs per client."""
    results: list[list[float]] = [[] for _ in work]
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            for prompt in work[index]:
                results[index].append(_ttft(url, prompt, max_tokens))
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _disk_written(server: Server, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        disk = server.flowkv_stats()["tiers"]["disk"]
        if disk["write_queue"] == 0 and disk["write_done"] + disk["write_dropped"] >= disk["write_queued"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"disk writes did not finish in {timeout_s:.0f} s: {disk}")
        time.sleep(0.05)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _one_setting(model: Path, folder: Path, setting: str, args: argparse.Namespace, token_bytes: int,
                 rng: random.Random) -> dict[str, Any]:
    from flowkv.bench.capacity import drop_page_cache

    vocab = model_config(model)["vocab_size"]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    disk_docs = [tokens(args.doc_tokens) for _ in range(args.disk_docs)]
    memory_docs = [tokens(args.doc_tokens) for _ in range(args.memory_docs)]
    doc_bytes = args.doc_tokens * token_bytes
    # Room for the memory documents and the disk hits promoted beside them (the least recently used go).
    memory_docs_held = args.memory_docs + 2 * args.disk_clients + 1
    memory_bytes = memory_docs_held * doc_bytes
    transfer = transfer_config("cpu-disk", folder, chunk_size=256, memory_bytes=memory_bytes)
    transfer["kv_connector_extra_config"]["async_loads"] = setting
    max_model_len = -(-(args.doc_tokens + 64 + args.output_tokens) // 128) * 128
    pool = (args.memory_clients + args.disk_clients + 1) * max_model_len * token_bytes
    with Server(model, folder, transfer=transfer, pool_bytes=pool, max_model_len=max_model_len,
                prefix_caching=False, eager=args.eager) as server:
        for doc in disk_docs + memory_docs:  # the memory documents last: the disk ones left memory
            _ttft(server.url, doc + tokens(8), 1)
            _disk_written(server)  # the write-behind queue is bounded: let it drain
        drop_page_cache(folder / "disk")
        # The newest disk documents still fit in memory beside the memory documents: ask the others.
        on_disk = disk_docs[:len(disk_docs) - (memory_docs_held - args.memory_docs)]

        def memory_work() -> list[list[list[int]]]:
            return [[rng.choice(memory_docs) + tokens(16) for _ in range(args.requests)]
                    for _ in range(args.memory_clients)]

        alone = _clients(server.url, memory_work(), args.output_tokens)
        per_disk_client = len(on_disk) // args.disk_clients
        disk_work = [[doc + tokens(16) for doc in on_disk[i * per_disk_client:(i + 1) * per_disk_client]]
                     for i in range(args.disk_clients)]
        mixed: list[list[float]] = []
        disk: list[list[float]] = []

        def run_disk() -> None:
            disk.extend(_clients(server.url, disk_work, args.output_tokens))

        disk_thread = threading.Thread(target=run_disk)
        disk_thread.start()
        mixed = _clients(server.url, memory_work(), args.output_tokens)
        disk_thread.join()
        served = server.metric("vllm:flowkv_retrieved_tokens")
    alone_all = [t for c in alone for t in c]
    mixed_all = [t for c in mixed for t in c]
    disk_all = [t for c in disk for t in c]
    return {
        "async_loads": setting,
        "memory_alone_p50_ms": statistics.median(alone_all) * 1e3,
        "memory_alone_p99_ms": _p(alone_all, 0.99) * 1e3,
        "memory_with_disk_p50_ms": statistics.median(mixed_all) * 1e3,
        "memory_with_disk_p99_ms": _p(mixed_all, 0.99) * 1e3,
        "memory_p99_ratio": _p(mixed_all, 0.99) / _p(alone_all, 0.99),
        "disk_p50_ms": statistics.median(disk_all) * 1e3 if disk_all else None,
        "disk_p99_ms": _p(disk_all, 0.99) * 1e3 if disk_all else None,
        "requests": {"memory_alone": len(alone_all), "memory_with_disk": len(mixed_all), "disk": len(disk_all)},
        "flowkv_tokens": served,
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    settings = [s.strip() for s in args.async_loads.split(",") if s.strip()]
    if not settings or any(s not in ("auto", "always", "off") for s in settings):
        print(f"flowkv bench mix: --async-loads takes auto, always, off; got {args.async_loads!r}", file=sys.stderr)
        return 2
    if min(args.memory_docs, args.disk_docs, args.memory_clients, args.disk_clients, args.requests) <= 0:
        print("flowkv bench mix: document, client and request counts must be positive", file=sys.stderr)
        return 2
    if args.disk_docs < 2 * (2 * args.disk_clients + 1):
        print("flowkv bench mix: --disk-docs must be at least 4 x --disk-clients + 2", file=sys.stderr)
        return 2
    setup_environment()
    model = model_folder(args.model_dir)
    token_bytes = kv_bytes_per_token(model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fkv-bench-mix-") as tmp:
        for setting in settings:
            print(f"bench mix: async_loads={setting}...", file=sys.stderr)
            folder = Path(tempfile.mkdtemp(prefix=f"{setting}-", dir=tmp))
            rows.append(_one_setting(model, folder, setting, args, token_bytes, random.Random(7)))
    result = {"model": str(model), "workload": {k: getattr(args, k) for k in (
        "memory_docs", "disk_docs", "doc_tokens", "memory_clients", "disk_clients", "requests", "output_tokens")},
        "settings": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    work = result["workload"]
    print(f"{work['memory_clients']} clients on {work['memory_docs']} memory documents, {work['disk_clients']} on "
          f"{work['disk_docs']} disk documents ({work['doc_tokens']} tokens each)")
    header = (f"{'async_loads':<12} {'memory p50':>11} {'memory p99':>11} {'+disk p50':>10} {'+disk p99':>10} "
              f"{'p99 ratio':>9} {'disk p50':>9} {'disk p99':>9}")
    print(header)
    print("-" * len(header))
    for row in result["settings"]:
        print(f"{row['async_loads']:<12} {row['memory_alone_p50_ms']:>9.0f}ms {row['memory_alone_p99_ms']:>9.0f}ms "
              f"{row['memory_with_disk_p50_ms']:>8.0f}ms {row['memory_with_disk_p99_ms']:>8.0f}ms "
              f"{row['memory_p99_ratio']:>8.2f}x {row['disk_p50_ms']:>7.0f}ms {row['disk_p99_ms']:>7.0f}ms")
    print("(memory: TTFT of memory-hit requests alone, then beside the disk-hit requests; disk: the disk hits')")
