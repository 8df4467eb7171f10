"""What a stage is (its role, whether hashes may stand for its tokens, whether it is lossy) is declared
where it is registered, and the parts of flowkv that must know read that, never the stage's name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import flowkv
from flowkv.items import Chunk, RunContext
from flowkv.pipeline import PipelineError, dumps_pipeline, load_pipeline
from flowkv.registry import BUILTIN_STAGES, Facet, RegistryError, Role, resolve_stage
from flowkv.stages.chunking import chunk_hash
from flowkv.stages.codec import CompressConfig, compress


@flowkv.stage("halve-precision", kinds=("store",), needs={"kv"}, gives={"payload"}, role=Role.CODEC, lossy=True)
def halve_precision(chunks: Iterator[Chunk], *, ctx: RunContext, bits: int = 4) -> Iterator[Chunk]:
    """A third-party lossy codec: it encodes as `compress` with int4 would (what it writes is not the point)."""
    yield from compress(chunks, ctx=ctx, config=CompressConfig(codec="int4"))


@flowkv.stage("smooth-kv", kinds=("store",), needs={"kv"}, gives={"kv"}, lossy=True)
def smooth_kv(chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """A lossy stage of no declared role (it would change KV values)."""
    yield from chunks


def pipeline_text(*store_middle: object, quality: dict | None = None) -> str:
    return dumps_pipeline(
        pipeline={"name": "third-party"},
        tiers={"memory": {"kind": "memory", "capacity": "64MiB"}},
        store=["tokenize", "chunk-hash", "allocate", "gather", *store_middle, "put"],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"],
        sections={"quality": quality} if quality is not None else None,
    )


def quality_record(codec: str, params: dict, agreement: float) -> dict:
    return {"format": 1, "model": "tiny", "agreement": agreement,
            "codecs": [{"codec": codec, "params": params, "lossless": False, "agreement": agreement}]}


EXPECTED_ROLES = {
    "tokenize": Role.CHUNKER, "chunk-hash": Role.KEYER, "allocate": Role.ALLOCATOR, "gather": Role.TRANSFER,
    "compress": Role.CODEC, "put": Role.TIER_IO, "segment": Role.SEGMENTER, "lookup": Role.LOOKUP,
    "get": Role.TIER_IO, "decompress": Role.CODEC, "scatter": Role.TRANSFER, "pass-through": Role.FLOW, "take": Role.FLOW,
}


def test_every_built_in_stage_declares_its_role():
    assert {name: resolve_stage(name).role for name in BUILTIN_STAGES} == EXPECTED_ROLES
    hashes = {name for name in BUILTIN_STAGES if resolve_stage(name).accepts_hashes}
    assert hashes == {"tokenize", "chunk-hash", "pass-through", "take"}


def test_compress_is_lossy_by_its_codec():
    info = resolve_stage("compress")
    assert info.is_lossy(info.make_config(codec="int8"))
    assert not info.is_lossy(info.make_config(codec="zstd", level=1))
    assert not resolve_stage("decompress").is_lossy(resolve_stage("decompress").make_config())


def test_a_third_party_lossy_codec_under_another_name_is_held_to_the_quality_gate(tmp_path):
    path = tmp_path / "third-party.toml"
    path.write_text(pipeline_text((f"{__name__}:halve_precision", {"bits": 3}),
                                  quality={"min_agreement": 0.9, "record": "quality.json"}))
    with pytest.raises(PipelineError) as caught:
        load_pipeline(path)
    [diagnostic] = caught.value.diagnostics
    assert diagnostic.kind == "quality"
    assert 'halve-precision {"bits": 3}' in diagnostic.message and "needs a measurement" not in diagnostic.message

    # A record that measured it, by its name and settings, lets it load; one below the minimum does not.
    (tmp_path / "quality.json").write_text(json.dumps(quality_record("halve-precision", {"bits": 3}, 0.95)))
    assert load_pipeline(path).store[4].info.role is Role.CODEC
    (tmp_path / "quality.json").write_text(json.dumps(quality_record("halve-precision", {"bits": 3}, 0.5)))
    with pytest.raises(PipelineError, match="halve-precision .* below min_agreement 90.0%"):
        load_pipeline(path)


def test_a_lossy_stage_of_any_role_is_gated_and_a_lossless_pipeline_is_not(tmp_path):
    path = tmp_path / "smooth.toml"
    path.write_text(pipeline_text(f"{__name__}:smooth_kv", quality={"min_agreement": 0.9, "record": "q.json"}))
    with pytest.raises(PipelineError, match=r"no quality record at .*q\.json for lossy setting\(s\) smooth-kv"):
        load_pipeline(path)
    path.write_text(pipeline_text(f"{__name__}:halve_precision", "pass-through",
                                  quality={"min_agreement": 0.9, "record": "q.json"}).replace(
        f'use = "{__name__}:halve_precision"', 'use = "compress"\ncodec = "lz4"'))
    assert load_pipeline(path).store_codec() == ("lz4", {})


def test_a_role_and_facets_outside_the_enums_are_refused_where_the_stage_is_declared():
    with pytest.raises(RegistryError, match=r"unknown role 'keyr'; did you mean 'keyer'\?") as caught:
        flowkv.stage("bad-role", role="keyr")(_generator)
    assert caught.value.kind == "misuse"
    with pytest.raises(RegistryError, match=r"unknown facet 'payloads'; did you mean 'payload'\?"):
        flowkv.stage("bad-facet", gives={"payloads"})(_generator)
    # Plain strings name the facets; the info holds the enum's members.
    info = resolve_stage("get")
    assert info.gives == {"kv", "payload"} and all(isinstance(f, Facet) for f in info.gives)
    assert Facet.STORED in resolve_stage("put").gives


def _generator(items):
    yield from items


# -- the scheduler's hash reuse --------------------------------------------------------------------


@flowkv.stage("house-keys", kinds=("store", "retrieve", "lookup"), needs={"span"}, gives={"key"},
              role=Role.KEYER, accepts_hashes=True)
def house_keys(chunks: Iterator[Chunk], *, ctx: RunContext) -> Iterator[Chunk]:
    """A third-party keyer keying through ``ctx.services.chunk_keys`` (so precomputed hashes may stand in)."""
    yield from chunk_hash(chunks, ctx=ctx)


@flowkv.stage("content-keys", kinds=("store", "retrieve", "lookup"), needs={"span"}, gives={"key"},
              role=Role.KEYER)
def content_keys(chunks: Iterator[Chunk], *, ctx: RunContext) -> Iterator[Chunk]:
    """A keyer that does not say hashes may stand for its tokens."""
    yield from chunk_hash(chunks, ctx=ctx)


def keyed_with(keyer: str) -> str:
    local_cpu = (Path(__file__).resolve().parent.parent / "pipelines" / "local-cpu.toml").read_text()
    assert local_cpu.count('use = "chunk-hash"') >= 2
    return local_cpu.replace('use = "chunk-hash"', f'use = "{__name__}:{keyer}"')


def test_hash_reuse_follows_what_the_keyer_declares_not_its_name(monkeypatch):
    from flowkv.integration.vllm.chunk_hashes import keyed_pipeline
    from flowkv.pipeline import loads_pipeline

    assert keyed_pipeline(load_pipeline("local-cpu"))
    assert keyed_pipeline(loads_pipeline(keyed_with("house_keys")))
    assert not keyed_pipeline(loads_pipeline(keyed_with("content_keys")))
    # The built-in segmenter keys chunks by their content: a caller's chained hashes cannot stand in.
    assert not keyed_pipeline(load_pipeline("blend", overrides={"blend.separator": [271, 198]}))


# -- the trace summary ---------------------------------------------------------------------------


def test_the_trace_summary_knows_a_codec_by_the_role_its_spans_record(tmp_path):
    """A third-party codec stage, run by the real runner into a trace file: its spans carry its role,
    and the summary's codec advice names it though its name says nothing of codecs."""
    import time

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from flowkv.otlp_json import OTLPJsonFileExporter, load_spans
    from flowkv.runner import BoundStage, Runner
    from flowkv.tracetools import summarize

    def squeeze(items):
        for item in items:
            time.sleep(0.001)  # the codec's work: what makes it dominate its run's own time
            yield item

    exporter = OTLPJsonFileExporter(tmp_path)
    provider = TracerProvider(resource=Resource.create({"service.name": "flowkv"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    runner = Runner([BoundStage("pass-through", _generator, {}, False, "p.toml:3", 0, role=str(Role.FLOW)),
                     BoundStage("squeeze", squeeze, {}, False, "p.toml:6", 1, role=str(Role.CODEC))],
                    kind="store", pipeline="p", tracer=provider.get_tracer("flowkv"))
    for _ in range(3):
        runner.run([b"x"] * 4, RunContext(kind="store"))
    provider.shutdown()

    summary = summarize(load_spans(exporter.path))
    roles = {s.stage: s.role for s in summary.stages}
    assert roles == {"pass-through": "flow", "squeeze": "codec"}
    assert any(advice.startswith("Codec stage store/squeeze takes") for advice in summary.suggestions)


# -- the node server's list ----------------------------------------------------------------------


def test_a_node_server_runs_its_pipelines_server_list_or_an_engine_files_store_tail_by_role(tmp_path, caplog):
    """``node-server-disk`` declares its [server] list; a server file written as an engine's runs its store
    list after the transfer stage (found by role, wherever the codec sits), leaving out what cannot run there."""
    from flowkv.server.writer import server_stages

    def shown(pipeline):
        return [(spec.name, spec.settings()) for spec in server_stages(pipeline)]

    assert shown(load_pipeline("node-server-disk")) == [("compress", {**NO_CODEC, "codec": "none"}),
                                                        ("put", {"tiers": None})]
    assert shown(load_pipeline("local-cpu-lz4")) == [("compress", {**NO_CODEC, "codec": "lz4-shuffle"}),
                                                     ("put", {"tiers": None})]
    # put (memory) comes first there: the server skips the arena its chunks are in, then encodes for the disk.
    assert shown(load_pipeline("cpu-disk-zstd")) == [("put", {"tiers": ["memory"]}),
                                                     ("compress", {**NO_CODEC, "codec": "zstd-shuffle", "level": 1}),
                                                     ("put", {"tiers": ["disk"]})]
    # A third-party codec that declares no server kind cannot run there: its lower tiers get raw chunks, and
    # it says so.
    path = tmp_path / "server.toml"
    path.write_text(pipeline_text((f"{__name__}:halve_precision", {"bits": 3})))
    pipeline = load_pipeline(path)
    assert pipeline.store_codec() == ("halve-precision", {"bits": 3})
    with caplog.at_level("WARNING", logger="flowkv.server"):
        assert shown(pipeline) == [("put", {"tiers": None})]
    assert "stage 'halve-precision'" in caplog.text and "declare a [server] list" in caplog.text
    # A file of tiers alone (no list at all): its chunks still reach the lower tiers, raw, through put.
    path.write_text('[pipeline]\nname = "tiers-only"\n\n[tiers.memory]\nkind = "memory"\n\n'
                    '[tiers.disk]\nkind = "disk"\npath = "/tmp/flowkv-unused"\ncapacity = "1GiB"\n')
    [bare] = server_stages(load_pipeline(path))
    assert (bare.name, bare.role, bare.settings) == ("put", "tier-io", {"tiers": None})


NO_CODEC = {name: None for name in ("level", "acceleration", "group_size", "key_group_size", "scale_dtype", "scaling",
                                    "window")}
