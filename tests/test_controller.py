"""The controller as a real process: registration, events, resyncs, liveness, lookups, commands, tokens.

Holders here are real ``Reporter`` objects (in this process or in processes
of their own) speaking HTTP to a real ``flowkv controller``; what they report
are the keys an instance computes for its chunks. The vLLM end of the same
path is in ``test_controller_vllm.py``.
"""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from fleet_helpers import (
    ControllerProcess,
    chunk_keys,
    post,
    start_reporter_process,
    status_of,
    wait_for,
)
from flowkv.fleet.protocol import CommandResult, Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session

TOKENS = list(range(1000, 1100))


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    process = ControllerProcess(tmp_path_factory.mktemp("controller")).start()  # a token file per role
    yield process
    process.close()


def make_reporter(controller, instance_id, *, chunk_size=16, hash_name="sha256", tiers=("memory", "disk"),
                  token="instance", tmp_path=None, **config):
    token_file = None
    token = controller.tokens["instance"] if token == "instance" else token
    if token is not None:
        token_file = tmp_path / f"{instance_id}.token"
        token_file.write_text(token)
    registration = Registration(
        instance_id=instance_id, session=new_session(), model="m", chunk_size=chunk_size, hash=hash_name,
        url=f"http://{instance_id}.invalid", pipeline="test",
        tiers=[TierInfo(name=name, kind=name, capacity_bytes=1 << 20) for name in tiers])
    commands = []

    def run_command(command):
        # What a holder does: carry it out, and report what went as events.
        commands.append(command)
        if command.op == "clear":
            for tier in command.tiers or tiers:
                reporter.offer("clear", tier)
        return CommandResult(id=command.id, ok=True, detail=f"did {command.op}")

    reporter = Reporter(ReporterConfig(url=controller.url, heartbeat_s=0.3,
                                       token_file=str(token_file) if token_file else None, **config),
                        registration, run_command=run_command)
    reporter.commands = commands
    return reporter.start()


def test_lookup_answers_every_holder_with_its_matched_tokens_and_tier_longest_first(controller, tmp_path):
    a = make_reporter(controller, "lk-a", tmp_path=tmp_path)
    b = make_reporter(controller, "lk-b", tmp_path=tmp_path)
    # Another hash function and chunk size: the controller hashes the tokens its way too.
    c = make_reporter(controller, "lk-c", chunk_size=32, hash_name="xxh3_128", tmp_path=tmp_path)
    try:
        keys = chunk_keys(TOKENS, chunk_size=16)
        for key in keys[:5]:
            a.offer("admit", "memory", key)
        b.offer("admit", "memory", keys[0])
        b.offer("admit", "disk", keys[1])
        b.offer("admit", "memory", keys[3])  # not contiguous: chunk 2 is missing
        for key in chunk_keys(TOKENS, chunk_size=32, hash_name="xxh3_128")[:3]:
            c.offer("admit", "memory", key)
        assert all(r.wait_idle(60) for r in (a, b, c))

        holders = controller.lookup(token_ids=TOKENS)
        mine = [h for h in holders if h["instance_id"].startswith("lk-")]
        assert [(h["instance_id"], h["matched_tokens"]) for h in mine] == [
            ("lk-c", 96), ("lk-a", 80), ("lk-b", 32)]
        by_id = {h["instance_id"]: h for h in mine}
        assert by_id["lk-a"]["chunks_by_tier"] == {"memory": 5} and by_id["lk-a"]["tier"] == "memory"
        assert by_id["lk-b"]["chunks_by_tier"] == {"memory": 1, "disk": 1} and by_id["lk-b"]["tier"] == "disk"
        assert by_id["lk-a"]["url"] == "http://lk-a.invalid"

        # Eviction moves a holder down the list; a different prefix matches nobody.
        a.offer("evict", "memory", keys[1])
        assert a.wait_idle(60)
        matched = {h["instance_id"]: h["matched_tokens"] for h in controller.lookup(token_ids=TOKENS)}
        assert matched["lk-a"] == 16 and matched["lk-b"] == 32
        assert not [h for h in controller.lookup(token_ids=[7] + TOKENS[1:]) if h["instance_id"].startswith("lk-")]
        # Keys carry request tags: untagged chunks do not serve a tagged request.
        assert not [h for h in controller.lookup(token_ids=TOKENS, tags={"cache_salt": "x"})
                    if h["instance_id"].startswith("lk-")]
    finally:
        for reporter in (a, b, c):
            reporter.close()


def test_a_gap_in_sequence_numbers_asks_for_a_resync_that_restores_the_directory(controller, tmp_path):
    reporter = make_reporter(controller, "gap", tmp_path=tmp_path)
    keys = chunk_keys(TOKENS, chunk_size=16)
    try:
        for key in keys[:3]:
            reporter.offer("admit", "memory", key)
        assert reporter.wait_idle(60)
        registration = reporter.registration
        # A batch whose first number skips ahead (messages were lost) is refused with 'resync'.
        lost = {"instance_id": "gap", "rank": 0, "session": registration.session, "seq_from": 10_000,
                "events": [{"op": "admit", "tier": "memory", "key": keys[5]}]}
        assert controller.post("/v1/events", lost)["status"] == "resync"
        # A batch sent twice (a lost reply) is applied once.
        snapshots = reporter.counters["snapshots"]
        reporter.offer("admit", "memory", keys[3])
        assert reporter.wait_idle(60)
        # The next heartbeat says which number the holder is at; the controller, knowing it missed
        # nothing, does not ask again.
        wait_for(lambda: reporter.counters["heartbeats"] >= 3, "heartbeats go on")
        assert reporter.counters["snapshots"] == snapshots
        assert controller.lookup(token_ids=TOKENS)[0]["matched_tokens"] >= 64

        # An event dropped on the holder's side (a full queue) is healed by a snapshot.
        with reporter._lock:  # what a full queue does: drop, and note that a snapshot is owed
            reporter._held["memory"].add(keys[4])
            reporter._need_snapshot = True
        assert reporter.wait_idle(60)
        matched = {h["instance_id"]: h["matched_tokens"] for h in controller.lookup(token_ids=TOKENS)}
        assert matched["gap"] == 80
    finally:
        reporter.close()


def test_a_full_queue_drops_and_counts_events_without_blocking_and_a_snapshot_heals(tmp_path):
    # The controller is not there yet: reporting must cost only counters.
    process = ControllerProcess(tmp_path / "late")
    with __import__("socket").socket() as probe:
        probe.bind(("127.0.0.1", 0))
        process.port = probe.getsockname()[1]
    registration = Registration(instance_id="late", session=new_session(), model="m", chunk_size=16,
                                hash="sha256", tiers=[TierInfo(name="memory", kind="memory")])
    reporter = Reporter(ReporterConfig(url=f"http://127.0.0.1:{process.port}", heartbeat_s=0.3, max_queue=2,
                                       token_file=str(process.token_file)), registration).start()
    try:
        keys = chunk_keys(TOKENS, chunk_size=16)
        for key in keys:
            reporter.offer("admit", "memory", key)
        assert reporter.counters["events_dropped"] == len(keys) - 2
        wait_for(lambda: reporter.counters["controller_errors"] >= 1, "the reporter notices no controller")
        process.start()
        assert reporter.wait_idle(120)
        assert process.lookup(token_ids=TOKENS)[0]["matched_tokens"] == 16 * len(keys)
    finally:
        reporter.close()
        process.close()


def test_a_lapsed_instance_is_marked_down_and_comes_back_by_itself(controller):
    keys = chunk_keys(TOKENS, chunk_size=16)
    proc = start_reporter_process(controller.url, "doomed", keys[:2], chunk_size=16,
                                  token_file=controller.token_file)
    try:
        assert controller.instance("doomed")["state"] == "up"
        assert "doomed" in {h["instance_id"] for h in controller.lookup(token_ids=TOKENS)}
        # Stopped (a stuck process, a long GC pause): down after the timeout; continued: up again,
        # re-registered and resynced without anyone's help.
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: controller.instance("doomed")["state"] == "down", "the stopped instance is marked down")
        assert controller.instance("doomed") is not None  # listed while down
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: controller.instance("doomed")["state"] == "up", "the instance comes back by itself")
        wait_for(lambda: "doomed" in {h["instance_id"] for h in controller.lookup(token_ids=TOKENS)},
                 "its chunks are back in the directory")
        # Killed: down, and stays down.
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_for(lambda: controller.instance("doomed")["state"] == "down", "the killed instance is marked down")
        # Down, not dropped: listed, but lookups do not send anyone there.
        assert "doomed" not in {h["instance_id"] for h in controller.lookup(token_ids=TOKENS)}
        down = [h for h in controller.lookup(token_ids=TOKENS, include_down=True) if h["instance_id"] == "doomed"]
        assert down and down[0]["state"] == "down"
        # The instance restarts (a new process, the same id): it registers and resyncs by itself.
        proc = start_reporter_process(controller.url, "doomed", keys[:3], chunk_size=16,
                                      token_file=controller.token_file)
        assert controller.instance("doomed")["state"] == "up"
        matched = {h["instance_id"]: h["matched_tokens"] for h in controller.lookup(token_ids=TOKENS)}
        assert matched["doomed"] == 48
    finally:
        proc.kill()
        proc.wait()


def test_a_controller_restart_is_followed_by_a_resync_that_restores_the_directory(tmp_path):
    process = ControllerProcess(tmp_path / "restart").start()
    reporter = Reporter(ReporterConfig(url=process.url, heartbeat_s=0.3, token_file=str(process.token_file)),
                        Registration(instance_id="survivor", session=new_session(), model="m", chunk_size=16,
                                     hash="sha256", tiers=[TierInfo(name="memory", kind="memory")])).start()
    try:
        keys = chunk_keys(TOKENS, chunk_size=16)
        for key in keys[:4]:
            reporter.offer("admit", "memory", key)
        assert reporter.wait_idle(60)
        assert process.lookup(token_ids=TOKENS)[0]["matched_tokens"] == 64
        registrations = reporter.counters["registrations"]
        process.restart()  # SIGKILL and start again on the same port: the directory is empty
        # (the registration count below shows it: the reporter registers again only when the
        # restarted controller does not know it)
        wait_for(lambda: process.lookup(token_ids=TOKENS), "the instance resyncs after the restart")
        assert process.lookup(token_ids=TOKENS)[0]["matched_tokens"] == 64
        assert reporter.counters["registrations"] == registrations + 1
        assert process.instance("survivor")["state"] == "up"
    finally:
        reporter.close()
        process.close()


def test_commands_need_the_token_and_reach_the_instances(controller, tmp_path):
    reporter = make_reporter(controller, "cmd", tmp_path=tmp_path)
    keys = chunk_keys(TOKENS, chunk_size=16)
    try:
        for key in keys[:3]:
            reporter.offer("admit", "memory", key)
        assert reporter.wait_idle(60)
        # No token, a wrong one, another role's: refused, nothing queued.
        for token in (None, "wrong", controller.tokens["reader"], controller.tokens["instance"]):
            assert status_of(lambda: controller.post("/clear", {"instance_id": "cmd"}, token=token)) == 401
        for token in ("wrong", controller.tokens["reader"], controller.tokens["operator"]):
            assert status_of(lambda: post(controller.url + "/v1/register",
                                          reporter.registration.model_dump(mode="json"), token=token)) == 401
        assert status_of(lambda: controller.post("/pin", {"token_ids": TOKENS}, token=None)) == 401
        assert reporter.commands == []
        # Queries need a reader's (or an operator's) token.
        assert status_of(lambda: controller.post("/lookup", {"token_ids": TOKENS}, token=None)) == 401
        assert "cmd" in {h["instance_id"] for h in controller.post(
            "/lookup", {"token_ids": TOKENS}, token=controller.tokens["reader"])["holders"]}

        # Without an instance, a pin goes to every instance holding a prefix.
        assert "cmd" in controller.post("/pin", {"token_ids": TOKENS[:40]})["instances"]
        reply = controller.post("/pin", {"instance_id": "cmd", "token_ids": TOKENS, "ttl_s": 60, "wait_s": 30})
        assert reply["instances"] == ["cmd"] and [r["ok"] for r in reply["results"].values()] == [True]
        pinned = [c for c in reporter.commands if c.op == "pin"]
        assert [(c.token_ids, c.ttl_s) for c in pinned] == [(TOKENS[:40], 300.0), (TOKENS, 60)]

        reply = controller.post("/prefetch", {"instance_id": "cmd", "token_ids": TOKENS, "wait_s": 30})
        assert reply["instances"] == ["cmd"] and len(reply["results"]) == 1
        assert status_of(lambda: controller.post("/clear", {"instance_id": "nobody"})) == 404

        reply = controller.post("/clear", {"instance_id": "cmd", "wait_s": 30})
        assert reply["instances"] == ["cmd"] and list(reply["results"].values())[0]["ok"]
        assert "cmd" not in {h["instance_id"] for h in controller.lookup(token_ids=TOKENS)}
    finally:
        reporter.close()


def test_a_reporter_with_a_bad_token_is_refused_and_only_counts_it(controller, tmp_path):
    reporter = make_reporter(controller, "intruder", token="not-the-token", tmp_path=tmp_path)
    try:
        reporter.offer("admit", "memory", chunk_keys(TOKENS, chunk_size=16)[0])
        wait_for(lambda: reporter.counters["controller_errors"] >= 2, "the reporter is refused")
        assert controller.instance("intruder") is None
    finally:
        reporter.close()


def test_metrics_openapi_and_the_dashboard_are_served(controller, tmp_path):
    reporter = make_reporter(controller, "seen", tmp_path=tmp_path)
    try:
        assert reporter.wait_idle(60)  # registered and synced: what follows goes as an event
        reporter.offer("admit", "memory", chunk_keys(TOKENS, chunk_size=16)[0])
        assert reporter.wait_idle(60)
        for path in ("/metrics", "/openapi.json", "/docs", "/instances", "/api/events", "/api/history"):
            assert status_of(lambda: urllib.request.urlopen(controller.url + path)) == 401, path
        metrics = controller.get("/metrics", token=controller.tokens["reader"])
        assert 'flowkv_controller_chunks{instance="seen",rank="0"} 1' in metrics
        assert 'flowkv_controller_instances{state="up"}' in metrics
        schema = controller.get("/openapi.json")
        assert {"/lookup", "/instances", "/clear", "/pin", "/prefetch", "/health", "/metrics"} <= set(schema["paths"])
        assert "swagger" in controller.get("/docs").lower()
        with urllib.request.urlopen(controller.url + "/") as reply:  # the page itself holds no data: no token
            page = reply.read().decode()
        assert "/dashboard.js" in page and "http" not in page.split("<script")[1].split("</script>")[0].replace(
            'src="/dashboard.js"', "")
        events = controller.get("/api/events?limit=200")
        assert any(e["instance_id"] == "seen" and e["op"] == "admit" for e in events)
        assert json.dumps(controller.get("/health", token=None))
    finally:
        reporter.close()


def test_chunks_in_a_node_servers_shared_tier_count_for_the_instances_that_share_it(controller, tmp_path):
    # A node server reports as a holder of its own (kind "server"); an instance whose pipeline reads
    # through it lists it in `shared`. Lookups name the instances, never the server itself.
    config = ReporterConfig(url=controller.url, heartbeat_s=0.3, token_file=str(controller.token_file))
    server = Reporter(config, Registration(instance_id="node-1", kind="server", session=new_session(), model="m",
                                           chunk_size=16, hash="sha256",
                                           tiers=[TierInfo(name="shm", kind="memory")])).start()
    sharing = Reporter(config, Registration(instance_id="shares-node-1", session=new_session(), model="m",
                                            chunk_size=16, hash="sha256", shared=["node-1"],
                                            tiers=[TierInfo(name="memory", kind="memory"),
                                                   TierInfo(name="server", kind="server")])).start()
    alone = Reporter(config, Registration(instance_id="alone", session=new_session(), model="m", chunk_size=16,
                                          hash="sha256", tiers=[TierInfo(name="memory", kind="memory")])).start()
    try:
        keys = chunk_keys(TOKENS, chunk_size=16)
        sharing.offer("admit", "memory", keys[0])
        for key in keys[:4]:
            server.offer("admit", "shm", key)
        assert all(r.wait_idle(60) for r in (server, sharing, alone))
        answers = {h["instance_id"]: h for h in controller.lookup(token_ids=TOKENS)}
        assert "node-1" not in answers and "alone" not in answers
        assert answers["shares-node-1"]["matched_tokens"] == 64
        assert answers["shares-node-1"]["chunks_by_tier"] == {"memory": 1, "node-1/shm": 3}
        assert answers["shares-node-1"]["tier"] == "node-1/shm"
        assert controller.instance("node-1")["kind"] == "server"
    finally:
        for reporter in (server, sharing, alone):
            reporter.close()


def test_the_controller_table_comes_from_the_pipeline_file_or_the_connector_extra_config(tmp_path):
    from flowkv.integration.vllm.fleet import default_instance_id
    from flowkv.integration.vllm.settings import ConnectorSettings
    from flowkv.pipeline import PipelineError, builtin_pipelines, load_pipeline

    settings = ConnectorSettings.from_extra_config(
        {"pipeline": "local-cpu", "controller": {"url": "https://127.0.0.1:9100", "heartbeat_s": 0.5,
                                                 "token_file": "~/.flowkv/instance.token", "ca_file": "/ca.pem"}},
        default_model="m")
    controller = load_pipeline(settings.pipeline, overrides=settings.overrides).controller
    assert (controller.url, controller.heartbeat_s, controller.kv_events) == ("https://127.0.0.1:9100", 0.5, True)
    assert (controller.token_file, controller.ca_file) == ("~/.flowkv/instance.token", "/ca.pem")
    assert load_pipeline("local-cpu").controller.url is None  # off unless asked for

    text = builtin_pipelines()["local-cpu"].read_text() + '\n[controller]\nurll = "http://127.0.0.1:9100"\n'
    path = tmp_path / "mine.toml"
    path.write_text(text)
    try:
        load_pipeline(str(path))
    except PipelineError as exc:
        assert "urll" in str(exc) and f"{path}:" in str(exc)
    else:
        raise AssertionError("a misspelled [controller] key must be refused")

    assert default_instance_id("http://10.0.0.7:8001/", "abc") == "10.0.0.7:8001"
    assert default_instance_id(None, "0123456789abcdef").endswith("-0123456789ab")


def test_a_token_file_under_home_is_read_as_the_readme_writes_it(tmp_path, monkeypatch):
    """The README's extra config names "token_file": "~/.flowkv-token": the reporter expands the
    home folder, so the instance registers with the token in the file there."""
    process = ControllerProcess(tmp_path / "tilde").start()
    home = tmp_path / "home"
    home.mkdir()
    (home / ".flowkv-token").write_text(process.token_file.read_text())
    monkeypatch.setenv("HOME", str(home))
    reporter = Reporter(ReporterConfig(url=process.url, heartbeat_s=0.3, token_file="~/.flowkv-token"),
                        Registration(instance_id="at-home", session=new_session(), model="m", chunk_size=16,
                                     hash="sha256", tiers=[TierInfo(name="memory", kind="memory")])).start()
    try:
        reporter.offer("admit", "memory", chunk_keys(TOKENS, chunk_size=16)[0])
        assert reporter.wait_idle(60)
        assert reporter.counters["registrations"] == 1
        assert process.instance("at-home")["state"] == "up"
    finally:
        reporter.close()
        process.close()
