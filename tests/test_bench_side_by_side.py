"""``flowkv bench side-by-side``: its table from rounds made up here (medians, ratios taken within a
round, tokens served, greedy tokens compared), and a run for real at a tiny size: every configuration
in a process of its own, each round of each, the hits served, the traced transfer stages, and the
LMCache row saying why it did not run where its environment is missing."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from flowkv.bench import rounds, sidebyside


def an_answer(round1_ms: list[float], round2_ms: list[float], *, cached: int, tokens: list[int]) -> dict:
    def asked(times: list[float], cached_tokens: int, offset: int) -> list[dict]:
        return [{"ttft_s": ms / 1e3, "cached_tokens": cached_tokens, "token": tokens[offset + i]}
                for i, ms in enumerate(times)]

    return {"rounds": [asked(round1_ms, 0, 0), asked(round2_ms, cached, len(round1_ms))], "start_s": 3.0}


TOKENS = [5, 6, 7, 8]
RUNS = {
    "floor": [an_answer([500, 520], [20, 22], cached=512, tokens=TOKENS),
              an_answer([900, 1000], [40, 42], cached=512, tokens=TOKENS)],
    "no connector": [an_answer([600, 640], [590, 600], cached=0, tokens=TOKENS),
                     an_answer([1200, 1280], [1000, 1200], cached=0, tokens=TOKENS)],
    "local-cpu": [an_answer([630, 650], [30, 34], cached=512, tokens=[5, 6, 7, 9]),
                  an_answer([1260, 1300], [44, 48], cached=384, tokens=TOKENS)],
    "node": [None, an_answer([1300, 1340], [60, 62], cached=512, tokens=TOKENS)],
}


def summarized(runs: dict) -> dict:
    results = {"workload": json.loads(rounds.Workload(docs=2, doc_tokens=512).to_json()), "configs": list(runs),
               "repeats": 2, "runs": runs, "failed": {}, "load": [1.5, 2.5], "copy_gbps": []}
    sidebyside.summarize(results)
    return results


def test_each_round_is_its_median_request_and_the_table_the_median_round():
    rows = summarized(RUNS)["rows"]
    assert rows["floor"]["round1_s"] == pytest.approx([0.73, 0.51, 0.95])
    assert rows["floor"]["round2_s"] == pytest.approx([0.031, 0.021, 0.041])
    assert rows["local-cpu"]["runs"] == 2 and rows["node"]["runs"] == 1
    assert rows["node"]["round2_s"] == pytest.approx([0.061, 0.061, 0.061])


def test_ratios_are_taken_within_a_round_then_their_median():
    rows = summarized(RUNS)["rows"]
    # round 1 against no connector: 640/620 and 1280/1240, both 1.032
    assert rows["local-cpu"]["round1_vs_no_connector"] == pytest.approx([640 / 620, 640 / 620, 1280 / 1240])
    # round 2 against the floor: 32/21 in the first round, 46/41 in the second; their median is their mean
    hit = [32 / 21, 46 / 41]
    assert rows["local-cpu"]["round2_vs_floor"] == pytest.approx([sum(hit) / 2, min(hit), max(hit)])
    # node ran in the second round only: its ratio to local-cpu is that round's
    assert rows["node"]["round2_vs_local-cpu"] == pytest.approx([61 / 46] * 3)
    assert rows["no connector"]["round1_vs_no_connector"] is None
    assert rows["floor"]["round2_vs_floor"] is None


def test_tokens_from_cache_are_the_fewest_of_round_2_and_greedy_tokens_are_compared_request_by_request():
    rows = summarized(RUNS)["rows"]
    assert rows["local-cpu"]["cached_tokens"] == 384
    assert rows["no connector"]["cached_tokens"] == 0
    assert rows["local-cpu"]["tokens_equal"] == [7, 8]  # the first round's fourth token differs
    assert rows["node"]["tokens_equal"] == [4, 4]


def test_the_printed_rows_carry_the_figures():
    results = summarized(RUNS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        sidebyside._print(results)
    text = out.getvalue()
    assert "load average 1.50-2.50" in text
    [row] = [line for line in text.splitlines() if line.startswith("local-cpu |")]
    assert row.split(" | ") == ["local-cpu", "960.0 (640-1280)", "1.03x [1.03-1.03]", "39.0 (32-46)",
                                "1.32x [1.12-1.52]", "384", "7/8"]
    [node] = [line for line in text.splitlines() if line.startswith("node |")]
    assert "1.33x [1.33-1.33] local-cpu" in node


def test_the_workload_is_the_same_for_every_process_and_the_pool_is_sized_in_documents():
    workload = rounds.Workload(docs=3, doc_tokens=300, question_tokens=8, vocab=100, pool_docs=1.5)
    again = rounds.Workload.from_json(workload.to_json())
    assert again == workload
    assert again.prompt(1, 0) == workload.prompt(1, 0) and len(workload.prompt(1, 0)) == 308
    assert workload.prompt(1, 0)[:300] == workload.prompt(1, 1)[:300]  # the same document
    assert workload.question(1, 0) != workload.question(1, 1) and workload.document(0) != workload.document(1)
    assert min(workload.prompt(2, 1)) >= 16 and max(workload.prompt(2, 1)) < 100
    assert workload.pool_bytes(1000) == int(1.5 * (300 + 8 + rounds.ROOM) * 1000)
    assert workload.pool_bytes(1000, floor=True) == 4 * (300 + 8 + rounds.ROOM) * 1000


@pytest.mark.parametrize("argv, why", [
    (["--configs", "floor,lmcache"], "--configs takes"),
    (["--pool-docs", "8"], "--pool-docs must be"),
    (["--pool-docs", "0.5"], "--pool-docs must be"),
    (["--repeats", "0"], "--repeats must be positive"),
])
def test_bad_options_are_refused_before_anything_starts(capsys, argv, why):
    from flowkv.cli import main

    assert main(["bench", "side-by-side", *argv]) == 2
    assert why in capsys.readouterr().err


STAND_IN_PEER = """#!{python}
# Stands in for LMCache's Python: answers the rounds as examples/peers/lmcache_mp_ttft.py does, and says
# what it was run with.
import json, os, sys
args = sys.argv[1:]
workload = json.loads(open(args[args.index("--rounds") + 1]).read())
asked = [{{"ttft_s": 0.5, "cached_tokens": 0, "token": 1}} for _ in range(workload["docs"])]
print("vLLM would log here")
print(json.dumps({{"rounds": [asked, asked], "start_s": 1.0, "argv": args, "pythonpath": os.environ.get("PYTHONPATH")}}))
"""


def test_the_lmcache_row_runs_the_peer_script_with_its_own_python_and_nothing_of_this_tree_on_its_path(
        capsys, tmp_path, monkeypatch, own_environment):
    import sys

    from flowkv.cli import main

    python = tmp_path / "python"
    python.write_text(STAND_IN_PEER.format(python=sys.executable))
    python.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert main(["bench", "side-by-side", "--configs", "LMCache MP", "--docs", "3", "--repeats", "2",
                 "--model-dir", str(model), "--lmcache-python", str(python), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["failed"] == {} and results["rows"]["LMCache MP"]["runs"] == 2
    assert results["rows"]["LMCache MP"]["round2_s"] == [0.5, 0.5, 0.5]
    for answer in results["runs"]["LMCache MP"]:
        assert answer["pythonpath"] is None
        script, *rest = answer["argv"]
        assert script == str(sidebyside.PEER_SCRIPT) and sidebyside.PEER_SCRIPT.exists()
        assert rest[0] == "--rounds" and rest[2:] == ["--model-dir", str(model)]


@pytest.mark.vllm
def test_a_tiny_table_for_real(capsys, tmp_path, own_environment, engines_in_this_process):
    import vllm  # noqa: F401 - a broken vLLM install fails this test; it never skips it
    from vllm_helpers import tiny_model_dir

    from flowkv.cli import main

    configs = ["floor", "no connector", "local-cpu", "LMCache MP"]
    argv = ["bench", "side-by-side", "--docs", "2", "--doc-tokens", "256", "--question-tokens", "8",
            "--pool-docs", "1", "--repeats", "1", "--configs", ",".join(configs), "--model-dir", str(tiny_model_dir()),
            "--lmcache-python", str(tmp_path / "no-such-python"), "--trace", str(tmp_path / "traces"), "--eager",
            "--json"]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    rows = results["rows"]
    assert list(rows) == configs and len(results["load"]) == len(configs)
    [why] = set(results["failed"]["LMCache MP"])
    assert "no LMCache environment" in why and rows["LMCache MP"]["runs"] == 0
    assert set(results["failed"]) == {"LMCache MP"}
    for name in configs[:3]:
        assert rows[name]["runs"] == 1, name
        [answer] = results["runs"][name]
        assert [len(asked) for asked in answer["rounds"]] == [2, 2], name
        assert rows[name]["tokens_equal"][1] == 4, name  # both rounds' requests
    # Round 2 asks each document again after another question: the floor's prefix cache and flowkv serve
    # its two whole blocks; with vLLM's prefix cache off and no connector, nothing is.
    assert rows["floor"]["cached_tokens"] == 256 and rows["local-cpu"]["cached_tokens"] == 256
    assert rows["no connector"]["cached_tokens"] == 0
    assert [asked["cached_tokens"] for asked in results["runs"]["local-cpu"][0]["rounds"][0]] == [0, 0]
    # The traced configuration's transfer stages, against the copies this process measured.
    assert len(results["copy_gbps"]) == 1
    stages = results["transfers"]["local-cpu"]
    assert {"store/gather", "retrieve/scatter"} <= set(stages)
    for cell in stages.values():
        assert cell["gbps"][1] <= cell["gbps"][0] <= cell["gbps"][2]
        assert cell["x_copy"] == pytest.approx(cell["gbps"][0] / results["transfers"]["copy_gbps"][0])


KILLED_PEER = """#!{python}
# Stands in for a configuration's process killed with -9 in the middle of its rounds: it starts a process of
# its own group first (as vLLM's engine core and workers are), says which, and is killed before answering.
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open({pid_file!r}, "w").write(str(child.pid))
print("round 1 of 2 under way", flush=True)
time.sleep(0.2)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_configuration_killed_mid_run_is_a_failed_round_and_leaves_no_process_of_its_group(
        capsys, tmp_path, own_environment):
    """A configuration's process killed with SIGKILL mid-run: its rounds are reported failed with the exit
    status, the table still prints, and what it started in its process group is stopped with it."""
    import signal
    import sys

    from flowkv.cli import main

    pid_file = tmp_path / "engine.pid"
    python = tmp_path / "python"
    python.write_text(KILLED_PEER.format(python=sys.executable, pid_file=str(pid_file)))
    python.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    assert main(["bench", "side-by-side", "--configs", "LMCache MP", "--docs", "3", "--repeats", "2",
                 "--model-dir", str(model), "--lmcache-python", str(python), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    why = results["failed"]["LMCache MP"]
    assert len(why) == 2 and all(w.startswith(f"exit {-signal.SIGKILL}") for w in why), why
    assert results["rows"]["LMCache MP"]["runs"] == 0 and results["runs"]["LMCache MP"] == [None, None]
    # Stopped with its group, not left running: gone, or dead and waiting for init (its parent was
    # killed) to reap it.
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
