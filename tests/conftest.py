"""Shared test set-up: no model hub, ever; and every test that starts vLLM carries the ``vllm`` marker.

``-m "not vllm"`` must skip every test that starts a vLLM engine (20-50 s each
on two cores): ``vllm.LLM`` refuses to start inside a test without the marker.
"""

import importlib.abc
import importlib.util
import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_LLM_MODULE = "vllm.entrypoints.llm"
# The test running now, and whether it carries the vllm marker.
_running: dict[str, object] = {"nodeid": None, "marked": True}


def _guard(module) -> None:
    """Make ``module.LLM`` refuse to start in a test without the vllm marker."""
    cls = module.LLM
    if getattr(cls.__init__, "_flowkv_marker_guard", False):
        return
    start = cls.__init__

    def __init__(self, *args, **kwargs):
        if not _running["marked"]:
            raise AssertionError(f"{_running['nodeid']} starts vLLM: mark it @pytest.mark.vllm")
        start(self, *args, **kwargs)

    __init__._flowkv_marker_guard = True
    cls.__init__ = __init__


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Puts the guard on ``vllm.LLM`` as soon as a test imports vLLM (tests import it lazily)."""

    def find_spec(self, name, path=None, target=None):
        if name != _LLM_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_guard(module):
            exec_module(module)
            _guard(module)

        spec.loader.exec_module = exec_and_guard
        return spec


sys.meta_path.insert(0, _GuardOnImport())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before any fixture of the test is set up: a module-scoped engine is built for its first test.
    _running["nodeid"] = item.nodeid
    _running["marked"] = item.get_closest_marker("vllm") is not None
    if _LLM_MODULE in sys.modules:
        _guard(sys.modules[_LLM_MODULE])


# Under CI=true a skipped test fails the run unless its reason is one of these: a CI machine that
# lacks a part of the set-up (vLLM, redis-server, chromium, openssl, mkfs.ext4, root) must not pass
# by skipping what it could not run. Only hardware the CI machine cannot have is excused.
ALLOWED_SKIPS_IN_CI = ("needs a CUDA device",)
_skipped: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))


def _unexcused_skips() -> list[tuple[str, str]]:
    return [(nodeid, reason) for nodeid, reason in _skipped
            if not any(allowed in reason for allowed in ALLOWED_SKIPS_IN_CI)]


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI") == "true" and _unexcused_skips() and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if os.environ.get("CI") == "true" and _unexcused_skips():
        terminalreporter.section("skips that fail a CI run")
        for nodeid, reason in _unexcused_skips():
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line("CI=true: a test the set-up should have made runnable was skipped "
                              f"(allowed: {', '.join(ALLOWED_SKIPS_IN_CI)})")


def pytest_addoption(parser):
    parser.addoption("--shuffle", metavar="SEED", default=None,
                     help="run the modules, and the tests inside each module, in an order shuffled with SEED "
                          "(a module's tests stay together, so its shared engine still starts once): tests "
                          "must not depend on the order they run in. A module marked in_order (a story of "
                          "real processes told step by step, its docstring says which) keeps its own order")


def pytest_collection_modifyitems(session, config, items):
    _write_groups(config, items)
    seed = config.getoption("--shuffle")
    if seed is None:
        return
    import random

    rng = random.Random(seed)
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = list(modules)
    rng.shuffle(order)
    items[:] = []
    for module in order:
        tests = modules[module]
        if not any(item.get_closest_marker("in_order") for item in tests):
            rng.shuffle(tests)
        items.extend(tests)


# How ``make test``'s two pytest-xdist workers (``-n 2``) share the suite: every test that starts vLLM
# in one group, run one after another by one worker, as without workers (an engine takes both cores;
# in-process engines share vLLM's process-wide state, which allows one connected engine at a time);
# every other module whole (its module-scoped servers start once, an in_order story keeps its
# order) on whichever worker is free. Tests that start no vLLM mostly wait on processes and
# sockets, so they run beside the engines instead of after them.
#
# xdist's own ``--dist loadgroup`` cannot do it here: it renames a test by assigning
# ``item._nodeid``, which pytest 9 no longer reads (tests/test_suite_policy.py pins that). So each
# worker writes the group of every test it collected to a file the controller names, and the
# controller's scheduler (one work unit per group) reads it once every worker has collected.
_GROUPS_FILE = "FLOWKV_TEST_GROUPS_FILE"


def test_group(item) -> str:
    """The work unit ``item`` runs in under ``make test``'s workers."""
    return "vllm" if item.get_closest_marker("vllm") else item.nodeid.split("::", 1)[0]


def _write_groups(config, items) -> None:
    path = os.environ.get(_GROUPS_FILE)
    if not path or not hasattr(config, "workerinput"):
        return
    import json

    part = f"{path}.{config.workerinput['workerid']}"
    with open(part, "w", encoding="utf-8") as out:
        json.dump({item.nodeid: test_group(item) for item in items}, out)
    os.replace(part, path)  # every worker collects the same tests: the last one to finish wins


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import tempfile

        # Workers inherit the controller's environment: they learn where to write.
        fd, path = tempfile.mkstemp(prefix="flowkv-test-groups-", suffix=".json")
        os.close(fd)
        os.environ[_GROUPS_FILE] = path
        config.add_cleanup(lambda: os.path.exists(path) and os.unlink(path))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    import json

    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """One work unit per group (``test_group``); the largest (vLLM's) goes out first."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                with open(os.environ[_GROUPS_FILE], encoding="utf-8") as groups:
                    self.groups = json.load(groups)
            return self.groups[nodeid]  # every collected test has its group

    if config.getvalue("dist") != "loadgroup":
        return None
    return ByGroup(config, log)


def pytest_report_header(config):
    seed = config.getoption("--shuffle")
    return None if seed is None else f"flowkv: test order shuffled with seed {seed}"


@pytest.fixture
def engines_in_this_process(monkeypatch):
    """The vLLM engines flowkv's CLI builds in this test (``flowkv demo``, ``bench``, ``quality``, run
    through ``flowkv.cli.main``) start eager (vLLM's CPU CI switch) and in the test's own process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ~2 s a start instead of 20-40 s. What the CLI prints and
    what flowkv serves do not depend on either (vLLM's own layout and compiled engines run under
    ``vllm serve`` in tests/test_vllm_serve.py, its own layout for ``vllm.LLM`` in test_vllm_hooks.py)."""
    from vllm_helpers import engine_processes

    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")
    with engine_processes(separate=False):
        yield


@pytest.fixture(name="own_environment")
def _own_environment():
    """The environment as it was, after a test that runs ``flowkv demo`` or ``bench`` (they set vLLM's
    for their run: log level, KV pool size)."""
    from vllm_helpers import own_environment

    with own_environment():
        yield
