"""``flowkv bench route`` at a tiny size: a real controller, two ``vllm serve`` (eager) and two
``flowkv route`` proxies (round-robin and by cached prefix), as the benchmark starts them.

Asserts the structure of its figures and the relations between them, never a speed: both modes
sent every request; the controller's clear between them left each mode cold, so each mode's hits
are whole documents of repeated asks, at most all but each document's first and at least one per
document under round-robin (three asks, two instances); the table follows from the figures.
"""

from __future__ import annotations

import json
import re

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import engine_processes, tiny_model_dir  # noqa: E402

from flowkv.bench import route  # noqa: E402
from flowkv.cli import main  # noqa: E402

pytestmark = pytest.mark.vllm

DOCUMENTS, DOC_TOKENS, REPEATS = 2, 512, 3  # a document: two chunks of local-cpu's
MODES = ["round-robin", "flowkv route"]


def test_both_modes_send_every_request_and_hit_only_whole_repeated_documents(capsys):
    argv = ["bench", "route", "--model-dir", str(tiny_model_dir()), "--documents", str(DOCUMENTS),
            "--doc-tokens", str(DOC_TOKENS), "--repeats", str(REPEATS), "--concurrency", "1", "--eager", "--json"]
    # vLLM's engine core runs the model itself (no worker process): a start ~10 s sooner (tests/vllm_server.py)
    with engine_processes(separate=False):
        assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    assert list(results) == MODES

    from transformers import AutoTokenizer

    from flowkv.integration.harness import QUESTIONS

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir()), local_files_only=True)
    prompt_tokens = DOC_TOKENS + len(tokenizer.encode(QUESTIONS[0], add_special_tokens=False))
    asks = DOCUMENTS * REPEATS
    for mode, figures in results.items():
        assert figures["requests"] == asks, mode
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"] and figures["requests_per_s"] > 0, mode
        assert 1 <= figures["backends_per_document"] <= 2, mode
        # A hit is a whole document (the question after it is computed); no document's first ask hits.
        hits = figures["hit_rate"] * asks * prompt_tokens / DOC_TOKENS
        assert hits == pytest.approx(round(hits)), (mode, figures)
        assert round(hits) <= asks - DOCUMENTS, (mode, figures)
    # Round-robin puts each document's three asks on two instances: one of them lands where it was.
    assert round(results["round-robin"]["hit_rate"] * asks * prompt_tokens / DOC_TOKENS) >= DOCUMENTS

    route._print_table({mode: {**figures, "ttfts_ms": []} for mode, figures in results.items()},
                       _namespace(argv))
    out = capsys.readouterr().out
    rows = re.findall(r"^(round-robin|flowkv route) +([\d.]+)% +(\d+)ms +(\d+)ms +([\d.]+) +([\d.]+)$", out, re.M)
    assert [row[0] for row in rows] == MODES, out
    for row in rows:
        figures = results[row[0]]
        assert row[1:] == (f"{figures['hit_rate']:.1%}"[:-1], f"{figures['ttft_p50_ms']:.0f}",
                           f"{figures['ttft_p99_ms']:.0f}", f"{figures['requests_per_s']:.2f}",
                           f"{figures['backends_per_document']:.2f}")


def _namespace(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    return parser.parse_args(argv[2:])
