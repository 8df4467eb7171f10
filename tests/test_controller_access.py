"""Who may ask the controller what, against a real ``flowkv controller`` process.

Each test is an attack that used to succeed (issue 25, item 8) and now fails,
with the honest client still served: an open default, a web page rebinding
its name to loopback (``Host``), one token for instances and operators, an
instance taking over another's id, ``chunk_size: 0``, long ``/clear`` waits
starving the worker pool, unbounded ``ttl_s`` and bodies.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.error
from pathlib import Path

import pytest

from fleet_helpers import ControllerProcess, chunk_keys, get, post, status_of, wait_for
from test_route import Backend, complete
from flowkv.fleet.protocol import CommandResult, Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session

TOKENS = list(range(100, 164))  # 4 chunks of 16
FLOWKV = str(Path(sys.executable).parent / "flowkv")


def registration(instance_id: str, **fields) -> Registration:
    return Registration(instance_id=instance_id, session=new_session(), model="m", chunk_size=16, hash="sha256",
                        url=f"http://{instance_id}.invalid", tiers=[TierInfo(name="memory", kind="memory")],
                        **fields)


def reporter_for(controller: ControllerProcess, instance_id: str, token_file: Path, **kwargs) -> Reporter:
    return Reporter(ReporterConfig(url=controller.url, heartbeat_s=0.3, token_file=str(token_file)),
                    registration(instance_id), **kwargs).start()


def holders(controller: ControllerProcess) -> dict[str, int]:
    return {h["instance_id"]: h["matched_tokens"] for h in controller.lookup(token_ids=TOKENS)}


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    process = ControllerProcess(tmp_path_factory.mktemp("controller"), args=["--max-body-bytes", "65536"]).start()
    yield process
    process.close()


def start_fails(*args: str) -> str:
    """What ``flowkv controller ARGS`` says when it refuses to start."""
    done = subprocess.run([FLOWKV, "controller", "--port", "0", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    return done.stderr


def test_no_token_no_start_unless_insecure_and_insecure_is_loopback_only(tmp_path):
    assert "--insecure" in start_fails()
    assert "loopback only" in start_fails("--insecure", "--host", "0.0.0.0")
    empty = tmp_path / "empty.tokens"
    empty.write_text("# nobody yet\n")
    assert "holds no token" in start_fails("--reader-token-file", str(empty))

    open_one = ControllerProcess(tmp_path / "insecure", insecure=True).start()
    try:  # the whole API without a token, on loopback
        reporter = Reporter(ReporterConfig(url=open_one.url, heartbeat_s=0.3), registration("open")).start()
        try:
            reporter.offer("admit", "memory", chunk_keys(TOKENS, chunk_size=16)[0])
            assert reporter.wait_idle(60)
            assert holders(open_one) == {"open": 16}
            assert open_one.post("/clear", {"instance_id": "open"})["instances"] == ["open"]
        finally:
            reporter.close()
    finally:
        open_one.close()


def test_every_endpoint_but_health_needs_a_token_of_its_role(controller):
    tokens = controller.tokens
    reporter = reporter_for(controller, "roles", controller.token_file)
    try:
        reporter.offer("admit", "memory", chunk_keys(TOKENS, chunk_size=16)[0])
        assert reporter.wait_idle(60)
        lookup = lambda token: controller.post("/lookup", {"token_ids": TOKENS}, token=token)  # noqa: E731
        clear = lambda token: controller.post("/clear", {"instance_id": "nobody"}, token=token)  # noqa: E731
        # What each role may do: a reader reads, an operator reads and commands, an instance only reports.
        assert [status_of(lambda: lookup(tokens[role])) for role in ("reader", "operator", "instance")] == \
            [200, 200, 401]
        assert [status_of(lambda: clear(tokens[role])) for role in ("reader", "operator", "instance")] == \
            [401, 404, 401]
        for path in ("/instances", "/metrics", "/api/events", "/api/history", "/openapi.json", "/docs"):
            assert [status_of(lambda: controller.get(path, token=token))
                    for token in (None, tokens["instance"], tokens["reader"])] == [401, 401, 200], path
        for path in ("/pin", "/prefetch", "/clear", "/lookup", "/v1/register", "/v1/heartbeat", "/v1/events",
                     "/v1/snapshot"):
            assert status_of(lambda: controller.post(path, {}, token=None)) == 401, path
        assert controller.get("/health", token=None)["up"] >= 1
        assert "dashboard.js" in controller.get("/", token=None)  # a page without data; it asks for a token
        assert holders(controller)["roles"] == 16  # and the instance was never disturbed
    finally:
        reporter.close()


def test_a_request_naming_another_host_or_origin_is_refused(tmp_path):
    # A web page whose name resolves to 127.0.0.1 (DNS rebinding) reaches the port, with its own name in Host.
    process = ControllerProcess(tmp_path / "hosts", args=["--allow-host", "controller.example"]).start()
    try:
        clear = lambda **headers: post(process.url + "/clear", {}, token=process.token,  # noqa: E731
                                       headers=headers)
        assert status_of(lambda: clear(Host="attacker.example")) == 403
        assert status_of(lambda: get(process.url + "/health", headers={"Host": "attacker.example:9100"})) == 403
        assert status_of(lambda: clear(Origin="http://attacker.example")) == 403
        assert status_of(lambda: clear(Origin="null")) == 403
        # Loopback names, the address bound, and --allow-host are allowed.
        for host in ("127.0.0.1", f"127.0.0.1:{process.port}", "localhost:1", "[::1]:9100", "controller.example"):
            assert status_of(lambda: clear(Host=host)) == 200, host
        assert status_of(lambda: clear(Origin=f"http://localhost:{process.port}")) == 200
        assert status_of(lambda: clear(Origin="https://controller.example")) == 200
    finally:
        process.close()


def test_an_instance_cannot_report_for_another_instances_id(tmp_path):
    folder = tmp_path / "owners"
    folder.mkdir()
    instances = folder / "instances.tokens"
    instances.write_text("token-of-a\ntoken-of-b\ntoken-of-node node-1  # this one reports as node-1 only\n")
    process = ControllerProcess(folder, args=["--instance-token-file", str(instances)]).start()
    files = {}
    for name in ("a", "b", "node"):
        files[name] = folder / f"{name}.token"
        files[name].write_text(f"token-of-{name}\n")
    keys = chunk_keys(TOKENS, chunk_size=16)
    honest = reporter_for(process, "a", files["a"])
    try:
        for key in keys:
            honest.offer("admit", "memory", key)
        assert honest.wait_idle(60)
        # b's token registers "a" (a new session would drop a's chunks), sends it events, heartbeats for it.
        impostor = registration("a")
        for path, body in (("/v1/register", impostor.model_dump(mode="json")),
                           ("/v1/events", {"instance_id": "a", "session": impostor.session, "seq_from": 0,
                                           "events": [{"op": "clear", "tier": "memory"}]}),
                           ("/v1/heartbeat", {"instance_id": "a", "session": impostor.session, "seq": 0}),
                           ("/v1/snapshot", {"instance_id": "a", "session": impostor.session, "seq": 0,
                                             "tiers": {}})):
            assert status_of(lambda: post(process.url + path, body, token="token-of-b")) == 403, path
        assert status_of(lambda: post(process.url + "/v1/register", registration("b").model_dump(mode="json"),
                                      token="token-of-node")) == 403
        assert status_of(lambda: post(process.url + "/v1/register", registration("node-1").model_dump(mode="json"),
                                      token="token-of-a")) == 403
        assert holders(process) == {"a": 64}
        assert process.instance("a")["state"] == "up"
        # Each may report for its own: b for a new id, node for node-1.
        others = [reporter_for(process, "b", files["b"]), reporter_for(process, "node-1", files["node"])]
        assert all(r.wait_idle(60) for r in others)
        assert {"a", "b", "node-1"} <= {i["instance_id"] for i in process.get("/instances")}
        assert honest.counters["registrations"] == 1  # never knocked off
        for reporter in others:
            reporter.close()
    finally:
        honest.close()
        process.close()


def test_fields_are_validated_so_a_bad_report_cannot_break_lookups(controller):
    reporter = reporter_for(controller, "valid", controller.token_file)
    try:
        reporter.offer("admit", "memory", chunk_keys(TOKENS, chunk_size=16)[0])
        assert reporter.wait_idle(60)
        instance = controller.tokens["instance"]
        for bad in ({"chunk_size": 0}, {"chunk_size": -16}, {"rank": -1}, {"world_size": 0}, {"instance_id": ""}):
            body = registration("bad").model_dump(mode="json") | bad
            assert status_of(lambda: controller.post("/v1/register", body, token=instance)) == 422, bad
        assert holders(controller)["valid"] == 16  # lookups still answer
        for command, body in (("/clear", {"wait_s": 1000}), ("/clear", {"wait_s": -1}),
                              ("/pin", {"token_ids": TOKENS, "ttl_s": 1e12}), ("/pin", {"token_ids": TOKENS,
                                                                                       "ttl_s": 0}),
                              ("/prefetch", {"token_ids": TOKENS, "wait_s": float("1e9")})):
            assert status_of(lambda: controller.post(command, body)) == 422, (command, body)
        assert status_of(lambda: controller.get("/api/events?limit=-5")) == 422
        # A body past --max-body-bytes: unread without a token (401), refused with one (413).
        huge = b'{"token_ids": [' + b"1," * 40_000 + b"1]}"
        assert status_of(lambda: post(controller.url + "/lookup", huge)) == 401
        assert status_of(lambda: post(controller.url + "/lookup", huge, token=controller.tokens["reader"])) == 413
        assert holders(controller)["valid"] == 16
    finally:
        reporter.close()


def test_long_command_waits_do_not_starve_health_or_lookups(controller):
    # The instance takes the clears but confirms none until the test lets it: each /clear waits its full wait_s.
    release = threading.Event()

    def run_command(command):
        release.wait(120)
        return CommandResult(id=command.id, ok=True)

    reporter = reporter_for(controller, "slow", controller.token_file, run_command=run_command)
    # Another instance holding the prompt, which the clears do not name: what /lookup must still find.
    bystander = reporter_for(controller, "bystander", controller.token_file)
    answered: list[str] = []
    try:
        for holder in (reporter, bystander):
            holder.offer("admit", "memory", chunk_keys(TOKENS, chunk_size=16)[0])
            assert holder.wait_idle(60)
        before = _clears_queued(controller)

        def clear() -> None:
            controller.post("/clear", {"instance_id": "slow", "wait_s": 30})
            answered.append("clear")

        clears = [threading.Thread(target=clear, daemon=True) for _ in range(60)]
        for thread in clears:
            thread.start()
        wait_for(lambda: _clears_queued(controller) >= before + 60, "all 60 clears are waiting")
        # More waiting clears than the worker pool has threads; /health and /lookup still answer meanwhile.
        assert controller.get("/health", token=None)["status"] == "ok"
        assert controller.instance("slow") is not None  # /instances and /lookup run on the worker pool
        assert holders(controller)["bystander"] == 16
        answered.append("health and lookup")
        release.set()
        for thread in clears:
            thread.join(120)
        assert answered[0] == "health and lookup" and answered.count("clear") == 60
    finally:
        release.set()
        reporter.close()
        bystander.close()


def _clears_queued(controller: ControllerProcess) -> int:
    for line in controller.get("/metrics").splitlines():
        if line.startswith('flowkv_controller_messages_total{kind="clears"}'):
            return int(float(line.split()[-1]))
    return 0


def test_over_tls_reporters_routers_and_people_check_the_certificate(tmp_path):
    from redis_servers import TlsFiles  # the same throw-away CA and 127.0.0.1 certificate

    tls = TlsFiles.create(tmp_path / "pki")
    process = ControllerProcess(tmp_path / "tls", ca_file=tls.ca_cert,
                                args=["--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key)]).start()
    try:
        assert process.url.startswith("https://127.0.0.1:")
        trusting = Reporter(ReporterConfig(url=process.url, heartbeat_s=0.3, token_file=str(process.token_file),
                                           ca_file=str(tls.ca_cert)), registration("over-tls")).start()
        # Without the CA the certificate is not trusted: the reporter is refused, counted, and goes on.
        doubting = reporter_for(process, "no-ca", process.token_file)
        try:
            trusting.offer("admit", "memory", chunk_keys(TOKENS, chunk_size=16)[0])
            assert trusting.wait_idle(60)
            assert holders(process) == {"over-tls": 16}
            wait_for(lambda: doubting.counters["controller_errors"] >= 1, "the untrusting reporter fails")
            assert process.instance("no-ca") is None
            # Plain HTTP to the TLS port gets no answer.
            assert _plain_http_fails(process.url)
            # flowkv route asks an https controller, given its CA.
            backend = Backend("a")
            route = subprocess.Popen([FLOWKV, "route", "--port", "0", "--backend", backend.url, "--controller",
                                      process.url, "--controller-ca-file", str(tls.ca_cert), "--token-file",
                                      str(process.token_files["reader"]), "--lookup-timeout-s", "30",
                                      "--log-level", "warning"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
            try:
                url = route.stdout.readline().decode().split("listening on ")[1].strip()
                wait_for(lambda: get(url + "/health")["status"] == "ok", "route is up")
                _, headers = complete(url, TOKENS)
                assert headers["x-flowkv-route"] == "no-holder"  # the lookup answered (no holder at a's URL)
            finally:
                route.terminate()
                route.wait(timeout=30)
                backend.close()
        finally:
            trusting.close()
            doubting.close()
    finally:
        process.close()


def _plain_http_fails(url: str) -> bool:
    try:
        get(url.replace("https://", "http://") + "/health")
    except (urllib.error.URLError, ConnectionError, OSError):
        return True
    return False


def test_a_wrong_token_in_a_url_error_names_the_role(controller):
    try:
        controller.post("/clear", {}, token=controller.tokens["reader"])
    except urllib.error.HTTPError as exc:
        assert exc.code == 401 and "operator" in exc.read().decode()
    else:
        raise AssertionError("a reader's token must not clear")
