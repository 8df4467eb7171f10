"""``flowkv quality``: what a pipeline's codecs do to a model's output, and the gate that uses it.

A lossy codec (``fp8``, ``int8``, ``int4``) changes the KV that a warm
request loads, so it can change what the model says. ``flowkv quality
PIPELINE`` measures that with the real vLLM: a fixed prompt set (Python
standard-library sources of ``--prompt-tokens`` tokens, each followed by a
question; files the trained reference model never saw) is generated
greedily with no KV loaded (the reference), stored through each codec of the
pipeline's ``compress`` stages, and generated again so that the whole cached
prefix is loaded through that codec. The model is the trained reference
model (`flowkv._testing.trained_model`, built locally once) unless
``--model`` names another. For each codec it reports:

- **agreement**: the fraction of generated tokens (``--max-tokens`` per
  prompt, position by position) equal to the reference's;
- **max logprob diff**: the largest difference in the log-probability of the
  reference's token, over the positions where both generations still share
  their context (up to and including the first differing token).

``none`` is always measured too, as the control: it loads exact KV the same
way, so its figures are the noise floor of reusing KV at all (a prefill
that reuses KV computes the rest of the prompt in a different batch shape,
and a near-tie in the logits can flip). Each codec is also compared against
that control (``agreement_vs_control``), which isolates the codec's effect.
The gate uses ``agreement``, the end-to-end figure.

It writes a quality record (JSON) with the model, the codecs and their
parameters, the figures, the prompt set and the date. A pipeline file can
then require a minimum::

    [quality]
    min_agreement = 0.95
    record = "quality/cpu-disk-int8.json"   # relative to the pipeline file

and the loader refuses the pipeline (at the ``min_agreement`` line) when a
lossy codec of its store list has no measurement in the record, the record
measured other codecs or parameters, or the recorded agreement is below the
minimum. Pipelines whose codecs are all lossless need no record. A record
holds for the model it was measured on: produce it with ``--model`` set to
the model you serve.

    flowkv quality pipelines/cpu-disk-int8.toml --model /models/my-llama --out quality/cpu-disk-int8.json

The measurement runs every codec in one vLLM: the requests of each codec
carry a cache-key tag that selects it (stage ``quality-compress``, the same
`flowkv.stages.codec.encode_chunk` the ``compress`` stage calls), the memory tier holds
the encoded payloads, and the pipeline's real ``decompress`` stage decodes
them on the way back.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowkv.codecs import get_codec
from flowkv.items import Chunk, RunContext
from flowkv.pipeline import dumps_pipeline
from flowkv.integration.harness import compare_generation as _compare
from flowkv.quality_gate import (
    RECORD_FORMAT,
    blend_setting,
    check_gate,
    check_served_model,
    codec_code_digest,
    codec_settings,
    load_record,
    record_path,
)
from flowkv.quality_gate import canonical_params as _canonical
from flowkv.quality_gate import describe_codec as _describe
from flowkv.quality_gate import model_digest as _model_digest
from flowkv.registry import Role, stage

__all__ = [
    "RECORD_FORMAT",
    "add_commands",
    "check_gate",
    "check_served_model",
    "codec_settings",
    "load_record",
    "measure",
    "quality_compress",
    "record_path",
]

# The request tag that picks a codec in a measurement run.
_CODEC_TAG = "quality_codec"


# -- the measurement stage ----------------------------------------------------------


def _measured(config: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(entry["codec"], entry.get("params", {})) for entry in map(json.loads, config.codecs or [])]


# Lossy when it measures a lossy codec: the [quality] gate holds it to a record like `compress`.
@stage("quality-compress", kinds=("store",), needs={"kv"}, gives={"payload"}, role=Role.CODEC,
       lossy=lambda config: any(not get_codec(codec).lossless for codec, _ in _measured(config)), encodings=_measured)
def quality_compress(chunks: Iterator[Chunk], *, ctx: RunContext, codecs: list[str] | None = None) -> Iterator[Chunk]:
    """Encode each chunk with the codec its request's ``quality_codec`` tag picks (an index into ``codecs``).

    Each entry of ``codecs`` is a JSON object ``{"codec": NAME, "params": {...}}``.
    Requests without the tag are stored raw. Used by ``flowkv quality`` to
    measure several codecs in one vLLM; the encoding is the ``compress``
    stage's (`flowkv.stages.codec.encode_chunk`: true tokens on a packed
    cache), and a ``window`` parameter keeps the last tokens of each stored
    prefix exact as it does there.

    TOML::

        [[store.stages]]
        use = "flowkv.quality:quality_compress"
        codecs = ['{"codec": "int8", "params": {}}']
    """
    plans = []
    for text in codecs or []:
        entry = json.loads(text)
        get_codec(entry["codec"]).resolve_params(**entry.get("params", {}))  # fail on the first run, not per chunk
        plans.append((entry["codec"], entry.get("params", {})))
    from flowkv.codecs import prefix_window
    from flowkv.stages.codec import encode_chunk, stored_end

    for chunk in chunks:
        choice = chunk.request.tags.get(_CODEC_TAG)
        if choice is not None:
            codec, params = plans[int(choice)]
            if params.get("window"):
                window = prefix_window(params["window"], chunk.start, chunk.end, stored_end(ctx.services, chunk.request))
                params = {**params, "window": window}
            chunk.payload = encode_chunk(chunk, ctx.services, codec, params)
            ctx.record(bytes=len(chunk.payload))
        yield chunk


# -- measuring ---------------------------------------------------------------------


def _measurement_pipeline(folder: Path, chunk_size: int, codecs: list[tuple[str, dict[str, Any]]],
                          capacity: int) -> Path:
    entries = [json.dumps({"codec": c, "params": p}, sort_keys=True) for c, p in codecs]
    path = folder / "quality-measurement.toml"
    path.write_text(dumps_pipeline(
        pipeline={"name": "quality-measurement", "chunk_size": chunk_size},
        tiers={"memory": {"kind": "memory", "capacity": capacity}},
        store=["tokenize", "chunk-hash", "allocate", "gather",
               ("flowkv.quality:quality_compress", {"codecs": entries}), "put"],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"],
    ), encoding="utf-8")
    return path


def prompt_set(tokenizer: Any, count: int, prompt_tokens: int) -> list[list[int]]:
    """The fixed prompts: standard-library source documents, each followed by one of the demo's questions.

    The documents are the first files by name that are long enough, as the demo takes them; the
    trained reference model holds those files out of its training (the 32 of the default prompt
    set, see `flowkv._testing.trained_model.held_out_sources`).
    """
    from flowkv.integration.harness import QUESTIONS, documents

    questions = [tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    return [doc + questions[i % len(questions)] for i, doc in enumerate(documents(tokenizer, count, prompt_tokens))]


def measure(
    pipeline: Any,
    *,
    model: Path,
    prompts: int = 32,
    prompt_tokens: int = 1024,
    max_tokens: int = 16,
    logprobs: int = 5,
    codecs: list[tuple[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Run the quality measurement for a loaded pipeline on `model`; returns the quality record.

    `codecs` defaults to the codecs of the pipeline's ``compress`` stages;
    ``none`` is always measured first, as the control that shows what
    loading exact KV changes. Starts one vLLM (CPU or whatever vLLM finds).
    """
    from flowkv.integration.harness import build_llm, flowkv_config, kv_bytes_per_token, setup_environment, shutdown

    user_kv_space = "VLLM_CPU_KVCACHE_SPACE" in os.environ
    setup_environment()
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    codecs = codecs or codec_settings(pipeline.store)
    # The ``none`` control: what loading exact KV does (prefill numerics), apart from any codec.
    codecs = [("none", {})] + [entry for entry in codecs if entry != ("none", {})]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompt_ids = prompt_set(tokenizer, prompts, prompt_tokens)
    longest = max(len(p) for p in prompt_ids)
    max_model_len = 128 * math.ceil((longest + max_tokens + 1) / 128)
    per_token = kv_bytes_per_token(model)
    # vLLM's pool: one prompt at a time; flowkv's: every prompt once per codec, raw-sized.
    pool_bytes = max(64 << 20, 4 * max_model_len * per_token)
    tier_bytes = 2 * len(codecs) * len(prompt_ids) * (longest + pipeline.chunk_size) * per_token
    if not user_kv_space:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # else it overrides kv_cache_memory_bytes

    def params(tag: int | None, tokens: int) -> Any:
        transfer = {f"flowkv.tag.{_CODEC_TAG}": str(tag)} if tag is not None else {"flowkv.skip_save": True}
        extra = {"kv_transfer_params": transfer}
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                              extra_args=extra)

    batch = [{"prompt_token_ids": ids} for ids in prompt_ids]

    def generate(sampling: Any) -> list[Any]:
        # One prompt at a time: a batch's shape changes the arithmetic (and with loads
        # landing at different steps, from run to run), which would blur the codec's effect.
        return [llm.generate([prompt], sampling, use_tqdm=False)[0] for prompt in batch]

    with tempfile.TemporaryDirectory(prefix="flowkv-quality-") as tmp:
        config = flowkv_config(str(_measurement_pipeline(Path(tmp), pipeline.chunk_size, codecs, tier_bytes)))
        llm = build_llm(model, kv_transfer_config=config, max_model_len=max_model_len,
                        kv_cache_memory_bytes=None if user_kv_space else pool_bytes)
        try:
            # Nothing is cached yet and these requests store nothing: vLLM computes every token.
            reference = generate(params(None, max_tokens))
            if any(out.num_cached_tokens for out in reference):
                raise RuntimeError("the reference run loaded cached KV; it must compute every token")
            results = []
            control = None
            for index, (codec, codec_params) in enumerate(codecs):
                generate(params(index, 1))  # computes, and stores through the codec
                warm = generate(params(index, max_tokens))
                served = [int(out.num_cached_tokens or 0) for out in warm]
                if not all(served):
                    raise RuntimeError(f"codec {codec}: {served.count(0)} warm request(s) loaded nothing; "
                                       f"the measurement needs every prompt served from the cache")
                compared = [_compare(ref.outputs[0], new.outputs[0]) for ref, new in zip(reference, warm)]
                equal = sum(c["equal"] for c in compared)
                total = sum(c["total"] for c in compared)
                diffs = [d for c in compared for d in c["logprob_diffs"]]
                control = control or warm  # the first codec is the `none` control
                against = [_compare(ref.outputs[0], new.outputs[0]) for ref, new in zip(control, warm)]
                control_diffs = [d for c in against for d in c["logprob_diffs"]]
                results.append({
                    "codec": codec,
                    "params": codec_params,
                    "lossless": get_codec(codec).lossless,
                    # The code measured: the gate refuses this entry once the codec's code changes.
                    "code_sha256": codec_code_digest(codec),
                    "agreement": equal / total,
                    "max_logprob_diff": max(diffs) if diffs else None,
                    "prompts_identical": sum(c["equal"] == c["total"] for c in compared),
                    "first_differences": [c["first_difference"] for c in compared],
                    # The reference's top-1 minus top-2 logprob where each prompt first differs.
                    "flip_margins": [c["flip_margin"] for c in compared],
                    # Against the control (exact KV loaded the same way): the codec's own effect.
                    "agreement_vs_control": sum(c["equal"] for c in against) / total,
                    "max_logprob_diff_vs_control": max(control_diffs) if control_diffs else None,
                    "tokens_compared": total,
                    "tokens_loaded": sum(served),
                })
        finally:
            shutdown(llm)
    import vllm

    return {
        "format": RECORD_FORMAT,
        "model": str(model),
        "model_config_sha256": _model_digest(model),
        "pipeline": pipeline.name,
        "pipeline_source": pipeline.source,
        "codecs": results,
        # Over the codecs measured, the control included.
        "agreement": min(r["agreement"] for r in results),
        "max_logprob_diff": max((r["max_logprob_diff"] or 0.0) for r in results),
        "prompts": {
            "count": len(prompt_ids),
            "source": "Python standard-library sources (sorted by file name) + the demo's questions",
            "document_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "sha256": hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest(),
        },
        "reference": "the same vLLM with no KV loaded (greedy, temperature 0)",
        "vllm": getattr(vllm, "__version__", "?"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# -- the command ----------------------------------------------------------------------


def add_commands(subparsers: Any) -> None:
    """Add ``flowkv quality`` to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "quality", help="greedy-token agreement of a pipeline's codecs against no compression (real vLLM)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("pipeline", help="built-in pipeline name or TOML path")
    parser.add_argument("--json", action="store_true", help="print the quality record as JSON")
    parser.add_argument("--prompts", type=int, default=32, help="prompts in the fixed set (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="document tokens per prompt (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated per prompt (default 16)")
    parser.add_argument("--model", help="model folder (default: the trained reference model, built locally once)")
    parser.add_argument("--codecs", help="measure these codecs instead of the pipeline's: NAME[:KEY=VALUE...],...")
    parser.add_argument("--out", help="write the quality record here (default: the pipeline's [quality] record, if set "
                        "and the pipeline is not a built-in one)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``flowkv quality``: measure, print, write the record; 1 when below the pipeline's own minimum."""
    from flowkv.pipeline import PipelineError, load_pipeline

    if args.prompts <= 0 or args.prompt_tokens <= 0 or args.max_tokens <= 0:
        print("flowkv quality: --prompts, --prompt-tokens and --max-tokens must be positive", file=sys.stderr)
        return 2
    try:
        # The gate is what this command feeds: load without it, or a missing record stops us.
        pipeline = load_pipeline(args.pipeline, check_quality=False)
        codecs = None
        if args.codecs:
            from flowkv.bench.codecs import parse_codecs

            codecs = [(name, _canonical(name, params)) for name, params in parse_codecs(args.codecs)]
    except (PipelineError, FileNotFoundError, ValueError) as exc:
        print(f"flowkv quality: {exc}", file=sys.stderr)
        return 2
    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            print(f"flowkv quality: {model} is not a model folder (no config.json)", file=sys.stderr)
            return 2
    else:
        from flowkv._testing.trained_model import trained_model

        model = trained_model()
    print(f"flowkv quality: {args.prompts} prompts on {model} through pipeline '{pipeline.name}'...", file=sys.stderr)
    if pipeline.blend is not None:
        record = measure_blend(pipeline, args.pipeline, model=model, prompts=args.prompts,
                               prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    else:
        record = measure(pipeline, model=model, prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                         max_tokens=args.max_tokens, codecs=codecs)
    out = args.out
    if out is None and pipeline.quality.record and not _is_builtin(pipeline):
        # A built-in pipeline's record ships with flowkv (measured on its reference model):
        # a measurement of another model goes where --out says, never over it.
        out = str(record_path(pipeline.quality.record, pipeline.source))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    minimum = pipeline.quality.min_agreement
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        _print(record, out, minimum)
    if minimum is not None and any(not r["lossless"] and r["agreement"] < minimum for r in record["codecs"]):
        return 1
    return 0


# The RAG workload of a blend measurement: documents per prompt, and the pool they are drawn from.
_BLEND_K = 4
_BLEND_POOL = 8


def measure_blend(pipeline: Any, source: str, *, model: Path, prompts: int = 32, prompt_tokens: int = 1024,
                  max_tokens: int = 16) -> dict[str, Any]:
    """The quality record of a ``[blend]`` pipeline: ``flowkv bench rag``'s workload at its recompute_ratio.

    Each prompt is a system prompt, then ``_BLEND_K`` documents of the pool
    (``prompt_tokens`` in all) in random order, each closed by the pipeline's
    separator, then a question: generated by a full prefill (the reference)
    and through the pipeline, its documents blended where they now sit.
    Starts two vLLMs, one after the other.
    """
    from flowkv.bench import rag
    from flowkv.integration.harness import setup_environment

    setup_environment()
    blend = pipeline.blend
    workload = argparse.Namespace(pool=_BLEND_POOL, k=_BLEND_K, doc_tokens=max(32, prompt_tokens // _BLEND_K),
                                  system_tokens=64, question_tokens=32, prompts=prompts, repeats=1,
                                  max_tokens=max_tokens, dtype="bfloat16", seed=0)
    results = rag.measure(model, workload, ratios=[blend.recompute_ratio], configs=[rag.NO_CACHE, "flowkv blend"],
                          blend_pipeline=source, separator=list(blend.separator),
                          # The gate this measurement feeds must not stop the vLLM that measures.
                          blend_overrides={"quality.mode": "warn"})
    [figures] = [f for name, f in results["configs"].items() if name.startswith("flowkv blend")]
    codec, params = blend_setting(blend)
    entry = {"codec": codec, "params": params, "lossless": False, "agreement": figures["greedy_agreement"],
             "first_token_agreement": figures["first_token_agreement"],
             "mean_logprob_diff": figures["mean_abs_dlogprob"], "reused_share": figures["reused_share"],
             "recomputed_share": figures["recomputed_share"], "max_logprob_diff": None, "prompts_identical": None,
             "agreement_vs_control": None, "max_logprob_diff_vs_control": None, "first_differences": []}
    return {"format": RECORD_FORMAT, "model": str(model), "model_config_sha256": _model_digest(model),
            "pipeline": pipeline.name, "pipeline_source": pipeline.source, "codecs": [entry],
            "agreement": entry["agreement"], "reference": "a full prefill (no KV loaded)",
            "prompts": {"count": prompts, "document_tokens": workload.k * workload.doc_tokens,
                        "max_tokens": max_tokens, "set": f"bench rag: {workload.k} of {workload.pool} random "
                                                         f"documents in random order"},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _is_builtin(pipeline: Any) -> bool:
    from flowkv.pipeline import builtin_pipelines

    return Path(pipeline.source).resolve() in {path.resolve() for path in builtin_pipelines().values()}


def _max_flip_margin(row: dict[str, Any]) -> float | None:
    margins = [m for m in row.get("flip_margins") or [] if m is not None]  # records before it lack the field
    return max(margins) if margins else None


def _print(record: dict[str, Any], out: str | None, minimum: float | None) -> None:
    prompts = record["prompts"]
    print(f"model {record['model']}; {prompts['count']} prompts of {prompts['document_tokens']} document tokens, "
          f"{prompts['max_tokens']} greedy tokens each; reference: {record['reference']}")
    header = (f"{'codec':<46} {'agreement':>9} {'max |dlogprob|':>14} {'identical':>9} "
              f"{'vs none: agree':>14} {'max |dlogprob|':>14} {'flip margin':>11}")
    print(header)
    print("-" * len(header))

    def diff(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    for row in record["codecs"]:
        if row["codec"] == "blend":  # measured against a full prefill by measure_blend: its own figures
            print(f"{_describe(row['codec'], row['params']):<46} {row['agreement']:>9.1%}  first token "
                  f"{row['first_token_agreement']:.1%}, mean |dlogprob| {row['mean_logprob_diff']:.4f}, "
                  f"{row['reused_share']:.1%} of prompt tokens reused, {row['recomputed_share']:.1%} of them "
                  "recomputed")
            continue
        print(f"{_describe(row['codec'], row['params']):<46} {row['agreement']:>9.1%} "
              f"{diff(row['max_logprob_diff']):>14} {row['prompts_identical']:>5}/{prompts['count']:<3} "
              f"{row['agreement_vs_control']:>14.1%} {diff(row['max_logprob_diff_vs_control']):>14} "
              f"{diff(_max_flip_margin(row)):>11}")
    print("(agreement: greedy tokens equal to the reference, which loaded no KV; 'vs none': against the "
          "none control, which loaded exact KV the same way, so only the codec differs; flip margin: the "
          "largest lead of the reference's token over its runner-up, in nats, where a prompt first differs)")
    if minimum is not None:
        verdict = all(r["lossless"] or r["agreement"] >= minimum for r in record["codecs"])
        print(f"[quality] min_agreement {minimum:.1%}: {'passes' if verdict else 'FAILS'}")
    print(f"record: {out}" if out else "record not written (give --out FILE)")
