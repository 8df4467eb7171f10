"""The suite's own rules, run on a throw-away test folder with this suite's conftest.py:
under CI=true a skip fails the run unless it is excused (no CUDA device), and ``--shuffle SEED``
runs modules and their tests in another order while keeping each module's tests together, and
``make test``'s two workers run every vLLM test on one of them and each other module whole."""

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


# Workers' output does not reach the controller's: each test appends its module and worker to a file.
RAN = ("import os\n"
       "def ran(module):\n"
       "    with open(os.path.join(os.path.dirname(__file__), 'ran.log'), 'a') as log:\n"
       "        log.write(f\"{module} {os.environ['PYTEST_XDIST_WORKER']}\\n\")\n")
WORKER_FILES = {
    "ran.py": RAN,
    # Two modules of engine tests and three of others: which worker ran each test, and when.
    **{f"test_engine{m}.py": "import time, pytest\nfrom ran import ran\npytestmark = pytest.mark.vllm\n" + "".join(
        f"def test_{t}():\n    time.sleep(0.2)\n    ran('engine{m}')\n"
        for t in range(4)) for m in range(2)},
    **{f"test_other{m}.py": "import time\nfrom ran import ran\n" + "".join(
        f"def test_{t}():\n    time.sleep(0.1)\n    ran('other{m}')\n"
        for t in range(3)) for m in range(3)},
}


def workers_of(out: subprocess.CompletedProcess[str], folder: Path) -> dict[str, set[str]]:
    """Each module's workers in the run that just ended (``out``)."""
    assert out.returncode == 0, out.stdout + out.stderr
    ran: dict[str, set[str]] = {}
    log = folder / "ran.log"
    for module, worker in re.findall(r"(\w+) (gw\d)", log.read_text()):
        ran.setdefault(module, set()).add(worker)
    log.unlink()
    return ran


def test_make_tests_workers_run_every_vllm_test_on_one_worker_and_each_other_module_whole(tmp_path):
    folder = suite(tmp_path / "workers", WORKER_FILES)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: starts vLLM\n")
    ran = workers_of(run_pytest(folder, "-n", "2", "--dist", "loadgroup", ci=False), folder)
    assert sorted(ran) == ["engine0", "engine1", "other0", "other1", "other2"]
    assert all(len(workers) == 1 for workers in ran.values()), ran  # a module whole on one worker
    assert ran["engine0"] == ran["engine1"]  # every vLLM test on the same one
    assert set().union(*ran.values()) == {"gw0", "gw1"}  # and the others beside it
    # The same under --shuffle: groups do not depend on the order.
    shuffled = workers_of(run_pytest(folder, "-n", "2", "--dist", "loadgroup", "--shuffle", "3", ci=False), folder)
    assert shuffled["engine0"] == shuffled["engine1"] and all(len(w) == 1 for w in shuffled.values())


def test_xdists_own_loadgroup_does_not_group_under_this_pytest(tmp_path):
    """Why conftest.py schedules the workers itself: pytest-xdist 3.8's ``--dist loadgroup`` renames
    each marked test by assigning ``item._nodeid``, which pytest 9 no longer reads, so every test is a
    group of its own. When this fails, xdist groups again: drop conftest's scheduler for its own."""
    folder = tmp_path / "xdist"
    folder.mkdir()
    (folder / "ran.py").write_text(RAN, encoding="utf-8")
    (folder / "test_grouped.py").write_text(
        "import time, pytest\nfrom ran import ran\n" + "".join(
            f"@pytest.mark.xdist_group('one')\ndef test_{t}():\n    time.sleep(0.1)\n    ran('grouped')\n"
            for t in range(8)), encoding="utf-8")
    out = run_pytest(folder, "-v", "-n", "2", "--dist", "loadgroup", ci=False)
    assert "@one" not in out.stdout  # xdist's renamed ids would carry the group
    assert workers_of(out, folder)["grouped"] == {"gw0", "gw1"}  # so the group's tests went to both workers
