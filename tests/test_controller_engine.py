"""An in-process cache engine joins the fleet: its memory and disk tiers as the controller sees them.

A real ``CacheEngine`` (pipeline ``cpu-disk`` on a synthetic paged cache) with an ``EngineHolder``
reporting to a real controller process: stores show up in lookups per tier, memory evictions leave
the disk copies, and the controller's clear, pin and prefetch commands run on the engine.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fleet_helpers import ControllerProcess, wait_for
from flowkv import CacheEngine, KVTransfer
from flowkv._testing.paged import make_paged_kv, random_slot_mapping
from flowkv.fleet.holder import EngineHolder
from flowkv.fleet.reporter import ReporterConfig
from flowkv.items import Request
from flowkv.kernels import KVGeometry

CHUNK = 64
NUM_BLOCKS = 64


@pytest.fixture
def fleet(tmp_path):
    controller = ControllerProcess(tmp_path / "controller").start()
    geometry = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    chunk_bytes = geometry.token_bytes * CHUNK
    # Memory holds 3 chunks; the disk holds everything.
    engine = CacheEngine.from_pipeline("cpu-disk", geometry=geometry, model_name="tiny", overrides={
        "chunk_size": CHUNK, "tiers.memory.capacity": 3 * chunk_bytes + 8192,
        "tiers.disk.path": str(tmp_path / "disk"), "save_partial_chunks": True})
    lock = threading.Lock()
    holder = EngineHolder(engine, lock, ReporterConfig(url=controller.url, heartbeat_s=0.3,
                                                     token_file=str(controller.token_file)),
                          instance_id="in-process", model="tiny")
    engine.storage.subscribe(holder.on_tier_event)
    holder.start()
    yield controller, engine, lock, holder, geometry
    holder.close()
    engine.close()
    controller.close()


def store(engine, lock, geometry, seed: int, chunks: int = 3, extra: int = 0) -> list[int]:
    ids = torch.randint(0, 32000, (chunks * CHUNK + extra,), generator=torch.Generator().manual_seed(seed))
    kv = make_paged_kv(geometry, NUM_BLOCKS, seed=seed)
    slots = random_slot_mapping(len(ids), geometry, NUM_BLOCKS, seed=seed)
    with lock:
        assert engine.store(KVTransfer(tokens=ids, kv_caches=kv, slot_mapping=slots)).stored_tokens == len(ids)
        assert engine.flush(30.0)
    return ids.tolist()


def tiers_of(controller, token_ids) -> dict[str, int] | None:
    answer = [h for h in controller.lookup(token_ids=token_ids) if h["instance_id"] == "in-process"]
    return answer[0]["chunks_by_tier"] if answer else None


def test_memory_and_disk_chunks_are_in_the_directory_and_commands_run_on_the_engine(fleet):
    controller, engine, lock, holder, geometry = fleet
    first = store(engine, lock, geometry, seed=1)
    assert holder.reporter.wait_idle(60)
    assert tiers_of(controller, first) == {"memory": 3}
    listed = controller.instance("in-process")
    assert [t["name"] for t in listed["tiers"]] == ["memory", "disk"] and listed["pipeline"] == "cpu-disk"
    assert {t["name"]: t["chunks"] for t in listed["tiers"]} == {"memory": 3, "disk": 3}

    # A second document pushes the first out of memory: the directory finds it on disk.
    second = store(engine, lock, geometry, seed=2)
    assert holder.reporter.wait_idle(60)
    assert tiers_of(controller, second) == {"memory": 3}
    assert tiers_of(controller, first) == {"disk": 3}

    # Prefetch brings it back into memory (and the promotion is an event like any other).
    reply = controller.post("/prefetch", {"instance_id": "in-process", "token_ids": first, "wait_s": 60})
    assert [r["detail"] for r in reply["results"].values()] == ["prefetch 3 of 3 chunks"]
    wait_for(lambda: tiers_of(controller, first) == {"memory": 3}, "the prefetched chunks are in memory")
    reply = controller.post("/pin", {"instance_id": "in-process", "token_ids": first, "wait_s": 60})
    assert [r["detail"] for r in reply["results"].values()] == ["pin 3 of 3 chunks"]

    # Clear empties memory; the disk keeps its copies (byte tiers evict on their own).
    reply = controller.post("/clear", {"instance_id": "in-process", "wait_s": 60})
    detail = list(reply["results"].values())[0]["detail"]
    assert detail.startswith("removed ") and "disk keep their chunks" in detail
    assert holder.reporter.wait_idle(60)
    wait_for(lambda: tiers_of(controller, first) == {"disk": 3}, "the directory agrees with the engine")
    with lock:
        assert len(engine.storage.memory.keys()) == 0
    # The engine's counters reach the controller with the heartbeats.
    wait_for(lambda: controller.instance("in-process")["stats"]["counters"].get("stores", 0) >= 2,
             "heartbeats carry the engine's counters")


def test_a_prefetch_command_is_the_engines_lookup_a_partial_last_chunk_included(fleet):
    """The controller's prefetch runs the engine's lookup list: the last chunk, shorter than the
    others, is found and promoted at its own shape (not one of a whole chunk)."""
    controller, engine, lock, holder, geometry = fleet
    first = store(engine, lock, geometry, seed=3, chunks=2, extra=CHUNK // 2)
    assert holder.reporter.wait_idle(60)  # registered, and its stores reported: the controller knows it
    keys = [key.to_str() for key in engine.chunk_keys(Request(tokens=torch.tensor(first)))]
    with lock:
        engine.memory.clear()  # on disk only
        assert len(keys) == 3 and not any(engine.memory.contains(key) for key in keys)
        lookups = engine.stats().get("lookups", 0)
    reply = controller.post("/prefetch", {"instance_id": "in-process", "token_ids": first, "wait_s": 60})
    assert [r["detail"] for r in reply["results"].values()] == ["prefetch 3 of 3 chunks"]
    wait_for(lambda: all(engine.memory.contains(key) for key in keys), "the three chunks promoted into memory")
    with lock:
        stats = engine.stats()
    assert stats.get("corrupt_payloads", 0) == 0 and stats.get("lookups", 0) == lookups  # a command, no lookup
