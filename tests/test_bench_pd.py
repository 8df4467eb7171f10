"""``flowkv bench pd`` at a tiny size: colocated against disaggregated prefill, real servers, vLLM's client.

One run of the command for the module (three eager float32 ``vllm serve``
instances, two node servers, two ``flowkv route``): three documents asked
twice each at concurrency 2, in one round (medians and ranges over rounds: on
made-up rounds in test_bench_serve_table.py), vLLM's own prefix cache off so
that every reuse is flowkv's. Asserts the structure of the figures and the
relations between them, never a speed: both set-ups in every round; the
prompt tokens add up across the colocated instance, the prefill instance and
the decode instance; the decode instance loads every prompt from the node
server but (at most) its last block; the outputs of the two set-ups are equal.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest

from flowkv.bench import pd
from flowkv.cli import main

ROUNDS = 1  # medians and ranges over rounds: on made-up rounds in test_bench_serve_table.py
LEVEL = 2
DOCS, ASKS = 3, 2
REQUESTS = DOCS * ASKS
BLOCK = 128


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    import vllm  # noqa: F401 - a broken vLLM install fails these tests; it never skips them
    from vllm_helpers import engine_processes, tiny_model_dir

    folder = tmp_path_factory.mktemp("bench-pd")
    buffer = io.StringIO()
    # vLLM's engine core runs the model itself (no worker process): a start ~10 s sooner (tests/vllm_server.py)
    with contextlib.redirect_stdout(buffer), engine_processes(separate=False):
        status = main(["bench", "pd", "--model-dir", str(tiny_model_dir()), "--concurrency", str(LEVEL),
                       "--repeats", str(ROUNDS), "--docs", str(DOCS), "--asks", str(ASKS), "--doc-tokens", "512",
                       "--question-tokens", "16", "--output-tokens", "4", "--pool-docs", "3", "--dtype", "float32",
                       "--no-prefix-caching", "--eager", "--keep-logs", str(folder / "logs"),
                       "--plot", str(folder / "pd.png"), "--json"])
    assert status == 0
    return json.loads(buffer.getvalue()), folder


def runs(results, config):
    [(level, level_runs)] = results["runs"][config].items()
    assert int(level) == LEVEL and len(level_runs) == ROUNDS
    return level_runs


def total_prompt(run, prefill=False):
    prefix = "prefill_" if prefill else ""
    return sum(run[f"{prefix}{kind}_tokens"] for kind in ("computed", "cached", "loaded"))


@pytest.mark.vllm
def test_both_setups_ran_every_round_and_answered_every_request(bench):
    results, _ = bench
    assert list(results["median"]) == list(pd.CONFIGS)
    for config in pd.CONFIGS:
        for run in runs(results, config):
            assert run["completed"] == REQUESTS and run["failed"] == 0 and run["requests"] == REQUESTS
            assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"] and 0 < run["itl_p50_ms"] <= run["itl_p99_ms"]
        [(level, row)] = results["median"][config].items()
        spread = results["range"][config][level]
        for key in pd.FIGURES:  # the median of the rounds, within their range
            values = [run[key] for run in runs(results, config)]
            assert spread[key] == [min(values), max(values)] and min(values) <= row[key] <= max(values)


@pytest.mark.vllm
def test_prompt_tokens_add_up_and_the_decode_instance_loads_all_but_a_block_from_the_tier(bench):
    results, _ = bench
    disaggregated = runs(results, "disaggregated")
    for together, split in zip(runs(results, "colocated"), disaggregated):
        # Both set-ups got the same prompts in a round: the same prompt tokens on every instance.
        assert total_prompt(together) == total_prompt(split) == total_prompt(split, prefill=True) > REQUESTS * 512
        # Colocated: one instance, no prefill leg; vLLM's prefix cache is off.
        assert together["prefill_requests"] == together["prefilled"] == total_prompt(together, prefill=True) == 0
        assert together["cached_tokens"] == 0
        # Every request went to the prefill instance first, which computed it all and loaded nothing.
        assert split["prefilled"] == split["prefill_requests"] == REQUESTS and split["prefill_failed"] == 0
        assert split["prefill_loaded_tokens"] == split["prefill_cached_tokens"] == 0
        # The decode instance computed a request's last block at most, and loaded the rest from flowkv.
        assert REQUESTS <= split["computed_tokens"] <= REQUESTS * BLOCK
        assert split["loaded_tokens"] == total_prompt(split) - split["computed_tokens"]
        assert split["retrieved_tokens"] >= split["loaded_tokens"] > 0
    # Colocated, a document's second ask loads it from flowkv (unless both asks ran at once).
    assert sum(run["loaded_tokens"] for run in runs(results, "colocated")) >= 256


@pytest.mark.vllm
def test_the_outputs_of_both_setups_are_equal(bench):
    results, folder = bench
    assert results["outputs_equal"] == {str(LEVEL): [REQUESTS] * ROUNDS}
    for repeat in range(ROUNDS):  # the client's own records, kept with --keep-logs
        texts = [json.loads((folder / "logs" / f"{config}-round{repeat}-c{LEVEL}.json").read_text())["generated_texts"]
                 for config in pd.CONFIGS]
        assert texts[0] == texts[1] and len(texts[0]) == REQUESTS and all(texts[0])


@pytest.mark.vllm
def test_ratios_are_each_rounds_disaggregated_over_colocated_and_the_table_and_plot_show_them(bench, capsys):
    results, folder = bench
    [(level, ratios)] = results["ratios"].items()
    for key in pd.FIGURES:
        per_round = [split[key] / together[key]
                     for together, split in zip(runs(results, "colocated"), runs(results, "disaggregated"))]
        assert ratios[key]["rounds"] == pytest.approx(per_round)
        assert ratios[key]["median"] == pytest.approx(statistics.median(per_round))
        assert ratios[key]["range"] == pytest.approx([min(per_round), max(per_round)])
    pd._print(results)
    lines = capsys.readouterr().out.splitlines()
    [header] = [line for line in lines if line.startswith(f"c={LEVEL}")]
    assert header.split()[1:] == ["colocated", "disaggregated", "disagg", "/", "colocated"]
    for label in ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "requests/s", "outputs equal"):
        assert sum(line.startswith(label) for line in lines) == 1, label
    assert (folder / "pd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cores_are_parsed_from_ids_and_ranges_and_one_core_is_refused(capsys):
    assert pd.cores("0-2,5") == [0, 1, 2, 5]
    assert pd.cores("3") == [3]
    with pytest.raises(ValueError, match="like 0-3,6"):
        pd.cores("0-a")
    assert main(["bench", "pd", "--cores", "1"]) == 2
    assert "two cores or more" in capsys.readouterr().err
    assert main(["bench", "pd", "--concurrency", "0"]) == 2
    assert "--concurrency must be positive" in capsys.readouterr().err
