"""The node server with real processes: one ``flowkv server``, engines in this and other processes.

Engines use the ``server`` tier (pipelines from ``node_servers.node_pipeline``);
chunks are 16 tokens of 1 KiB each (2 layers x 2 KV heads x 64 x K,V x bf16).
Faults (processes killed, servers restarted, corrupt disk) are in
``test_node_faults.py``; vLLM through the server in ``test_vllm_node.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from node_servers import (  # noqa: F401 - node_servers is a fixture
    CHUNK,
    GO_TAG,
    HOLD_STORE,
    HOLD_TAG,
    ROOT,
    arena_name,
    chunk_kv,
    engine,
    geometry,
    keys_of,
    scraped,
    kv_for,
    node_pipeline,
    node_servers,
    server_pipeline,
    slots_for,
    wait_for,
)

from flowkv import KVTransfer
from flowkv.tiers.node_protocol import NodeConnection

CLIENT = str(Path(__file__).resolve().parent / "node_client.py")
TOKENS = 160  # 10 chunks
CHUNK_BYTES = CHUNK * 1024


@pytest.fixture(scope="module")
def server(node_servers):
    return node_servers("shared")


@pytest.fixture(scope="module")
def pipeline(server, tmp_path_factory):
    return node_pipeline(tmp_path_factory.mktemp("pipelines"), server.socket)



def client(pipeline, action, *args: str) -> dict:
    """Run ``node_client.py`` in a process of its own; its JSON answer."""
    done = subprocess.run([sys.executable, CLIENT, str(pipeline), action, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def tokens(first: int = 0, n: int = TOKENS) -> torch.Tensor:
    return torch.arange(first, first + n)



def test_a_chunk_one_process_stored_is_read_by_another_from_the_shared_pages(server, pipeline):
    before = server.status()["requests"]
    stored = client(pipeline, "store", "--seed", "7", "--first-token", "1000")
    assert stored["stored"] == TOKENS
    assert stored["tier"]["allocated"] == 10 and stored["tier"]["admitted"] == 10
    # One round trip per request and kind: lookup (allocate's held check), alloc, commit.
    assert stored["tier"]["calls"] == 3

    e = engine(pipeline)
    dst = kv_for(500)
    slots = slots_for(TOKENS)
    result = e.retrieve(KVTransfer(tokens=tokens(1000), kv_caches=dst, slot_mapping=slots))
    assert result.loaded_tokens == TOKENS and result.failed_range is None
    assert torch.equal(chunk_kv(dst, slots), chunk_kv(kv_for(7), slots))
    tier = e.stats()["tiers"]["node"]
    assert tier["read_hits"] == 10 and tier["reads"] == 1
    e.close()
    after = server.status()["requests"]
    assert after["committed_chunks"] - before.get("committed_chunks", 0) == 10
    assert after["get_hits"] - before.get("get_hits", 0) == 10


def test_status_command_and_prometheus_metrics(server, pipeline):
    client(pipeline, "store", "--seed", "3", "--first-token", "5000")
    done = subprocess.run([sys.executable, "-m", "flowkv.cli", "server", "status", "--socket", str(server.socket),
                           "--json"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["memory"]["entries"] >= 10
    assert status["memory"]["used_bytes"] == status["memory"]["entries"] * CHUNK_BYTES
    assert status["memory"]["used_bytes"] + status["memory"]["free_bytes"] == status["memory"]["capacity_bytes"]
    assert status["clients"]["connected"] == 1  # the status command itself
    assert status["health"] == {"memory": "healthy"}
    # The arena's shared pages were made resident at start (in the background), all of them.
    done_status = wait_for(lambda: (s := server.status())["memory"]["prefault"] == "done" and s, "the pre-fault")
    assert done_status["memory"]["resident_bytes"] >= done_status["memory"]["capacity_bytes"]
    text = subprocess.run([sys.executable, "-m", "flowkv.cli", "server", "status", "--socket", str(server.socket)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
    assert f"{status['memory']['entries']} entries" in text and "1 connected" in text
    metrics = urllib.request.urlopen(server.fields["metrics"], timeout=10).read().decode()
    entries = server.status()["memory"]["entries"]
    samples = scraped(metrics)
    assert samples[("flowkv_server_memory_entries", ())] == entries
    assert "# TYPE flowkv_server_committed_chunks_total counter" in metrics
    assert samples[("flowkv_server_memory_resident_bytes", ())] == done_status['memory']['resident_bytes']


def test_models_and_tags_never_share_an_entry(server, pipeline):
    a, b = engine(pipeline, "model-a"), engine(pipeline, "model-b")
    ids, slots = tokens(9000), slots_for(TOKENS)
    assert a.store(KVTransfer(tokens=ids, kv_caches=kv_for(1), slot_mapping=slots)).stored_tokens == TOKENS
    assert b.lookup(ids) == 0
    assert a.lookup(ids, tags={"tenant": "x"}) == 0
    assert b.store(KVTransfer(tokens=ids, kv_caches=kv_for(2), slot_mapping=slots)).stored_tokens == TOKENS
    assert a.lookup(ids) == b.lookup(ids) == TOKENS
    dst = kv_for(600)
    assert int(b.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask.sum()) == TOKENS
    assert torch.equal(chunk_kv(dst, slots), chunk_kv(kv_for(2), slots))
    a.close()
    b.close()


def test_lookup_pins_the_prefix_and_a_chunk_gone_before_retrieve_shrinks_the_mask(server, tmp_path):
    from vllm_helpers import EVICT_TAG

    # The retrieve list removes the chunk a request's tag names after its lookup, before get.
    path = node_pipeline(tmp_path, server.socket, name="evicting",
                         retrieve=["tokenize", "chunk-hash", "lookup", "vllm_helpers:evict_chunk", "get",
                                   "decompress", "scatter"])
    e = engine(path)
    ids, slots = tokens(20000), slots_for(TOKENS)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(4), slot_mapping=slots)).stored_tokens == TOKENS
    pinned_before = server.status()["memory"]["pinned_entries"]
    assert e.lookup(ids, pin=True, lookup_id="req-1") == TOKENS
    assert server.status()["memory"]["pinned_entries"] == pinned_before + 10

    # Gone between the scheduler's lookup and the load: the retrieve's own lookup stops before it.
    other = server.connect("another-client")
    assert other.call("remove", keys=[keys_of(e, ids)[7]])["removed"] == [True]
    other.close()
    dst = kv_for(601)
    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots, lookup_id="req-1"))
    assert result.loaded_tokens == 7 * CHUNK and result.loaded_to == 7 * CHUNK
    assert torch.equal(chunk_kv(dst, slots[:112]), chunk_kv(kv_for(4), slots[:112]))
    e.storage.memory.server_stats()  # a round trip after the retrieve's one-way release
    assert server.status()["memory"]["pinned_entries"] == pinned_before

    # Gone between the retrieve's lookup and its get: the mask ends before it, the rest is a failed range.
    tagged = {EVICT_TAG: "4"}  # a tag is part of the keys: store under it first
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(4), slot_mapping=slots,
                              tags=tagged)).stored_tokens == TOKENS
    result = e.retrieve(KVTransfer(tokens=ids, kv_caches=kv_for(605), slot_mapping=slots, tags=tagged))
    assert result.loaded_tokens == 4 * CHUNK and result.failed_range == (4 * CHUNK, TOKENS)
    assert e.stats()["retrieve_missing_chunks"] == 1
    e.close()


def test_a_full_arena_stops_a_store_at_once_and_keeps_its_prefix(node_servers, tmp_path):
    small = node_servers("small", memory="128KiB")  # 8 chunks
    path = node_pipeline(tmp_path, small.socket)
    e = engine(path)
    ids, slots = tokens(0, 128), slots_for(128)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(5), slot_mapping=slots)).stored_tokens == 128
    assert e.lookup(ids, pin=True, lookup_id="hold-all") == 128  # nothing left to evict
    assert e.store(KVTransfer(tokens=tokens(3000, 64), kv_caches=kv_for(5),
                              slot_mapping=slots_for(64))).stored_tokens == 0
    assert e.stats()["store_backpressure_stops"] == 1
    assert small.status()["requests"]["alloc_shortfalls"] == 1
    e.release("hold-all")
    assert e.store(KVTransfer(tokens=tokens(3000, 64), kv_caches=kv_for(5),
                              slot_mapping=slots_for(64))).stored_tokens == 64  # evicts 4
    status = small.status()["memory"]
    assert status["entries"] == 8 and status["evictions"] == 4
    e.close()


def test_two_clients_storing_one_chunk_at_once_keep_one_entry_and_both_hit(server, tmp_path):
    hold = node_pipeline(tmp_path, server.socket, name="hold", store=HOLD_STORE)
    holding, go = tmp_path / "holding", tmp_path / "go"
    holding.mkdir()
    tags = f"{HOLD_TAG}={holding},{GO_TAG}={go}"
    before = server.status()
    args = ["store", "--seed", "11", "--first-token", "40000", "--tags", tags]
    procs = [subprocess.Popen([sys.executable, CLIENT, str(hold), *args], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(2)]
    # Both hold their ten rooms, gathered into and not committed.
    wait_for(lambda: len(list(holding.iterdir())) == 2, "both clients to hold their rooms")
    assert server.status()["clients"]["allocations_held"] == 20
    go.touch()
    outs = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
    assert sorted(out["tier"]["admitted"] for out in outs) == [0, 10]
    after = server.status()
    assert after["memory"]["entries"] - before["memory"]["entries"] == 10
    assert after["memory"]["used_bytes"] - before["memory"]["used_bytes"] == 10 * CHUNK_BYTES
    assert after["requests"]["duplicate_commits"] - before["requests"].get("duplicate_commits", 0) == 10
    assert after["clients"]["allocations_held"] == 0
    for _ in range(2):  # both clients' stores are served later (each process holds the same tags)
        hit = client(hold, "lookup", "--first-token", "40000", "--tags", tags)
        assert hit["hit"] == TOKENS


def test_memory_then_server_then_disk_keeps_prefix_contiguity_across_all_three(server, tmp_path):
    disk = tmp_path / "disk"
    path = node_pipeline(tmp_path, server.socket, name="mem-node-disk", memory="1MiB", disk=disk)
    ids, slots = tokens(60000), slots_for(TOKENS)
    first = engine(path)
    assert first.store(KVTransfer(tokens=ids, kv_caches=kv_for(8), slot_mapping=slots)).stored_tokens == TOKENS
    assert first.flush(timeout_s=30.0)
    written = first.stats()
    assert written["tier.memory.written_bytes"] == written["tier.node.written_bytes"] == TOKENS * 1024
    assert len(list(disk.rglob("*.kv"))) == 10
    keys = keys_of(first, ids)
    first.close()

    # A new process: chunks 0-1 in its memory, 2-3 on the server only, 4-9 on disk only.
    second = engine(path)
    assert second.store(KVTransfer(tokens=ids[:32], kv_caches=kv_for(8), slot_mapping=slots[:32])).stored_tokens == 32
    conn = server.connect()
    assert conn.call("remove", keys=keys[4:])["removed"] == [True] * 6
    conn.close()
    assert second.lookup(ids) == TOKENS
    dst = kv_for(602)
    assert int(second.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask.sum()) == TOKENS
    assert torch.equal(chunk_kv(dst, slots), chunk_kv(kv_for(8), slots))
    counters = second.stats()
    assert counters["tier.node.read_bytes"] == 2 * CHUNK_BYTES
    # Disk hits are promoted into memory and read from there.
    assert counters.get("tier.disk.read_bytes", 0) + counters["tier.memory.read_bytes"] == 8 * CHUNK_BYTES
    second.close()


def test_layerwise_store_and_retrieve_move_each_layer_through_the_mapped_pages(server, tmp_path):
    path = node_pipeline(tmp_path, server.socket, name="node-layerwise", sections={"layerwise": {"enabled": True}})
    e = engine(path)
    ids, slots = tokens(70000), slots_for(TOKENS)
    src = kv_for(12)
    handle = e.store_layerwise(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots))
    for layer in range(geometry().num_layers):
        handle.layer_ready(layer)
    assert handle.finish() == TOKENS
    dst = kv_for(603)
    loading = e.retrieve_layerwise(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots))
    loading.wait(0)
    first_layer = chunk_kv(dst, slots)[0]
    assert torch.equal(first_layer, chunk_kv(src, slots)[0])
    loading.wait(1)
    assert int(loading.finish().sum()) == TOKENS
    assert torch.equal(chunk_kv(dst, slots), chunk_kv(src, slots))
    e.close()


def test_server_spans_nest_under_the_client_stage_that_called(node_servers, tmp_path):
    from flowkv import telemetry

    client_traces, server_traces = tmp_path / "client", tmp_path / "server"
    traced = node_servers("traced", pipeline=server_pipeline(tmp_path, tmp_path / "disk", traces=server_traces))
    path = node_pipeline(tmp_path, traced.socket, name="traced",
                         sections={"telemetry": {"exporter": "file", "folder": str(client_traces)}})
    e = engine(path)
    ids, slots = tokens(80000), slots_for(TOKENS)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(13), slot_mapping=slots)).stored_tokens == TOKENS
    assert int(e.retrieve(KVTransfer(tokens=ids, kv_caches=kv_for(604), slot_mapping=slots)).ret_mask.sum()) == TOKENS
    e.close()
    telemetry.flush()
    assert traced.stop() == 0  # the server writes its spans out as it exits
    client_spans = {s.span_id: s for s in _spans(client_traces)}
    server_spans = [s for s in _spans(server_traces) if s.name.startswith("flowkv.server.")]
    assert server_spans and all(s.resource.get("service.name") == "flowkv-server" for s in server_spans)
    by_name: dict[str, set[str]] = {}
    for span in server_spans:
        parent = client_spans.get(span.parent_span_id)
        assert parent is not None and parent.trace_id == span.trace_id, span
        by_name.setdefault(span.name, set()).add(parent.name)
    assert by_name["flowkv.server.alloc"] == {"allocate"}
    assert by_name["flowkv.server.commit"] == {"put"}
    assert by_name["flowkv.server.get"] == {"get"}
    assert by_name["flowkv.server.lookup"] >= {"allocate", "lookup"}


def _spans(folder: Path) -> list:
    from flowkv.otlp_json import load_spans

    return [span for path in sorted(folder.glob("*.json*")) for span in load_spans(path)]


def test_events_and_snapshot_let_a_controller_follow_the_arena(node_servers, tmp_path):
    small = node_servers("events", memory="128KiB")
    conn = small.connect("controller")
    start = conn.call("snapshot")
    assert start["keys"] == [] and start["tier"] == "memory"
    e = engine(node_pipeline(tmp_path, small.socket, name="events"))
    ids = tokens(0, 128)
    assert e.store(KVTransfer(tokens=ids, kv_caches=kv_for(14), slot_mapping=slots_for(128))).stored_tokens == 128
    keys = keys_of(e, ids)
    got = conn.call("events", since=start["seq"], wait_s=5.0)
    assert [(kind, tier, key) for _, kind, tier, key in got["events"]] == [("admit", "memory", k) for k in keys]
    assert not got["gap"]
    # Eight more chunks evict the first eight.
    assert e.store(KVTransfer(tokens=tokens(500, 128), kv_caches=kv_for(14),
                              slot_mapping=slots_for(128))).stored_tokens == 128
    later = conn.call("events", since=got["seq"], wait_s=5.0)["events"]
    assert sorted(k for _, kind, _, k in later if kind == "evict") == sorted(keys)
    assert sum(kind == "admit" for _, kind, _, _ in later) == 8
    assert sorted(conn.call("snapshot")["keys"]) == sorted(keys_of(e, tokens(500, 128)))
    conn.close()
    e.close()


def test_sigterm_drains_write_behind_and_removes_socket_and_token(node_servers, tmp_path):
    disk = tmp_path / "disk"
    node = node_servers("drain", pipeline=server_pipeline(tmp_path, disk))
    assert [arena_name(path) for path in node.segments()] == [node.fields["segment"]]
    assert node.fields["segment"].startswith("memfd:flowkv-node-")  # no file anywhere to remove or leave
    e = engine(node_pipeline(tmp_path, node.socket, name="drain"))
    assert e.store(KVTransfer(tokens=tokens(0), kv_caches=kv_for(15),
                              slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS
    assert node.stop() == 0
    assert len(list(disk.rglob("*.kv"))) == 10
    assert not node.socket.exists() and not Path(f"{node.socket}.token").exists()
    assert e.lookup(tokens(0)) == 0  # gone: a miss, at once
    assert e.storage.health()["node"].value == "unhealthy"
    e.close()


def test_the_servers_own_stage_list_encodes_for_its_lower_tiers_with_a_span_per_stage(node_servers, tmp_path):
    """A server pipeline's [server] list (compress, then put) runs on each committed chunk: the disk holds
    its codec's payloads, each run is traced stage by stage, and a restarted server serves them again."""
    from flowkv import payload as payloads
    from flowkv import telemetry
    from flowkv.pipeline import dumps_pipeline

    disk, traces = tmp_path / "disk", tmp_path / "server-traces"
    server_file = tmp_path / "server-zstd.toml"
    server_file.write_text(dumps_pipeline(
        pipeline={"name": "server-zstd"}, store=[], retrieve=[],
        tiers={"disk": {"kind": "disk", "path": str(disk), "capacity": "256MiB", "timeout_s": 2.0}},
        server=[("compress", {"codec": "zstd-shuffle", "level": 1}), "put"],
        sections={"telemetry": {"exporter": "file", "folder": str(traces)}}))
    node = node_servers("own-list", pipeline=server_file)
    assert node.status()["lower"] == {"stages": ["compress", "put"], "queued": 0, "tiers": ["disk"]}
    e = engine(node_pipeline(tmp_path, node.socket, name="own-list"))
    ids, slots, src = tokens(90000), slots_for(TOKENS), kv_for(16)
    assert e.store(KVTransfer(tokens=ids, kv_caches=src, slot_mapping=slots)).stored_tokens == TOKENS
    assert node.stop() == 0  # drains the writer and the write-behind queue
    files = sorted(disk.rglob("*.kv"))
    assert len(files) == TOKENS // CHUNK
    assert {payloads.read_header(f.read_bytes()).codec for f in files} == {"zstd-shuffle"}

    spans = _spans(traces)
    runs = [s for s in spans if s.name == "flowkv.server"]
    assert len(runs) == TOKENS // CHUNK
    stages = [s for s in spans if s.parent_span_id in {run.span_id for run in runs}]
    assert sorted((s.name, s.attributes["flowkv.stage.role"]) for s in stages) == sorted(
        [("compress", "codec"), ("put", "tier-io")] * len(runs))
    line = server_file.read_text().splitlines().index("[[server.stages]]") + 1
    assert {s.attributes["flowkv.stage.source"] for s in stages if s.name == "compress"} == {f"{server_file}:{line}"}
    assert all(s.attributes["flowkv.bytes"] > 0 for s in stages if s.name == "put")

    node.start()  # an empty arena: every chunk comes from the disk, through the client's decompress
    try:
        wait_for(lambda: e.lookup(ids) == TOKENS, "the client back on the restarted server, which finds the disk's")
        dst = kv_for(605)
        assert int(e.retrieve(KVTransfer(tokens=ids, kv_caches=dst, slot_mapping=slots)).ret_mask.sum()) == TOKENS
        assert torch.equal(chunk_kv(dst, slots), chunk_kv(src, slots))
        assert node.status()["requests"]["promotions"] == TOKENS // CHUNK
    finally:
        e.close()
        telemetry.flush()


class _CountRowCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the kernels' row-index copies (index_select for a gather)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.__name__.startswith("index_select")
        return func(*args, **(kwargs or {}))


def test_a_store_gathers_into_the_mapped_pages_in_one_copy(node_servers, tmp_path, monkeypatch):
    """The server hands a request's rooms out back to back: the store fills all of them with one copy.
    A server of its own: the module's shared one, after other tests in another order (--shuffle), has
    its free pages in pieces, and rooms that are not back to back take a copy each."""
    from flowkv.kernels import torch_kv

    own = node_servers("one-copy")
    monkeypatch.setattr(torch_kv, "NUMPY_GATHER", False)  # the copy as one countable index_select
    e = engine(node_pipeline(tmp_path, own.socket), "one-copy")
    try:
        ids, src = tokens(70000), kv_for(7)
        with _CountRowCopies() as counted:
            assert e.store(KVTransfer(tokens=ids, kv_caches=src,
                                      slot_mapping=slots_for(TOKENS))).stored_tokens == TOKENS
        assert counted.calls == 1
        from flowkv.kernels import gather

        dst = kv_for(8)
        assert int(e.retrieve(KVTransfer(tokens=ids, kv_caches=dst,
                                         slot_mapping=slots_for(TOKENS))).ret_mask.sum()) == TOKENS
        g, slots = geometry(), slots_for(TOKENS)
        assert torch.equal(gather(dst, g, slots, g.empty_chunk(TOKENS)), gather(src, g, slots, g.empty_chunk(TOKENS)))
    finally:
        e.close()
