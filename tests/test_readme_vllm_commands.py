"""The README's vLLM commands, run through the CLI at small sizes: ``flowkv demo`` (and ``--layerwise``),
``flowkv trace summarize`` / ``timeline`` on the trace the demo wrote, and ``flowkv bench ttft``.

Nothing here is held to a time limit, nor to a speed: how much faster warm
is than cold, and how close to the floor (vLLM's own prefix cache on the same
prompts), is what the demo and ``bench ttft`` print as ratios. What must hold
whatever the machine's speed: the table has a row per request, cold requests
are served nothing and warm ones whole chunks of their document, vLLM's own
cache serves at least those on the floor run; every printed mean, ratio and
total follows from the printed rows. ``flowkv quality`` and ``bench capacity`` run in
``test_quality.py`` and ``test_bench_capacity.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import tiny_model_dir  # noqa: E402

from flowkv.cli import main  # noqa: E402

pytestmark = pytest.mark.vllm

DOCUMENTS = 2
DOC_TOKENS = 1500
CHUNK = 256  # local-cpu's chunk
BLOCK = 128  # vLLM's default block on CPU
NUMBER = r"\d+(?:\.\d+)?"




@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_demo_table_follows_from_its_rows_and_its_trace_summarizes(layerwise, tmp_path, capsys, own_environment,
                                                                  engines_in_this_process):
    traces = tmp_path / "traces"
    model = tiny_model_dir()
    argv = ["demo", "--documents", str(DOCUMENTS), "--doc-tokens", str(DOC_TOKENS), "--traces", str(traces),
            "--model-dir", str(model)]
    before = (model / "model.safetensors").read_bytes()
    assert main(argv + (["--layerwise"] if layerwise else [])) == 0
    out = capsys.readouterr().out
    assert (model / "model.safetensors").read_bytes() == before  # the model it was given, not rebuilt

    rows = re.findall(r"^ *(\d+) +(\d+) +(cold|warm) +(\d+) +(\d+) +([\d.]+) +([\d.]+) +(\d+)$", out, re.M)
    assert [(int(d), int(q), kind) for d, q, kind, *_ in rows] == [
        (doc, question, "cold" if question == 1 else "warm") for doc in range(DOCUMENTS) for question in (1, 2)
    ], out
    cold = [r for r in rows if r[2] == "cold"]
    warm = [r for r in rows if r[2] == "warm"]
    for _, _, _, prompt, served, _, _, _ in cold:
        assert int(served) == 0 and int(prompt) > DOC_TOKENS
    for _, _, _, prompt, served, _, _, floor_served in warm:
        # The document's whole chunks (and no more than the prompt shares with the cold one), in whole blocks.
        assert DOC_TOKENS // CHUNK * CHUNK <= int(served) < int(prompt), out
        assert int(served) % BLOCK == 0 and int(served) % CHUNK == 0
        # vLLM's own prefix cache (the floor) serves the shared prefix in whole blocks: at least flowkv's chunks.
        assert int(served) <= int(floor_served) < int(prompt) and int(floor_served) % BLOCK == 0, out
    cold_ms = sum(float(r[5]) for r in cold) / len(cold)
    warm_ms = sum(float(r[5]) for r in warm) / len(warm)
    alone_ms = sum(float(r[6]) for r in cold) / len(cold)
    floor_ms = sum(float(r[6]) for r in warm) / len(warm)

    printed_cold = re.search(r"^TTFT cold \(mean\): +([\d.]+) ms", out, re.M).group(1)
    printed_warm, faster = re.search(r"^TTFT warm \(mean\): +([\d.]+) ms +\(([\d.]+)x faster\)", out, re.M).groups()
    # Means of rows printed to 0.1 ms: within that rounding of the printed means.
    assert abs(float(printed_cold) - cold_ms) <= 0.1 and abs(float(printed_warm) - warm_ms) <= 0.1
    # The speed-up, to 0.1: the quotient of the two means (each printed to 0.1 ms).
    pc, pw = float(printed_cold), float(printed_warm)
    assert (pc - 0.05) / (pw + 0.05) - 0.05 <= float(faster) <= (pc + 0.05) / (pw - 0.05) + 0.05, out
    printed_alone, storing = re.search(r"^vLLM alone, cold \(mean\): +([\d.]+) ms +\(cold with flowkv storing: "
                                       r"([\d.]+)x\)", out, re.M).groups()
    printed_floor, over_floor = re.search(r"^TTFT floor \(mean\): +([\d.]+) ms +\(vLLM's own prefix cache, same "
                                          r"prompts; warm / floor ([\d.]+)x\)", out, re.M).groups()
    assert abs(float(printed_alone) - alone_ms) <= 0.1 and abs(float(printed_floor) - floor_ms) <= 0.1
    # Ratios to 0.01 of means of rows printed to 0.1 ms.
    assert (cold_ms - 0.05) / (alone_ms + 0.05) - 0.005 <= float(storing) <= (cold_ms + 0.05) / (alone_ms - 0.05) + 0.005
    assert (warm_ms - 0.05) / (floor_ms + 0.05) - 0.005 <= float(over_floor) <= (warm_ms + 0.05) / (floor_ms - 0.05) + 0.005
    served, total = (int(x) for x in re.search(r"^tokens served by flowkv: +(\d+) of (\d+) prompt tokens", out,
                                               re.M).groups())
    assert served == sum(int(r[4]) for r in rows) and total == sum(int(r[3]) for r in rows)
    assert float(re.search(r"^lookup hit rate \(tokens\): +([\d.]+) %", out, re.M).group(1)) > 0
    stored = int(re.search(r"^flowkv store time \(total\): +[\d.]+ ms for (\d+) tokens", out, re.M).group(1))
    retrieved = int(re.search(r"^flowkv retrieve time \(total\): *[\d.]+ ms for (\d+) tokens", out, re.M).group(1))
    assert retrieved == served  # what flowkv loaded is what vLLM counted as cached
    assert stored >= DOCUMENTS * (DOC_TOKENS // CHUNK) * CHUNK

    # The trace it names, through `flowkv trace summarize` and `timeline`.
    [trace] = re.findall(r"^trace: (\S+)", out, re.M)
    assert Path(trace).parent == traces and Path(trace).exists()
    assert main(["trace", "summarize", trace]) == 0
    summary = capsys.readouterr().out
    for stage in ("gather", "scatter", "lookup"):
        assert stage in summary, summary
    if layerwise:
        assert "overlap" in summary.lower(), summary
    page = tmp_path / "timeline.html"
    assert main(["trace", "timeline", trace, "-o", str(page)]) == 0
    assert page.stat().st_size > 0 and "scatter" in page.read_text()


def test_bench_ttft_speedups_are_the_ratios_of_its_times(capsys, own_environment, engines_in_this_process):
    lengths = [512, 1024]  # two lengths, each over a block boundary: what the table has at every length
    peers = "no cache,vLLM prefix cache,flowkv,ExampleConnector,OffloadingConnector,SimpleCPUOffloadConnector"
    argv = ["bench", "ttft", "--lengths", ",".join(map(str, lengths)), "--repeats", "1", "--peers", peers,
            "--model-dir", str(tiny_model_dir()), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lengths"] == lengths
    ran = list(report["ttft_s"])
    assert ran[:4] == ["no cache", "vLLM prefix cache", "flowkv", "ExampleConnector"], report
    # The peers vLLM cannot start on CPU are reported, not fatal (or run, where they can).
    assert set(ran[4:]) | set(report["failed"]) == {"OffloadingConnector", "SimpleCPUOffloadConnector"}
    base = report["ttft_s"]["no cache"]
    for name in ran:
        assert report["speedup_vs_no_cache"][name] == pytest.approx([b / t for b, t in zip(base, report["ttft_s"][name])])
    # Every connector's hit against the floor (vLLM's own prefix cache on the same prompts).
    floor = report["ttft_s"]["vLLM prefix cache"]
    assert set(report["vs_floor"]) == set(ran) - {"no cache", "vLLM prefix cache"}
    for name, ratios in report["vs_floor"].items():
        assert ratios == pytest.approx([t / f for t, f in zip(report["ttft_s"][name], floor)])
    assert report["served_tokens"]["no cache"] == [0, 0]
    # A repeated prompt: flowkv serves its whole chunks, in whole blocks, short of the last token;
    # vLLM's prefix cache serves the same blocks from its own pool.
    assert report["served_tokens"]["flowkv"] == [(n - 1) // BLOCK * BLOCK for n in lengths]
    assert report["served_tokens"]["vLLM prefix cache"] == report["served_tokens"]["flowkv"]
    # (How much faster a hit is than a prefill, and how close to the floor, is the benchmark's
    # printed ratios, not an assertion: see the README's measured figures.)

    from flowkv.bench import ttft

    ttft._print(report)  # the table of the same figures
    out = capsys.readouterr().out
    assert re.search(r"^hit TTFT / the floor \(vLLM prefix cache, same prompts\):$", out, re.M), out
    assert re.search(rf"^  flowkv +512: {NUMBER}x, 1024: {NUMBER}x$", out, re.M), out
