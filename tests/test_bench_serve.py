"""``flowkv bench serve`` at a tiny size: real ``vllm serve`` servers, vLLM's own client, the table.

Asserts the table's structure and the relations between its figures, never
a speed: three configurations (no connector, the ceiling — vLLM's pool
holding every document —, flowkv ``local-cpu``) at concurrency 2, eager, in
one round (a server each: ~30 s), three documents asked twice each, vLLM's own
prefix cache off (but for the ceiling, which is that cache) so that every other
reuse is flowkv's. The medians and ranges over several rounds are checked on
made-up rounds in tests/test_bench_serve_table.py, without servers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import socket

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import engine_processes, tiny_model_dir  # noqa: E402

from flowkv.bench import serve  # noqa: E402
from flowkv.cli import main  # noqa: E402

pytestmark = pytest.mark.vllm

LEVELS = (2,)  # one level: its rows, ratios and ranges are what the table has at every level
ROUNDS = 1
CONFIGS = ("none", "ceiling", "local-cpu")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-serve")
    buffer = io.StringIO()
    # vLLM's engine core runs the model itself (no worker process): a start ~10 s sooner (tests/vllm_server.py)
    with contextlib.redirect_stdout(buffer), engine_processes(separate=False):
        status = main(["bench", "serve", "--model-dir", str(tiny_model_dir()), "--configs", ",".join(CONFIGS),
                       "--concurrency", ",".join(map(str, LEVELS)), "--repeats", str(ROUNDS), "--docs", "3", "--asks", "2",
                       "--doc-tokens", "512", "--question-tokens", "16", "--output-tokens", "4",
                       "--pool-docs", "2", "--no-prefix-caching", "--eager", "--keep-logs", str(logs), "--json"])
    assert status == 0
    return json.loads(buffer.getvalue())


def test_every_configuration_ran_every_level_and_completed_every_request(results):
    assert results["failed"] == {}
    assert list(results["median"]) == list(CONFIGS)
    for config, rows in results["median"].items():
        assert sorted(int(level) for level in rows) == list(LEVELS)
        for level, row in rows.items():
            runs = results["runs"][config][level]
            assert len(runs) == ROUNDS
            spread = results["range"][config][level]
            for key in ("requests_per_s", "ttft_p99_ms", "itl_p50_ms"):
                # the median of the rounds, within their range
                assert spread[key] == [min(r[key] for r in runs), max(r[key] for r in runs)]
                assert spread[key][0] <= row[key] <= spread[key][1]
            assert row["completed"] == 3 * 2 and row["failed"] == 0
            assert row["requests_per_s"] > 0
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
            assert row["itl_p50_ms"] > 0


def test_only_flowkv_serves_tokens_and_its_ratios_are_against_no_connector(results):
    for config in ("none", "ceiling"):
        for level, row in results["median"][config].items():
            assert row["flowkv_tokens"] == 0 and row["connector_tokens"] == 0
            assert row[f"requests_per_s_vs_{config}"] == pytest.approx(1.0)
    for level, row in results["median"]["local-cpu"].items():
        # Each document's second ask: at least one whole chunk came from flowkv, and vLLM counted it.
        assert row["flowkv_tokens"] >= 256
        assert row["connector_tokens"] >= row["flowkv_tokens"]
        none = results["median"]["none"][level]
        assert row["requests_per_s_vs_none"] == pytest.approx(row["requests_per_s"] / none["requests_per_s"])
        assert row["ttft_p99_vs_none"] == pytest.approx(row["ttft_p99_ms"] / none["ttft_p99_ms"])
        ceiling = results["median"]["ceiling"][level]
        assert row["requests_per_s_vs_ceiling"] == pytest.approx(row["requests_per_s"] / ceiling["requests_per_s"])
        assert row["ttft_p99_vs_ceiling"] == pytest.approx(row["ttft_p99_ms"] / ceiling["ttft_p99_ms"])
        assert row["itl_p50_vs_none"] == pytest.approx(row["itl_p50_ms"] / none["itl_p50_ms"])


def test_the_table_has_a_row_per_configuration_and_level(results, capsys):
    serve._print(json.loads(json.dumps(results)))
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0] in CONFIGS]
    assert [(r[0], int(r[1])) for r in rows] == [(c, level) for c in CONFIGS for level in LEVELS]
    assert "req/s" in lines[1] and "TTFT p99" in lines[1] and "x ceil" in lines[1]
    for r in rows:  # req/s, then its range over the rounds
        low, high = (float(x) for x in r[3].split("-"))
        assert low <= float(r[2]) <= high


def test_vllms_client_runs_in_this_process_its_output_in_its_log_and_a_failure_names_that_log(tmp_path, capsys):
    """``serve.client`` runs ``vllm bench serve`` here (no interpreter per run): what it prints and logs
    goes to the run's log, never to the benchmark's own output (its ``--json``); the heap it freezes
    is unfrozen; an error stops the run as ``ClientFailed``, which names the log."""
    workload = argparse.Namespace(doc_tokens=64, question_tokens=8, docs=1, asks=1, output_tokens=2)
    with socket.socket() as closed:  # a port nothing listens on: every request fails, the run ends
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    result = serve.client(url, workload, model=tiny_model_dir(), concurrency=1, seed=0,
                          result_file=tmp_path / "run.json")
    assert (result["completed"], result["failed"]) == (0, 1)
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    assert "Serving Benchmark Result" in (tmp_path / "run.log").read_text()
    assert gc.get_freeze_count() == 0

    with pytest.raises(serve.ClientFailed, match=r"--max-concurrency must be greater than 0.*bad\.log"):
        serve.client(url, workload, model=tiny_model_dir(), concurrency=0, seed=0, result_file=tmp_path / "bad.json")
