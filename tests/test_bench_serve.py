"""``flowkv bench serve`` at a tiny size: real ``vllm serve`` servers, vLLM's own client, the table.

Asserts the table's structure and the relations between its figures, never
a speed: two configurations (no connector, flowkv ``local-cpu``) at
concurrency 1 and 2, three documents asked twice each, vLLM's own prefix
cache off so that every reuse is flowkv's.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import tiny_model_dir  # noqa: E402

from flowkv.bench import serve  # noqa: E402
from flowkv.cli import main  # noqa: E402

pytestmark = pytest.mark.vllm

LEVELS = (1, 2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-serve")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = main(["bench", "serve", "--model-dir", str(tiny_model_dir()), "--configs", "none,local-cpu",
                       "--concurrency", ",".join(map(str, LEVELS)), "--docs", "3", "--asks", "2",
                       "--doc-tokens", "512", "--question-tokens", "16", "--output-tokens", "4",
                       "--pool-docs", "2", "--no-prefix-caching", "--keep-logs", str(logs), "--json"])
    assert status == 0
    return json.loads(buffer.getvalue())


def test_every_configuration_ran_every_level_and_completed_every_request(results):
    assert results["failed"] == {}
    assert list(results["median"]) == ["none", "local-cpu"]
    for rows in results["median"].values():
        assert sorted(int(level) for level in rows) == list(LEVELS)
        for row in rows.values():
            assert row["completed"] == 3 * 2 and row["failed"] == 0
            assert row["requests_per_s"] > 0
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
            assert row["itl_p50_ms"] > 0


def test_only_flowkv_serves_tokens_and_its_ratios_are_against_no_connector(results):
    for level, row in results["median"]["none"].items():
        assert row["flowkv_tokens"] == 0 and row["connector_tokens"] == 0
        assert row["requests_per_s_vs_none"] == pytest.approx(1.0)
    for level, row in results["median"]["local-cpu"].items():
        # Each document's second ask: at least one whole chunk came from flowkv, and vLLM counted it.
        assert row["flowkv_tokens"] >= 256
        assert row["connector_tokens"] >= row["flowkv_tokens"]
        none = results["median"]["none"][level]
        assert row["requests_per_s_vs_none"] == pytest.approx(row["requests_per_s"] / none["requests_per_s"])
        assert row["ttft_p99_vs_none"] == pytest.approx(row["ttft_p99_ms"] / none["ttft_p99_ms"])


def test_the_table_has_a_row_per_configuration_and_level(results, capsys):
    serve._print(json.loads(json.dumps(results)))
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("none", "local-cpu")]
    assert [(r[0], int(r[1])) for r in rows] == [(c, level) for c in ("none", "local-cpu") for level in LEVELS]
    assert "req/s" in lines[1] and "TTFT p99" in lines[1]
