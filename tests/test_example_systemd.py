"""examples/systemd/flowkv-server.service run as systemd would run it: its ExecStart with the
machine's paths put in (the venv's flowkv, a runtime folder made with the unit's mode, a copy of the
built-in node-server-disk pipeline, a free metrics port, an arena that fits this machine), then
`flowkv server status` and Prometheus on the port the unit names, and its KillSignal: the server
drains and removes its socket within TimeoutStopSec."""

from __future__ import annotations

import os
import signal
import subprocess
import re
import sys
import urllib.request
from pathlib import Path

from vllm_server import free_port, shell_commands

from flowkv.pipeline import dumps_pipeline, load_pipeline

UNIT = Path(__file__).resolve().parents[1] / "examples" / "systemd" / "flowkv-server.service"


def unit_settings() -> dict[str, str]:
    settings: dict[str, str] = {}
    joined = ""
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or line.startswith("["):
            continue
        joined += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if "=" in joined:
                key, value = joined.split("=", 1)
                settings[key.strip()] = value.strip()
            joined = ""
    return settings


def test_the_unit_runs_the_server_as_written_and_stops_it_with_its_kill_signal(tmp_path):
    settings = unit_settings()
    [(_, argv)] = shell_commands(settings["ExecStart"], fenced=False)
    assert argv[0].endswith("/bin/flowkv") and argv[1] == "server"
    runtime = tmp_path / "run" / settings["RuntimeDirectory"]
    runtime.mkdir(parents=True, mode=int(settings["RuntimeDirectoryMode"], 8))
    port = free_port()
    # /etc/flowkv/node-server-disk.toml: "a copy of the built-in server pipeline with the disk tier's
    # path set for the machine" (examples/systemd/README.md)
    disk = tmp_path / "disk"
    config = tmp_path / "node-server-disk.toml"
    text = Path(load_pipeline("node-server-disk").source).read_text(encoding="utf-8")
    config.write_text(re.sub(r'(?m)^path = ".*"$', f'path = "{disk}"', text, count=1), encoding="utf-8")
    assert str(load_pipeline(config).tiers["disk"].config.path) == str(disk)
    replaced = {"/run/flowkv": str(runtime), "/etc/flowkv/node-server-disk.toml": str(config), "9464": str(port)}
    command = [str(Path(sys.executable).parent / "flowkv")]
    for arg in argv[1:]:
        for old, new in replaced.items():
            arg = arg.replace(old, new)
        command.append(arg)
    # The unit's --memory is a production figure: this machine holds a test-sized arena.
    command[command.index("--memory") + 1] = "64MiB"
    socket = Path(command[command.index("--socket") + 1])
    with open(tmp_path / "server.log", "w", encoding="utf-8") as log:  # the journal
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        assert "ready" in proc.stdout.readline(), (tmp_path / "server.log").read_text()
        status = subprocess.run([str(Path(sys.executable).parent / "flowkv"), "server", "status", "--socket",
                                 str(socket)], capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        assert "entries" in status.stdout
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as reply:
            assert "flowkv_server_" in reply.read().decode()
        assert settings["KillSignal"] == "SIGTERM"
        proc.send_signal(getattr(signal, settings["KillSignal"]))
        assert proc.wait(timeout=float(settings["TimeoutStopSec"])) == 0
        assert not socket.exists(), "the socket outlived the server's stop"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_unit_leaves_room_above_the_arena():
    settings = unit_settings()
    [(_, argv)] = shell_commands(settings["ExecStart"], fenced=False)
    memory = argv[argv.index("--memory") + 1]
    assert memory.endswith("GiB") and settings["MemoryMax"].endswith("G")
    assert int(settings["MemoryMax"][:-1]) > int(memory[:-3])
