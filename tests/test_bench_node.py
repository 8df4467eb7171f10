"""``flowkv bench engine --via server``: a small run, through a server the benchmark starts and stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from node_servers import ROOT


def test_engine_via_server_reports_both_paths_against_the_copy_in_few_round_trips():
    done = subprocess.run([sys.executable, "-m", "flowkv.cli", "bench", "engine", "--via", "server", "--tokens",
                           "1024", "--repeats", "1", "--json"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["tokens"] == 1024
    for name in ("in-process", "server"):
        for kind in ("store", "retrieve"):
            assert figures[f"{name}_{kind}_vs_copy"] > 0
    assert figures["server_vs_in_process_retrieve"] > 0
    # Two stores (lookup, alloc, commit each) and two retrieves (lookup, get each): one round trip
    # per request and kind, never one per chunk (a store here is four chunks).
    assert figures["server_round_trips"] == 2 * 3 + 2 * 2
    assert figures["server_one_way_messages"] == 2 * 4  # each retrieve's read references, given back
    assert figures["server_segment"].startswith("memfd:flowkv-node-")  # a descriptor, no file to leave

