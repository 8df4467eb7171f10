"""A tensor-parallel instance in the controller and ``flowkv route``: a holder per rank, one instance to route to.

vLLM runs a worker per rank; each rank's flowkv engine stores its own shard of
every chunk under keys that carry the world size and its rank, and registers
with the controller as rank ``r`` of its instance (``Registration.rank``,
``world_size``), reporting its own tiers. Here the ranks are real ``Reporter``
objects, and one a process of its own killed with SIGKILL, speaking HTTP to a
real ``flowkv controller``; a real ``flowkv route`` chooses between a TP=2
instance ``tp`` and a TP=1 instance ``one`` (stand-in backends that answer with
their name). One story in steps: the module keeps its order under --shuffle.

The controller lists each rank as a holder; it counts for an instance (in
``/instances``, ``/lookup`` and so for the router) only the chunks every rank
holds its shard of, from chunk 0, as vLLM's scheduler takes the smallest of
its ranks' answers; an instance with a rank down or never registered serves
nothing.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from fleet_helpers import (Backend, ControllerProcess, chunk_keys, start_reporter_process, start_route, stop_fleet,
                           wait_for)
from flowkv.fleet.protocol import Registration, TierInfo
from flowkv.fleet.reporter import Reporter, ReporterConfig, new_session

pytestmark = pytest.mark.in_order

CHUNK = 16
DOC = list(range(3000, 3000 + 8 * CHUNK))  # eight chunks
GIB = 1 << 30


def tp_keys(rank: int, world_size: int = 2) -> list[str]:
    return chunk_keys(DOC, chunk_size=CHUNK, world_size=world_size, rank=rank)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    controller = ControllerProcess(folder / "controller", heartbeat_s=0.3, timeout_s=3.0).start()
    backends = {name: Backend(name) for name in ("tp", "one")}
    reporters: dict[str, Reporter] = {}

    def report(name: str, instance_id: str, *, rank: int = 0, world_size: int = 1) -> Reporter:
        registration = Registration(
            instance_id=instance_id, rank=rank, world_size=world_size, session=new_session(), model="m",
            url=backends[instance_id].url if instance_id in backends else None, chunk_size=CHUNK, hash="sha256",
            tiers=[TierInfo(name="memory", kind="memory", capacity_bytes=GIB)])
        reporters[name] = Reporter(ReporterConfig(url=controller.url, heartbeat_s=0.3,
                                                  token_file=str(controller.token_file)), registration).start()
        return reporters[name]

    report("tp0", "tp", rank=0, world_size=2)
    report("tp1", "tp", rank=1, world_size=2)
    report("one", "one")
    processes: list[subprocess.Popen] = []
    url, route = start_route(["--backend", backends["tp"].url, "--backend", backends["one"].url,
                              "--controller", controller.url, "--token-file", str(controller.token_files["reader"]),
                              "--lookup-timeout-s", "30"], folder / "route.log")
    try:
        yield {"controller": controller, "backends": backends, "reporters": reporters, "report": report,
               "route": url, "processes": processes}
    finally:
        stop_fleet([route, *processes], list(reporters.values()), list(backends.values()), controller)


def admit(reporter: Reporter, keys: list[str]) -> None:
    for key in keys:
        reporter.offer("admit", "memory", key)
    assert reporter.wait_idle(60)


def matched(fleet, **body) -> dict[str, int]:
    """Each answering instance once: its matched tokens (and no instance twice)."""
    holders = fleet["controller"].lookup(token_ids=DOC, **body)
    names = [h["instance_id"] for h in holders]
    assert len(names) == len(set(names)), names
    return {h["instance_id"]: h["matched_tokens"] for h in holders}


def routed(fleet) -> tuple[str, str, int]:
    """Where ``flowkv route`` sends the document: the backend, why, the matched tokens it was told."""
    body = json.dumps({"model": "m", "prompt": DOC, "max_tokens": 1}).encode()
    request = urllib.request.Request(fleet["route"] + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer, headers = json.load(reply), reply.headers
    return answer["backend"], headers["x-flowkv-route"], int(headers["x-flowkv-matched-tokens"])


def test_each_rank_is_listed_and_the_instance_counts_the_chunks_every_rank_holds(fleet):
    reporters = fleet["reporters"]
    admit(reporters["tp0"], tp_keys(0))  # rank 0 holds its shard of all eight chunks
    admit(reporters["tp1"], tp_keys(1)[:3])  # rank 1 of the first three only
    admit(reporters["one"], chunk_keys(DOC, chunk_size=CHUNK)[:5])
    tp = fleet["controller"].instance("tp")
    assert (tp["state"], tp["world_size"], tp["ranks"], tp["missing_ranks"]) == ("up", 2, [0, 1], [])
    assert [(h["rank"], h["state"], h["chunks"], h["tiers"]) for h in tp["holders"]] == [
        (0, "up", 8, {"memory": 8}), (1, "up", 3, {"memory": 3})]
    # What the instance can serve: the chunks both ranks hold; its memory is both ranks'.
    assert tp["chunks"] == 3
    assert tp["tiers"][0]["chunks"] == 3 and tp["tiers"][0]["capacity_bytes"] == 2 * GIB
    # Rank 0's shards of a chunk never stand in for rank 1's: keys carry the rank.
    assert matched(fleet) == {"one": 5 * CHUNK, "tp": 3 * CHUNK}
    assert routed(fleet) == ("one", "longest-prefix", 5 * CHUNK)


def test_the_router_goes_to_the_tp_instance_once_every_rank_holds_the_longer_prefix(fleet):
    reporters = fleet["reporters"]
    admit(reporters["tp1"], tp_keys(1)[3:])
    assert matched(fleet) == {"tp": 8 * CHUNK, "one": 5 * CHUNK}
    assert fleet["controller"].instance("tp")["chunks"] == 8
    assert routed(fleet) == ("tp", "longest-prefix", 8 * CHUNK)
    # One rank evicting a chunk ends the instance's prefix there, whatever the other rank holds.
    reporters["tp1"].offer("evict", "memory", tp_keys(1)[2])
    assert reporters["tp1"].wait_idle(60)
    assert matched(fleet) == {"one": 5 * CHUNK, "tp": 2 * CHUNK}
    assert routed(fleet) == ("one", "longest-prefix", 5 * CHUNK)


def test_a_rank_killed_takes_its_instance_out_of_lookups_and_routing(fleet):
    controller = fleet["controller"]
    # Rank 1 of tp restarts as a process of its own (a new session replaces the old holder), holding all.
    fleet["reporters"].pop("tp1").close()
    proc = start_reporter_process(controller.url, "tp", tp_keys(1), chunk_size=CHUNK, rank=1, world_size=2,
                                  backend_url=fleet["backends"]["tp"].url, token_file=controller.token_file,
                                  heartbeat_s=0.3)
    fleet["processes"].append(proc)
    wait_for(lambda: matched(fleet).get("tp") == 8 * CHUNK, "the restarted rank's snapshot")
    assert routed(fleet) == ("tp", "longest-prefix", 8 * CHUNK)
    proc.kill()  # SIGKILL: no goodbye; the controller notices the missing heartbeats
    proc.wait(timeout=30)
    tp = wait_for(lambda: (i := controller.instance("tp"))["state"] == "down" and i, "tp marked down")
    assert [(h["rank"], h["state"]) for h in tp["holders"]] == [(0, "up"), (1, "down")]
    assert "tp" not in matched(fleet)
    assert matched(fleet, include_down=True)["tp"] == 8 * CHUNK  # still known, not served
    assert routed(fleet) == ("one", "longest-prefix", 5 * CHUNK)


def test_an_instance_whose_ranks_have_not_all_registered_serves_nothing(fleet):
    half = fleet["report"]("half0", "half", rank=0, world_size=2)
    admit(half, chunk_keys(DOC, chunk_size=CHUNK, world_size=2, rank=0))
    listed = fleet["controller"].instance("half")
    assert (listed["state"], listed["ranks"], listed["missing_ranks"], listed["chunks"]) == ("down", [0], [1], 0)
    assert [(h["rank"], h["chunks"]) for h in listed["holders"]] == [(0, 8)]
    assert "half" not in matched(fleet, include_down=True)
