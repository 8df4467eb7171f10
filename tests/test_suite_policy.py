"""The suite's own rules, run on a throw-away test folder with this suite's conftest.py:
under CI=true a skip fails the run unless it is excused (no CUDA device), and ``--shuffle SEED``
runs modules and their tests in another order while keeping each module's tests together."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_pytest(folder: Path, *args: str, ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def suite(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir()
    shutil.copy(HERE / "conftest.py", folder / "conftest.py")
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def test_a_skip_fails_a_ci_run_unless_it_is_excused(tmp_path):
    folder = suite(tmp_path / "skips", {"test_skips.py": (
        "import pytest\n"
        "def test_runs():\n    assert True\n"
        "def test_needs_a_server():\n    pytest.skip('redis-server is not installed')\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
        "def test_needs_cuda():\n    pass\n")})
    ci = run_pytest(folder, ci=True)
    assert ci.returncode == 1, ci.stdout
    assert "skips that fail a CI run" in ci.stdout
    assert "test_skips.py::test_needs_a_server: redis-server is not installed" in ci.stdout
    assert "test_needs_cuda" not in ci.stdout.split("skips that fail a CI run")[1]
    local = run_pytest(folder, ci=False)
    assert local.returncode == 0, local.stdout
    assert "skips that fail" not in local.stdout

    excused = suite(tmp_path / "excused", {"test_cuda.py": (
        "import pytest\n"
        "def test_runs():\n    assert True\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
        "def test_needs_cuda():\n    pass\n")})
    assert run_pytest(excused, ci=True).returncode == 0


def test_shuffle_reorders_modules_and_tests_and_keeps_each_module_together(tmp_path):
    files = {f"test_m{m}.py": "".join(f"def test_{m}_{t}():\n    print('RAN {m} {t}')\n" for t in range(6))
             for m in range(4)}
    folder = suite(tmp_path / "shuffle", files)

    def order(*args: str) -> list[tuple[str, str]]:
        out = run_pytest(folder, "-s", *args, ci=False)
        assert out.returncode == 0, out.stdout
        return re.findall(r"RAN (\d) (\d)", out.stdout)

    plain = order()
    assert plain == [(str(m), str(t)) for m in range(4) for t in range(6)]
    shuffled = order("--shuffle", "7")
    assert shuffled != plain and sorted(shuffled) == sorted(plain)
    assert order("--shuffle", "7") == shuffled  # the seed decides
    modules = [m for m, _ in shuffled]
    assert [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m] == list(dict.fromkeys(modules))

    # A module marked in_order moves whole, its tests in their own order.
    text = (folder / "test_m2.py").read_text()
    (folder / "test_m2.py").write_text("import pytest\npytestmark = pytest.mark.in_order\n" + text)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    in_order: a story\n")
    story = [t for m, t in order("--shuffle", "7") if m == "2"]
    assert story == [str(t) for t in range(6)]
