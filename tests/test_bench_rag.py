"""``flowkv bench rag``: RAG prompts with documents in random order, through no cache, prefix keys and CacheBlend.

The workload and the options without vLLM; then one tiny run of the real
benchmark (three vLLMs on the tiny model, fp32) whose figures must keep the
relations the configurations imply (never a wall-clock limit).
"""

from __future__ import annotations

import argparse
import json

import pytest
from vllm_helpers import tiny_model_dir

from flowkv.bench import BENCHMARKS
from flowkv.bench import rag as bench


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rag_is_a_registered_benchmark():
    assert BENCHMARKS["rag"][0] == "flowkv.bench.rag"


def test_every_prompt_is_the_system_prompt_then_k_pool_documents_in_its_order_then_a_question():
    work = bench.Workload(vocab=2048, pool=5, k=3, doc_tokens=40, system_tokens=10, question_tokens=6, prompts=4,
                          repeats=2, seed=7)
    assert len(work.documents) == 5 and all(len(d) == 40 and d[-1:] == bench.SEPARATOR for d in work.documents)
    # The separator closes each document and the system prompt, and nowhere else.
    assert all(bench.SEPARATOR[0] not in d[:-1] for d in work.documents + [work.system])
    assert [w[:50] for w in work.warmup] == [work.system + d for d in work.documents]
    orders = set()
    for group in work.prompts:
        assert len(group) == 4
        for prompt, chosen in group:
            assert len(set(chosen)) == 3 and all(0 <= i < 5 for i in chosen)
            body = [t for i in chosen for t in work.documents[i]]
            assert prompt[:10] == work.system and prompt[10:130] == body and len(prompt) == 136
            orders.add(tuple(chosen))
    assert len(orders) > 1  # drawn, not one fixed order
    again = bench.Workload(vocab=2048, pool=5, k=3, doc_tokens=40, system_tokens=10, question_tokens=6, prompts=4,
                           repeats=2, seed=7)
    assert again.prompts == work.prompts  # one seed, one workload


def test_bad_options_are_refused(capsys):
    for argv in (["--ratios", "0,2"], ["--ratios", "x"], ["--k", "5", "--pool", "3"], ["--configs", "lmcache"],
                 ["--repeats", "0"], ["--model", "/nonexistent"]):
        assert bench.run(parse(*argv)) == 2, argv
        assert "flowkv bench rag:" in capsys.readouterr().err


def test_percentile_is_nearest_rank():
    assert bench._percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert bench._percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert bench._percentile([5.0], 0.99) == 5.0


@pytest.mark.vllm
def test_a_tiny_run_reuses_documents_in_any_order_and_ratio_1_matches_the_full_prefill(tmp_path, capsys,
                                                                                        engines_in_this_process):
    plot = tmp_path / "rag.png"
    args = parse("--model", str(tiny_model_dir()), "--dtype", "float32", "--pool", "3", "--k", "2",
                 "--doc-tokens", "256", "--system-tokens", "128", "--question-tokens", "16", "--prompts", "2",
                 "--repeats", "2", "--max-tokens", "4", "--ratios", "0,0.3,1", "--json", "--plot", str(plot))
    assert bench.run(args) == 0
    results = json.loads(capsys.readouterr().out)
    configs = results["configs"]
    assert list(configs) == ["no cache", "flowkv prefix", "flowkv blend 0", "flowkv blend 0.3", "flowkv blend 1"]
    for name, figures in configs.items():
        assert figures["ttft_p50_s"] <= figures["ttft_p99_s"], name
        low, high = figures["ttft_repeat_p50_s"]
        assert 0 < low <= high, name
    full = configs["no cache"]
    assert (full["reused_share"], full["greedy_agreement"], full["mean_abs_dlogprob"]) == (0.0, 1.0, 0.0)
    # Prefix keys reuse the system prompt and the first document (seen first in the warm-up) only;
    # segment keys every document wherever it sits, whatever the ratio.
    prefix = configs["flowkv prefix"]["reused_share"]
    blends = [configs[f"flowkv blend {r}"] for r in ("0", "0.3", "1")]
    assert 0 < prefix < blends[0]["reused_share"]
    assert blends[0]["reused_share"] == blends[1]["reused_share"] == blends[2]["reused_share"] >= 0.8
    # Exact prefix KV changes nothing but rounding.
    assert configs["flowkv prefix"]["mean_abs_dlogprob"] <= 1e-3
    # The recomputed share grows with the ratio: none at 0; at 1 every reused token but the exact system prompt.
    shares = [b["recomputed_share"] for b in blends]
    assert shares[0] == 0.0 < shares[1] < shares[2] < 1.0
    # Ratio 1 is a full prefill of the reused tokens; plain concatenation (0) is further from it. (The
    # tiny model's check layer, 1, is its last: at 0.3 every reused token is recomputed there too.)
    assert blends[2]["mean_abs_dlogprob"] <= 1e-3 < blends[0]["mean_abs_dlogprob"]
    assert blends[1]["mean_abs_dlogprob"] <= blends[0]["mean_abs_dlogprob"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.vllm
def test_flowkv_quality_measures_a_blend_pipeline_and_its_record_passes_the_enforced_gate(tmp_path, capsys,
                                                                                           engines_in_this_process):
    from flowkv.cli import main
    from flowkv.pipeline import PipelineError, load_pipeline

    pipeline = tmp_path / "my-blend.toml"
    pipeline.write_text('extends = "blend"\n\n[pipeline]\nname = "my-blend"\n\n[blend]\nseparator = [3]\n'
                        'recompute_ratio = 0.3\n\n[quality]\nmode = "enforce"\nmin_agreement = 0.0\n'
                        'record = "my-blend-quality.json"\n', encoding="utf-8")
    with pytest.raises(PipelineError, match="no quality record at"):
        load_pipeline(pipeline)
    assert main(["quality", str(pipeline), "--model", str(tiny_model_dir()), "--prompts", "2",
                 "--prompt-tokens", "512", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert 'blend {"check_layers": [1], "recompute_ratio": 0.3}' in out
    record = json.loads((tmp_path / "my-blend-quality.json").read_text())
    [entry] = record["codecs"]
    assert (entry["codec"], entry["params"]) == ("blend", {"check_layers": [1], "recompute_ratio": 0.3})
    assert 0.0 <= entry["agreement"] <= 1.0 and entry["reused_share"] >= 0.8 and 0 < entry["recomputed_share"] < 1
    # The record it wrote is what the gate reads: enforced, the pipeline now loads at its ratio only.
    assert load_pipeline(pipeline, overrides={"quality.min_agreement": entry["agreement"]}).blend.recompute_ratio == 0.3
    with pytest.raises(PipelineError, match="no measurement of blend"):
        load_pipeline(pipeline, overrides={"blend.recompute_ratio": 0.15})
