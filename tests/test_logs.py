"""flowkv's log lines carry a time and a process: vLLM's format inside vLLM, a standard one elsewhere.

Each case runs in a fresh interpreter, since logging set-up is per process.
(A line logged inside a real `vllm serve` is checked in ``test_vllm_serve.py``.)
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

# 2026-11-30 09:57:11,387 WARNING MainProcess pid=4711 flowkv.tiers: message
STANDARD_LINE = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING MainProcess pid={pid} flowkv\.tiers: {message}"
# (EngineCore pid=4711) WARNING 11-30 09:57:11 [disk.py:330] message  -- vLLM's format
VLLM_LINE = r"\(\S+ pid={pid}\) WARNING \d\d-\d\d \d\d:\d\d:\d\d \[<string>:\d+\] {message}"


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}, timeout=600)


def lines_like(pattern: str, text: str, pid: str, message: str) -> list[str]:
    regex = re.compile(pattern.replace("{pid}", pid).replace("{message}", re.escape(message)))
    return [line for line in text.splitlines() if regex.fullmatch(line)]


def test_the_flowkv_command_logs_with_time_level_and_process():
    done = run(
        "import logging, os\n"
        "from flowkv import cli\n"
        "cli.main(['pipeline', 'list'])\n"
        "print('pid', os.getpid())\n"
        "logging.getLogger('flowkv.tiers').warning('disk tier full')\n"
    )
    pid = done.stdout.split("pid ")[-1].strip()
    assert lines_like(STANDARD_LINE, done.stderr, pid, "disk tier full"), done.stderr


@pytest.mark.parametrize(("level", "debug_shown", "warning_shown"),
                         [(None, False, True), ("DEBUG", True, True), ("ERROR", False, False)])
def test_flowkv_logging_level_sets_flowkvs_level_and_only_flowkvs(level, debug_shown, warning_shown):
    """FLOWKV_LOGGING_LEVEL outside vLLM: flowkv's loggers follow it (WARNING when unset); another
    library's logger keeps the program's level."""
    env = {"FLOWKV_LOGGING_LEVEL": level} if level else {}
    base = {k: v for k, v in os.environ.items() if k != "FLOWKV_LOGGING_LEVEL"}
    done = subprocess.run([sys.executable, "-c", (
        "import logging\n"
        "from flowkv import cli\n"
        "cli.main(['pipeline', 'list'])\n"
        "logging.getLogger('flowkv.tiers').debug('flowkv debug line')\n"
        "logging.getLogger('flowkv.tiers').warning('flowkv warning line')\n"
        "logging.getLogger('otherlib').debug('other debug line')\n")],
        capture_output=True, text=True, check=True, env={**base, **env}, timeout=600)
    assert ("flowkv debug line" in done.stderr) == debug_shown, done.stderr
    assert ("flowkv warning line" in done.stderr) == warning_shown, done.stderr
    assert "other debug line" not in done.stderr


@pytest.mark.parametrize("order", ["configure-then-plugin", "plugin-then-configure"])
def test_inside_vllm_flowkv_lines_take_vllms_format(order):
    steps = ["configure_logging(LoggingConfig())", "vllm_plugin()"]
    if order == "plugin-then-configure":
        steps.reverse()
    done = run(
        "import logging, os\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "from flowkv.logs import vllm_plugin\n"
        + "\n".join(steps) + "\n"
        "vllm_plugin()  # vLLM loads plugins in several places: once is enough\n"
        "print('pid', os.getpid())\n"
        "logging.getLogger('flowkv.tiers').warning('disk tier full')\n",
        VLLM_LOGGING_STREAM="ext://sys.stderr", VLLM_LOGGING_COLOR="0", VLLM_LOGGING_LEVEL="INFO",
    )
    pid = done.stdout.split("pid ")[-1].strip()
    assert len(lines_like(VLLM_LINE, done.stderr, pid, "disk tier full")) == 1, done.stderr


@pytest.mark.parametrize("why", ["vLLM does not configure logging", "the program configured logging"])
def test_flowkv_leaves_logging_to_the_program_when_vllm_does_not_own_it(why):
    done = run(
        "import logging\n"
        "from flowkv.logs import vllm_plugin\n"
        + ("logging.basicConfig()\n" if why == "the program configured logging" else "")
        + "vllm_plugin()\n"
        "print(logging.getLogger('flowkv').handlers, logging.getLogger('flowkv').propagate)\n",
        VLLM_CONFIGURE_LOGGING="0" if why == "vLLM does not configure logging" else "1",
    )
    assert done.stdout.strip() == "[] True"


def test_vllm_loads_the_set_up_as_a_general_plugin():
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    # (and the blend's model plugin: tests/test_blend_models.py)
    assert {p.name: p.value for p in plugins if p.value.startswith("flowkv.")} == {
        "flowkv-logging": "flowkv.logs:vllm_plugin",
        "flowkv-models": "flowkv.integration.vllm.models:register_models",
    }
