"""Layerwise store and retrieve through the engine: same bytes as whole-request runs,
the all-layers rule for hits, and one span per stage per layer."""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import flowkv
from flowkv import CacheEngine, KVTransfer, telemetry
from flowkv.items import Chunk, RunContext
from flowkv.kernels import KVGeometry, gather
from flowkv.otlp_json import load_spans
from flowkv.pipeline import PipelineError, load_pipeline
from flowkv.testing import make_paged_kv, random_slot_mapping

CHUNK = 64
BLOCKS = 48
N = 5 * CHUNK + 17


def geometry(layout: str = "cpu") -> KVGeometry:
    heads = 1 if layout == "mla" else 2
    return KVGeometry(layout, num_layers=4, num_kv_heads=heads, head_size=16, block_size=16, dtype=torch.float16)


def make_engine(g: KVGeometry, pipeline: str = "local-cpu", **overrides) -> CacheEngine:
    settings = {"chunk_size": CHUNK, "tiers.memory.capacity": "16MiB", "layerwise.enabled": True, **overrides}
    return CacheEngine.from_pipeline(pipeline, geometry=g, model_name="tiny", overrides=settings)


def read_back(caches, g: KVGeometry, slots: torch.Tensor) -> torch.Tensor:
    return gather(caches, g, slots, torch.empty(g.chunk_shape(len(slots)), dtype=g.dtype))


def paged_request(g: KVGeometry, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A filled source cache, an empty destination, N tokens and their slots (seeds seed, seed+1, seed+2)."""
    src = make_paged_kv(g, BLOCKS, seed=seed)
    dst = make_paged_kv(g, BLOCKS, seed=seed + 1, fill=False)
    return src, dst, torch.arange(N), random_slot_mapping(N, g, BLOCKS, seed=seed + 2)


@pytest.mark.parametrize("layout", ["cpu", "flash_kv_nhd", "flash_blocks_hnd", "mla"])
def test_layerwise_round_trip_equals_whole_request(layout: str) -> None:
    g = geometry(layout)
    src = make_paged_kv(g, BLOCKS, seed=1)
    tokens = torch.arange(N) + 7
    slots = random_slot_mapping(N, g, BLOCKS, seed=2)

    layerwise = make_engine(g)
    whole = CacheEngine.from_pipeline("local-cpu", geometry=g, model_name="tiny",
                                      overrides={"chunk_size": CHUNK, "tiers.memory.capacity": "16MiB"})
    assert layerwise.layerwise and not whole.layerwise
    handle = layerwise.store_layerwise(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    for layer in range(g.num_layers):
        handle.layer_ready(layer)
    assert handle.finish() == 5 * CHUNK
    assert handle.result.stored_tokens == 5 * CHUNK
    assert whole.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots)).stored_tokens == 5 * CHUNK

    dst_layerwise = make_paged_kv(g, BLOCKS, seed=9, fill=False)
    dst_whole = make_paged_kv(g, BLOCKS, seed=9, fill=False)
    retrieve = layerwise.retrieve_layerwise(KVTransfer(tokens=tokens, kv_caches=dst_layerwise, slot_mapping=slots))
    for layer in range(g.num_layers):
        retrieve.wait(layer)
    mask_layerwise = retrieve.finish()
    assert retrieve.found_to == retrieve.result.loaded_to == 5 * CHUNK
    assert torch.equal(retrieve.result.ret_mask, mask_layerwise)
    mask_whole = whole.retrieve(KVTransfer(tokens=tokens, kv_caches=dst_whole, slot_mapping=slots)).ret_mask

    assert torch.equal(mask_layerwise, mask_whole)
    assert int(mask_layerwise.sum()) == 5 * CHUNK
    hit = slots[: 5 * CHUNK]
    assert torch.equal(read_back(dst_layerwise, g, hit), read_back(src, g, hit))
    # Both paths wrote exactly the same bytes everywhere, the untouched slots included.
    for a, b in zip(dst_layerwise, dst_whole):
        assert torch.equal(a, b)


class LayerPacer:
    """A deliberately slow per-layer transfer, paced by the test instead of by a clock.

    The ``held-layer`` stage (below, before ``scatter``) records when each
    layer's transfer starts, then holds it until the test opens that layer,
    and records when the layer's scatter is done. The test records its own
    "compute" of each layer in the same log: one lock, so the log is a total
    order of what happened, and overlap is read from that order alone.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.log: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self.started = [threading.Event() for _ in range(num_layers)]
        self.opened = [threading.Event() for _ in range(num_layers)]

    def record(self, what: str, layer: int) -> None:
        with self._lock:
            self.log.append((what, layer))

    def position(self, what: str, layer: int) -> int:
        return self.log.index((what, layer))

    def done(self, layer: int) -> bool:
        with self._lock:
            return ("transfer-end", layer) in self.log


PACER: LayerPacer | None = None
READY_S = 60.0  # how long a held transfer waits to be opened: readiness, never reached when the test is right


@flowkv.stage("held-layer", kinds=("retrieve",), needs={"kv"}, gives={"kv"}, per_layer=True)
def held_layer(chunks: Iterator[Chunk], *, ctx: RunContext):
    """Start layer ``ctx.layer``'s transfer, then hold it until the test's pacer opens that layer."""
    pacer = PACER
    if pacer is None:
        yield from chunks
        return
    layer = ctx.layer
    pacer.record("transfer-start", layer)
    pacer.started[layer].set()
    if not pacer.opened[layer].wait(READY_S):
        raise RuntimeError(f"layer {layer} was never opened")
    try:
        yield from chunks  # scatter writes each chunk's layer as it pulls it
    finally:
        pacer.record("transfer-end", layer)


@pytest.fixture
def paced(tmp_path):
    """A layerwise engine whose retrieve runs ``held-layer`` before ``scatter``, and its pacer."""
    global PACER
    g = geometry()
    pipeline = tmp_path / "paced.toml"
    body = open(load_pipeline("local-cpu").source).read().replace(
        '[[retrieve.stages]]\nuse = "scatter"',
        f'[[retrieve.stages]]\nuse = "{__name__}:held_layer"\n\n[[retrieve.stages]]\nuse = "scatter"',
    )
    pipeline.write_text(body)
    engine = make_engine(g, str(pipeline))
    PACER = LayerPacer(g.num_layers)
    try:
        yield engine, PACER
    finally:
        for event in PACER.opened:  # let a held transfer go, however the test ended
            event.set()
        engine.close()
        PACER = None


def test_each_layer_lands_by_its_wait_while_later_layers_are_still_pending(paced) -> None:
    engine, pacer = paced
    g = engine.geometry
    src, dst, tokens, slots = paged_request(g, seed=3)
    engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    hit = slots[: 5 * CHUNK]
    want = read_back(src, g, hit)
    pacer.opened[0].set()
    retrieve = engine.retrieve_layerwise(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots))
    for layer in range(g.num_layers):
        retrieve.wait(layer)
        got = read_back(dst, g, hit)
        assert torch.equal(got[layer], want[layer]), f"layer {layer} not in place after wait({layer})"
        for later in range(layer + 1, g.num_layers):
            # Held until the model "computes" this layer: queued, not yet moved.
            assert not pacer.done(later), f"layer {later} landed before layer {layer} was computed"
            assert not got[later].view(torch.int16).any(), f"layer {later} written before its turn"
        if layer + 1 < g.num_layers:
            pacer.opened[layer + 1].set()
    assert int(retrieve.finish().sum()) == 5 * CHUNK


def compute_while_loading(engine: CacheEngine, pacer: LayerPacer, tokens, dst, slots, *, overlap_wait_s: float):
    """Drive a layerwise retrieve as a model does: wait(i), compute layer i, then i+1.

    Layer 0's transfer may go at once; layer i+1's may finish only once layer
    i's compute began. Layer i's compute runs until layer i+1's transfer has
    started or ``overlap_wait_s`` passed (how long, matters only for the run
    time of the synchronous case, where it never starts meanwhile).
    """
    pacer.opened[0].set()
    retrieve = engine.retrieve_layerwise(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots))
    work = torch.randn(64, 64)
    for layer in range(pacer.num_layers):
        retrieve.wait(layer)
        pacer.record("compute-start", layer)
        if layer + 1 < pacer.num_layers:
            pacer.opened[layer + 1].set()
            pacer.started[layer + 1].wait(overlap_wait_s)
        work = torch.tanh(work @ work)  # the layer's compute
        pacer.record("compute-end", layer)
    return retrieve.finish()


def overlapped_layers(pacer: LayerPacer) -> list[int]:
    """Layers i whose compute ran while layer i+1's transfer ran: read from the order of the log."""
    return [
        layer for layer in range(pacer.num_layers - 1)
        if pacer.position("transfer-start", layer + 1) < pacer.position("compute-end", layer)
        and pacer.position("compute-start", layer) < pacer.position("transfer-end", layer + 1)
    ]


def test_layer_i_plus_1_moves_while_layer_i_computes(paced) -> None:
    engine, pacer = paced
    src, dst, tokens, slots = paged_request(engine.geometry, seed=4)
    engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    mask = compute_while_loading(engine, pacer, tokens, dst, slots, overlap_wait_s=READY_S)
    assert int(mask.sum()) == 5 * CHUNK
    assert overlapped_layers(pacer) == list(range(engine.geometry.num_layers - 1)), pacer.log


class LoadWhenAsked:
    """A synchronous loader's layer future: the layer moves on the caller's thread when waited for."""

    def __init__(self, fn, args) -> None:
        self.fn, self.args, self.ran, self.error = fn, args, False, None

    def result(self, timeout=None):
        if not self.ran:
            self.ran = True
            try:
                self.fn(*self.args)
            except Exception as exc:  # noqa: BLE001 - kept for every later waiter, like a Future
                self.error = exc
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.ran


def test_a_synchronous_loader_shows_no_overlap(paced, monkeypatch) -> None:
    """The check above is not vacuous: the same run with each layer moved only when waited for
    (what a loader without a transfer worker does) loads the same bytes and overlaps nothing."""
    engine, pacer = paced
    src, dst, tokens, slots = paged_request(engine.geometry, seed=4)
    engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    monkeypatch.setattr(engine.executor, "submit_layer", lambda fn, *args: LoadWhenAsked(fn, args))
    mask = compute_while_loading(engine, pacer, tokens, dst, slots, overlap_wait_s=0.05)
    assert int(mask.sum()) == 5 * CHUNK
    hit = slots[: 5 * CHUNK]
    assert torch.equal(read_back(dst, engine.geometry, hit), read_back(src, engine.geometry, hit))
    assert overlapped_layers(pacer) == [], pacer.log


# A per-layer stage that loses chunk 2's layer 1, as a failed transfer would.
@flowkv.stage("lose-one-layer", kinds=("retrieve",), needs={"kv"}, per_layer=True)
def lose_one_layer(chunks: Iterator[Chunk], *, ctx: RunContext, chunk: int = 2, layer: int = 1):
    for item in chunks:
        if item.index == chunk and ctx.layer == layer:
            continue
        yield item


def test_missing_layer_of_one_chunk_shrinks_the_mask_there(tmp_path) -> None:
    pipeline = tmp_path / "lossy-layer.toml"
    text = load_pipeline("local-cpu").source
    body = open(text).read().replace(
        '[[retrieve.stages]]\nuse = "scatter"',
        f'[[retrieve.stages]]\nuse = "{__name__}:lose_one_layer"\n\n[[retrieve.stages]]\nuse = "scatter"',
    )
    pipeline.write_text(body)
    g = geometry()
    src, dst, tokens, slots = paged_request(g, seed=6)
    engine = make_engine(g, str(pipeline))
    engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    assert engine.lookup(tokens) == 5 * CHUNK

    result = engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots))
    mask = result.ret_mask

    assert int(mask.sum()) == 2 * CHUNK  # chunks 0 and 1; chunk 2 lacks a layer, so it and all after are out
    assert bool(mask[: 2 * CHUNK].all())
    assert result.failed_range == (2 * CHUNK, 5 * CHUNK)
    assert result.loaded_to == 2 * CHUNK


def test_layerwise_store_keeps_only_chunks_with_every_layer() -> None:
    g = geometry()
    src, _, tokens, slots = paged_request(g, seed=10)
    engine = make_engine(g)
    handle = engine.store_layerwise(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    for layer in range(g.num_layers - 1):  # the last layer never arrives
        handle.layer_ready(layer)
    assert handle.finish() == 0
    assert engine.lookup(tokens) == 0
    assert engine.stats()["tiers"]["memory"]["entries"] == 0


def test_aborted_layerwise_store_frees_its_slabs() -> None:
    g = geometry()
    src, _, tokens, slots = paged_request(g, seed=12)
    engine = make_engine(g)
    free_before = engine.memory.arena.free_slabs
    handle = engine.store_layerwise(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    handle.layer_ready(0)
    handle.abort()
    assert engine.memory.arena.free_slabs == free_before


def test_layerwise_needs_a_per_layer_stage(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(textwrap.dedent("""\
        [tiers.memory]
        kind = "memory"

        [[store.stages]]
        use = "tokenize"

        [[retrieve.stages]]
        use = "tokenize"

        [layerwise]
        enabled = true
    """))
    with pytest.raises(PipelineError) as caught:
        load_pipeline(bad)
    messages = [str(d) for d in caught.value.diagnostics]
    assert any(":11:1: layerwise is on but [[store.stages]] has no per-layer stage" in m for m in messages), messages


def test_layerwise_spans_carry_the_layer_and_waits(tmp_path) -> None:
    folder = tmp_path / "traces"
    g = geometry()
    src, dst, tokens, slots = paged_request(g, seed=14)
    engine = make_engine(g, **{"telemetry.exporter": "file", "telemetry.folder": str(folder)})
    engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots, request_id="req-1"))
    engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots, request_id="req-2"))
    telemetry.flush()
    [trace_file] = folder.glob("flowkv-*.json")
    spans = load_spans(trace_file)
    scatters = [s for s in spans if s.name == "scatter"]
    gathers = [s for s in spans if s.name == "gather"]
    assert sorted(s.attributes["flowkv.layer"] for s in scatters) == list(range(g.num_layers))
    assert sorted(s.attributes["flowkv.layer"] for s in gathers) == list(range(g.num_layers))
    waits = [s for s in spans if s.name == "flowkv.wait"]
    assert sorted(s.attributes["flowkv.layer"] for s in waits) == list(range(g.num_layers))
    by_id = {s.span_id: s for s in spans}
    request_spans = {s.span_id for s in spans if s.name == "flowkv.retrieve.layerwise"}
    for span in scatters:
        root = by_id[span.parent_span_id]
        assert root.name == "flowkv.retrieve" and root.parent_span_id in request_spans
        assert span.attributes["flowkv.request_id"] == "req-2"


def test_layerwise_latencies_cover_only_their_own_call() -> None:
    g = geometry()
    src, dst, tokens, slots = paged_request(g, seed=17)
    engine = make_engine(g)
    before = time.perf_counter()
    engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots))
    engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots))
    elapsed_ms = (time.perf_counter() - before) * 1e3
    latencies = engine.drain_latencies()
    # Each observation is the call's own span, so it is no longer than both calls together.
    for kind in ("store", "retrieve"):
        [ms] = latencies[kind]
        assert 0 < ms <= elapsed_ms, (kind, ms, elapsed_ms)


def test_nothing_to_move_runs_no_layer_blocks(tmp_path) -> None:
    folder = tmp_path / "traces"
    g = geometry()
    src, dst, tokens, slots = paged_request(g, seed=20)
    engine = make_engine(g, **{"telemetry.exporter": "file", "telemetry.folder": str(folder)})
    store = KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots)
    assert engine.store(store).stored_tokens == 5 * CHUNK
    assert engine.store(store).stored_tokens == 0  # every chunk already held
    unknown = tokens + 1000
    assert not engine.retrieve(KVTransfer(tokens=unknown, kv_caches=dst, slot_mapping=slots)).ret_mask.any()
    telemetry.flush()
    [trace_file] = folder.glob("flowkv-*.json")
    names = [s.name for s in load_spans(trace_file)]
    # Only the first store moved data: one gather per layer, and no scatter or wait at all.
    assert names.count("gather") == g.num_layers
    assert names.count("scatter") == 0 and names.count("flowkv.wait") == 0
    assert names.count("flowkv.store.layerwise") == 2 and names.count("flowkv.retrieve.layerwise") == 1
