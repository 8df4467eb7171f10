"""The worker's asynchronous loads (``flowkv.integration.vllm.async_loads``) against a real engine.

The engine's slower tier is ``GateTier``: payloads in a dict, whose reads
wait until the test opens its gate, so a load is caught while its chunks are
still on their way up into memory. Nothing starts vLLM.
"""

from __future__ import annotations

import threading
import time

import anyio
import attrs
import pytest
import torch

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

import flowkv  # noqa: E402
from flowkv import CacheEngine, KVTransfer  # noqa: E402
from flowkv._testing.paged import make_paged_kv, random_slot_mapping  # noqa: E402
from flowkv.integration.vllm.async_loads import AsyncLoads  # noqa: E402
from flowkv.integration.vllm.metadata import LoadSpec, slot_mapping  # noqa: E402
from flowkv.kernels import KVGeometry, gather  # noqa: E402
from flowkv.keys import chain_hashes  # noqa: E402
from flowkv.pipeline import dumps_pipeline, loads_pipeline  # noqa: E402
from flowkv.tiers import Tier  # noqa: E402

BLOCK = 16
CHUNK = 32
NUM_BLOCKS = 64
GEOMETRY = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=BLOCK, dtype=torch.bfloat16)
SRC = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=1)
SLOTS = random_slot_mapping(NUM_BLOCKS * BLOCK, GEOMETRY, NUM_BLOCKS, seed=2)
GATE = threading.Event()


@attrs.frozen(kw_only=True)
class GateTierConfig:
    pass


@flowkv.tier("gate-test", config=GateTierConfig)
class GateTier(Tier):
    """A byte tier whose reads wait for ``GATE``."""

    data: dict[str, bytes] = {}

    def __init__(self, *, name: str, config: GateTierConfig) -> None:
        self.name = name
        GateTier.data = {}

    async def exists(self, keys):
        return [key in self.data for key in keys]

    async def get(self, keys):
        while not GATE.is_set():
            await anyio.sleep(0.005)
        return [self.data.get(key) for key in keys]

    async def put(self, entries):
        for key, blob in entries:
            self.data[key] = bytes(blob)

    async def aclose(self):
        pass


def engine() -> CacheEngine:
    text = dumps_pipeline(
        pipeline={"name": "gate", "chunk_size": CHUNK},
        tiers={"memory": {"kind": "memory", "capacity": "4MiB"},
               "gate": {"kind": f"{__name__}:GateTier", "timeout_s": 30.0}},
        store=["tokenize", "chunk-hash", "allocate", "gather", ("compress", {"codec": "none"}), "put"],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"],
    )
    return CacheEngine(loads_pipeline(text), geometry=GEOMETRY, model_name="tiny")


def on_gate_only(e: CacheEngine, ids: list[int]) -> None:
    """Store ``ids``, then leave them only in the gate tier."""
    GATE.set()
    e.store(KVTransfer(tokens=ids, kv_caches=SRC, slot_mapping=SLOTS[: len(ids)]))
    assert e.flush(30)
    e.memory.clear()
    GATE.clear()


def load_spec(req_id: str, ids: list[int], lookup_id: str) -> LoadSpec:
    return LoadSpec(req_id=req_id, token_ids=ids, token_start=0, block_ids=list(range(NUM_BLOCKS)), start=0,
                    end=len(ids), skip_prefix=0, lookup_id=lookup_id, tags={}, load_async=True,
                    chunk_hashes=chain_hashes(ids, CHUNK, "sha256_cbor"))


def async_loads(e: CacheEngine, dst) -> AsyncLoads:
    def transfer(load: LoadSpec) -> KVTransfer:
        slots = slot_mapping(load.block_ids, BLOCK, load.token_start, len(load.token_ids), load.start, load.end)
        return KVTransfer(tokens=load.token_ids, kv_caches=dst, slot_mapping=slots, lookup_id=load.lookup_id,
                          chunk_hashes=load.chunk_hashes)

    return AsyncLoads(engine_lock=threading.Lock(), block_size=BLOCK, transfer=transfer,
                      reached=lambda load, to: min(max(load.token_start + to, load.start), load.end),
                      load_failed=lambda load: None, wait_limit_s=60.0)


def landed(e: CacheEngine, lookup_id: str) -> None:
    deadline = time.monotonic() + 30
    while e.prefetch_pending(lookup_id):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_load_finishes_once_its_chunks_are_up_in_memory_and_not_before():
    e = engine()
    ids = tokens(4 * CHUNK, seed=1)
    on_gate_only(e, ids)
    found = e.lookup_result(ids, pin=True, lookup_id="L1")
    assert (found.hit_tokens, found.memory_tokens) == (4 * CHUNK, 0)
    dst = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=3, fill=False)
    loads = async_loads(e, dst)
    loads.add(load_spec("r1", ids, "L1"))

    waiting = loads.finish(e, set())  # the chunks are still being read
    assert (waiting.recving, waiting.failed, len(loads)) == (set(), set(), 1)
    GATE.set()
    landed(e, "L1")
    done = loads.finish(e, set())
    assert (done.recving, done.failed, done.error_blocks) == ({"r1"}, set(), set())
    assert len(loads) == 0
    slots = slot_mapping(list(range(NUM_BLOCKS)), BLOCK, 0, len(ids), 0, len(ids))
    stored, loaded = (torch.empty(GEOMETRY.chunk_shape(len(ids)), dtype=GEOMETRY.dtype) for _ in range(2))
    # What was stored from SRC's slots is now in dst's blocks.
    assert torch.equal(gather(SRC, GEOMETRY, SLOTS[: len(ids)], stored), gather(dst, GEOMETRY, slots, loaded))
    assert e.stats()["retrieved_tokens"] == 4 * CHUNK
    assert e.stats()["tiers"]["memory"]["pinned_objects"] == 0


def test_a_load_missing_a_chunk_is_reported_failed_without_copying_anything():
    e = engine()
    ids = tokens(4 * CHUNK, seed=2)
    on_gate_only(e, ids)
    e.lookup_result(ids, pin=True, lookup_id="L2")
    GATE.set()
    landed(e, "L2")
    # Chunk 2 goes after it was found (a corrupt file is dropped when read).
    [key] = [k.to_str() for k in e.keys.prefix({}).keys(chain_hashes(ids, CHUNK, "sha256_cbor"))][2:3]
    e.storage.remove(key)
    GateTier.data.pop(key)
    loads = async_loads(e, make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=4, fill=False))
    loads.add(load_spec("r2", ids, "L2"))
    done = loads.finish(e, set())

    assert (done.recving, done.failed) == ({"r2"}, {"r2"})
    # Every block of the load: vLLM drops it and asks again.
    assert done.error_blocks == set(range(4 * CHUNK // BLOCK))
    assert e.stats().get("retrieved_tokens", 0) == 0
    assert e.stats()["retrieve_short"] == 1
    assert e.stats()["tiers"]["memory"]["pinned_objects"] == 0


def test_a_load_of_a_request_vllm_finished_is_reported_without_a_copy():
    e = engine()
    ids = tokens(4 * CHUNK, seed=3)
    on_gate_only(e, ids)
    e.lookup_result(ids, pin=True, lookup_id="L3")
    loads = async_loads(e, make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=5, fill=False))
    loads.add(load_spec("r3", ids, "L3"))
    done = loads.finish(e, {"r3"})  # aborted while its chunks were on their way
    assert (done.recving, done.failed) == ({"r3"}, set())
    GATE.set()
    landed(e, "L3")
    assert e.stats().get("retrieved_tokens", 0) == 0
    assert e.stats()["tiers"]["memory"]["pinned_objects"] == 0


def test_an_idle_step_waits_for_a_load_to_land_sleeping_and_no_longer_than_its_limit():
    """A step that schedules nothing waits for a prefetch (the GIL released, so the I/O thread can read):
    it returns False at its limit while the chunks are held up, and at once once they have landed."""
    e = engine()
    ids = tokens(4 * CHUNK, seed=4)
    on_gate_only(e, ids)
    e.lookup_result(ids, pin=True, lookup_id="L4")
    loads = async_loads(e, make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=6, fill=False))
    started = time.monotonic()
    assert not loads.wait_for_landing(e, 30.0) and time.monotonic() - started < 5  # none pending: no wait
    loads.add(load_spec("r4", ids, "L4"))
    started, cpu = time.monotonic(), time.thread_time()
    assert not loads.wait_for_landing(e, 0.2)  # held up at the gate
    waited, spun = time.monotonic() - started, time.thread_time() - cpu
    assert waited >= 0.2 and spun < waited / 2  # slept, not spun
    GATE.set()
    started = time.monotonic()
    assert loads.wait_for_landing(e, 30.0)  # returns once landed, long before the limit
    assert time.monotonic() - started < 25
    done = loads.finish(e, set())
    assert done.recving == {"r4"} and done.failed == set()
