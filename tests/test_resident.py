"""Resident arenas (flowkv.resident): pages backed before stores write them, checked with
mincore (the kernel's own answer), never with timings."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest
import torch
from node_servers import node_servers, wait_for  # noqa: F401 - node_servers is a fixture

from flowkv import CacheEngine
from flowkv.kernels import KVGeometry
from flowkv.memory import MemoryArena
from flowkv.resident import (
    PAGE_BYTES,
    ResidentBuffer,
    available_memory,
    huge_page_support,
    resident_pages,
)

MiB = 1 << 20


def pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES)


def test_a_fresh_mapping_has_no_resident_pages_until_pre_faulted():
    cold = ResidentBuffer.anonymous(8 * MiB, prefault="off")
    assert resident_pages(cold.tensor) == 0
    assert (cold.resident_bytes, cold.prefault_state) == (0, "off")
    cold.tensor[::PAGE_BYTES].fill_(1)  # a first touch of every page
    assert resident_pages(cold.tensor) == pages(8 * MiB)

    warm = ResidentBuffer.anonymous(8 * MiB, prefault="now")
    assert resident_pages(warm.tensor) == pages(8 * MiB)
    assert (warm.resident_bytes, warm.prefault_state) == (8 * MiB, "done")


def test_pre_fault_keeps_bytes_already_written():
    buffer = ResidentBuffer.anonymous(4 * MiB, prefault="off")
    buffer.tensor[:16] = torch.arange(16, dtype=torch.uint8)
    buffer.prefault("now")  # as a background pre-fault does while stores already write
    assert torch.equal(buffer.tensor[:16], torch.arange(16, dtype=torch.uint8))
    assert resident_pages(buffer.tensor) == pages(4 * MiB)
    assert buffer.prefault_state == "done"


@pytest.mark.parametrize("mode", ["now", "background"])
def test_arena_is_resident_after_start(mode):
    arena = MemoryArena(32 * MiB, slab_bytes=MiB, prefault=mode)
    assert arena.wait_resident(timeout=120)
    assert arena.prefault_state == "done"
    assert arena.resident_bytes == arena.capacity_bytes
    assert resident_pages(arena.buffer) == pages(arena.capacity_bytes)


def test_arena_without_prefault_is_not_resident():
    arena = MemoryArena(32 * MiB, slab_bytes=MiB, prefault="off")
    assert resident_pages(arena.buffer) == 0
    obj = arena.allocate((MiB,), torch.uint8)
    obj.tensor.fill_(1)
    assert resident_pages(arena.buffer) == pages(MiB)


def test_engine_arena_is_resident_after_start():
    g = KVGeometry("cpu", 2, 2, 64, 16, torch.float16)
    engine = CacheEngine.from_pipeline("local-cpu", geometry=g, model_name="tiny",
                                       overrides={"chunk_size": 64, "tiers.memory.capacity": "16MiB"})
    try:
        arena = engine.memory.arena
        assert arena.wait_resident(timeout=120)
        assert resident_pages(arena.buffer) == pages(arena.capacity_bytes)
    finally:
        engine.close()


def test_pre_fault_stops_at_the_memory_reserve():
    available = available_memory()
    assert available is not None
    # A reserve above what is available: pre-faulting must not take a single step.
    buffer = ResidentBuffer.anonymous(64 * MiB, prefault="now", reserve_bytes=available + (1 << 40))
    assert buffer.resident_bytes == 0
    assert buffer.prefault_state.startswith("stopped:") and "available" in buffer.prefault_state
    assert resident_pages(buffer.tensor) == 0


def test_background_pre_fault_can_be_stopped():
    buffer = ResidentBuffer.anonymous(256 * MiB, prefault="background")
    buffer.stop(timeout=120)
    assert buffer.wait_resident(timeout=120)
    assert buffer.prefault_state in ("done", "stopped: asked to stop")
    assert resident_pages(buffer.tensor) >= pages(buffer.resident_bytes)


def test_shared_buffer_is_resident_for_every_process_that_maps_it():
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    path = shm / f"flowkv-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    owner = ResidentBuffer.shared(path, 8 * MiB, prefault="now")
    try:
        assert resident_pages(owner.tensor) == pages(8 * MiB)
        owner.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        client = ResidentBuffer.shared(path, 8 * MiB, create=False, prefault="off")
        # The pages belong to the file: a second mapping finds them resident, bytes included.
        assert resident_pages(client.tensor) == pages(8 * MiB)
        assert client.tensor[:4].tolist() == [1, 2, 3, 4]
        with pytest.raises(FileExistsError):
            ResidentBuffer.shared(path, 8 * MiB)
        with pytest.raises(ValueError, match="fewer than"):
            ResidentBuffer.shared(path, 16 * MiB, create=False)
        client.close()
    finally:
        owner.close()
        owner.unlink()
    assert not path.exists()


def test_node_server_segment_is_resident_after_start(node_servers):
    server = node_servers("resident", memory="32MiB")
    (segment,) = server.segments()
    view = ResidentBuffer.shared(segment, 32 * MiB, create=False, prefault="off")
    try:  # the segment's pages belong to the file: this process sees what the server made resident
        wait_for(lambda: resident_pages(view.tensor) == pages(32 * MiB), "the server's arena pre-fault")
    finally:
        view.close()


def test_huge_pages_are_advised_only_where_the_os_offers_them():
    support = huge_page_support()
    buffer = ResidentBuffer.anonymous(8 * MiB, prefault="now", huge_pages=True)
    assert buffer.huge_pages_advised == support.anonymous()
    assert buffer.tensor.data_ptr() % (2 * MiB) == 0 or not support.anonymous()
    plain = ResidentBuffer.anonymous(8 * MiB, prefault="now", huge_pages=False)
    assert not plain.huge_pages_advised


def test_an_arena_larger_than_the_machine_is_refused_with_a_clear_error():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        ResidentBuffer.anonymous(64 * total, prefault="off")
    except MemoryError as exc:
        assert "lower [tiers.memory] capacity" in str(exc) and "GiB of memory" in str(exc)
    else:  # a kernel that overcommits without limit (vm.overcommit_memory = 1) maps it
        assert Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1"


def test_bad_arguments():
    with pytest.raises(ValueError, match="prefault must be one of"):
        ResidentBuffer.anonymous(MiB, prefault="eager")
    with pytest.raises(ValueError, match="smaller than"):
        MemoryArena(8 * MiB, slab_bytes=MiB, backing=ResidentBuffer.anonymous(MiB, prefault="off"))
    with pytest.raises(ValueError, match="CPU"):
        resident_pages(torch.empty(0, device="meta"))
    with pytest.raises(ValueError, match="window_bytes"):
        ResidentBuffer.anonymous(MiB, prefault="off", window_bytes=0)


# -- the background window: resident ahead of the allocation frontier, refilled while idle --

def test_background_pre_fault_keeps_a_bounded_window_resident():
    buffer = ResidentBuffer.anonymous(64 * MiB, prefault="background", window_bytes=8 * MiB)
    try:
        assert buffer.wait_resident(timeout=120)
        assert buffer.prefault_state == "window full"
        assert buffer.resident_bytes == buffer.target_bytes == 8 * MiB
        assert resident_pages(buffer.tensor[: 8 * MiB]) == pages(8 * MiB)
        assert resident_pages(buffer.tensor[8 * MiB:]) == 0  # not the whole arena at start
    finally:
        buffer.close()


def test_the_window_moves_with_the_arena_frontier():
    backing = ResidentBuffer.anonymous(64 * MiB, prefault="background", window_bytes=8 * MiB, quiet_s=0.0)
    arena = MemoryArena(64 * MiB, slab_bytes=MiB, backing=backing)
    try:
        assert arena.wait_resident(timeout=120)
        objs = [arena.allocate((MiB,), torch.uint8) for _ in range(12)]
        assert backing.frontier_bytes == 12 * MiB
        assert backing.target_bytes == 20 * MiB
        assert arena.wait_resident(timeout=120)
        assert backing.resident_bytes == 20 * MiB
        assert resident_pages(arena.buffer[: 20 * MiB]) == pages(20 * MiB)
        assert resident_pages(arena.buffer[20 * MiB:]) == 0
        # Freed pages below the frontier are handed out again first: the frontier stays.
        for obj in objs:
            obj.ref_down()
        arena.allocate((MiB,), torch.uint8)
        assert backing.frontier_bytes == 12 * MiB
    finally:
        backing.close()


def test_refill_waits_while_the_engine_is_busy_and_allocation_never_waits_for_it():
    backing = ResidentBuffer.anonymous(64 * MiB, prefault="background", window_bytes=4 * MiB, quiet_s=0.0)
    arena = MemoryArena(64 * MiB, slab_bytes=MiB, backing=backing)
    try:
        assert arena.wait_resident(timeout=120)
        with arena.busy():  # a forward pass: stores allocate and write, the refill takes no step
            objs = [arena.allocate((MiB,), torch.uint8) for _ in range(16)]
            for obj in objs:
                obj.tensor.fill_(7)  # the writer faults its own pages in, as with prefault = "off"
            assert backing.target_bytes == 20 * MiB
            assert not arena.wait_resident(timeout=0.3)
            assert backing.resident_bytes == 4 * MiB
            assert backing.prefault_state == "waiting for the engine to idle"
        assert arena.wait_resident(timeout=120)  # idle again: the window is refilled
        assert backing.resident_bytes == 20 * MiB
        assert all(bool((obj.tensor == 7).all()) for obj in objs)  # refilling keeps the bytes
    finally:
        backing.close()


def test_refill_waits_for_a_quiet_engine():
    buffer = ResidentBuffer.anonymous(32 * MiB, prefault="background", window_bytes=4 * MiB, quiet_s=3600.0)
    try:
        assert buffer.wait_resident(timeout=120)  # the engine never worked yet: idle from the start
        assert buffer.resident_bytes == 4 * MiB
        buffer.note_allocated(8 * MiB)  # a store just now: the engine is busy for quiet_s
        assert buffer.target_bytes == 12 * MiB
        assert not buffer.wait_resident(timeout=0.3)
        assert buffer.resident_bytes == 4 * MiB
    finally:
        buffer.close()
    assert buffer.prefault_state == "stopped: asked to stop"


def test_a_window_larger_than_the_buffer_makes_it_all_resident():
    buffer = ResidentBuffer.anonymous(8 * MiB, prefault="background", window_bytes=64 * MiB)
    try:
        assert buffer.wait_resident(timeout=120)
        assert buffer.prefault_state == "done"
        assert resident_pages(buffer.tensor) == pages(8 * MiB)
    finally:
        buffer.close()


def test_pre_fault_now_leaves_no_thread_behind():
    def prefault_threads() -> int:
        return sum(t.name == "flowkv-prefault" and t.is_alive() for t in threading.enumerate())

    before = prefault_threads()
    buffer = ResidentBuffer.anonymous(16 * MiB, prefault="now", window_bytes=4 * MiB)
    assert buffer.prefault_state == "done" and resident_pages(buffer.tensor) == pages(16 * MiB)
    buffer.note_allocated(16 * MiB)
    assert prefault_threads() == before  # nothing competes with the engine after "now" returned
    buffer.close()


def test_memory_tier_window_from_the_pipeline_file():
    g = KVGeometry("cpu", 2, 2, 64, 16, torch.float16)
    engine = CacheEngine.from_pipeline("local-cpu", geometry=g, model_name="tiny",
                                       overrides={"chunk_size": 64, "tiers.memory.capacity": "64MiB",
                                                  "tiers.memory.prefault_window": "4MiB"})
    try:
        backing = engine.memory.arena.backing
        assert backing.window_bytes == 4 * MiB
        assert engine.memory.arena.wait_resident(timeout=120)
        assert resident_pages(engine.memory.arena.buffer[8 * MiB:]) == 0
    finally:
        engine.close()
