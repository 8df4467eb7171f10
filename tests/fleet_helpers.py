"""Shared pieces of the fleet tests: a real ``flowkv controller`` process, HTTP calls, chunk keys."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from flowkv.keys import KeyPrefix, chain_hashes

# Readiness bounds (how long a start may take on a loaded 2-core machine), not speed claims.
READY_TIMEOUT_S = 120.0


ROLES = ("instance", "reader", "operator")


class ControllerProcess:
    """``flowkv controller`` in a process of its own, on loopback; ``restart`` keeps its port.

    With ``token``, that one token serves every role (``--token-file``); without, each role has a token file
    of its own (``tokens[role]``, ``token_files[role]``); ``insecure`` runs it with none. ``token_file`` is
    what a reporter needs (the instance token); ``get`` and ``post`` carry the token a path's role needs.
    """

    def __init__(self, folder: Path, *, token: str | None = None, heartbeat_s: float = 0.5,
                 timeout_s: float = 3.0, insecure: bool = False, args: Sequence[str] = (),
                 ca_file: Path | None = None) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.insecure = insecure
        self.args = list(args)
        # an https controller's CA (its --tls-cert): what get and post check its certificate against
        self.context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        self.tokens: dict[str, str] = {}
        self.token_files: dict[str, Path] = {}
        if token is not None:
            self.tokens = dict.fromkeys(ROLES, token)
            self.token_files = dict.fromkeys(ROLES, folder / "token")
            (folder / "token").write_text(token + "\n")
        elif not insecure:
            for role in ROLES:
                self.tokens[role] = f"{role}-{os.urandom(8).hex()}"
                self.token_files[role] = folder / f"{role}.tokens"
                self.token_files[role].write_text(self.tokens[role] + "\n")
        self.token = self.tokens.get("operator")
        self.token_file: Path | None = self.token_files.get("instance")
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> ControllerProcess:
        command = [str(Path(sys.executable).parent / "flowkv"), "controller", "--host", "127.0.0.1",
                   "--port", str(self.port), "--heartbeat-s", str(self.heartbeat_s),
                   "--timeout-s", str(self.timeout_s), "--log-level", "warning"]
        if self.insecure:
            command.append("--insecure")
        elif len(set(self.token_files.values())) == 1:
            command += ["--token-file", str(self.token_files["operator"])]
        else:
            for role, path in self.token_files.items():
                command += [f"--{role}-token-file", str(path)]
        command += self.args
        self.starts += 1
        log = open(self.folder / f"controller-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
        line = self.proc.stdout.readline().decode()
        match = re.search(r"listening on (https?://[\d.]+:(\d+))", line)
        if match is None:
            self.proc.kill()
            raise RuntimeError(f"flowkv controller did not start: {line!r}\n{self.log_tail()}")
        self.url, self.port = match.group(1), int(match.group(2))
        wait_for(lambda: self.get("/health")["status"] == "ok", "the controller answers /health")
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self) -> str:
        logs = sorted(self.folder.glob("controller-*.log"))
        return logs[-1].read_text(errors="replace")[-3000:] if logs else ""

    # -- HTTP -----------------------------------------------------------------

    def token_for(self, path: str) -> str | None:
        """The token a request to ``path`` needs (the operator's serves a reader's calls too)."""
        return self.tokens.get("instance" if path.startswith("/v1/") else "operator")

    def get(self, path: str, *, token: str | None = "default") -> Any:
        return get(self.url + path, token=self.token_for(path) if token == "default" else token,
                   context=self.context)

    def post(self, path: str, body: dict[str, Any], *, token: str | None = "default") -> Any:
        return post(self.url + path, body, token=self.token_for(path) if token == "default" else token,
                    context=self.context)

    def lookup(self, **body: Any) -> list[dict[str, Any]]:
        return self.post("/lookup", body)["holders"]

    def instance(self, instance_id: str) -> dict[str, Any] | None:
        return next((i for i in self.get("/instances") if i["instance_id"] == instance_id), None)


def _headers(token: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", **(extra or {})}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def get(url: str, *, token: str | None = None, headers: dict[str, str] | None = None,
        context: ssl.SSLContext | None = None) -> Any:
    request = urllib.request.Request(url, headers=_headers(token, headers))
    with urllib.request.urlopen(request, timeout=60, context=context) as reply:
        return json.load(reply) if "json" in reply.headers.get("content-type", "") else reply.read().decode()


def post(url: str, body: dict[str, Any] | bytes, *, token: str | None = None,
         headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=_headers(token, headers), method="POST")
    with urllib.request.urlopen(request, timeout=60, context=context) as reply:
        return json.load(reply)


def status_of(call: Callable[[], Any]) -> int:
    """The HTTP status a call ends with (200 when it returns)."""
    try:
        call()
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = READY_TIMEOUT_S) -> Any:
    """Poll ``condition`` until it is truthy (a readiness bound, not a speed claim)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except (OSError, urllib.error.URLError, KeyError, TypeError) as exc:
            last_error = exc
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting until {what}" + (f" (last error: {last_error})" if last_error else ""))


def chunk_keys(tokens: Sequence[int], *, chunk_size: int, hash_name: str = "sha256", model: str = "m",
               world_size: int = 1, rank: int = 0, tags: dict[str, str] | None = None,
               partial: bool = False) -> list[str]:
    """The cache keys an instance with these settings gives the chunks of ``tokens``."""
    prefix = KeyPrefix.build(model=model, world_size=world_size, worker_rank=rank, dtype="bfloat16",
                             layout="test-layout", tags=tags)
    return [prefix.key(h).to_str() for h in chain_hashes(list(tokens), chunk_size, hash_name, partial=partial)]


def start_route(args: Sequence[str], log: Path) -> tuple[str, subprocess.Popen]:
    """``flowkv route --port 0 ARGS`` in a process of its own (its stderr appended to ``log``): its URL once
    it answers ``/health``, and the process (the caller stops it)."""
    proc = subprocess.Popen([str(Path(sys.executable).parent / "flowkv"), "route", "--port", "0",
                             "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=open(log, "ab"), stdin=subprocess.DEVNULL)
    line = proc.stdout.readline().decode()
    if "listening on http://" not in line:
        proc.kill()
        raise RuntimeError(f"flowkv route did not start: {line!r}\n{log.read_text(errors='replace')[-3000:]}")
    url = line.split("listening on ")[1].strip()
    wait_for(lambda: get(url + "/health")["status"] == "ok", "flowkv route answers /health")
    return url, proc


def stop_fleet(processes: Sequence[subprocess.Popen], reporters: Sequence[Any], backends: Sequence[Any],
               controller: ControllerProcess) -> None:
    """Stop what a fleet test started: its processes (SIGTERM), reporters, stand-in backends and controller."""
    for proc in processes:
        proc.terminate()
        proc.wait(timeout=30)
    for reporter in reporters:
        reporter.close()
    for backend in backends:
        backend.close()
    controller.close()


def reporter_script(url: str, instance_id: str, keys: Sequence[str], *, chunk_size: int,
                    hash_name: str = "sha256", token_file: Path | None = None, heartbeat_s: float = 0.5,
                    rank: int = 0, world_size: int = 1, backend_url: str | None = None) -> str:
    """Python source of a process that registers as rank ``rank`` of ``instance_id`` (serving at
    ``backend_url``, default ``http://INSTANCE.invalid``), admits ``keys`` and lives on."""
    return f"""
import time
from flowkv.fleet.protocol import Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session
registration = Registration(instance_id={instance_id!r}, rank={rank}, world_size={world_size},
                            session=new_session(), model="m",
                            tiers=[TierInfo(name="memory", kind="memory", capacity_bytes=1 << 30)],
                            chunk_size={chunk_size}, hash={hash_name!r},
                            url={backend_url or f"http://{instance_id}.invalid"!r})
reporter = Reporter(ReporterConfig(url={url!r}, heartbeat_s={heartbeat_s},
                                   token_file={str(token_file) if token_file else None!r}), registration).start()
for key in {list(keys)!r}:
    reporter.offer("admit", "memory", key)
print("ready" if reporter.wait_idle(120) else "not synced", flush=True)
while True:
    time.sleep(1)
"""


def start_reporter_process(url: str, instance_id: str, keys: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", reporter_script(url, instance_id, keys, **kwargs)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=dict(os.environ))
    line = proc.stdout.readline().decode().strip()
    assert line == "ready", f"reporter process for {instance_id} said {line!r}"
    return proc


class Backend:
    """A stand-in for a vLLM server: answers with its name; ``"hold": true`` waits for ``release``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.release = threading.Event()
        self.go_on = threading.Event()
        self.events: list[str] = []
        self.held = 0
        self.bodies: list[dict] = []
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                backend.bodies.append(body)
                if body.get("hold"):
                    backend.held += 1
                    backend.release.wait(120)
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for n in range(3):
                        self.wfile.write(f"data: {json.dumps({'backend': backend.name, 'n': n})}\n\n".encode())
                        self.wfile.flush()
                        if n == 0 and body.get("trickle"):
                            backend.events.append("backend sent its first piece")
                            backend.go_on.wait(120)
                    self.wfile.write(b"data: [DONE]\n\n")
                    backend.events.append("backend finished")
                    return
                answer = {"backend": backend.name, "object": "text_completion"}
                prefill = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
                if prefill and body.get("refuse_prefill"):
                    self.send_response(500)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                    return
                if prefill:
                    answer["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                                    "flowkv_committed_tokens": 96, "prefilled_by": backend.name}
                payload = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
