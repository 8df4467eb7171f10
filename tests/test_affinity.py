"""flowkv.kernels.affinity: threads started by a thread pinned to one core run on the process's other cores
(the worker's side of vLLM is checked in test_vllm_hooks.py); the tiers' I/O thread too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from flowkv.kernels import affinity

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


def on_a_pinned_thread(body):
    """Run ``body`` on a thread pinned to the first of this process's cores, while another thread of
    the process may run on every core (as vLLM's OpenMP worker does on the others); its result."""
    cores = sorted(os.sched_getaffinity(0))
    result: list = []
    release = threading.Event()
    bystander = threading.Thread(target=release.wait)  # keeps every core among the process's
    bystander.start()

    def pinned():
        os.sched_setaffinity(0, {cores[0]})
        result.append(body())

    try:
        thread = threading.Thread(target=pinned)
        thread.start()
        thread.join()
    finally:
        release.set()
        bystander.join()
    return cores, result[0]


@needs_two_cores
def test_threads_started_in_the_block_run_off_the_callers_core_and_the_caller_gets_its_core_back():
    def body():
        seen: dict[str, set[int]] = {}
        with affinity.threads_elsewhere() as cores:
            started = threading.Thread(target=lambda: seen.setdefault("inside", os.sched_getaffinity(0)))
            started.start()
            started.join()
        after = threading.Thread(target=lambda: seen.setdefault("after", os.sched_getaffinity(0)))
        after.start()
        after.join()
        return cores, seen, os.sched_getaffinity(0)

    cores, (elsewhere, seen, caller_after) = on_a_pinned_thread(body)
    assert elsewhere == set(cores[1:]) == seen["inside"]
    assert caller_after == {cores[0]} == seen["after"]


def test_an_unpinned_caller_changes_nothing():
    with affinity.threads_elsewhere() as cores:
        assert cores is None and os.sched_getaffinity(0) == affinity.process_cores()


@needs_two_cores
def test_the_tiers_io_thread_started_by_a_pinned_thread_runs_off_its_core():
    # The portal is one per process: a fresh process, whose main thread is pinned as vLLM's worker's is.
    script = textwrap.dedent("""
        import json, os, threading
        release = threading.Event()
        threading.Thread(target=release.wait, daemon=True).start()
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from flowkv.tiers import portal
        portal.get_portal()
        print(json.dumps([sorted(os.sched_getaffinity(portal._portal_thread.native_id)),
                          sorted(os.sched_getaffinity(0))]))
        portal.shutdown()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    cores = sorted(os.sched_getaffinity(0))
    assert json.loads(out.stdout) == [cores[1:], cores[:1]], out.stdout
