"""The connector's scheduler side in this process: what a lookup ships, how often it asks, what saves carry.

vLLM's own ``Request`` objects (with vLLM's block hasher) and scheduler
outputs made here; the worker is a ``CacheEngine`` answering through
``query.answer``, as it does on its socket, behind a client that counts what
it is sent. Nothing starts vLLM.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from flowkv import CacheEngine  # noqa: E402
from flowkv._testing.paged import make_paged_kv, random_slot_mapping  # noqa: E402
from flowkv.calls import KVTransfer  # noqa: E402
from flowkv.integration.vllm.metadata import floor_to  # noqa: E402
from flowkv.integration.vllm.query import answer  # noqa: E402
from flowkv.integration.vllm.scheduler import ConnectorScheduler  # noqa: E402
from flowkv.integration.vllm.settings import ConnectorSettings  # noqa: E402
from flowkv.kernels import KVGeometry  # noqa: E402
from flowkv.keys import chain_hashes  # noqa: E402
from flowkv.pipeline import load_pipeline  # noqa: E402

BLOCK = 32
CHUNK = 64
NUM_BLOCKS = 512
GEOMETRY = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=BLOCK, dtype=torch.bfloat16)
SRC = make_paged_kv(GEOMETRY, NUM_BLOCKS, seed=1)
SLOTS = random_slot_mapping(NUM_BLOCKS * BLOCK, GEOMETRY, NUM_BLOCKS, seed=2)

@pytest.fixture(autouse=True)
def vllms_root_hash():
    """What vLLM's engine core does before its first request: its root hash from sha256_cbor. Set for
    each test, not once at import: an engine an earlier test ran in this process set it from its own
    hash algorithm (the process-wide ``NONE_HASH``)."""
    init_none_hash(sha256_cbor)


class CountingClient:
    """Stands in for the IPC client: hands each question to a worker engine, counting what was sent."""

    def __init__(self, engine: CacheEngine) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.lookups: list[tuple[dict, int]] = []  # (header, body bytes)

    def ask(self, header, body=None):
        import numpy as np

        array = np.asarray(body if body is not None else [], dtype="<i8")
        if header["op"] == "lookup":
            self.lookups.append((header, array.nbytes))
        return [{"ok": True, **answer(self.engine, self.lock, dict(header), array)}]

    def tell(self, header, body=None):
        self.ask(header, body)

    def close(self):
        pass


def worker_engine(chunk: int = CHUNK, pipeline: str = "local-cpu", **overrides) -> CacheEngine:
    return CacheEngine.from_pipeline(pipeline, geometry=GEOMETRY, model_name="tiny",
                                     overrides={"chunk_size": chunk, "tiers.memory.capacity": "16MiB", **overrides})


def scheduler(engine: CacheEngine, *, block: int = BLOCK, algo: str = "sha256", role: str = "kv_both",
              **extra) -> ConnectorScheduler:
    settings = ConnectorSettings.from_extra_config({"chunk_size": engine.chunk_size, **extra}, default_model="tiny")
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block, prefix_caching_hash_algo=algo),
        parallel_config=SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1, pipeline_parallel_size=1),
        instance_id="test-scheduler",
    )
    # KVTransferConfig's is_kv_consumer / is_kv_producer for kv_role
    transfer = SimpleNamespace(is_kv_consumer=role in ("kv_both", "kv_consumer"),
                               is_kv_producer=role in ("kv_both", "kv_producer"), kv_load_failure_policy="recompute")
    connector = ConnectorScheduler(config, transfer, settings,
                                   load_pipeline(settings.pipeline, overrides=settings.overrides))
    connector._lookup_client.close()
    connector._lookup_client = CountingClient(engine)
    return connector


def vllm_request(req_id: str, tokens: list[int], *, block: int = BLOCK, cache_salt: str | None = None,
                 kv_transfer_params: dict | None = None) -> Request:
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": kv_transfer_params}
                              if kv_transfer_params is not None else None)
    return Request(req_id, list(tokens), sampling, None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(block, sha256_cbor))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def store(engine: CacheEngine, ids: list[int]) -> None:
    engine.store(KVTransfer(tokens=ids, kv_caches=SRC, slot_mapping=SLOTS[: len(ids)]))


def output(new=(), cached=(), scheduled=None):
    """A SchedulerOutput as the connector reads it: new requests (req, computed, blocks) and running ones."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(blocks,), num_computed_tokens=c)
                            for r, c, blocks in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.request_id for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[(blocks,) if blocks else None for _, _, blocks in cached],
            num_computed_tokens=[c for _, c, _ in cached]),
        num_scheduled_tokens=scheduled or {},
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
    )


def carry_out_saves(engine: CacheEngine, meta) -> None:
    """What a worker does with the step's saves: store each, keyed by the hashes the scheduler sent."""
    for save in meta.saves:
        n = len(save.token_ids)
        engine.store(KVTransfer(tokens=save.token_ids, kv_caches=SRC,
                                slot_mapping=SLOTS[save.token_start:save.token_start + n],
                                chunk_hashes=save.chunk_hashes))


def test_a_waiting_request_is_looked_up_once_however_many_steps_it_waits():
    engine = worker_engine()
    prompt = tokens(5 * CHUNK + 10, seed=1)
    store(engine, prompt[: 4 * CHUNK])
    connector = scheduler(engine)
    request = vllm_request("waits", prompt)

    # No free blocks for it: vLLM asks again every step it waits.
    answers = [connector.get_num_new_matched_tokens(request, 0) for _ in range(25)]

    assert answers == [(4 * CHUNK, False)] * 25
    assert len(connector._lookup_client.lookups) == 1
    stats = engine.stats()
    assert stats["lookups"] == 1 and stats.get("lookup_repeats", 0) == 0
    assert stats["lookup_requested_tokens"] == 5 * CHUNK
    # Its pins are held all along, for the load vLLM will accept.
    assert stats["tiers"]["memory"]["pinned_objects"] == 4


def test_a_lookup_ships_chunk_hashes_not_tokens():
    engine = worker_engine()
    prompt = tokens(16 * CHUNK, seed=2)
    connector = scheduler(engine)
    connector.get_num_new_matched_tokens(vllm_request("big", prompt), 0)
    [(header, body_bytes)] = connector._lookup_client.lookups
    assert header["num_tokens"] == 16 * CHUNK
    # 32 bytes a chunk (sha256_cbor), where the tokens would take 8 bytes each.
    assert body_bytes == 16 * 32 < len(prompt) * 8


def test_a_miss_another_request_stored_meanwhile_is_looked_up_again():
    engine = worker_engine()
    prompt = tokens(4 * CHUNK + 5, seed=3)
    connector = scheduler(engine)
    first, second = vllm_request("first", prompt), vllm_request("second", prompt)
    assert connector.get_num_new_matched_tokens(second, 0) == (0, False)
    # "first" runs its prefill and stores its chunks while "second" waits.
    assert connector.get_num_new_matched_tokens(first, 0) == (0, False)
    connector.update_state_after_alloc(first, None, 0)
    blocks = list(range(len(prompt) // BLOCK + 1))
    meta = connector.build_connector_meta(output(new=[(first, 0, blocks)], scheduled={"first": len(prompt)}))
    carry_out_saves(engine, meta)
    assert connector.get_num_new_matched_tokens(second, 0) == (4 * CHUNK, False)
    assert connector.get_num_new_matched_tokens(second, 0) == (4 * CHUNK, False)

    assert len(connector._lookup_client.lookups) == 3  # second, first, second again
    stats = engine.stats()
    assert (stats["lookups"], stats["lookup_repeats"]) == (2, 1)
    # Each request's tokens and hits count once.
    assert stats["lookup_requested_tokens"] == 2 * 4 * CHUNK
    assert stats["lookup_hit_tokens"] == 4 * CHUNK


def test_saves_carry_only_the_chunks_each_step_completes():
    engine = worker_engine()
    prompt = tokens(16 * CHUNK + 7, seed=4)
    connector = scheduler(engine)
    request = vllm_request("long", prompt)
    connector.get_num_new_matched_tokens(request, 0)
    connector.update_state_after_alloc(request, None, 0)
    blocks = list(range(len(prompt) // BLOCK + 1))
    step = 3 * CHUNK + 20  # prefill chunks that do not end on a chunk boundary
    saves = []
    computed = 0
    while computed < len(prompt):
        n = min(step, len(prompt) - computed)
        new = [(request, computed, blocks)] if computed == 0 else []
        cached = [(request, computed, None)] if computed else []
        meta = connector.build_connector_meta(output(new=new, cached=cached, scheduled={"long": n}))
        carry_out_saves(engine, meta)
        saves += meta.saves
        computed += n

    starts = [s.token_start for s in saves]
    ends = [s.token_start + len(s.token_ids) for s in saves]
    # One run of chunks after another, never a token twice: O(n) over a chunked prefill.
    assert starts == [0] + ends[:-1] and ends[-1] == 16 * CHUNK
    for save in saves:
        assert save.token_ids == prompt[save.token_start:save.token_start + len(save.token_ids)]
        assert save.chunk_hashes == chain_hashes(prompt[: save.token_start + len(save.token_ids)], CHUNK,
                                                 "sha256_cbor")[save.token_start // CHUNK:]
    # The worker stored under the keys it would have made from the tokens.
    assert engine.lookup(torch.tensor(prompt)) == 16 * CHUNK


def test_a_load_carries_the_tokens_and_hashes_of_the_chunks_it_reads_only():
    engine = worker_engine()
    prompt = tokens(8 * CHUNK + 3, seed=5)
    store(engine, prompt)
    connector = scheduler(engine)
    request = vllm_request("warm", prompt)
    # vLLM's own prefix cache held the first block: flowkv loads from there.
    assert connector.get_num_new_matched_tokens(request, BLOCK) == (8 * CHUNK - BLOCK, False)
    connector.update_state_after_alloc(request, None, 8 * CHUNK - BLOCK)
    blocks = list(range(len(prompt) // BLOCK + 1))
    meta = connector.build_connector_meta(output(new=[(request, 8 * CHUNK, blocks)], scheduled={"warm": 3}))
    [load] = meta.loads
    assert (load.start, load.end, load.token_start, load.skip_prefix) == (BLOCK, 8 * CHUNK, 0, 0)
    assert load.chunk_hashes == chain_hashes(prompt[: 8 * CHUNK], CHUNK, "sha256_cbor")
    assert load.token_ids == prompt[: 8 * CHUNK]
    assert not load.load_async


@pytest.mark.parametrize("setting, sound", [
    ({}, True),
    ({"algo": "sha256"}, False),  # vLLM's default pickles its input
    ({"block": 2 * BLOCK}, False),  # other spans
    ({"cache_salt": "tenant-a"}, False),  # vLLM mixes the salt into block 0; flowkv keys it as a tag
])
def test_vllm_block_hashes_stand_for_chunk_hashes_only_where_they_are_flowkv_s(setting, sound):
    engine = worker_engine(chunk=BLOCK)
    block = setting.get("block", BLOCK)
    connector = scheduler(engine, block=block, algo=setting.get("algo", "sha256_cbor"))
    prompt = tokens(6 * BLOCK + 9, seed=6)
    request = vllm_request("r", prompt, block=block, cache_salt=setting.get("cache_salt"))
    connector.get_num_new_matched_tokens(request, 0)
    chain = connector._requests["r"].chain
    assert chain.from_vllm is sound
    # Either way the keys are flowkv's own chunk hashes of the tokens.
    assert chain.full == chain_hashes(prompt, BLOCK, "sha256_cbor", partial=False)
    if sound:
        assert chain.full == [bytes(h) for h in request.block_hashes]


def test_a_hit_below_memory_loads_asynchronously_and_memory_hits_do_not(tmp_path):
    engine = worker_engine(pipeline="cpu-disk", **{"tiers.disk.path": str(tmp_path)})
    cold, warm = tokens(4 * CHUNK + 1, seed=7), tokens(4 * CHUNK + 1, seed=8)
    store(engine, cold)
    assert engine.flush(30)
    engine.memory.clear()  # on disk only now
    store(engine, warm)
    connector = scheduler(engine)
    assert connector.get_num_new_matched_tokens(vllm_request("disk", cold), 0) == (4 * CHUNK, True)
    assert connector.get_num_new_matched_tokens(vllm_request("memory", warm), 0) == (4 * CHUNK, False)

    always = scheduler(engine, async_loads="always")
    assert always.get_num_new_matched_tokens(vllm_request("memory-2", warm), 0) == (4 * CHUNK, True)
    off = scheduler(engine, async_loads="off")
    assert off.get_num_new_matched_tokens(vllm_request("disk-2", cold), 0) == (4 * CHUNK, False)


def test_a_request_ended_before_its_accepted_load_was_sent_leaves_no_pin():
    """vLLM accepted an asynchronous load (its blocks allocated), then the request ended (a client that hung
    up) before the next step's metadata could send the load: the lookup's pins go at once, not at their
    deadline; a load that was sent is released by its retrieve, not twice."""
    engine = worker_engine()
    doc = tokens(4 * CHUNK + 1, seed=9)
    store(engine, doc)
    connector = scheduler(engine, async_loads="always")
    request = vllm_request("gone", doc)
    assert connector.get_num_new_matched_tokens(request, 0) == (4 * CHUNK, True)
    lookup_id = connector._requests["gone"].answer.lookup_id
    assert engine.storage.holds_pins(lookup_id)
    connector.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6, 7, 8],)),
                                       4 * CHUNK)
    assert engine.storage.holds_pins(lookup_id)  # accepted: the retrieve will release them
    connector.request_finished(request, [])
    assert not engine.storage.holds_pins(lookup_id)
    assert connector.build_connector_meta(output()).loads == []

    kept = vllm_request("kept", doc)
    assert connector.get_num_new_matched_tokens(kept, 0) == (4 * CHUNK, True)
    lookup_id = connector._requests["kept"].answer.lookup_id
    connector.update_state_after_alloc(kept, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6, 7, 8],)),
                                       4 * CHUNK)
    [load] = connector.build_connector_meta(output()).loads
    assert load.lookup_id == lookup_id and engine.storage.holds_pins(lookup_id)
    connector.request_finished(kept, [])  # ended while its load runs: the worker's retrieve releases them
    assert engine.storage.holds_pins(lookup_id)


@pytest.mark.parametrize("keyer, ships_hashes", [("house_keys", True), ("content_keys", False)])
def test_a_third_party_keyer_gets_hashes_shipped_only_when_it_declares_it_accepts_them(tmp_path, keyer, ships_hashes):
    # The scheduler decides by what the keyer declares (flowkv.registry.StageInfo.accepts_hashes), not by its name.
    from test_stage_roles import keyed_with

    path = tmp_path / "house.toml"
    path.write_text(keyed_with(keyer))
    engine = worker_engine(pipeline=str(path))
    prompt = tokens(6 * CHUNK, seed=7)
    store(engine, prompt[: 3 * CHUNK])
    connector = scheduler(engine, pipeline=str(path))
    assert connector.get_num_new_matched_tokens(vllm_request("house", prompt), 0) == (3 * CHUNK, False)
    [(header, body_bytes)] = connector._lookup_client.lookups
    assert body_bytes == (6 * 32 if ships_hashes else len(prompt) * 8)


class CountingDict(dict):
    """The connector's request table, counting the lookups a step makes in it."""

    gets = 0

    def get(self, key, default=None):
        self.gets += 1
        return super().get(key, default)


def decoding_batch(engine: CacheEngine, connector: ConnectorScheduler, n: int, prompt_tokens: int):
    """``n`` requests whose prompts were prefilled (and stored) in one step: (requests, tokens computed)."""
    requests = [vllm_request(f"r{i}", tokens(prompt_tokens, seed=100 + i)) for i in range(n)]
    new = []
    for i, request in enumerate(requests):
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        connector.update_state_after_alloc(request, None, 0)
        new.append((request, 0, list(range(i * 8, i * 8 + 8))))
    meta = connector.build_connector_meta(output(new=new, scheduled={r.request_id: prompt_tokens for r in requests}))
    assert len(meta.saves) == n
    carry_out_saves(engine, meta)
    return requests, prompt_tokens


def decode_step(connector: ConnectorScheduler, requests, computed: int, extra_new=()):
    return connector.build_connector_meta(output(new=extra_new, cached=[(r, computed, None) for r in requests],
                                                 scheduled={r.request_id: 1 for r in requests}))


def test_decode_steps_of_stored_prompts_do_one_check_not_a_lookup_per_request(monkeypatch):
    """A decoding batch whose prompts flowkv stored: after two quiet steps (a rollback of the
    saving step would show in them) build_connector_meta looks at no request at all."""
    engine = worker_engine()
    connector = scheduler(engine)
    requests, computed = decoding_batch(engine, connector, 8, 3 * CHUNK + 5)
    table = CountingDict(connector._requests)
    connector._requests = table
    save_specs = []
    original = connector._save_spec
    monkeypatch.setattr(connector, "_save_spec", lambda *a: save_specs.append(a) or original(*a))

    per_step = []
    for step in range(40):
        before = (table.gets, len(save_specs))
        meta = decode_step(connector, requests, computed + step)
        assert not meta.loads and not meta.saves
        per_step.append((table.gets - before[0], len(save_specs) - before[1]))
    assert per_step[:2] == [(8, 8), (8, 8)]  # the two quiet steps
    assert per_step[2:] == [(0, 0)] * 38
    assert connector._attentive == set()

    # A new request joins the batch: only it is looked at; it is stored; the others stay skipped.
    newcomer = vllm_request("new", tokens(2 * CHUNK + 9, seed=200))
    connector.get_num_new_matched_tokens(newcomer, 0)
    connector.update_state_after_alloc(newcomer, None, 0)
    before = (table.gets, len(save_specs))
    meta = connector.build_connector_meta(output(
        new=[(newcomer, 0, list(range(100, 104)))], cached=[(r, computed + 40, None) for r in requests],
        scheduled={"new": 2 * CHUNK + 9, **{r.request_id: 1 for r in requests}}))
    assert [save.req_id for save in meta.saves] == ["new"]
    assert (table.gets - before[0], len(save_specs) - before[1]) == (1, 1)
    carry_out_saves(engine, meta)
    assert engine.lookup(torch.tensor(newcomer.prompt_token_ids)) == 2 * CHUNK
    for request in requests:
        assert engine.lookup(torch.tensor(request.prompt_token_ids)) == 3 * CHUNK


def test_a_rollback_right_after_the_saving_step_still_saves_again():
    """The step after a request's last save may show vLLM rolled it back (a failed load cut
    that step): the connector still looks, and asks for the store again."""
    engine = worker_engine()
    connector = scheduler(engine)
    [request], computed = decoding_batch(engine, connector, 1, 3 * CHUNK + 5)
    # Rolled back to inside chunk 1: vLLM computes the rest of the prompt again.
    meta = connector.build_connector_meta(output(cached=[(request, CHUNK + 3, None)],
                                                 scheduled={request.request_id: computed - CHUNK - 3}))
    assert [(save.token_start, len(save.token_ids)) for save in meta.saves] == [(CHUNK, 2 * CHUNK)]
    for step in range(3):
        decode_step(connector, [request], computed + step)
    assert connector._attentive == set()


def test_a_resumed_request_is_looked_at_again():
    """Preempted and resumed (vLLM gives its blocks anew): its steps are looked at until quiet again."""
    engine = worker_engine()
    connector = scheduler(engine)
    [request], computed = decoding_batch(engine, connector, 1, 3 * CHUNK + 5)
    for step in range(3):
        decode_step(connector, [request], computed + step)
    assert connector._attentive == set()
    resumed = output(cached=[(request, 0, list(range(200, 208)))], scheduled={request.request_id: computed})
    resumed.scheduled_cached_reqs.resumed_req_ids = {request.request_id}
    meta = connector.build_connector_meta(resumed)
    assert connector._requests[request.request_id].block_ids == list(range(200, 208))
    assert [(save.token_start, save.block_ids) for save in meta.saves] == [(0, list(range(200, 208)))]
    assert request.request_id in connector._attentive


# -- blend pipelines (CacheBlend): segments end anywhere -----------------------------------------

SEPARATOR = [1, 2]  # never drawn by tokens()
BLEND = {"pipeline": "blend", "blend.separator": SEPARATOR}


def blend_parts(seed: int) -> tuple[list[int], list[list[int]]]:
    """A system prompt and four documents, each closed by the separator."""
    system = tokens(40, seed) + SEPARATOR
    return system, [tokens(100, seed + 1 + i) + SEPARATOR for i in range(4)]


def blend_engine() -> CacheEngine:
    return worker_engine(pipeline="blend", **{"blend.separator": SEPARATOR})


def test_a_blend_lookup_matches_the_prefix_then_each_following_document_found_up_to_the_first_missing():
    engine = blend_engine()
    system, docs = blend_parts(seed=40)
    store(engine, system + docs[0] + docs[1] + docs[2])
    connector = scheduler(engine, **BLEND)
    question = tokens(20, seed=49)
    reordered = system + docs[2] + docs[0] + question
    # Whole blocks of the documents found; the question is never stored.
    assert connector.get_num_new_matched_tokens(vllm_request("reordered", reordered), 0) == (
        floor_to(len(system + docs[2] + docs[0]), BLOCK), False)
    # A document flowkv does not hold ends the match there, though one after it is stored.
    holed = system + docs[1] + docs[3] + docs[0] + question
    assert connector.get_num_new_matched_tokens(vllm_request("holed", holed), 0) == (
        floor_to(len(system + docs[1]), BLOCK), False)
    # Segment pipelines ship tokens: a segment's key depends on where separators fall.
    header, body_bytes = connector._lookup_client.lookups[-1]
    assert "num_tokens" not in header and body_bytes == 8 * len(holed)


def test_a_blend_load_carries_every_token_of_the_documents_it_touches_and_the_requests_ratio():
    engine = blend_engine()
    system, docs = blend_parts(seed=50)
    store(engine, system + docs[0] + docs[1])
    connector = scheduler(engine, **BLEND, async_loads="always")
    prompt = system + docs[1] + docs[0] + tokens(20, seed=59)
    request = Request("ratio", prompt, SamplingParams(max_tokens=4, extra_args={
        "kv_transfer_params": {"flowkv.blend.recompute_ratio": 0.4}}), None,
        block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))
    documents = len(system + docs[1] + docs[0])
    matched, load_async = connector.get_num_new_matched_tokens(request, 0)
    # Even with async_loads = "always": a blend recomputes in the step it lands in.
    assert (matched, load_async) == (floor_to(documents, BLOCK), False)
    connector.update_state_after_alloc(request, None, matched)
    blocks = list(range(len(prompt) // BLOCK + 1))
    meta = connector.build_connector_meta(output(new=[(request, 0, blocks)], scheduled={"ratio": len(prompt)}))
    [load] = meta.loads
    assert (load.start, load.end, load.token_start) == (0, matched, 0)
    # The last document reaches past the last whole block: all of it goes, or its key would differ.
    assert load.token_ids == prompt[:documents] and load.chunk_hashes is None
    assert load.recompute_ratio == 0.4
    # The same step's save keeps out what the load brought (chunk-aligned, as the engine skips).
    [save] = meta.saves
    assert save.token_ids == prompt and save.skip_prefix == floor_to(matched, CHUNK)
    # Segment keys only, made in the worker: nothing of the blended range goes under chained keys.
    assert save.chunk_hashes is None


def test_a_blend_save_stores_every_document_a_separator_closed_not_only_whole_chunks():
    engine = blend_engine()
    system, docs = blend_parts(seed=60)
    prompt = system + docs[0] + docs[1] + tokens(20, seed=69)
    connector = scheduler(engine, **BLEND)
    request = vllm_request("cold", prompt)
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    connector.update_state_after_alloc(request, None, 0)
    blocks = list(range(len(prompt) // BLOCK + 1))
    meta = connector.build_connector_meta(output(new=[(request, 0, blocks)], scheduled={"cold": len(prompt)}))
    [save] = meta.saves
    assert save.token_ids == prompt and save.skip_prefix == 0
    carry_out_saves(engine, meta)
    # The second document ends past the last chunk boundary and is stored all the same.
    later = system + docs[1] + tokens(20, seed=70)
    assert engine.lookup(torch.tensor(later)) == len(system + docs[1])
    # Nothing new past the prompt: the next step asks for no save.
    step = connector.build_connector_meta(output(cached=[(request, len(prompt), None)], scheduled={"cold": 1}))
    assert step.saves == []
