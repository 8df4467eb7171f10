"""A real `vllm serve` for the tests: vLLM's OpenAI-compatible server on loopback, as a user runs it.

:class:`VllmServer` starts ``vllm serve`` (the console script of the venv
running the tests, as ``make`` sets it up) on ``127.0.0.1`` and a free port,
in a session of its own, with its output in a log file; waits for ``/health``;
sends completions (streamed or not) and reads ``/metrics``; and stops it with
SIGTERM, as systemd or Kubernetes would. A module shares its servers
between its tests in module-scoped fixtures (a start costs 25-70 s on two
cores).

``start_server(folder, kv_extra={...}, args=[...], env={...}, transfer=README_CONFIG)`` starts one
(another pipeline, another README line's transfer config, vLLM flags, environment); the caller
stops it (``close()``). ``start_servers`` starts several side by side, ``start_all`` servers already
made. Servers run eager and in float32 (as the tests' ``vllm.LLM`` engines do, see
``vllm_helpers.DTYPE``), the model in the engine core's process; ``compiled=True`` runs vLLM's compiled
default and its process layout (``test_vllm_serve``'s servers), ``worker_process=True`` the layout alone.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_helpers import BLOCK_SIZE, DTYPE, KV_BYTES_PER_BLOCK, tiny_model_dir

MODEL_NAME = "tiny"
# A start that has not answered /health by then hangs (a readiness bound, not a speed claim).
READY_TIMEOUT_S = 900.0
# How long a SIGTERM'd server may take to exit before the test kills what is left.
STOP_TIMEOUT_S = 300.0
# The scheduler's wait for a worker's lookup answer. flowkv's default (200 ms) is missed now and
# then on a busy two-core machine, and a missed lookup is a cache miss: the tests about hits must
# not depend on the machine's load (a test about the timeout sets its own).
LOOKUP_TIMEOUT_MS = 10_000
# The same for a Redis call: the pipelines' call timeout (0.5 s) and redis-py's socket timeout (5 s)
# make a call past them a miss, and the tests about hits from Redis must not depend on the load either
# (the tests about Redis faults set their own). Both count in the worker's event loop, which a loaded
# machine has been seen to stall for over 5 s: a reply that arrived meanwhile still timed out.
REDIS_PATIENCE = {"tiers.redis.timeout_s": 10.0, "tiers.redis.socket_timeout_s": 20.0}
# A reference ask's kv_transfer_params: keyed apart from every other request (a tag of its own, so
# flowkv finds nothing for it) and stored nowhere: the prompt computed by the model alone.
REFERENCE_ASK = {"flowkv.skip_save": True, "flowkv.tag.test": "reference"}


# Bytes per element of the dtypes the tests serve the tiny model in (KV_BYTES_PER_BLOCK is DTYPE's).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


README = Path(__file__).resolve().parents[1] / "README.md"


def shell_commands(text: str, *, fenced: bool = True) -> list[tuple[int, list[str]]]:
    """The commands of a text as (line, argv), as a shell would split them: continued lines and
    quoted JSON over several lines joined, comments dropped. ``fenced``: only inside a markdown
    file's ```bash blocks."""
    commands: list[tuple[int, list[str]]] = []
    in_bash, pending, start = not fenced, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if fenced and line.startswith("```"):
            in_bash, pending = line.strip() == "```bash", ""
            continue
        if not in_bash:
            continue
        if not pending:
            start = number
        pending = pending[:-1] if pending.endswith("\\") else pending + ("\n" if pending else "")
        pending += line
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        if pending.endswith("\\"):
            continue
        pending = ""
        if argv:
            commands.append((start, argv))
    return commands


def readme_serve_commands(path: Path = README) -> list[tuple[int, list[str]]]:
    """Every ``vllm serve`` command of a markdown file's bash blocks (README.md's by default)."""
    return [(line, argv) for line, argv in shell_commands(path.read_text(encoding="utf-8"))
            if argv[:2] == ["vllm", "serve"]]


def readme_transfer_config(line: int | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a README ``vllm serve`` command (the first one by default), parsed."""
    for at, argv in readme_serve_commands():
        if line is None or at == line:
            return json.loads(argv[argv.index("--kv-transfer-config") + 1])
    raise LookupError(f"no vllm serve command at README.md:{line}")


def flowkv_transfer_config(base: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A README --kv-transfer-config (``base``; by default the first, its quick start), with ``extra``
    in kv_connector_extra_config (over the README's own settings)."""
    config = copy.deepcopy(base) if base is not None else readme_transfer_config()
    config["kv_connector_extra_config"].update(extra)
    return config


def readme_transfer_configs() -> list[dict[str, Any]]:
    """Every ``--kv-transfer-config`` of the README's ``vllm serve`` lines, parsed, in order."""
    return [json.loads(argv[argv.index("--kv-transfer-config") + 1]) for _, argv in readme_serve_commands()
            if "--kv-transfer-config" in argv]


class VllmServer:
    """One ``vllm serve`` process tree on loopback; see the module's docstring."""

    def __init__(self, folder: Path, *, kv_extra: dict[str, Any] | None = None, args: Sequence[str] = (),
                 kv_cache_blocks: int = 512, env: dict[str, str] | None = None, compiled: bool = False,
                 dtype: str = DTYPE, transfer: dict[str, Any] | None = None,
                 worker_process: bool | None = None) -> None:
        self.folder = folder
        self.env = dict(env or {})
        if not (compiled if worker_process is None else worker_process):
            # vLLM's engine core runs the model in its own process (its CPU platform keeps the one-process
            # executor when multiprocessing is off; the API server and the engine core stay two processes):
            # one spawned process and one import of vLLM fewer, ~10 s of a start on two cores. flowkv's
            # scheduler and worker sides still talk over their socket. vLLM's default layout runs in the
            # compiled servers, the shutdown test and the parallel ones (a process per rank).
            self.env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.compiled = compiled
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "server.log"
        # Unix socket paths are limited to 107 bytes: the IPC folder is a short one of its own.
        self.ipc_dir = Path(tempfile.mkdtemp(prefix="fkv-serve-"))
        command = [
            str(Path(sys.executable).parent / "vllm"), "serve", str(tiny_model_dir()),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--block-size", str(BLOCK_SIZE), "--max-model-len", "4096",
            "--no-enable-prefix-caching", "--seed", "0",
            "--kv-cache-memory-bytes",
            str(kv_cache_blocks * KV_BYTES_PER_BLOCK * DTYPE_BYTES[dtype] // DTYPE_BYTES[DTYPE]),
            "--enable-prompt-tokens-details",
        ]
        if not compiled:
            # Eager starts 10-40 s sooner on two cores (torch.compile is not these tests' subject). In bf16
            # its greedy tokens change with the batch a request lands in (near-ties flip): hence float32.
            command.append("--enforce-eager")
        if kv_extra is not None:
            config = flowkv_transfer_config(transfer, ipc_dir=str(self.ipc_dir),
                                            **{"lookup_timeout_ms": LOOKUP_TIMEOUT_MS, **kv_extra})
            command += ["--kv-transfer-config", json.dumps(config)]
        self.command = command + list(args)
        self.proc: subprocess.Popen | None = None

    # -- life -----------------------------------------------------------------

    def start(self) -> VllmServer:
        cores = os.cpu_count() or 1
        # vLLM's default log level whatever an earlier test left in os.environ (flowkv.demo sets ERROR):
        # the log is what a user sees.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_COLOR": "0", "VLLM_LOGGING_LEVEL": "INFO",
               "PYTHONUNBUFFERED": "1",
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
               **self.env}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        with open(self.log_path, "wb") as log:
            # A session of its own: every process of the server is in its process group.
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} before it was ready:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"vllm serve did not answer /health within {READY_TIMEOUT_S:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` to the API server and wait for it; returns its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL whatever is left of the server's processes."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        """Stop the server if it runs and make sure none of its processes is left."""
        if self.proc is not None:
            self.stop()
            if self.live_processes():
                self.kill()
        for leftover in self.ipc_dir.glob("*"):
            leftover.unlink()
        self.ipc_dir.rmdir()

    def wait_for_group_exit(self, timeout_s: float = STOP_TIMEOUT_S) -> list[int]:
        """Wait until no process of the server's group runs (the API server's exit does not wait for
        its engine core and workers to finish exiting); the pids still running at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := self.live_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def live_processes(self) -> list[int]:
        """Pids of the server's process group that are still running (zombies aside)."""
        from flowkv.bench.serve import group_running

        assert self.proc is not None
        return group_running(self.proc.pid)

    # -- HTTP -----------------------------------------------------------------

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def complete(self, prompt: Sequence[int] | str, *, max_tokens: int = 16, stream: bool = False,
                 **fields: Any) -> dict[str, Any]:
        """A greedy completion. Streamed, the chunks are joined into ``text`` and ``token_ids``,
        with ``chunks`` (how many came), ``usage`` and ``done`` (the ``[DONE]`` line came)."""
        body = {"model": MODEL_NAME, "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
                "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, "stream": stream, **fields}
        if stream:
            body["stream_options"] = {"include_usage": True}
        request = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            if not stream:
                return json.load(reply)
            return _join_stream(_sse_events(reply))

    def stream_events(self, prompt: Sequence[int], *, max_tokens: int = 16,
                      **fields: Any) -> Iterator[dict[str, Any] | None]:
        """A streamed completion's events as they arrive; None stands for ``[DONE]``."""
        body = {"model": MODEL_NAME, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                "stream": True, **fields}
        request = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            yield from _sse_events(reply)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as reply:
            return reply.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels`` (0 when there is none)."""
        return metric_value(self.metrics(), name, **labels)

    def worker_stats(self, timeout_ms: int = 30_000) -> dict[str, Any]:
        """flowkv's statistics of the server's worker (rank 0), over its lookup socket."""
        from flowkv.integration._ipc import query_worker

        [socket_file] = self.ipc_dir.glob("flowkv-*-r0.sock")
        return query_worker(socket_file, "stats", timeout_ms=timeout_ms)["stats"]

    # -- the log ----------------------------------------------------------------

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


def _sse_events(reply) -> Iterator[dict[str, Any] | None]:
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        yield None if data == "[DONE]" else json.loads(data)


def _join_stream(events: Iterator[dict[str, Any] | None]) -> dict[str, Any]:
    text, token_ids, chunks, usage, done = [], [], 0, None, False
    for event in events:
        if event is None:
            done = True
            continue
        chunks += 1
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            text.append(choice.get("text", ""))
            token_ids += choice.get("token_ids") or []
    return {"text": "".join(text), "token_ids": token_ids, "chunks": chunks, "usage": usage, "done": done}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum the Prometheus samples of ``name`` in ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        have = dict(_LABEL.findall(match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def start_server(folder: Path, *, kv_extra: dict[str, Any] | None = None, args: Sequence[str] = (),
                 **options: Any) -> VllmServer:
    """Start a server (flowkv when ``kv_extra`` is given, else none) and wait until it is ready."""
    server = VllmServer(folder, kv_extra=kv_extra, args=args, **options)
    try:
        return server.start()
    except BaseException:
        server.close()
        raise


def start_servers(folder: Path, specs: dict[str, dict[str, Any]]) -> dict[str, VllmServer]:
    """Start several servers at once (``start_server``'s options per name, each in ``folder / name``)
    and wait until every one is ready; see ``start_all``."""
    return start_all({name: VllmServer(folder / name, **options) for name, options in specs.items()})


def start_all(servers: dict[str, VllmServer]) -> dict[str, VllmServer]:
    """Start ``servers`` side by side and wait until every one is ready: a start is mostly one process
    importing and loading on one core, so two or three side by side take little longer than one. If one
    fails, all are stopped."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(servers)) as pool:
        started = [pool.submit(server.start) for server in servers.values()]
    try:
        for future in started:
            future.result()
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    return servers
