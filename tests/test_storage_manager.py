"""The storage manager (flowkv.tiers.manager) on its own, and a user's tier written to the public contract.

The manager is built the way the engine builds it: tier instances in lookup
order, memory included. The byte tier here is ``DictTier`` below: what a
user writes (public names only, no OpenTelemetry), also named in a pipeline
file by ``"test_storage_manager:DictTier"`` and driven through the engine.
"""

from __future__ import annotations

import inspect

import attrs
import pytest
import torch

import flowkv
from flowkv import CacheEngine, KVTransfer
from flowkv import payload as payloads
from flowkv.kernels import KVGeometry, gather
from flowkv.pipeline import dumps_pipeline, loads_pipeline
from flowkv.testing import make_paged_kv, random_slot_mapping
from flowkv.tiers import MemoryTier, MemoryTierConfig, StorageManager, Tier, TierHealth
from flowkv.tiers.manager import Entry, TierEvent

SHAPE = (2, 2, 64, 2, 16)  # one chunk (layers, kv, tokens, heads, head size): 16 KiB of fp16
SLAB = 16 * 1024  # one raw chunk: four fit in memory


# -- a user's tier: the whole of it -----------------------------------------------


@attrs.frozen(kw_only=True)
class DictTierConfig:
    max_entries: int = 1000


@flowkv.tier("dict-test", config=DictTierConfig)
class DictTier(Tier):
    """Payloads in a dict; a byte tier like disk or Redis, for tests."""

    def __init__(self, *, name: str, config: DictTierConfig) -> None:
        self.name = name
        self.config = config
        self.data: dict[str, bytes] = {}

    async def exists(self, keys: list[str]) -> list[bool]:
        return [key in self.data for key in keys]

    async def get(self, keys: list[str]) -> list[bytes | None]:
        return [self.data.get(key) for key in keys]

    async def put(self, entries: list[tuple[str, bytes]]) -> None:
        for key, blob in entries:
            if len(self.data) < self.config.max_entries:
                self.data.setdefault(key, bytes(blob))

    async def aclose(self) -> None:
        self.data.clear()


def test_a_user_tier_is_short_and_uses_only_public_names():
    source = inspect.getsource(DictTierConfig) + inspect.getsource(DictTier)
    assert len(source.splitlines()) < 40
    assert "opentelemetry" not in source and "._" not in source and "flowkv._" not in source


# -- the manager ---------------------------------------------------------------------


def manager(**byte_tiers: DictTier) -> StorageManager:
    memory = MemoryTier(name="memory", config=MemoryTierConfig(capacity=4 * SLAB, pin_memory=False))
    return StorageManager({"memory": memory, **byte_tiers}, slab_bytes=SLAB)


def dict_tier(name: str) -> DictTier:
    return DictTier(name=name, config=DictTierConfig())


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def store_in_memory(storage: StorageManager, key: str, kv: torch.Tensor) -> None:
    obj = storage.allocate(kv.shape, kv.dtype)
    obj.tensor.copy_(kv)
    assert storage.put("memory", key, obj=obj) == kv.nbytes
    obj.ref_down()


def test_memory_is_built_like_any_tier_and_opened_with_the_slab():
    storage = manager(disk=dict_tier("disk"))
    assert storage.order == ("memory", "disk")
    assert storage.staging == "memory" and storage.holds_objects("memory") and not storage.holds_objects("disk")
    assert storage.memory.arena.slab_bytes == SLAB
    assert storage.health() == {"memory": TierHealth.HEALTHY, "disk": TierHealth.HEALTHY}
    assert set(storage.stats()) == {"memory", "disk"}


def test_find_answers_the_first_tier_in_order_and_skips_what_it_is_told():
    disk, remote = dict_tier("disk"), dict_tier("remote")
    storage = manager(disk=disk, remote=remote)
    store_in_memory(storage, "k0", chunk(0))
    disk.data["k1"] = payloads.encode(chunk(1), "none")
    remote.data["k1"] = remote.data["k2"] = payloads.encode(chunk(2), "none")
    assert storage.find(["k0", "k1", "k2", "k3"]) == ["memory", "disk", "remote", None]
    assert storage.find(["k0", "k1", "k2"], skip=[False, True, False]) == ["memory", None, "remote"]
    assert storage.find(["k0", "k1", "k2"], tiers=["remote"]) == [None, "remote", "remote"]


@pytest.mark.parametrize("promote", [True, False])
def test_promotion_is_the_callers_choice(promote):
    disk = dict_tier("disk")
    storage = manager(disk=disk)
    decoded = []  # the manager decodes nothing itself: its engine's decode stages do (here, a stand-in)
    storage.decode_promotions_with(lambda entry, blob, room: decoded.append(entry.tier) or
                                   payloads.decode_into(blob, room.tensor, expect_key=entry.key) is not None)
    kv = chunk(3)
    disk.data["k"] = payloads.encode(kv, "none", key="k")
    found = storage.read(Entry("k", "disk", tuple(kv.shape), kv.dtype), promote=promote)
    assert storage.contains("k") is promote
    if promote:
        assert found.tier == "memory" and torch.equal(found.kv, kv) and decoded == ["disk"]
        found.obj.ref_down()
    else:
        assert found.tier == "disk" and found.obj is None
        assert torch.equal(payloads.decode(found.payload), kv)


def test_put_writes_the_named_byte_tier_behind():
    disk = dict_tier("disk")
    storage = manager(disk=disk)
    kv = chunk(4)
    assert storage.put("disk", "k", kv=kv) > 0
    assert storage.flush(10.0)
    assert torch.equal(payloads.decode(disk.data["k"]), kv)
    assert not storage.contains("k")


def test_observers_see_admits_evictions_and_removals():
    storage = manager()
    events: list[TierEvent] = []
    storage.subscribe(events.append)
    for index in range(5):  # four fit: the fifth evicts the oldest
        store_in_memory(storage, f"k{index}", chunk(index))
    assert storage.remove("k4")
    kinds = [(e.kind, e.key) for e in events]
    assert kinds[:4] == [("admit", f"k{i}") for i in range(4)]
    assert ("evict", "k0") in kinds and ("admit", "k4") in kinds and kinds[-1] == ("remove", "k4")
    assert all(e.tier == "memory" for e in events)


def test_pins_keep_object_hits_until_released():
    storage = manager()
    store_in_memory(storage, "k", chunk(5))
    storage.pin([("k", "memory"), ("elsewhere", "disk"), ("masked", None)], "lookup-1")
    assert storage.stats()["memory"]["pinned_objects"] == 1
    storage.release("lookup-1")
    assert storage.stats()["memory"]["pinned_objects"] == 0


# -- the user's tier in a pipeline, through the engine -----------------------------------


USER_TIER_GEOMETRY = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16,
                                dtype=torch.bfloat16)


def stored_through_the_user_tier(get: object, decode: str, sections: dict | None = None):
    """An engine (memory, then the user's tier) that stored 96 tokens into both and then emptied memory:
    (engine, tokens, the source cache, slots)."""
    g = USER_TIER_GEOMETRY
    text = dumps_pipeline(
        pipeline={"name": "dict", "chunk_size": 32},
        tiers={"memory": {"kind": "memory", "capacity": "4MiB", "pin_memory": False},
               "mine": {"kind": f"{__name__}:DictTier", "max_entries": 100, "timeout_s": 5.0}},
        store=["tokenize", "chunk-hash", "allocate", "gather", "put"],
        retrieve=["tokenize", "chunk-hash", "lookup", get, decode, "scatter"],
        sections=sections,
    )
    engine = CacheEngine(loads_pipeline(text), geometry=g, model_name="tiny")
    tokens = torch.arange(96)
    src = make_paged_kv(g, 16, seed=1)
    slots = random_slot_mapping(96, g, 16, seed=3)
    assert engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots)).stored_tokens == 96
    assert engine.flush(10.0)
    engine.memory.clear()
    scrubbed = []  # the freed pages zeroed: a room nobody fills holds no stale copy of the KV
    while (room := engine.storage.allocate(g.chunk_shape(32), g.dtype)) is not None:
        room.tensor.zero_()
        scrubbed.append(room)
    for room in scrubbed:
        room.ref_down()
    return engine, tokens, src, slots


def test_the_user_tier_serves_an_engine_from_a_pipeline_file():
    g = USER_TIER_GEOMETRY
    engine, tokens, src, slots = stored_through_the_user_tier(("get", {"promote": False}), "decompress")
    try:
        dst = make_paged_kv(g, 16, seed=2, fill=False)
        result = engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots))
        assert result.loaded_to == 96 and result.failed_range is None
        assert engine.stats()["tier.mine.read_bytes"] > 0
        assert len(engine.memory) == 0  # promote = false: read from the user's tier, not copied up
        out = [torch.empty(g.chunk_shape(96), dtype=g.dtype) for _ in range(2)]
        assert torch.equal(gather(dst, g, slots, out[0]), gather(src, g, slots, out[1]))
    finally:
        engine.close()


# -- promotion decodes through the pipeline's own decode stages -------------------------------


@flowkv.stage("decode-own-tensor", kinds=("retrieve",), needs={"payload"}, gives={"kv"}, role=flowkv.Role.CODEC)
def decode_own_tensor(chunks, *, ctx):
    """A user's decode stage that knows nothing of rooms: each payload into a tensor of its own, counted."""
    for chunk in chunks:
        if chunk.kv is None:
            chunk.kv = payloads.decode(chunk.payload, expect_key=chunk.key_str)
            ctx.services.count("decoded_by_the_users_stage")
        yield chunk


def test_a_promoted_chunk_is_decoded_by_the_pipelines_own_decode_stage_in_a_span(tmp_path):
    from flowkv import telemetry
    from flowkv.otlp_json import load_spans

    g = USER_TIER_GEOMETRY
    traces = tmp_path / "traces"
    engine, tokens, src, slots = stored_through_the_user_tier(
        "get", f"{__name__}:decode_own_tensor", {"telemetry": {"exporter": "file", "folder": str(traces)}})
    try:
        dst = make_paged_kv(g, 16, seed=2, fill=False)
        assert engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots)).loaded_to == 96
        stats = engine.stats()
        # Three chunks read from the user's tier, each decoded into memory by the user's stage, once:
        assert stats["promotions"] == 3 and stats["decoded_by_the_users_stage"] == 3
        held = [engine.memory.get(key) for key in engine.memory.keys()]
        assert len(held) == 3 and not any("codec" in obj.meta for obj in held)  # they landed raw
        engine.memory.release_objects(held)
        again = make_paged_kv(g, 16, seed=4, fill=False)
        assert engine.retrieve(KVTransfer(tokens=tokens, kv_caches=again, slot_mapping=slots)).loaded_to == 96
        assert engine.stats()["decoded_by_the_users_stage"] == 3  # raw in memory: read again, decoded no more
        out = [torch.empty(g.chunk_shape(96), dtype=g.dtype) for _ in range(3)]
        assert torch.equal(gather(dst, g, slots, out[0]), gather(src, g, slots, out[1]))
        assert torch.equal(gather(again, g, slots, out[2]), out[1])
    finally:
        engine.close()
    telemetry.flush()
    spans = [span for path in sorted(traces.glob("*.json*")) for span in load_spans(path)]
    by_id = {span.span_id: span for span in spans}
    promotions = [s for s in spans if s.name == "flowkv.promote"]
    assert len(promotions) == 3 and {by_id[s.parent_span_id].name for s in promotions} == {"get"}
    decodes = [s for s in spans if s.parent_span_id in {p.span_id for p in promotions}]
    assert [(s.name, s.attributes["flowkv.stage.role"]) for s in decodes] == [("decode-own-tensor", "codec")] * 3
    # The trace summary shows the promotions' decode as runs of their own.
    from flowkv.tracetools import summarize

    summary = summarize(spans)
    assert summary.runs["promote"] == 3
    assert [(s.kind, s.stage) for s in summary.stages if s.kind == "promote"] == [("promote", "decode-own-tensor")]


# -- a store batch is its caller's own ---------------------------------------------------


@flowkv.stage("put-forgetful", kinds=("store",), needs={"kv"}, gives={"stored"}, role=flowkv.Role.TIER_IO)
def put_forgetful(chunks, *, ctx):
    """A user's put stage: its chunks through a store batch, never committed for requests tagged ``forget``."""
    batch = ctx.services.storage.batch()
    forget = False
    for chunk in chunks:
        forget = "forget" in chunk.request.tags
        batch.put("memory", chunk.key_str, obj=chunk.obj, kv=chunk.kv, tenant=chunk.request.tenant)
        yield chunk
    if not forget:
        batch.commit()


def test_a_store_batch_never_committed_stores_nothing_and_leaks_into_no_later_store():
    g = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    text = dumps_pipeline(
        pipeline={"name": "forgetful", "chunk_size": 32},
        tiers={"memory": {"kind": "memory", "capacity": "4MiB", "pin_memory": False}},
        store=["tokenize", "chunk-hash", "allocate", "gather", f"{__name__}:put_forgetful"],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"],
    )
    engine = CacheEngine(loads_pipeline(text), geometry=g, model_name="tiny")
    try:
        src = make_paged_kv(g, 16, seed=1)
        slots = random_slot_mapping(96, g, 16, seed=3)
        forgotten, kept = torch.arange(96), torch.arange(96) + 1000
        engine.store(KVTransfer(tokens=forgotten, kv_caches=src, slot_mapping=slots, tags={"forget": "1"}))
        memory = engine.stats()["tiers"]["memory"]
        assert memory["entries"] == 0 and memory["used_bytes"] == 0  # its rooms went back with the run
        # The next store on this thread commits its own chunks only.
        engine.store(KVTransfer(tokens=kept, kv_caches=src, slot_mapping=slots))
        assert engine.stats()["tiers"]["memory"]["entries"] == 3
        assert engine.lookup(kept) == 96
        assert engine.lookup(forgotten, tags={"forget": "1"}) == 0
    finally:
        engine.close()
