"""``flowkv bench serve``'s and ``bench pd``'s tables from rounds made up here: medians, ranges, ratios and
the printed rows, without a server (tests/test_bench_serve.py and test_bench_pd.py run one round for real)."""

from __future__ import annotations

import contextlib
import io

import pytest

from flowkv.bench import pd, serve


def a_round(requests_per_s: float, ttft_p99_ms: float, itl_p50_ms: float, *, flowkv_tokens: int = 0) -> dict:
    return {"requests_per_s": requests_per_s, "ttft_p50_ms": ttft_p99_ms / 2, "ttft_p99_ms": ttft_p99_ms,
            "itl_p50_ms": itl_p50_ms, "completed": 6, "failed": 0, "flowkv_tokens": flowkv_tokens,
            "connector_tokens": flowkv_tokens}


def results_of(runs: dict) -> dict:
    results = {"runs": {}, "median": {}, "failed": {},
               "workload": {"docs": 3, "asks": 2, "doc_tokens": 512, "question_tokens": 16, "output_tokens": 4,
                            "pool_docs": 2, "memory_docs": 8, "repeats": 3, "vllm_prefix_caching": False}}
    serve.summarize(results, runs)
    return results


RUNS = {
    "none": {2: [a_round(1.0, 300, 20), a_round(3.0, 100, 40), a_round(2.0, 200, 30)]},
    "ceiling": {2: [a_round(4.0, 50, 20), a_round(4.0, 70, 22), a_round(6.0, 60, 21)]},
    "local-cpu": {2: [a_round(3.0, 90, 25, flowkv_tokens=512), a_round(2.5, 80, 26, flowkv_tokens=512),
                      a_round(3.5, 100, 24, flowkv_tokens=768)]},
}


def test_the_median_of_each_figure_over_the_rounds_within_its_range():
    results = results_of(RUNS)
    assert results["median"]["none"][2]["requests_per_s"] == 2.0
    assert results["median"]["none"][2]["ttft_p99_ms"] == 200
    assert results["median"]["local-cpu"][2]["flowkv_tokens"] == 512
    assert results["range"]["none"][2] == {"requests_per_s": [1.0, 3.0], "ttft_p99_ms": [100, 300],
                                           "itl_p50_ms": [20, 40]}
    assert results["range"]["ceiling"][2]["requests_per_s"] == [4.0, 6.0]
    assert results["runs"]["local-cpu"][2] == RUNS["local-cpu"][2]


def test_ratios_are_between_medians_at_the_same_concurrency():
    row = results_of(RUNS)["median"]["local-cpu"][2]
    assert row["requests_per_s_vs_none"] == pytest.approx(3.0 / 2.0)
    assert row["ttft_p99_vs_none"] == pytest.approx(90 / 200)
    assert row["itl_p50_vs_none"] == pytest.approx(25 / 30)
    assert row["requests_per_s_vs_ceiling"] == pytest.approx(3.0 / 4.0)
    assert row["ttft_p99_vs_ceiling"] == pytest.approx(90 / 60)
    none = results_of(RUNS)["median"]["none"][2]
    assert none["requests_per_s_vs_none"] == pytest.approx(1.0)


def test_a_configuration_without_a_whole_round_is_left_out_and_the_others_keep_their_ratios():
    results = results_of({"none": RUNS["none"], "local-cpu": {2: []}, "ceiling": {}})
    assert list(results["median"]) == ["none"]
    assert "requests_per_s_vs_ceiling" not in results["median"]["none"][2]


def test_the_printed_table_has_a_row_per_configuration_with_its_median_and_range():
    out = io.StringIO()
    results = results_of(RUNS)
    results["failed"] = {"cpu-disk": "at concurrency 2: the server died"}
    with contextlib.redirect_stdout(out):
        serve._print(results)
    lines = out.getvalue().splitlines()
    assert "median and range of 3 round(s)" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[3:6]}
    assert list(rows) == ["none", "ceiling", "local-cpu"]
    assert rows["none"][1:4] == ["2", "2.00", "1.00-3.00"]
    assert rows["local-cpu"][2:6] == ["3.00", "2.50-3.50", "1.50x", "0.75x"]
    assert rows["local-cpu"][-2:] == ["512", "6"]
    assert lines[-1] == "cpu-disk: failed: at concurrency 2: the server died"


def a_pd_round(ttft_ms: float, itl_ms: float, requests_per_s: float) -> dict:
    return {"ttft_p50_ms": ttft_ms / 2, "ttft_p99_ms": ttft_ms, "itl_p50_ms": itl_ms, "itl_p99_ms": 2 * itl_ms,
            "requests_per_s": requests_per_s, "completed": 6}


def test_pd_medians_ranges_and_the_median_of_each_rounds_disaggregated_over_colocated():
    results = {"runs": {"colocated": {2: [a_pd_round(100, 10, 2.0), a_pd_round(300, 30, 1.0),
                                          a_pd_round(200, 20, 4.0)]},
                        "disaggregated": {2: [a_pd_round(300, 20, 1.0), a_pd_round(150, 30, 3.0),
                                              a_pd_round(100, 10, 2.0)]}},
               "ratios": {}}
    pd._summarize(results)
    assert results["median"]["colocated"][2]["ttft_p99_ms"] == 200
    assert results["median"]["disaggregated"][2]["ttft_p99_ms"] == 150
    assert results["range"]["disaggregated"][2]["ttft_p99_ms"] == [100, 300]
    # Each round's disaggregated / colocated (the two ran back to back), then their median: 0.5, not the
    # ratio of the medians (0.75).
    assert results["ratios"][2]["ttft_p99_ms"] == {"median": 0.5, "range": [0.5, 3.0], "rounds": [3.0, 0.5, 0.5]}
    assert results["ratios"][2]["requests_per_s"] == {"median": 0.5, "range": [0.5, 3.0], "rounds": [0.5, 3.0, 0.5]}


GROUP_THAT_IGNORES_SIGTERM = """
import signal, subprocess, sys, time
# A member that ignores SIGTERM (as a busy engine process may take its time): only SIGKILL stops it.
subprocess.Popen([sys.executable, "-c",
                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(600)"])
time.sleep(600)
"""


def test_stop_group_returns_once_no_member_of_the_group_is_running():
    """``stop_group`` sends signals and then waits until they took effect: when it returns, nothing of the
    group still runs (the next configuration does not start beside a process tearing down its memory)."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", GROUP_THAT_IGNORES_SIGTERM], start_new_session=True)
    deadline = time.monotonic() + 60
    while len(serve.group_running(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = serve.group_running(proc.pid)
    assert proc.pid in members and len(members) == 2, members
    serve.stop_group(proc, timeout_s=0.5)
    assert serve.group_running(proc.pid) == []
    assert proc.returncode == -15  # the leader took SIGTERM


def test_servers_started_side_by_side_are_all_stopped_when_one_fails_to_come_up(tmp_path):
    """``start_side_by_side`` launches every server before it waits for any; one that exits before it answers
    raises with its log's tail, and the stack stops every process it launched."""
    import contextlib
    import sys

    servers = [serve.Server(tmp_path, tmp_path, transfer=None, pool_bytes=1, max_model_len=1, name=name)
               for name in ("slow", "broken")]
    servers[0].command = [sys.executable, "-c", "import time; time.sleep(600)"]
    servers[1].command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="no model here"):
        with contextlib.ExitStack() as stack:
            serve.start_side_by_side(stack, servers)
    assert servers[1].proc.returncode == 3
    assert servers[0].proc.returncode is not None and serve.group_running(servers[0].proc.pid) == []
