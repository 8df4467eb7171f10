"""``flowkv demo``: vLLM with flowkv on a long-document question-answering workload.

Several documents of a few thousand tokens are each asked two questions. The
first question of a document is a cold prefill; flowkv stores the document's
KV as vLLM computes it. The second question shares the document as its
prefix, and with vLLM's own prefix caching off every reused token comes from
flowkv. The table shows time to first token (TTFT) per request, the tokens
flowkv served, and flowkv's own store and retrieve time; the run's trace goes
to ``traces/``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEMO_MODEL = dict(num_layers=4, hidden_size=1024, num_heads=16, num_kv_heads=4, intermediate_size=2816,
                  vocab_size=2048, max_position_embeddings=32768)
QUESTIONS = (
    "\n\nQuestion: Which functions does this module define, and what do they return?\nAnswer:",
    "\n\nQuestion: Summarize in one sentence what this code is for.\nAnswer:",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=4, help="documents in the workload (default 4)")
    parser.add_argument("--doc-tokens", type=int, default=3000, help="tokens per document (default 3000)")
    parser.add_argument("--pipeline", default="local-cpu", help="built-in pipeline name or TOML path")
    parser.add_argument("--model-dir", default=str(default_model_dir()),
                        help="where the demo model is built (once)")
    parser.add_argument("--traces", default="traces", help="folder for the run's OTLP-JSON trace")
    parser.add_argument("--layerwise", action="store_true", help="turn on layerwise transfers")


def default_model_dir() -> Path:
    return Path(os.environ.get("FLOWKV_CACHE", Path.home() / ".cache" / "flowkv")) / "models" / "demo-llama"


def setup_environment() -> None:
    """vLLM on this CPU: no hub, both cores, a small KV pool."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cores = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}" if cores > 1 else "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # vLLM's processes warn about torch deprecations


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of bf16 keys and values one token takes over all layers of the model in folder ``model``."""
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * heads * head_dim * 2


def documents(tokenizer: Any, count: int, doc_tokens: int) -> list[list[int]]:
    """``count`` documents of exactly ``doc_tokens`` tokens: standard-library sources, read locally."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)
    docs: list[list[int]] = []
    for path in sources:
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer.encode(f"Document: {path.name}\n\n{text}", add_special_tokens=False)
        if len(ids) >= doc_tokens:
            docs.append(ids[:doc_tokens])
        if len(docs) == count:
            return docs
    raise RuntimeError(f"found only {len(docs)} standard-library files of {doc_tokens} tokens")


def build_llm(model: Path, *, kv_transfer_config: Any = None, max_model_len: int = 16384,
              kv_cache_memory_bytes: int | None = None) -> Any:
    """A vLLM engine for the demo model; prefix caching off so every reuse comes from the connector."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    return LLM(
        model=str(model),
        dtype="bfloat16",
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        kv_transfer_config=kv_transfer_config,
        disable_log_stats=True,
        seed=0,
        **kwargs,
    )


def flowkv_config(pipeline: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="FlowKVConnector",
        kv_connector_module_path="flowkv.integration.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"pipeline": pipeline, **extra},
    )


def time_to_first_token(llm: Any, prompt_ids: list[int], *, skip_save: bool = False) -> tuple[float, int]:
    """Seconds to the first generated token of one prompt, and the tokens the connector served.

    ``skip_save`` asks flowkv not to store the prompt (a read-only request).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"flowkv.skip_save": True}} if skip_save else None
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
    started = time.perf_counter()
    [output] = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)
    return time.perf_counter() - started, int(output.num_cached_tokens or 0)


def shutdown(llm: Any) -> None:
    """Stop a vLLM engine and its processes before another starts."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def progress(items: list[Any], desc: str) -> Iterator[Any]:
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, file=sys.stderr, leave=False)


def run(args: argparse.Namespace) -> int:
    setup_environment()
    from transformers import AutoTokenizer

    from flowkv.testing import tiny_model

    print(f"flowkv demo: building the demo model in {args.model_dir} (once)...", file=sys.stderr)
    model = tiny_model(args.model_dir, **DEMO_MODEL)
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
    print_report(rows, stats, traces)
    return 0


def print_report(rows: list[dict[str, Any]], stats: dict[str, Any], traces: Path) -> None:
    print()
    print(f"{'doc':>3} {'question':>8} {'kind':>5} {'prompt':>7} {'from flowkv':>11} {'TTFT ms':>9}")
    for row in rows:
        kind = "warm" if row["question"] else "cold"
        print(f"{row['doc']:>3} {row['question'] + 1:>8} {kind:>5} {row['prompt_tokens']:>7} "
              f"{row['served']:>11} {row['ttft_s'] * 1e3:>9.1f}")
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
