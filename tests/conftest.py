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
    _record_unit_time(report)
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))


def _unexcused_skips() -> list[tuple[str, str]]:
    return [(nodeid, reason) for nodeid, reason in _skipped
            if not any(allowed in reason for allowed in ALLOWED_SKIPS_IN_CI)]


def pytest_sessionfinish(session, exitstatus):
    _save_unit_times()
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


# How ``make test``'s two pytest-xdist workers (``-n 2``) share the suite: each module whole (its
# module-scoped servers start once, an in_order story keeps its order), the first worker the modules
# that start vLLM, the second the others beside it (they mostly wait on processes and sockets), then
# either the rest of the other kind, the longest first. "Longest" is what each module took in the last
# run on this machine (a file beside the venv, written at the end of every run with workers), or on a
# machine with no run yet (CI's fresh clone) the times shipped in tests/module-seconds.json; modules
# with neither follow, those with more tests first.
#
# xdist's own ``--dist loadgroup`` cannot do it here: it renames a test by assigning
# ``item._nodeid``, which pytest 9 no longer reads (tests/test_suite_policy.py pins that). So each
# worker writes the group of every test it collected to a file the controller names, and the
# controller's scheduler (one work unit per group) reads it once every worker has collected.
_GROUPS_FILE = "FLOWKV_TEST_GROUPS_FILE"
_DURATIONS_FILE = "FLOWKV_TEST_DURATIONS_FILE"
_DEFAULT_DURATIONS = os.path.join(os.path.expanduser("~"), ".cache", "flowkv", "test-durations.json")
_SHIPPED_DURATIONS = os.path.join(os.path.dirname(__file__), "module-seconds.json")
_unit_seconds: dict[str, float] | None = None  # a dict in the controller of a run with workers


def test_group(item) -> str:
    """The work unit ``item`` runs in under ``make test``'s workers: its module."""
    return item.nodeid.split("::", 1)[0]


def _durations_path() -> str:
    return os.environ.get(_DURATIONS_FILE) or _DEFAULT_DURATIONS


def _write_groups(config, items) -> None:
    path = os.environ.get(_GROUPS_FILE)
    if not path or not hasattr(config, "workerinput"):
        return
    import json

    groups = {item.nodeid: test_group(item) for item in items}
    engines = sorted({groups[item.nodeid] for item in items if item.get_closest_marker("vllm")})
    part = f"{path}.{config.workerinput['workerid']}"
    with open(part, "w", encoding="utf-8") as out:
        json.dump({"groups": groups, "engines": engines}, out)
    os.replace(part, path)  # every worker collects the same tests: the last one to finish wins


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import tempfile

        # Workers inherit the controller's environment: they learn where to write.
        fd, path = tempfile.mkstemp(prefix="flowkv-test-groups-", suffix=".json")
        os.close(fd)
        os.environ[_GROUPS_FILE] = path
        config.add_cleanup(lambda: os.path.exists(path) and os.unlink(path))
        global _unit_seconds
        _unit_seconds = {}


def _record_unit_time(report) -> None:
    if _unit_seconds is not None:
        unit = report.nodeid.split("::", 1)[0]
        _unit_seconds[unit] = _unit_seconds.get(unit, 0.0) + report.duration


def _save_unit_times() -> None:
    """Merge this run's seconds per module into the record the next run orders its modules by."""
    if not _unit_seconds:
        return
    import json

    path = _durations_path()
    try:
        with open(path, encoding="utf-8") as old:
            record = json.load(old)
    except (OSError, ValueError):
        record = {}
    record.update({unit: round(seconds, 1) for unit, seconds in _unit_seconds.items()})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.tmp", "w", encoding="utf-8") as out:
        json.dump(record, out, indent=0, sort_keys=True)
    os.replace(f"{path}.tmp", path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    import json

    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """One work unit per group (``test_group``), the longest first."""

        groups: dict[str, str] | None = None

        def _load(self) -> dict[str, str]:
            if self.groups is None:
                with open(os.environ[_GROUPS_FILE], encoding="utf-8") as written:
                    found = json.load(written)
                self.groups, self.engines = found["groups"], set(found["engines"])
                try:
                    with open(_durations_path(), encoding="utf-8") as record:
                        self.seconds = json.load(record)
                except (OSError, ValueError):
                    self.seconds = {}
                if not self.seconds:  # a first run here: the times of a whole run shipped with the tests
                    try:
                        with open(_SHIPPED_DURATIONS, encoding="utf-8") as shipped:
                            self.seconds = json.load(shipped)
                    except (OSError, ValueError):  # a copy of this file elsewhere (tests/test_suite_policy.py)
                        self.seconds = {}
            return self.groups

        def _split_scope(self, nodeid: str) -> str:
            return self._load()[nodeid]  # every collected test has its group

        def _assign_work_unit(self, node) -> None:
            # The first worker takes the engine modules, the second the others, each the longest of its
            # kind first, and either the other kind once its own is done: two engines side by side slow
            # each other's steps (2-6x for the in-process ones), an engine beside sockets hardly at all.
            engines_first = int(node.gateway.id.removeprefix("gw")) % 2 == 0
            for scope in self.workqueue:
                if (scope in self.engines) == engines_first:
                    self.workqueue.move_to_end(scope, last=False)
                    break
            super()._assign_work_unit(node)

        def schedule(self) -> None:
            first = self.collection is None
            if first and self.collection_is_completed:
                self._load()
                # xdist orders its queue as it builds it: build it, order it, then hand out.
                assign, self._assign_work_unit = self._assign_work_unit, lambda node: None
                try:
                    super().schedule()
                finally:
                    self._assign_work_unit = assign
                longest = sorted(self.workqueue.items(), key=lambda unit: (
                    -self.seconds.get(unit[0], 0.0), unit[0] not in self.engines, -len(unit[1])))
                self.workqueue.clear()
                self.workqueue.update(longest)
                for node in self.nodes:
                    if self.workqueue:
                        self._assign_work_unit(node)
                for node in self.nodes:
                    self._reschedule(node)
                return
            super().schedule()

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
