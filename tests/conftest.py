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
