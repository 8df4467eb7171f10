"""Node-server faults with real processes: clients and servers killed with SIGKILL, a server absent or
restarted, corrupt and short payloads on the server's disk. Each test asserts the counts it expects.

The clients are engines with a ``server`` tier, in this process or in processes
of their own (``node_client.py``); vLLM through the same faults is in
``test_vllm_node.py``.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from node_servers import (  # noqa: F401 - node_servers is a fixture
    CHUNK,
    HOLD_STORE,
    HOLD_TAG,
    ROOT,
    NodeServerProcess,
    arena_name,
    chunk_kv,
    engine,
    keys_of,
    kv_for,
    mapped_arenas,
    node_pipeline,
    node_servers,
    server_pipeline,
    slots_for,
    wait_for,
)

from flowkv import KVTransfer
from flowkv.tiers.disk import key_digest

CLIENT = str(Path(__file__).resolve().parent / "node_client.py")
TOKENS = 160  # 10 chunks of 16 tokens, 16 KiB each
CHUNK_BYTES = CHUNK * 1024
# The server's lease timeout in the reclaim test. Its "not reclaimed yet" check runs right after the
# kill: on a loaded two-core machine those few calls took up to seconds, so the lease is long enough
# that the check always lands inside it (a readiness margin, not a speed claim).
LEASE_S = 20.0
# A call's bound in the hung-server test: long enough that no call to the live server (before the
# SIGSTOP) runs out on a loaded machine, so the counts after it are exact.
HUNG_CALL_TIMEOUT_S = 2.0




def test_a_client_killed_mid_store_is_reclaimed_after_the_lease_timeout_and_nothing_it_held_is_served(
        node_servers, tmp_path):
    node = node_servers("leases", lease_timeout_s=LEASE_S)
    plain = node_pipeline(tmp_path, node.socket)
    hold = node_pipeline(tmp_path, node.socket, name="hold", store=HOLD_STORE)
    e = engine(plain)
    assert e.store(KVTransfer(tokens=torch.arange(5 * CHUNK), kv_caches=kv_for(1),
                              slot_mapping=slots_for(5 * CHUNK))).stored_tokens == 5 * CHUNK

    holding, release = tmp_path / "holding", tmp_path / "never"
    holding.mkdir()
    # One client pins the five stored chunks and waits; the other holds ten rooms, gathered, not committed.
    pinner = subprocess.Popen([sys.executable, CLIENT, str(plain), "lookup", "--tokens", str(5 * CHUNK), "--pin", "r1",
                               "--then-wait", str(release)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert json.loads(pinner.stdout.readline())["hit"] == 5 * CHUNK
    storer = subprocess.Popen([sys.executable, CLIENT, str(hold), "store", "--first-token", "100000",
                               "--tags", f"{HOLD_TAG}={holding}"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    wait_for(lambda: any(holding.iterdir()), "the storing client to hold its rooms")
    held = node.status()
    assert held["clients"]["allocations_held"] == 10
    assert held["memory"]["pinned_entries"] == 5
    assert held["memory"]["used_bytes"] == 15 * CHUNK_BYTES

    for proc in (pinner, storer):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    gone = node.status()
    # Within the lease timeout nothing is taken back yet; nothing uncommitted is in the index.
    assert gone["clients"]["disconnected"] == 2
    assert gone["clients"]["allocations_held"] == 10 and gone["clients"]["reclaimed_allocations"] == 0
    hold_keys = [k.to_str() for k in engine(hold).keys.of(torch.arange(100000, 100000 + TOKENS),
                                                           {HOLD_TAG: str(holding)}, None)]
    conn = node.connect()
    assert conn.call("lookup", keys=hold_keys)["held"] == [False] * 10
    assert conn.call("get", keys=hold_keys)["objs"] == [None] * 10
    conn.close()

    after = wait_for(lambda: (s := node.status())["clients"]["reclaimed_allocations"] == 10 and s,
                     "the lease timeout to reclaim the killed client's rooms", timeout_s=LEASE_S * 10)
    assert after["clients"]["allocations_held"] == 0 and after["clients"]["reads_held"] == 0
    assert after["clients"]["reclaimed_pins"] == 5
    assert after["clients"]["disconnected"] == 0
    assert after["memory"]["pinned_entries"] == 0
    assert after["memory"]["used_bytes"] == 5 * CHUNK_BYTES and after["memory"]["entries"] == 5
    assert after["requests"].get("request_errors", 0) == 0
    # The reclaimed rooms hold a store again; this client, idle all along, was never dropped.
    assert e.store(KVTransfer(tokens=torch.arange(200000, 200000 + TOKENS), kv_caches=kv_for(2),
                              slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS
    assert e.stats()["tiers"]["node"]["connects"] == 1
    e.close()


def test_a_hung_server_costs_one_bounded_call_then_misses_until_it_answers_again(node_servers, tmp_path):
    node = node_servers("hung")
    e = engine(node_pipeline(tmp_path, node.socket, timeout_s=HUNG_CALL_TIMEOUT_S))
    ids, slots = torch.arange(TOKENS), slots_for(TOKENS)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(9), slot_mapping=slots)).stored_tokens == TOKENS
    os.kill(node.pid, signal.SIGSTOP)
    try:
        assert e.lookup(ids) == 0  # waits timeout_s once, then gives up on the connection
        assert e.store(KVTransfer(tokens=torch.arange(1000, 1000 + TOKENS), kv_caches=kv_for(9),
                                  slot_mapping=slots)).stored_tokens == 0
        tier = e.stats()["tiers"]["node"]
        assert tier["timeouts"] == 1 and tier["failures"] == 1 and tier["skipped"] >= 1
    finally:
        os.kill(node.pid, signal.SIGCONT)
    assert wait_for(lambda: e.lookup(ids), "the client to reconnect to the same server") == TOKENS
    tier = e.stats()["tiers"]["node"]
    assert tier["connects"] == 2 and tier["remaps"] == 0 and tier["timeouts"] == 1
    e.close()


def test_server_killed_and_restarted_clients_miss_at_once_reconnect_remap_and_never_read_the_old_segment(
        node_servers, tmp_path):
    node = node_servers("restart")
    e = engine(node_pipeline(tmp_path, node.socket))
    ids, slots = torch.arange(TOKENS), slots_for(TOKENS)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(3), slot_mapping=slots)).stored_tokens == TOKENS
    assert e.lookup(ids, pin=True, lookup_id="before-kill") == TOKENS
    old_segment = node.fields["segment"]

    node.kill()
    assert old_segment in mapped_arenas()  # SIGKILL: this process still maps the old arena
    dst = kv_for(700)
    untouched = [layer.clone() for layer in dst]
    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots, lookup_id="before-kill"))
    assert result.loaded_tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(dst, untouched))  # nothing read through the old mapping
    assert e.lookup(ids) == 0
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(3), slot_mapping=slots)).stored_tokens == 0
    tier = e.stats()["tiers"]["node"]
    assert tier["failures"] == 1 and tier["healthy"] == 0  # one failed call, then misses without calling
    assert tier["skipped"] >= 1
    assert e.storage.health()["node"].value == "unhealthy"

    node.start()  # the same socket: a new server, a new arena
    assert [arena_name(path) for path in node.segments()] == [node.fields["segment"]] != [old_segment]
    stored = wait_for(lambda: e.store(KVTransfer(tokens=ids, kv_caches=kv_for(4), slot_mapping=slots)).stored_tokens,
                      "the client to reconnect after its back-off")
    assert stored == TOKENS
    assert e.lookup(ids) == TOKENS
    dst = kv_for(701)
    assert int(e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask.sum()) == TOKENS
    assert torch.equal(chunk_kv(dst, slots), chunk_kv(kv_for(4), slots))  # the new server's data
    tier = e.stats()["tiers"]["node"]
    assert tier["connects"] == 2 and tier["remaps"] == 1 and tier["healthy"] == 1
    assert e.stats().get("runs_failed", 0) == 0
    e.close()
    gc.collect()
    # The old arena was freed with its last mapping (no file was ever left of it); the new one stays mapped
    # here only while an engine holds it.
    assert old_segment not in mapped_arenas()


def test_a_server_absent_at_start_costs_misses_until_it_comes(node_servers, tmp_path):
    folder = Path(node_servers.folder)
    node = NodeServerProcess(folder / "late.sock")
    e = engine(node_pipeline(tmp_path, node.socket))
    ids, slots = torch.arange(TOKENS), slots_for(TOKENS)
    assert e.lookup(ids) == 0
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(5), slot_mapping=slots)).stored_tokens == 0
    assert int(e.retrieve(KVTransfer(tokens=ids, kv_caches=kv_for(702), slot_mapping=slots)).ret_mask.sum()) == 0
    tier = e.stats()["tiers"]["node"]
    assert tier["connects"] == 0 and tier["healthy"] == 0 and tier["calls"] == 0
    node.start()
    try:
        assert wait_for(lambda: e.store(KVTransfer(tokens=ids, kv_caches=kv_for(5),
                                                   slot_mapping=slots)).stored_tokens, "a reconnect") == TOKENS
        assert e.lookup(ids) == TOKENS
        assert e.stats()["tiers"]["node"]["connects"] == 1
    finally:
        e.close()
        assert node.stop() == 0
    assert not node.segments()


def test_a_corrupt_or_short_payload_on_the_servers_disk_is_a_counted_miss(node_servers, tmp_path):
    disk = tmp_path / "disk"
    server_file = server_pipeline(tmp_path, disk)
    node = node_servers("corrupt", pipeline=server_file)
    path = node_pipeline(tmp_path, node.socket, timeout_s=4.0)
    e = engine(path)
    ids, slots = torch.arange(TOKENS), slots_for(TOKENS)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(6), slot_mapping=slots)).stored_tokens == TOKENS
    keys = keys_of(e, ids)
    e.close()
    assert node.stop() == 0  # drains the write-behind: all ten on disk
    files = [disk / key_digest(k)[:2] / f"{key_digest(k)}.kv" for k in keys]
    assert all(f.exists() for f in files)
    body = bytearray(files[3].read_bytes())
    body[-100] ^= 0xFF  # a flipped bit in chunk 3's KV
    files[3].write_bytes(bytes(body))
    files[6].write_bytes(files[6].read_bytes()[:1000])  # chunk 6 cut short

    node.start()  # an empty arena; the disk as it is now
    e = engine(path)
    assert e.lookup(ids, pin=True, lookup_id="r") == TOKENS  # the disk says it has all ten (it reads nothing)
    dst = kv_for(703)
    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots, lookup_id="r"))
    # The lookup's prefetch found both out; the retrieve (its own lookup first) loads the prefix before them.
    assert result.loaded_tokens == 3 * CHUNK and result.loaded_to == 3 * CHUNK
    assert torch.equal(chunk_kv(dst, slots[:48]), chunk_kv(kv_for(6), slots[:48]))
    status = node.status()
    assert status["tiers"]["disk"]["corrupt"] == 2  # both found out, both removed
    assert status["requests"]["promotions"] == 8
    assert not files[3].exists() and not files[6].exists()
    assert e.lookup(ids) == 3 * CHUNK
    assert status["requests"].get("request_errors", 0) == 0
    e.close()
