"""Choosing a pipeline for vLLM: errors at start-up, and a disk tier across restarts.

Each test starts its own vLLM engines (in this process, ~2 s each; see vllm_helpers.make_llm).
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import (  # noqa: E402
    generate,
    make_llm,
    random_tokens,
    request,
    shutdown_llm,
    stats,
)

pytestmark = pytest.mark.vllm


def test_bad_pipeline_stops_vllm_at_start_with_every_error(tmp_path, capfd):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        "[pipeline]\n"
        'name = "bad"\n'
        "chunk_sise = 256\n"
        "[tiers.memory]\n"
        'kind = "memory"\n'
        'capacity = "64MiB"\n'
        "[[store.stages]]\n"
        'use = "tokenize"\n'
        "[[store.stages]]\n"
        'use = "gathr"\n',
        encoding="utf-8",
    )
    # vLLM's own process layout: the engine core's failure reaches the user as a RuntimeError, the
    # reasons in the log
    with pytest.raises(RuntimeError):
        make_llm({"pipeline": str(bad)}, separate_processes=True)
    logs = capfd.readouterr().err
    assert f"{bad}:3:1: [pipeline]: unknown key 'chunk_sise'; did you mean 'chunk_size'?" in logs
    assert f"{bad}:10:1: unknown stage 'gathr'; did you mean 'gather'?" in logs


def test_disk_tier_serves_a_restarted_vllm_and_keys_carry_the_model_name(tmp_path):
    settings = {
        "pipeline": "cpu-disk",
        "tiers.disk.path": str(tmp_path / "disk"),
        "tiers.disk.capacity": "256MiB",
        "tiers.memory.capacity": "64MiB",
    }
    prompt = random_tokens(500, 1800)

    first = make_llm(settings)
    try:
        [(cold, cold_cached)] = generate(first, [request(prompt)])
    finally:
        shutdown_llm(first)
    assert cold_cached == 0
    # Closing the worker's engine drains the disk tier's write-behind queue.
    assert len(list((tmp_path / "disk").rglob("*.kv"))) == 7

    restarted = make_llm(settings)
    try:
        memory_entries_at_start = stats(restarted)["tiers"]["memory"]["entries"]
        [(warm, warm_cached)] = generate(restarted, [request(prompt)])
    finally:
        shutdown_llm(restarted)
    # A new process starts with an empty memory tier: the hit came from disk.
    assert memory_entries_at_start == 0
    assert warm_cached == 1792
    assert warm == cold

    other_model = make_llm({**settings, "model_name": "some-other-model"})
    try:
        [(_, other_cached)] = generate(other_model, [request(prompt)])
    finally:
        shutdown_llm(other_model)
    assert other_cached == 0


def test_save_decode_lets_the_next_turn_reuse_generated_tokens():
    llm = make_llm({"pipeline": "local-cpu", "save_decode": True, "tiers.memory.capacity": "64MiB"})
    try:
        first_turn = random_tokens(600, 600)
        [(answer, _)] = generate(llm, [request(first_turn, max_tokens=300)])
        # The next turn sends the conversation so far plus a new question.
        next_turn = first_turn + answer + random_tokens(601, 50)
        [(reply, cached)] = generate(llm, [request(next_turn)])
        # The same turn computed from scratch (a cache salt of its own: no hit) answers the same.
        [(cold_reply, cold_cached)] = generate(llm, [request(next_turn, cache_salt="cold")])
    finally:
        shutdown_llm(llm)
    # 899 tokens have KV after the first turn (the last sampled token has
    # none yet): 3 whole chunks, one more than the prompt alone fills.
    assert cached == 768
    assert cold_cached == 0 and reply == cold_reply


def test_with_vllm_prefix_caching_flowkv_serves_what_vllm_evicted():
    # vLLM's own prefix cache on (its default) in a pool of 40 blocks.
    llm = make_llm({"pipeline": "local-cpu", "tiers.memory.capacity": "64MiB"},
                   kv_cache_blocks=40, enable_prefix_caching=True)
    try:
        prefix = random_tokens(700, 2000)
        generate(llm, [request(prefix + random_tokens(701, 30))])
        [(_, local_hit)] = generate(llm, [request(prefix + random_tokens(702, 30))])
        # Two other prompts take the pool: vLLM evicts the prefix's blocks.
        generate(llm, [request(random_tokens(703, 2000))])
        generate(llm, [request(random_tokens(704, 2000))])

        prompt = prefix + random_tokens(705, 30)
        # A new cache salt misses in vLLM's cache and in flowkv alike.
        [(cold, cold_cached)] = generate(llm, [request(prompt, cache_salt="fresh")])
        before = stats(llm).get("retrieved_tokens", 0)
        [(warm, warm_cached)] = generate(llm, [request(prompt)])
        retrieved = stats(llm).get("retrieved_tokens", 0) - before
    finally:
        shutdown_llm(llm)
    assert local_hit == 1920  # vLLM's own hit: 15 whole blocks of the prefix
    assert cold_cached == 0
    assert warm_cached >= 1792
    assert retrieved > 0
    assert warm == cold


def test_quality_record_of_another_model_stops_vllm_at_start(tmp_path):
    """The shipped int8 pipeline, gated by a record whose model is not the one vLLM serves."""
    from flowkv.pipeline import resolve_source

    shipped = resolve_source("cpu-disk-int8").read_text(encoding="utf-8")
    gated = tmp_path / "gated.toml"
    quality = '[quality]\nmin_agreement = 0.95\nrecord = "quality.json"\n'
    gated.write_text(shipped.split("\n[quality]\n")[0] + "\n" + quality, encoding="utf-8")
    (tmp_path / "quality.json").write_text(json.dumps({
        "format": 1, "model": "/models/another", "model_config_sha256": "0" * 64,
        "codecs": [{"codec": "int8", "params": {"group_size": 0, "key_group_size": 0, "scale_dtype": "fp16"},
                    "agreement": 0.99}],
    }), encoding="utf-8")
    with pytest.raises(ValueError) as refused:  # an engine in this process: the error itself
        make_llm({"pipeline": str(gated), "tiers.disk.path": str(tmp_path / "disk")})
    logs = str(refused.value)
    assert f"[quality] record {tmp_path / 'quality.json'} measured model /models/another, but vLLM serves" in logs

    # As shipped, its record measured flowkv's trained reference model: the tiny model needs its own.
    with pytest.raises(ValueError) as refused:
        make_llm({"pipeline": "cpu-disk-int8", "tiers.disk.path": str(tmp_path / "disk")})
    logs = str(refused.value)
    assert "quality/cpu-disk-int8.json measured model " in logs and "trained-llama-" in logs
    assert "but vLLM serves" in logs and "config.json differs" in logs


def test_int8_on_vllms_cpu_cache_quantizes_the_tokens_true_key_channels(tmp_path):
    """vLLM's CPU blocks are packed (a block row is not a token): the worker draws the packing from
    vLLM's cache-write op at start, and the int8 payloads it writes to disk hold the tokens' true keys
    and values, quantized per key channel: each within int8's bound of the raw copy of the same
    chunk, unpacked with a table this test draws itself."""
    from flowkv import payload
    from flowkv.codecs import get_codec
    from flowkv.integration.vllm.cpu_packing import packed_layout

    pipeline = tmp_path / "int8-beside-raw.toml"
    pipeline.write_text(f"""extends = "cpu-disk-int8"
[pipeline]
name = "int8-beside-raw"
[tiers.disk]
path = "{tmp_path / 'int8'}"
timeout_s = 10.0
[tiers.raw]
kind = "disk"
path = "{tmp_path / 'raw'}"
capacity = "256MiB"
timeout_s = 10.0
[store]
replace = ["put", "compress", "put"]  # the raw copy beside the memory one, then int8 as shipped
[[store.stages]]
use = "put"
tiers = ["memory", "raw"]
[[store.stages]]
use = "compress"
codec = "int8"
scale_dtype = "fp16"
[[store.stages]]
use = "put"
tiers = ["disk"]
[quality]
mode = "warn"
""", encoding="utf-8")
    llm = make_llm({"pipeline": str(pipeline)})
    try:
        generate(llm, [request(random_tokens(501, 1100))])
    finally:
        shutdown_llm(llm)  # drains the disk tiers' write-behind
    raw_files = sorted((tmp_path / "raw").rglob("*.kv"))
    assert len(raw_files) == 4  # 1,024 of 1,100 tokens in chunks of 256
    layout = packed_layout(torch.float32, block_size=128, head_size=64)  # the tiny model's, as the worker drew it
    codec = get_codec("int8")
    params = codec.resolve_params(scale_dtype="fp16")
    for raw_file in raw_files:
        raw = payload.decode(raw_file.read_bytes())
        blob = (tmp_path / "int8" / raw_file.relative_to(tmp_path / "raw")).read_bytes()
        assert payload.read_header(blob).unpacked
        true = layout.unpack_chunk(raw)
        loaded = layout.unpack_chunk(payload.decode(blob, packing=layout))
        assert not torch.equal(loaded, true)
        assert bool(((loaded.double() - true.double()).abs() <= codec.max_error(true, params)).all())


def test_an_engine_in_this_process_frees_vllms_connector_slot_at_shutdown():
    """vLLM's facts the in-process engines of the tests (and of flowkv's CLI) rely on: an engine's
    worker connector sits in vLLM's process-wide slot, so two engines of one process cannot both have
    one (the matrix runs its unconnected baselines before, not beside, a connected engine); the
    engine core's shutdown empties the slot, so engines can follow one another."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    llm = make_llm({"pipeline": "local-cpu", "tiers.memory.capacity": "64MiB"})
    try:
        assert has_kv_transfer_group()
        connector = weakref.ref(get_kv_transfer_group())
        assert type(connector()).__name__ == "FlowKVConnector"
    finally:
        shutdown_llm(llm)
    assert not has_kv_transfer_group()
    # harness.shutdown collected the stopped engine (its connector is gone) and froze what is left, so
    # the next engine's start does not scan this process's heap again (vLLM collects it while it starts).
    assert connector() is None
    assert gc.get_freeze_count() > 0
