"""A client's call cut off by its timeout: the pages it may still write are nobody else's while it lives.

A client that gives up on a call closes its connection, but its process
still maps the arena, and a gather it started may still be writing the
rooms that connection held. The server keeps them from reuse (quarantined)
until that process exits or gives them back, counts them against it, and
refuses it new rooms past ``--quarantine-max``; an honest client on the
same server keeps storing and reading, byte for byte.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from node_servers import ROOT, node_servers, scraped, wait_for  # noqa: F401 - node_servers is a fixture

from flowkv.tiers import node_protocol as wire
from flowkv.tiers.server import ServerTier, ServerTierConfig

KIB = 1 << 10
ROOM = 256 * KIB
DROPPED_ROOMS = 8  # 2 MiB: over the 1 MiB bound, so the dropping process gets no more
LEASE_S = 1.0
CLIENT = str(Path(__file__).resolve().parent / "node_dropping_client.py")


@pytest.fixture(scope="module")
def server(node_servers):
    return node_servers("dropped", memory="8MiB", lease_timeout_s=LEASE_S, extra=["--quarantine-max", "1MiB"])


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


class Dropping:
    """The client process of ``node_dropping_client.py``: one step per ``step()``."""

    def __init__(self, socket: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, CLIENT, str(socket), str(DROPPED_ROOMS), str(ROOM)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.rooms = [tuple(room) for room in self.read()["rooms"]]
        self.dropped = self.read()["dropped"]

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the dropping client exited ({self.proc.wait()})"
        return json.loads(line)

    def step(self, name: str) -> dict:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self.read()


def test_a_live_client_that_dropped_its_call_keeps_its_pages_from_reuse_until_it_exits(server):
    before = server.status()
    total = before["memory"]["free_bytes"]
    dropping = Dropping(server.socket)
    assert len(dropping.rooms) == DROPPED_ROOMS and "timed out" in dropping.dropped
    # Past the lease its process still runs: the rooms stay held, counted against it, and logged.
    held = wait_for(lambda: (s := server.status())["clients"].get("quarantined_sessions") == 1 and s,
                    "the dropped connection's lease to run out", timeout_s=LEASE_S * 60)
    assert held["clients"]["quarantined_bytes"] == DROPPED_ROOMS * ROOM
    assert held["clients"]["allocations_held"] == DROPPED_ROOMS
    assert held["clients"]["reclaimed_allocations"] == before["clients"]["reclaimed_allocations"]
    assert held["memory"]["free_bytes"] == total - DROPPED_ROOMS * ROOM
    assert "kept from reuse until it exits" in server.log.read_text()
    metrics = urllib.request.urlopen(server.fields["metrics"], timeout=60).read().decode()
    assert scraped(metrics)[("flowkv_server_quarantined_bytes", ())] == DROPPED_ROOMS * ROOM

    # An honest client takes the whole rest of the arena: never one of the dropped rooms.
    honest = wire.NodeConnection.connect(server.socket, timeout_s=30.0)
    hello = honest.hello("honest", map=True)
    segment = wire.map_segment(honest.take_segment_fd(), int(hello["segment_bytes"]))
    want = total // ROOM
    rooms = honest.call("alloc", sizes=[ROOM] * want)["objs"]
    assert len(rooms) == want - DROPPED_ROOMS
    assert not any(overlaps((offset, ROOM), room) for _, offset in rooms for room in dropping.rooms)
    for i, (_, offset) in enumerate(rooms):
        segment.buffer[offset:offset + ROOM].fill_(i + 1)
    keys = [f"honest-{i}" for i in range(len(rooms))]
    items = [[handle, key, ROOM, {"shape": [ROOM], "dtype": "uint8"}] for (handle, _), key in zip(rooms, keys)]
    assert honest.call("commit", items=items)["admitted"] == [True] * len(rooms)

    # The dropped call's gather goes on writing its rooms: the honest entries are untouched.
    assert dropping.step("write") == {"written": DROPPED_ROOMS}
    reads = honest.call("get", keys=keys)["objs"]
    assert all(read is not None for read in reads)
    for i, (handle, offset, nbytes, _) in enumerate(reads):
        assert nbytes == ROOM and bool((segment.buffer[offset:offset + ROOM] == i + 1).all()), keys[i]
    honest.send("release", handles=[read[0] for read in reads])

    # Over its bound, the dropping process gets no new room (any connection of it).
    again = dropping.step("alloc")
    assert again["alloc"] == "refused" and "no new rooms until it exits" in again["error"]
    assert server.status()["requests"]["alloc_refused_quarantined"] == 1

    # It exits: its rooms go back, and the honest client gets exactly those pages, evicting nothing.
    dropping.proc.stdin.write("exit\n")
    dropping.proc.stdin.flush()
    assert dropping.proc.wait(60) == 0
    after = wait_for(lambda: (s := server.status())["clients"]["quarantined_sessions"] == 0
                     and s["clients"]["reads_held"] == 0 and s,
                     "the exited client's rooms to be reclaimed (and the honest reads released)",
                     timeout_s=LEASE_S * 60)
    assert after["clients"]["reclaimed_quarantined"] == before["clients"]["reclaimed_quarantined"] + 1
    assert after["clients"]["allocations_held"] == 0 and after["clients"]["reads_held"] == 0
    assert after["memory"]["free_bytes"] == DROPPED_ROOMS * ROOM
    reused = honest.call("alloc", sizes=[ROOM] * DROPPED_ROOMS)["objs"]
    assert len(reused) == DROPPED_ROOMS
    assert all(any(overlaps((offset, ROOM), room) for room in dropping.rooms) for _, offset in reused)
    assert server.status()["memory"]["entries"] == len(keys)  # no eviction made that room
    honest.send("release", handles=[handle for handle, _ in reused])
    assert server.status()["requests"].get("request_failures", 0) == 0
    honest.close()
    segment.close()


def test_the_server_tier_gives_back_what_a_lost_connection_held_on_its_next_one(server):
    tier = ServerTier(name="node", config=ServerTierConfig(socket=str(server.socket), timeout_s=0.5,
                                                           backoff_max_s=0.5))
    tier.open(slab_bytes=ROOM)
    before = server.status()["clients"]
    objs = tier.allocate_many([(ROOM,)] * 4, torch.uint8)
    assert len(objs) == 4
    os.kill(server.pid, signal.SIGSTOP)  # a server too slow for one call: the tier drops that connection
    try:
        assert tier.contains_many(["k"]) == [False]
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert tier.stats()["timeouts"] == 1
    wait_for(lambda: server.status()["clients"]["quarantined_sessions"] == 1, "the lost connection's lease to run out",
             timeout_s=LEASE_S * 60)
    # This process is done with the rooms (what the store does after a failed commit): they go back
    # over the next connection, while it lives.
    tier.release_objects(objs)
    after = wait_for(lambda: tier.contains_many(["k"]) == [False] and (c := server.status()["clients"])
                     ["quarantined_sessions"] == 0 and c["allocations_held"] == 0 and c,
                     "the lost connection's rooms to be given back")
    assert after["reclaimed_allocations"] == before["reclaimed_allocations"]  # given back, not reclaimed
    assert tier.stats()["connects"] == 2
    tier.close()
