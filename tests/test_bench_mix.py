"""``flowkv bench mix`` at a tiny size: one real ``vllm serve`` (eager), ``async_loads = auto`` (the
default: disk hits load while the batch goes on). A setting costs a server start (~40 s here with its
workload); the loop over settings adds nothing the one setting does not run, so one is measured.

Asserts the structure of its figures and the relations between them, never a speed: a row per
setting; every phase sent the requests it was given; every request after the warm-up
was a hit of its whole document, the memory documents' and the disk documents' alike (the
disk ones were pushed out of memory first), and each ratio follows from the TTFTs beside it.
"""

from __future__ import annotations

import json
import re

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import engine_processes, tiny_model_dir  # noqa: E402

from flowkv.bench import mix  # noqa: E402
from flowkv.cli import main  # noqa: E402

pytestmark = pytest.mark.vllm

SETTINGS = ("auto",)
DOC_TOKENS = 256  # one chunk of cpu-disk's
MEMORY_CLIENTS, DISK_CLIENTS, REQUESTS = 1, 1, 2
DISK_DOCS = 4 * DISK_CLIENTS + 2  # the fewest the benchmark takes
# Memory holds the memory document and 2 x DISK_CLIENTS + 1 others: the newest disk documents
# stay there, the rest are asked from disk.
FROM_DISK = DISK_DOCS - (2 * DISK_CLIENTS + 1)


def test_a_row_per_setting_every_request_sent_and_every_document_a_hit(capsys):
    argv = ["bench", "mix", "--model-dir", str(tiny_model_dir()), "--async-loads", ",".join(SETTINGS),
            "--memory-docs", "1", "--disk-docs", str(DISK_DOCS), "--doc-tokens", str(DOC_TOKENS),
            "--memory-clients", str(MEMORY_CLIENTS), "--disk-clients", str(DISK_CLIENTS),
            "--requests", str(REQUESTS), "--output-tokens", "2", "--eager", "--json"]
    # vLLM's engine core runs the model itself (no worker process): a start ~10 s sooner (tests/vllm_server.py)
    with engine_processes(separate=False):
        assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["settings"]
    assert [row["async_loads"] for row in rows] == list(SETTINGS)
    for row in rows:
        memory_requests = MEMORY_CLIENTS * REQUESTS
        assert row["requests"] == {"memory_alone": memory_requests, "memory_with_disk": memory_requests,
                                   "disk": FROM_DISK}
        # The warm-up stored every document (no hit: each new); after it, each request (a document
        # and a question of its own) got its document back from flowkv, from memory or from disk.
        assert row["flowkv_tokens"] == (2 * memory_requests + FROM_DISK) * DOC_TOKENS, row
        for phase in ("memory_alone", "memory_with_disk", "disk"):
            assert 0 < row[f"{phase}_p50_ms"] <= row[f"{phase}_p99_ms"], (phase, row)
        assert row["memory_p99_ratio"] == pytest.approx(row["memory_with_disk_p99_ms"] / row["memory_alone_p99_ms"])

    mix._print(result)  # the table of the same figures: a row per setting, each cell its figure
    out = capsys.readouterr().out
    table = re.findall(r"^(\w+) +(\d+)ms +(\d+)ms +(\d+)ms +(\d+)ms +(\d+\.\d\d)x +(\d+)ms +(\d+)ms$", out, re.M)
    assert [line[0] for line in table] == list(SETTINGS), out
    for line, row in zip(table, rows):
        assert line[1:] == (f"{row['memory_alone_p50_ms']:.0f}", f"{row['memory_alone_p99_ms']:.0f}",
                            f"{row['memory_with_disk_p50_ms']:.0f}", f"{row['memory_with_disk_p99_ms']:.0f}",
                            f"{row['memory_p99_ratio']:.2f}", f"{row['disk_p50_ms']:.0f}", f"{row['disk_p99_ms']:.0f}")
