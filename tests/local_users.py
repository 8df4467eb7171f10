"""A second local user for the attack tests: ``nobody``, reached by dropping root's privileges.

Root ignores file modes, so a test that shows "another user cannot read
this" must act as another user. Two ways:

- ``as_nobody(script, *args)``: a stdlib-only Python script run by the
  system's ``python3`` under ``setpriv`` as nobody:nogroup (nobody cannot
  read root's venv or pyenv, so flowkv is not importable there: an attacker
  helper needs nothing but the standard library).
  (flowkv code that must meet file modes runs as root without the
  capabilities that bypass them: ``setpriv --bounding-set=-dac_override,
  -dac_read_search``, see ``test_tier_disk.py``; a fork of the test process
  would inherit locks its other threads hold.)

``LISTENER``: a stdlib script that binds a Unix socket, listens for
``argv[2]`` seconds and prints how many bytes its clients sent (an
impostor or squatter that records what it heard).

``shared_folder`` (fixture): a fresh folder under /tmp that nobody may
enter and write (pytest's own tmp folders are root's 0700). Tests that need these
skip unless the suite runs as root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
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


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder under /tmp that every user may enter and write (1777), removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix="fkv-users-", dir="/tmp"))
    folder.chmod(0o1777)  # like /tmp: anyone may enter and make their own things there
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
