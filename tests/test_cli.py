"""The ``flowkv`` command: pipeline validate / show / list, bench runner, --help everywhere."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowkv.cli import build_parser, main
from flowkv.pipeline import builtin_pipelines
from flowkv.registry import BUILTIN_STAGES, BUILTIN_TIERS

FIXTURES = Path(__file__).parent / "fixtures" / "pipelines"
DIAGNOSTIC = re.compile(r"^(?P<file>.+):(?P<line>\d+):(?P<col>\d+): (?P<message>.+)$")


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and sub-command the parser knows, as argument prefixes."""
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.extend(command_paths(sub, prefix + (name,)))
    return paths


ALL_COMMANDS = command_paths(build_parser())


def test_the_command_tree_has_what_the_issue_asks_for():
    for path in [("pipeline", "validate"), ("pipeline", "show"), ("pipeline", "list"), ("bench", "runner")]:
        assert path in ALL_COMMANDS


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(p) or "flowkv")
def test_help_on_every_command(path, capsys):
    with pytest.raises(SystemExit) as caught:
        main([*path, "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: flowkv {' '.join(path)}".rstrip())


@pytest.mark.parametrize("path", [(), ("pipeline",), ("bench",)], ids=["flowkv", "pipeline", "bench"])
def test_a_command_without_its_action_prints_help_and_fails(path, capsys):
    assert main(list(path)) == 2
    assert "usage: flowkv" in capsys.readouterr().out


# -- validate ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(builtin_pipelines()))
def test_validate_builtin_ok(name, capsys):
    # The blend pipelines' separator depends on the tokenizer: it must be given (--set, as in vLLM's extra config).
    blends = "\n[blend]\n" in builtin_pipelines()[name].read_text()
    if blends:
        assert main(["pipeline", "validate", name]) == 1
        assert "[blend]: missing required key 'separator'" in capsys.readouterr().err
    assert main(["pipeline", "validate", name, *(["--set", "blend.separator=[271, 198]"] if blends else [])]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{builtin_pipelines()[name]}: ok (")
    assert re.search(r"(\d+ store, \d+ retrieve, \d+ lookup|\d+ server) stages; tiers: \w", out)


def test_validate_prints_every_error_and_a_count(capsys):
    path = FIXTURES / "multi_errors.toml"
    assert main(["pipeline", "validate", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    *errors, summary = captured.err.strip().splitlines()
    assert summary == f"{path}: 6 errors"
    parsed = [DIAGNOSTIC.match(line) for line in errors]
    assert all(parsed), errors
    assert {m["file"] for m in parsed} == {str(path)}
    assert [int(m["line"]) for m in parsed] == [4, 5, 9, 12, 14, 18]


def test_validate_syntax_error(capsys):
    path = FIXTURES / "syntax_error.toml"
    assert main(["pipeline", "validate", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"{path}:3:14: TOML syntax:")
    assert err[1] == f"{path}: 1 error"


def test_validate_unknown_name(capsys):
    assert main(["pipeline", "validate", "local-cpo"]) == 1
    err = capsys.readouterr().err
    assert "no built-in pipeline named 'local-cpo'" in err and "did you mean 'local-cpu'?" in err


def test_validate_through_the_module_entry_point(tmp_path):
    """The real process: exit status and streams, from another directory."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    good = subprocess.run([sys.executable, "-m", "flowkv.cli", "pipeline", "validate", "local-cpu"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr
    assert ": ok (" in good.stdout
    bad = subprocess.run([sys.executable, "-m", "flowkv.cli", "pipeline", "validate",
                          str(FIXTURES / "syntax_error.toml")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and bad.stdout == ""
    assert ":3:14: TOML syntax" in bad.stderr


# -- show --------------------------------------------------------------------


def test_show_includes_defaults(capsys):
    path = FIXTURES / "minimal.toml"
    assert main(["pipeline", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# {path}\n")
    assert "[pipeline]\n  name = 'minimal'\n  chunk_size = 16\n  hash = 'auto'\n" in out
    assert "  pin_timeout_s = 30.0\n" in out  # a default the file does not say
    assert "  capacity = 67108864\n" in out  # "64MiB" as bytes
    assert "store: pass-through -> take\n" in out
    assert re.search(rf"  take +{re.escape(str(path))}:13  {{'limit': 4}}", out)
    assert "lookup: pass-through\n" in out


def test_show_json(capsys):
    path = FIXTURES / "minimal.toml"
    assert main(["pipeline", "show", "--json", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == str(path)
    assert info["pipeline"] == {
        "name": "minimal", "chunk_size": 16, "hash": "auto", "save_partial_chunks": False,
        "pin_timeout_s": 30.0, "description": "",
    }
    assert info["tiers"]["memory"]["capacity"] == 64 * 2**20
    assert info["tiers"]["memory"]["at"] == f"{path}:6"
    assert [s["use"] for s in info["store"]] == ["pass-through", "take"]
    assert info["store"][1]["limit"] == 4 and info["store"][1]["at"] == f"{path}:13"
    assert info["store"][1]["stage"].startswith("flowkv.stages.basic.take (")
    assert info["telemetry"]["exporter"] == "none" and info["telemetry"]["sampling"] == 1.0
    assert info["vllm"] == {"save_decode": False, "lookup_timeout_ms": 200, "remote_prefill_wait_ms": 10_000}
    assert info["quality"] == {"min_agreement": None, "record": None, "mode": "enforce"}


def test_show_builtin_json_through_the_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "flowkv.cli", "pipeline", "show", "--json", "local-cpu"],
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert [s["use"] for s in info["store"]][-1] == "put"
    assert info["pipeline"]["name"] == "local-cpu"


def test_show_broken_file_fails_with_errors(capsys):
    assert main(["pipeline", "show", str(FIXTURES / "syntax_error.toml")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and ":3:14: TOML syntax" in captured.err


# -- list --------------------------------------------------------------------


def test_list(capsys):
    assert main(["pipeline", "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("built-in pipelines:\n")
    for heading in ("built-in stages:", "built-in tier kinds:", "installed (entry point group 'flowkv.plugins'; 'flowkv.stages' is deprecated):"):
        assert heading in out
    assert re.search(r"^  local-cpu +\S+local-cpu\.toml$", out, re.M)
    assert re.search(r"^  gather +flowkv\.stages\.transfer:gather$", out, re.M)


def test_list_json(capsys):
    assert main(["pipeline", "list", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == {"pipelines", "stages", "tiers", "installed"}
    assert info["pipelines"] == {name: str(path) for name, path in builtin_pipelines().items()}
    assert info["stages"] == BUILTIN_STAGES
    assert info["tiers"] == BUILTIN_TIERS


# -- bench runner ---------------------------------------------------------------


def test_bench_runner_json(capsys):
    code = main(["bench", "runner", "--items", "2000", "--run-items", "100", "--stages", "3",
                 "--repeat", "1", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["items"], report["stages"], report["runs"]) == (2000, 3, 20)
    assert set(report["results"]) == {"hand", "off", "sampled", "on"}
    assert report["results"]["hand"]["ratio_to_hand"] == 1.0
    for row in report["results"].values():
        assert row["seconds"] > 0
    assert 0.0 <= report["sampled_share_traced"] <= 1.0


def test_bench_runner_table_and_bad_arguments(capsys):
    assert main(["bench", "runner", "--items", "600", "--run-items", "100", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("runner overhead: 6 pass-through stages, 600 items in 6 runs of 100")
    assert re.search(r"^on +[\d.]+ +[\d.]+ +-?[\d.]+ +[\d.]+$", out, re.M)
    assert main(["bench", "runner", "--sampling", "2"]) == 2
    assert "--sampling must be between 0 and 1" in capsys.readouterr().out


# -- the vLLM benchmarks' options (no vLLM starts: they are checked first) ---------------------


def test_bench_serve_and_ttft_name_their_baselines(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ceiling" in text and "(default 3)" in text  # the ceiling config; rounds by default
    assert main(["bench", "serve", "--configs", "none,top"]) == 2
    assert "none, ceiling, local-cpu" in capsys.readouterr().err
    assert main(["bench", "serve", "--repeats", "0"]) == 2
    assert main(["bench", "ttft", "--peers", "flowkv,floor"]) == 2
    assert "vLLM prefix cache" in capsys.readouterr().err  # the floor every hit is a ratio to
    with pytest.raises(SystemExit):
        main(["bench", "engine", "--help"])
    assert "--worker-conditions" in capsys.readouterr().out


def test_show_a_server_pipeline_gives_its_server_list_only(capsys):
    assert main(["pipeline", "show", "node-server-disk"]) == 0
    out = capsys.readouterr().out
    assert "server: compress -> put\n" in out
    assert "store:" not in out and "retrieve:" not in out and "[tiers.memory]" not in out
    assert main(["pipeline", "show", "--json", "node-server-disk"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [s["use"] for s in info["server"]] == ["compress", "put"] and "store" not in info
    assert main(["pipeline", "validate", "node-server-disk"]) == 0
    assert "ok (2 server stages; tiers: disk)" in capsys.readouterr().out


def test_the_fleets_commands_parse_alike_alone_and_their_process_never_imports_torch():
    """``flowkv controller``/``route``/``node-report`` build only their own parser (the same arguments as in
    the whole tree), and a process running one imports no torch: it starts in a fraction of a second."""
    from flowkv.cli import FLEET_COMMANDS

    whole, alone = build_parser(), build_parser(fleet_only=True)
    assert sorted(path for path in command_paths(alone) if path) == sorted(
        path for path in ALL_COMMANDS if path and path[0] in FLEET_COMMANDS)
    for name in FLEET_COMMANDS:
        assert (whole._subparsers._group_actions[0].choices[name].format_help()
                == alone._subparsers._group_actions[0].choices[name].format_help())
    probe = ("import sys\nfrom flowkv.cli import main\n"
             "for name in {names!r}:\n"
             "    try:\n        main([name, '--help'])\n    except SystemExit:\n        pass\n"
             "print('torch' in sys.modules, 'flowkv.fleet.commands' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe.format(names=FLEET_COMMANDS)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert out.stdout.splitlines()[-1] == "False True"
