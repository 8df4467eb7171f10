"""Real redis-server processes for the tier tests, and payloads the tiers accept.

Fixtures (import them by name into a test module: ``from redis_servers import redis_server``):

- ``redis_server``: one standalone server for the session (tests isolate
  themselves by namespace).
- ``redis_cluster``: three masters joined with ``redis-cli --cluster create``.
- ``own_redis_server``: a standalone server for one test, free to kill,
  pause and restart.

Every server listens on a free loopback port, keeps its files in a pytest
tmp dir, persists nothing, and is stopped when its fixture ends.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flowkv import payload

__all__ = [
    "RedisServer",
    "TlsFiles",
    "make_payload",
    "own_redis_server",
    "redis_cluster",
    "redis_server",
    "redis_tls_server",
]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
# How long a server may take to answer PING or a cluster to agree: readiness
# of a fixture, not a performance claim.
_READY_S = 20.0


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback port nobody listens on (and port + 10000 too, for a cluster bus)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(20000, 40000)
        if _port_is_free(port) and (not with_cluster_bus or _port_is_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found for redis-server")


@dataclass(frozen=True)
class TlsFiles:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def create(cls, folder: Path) -> TlsFiles:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("openssl is not installed")
        folder.mkdir(parents=True, exist_ok=True)
        files = cls(folder / "ca.crt", folder / "server.crt", folder / "server.key", folder / "client.crt",
                    folder / "client.key")
        ca_key, csr, ext = folder / "ca.key", folder / "server.csr", folder / "san.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for args in (
            ["req", "-x509", *ec, "-keyout", ca_key, "-out", files.ca_cert, "-subj", "/CN=flowkv-test-ca", "-days", "2"],
            ["req", *ec, "-keyout", files.server_key, "-out", csr, "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", csr, "-CA", files.ca_cert, "-CAkey", ca_key, "-CAcreateserial",
             "-out", files.server_cert, "-days", "2", "-extfile", ext],
            ["req", *ec, "-keyout", files.client_key, "-out", csr, "-subj", "/CN=flowkv-test-client"],
            ["x509", "-req", "-in", csr, "-CA", files.ca_cert, "-CAkey", ca_key, "-CAcreateserial",
             "-out", files.client_cert, "-days", "2"],
        ):
            subprocess.run([openssl, *map(str, args)], check=True, capture_output=True, timeout=_READY_S)
        return files


class RedisServer:
    """One redis-server process on 127.0.0.1; start, kill, pause and restart it."""

    def __init__(
        self,
        workdir: Path,
        *,
        cluster: bool = False,
        tls: TlsFiles | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if not Path(REDIS_SERVER).exists():
            pytest.skip("redis-server is not installed")
        self.workdir = workdir
        self.cluster = cluster
        self.tls = tls
        self.extra_args = extra_args
        self.port = free_port(with_cluster_bus=cluster)
        self.process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    def start(self) -> RedisServer:
        """Start on ``self.port`` (the same port on a restart) and wait for PING."""
        args = [
            REDIS_SERVER,
            *(("--port", "0", "--tls-port") if self.tls else ("--port",)), str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{self.port}.conf",
                "--cluster-node-timeout", "2000",
            ]
        if self.tls:
            args += [
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca_cert),
                "--tls-auth-clients", "no",
            ]
        args += list(self.extra_args)
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_for_ping()
        return self

    def _wait_for_ping(self) -> None:
        deadline = time.monotonic() + _READY_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                log = self.log_path.read_text() if self.log_path.exists() else ""
                raise RuntimeError(f"redis-server on port {self.port} exited: {log[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                    if self.tls:
                        context = ssl.create_default_context(cafile=str(self.tls.ca_cert))
                        # (a server started with --tls-auth-clients yes asks for it)
                        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
                        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                            sock.sendall(b"PING\r\n")
                            reply = sock.recv(64)
                    else:
                        raw.sendall(b"PING\r\n")
                        reply = raw.recv(64)
                # -NOAUTH also proves the server is up.
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def cli(self, *args: str) -> str:
        """Run ``redis-cli -p PORT ARGS`` and return its output."""
        tls_args = ["--tls", "--cacert", str(self.tls.ca_cert), "--cert", str(self.tls.client_cert),
                    "--key", str(self.tls.client_key)] if self.tls else []
        done = subprocess.run(
            [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *tls_args, *args],
            check=True, capture_output=True, text=True, timeout=_READY_S,
        )
        return done.stdout.strip()

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-workload."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server dies too
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung server)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=_READY_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class RedisClusterServers:
    """Three masters (no replicas) forming one Redis Cluster on loopback."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [RedisServer(workdir / f"node{i}", cluster=True) for i in range(3)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [REDIS_CLI, "--cluster", "create",
             *(f"127.0.0.1:{node.port}" for node in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, text=True, timeout=_READY_S,
        )
        deadline = time.monotonic() + _READY_S
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in node.cli("CLUSTER", "INFO") for node in self.nodes):
                return self
            time.sleep(0.05)
        raise RuntimeError("the three-master cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("redis-standalone")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory):
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_tls_server(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("redis-tls")
    server = RedisServer(folder, tls=TlsFiles.create(folder / "pki")).start()
    yield server
    server.stop()


@pytest.fixture
def own_redis_server(tmp_path: Path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


# -- payloads ------------------------------------------------------------------


def make_payload(nbytes: int, seed: int = 0, *, key: str | None = None) -> bytes:
    """A real flowkv payload (raw uint8 body) of ``nbytes``, or just its header when ``nbytes`` is smaller;
    bound to ``key`` (a tier that checks keys, like the disk tier, refuses it under any other)."""
    body = random.Random(seed).randbytes(max(0, nbytes - _HEADER_BYTES))
    return payload.encode(torch.frombuffer(bytearray(body), dtype=torch.uint8) if body
                          else torch.empty(0, dtype=torch.uint8), key=key)


# A 1-D uint8 payload's header is the same length whatever its body's.
_HEADER_BYTES = len(payload.encode(torch.empty(0, dtype=torch.uint8)))
