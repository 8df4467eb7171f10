"""``flowkv demo``: vLLM with flowkv on a long-document question-answering workload.

Several documents of a few thousand tokens are each asked two questions. The
first question of a document is a cold prefill; flowkv stores the document's
KV as vLLM computes it. The second question shares the document as its
prefix, and with vLLM's own prefix caching off every reused token comes from
flowkv. The table shows time to first token (TTFT) per request, the tokens
flowkv served, and flowkv's own store and retrieve time; the run's trace goes
to ``traces/``. Then a second vLLM, with no connector and its own prefix cache
on (a pool holding every document), takes the same requests: its second
question of a document is the floor — the fastest a cached prefix can be
served — so the table shows warm against the floor, not only against cold
(and cold against vLLM alone: what storing costs a cold request). The vLLM set-up it shares with ``flowkv quality`` and the
vLLM benchmarks is ``flowkv.integration.harness``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowkv.integration.harness import (
    QUESTIONS,
    build_llm,
    default_model_dir,
    documents,
    flowkv_config,
    model_folder,
    setup_environment,
    shutdown,
    time_to_first_token,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=4, help="documents in the workload (default 4)")
    parser.add_argument("--doc-tokens", type=int, default=3000, help="tokens per document (default 3000)")
    parser.add_argument("--pipeline", default="local-cpu", help="built-in pipeline name or TOML path")
    parser.add_argument("--model-dir", default=str(default_model_dir()),
                        help="where the demo model is built (once)")
    parser.add_argument("--traces", default="traces", help="folder for the run's OTLP-JSON trace")
    parser.add_argument("--layerwise", action="store_true", help="turn on layerwise transfers")


def progress(items: list[Any], desc: str) -> Iterator[Any]:
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, file=sys.stderr, leave=False)


def run(args: argparse.Namespace) -> int:
    setup_environment()
    from transformers import AutoTokenizer

    print(f"flowkv demo: model folder {args.model_dir} (the demo model is built there once if it holds none)...",
          file=sys.stderr)
    model = model_folder(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    docs = documents(tokenizer, args.documents, args.doc_tokens)
    questions = [tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    traces = Path(args.traces).resolve()
    traces.mkdir(parents=True, exist_ok=True)
    overrides: dict[str, Any] = {"telemetry.exporter": "file", "telemetry.folder": str(traces)}
    if args.layerwise:
        overrides["layerwise.enabled"] = True
    print(f"flowkv demo: starting vLLM (CPU) with flowkv on pipeline '{args.pipeline}'...", file=sys.stderr)
    llm = build_llm(model, kv_transfer_config=flowkv_config(args.pipeline, **overrides))
    try:
        rows = []
        requests = [(d, q) for d in range(len(docs)) for q in range(len(questions))]
        for doc, question in progress(requests, "requests"):
            prompt = docs[doc] + questions[question]
            ttft, served = time_to_first_token(llm, prompt)
            rows.append({"doc": doc, "question": question, "prompt_tokens": len(prompt),
                         "served": served, "ttft_s": ttft})
        from flowkv.integration.vllm import worker_stats

        stats = worker_stats(llm.llm_engine.vllm_config)
    finally:
        shutdown(llm)
    print("flowkv demo: the same requests through vLLM's own prefix cache (no connector)...", file=sys.stderr)
    llm = build_llm(model, enable_prefix_caching=True)
    try:
        for row in progress(rows, "floor"):
            prompt = docs[row["doc"]] + questions[row["question"]]
            row["floor_ttft_s"], row["floor_served"] = time_to_first_token(llm, prompt)
    finally:
        shutdown(llm)
    print_report(rows, stats, traces)
    return 0


def print_report(rows: list[dict[str, Any]], stats: dict[str, Any], traces: Path) -> None:
    print()
    floors = all("floor_ttft_s" in row for row in rows)
    print(f"{'doc':>3} {'question':>8} {'kind':>5} {'prompt':>7} {'from flowkv':>11} {'TTFT ms':>9}"
          + (f" {'vLLM alone ms':>13} {'its cache':>9}" if floors else ""))
    for row in rows:
        kind = "warm" if row["question"] else "cold"
        print(f"{row['doc']:>3} {row['question'] + 1:>8} {kind:>5} {row['prompt_tokens']:>7} "
              f"{row['served']:>11} {row['ttft_s'] * 1e3:>9.1f}"
              + (f" {row['floor_ttft_s'] * 1e3:>13.1f} {row['floor_served']:>9}" if floors else ""))
    cold = [r["ttft_s"] for r in rows if r["question"] == 0]
    warm = [r["ttft_s"] for r in rows if r["question"] > 0]
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    served = sum(r["served"] for r in rows)
    warm_prompt = sum(r["prompt_tokens"] for r in rows if r["question"] > 0)
    warm_served = sum(r["served"] for r in rows if r["question"] > 0)
    print()
    print(f"TTFT cold (mean):            {1e3 * sum(cold) / len(cold):9.1f} ms")
    if warm:
        print(f"TTFT warm (mean):            {1e3 * sum(warm) / len(warm):9.1f} ms"
              f"   ({sum(cold) / len(cold) / (sum(warm) / len(warm)):.1f}x faster)")
    if floors:
        # Means of the printed rows' figures, so every ratio follows from the table.
        alone = [r["floor_ttft_s"] for r in rows if r["question"] == 0]
        print(f"vLLM alone, cold (mean):     {1e3 * sum(alone) / len(alone):9.1f} ms"
              f"   (cold with flowkv storing: {sum(cold) / sum(alone):.2f}x)")
        floor = [r["floor_ttft_s"] for r in rows if r["question"] > 0]
        if floor and warm:
            print(f"TTFT floor (mean):           {1e3 * sum(floor) / len(floor):9.1f} ms"
                  f"   (vLLM's own prefix cache, same prompts; warm / floor {sum(warm) / sum(floor):.2f}x)")
    print(f"tokens served by flowkv:     {served:9d} of {prompt_tokens} prompt tokens "
          f"({100 * served / max(prompt_tokens, 1):.1f}%; warm requests {100 * warm_served / max(warm_prompt, 1):.1f}%)")
    lookups = stats.get("lookup_requested_tokens", 0)
    print(f"lookup hit rate (tokens):    {100 * stats.get('lookup_hit_tokens', 0) / max(lookups, 1):9.1f} %")
    print(f"flowkv store time (total):   {stats.get('store_ms', 0.0):9.1f} ms for "
          f"{stats.get('stored_tokens', 0)} tokens")
    print(f"flowkv retrieve time (total):{stats.get('retrieve_ms', 0.0):9.1f} ms for "
          f"{stats.get('retrieved_tokens', 0)} tokens")
    files = sorted(traces.glob("flowkv-*.json"), key=lambda p: p.stat().st_mtime)
    if files:
        print(f"trace: {files[-1]}  (flowkv trace summarize {files[-1]})")
