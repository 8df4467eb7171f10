"""The suite's own rules, run on a throw-away test folder with this suite's conftest.py:
under CI=true a skip fails the run unless it is excused (no CUDA device), and ``--shuffle SEED``
runs modules and their tests in another order while keeping each module's tests together, and
``make test``'s two workers run each module whole, engine modules beside the others, the longest (as the
last run recorded) first."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_pytest(folder: Path, *args: str, ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    # the record of module times the suite's scheduler keeps: this folder's own
    env["FLOWKV_TEST_DURATIONS_FILE"] = str(folder / "durations.json")
    if ci:
        env["CI"] = "true"
    # its temporary folders inside its own: pytest keeps the last three under /tmp, and a nested run there
    # would push out the folders (server logs included) of the run around it
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={folder / '.tmp'}", *args, str(folder)],
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


def order_of(folder: Path) -> list[tuple[str, str]]:
    """(module, worker) of each test in the order they ran."""
    return re.findall(r"(\w+) (gw\d)", (folder / "ran.log").read_text())


def first_on_each_worker(folder: Path) -> dict[str, str]:
    first: dict[str, str] = {}
    for module, worker in order_of(folder):
        first.setdefault(worker, module)
    return first


def test_make_tests_workers_run_engine_modules_beside_the_others_each_whole_the_longest_first(tmp_path):
    folder = suite(tmp_path / "workers", WORKER_FILES)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: starts vLLM\n")
    out = run_pytest(folder, "-n", "2", "--dist", "loadgroup", ci=False)
    first = first_on_each_worker(folder)
    ran = workers_of(out, folder)
    assert sorted(ran) == ["engine0", "engine1", "other0", "other1", "other2"]
    assert all(len(workers) == 1 for workers in ran.values()), ran  # a module whole on one worker
    # The first worker starts on an engine module, the second on another kind beside it.
    assert first["gw0"].startswith("engine") and first["gw1"].startswith("other"), first
    # The run recorded each module's seconds; the next run hands out the longest of each kind first.
    record = json.loads((folder / "durations.json").read_text())
    assert set(record) == {f"test_{name}.py" for name in ran} and record["test_engine0.py"] > record["test_other0.py"]
    record.update({"test_other2.py": 100.0, "test_other1.py": 50.0, "test_engine1.py": 80.0})
    (folder / "durations.json").write_text(json.dumps(record))
    out = run_pytest(folder, "-n", "2", "--dist", "loadgroup", ci=False)
    assert first_on_each_worker(folder) == {"gw0": "engine1", "gw1": "other2"}
    workers_of(out, folder)
    # The same under --shuffle: groups do not depend on the order.
    shuffled = workers_of(run_pytest(folder, "-n", "2", "--dist", "loadgroup", "--shuffle", "3", ci=False), folder)
    assert all(len(w) == 1 for w in shuffled.values()), shuffled


def test_a_first_run_here_orders_the_modules_by_the_times_shipped_beside_conftest(tmp_path):
    """A fresh clone (CI) has no record of its own: tests/module-seconds.json, shipped beside
    conftest.py, hands out the longest of each kind first all the same."""
    folder = suite(tmp_path / "shipped", WORKER_FILES)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: starts vLLM\n")
    (folder / "module-seconds.json").write_text(json.dumps({"test_other2.py": 100.0, "test_engine1.py": 80.0}))
    assert not (folder / "durations.json").exists()
    out = run_pytest(folder, "-n", "2", "--dist", "loadgroup", ci=False)
    assert first_on_each_worker(folder) == {"gw0": "engine1", "gw1": "other2"}
    workers_of(out, folder)


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
