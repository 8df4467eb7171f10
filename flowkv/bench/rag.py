"""``flowkv bench rag``: RAG prompts whose documents come in any order: no cache, prefix keys, CacheBlend.

The workload (the shape of LMCache's ``benchmarks/rag``): a pool of
``--pool`` documents of ``--doc-tokens`` tokens (random token ids; each ends
with the separator), a system prompt, and prompts of the system prompt, then
``--k`` documents drawn from the pool in random order, then a question of
``--question-tokens``. Before the timed prompts every document is seen once,
as ``[system][document][question]`` (what earlier requests of a RAG service
leave in the cache); the timed prompts themselves store nothing
(``flowkv.skip_save``), so every prompt meets the same cache.

Configurations, one vLLM each (prefix caching off in all):

- ``no cache``: no connector; every prompt a full prefill. Its generations
  are the reference the others' quality is measured against;
- ``flowkv prefix``: pipeline ``local-cpu`` (chained prefix keys): only a
  prompt that opens with a document seen right after the system prompt
  reuses it (about 1/k of the documents);
- ``flowkv blend R``: pipeline ``blend`` at each ``--ratios`` R, all through
  one vLLM (a request carries its own ``flowkv.blend.recompute_ratio``).

For each: TTFT p50 and p99 over every prompt of every repeat, and the spread
of the per-repeat medians (min-max); the share of prompt tokens vLLM took
from flowkv (``num_cached_tokens``); for blend the share of reused tokens
recomputed (the worker's blend counters); and quality against the full
prefill of the same prompt: greedy agreement over ``--max-tokens`` generated
tokens (position by position), top-1 agreement of the first token, and the
mean |Δlogprob| of the reference's tokens while the two generations share
their context. TTFT is timed on a one-token request; the quality on a
second, ``--max-tokens`` one.

The model is a random-weight Llama built once by
``flowkv._testing.tiny_model`` from ``--layers``, ``--hidden``, ``--heads``,
``--kv-heads``, ``--head-dim`` (default the issue's speed shape: 16 layers,
hidden 1024, 8 heads / 4 KV heads x 128), or ``--model`` (a local folder,
e.g. the trained reference model). ``--plot FILE.png`` draws TTFT and the
quality figures per configuration.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from flowkv.bench import chosen, positive, report
from flowkv.integration.harness import flowkv_config, model_config, setup_environment, shutdown

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
NO_CACHE = "no cache"
PREFIX = "flowkv prefix"
# Token ids the random documents never hold (the tokenizer's special tokens are the lowest ids):
# the separator that closes each document, and where random tokens start.
SEPARATOR = [3]
_FIRST_ID = 16
# The reference's top tokens whose logprobs each generation returns.
_LOGPROBS = 5
# The lookup answer may come late on a busy machine; a late one would count as a miss.
_LOOKUP_TIMEOUT_MS = 30_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench rag``."""
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a plot of TTFT and quality per configuration")
    parser.add_argument("--pool", type=int, default=20, help="documents in the pool (default 20)")
    parser.add_argument("--k", type=int, default=4, help="documents per prompt (default 4)")
    parser.add_argument("--doc-tokens", type=int, default=1024, help="tokens per document (default 1024)")
    parser.add_argument("--system-tokens", type=int, default=128, help="tokens of the system prompt (default 128)")
    parser.add_argument("--question-tokens", type=int, default=32, help="tokens per question (default 32)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per repeat (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, each with prompts of its own (default 3)")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated for quality (default 16)")
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="recompute ratios of the blend runs")
    parser.add_argument("--configs", default="no cache,flowkv prefix,flowkv blend",
                        help="comma-separated, of: no cache, flowkv prefix, flowkv blend (no cache is always run)")
    parser.add_argument("--model", help="a local model folder (default: a random-weight Llama of the shape below)")
    parser.add_argument("--model-dir", help="where the random-weight model is built (default under ~/.cache/flowkv)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)


class Workload:
    """The documents, the system prompt and every prompt of a run (token ids), from one seed."""

    def __init__(self, *, vocab: int, pool: int, k: int, doc_tokens: int, system_tokens: int, question_tokens: int,
                 prompts: int, repeats: int, seed: int, separator: list[int] = SEPARATOR) -> None:
        rng = random.Random(seed)
        closing = set(separator)

        def tokens(count: int) -> list[int]:
            out: list[int] = []
            while len(out) < count:  # no separator id inside a document: it would cut it
                token = rng.randrange(_FIRST_ID, vocab)
                if token not in closing:
                    out.append(token)
            return out

        self.system = tokens(system_tokens - len(separator)) + list(separator)
        self.documents = [tokens(doc_tokens - len(separator)) + list(separator) for _ in range(pool)]
        # Seen once each before the timed prompts: what stores the documents (and, for prefix keys,
        # the system prompt followed by one document).
        self.warmup = [self.system + doc + tokens(question_tokens) for doc in self.documents]
        # prompts[repeat][i]: (prompt, indices of its documents in order)
        self.prompts: list[list[tuple[list[int], list[int]]]] = []
        for _ in range(repeats):
            group = []
            for _ in range(prompts):
                chosen = rng.sample(range(pool), k)
                prompt = self.system + [t for i in chosen for t in self.documents[i]] + tokens(question_tokens)
                group.append((prompt, chosen))
            self.prompts.append(group)


def _check(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    try:
        ratios = [float(x) for x in args.ratios.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ratios must be comma-separated numbers in 0..1, got {args.ratios!r}") from None
    if not ratios or not all(0.0 <= r <= 1.0 for r in ratios):
        raise ValueError(f"--ratios must be comma-separated numbers in 0..1, got {args.ratios!r}")
    configs = chosen(args.configs, (NO_CACHE, PREFIX, "flowkv blend"), "--configs")
    positive(args, ("pool", "k", "doc_tokens", "system_tokens", "question_tokens", "prompts", "repeats", "max_tokens"))
    if args.k > args.pool:
        raise ValueError(f"--k ({args.k}) cannot exceed --pool ({args.pool})")
    if args.system_tokens <= len(SEPARATOR) or args.doc_tokens <= len(SEPARATOR):
        raise ValueError("--system-tokens and --doc-tokens must be longer than the separator")
    return ratios, [NO_CACHE] + [c for c in configs if c != NO_CACHE]


def _model(args: argparse.Namespace) -> Path:
    if args.model:
        model = Path(args.model).expanduser()
        if not (model / "config.json").is_file():
            raise ValueError(f"{model} is not a model folder (no config.json)")
        return model
    from flowkv._testing.tiny_model import tiny_model
    from flowkv.integration.harness import default_model_dir

    shape = dict(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
                 head_dim=args.head_dim, intermediate_size=int(2.75 * args.hidden), vocab_size=4096,
                 max_position_embeddings=32768)
    name = f"rag-llama-l{args.layers}-h{args.hidden}-{args.heads}x{args.kv_heads}x{args.head_dim}"
    folder = Path(args.model_dir) if args.model_dir else default_model_dir().parent / name
    return tiny_model(folder, **shape)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    try:
        ratios, configs = _check(args)
        model = _model(args)
    except ValueError as exc:
        print(f"flowkv bench rag: {exc}", file=sys.stderr)
        return 2
    setup_environment()
    results = measure(model, args, ratios=ratios, configs=configs)
    return report(results, args, table=print_table, plot=plot)


def measure(model: Path, args: argparse.Namespace, *, ratios: list[float], configs: list[str],
            blend_pipeline: str = "blend", separator: list[int] = SEPARATOR,
            blend_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every configuration on the same workload; the figures as ``print_table`` and ``plot`` take them.

    The blend runs use `blend_pipeline` (a name or a file) with
    `blend_overrides` (default: ``blend.separator`` set to `separator`, which
    closes every document of the workload).
    """
    config = model_config(model)
    overrides = {"blend.separator": separator} if blend_overrides is None else blend_overrides
    work = Workload(vocab=config["vocab_size"], pool=args.pool, k=args.k, doc_tokens=args.doc_tokens,
                    system_tokens=args.system_tokens, question_tokens=args.question_tokens, prompts=args.prompts,
                    repeats=args.repeats, seed=args.seed, separator=separator)
    longest = args.system_tokens + args.k * args.doc_tokens + args.question_tokens + args.max_tokens
    engine = dict(model=model, dtype=args.dtype, max_model_len=longest + 16, max_tokens=args.max_tokens)
    results: dict[str, Any] = {
        "model": str(model), "dtype": args.dtype,
        "workload": {"pool": args.pool, "k": args.k, "doc_tokens": args.doc_tokens,
                     "system_tokens": args.system_tokens, "question_tokens": args.question_tokens,
                     "prompts": args.prompts, "repeats": args.repeats, "max_tokens": args.max_tokens},
        "configs": {},
    }

    def add(name: str, figures: dict[str, Any]) -> None:
        # Printed as soon as measured: a run stopped part-way (a timeout) keeps what it measured.
        full = results["configs"].get(NO_CACHE, figures)["ttft_p50_s"]
        results["configs"][name] = {**figures, "ttft_vs_full_prefill": figures["ttft_p50_s"] / full}
        print(f"bench rag: {_row(name, results['configs'][name])}", file=sys.stderr, flush=True)

    print("bench rag: no cache...", file=sys.stderr)
    reference = _runs(work, None, [None], **engine)[None]
    add(NO_CACHE, _figures(reference, reference))
    if PREFIX in configs:
        print("bench rag: flowkv prefix...", file=sys.stderr)
        runs = _runs(work, flowkv_config("local-cpu", lookup_timeout_ms=_LOOKUP_TIMEOUT_MS), [None], **engine)[None]
        add(PREFIX, _figures(runs, reference))
    if "flowkv blend" in configs:
        print(f"bench rag: flowkv blend at {', '.join(map(str, ratios))}...", file=sys.stderr)
        blend = flowkv_config(blend_pipeline, **{**overrides, "lookup_timeout_ms": _LOOKUP_TIMEOUT_MS})
        _runs(work, blend, ratios, **engine,
              measured=lambda ratio, runs: add(f"flowkv blend {ratio:g}", _figures(runs, reference)))
    return results


def _runs(work: Workload, transfer: Any, ratios: list[float | None], *, model: Path, dtype: str, max_model_len: int,
          max_tokens: int, measured: Any = None) -> dict[float | None, dict[str, Any]]:
    """One vLLM: the warm-up prompts, then every prompt at each ratio (None: the pipeline's own);
    ``measured(ratio, runs)`` is called as each ratio is done."""
    import os

    from vllm import LLM

    from flowkv.integration.harness import kv_bytes_per_token

    # A pool for a few of the longest prompts (vLLM's CPU platform lets this variable override the bytes).
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    kv_bytes = max(64 << 20, 8 * max_model_len * kv_bytes_per_token(model) * (2 if dtype == "float32" else 1))
    llm = LLM(model=str(model), dtype=dtype, enable_prefix_caching=False, max_model_len=max_model_len,
              max_num_batched_tokens=max_model_len, kv_transfer_config=transfer, disable_log_stats=True, seed=0,
              enforce_eager=True, kv_cache_memory_bytes=kv_bytes)
    try:
        for prompt in work.warmup if transfer is not None else ():
            _generate(llm, prompt, 1, None, save=True, connected=True)
        out: dict[float | None, dict[str, Any]] = {}
        for ratio in ratios:
            before = _blend_counters(llm) if transfer is not None else (0, 0)
            ttft: list[list[float]] = []
            cached: list[int] = []
            generations: list[Any] = []
            for group in work.prompts:
                ttft.append([])
                for prompt, _ in group:
                    seconds = _timed(llm, prompt, ratio, connected=transfer is not None)
                    ttft[-1].append(seconds)
                    output = _generate(llm, prompt, max_tokens, ratio, save=False, connected=transfer is not None)
                    cached.append(int(output.num_cached_tokens or 0))
                    generations.append(output.outputs[0])
            after = _blend_counters(llm) if transfer is not None else (0, 0)
            # Each prompt was loaded twice (timed, then generated): halve the counters' growth.
            reused, recomputed = ((a - b) / 2 for a, b in zip(after, before))
            out[ratio] = {"ttft_s": ttft, "cached": cached, "prompt_tokens": [len(p) for g in work.prompts for p, _ in g],
                          "generations": generations, "blend_reused": reused, "blend_recomputed": recomputed}
            if measured is not None:
                measured(ratio, out[ratio])
        return out
    finally:
        shutdown(llm)


def _sampling(max_tokens: int, ratio: float | None, save: bool, connected: bool) -> Any:
    from vllm import SamplingParams

    transfer: dict[str, Any] = {} if save or not connected else {"flowkv.skip_save": True}
    if ratio is not None:
        transfer["flowkv.blend.recompute_ratio"] = ratio
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=_LOGPROBS,
                          extra_args={"kv_transfer_params": transfer} if transfer else None)


def _generate(llm: Any, prompt: list[int], max_tokens: int, ratio: float | None, *, save: bool,
              connected: bool) -> Any:
    """One greedy generation; a connected vLLM's request carries flowkv's settings (skip_save, the ratio)."""
    sampling = _sampling(max_tokens, ratio, save, connected)
    [output] = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
    return output


def _timed(llm: Any, prompt: list[int], ratio: float | None, *, connected: bool) -> float:
    """Seconds to the first token: a one-token request."""
    import time

    started = time.perf_counter()
    _generate(llm, prompt, 1, ratio, save=False, connected=connected)
    return time.perf_counter() - started


def _blend_counters(llm: Any) -> tuple[int, int]:
    from flowkv.integration.vllm import worker_stats

    numbers = worker_stats(llm.llm_engine.vllm_config)
    return int(numbers.get("blend_reused_tokens", 0)), int(numbers.get("blend_recomputed_tokens", 0))


def _percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (p99 of a few values is their largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-int(share * 100) * len(ordered) // 100) - 1))]


def _figures(runs: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """A configuration's figures: TTFT, reuse, and quality against the reference's generations."""
    from flowkv.integration.harness import compare_generation

    every = [t for group in runs["ttft_s"] for t in group]
    medians = [statistics.median(group) for group in runs["ttft_s"]]
    compared = [compare_generation(ref, got) for ref, got in zip(reference["generations"], runs["generations"])]
    diffs = [d for c in compared for d in c["logprob_diffs"]]
    return {
        "ttft_p50_s": statistics.median(every),
        "ttft_p99_s": _percentile(every, 0.99),
        "ttft_repeat_p50_s": [min(medians), max(medians)],
        "reused_share": sum(runs["cached"]) / sum(runs["prompt_tokens"]),
        "recomputed_share": runs["blend_recomputed"] / runs["blend_reused"] if runs["blend_reused"] else 0.0,
        "greedy_agreement": sum(c["equal"] for c in compared) / sum(c["total"] for c in compared),
        "first_token_agreement": sum(ref.token_ids[0] == got.token_ids[0] for ref, got in
                                     zip(reference["generations"], runs["generations"])) / len(compared),
        "mean_abs_dlogprob": sum(diffs) / len(diffs) if diffs else 0.0,
    }


def print_table(results: dict[str, Any]) -> None:
    w = results["workload"]
    print(f"{results['model']} ({results['dtype']}): {w['k']} of {w['pool']} documents x {w['doc_tokens']} tokens, "
          f"{w['prompts']} prompts x {w['repeats']} repeats, {w['max_tokens']} greedy tokens")
    print(f"{'config':<20} {'TTFT p50 ms':>11} {'p99 ms':>8} {'repeats ms':>13} {'vs full':>8} {'reused':>7} "
          f"{'recomp':>7} {'greedy':>7} {'top-1':>6} {'|dlp|':>7}")
    for name, f in results["configs"].items():
        print(_row(name, f))
    print("(TTFT of a one-token request, over every prompt; repeats: min-max of the per-repeat medians; vs full: "
          "p50 / no cache's; reused: prompt tokens vLLM took from flowkv; recomp: reused tokens recomputed; "
          "greedy, top-1, |dlp|: against no cache's full prefill)")


def _row(name: str, f: dict[str, Any]) -> str:
    low, high = f["ttft_repeat_p50_s"]
    return (f"{name:<20} {f['ttft_p50_s'] * 1e3:>11.1f} {f['ttft_p99_s'] * 1e3:>8.1f} "
            f"{low * 1e3:>6.0f}-{high * 1e3:<6.0f} {f['ttft_vs_full_prefill']:>7.2f}x {f['reused_share']:>7.1%} "
            f"{f['recomputed_share']:>7.1%} {f['greedy_agreement']:>7.1%} {f['first_token_agreement']:>6.0%} "
            f"{f['mean_abs_dlogprob']:>7.3f}")


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["configs"])
    figures = [results["configs"][n] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    medians = [f["ttft_p50_s"] * 1e3 for f in figures]
    low = [m - f["ttft_repeat_p50_s"][0] * 1e3 for m, f in zip(medians, figures)]
    high = [f["ttft_repeat_p50_s"][1] * 1e3 - m for m, f in zip(medians, figures)]
    left.bar(range(len(names)), medians, yerr=[[max(0, x) for x in low], [max(0, x) for x in high]], capsize=3)
    left.set_xticks(range(len(names)), names, rotation=30, ha="right")
    left.set_ylabel("TTFT p50 (ms); bars: repeat medians' range")
    blends = [(n, f) for n, f in zip(names, figures) if n.startswith("flowkv blend")]
    ratios = [float(n.rsplit(" ", 1)[1]) for n, _ in blends]
    right.plot(ratios, [f["greedy_agreement"] for _, f in blends], marker="o", label="greedy agreement")
    right.plot(ratios, [f["first_token_agreement"] for _, f in blends], marker="s", label="first-token top-1")
    right.plot(ratios, [f["mean_abs_dlogprob"] for _, f in blends], marker="^", label="mean |Δlogprob|")
    right.set_xlabel("recompute_ratio")
    right.set_title("quality against the full prefill")
    right.grid(True, alpha=0.3)
    right.legend()
    fig.suptitle(f"flowkv bench rag, {Path(results['model']).name}: {results['workload']['k']} documents x "
                 f"{results['workload']['doc_tokens']} tokens in random order ({results['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)
