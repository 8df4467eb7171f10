"""A second local user for the attack tests: ``nobody``, reached by dropping root's privileges.

Root ignores file modes, so a test that shows "another user cannot read
this" must act as another user. Two ways:

- ``as_nobody(script, *args)``: a stdlib-only Python script run by the
  system's ``python3`` under ``setpriv`` as nobody:nogroup (nobody cannot
  read root's venv or pyenv, so flowkv is not importable there: an attacker
  helper needs nothing but the standard library).
- ``in_child_as_nobody(fn)``: fork this process, drop to nobody in the
  child, run ``fn()`` there (flowkv already imported) and hand back its
  JSON-able result; for flowkv code that must run as a non-root user.

``LISTENER``: a stdlib script that binds a Unix socket, listens for
``argv[2]`` seconds and prints how many bytes its clients sent (an
impostor or squatter that records what it heard).

``shared_folder`` (fixture): a fresh folder under /tmp that nobody may
enter and write (pytest's own tmp folders are root's 0700). Tests that need these
skip unless the suite runs as root.
"""

from __future__ import annotations

import gc
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

NOBODY = pwd.getpwnam("nobody")

LISTENER = """
import os, socket, sys, time
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o777)
listener.listen(8)
listener.settimeout(0.2)
print("listening", flush=True)
received, connections = 0, 0
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        conn, _ = listener.accept()
    except socket.timeout:
        continue
    connections += 1
    conn.settimeout(0.5)
    try:
        while True:
            got = conn.recv(65536)
            if not got:
                break
            received += len(got)
    except socket.timeout:
        pass
    conn.close()
print("received", received, "connections", connections, flush=True)
"""
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing a second local user needs root")


def system_python() -> str:
    """A python3 that nobody may run (the system's, not root's pyenv)."""
    for candidate in ["/usr/bin/python3", *(shutil.which("python3", path=p) or "" for p in
                                            os.environ.get("PATH", "").split(os.pathsep))]:
        if candidate and os.access(candidate, os.X_OK) and _nobody_runs(candidate):
            return candidate
    pytest.skip("no python3 that the nobody user may run")


def _nobody_runs(python: str) -> bool:
    done = subprocess.run(_drop() + [python, "-c", "pass"], capture_output=True, timeout=60)
    return done.returncode == 0


def _drop() -> list[str]:
    return ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]


def as_nobody(script: str, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (Python source, stdlib only) as nobody with ``args`` in ``sys.argv[1:]``."""
    return subprocess.run(_drop() + [system_python(), "-c", script, *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd="/")


def spawn_as_nobody(script: str, *args: str) -> subprocess.Popen[str]:
    """``as_nobody`` without waiting: the process, its stdout piped."""
    return subprocess.Popen(_drop() + [system_python(), "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")


def in_child_as_nobody(fn: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    """``fn()`` run in a forked child that dropped to nobody; its result (JSON), or its exception re-raised.

    A fork copies a process whose other threads (telemetry exporters, gRPC, torch's pool) may hold
    locks at that instant, and nothing in the child will ever release them. So the child runs no
    garbage collection (the parent's unreachable generators would run their ``finally`` blocks and
    take such a lock) and torch on one thread (OpenMP is not fork-safe), and a child that still
    hangs is killed after ``timeout_s``: a failure, never a suite that waits forever.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            gc.disable()
            os.close(read_end)
            torch_module = sys.modules.get("torch")
            if torch_module is not None:
                torch_module.set_num_threads(1)
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            out = {"result": fn()}
        except BaseException:  # noqa: BLE001 - reported to the parent
            out, code = {"error": traceback.format_exc()}, 1
        with os.fdopen(write_end, "w") as pipe:
            json.dump(out, pipe)
        os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"as nobody: the child did not answer within {timeout_s:.0f} s (killed)")
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    text = b"".join(chunks).decode()
    out = json.loads(text) if text else {"error": "the child died without an answer"}
    if "error" in out:
        raise AssertionError(f"as nobody: {out['error']}")
    return out["result"]


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder under /tmp that every user may enter and write (1777), removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix="fkv-users-", dir="/tmp"))
    folder.chmod(0o1777)  # like /tmp: anyone may enter and make their own things there
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
