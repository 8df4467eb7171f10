"""``flowkv bench ttft``'s other flowkv peers at a small size: ``flowkv async`` and ``flowkv disk``, and
``--via server`` (flowkv in this process, through a node server the benchmark starts, and vLLM's own
prefix cache, on the same prompts).

Engines in this process, eager (``engines_in_this_process``); the README's own ``bench ttft`` line
(no cache, flowkv, the floor, the in-tree peers) runs in ``test_readme_vllm_commands.py``. What must
hold whatever the machine's speed: a row per peer and length, a TTFT per prompt, every hit peer
serves the same whole blocks of a repeated prompt as a memory hit does (short of its last token),
no cache serves none, and every printed ratio follows from the printed times.
"""

from __future__ import annotations

import json
import re

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import tiny_model_dir  # noqa: E402

from flowkv.bench import ttft  # noqa: E402
from flowkv.cli import main  # noqa: E402

pytestmark = pytest.mark.vllm

LENGTHS = [300, 640]  # a prompt that ends inside a block, and one of whole blocks ending inside a chunk
REPEATS = 2
BLOCK = 128  # vLLM's block on CPU
NUMBER = r"\d+(?:\.\d+)?"




def bench_ttft(capsys, *extra: str) -> dict:
    argv = ["bench", "ttft", "--lengths", ",".join(map(str, LENGTHS)), "--repeats", str(REPEATS),
            "--model-dir", str(tiny_model_dir()), "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def hit_tokens(length: int) -> int:
    """What a connector (or vLLM's prefix cache) serves of a repeated prompt: its whole blocks, short
    of the last token (vLLM computes at least that one)."""
    return (length - 1) // BLOCK * BLOCK


def check_structure(report: dict, peers: list[str]) -> None:
    assert report["lengths"] == LENGTHS and report["repeats"] == REPEATS
    assert report["failed"] == {}
    assert list(report["ttft_s"]) == peers
    for name in peers:
        runs = report["ttft_runs_s"][name]
        assert [len(r) for r in runs] == [REPEATS] * len(LENGTHS), name
        for median, each in zip(report["ttft_s"][name], runs):
            assert min(each) <= median <= max(each) and min(each) > 0, name
    if "no cache" in peers:
        base = report["ttft_s"]["no cache"]
        for name in peers:
            speedups = [b / t for b, t in zip(base, report["ttft_s"][name])]
            assert report["speedup_vs_no_cache"][name] == pytest.approx(speedups)
        assert report["served_tokens"]["no cache"] == [0] * len(LENGTHS)
    else:
        assert "speedup_vs_no_cache" not in report


def test_async_and_disk_hits_serve_the_blocks_a_memory_hit_serves(capsys, own_environment, engines_in_this_process):
    peers = ["flowkv async", "flowkv disk"]
    report = bench_ttft(capsys, "--peers", ",".join(peers))
    check_structure(report, peers)
    # The memory hit loaded in its step, the same hit vLLM waits for between steps, and the hit that
    # a second vLLM (memory empty, files out of the page cache) reads from the first one's disk tier.
    for name in peers:
        assert report["served_tokens"][name] == [hit_tokens(n) for n in LENGTHS], name
    assert "vs_floor" not in report  # no floor run, no ratio to it
    ttft._print(report)
    out = capsys.readouterr().out
    # Without a no-cache run a cell is the median TTFT and its range, in ms.
    rows = re.findall(rf"^ +(\d+)((?: +\d+ \(\d+-\d+\))+)$", out, re.M)
    assert [int(length) for length, _ in rows] == LENGTHS, out
    for index, (_, cells) in enumerate(rows):
        medians = re.findall(r"(\d+) \(", cells)
        assert medians == [f"{report['ttft_s'][name][index] * 1e3:.0f}" for name in peers], out


def test_via_server_hits_through_the_node_server_serve_what_in_process_hits_serve(capsys, own_environment,
                                                                                  engines_in_this_process):
    report = bench_ttft(capsys, "--via", "server")
    peers = ["no cache", "flowkv in-process", "flowkv via server", "vLLM prefix cache"]
    check_structure(report, peers)
    for name in peers[1:]:
        assert report["served_tokens"][name] == [hit_tokens(n) for n in LENGTHS], name
    local, remote = report["ttft_s"]["flowkv in-process"], report["ttft_s"]["flowkv via server"]
    assert report["server_vs_in_process"] == pytest.approx([r / t for r, t in zip(remote, local)])
    floor = report["ttft_s"]["vLLM prefix cache"]
    assert set(report["vs_floor"]) == {"flowkv in-process", "flowkv via server"}
    for name, ratios in report["vs_floor"].items():
        assert ratios == pytest.approx([t / f for t, f in zip(report["ttft_s"][name], floor)])
    ttft._print(report)
    out = capsys.readouterr().out
    [line] = re.findall(r"^hit TTFT via server / in-process: (.*)$", out, re.M)
    assert line == ", ".join(f"{n}: {r:.2f}x" for n, r in zip(LENGTHS, report["server_vs_in_process"]))


def test_a_length_past_the_models_positions_is_refused_before_an_engine_starts(capsys, own_environment):
    """The limit is the model's own (the tiny model: 8,192 positions), not the demo model's."""
    assert main(["bench", "ttft", "--lengths", "1024,8192", "--model-dir", str(tiny_model_dir()), "--json"]) == 2
    err = capsys.readouterr().err
    assert "--lengths must be at most 8176 tokens" in err and "(8192 positions, 16 kept for the answer)" in err
    assert main(["bench", "ttft", "--lengths", "0"]) == 2
    assert "--lengths must be positive token counts" in capsys.readouterr().err
