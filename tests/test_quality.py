"""The quality gate: a pipeline with lossy codecs loads only with a record that shows enough
agreement; ``flowkv quality`` measures that agreement with the real vLLM; ``flowkv bench
codecs`` measures codecs on KV a real model computed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from codec_reference import check_against_reference, reference_int

from flowkv.pipeline import PipelineError, dumps_pipeline, load_pipeline


def pipeline_text(codec: str = "int8", *, quality: dict | None = None, level: int | None = None,
                  second_codec: str | None = None) -> str:
    """A memory + disk pipeline with one compress stage (optionally a second, for the disk)."""
    compress = {"codec": codec, **({"level": level} if level is not None else {})}
    store = ["tokenize", "chunk-hash", "allocate", "gather", ("compress", compress), ("put", {"tiers": ["memory"]})]
    if second_codec:
        store += [("compress", {"codec": second_codec}), ("put", {"tiers": ["disk"]})]
    return dumps_pipeline(
        pipeline={"name": "gated"},
        tiers={"memory": {"kind": "memory", "capacity": "64MiB"},
               "disk": {"kind": "disk", "path": "disk", "capacity": "64MiB"}},
        store=store,
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"],
        sections={"quality": quality} if quality is not None else None,
    )


def record(entries: list[tuple[str, dict, float]], model: str = "tiny") -> dict:
    """A quality record as ``flowkv quality`` writes it (only the fields the gate reads are real)."""
    return {
        "format": 1,
        "model": model,
        "codecs": [{"codec": c, "params": p, "lossless": False, "agreement": a, "max_logprob_diff": 0.1}
                   for c, p, a in entries],
        "agreement": min(a for _, _, a in entries),
    }


INT8_PARAMS = {"group_size": 0, "key_group_size": 0}
# What the shipped cpu-disk-int8 pipeline sets: int8 with fp16 scales and zero points.
SHIPPED_INT8_PARAMS = {"group_size": 0, "key_group_size": 0, "scale_dtype": "fp16"}


def write(folder: Path, text: str, rec: dict | None = None) -> Path:
    path = folder / "gated.toml"
    path.write_text(text, encoding="utf-8")
    if rec is not None:
        (folder / "quality.json").write_text(json.dumps(rec), encoding="utf-8")
    return path


def gate_error(path: Path) -> str:
    """The single gate diagnostic of a refused pipeline, checked to point at min_agreement."""
    with pytest.raises(PipelineError) as caught:
        load_pipeline(path)
    [diag] = caught.value.diagnostics
    line = path.read_text().splitlines()[diag.line - 1]
    assert diag.kind == "quality" and line.startswith("min_agreement"), (diag, line)
    assert str(diag).startswith(f"{path}:{diag.line}:{diag.col}: [quality]")
    return diag.message


GATE = {"min_agreement": 0.9, "record": "quality.json"}


def test_gate_passes_with_a_record_at_or_above_the_minimum(tmp_path):
    path = write(tmp_path, pipeline_text(quality=GATE), record([("int8", INT8_PARAMS, 0.9)]))
    pipeline = load_pipeline(path)
    assert pipeline.quality.min_agreement == 0.9 and pipeline.quality.record == "quality.json"


def test_gate_refuses_a_record_below_the_minimum(tmp_path):
    path = write(tmp_path, pipeline_text(quality=GATE), record([("int8", INT8_PARAMS, 0.875)], model="m1"))
    message = gate_error(path)
    assert "87.5%" in message and "below min_agreement 90.0%" in message and "model m1" in message


def test_gate_refuses_a_missing_record(tmp_path):
    message = gate_error(write(tmp_path, pipeline_text(quality=GATE)))
    assert f"no quality record at {tmp_path / 'quality.json'}" in message and "flowkv quality" in message


def test_gate_refuses_min_agreement_without_a_record_path(tmp_path):
    message = gate_error(write(tmp_path, pipeline_text(quality={"min_agreement": 0.9})))
    assert "set record" in message and "int8" in message


def test_gate_refuses_a_record_of_another_codec_or_other_params(tmp_path):
    path = write(tmp_path, pipeline_text(quality=GATE), record([("int4", INT8_PARAMS, 1.0)]))
    message = gate_error(path)
    assert 'no measurement of int8 {"group_size": 0, "key_group_size": 0}' in message and "measured: int4" in message
    write(tmp_path, pipeline_text(quality=GATE), record([("int8", {"group_size": 32, "key_group_size": 0}, 1.0)]))
    assert "no measurement of int8" in gate_error(path)


def test_gate_checks_every_lossy_codec_of_a_tiered_pipeline(tmp_path):
    # raw in memory, int8 then int4 for the disk: the int4 measurement is what fails
    text = pipeline_text("int8", second_codec="int4", quality=GATE)
    path = write(tmp_path, text, record([("int8", INT8_PARAMS, 0.99), ("int4", INT8_PARAMS, 0.5)]))
    message = gate_error(path)
    assert message.startswith("[quality] int4") and "50.0%" in message


def test_gate_refuses_a_file_that_is_not_a_record(tmp_path):
    path = write(tmp_path, pipeline_text(quality=GATE))
    (tmp_path / "quality.json").write_text('{"agreement": 1.0}')
    assert "is not a flowkv quality record" in gate_error(path)
    (tmp_path / "quality.json").write_text("not json")
    assert "is not JSON" in gate_error(path)


def test_codec_settings_the_codec_does_not_take_are_refused_before_the_gate(tmp_path):
    # The compress stage checks its codec's parameters when the file loads, at the stage's line.
    with pytest.raises(PipelineError) as caught:
        load_pipeline(write(tmp_path, pipeline_text("int8", level=3, quality=GATE)))
    [diagnostic] = caught.value.diagnostics
    assert diagnostic.kind == "invalid-value"
    assert "codec 'int8' has no parameter 'level'" in diagnostic.message


def test_lossless_pipelines_need_no_record(tmp_path):
    pipeline = load_pipeline(write(tmp_path, pipeline_text("zstd-shuffle", level=1, quality=GATE)))
    assert pipeline.quality.min_agreement == 0.9


def test_min_agreement_must_be_a_fraction(tmp_path):
    path = write(tmp_path, pipeline_text(quality={"min_agreement": 95, "record": "q.json"}))
    assert "between 0 and 1" in gate_error(path)
    path.write_text(pipeline_text(quality={"min_agreemnt": 0.9}))
    with pytest.raises(PipelineError, match="did you mean 'min_agreement'"):
        load_pipeline(path)


def test_gate_can_be_skipped_to_write_the_record(tmp_path):
    path = write(tmp_path, pipeline_text(quality=GATE))
    assert load_pipeline(path, check_quality=False).quality.record == "quality.json"


def test_shipped_tiered_pipeline_is_raw_in_memory_and_int8_on_disk():
    from flowkv.quality_gate import codec_settings

    pipeline = load_pipeline("cpu-disk-int8")
    assert codec_settings(pipeline.store) == [("int8", SHIPPED_INT8_PARAMS)]
    puts = [s.settings()["tiers"] for s in pipeline.store if s.name == "put"]
    assert puts == [["memory"], ["disk"]]


def test_shipped_int8_pipeline_is_gated_by_a_record_of_the_trained_reference_model_only(tmp_path):
    """cpu-disk-int8 loads (its gate passes on the shipped record), serving the trained reference
    model is allowed, and serving any other model folder is refused: the random-weight demo model,
    or a copy of the reference model's config with another recipe digest."""
    from flowkv._testing.trained_model import trained_model
    from flowkv.quality import check_served_model, load_record, record_path

    pipeline = load_pipeline("cpu-disk-int8")
    assert pipeline.quality.min_agreement == 0.90
    record = load_record(record_path(pipeline.quality.record, pipeline.source))
    [entry] = [e for e in record["codecs"] if e["codec"] == "int8"]
    assert entry["params"] == SHIPPED_INT8_PARAMS and entry["agreement"] >= pipeline.quality.min_agreement
    assert record["prompts"]["count"] >= 32 and entry["tokens_compared"] == 16 * record["prompts"]["count"]
    # Where int8 changed a greedy token, the reference's top two were a near-tie (within int8's own
    # largest logprob change), not a token the model was sure of.
    assert all(m <= entry["max_logprob_diff"] for m in entry["flip_margins"] if m is not None)
    reference = trained_model(progress=False)
    assert check_served_model(pipeline, str(reference)) is None
    from vllm_helpers import tiny_model_dir

    with pytest.raises(ValueError, match="config.json differs"):
        check_served_model(pipeline, str(tiny_model_dir()))
    lookalike = tmp_path / "lookalike"
    lookalike.mkdir()
    config = json.loads((reference / "config.json").read_text())
    config["flowkv_recipe_sha256"] = "0" * 64
    (lookalike / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    with pytest.raises(ValueError, match="config.json differs"):
        check_served_model(pipeline, str(lookalike))


def test_the_shipped_record_measured_this_code_of_its_codecs():
    """The shipped record vouches for the codec code it measured: a change to how int8 quantizes
    (its class, its bases, the helpers they call) moves the digest and fails here until
    `flowkv quality cpu-disk-int8 --out pipelines/quality/cpu-disk-int8.json` measures it again."""
    from flowkv.quality_gate import codec_code_digest, load_record, record_path

    pipeline = load_pipeline("cpu-disk-int8")
    record = load_record(record_path(pipeline.quality.record, pipeline.source))
    for entry in record["codecs"]:
        assert entry["code_sha256"] == codec_code_digest(entry["codec"]), (
            f"{entry['codec']}'s code changed since the shipped record measured it: re-measure it")


def test_a_record_of_other_codec_code_is_refused_and_one_of_this_code_passes(tmp_path):
    from flowkv.quality_gate import codec_code_digest

    rec = record([("int8", INT8_PARAMS, 0.95)])
    rec["codecs"][0]["code_sha256"] = "0" * 64
    message = gate_error(write(tmp_path, pipeline_text(quality=GATE), rec))
    assert "another version of int8's code" in message and "flowkv quality" in message
    rec["codecs"][0]["code_sha256"] = codec_code_digest("int8")
    write(tmp_path, pipeline_text(quality=GATE), rec)
    assert load_pipeline(tmp_path / "gated.toml").quality.min_agreement == 0.9
    # The digest follows the codec: int4 and int8 differ, the same codec twice is the same.
    assert codec_code_digest("int8") == codec_code_digest("int8") != codec_code_digest("int4")


# -- the real measurements --------------------------------------------------------------


def _quality(argv: list[str]) -> int:
    from flowkv import quality

    parser = argparse.ArgumentParser()
    quality.add_commands(parser.add_subparsers())
    args = parser.parse_args(["quality", *argv])
    return args.func(args)


QUALITY_PROMPTS = 8
INT8_FLOOR = 0.6


@pytest.mark.vllm
def test_quality_run_with_vllm_measures_int4_below_int8_and_the_gate_uses_it(tmp_path, capsys, engines_in_this_process):
    """One vLLM on the tiny test model: int8 stays with the uncompressed model, int4 drifts,
    and the record written by the run lets the pipeline load at one minimum and not another."""
    from vllm_helpers import tiny_model_dir

    path = write(tmp_path, pipeline_text("int8", second_codec="int4",
                                         quality={"min_agreement": 0.5, "record": "quality.json"}))
    status = _quality([str(path), "--model", str(tiny_model_dir()), "--prompts", str(QUALITY_PROMPTS), "--prompt-tokens", "512",
                       "--max-tokens", "16", "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "quality.json").read_text()) == rec  # the pipeline's record path
    rows = {row["codec"]: row for row in rec["codecs"]}
    assert list(rows) == ["none", "int8", "int4"] and rows["int8"]["params"] == INT8_PARAMS
    assert rows["none"]["agreement"] == 1.0  # the control: exact KV loaded changes no greedy token
    assert rec["prompts"]["count"] == QUALITY_PROMPTS and rec["model"] == str(tiny_model_dir())
    for row in rows.values():
        assert row["tokens_compared"] == QUALITY_PROMPTS * 16
        assert row["tokens_loaded"] >= QUALITY_PROMPTS * 512  # every prompt's document came back through the codec
    print(f"int8 agreement {rows['int8']['agreement']:.3f} max dlogprob {rows['int8']['max_logprob_diff']:.4f}; "
          f"int4 agreement {rows['int4']['agreement']:.3f} max dlogprob {rows['int4']['max_logprob_diff']:.4f}")
    assert rows["none"]["max_logprob_diff"] < rows["int8"]["max_logprob_diff"] < rows["int4"]["max_logprob_diff"]
    assert rows["int8"]["agreement"] >= rows["int4"]["agreement"]
    # The random tiny model has near-ties everywhere, and which way int8's rounding tips them depends on
    # the kernels and, while the codecs quantized vLLM's packed block interiors, on the ISA's packing:
    # on these 8 prompts with the eager engine in the test's process int8 measured 0.742 (95 of 128
    # tokens) on an AMX machine and 0.625 on an AVX-512 one without AMX; on true key channels 0.773
    # (99 of 128) on the latter. The floor keeps a margin of 22 tokens below that and stays far above
    # int4's (0.18 there); int8 against int4, above, is the relation that holds on any kernels.
    assert rows["int8"]["agreement"] >= INT8_FLOOR
    worst = min(rows["int8"]["agreement"], rows["int4"]["agreement"])
    assert status == (0 if worst >= 0.5 else 1)
    for row in rows.values():  # a flip margin where, and only where, a prompt's generation differs
        assert [m is None for m in row["flip_margins"]] == [d is None for d in row["first_differences"]]
        assert all(m >= 0 for m in row["flip_margins"] if m is not None)

    # The gate reads what was measured: a minimum above int4's figure refuses the pipeline.
    text = path.read_text()
    assert worst < 1.0  # int4 changes some greedy token of the tiny model, so a stricter gate has a figure to refuse
    strict = min(1.0, worst + 0.01)
    path.write_text(text.replace("min_agreement = 0.5", f"min_agreement = {strict}"))
    assert "below min_agreement" in gate_error(path)
    path.write_text(text.replace("min_agreement = 0.5", f"min_agreement = {worst}"))
    assert load_pipeline(path).quality.min_agreement == worst


def test_compare_counts_equal_tokens_and_the_reference_margin_where_a_generation_first_differs():
    """The figures of one prompt, on generations written by hand: logprobs as vLLM gives them
    (token -> object with .logprob, the top ones and the chosen one)."""
    from types import SimpleNamespace

    from flowkv.quality import _compare

    def output(tokens, logprobs):
        return SimpleNamespace(token_ids=tokens, logprobs=[
            {token: SimpleNamespace(logprob=value) for token, value in position.items()} for position in logprobs])

    reference = output([1, 2, 3, 4], [{1: -0.1, 5: -2.0}, {2: -0.5, 7: -0.75, 8: -3.0}, {3: -0.1, 9: -1.0},
                                      {4: -0.2, 9: -2.0}])
    flipped = output([1, 7, 3, 9], [{1: -0.125, 5: -2.0}, {7: -0.5, 2: -0.625}, {3: -0.1}, {9: -0.2}])
    result = _compare(reference, flipped)
    assert result["equal"] == 2 and result["total"] == 4 and result["first_difference"] == 1
    assert result["flip_margin"] == 0.25  # token 2 led token 7 by 0.25 nats in the reference
    # |dlogprob| of the reference's token, up to and including the first differing position
    assert result["logprob_diffs"] == pytest.approx([0.025, 0.125])
    same = _compare(reference, reference)
    assert same["equal"] == 4 and same["first_difference"] is None and same["flip_margin"] is None
    assert same["logprob_diffs"] == [0.0] * 4


def _demo_model_dir() -> Path:
    import os

    return Path(os.environ.get("FLOWKV_TEST_CACHE", Path.home() / ".cache" / "flowkv" / "test-models")) / "demo-llama"


def test_bench_codecs_measures_the_demo_models_kv(capsys):
    """Default input is KV the demo model computed for real text, cut into chunks; lossless codecs stay bitwise."""
    from flowkv.bench import codecs as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--json", "--repeats", "1", "--documents", "1", "--doc-tokens", "300",
                              "--tokens", "128", "--codecs", "lz4,lz4-shuffle,int8",
                              "--model-dir", str(_demo_model_dir())])
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"].startswith("demo model KV")
    assert report["chunks"] == 3 and report["shape"] == [4, 2, 128, 4, 64]  # 300 tokens: 128 + 128 + 44
    rows = {row["codec"]: row for row in report["codecs"]}
    assert rows["lz4"]["bitwise_equal"] and rows["lz4-shuffle"]["bitwise_equal"]
    assert 0 < rows["int8"]["rel_l2_err"] < 0.02
    [gain] = report["shuffle"]
    assert gain["plain"] == "lz4" and gain["size_gain"] == pytest.approx(
        rows["lz4"]["payload_bytes"] / rows["lz4-shuffle"]["payload_bytes"])


def test_bench_codecs_measures_the_trained_models_kv_with_windows_per_document(capsys):
    """--model trained: the trained reference model's KV for held-out text; a window keeps each
    document's last tokens raw, so it costs their bytes once per document, not once per chunk."""
    from flowkv.bench import codecs as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--json", "--repeats", "1", "--model", "trained", "--documents", "2",
                              "--doc-tokens", "384", "--tokens", "128", "--codecs", "int4,int4:window=64"])
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"].startswith("trained model KV") and "held-out" in report["source"]
    assert report["chunks"] == 6 and report["shape"] == [4, 2, 128, 2, 64]
    rows = {row["codec"]: row for row in report["codecs"]}
    # Per document, in its last chunk only: 64 tokens x 4 layers x (K, V) x 2 heads x 64 channels in
    # bf16 instead of int4 codes, no value statistics (fp32 minimum and scale per token and head) for
    # them, and ',"window":64' in that payload's header.
    window_bytes = 64 * 4 * 2 * 2 * 64 * (2 - 0.5)
    value_stats = 64 * 4 * 2 * 8
    extra = rows["int4 window=64"]["payload_bytes"] - rows["int4"]["payload_bytes"]
    assert extra == 2 * (window_bytes - value_stats + len(',"window":64'))
    assert rows["int4 window=64"]["rel_l2_err"] < rows["int4"]["rel_l2_err"]


def test_cpu_disk_int8_serves_exact_kv_from_memory_and_int8_kv_from_disk(tmp_path):
    """Through the engine: a memory hit is bit-exact; once memory lost the chunks, the disk
    copy is an int8 payload and what it loads is within int8's stated bound, not exact."""
    import time

    import torch

    from flowkv import CacheEngine, KVTransfer, payload
    from flowkv._testing.paged import make_paged_kv, random_slot_mapping
    from flowkv.codecs import get_codec
    from flowkv.items import Request
    from flowkv.kernels import KVGeometry, gather
    from flowkv.tiers.disk import key_digest

    geometry = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    engine = CacheEngine.from_pipeline("cpu-disk-int8", geometry=geometry, model_name="tiny", overrides={
        "chunk_size": 64, "tiers.memory.capacity": "8MiB", "tiers.disk.path": str(tmp_path / "disk"),
        "tiers.disk.timeout_s": 10.0})
    try:
        tokens = torch.randint(0, 32000, (128,), generator=torch.Generator().manual_seed(0))
        src = make_paged_kv(geometry, 32, seed=1)
        slots = random_slot_mapping(128, geometry, 32, seed=2)

        def region(kv_caches):
            return gather(kv_caches, geometry, slots, torch.empty(geometry.chunk_shape(128), dtype=geometry.dtype))

        assert engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots)).stored_tokens == 128
        assert engine.flush(30.0)
        keys = [k.to_str() for k in engine.chunk_keys(Request(tokens=tokens))]
        files = [tmp_path / "disk" / key_digest(k)[:2] / f"{key_digest(k)}.kv" for k in keys]
        assert [payload.read_header(f.read_bytes()).codec for f in files] == ["int8", "int8"]

        dst = make_paged_kv(geometry, 32, seed=0, fill=False)
        assert bool(engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots)).ret_mask.all())
        assert torch.equal(region(dst).view(torch.int16), region(src).view(torch.int16))  # memory: exact

        for key in keys:
            assert engine.memory.remove(key)
        dst = make_paged_kv(geometry, 32, seed=0, fill=False)
        deadline = time.monotonic() + 30
        while not bool(engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots)).ret_mask.all()):
            assert time.monotonic() < deadline, "the disk copy never came back"
        exact, loaded = region(src), region(dst)
        assert not torch.equal(loaded, exact)  # disk: int8, lossy
        codec = get_codec("int8")
        params = codec.resolve_params(**SHIPPED_INT8_PARAMS)
        for index, chunk in enumerate(exact.split(64, dim=2)):
            bound = codec.max_error(chunk, params)
            error = (loaded.split(64, dim=2)[index].double() - chunk.double()).abs()
            assert bool((error <= bound).all())
            # and within half a step of an independent float64 int8 quantizer
            reference, step = reference_int(chunk, 8, scale_dtype="fp16")
            check_against_reference(chunk, loaded.split(64, dim=2)[index], reference, step)
    finally:
        engine.close()


def test_shipped_lossless_tiered_pipeline_loads_under_any_gate():
    """cpu-disk-zstd: raw memory, zstd-shuffle on disk; lossless, so a gate needs no record."""
    from flowkv.quality_gate import codec_settings

    pipeline = load_pipeline("cpu-disk-zstd", overrides={"quality.min_agreement": 1.0})
    assert codec_settings(pipeline.store) == [("zstd-shuffle", {"level": 1})]


# -- the record must have measured the served model ------------------------------------


def model_folder(folder: Path, hidden_size: int) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": hidden_size}), encoding="utf-8")
    return folder


def gated_pipeline_of(tmp_path: Path, measured: Path):
    from flowkv.quality_gate import model_digest

    rec = record([("int8", INT8_PARAMS, 0.95)], model=str(measured))
    rec["model_config_sha256"] = model_digest(measured)
    return load_pipeline(write(tmp_path, pipeline_text("int8", quality=GATE), rec))


def test_a_record_of_another_model_is_refused_for_the_served_one(tmp_path):
    from flowkv.quality_gate import check_served_model

    measured = model_folder(tmp_path / "measured", 64)
    other = model_folder(tmp_path / "other", 128)
    pipeline = gated_pipeline_of(tmp_path, measured)
    assert check_served_model(pipeline, str(measured)) is None
    with pytest.raises(ValueError, match=r"measured model .*measured, but vLLM serves .*other"):
        check_served_model(pipeline, str(other))


def test_a_served_model_without_a_local_config_is_a_warning(tmp_path):
    from flowkv.quality_gate import check_served_model

    pipeline = gated_pipeline_of(tmp_path, model_folder(tmp_path / "measured", 64))
    warning = check_served_model(pipeline, "some-org/hub-model")
    assert warning is not None and "cannot check" in warning and "hub-model" in warning


def test_ungated_or_lossless_pipelines_check_no_model(tmp_path):
    from flowkv.quality_gate import check_served_model

    assert check_served_model(load_pipeline(write(tmp_path, pipeline_text("int8"))), "anything") is None
    lossless = load_pipeline(write(tmp_path, pipeline_text("zstd", quality=GATE), record([("int8", INT8_PARAMS, 0.9)])))
    assert check_served_model(lossless, "anything") is None


def test_record_path_is_taken_from_the_pipeline_files_folder(tmp_path, monkeypatch):
    from flowkv.quality_gate import record_path

    assert record_path("q.json", str(tmp_path / "p.toml")) == tmp_path / "q.json"
    assert record_path("/abs/q.json", str(tmp_path / "p.toml")) == Path("/abs/q.json")
    assert record_path("~/q.json", str(tmp_path / "p.toml")) == Path.home() / "q.json"
    monkeypatch.chdir(tmp_path)
    assert record_path("q.json", "<string>") == tmp_path / "q.json"


# -- CacheBlend is gated like a lossy codec ------------------------------------------------

BLEND = {"blend.separator": [271]}
BLEND_DEFAULT = ("blend", {"check_layers": [1], "recompute_ratio": 0.15})


def blend_record(tmp_path: Path, entries: list[tuple[str, dict, float]], measured: Path | None = None) -> str:
    from flowkv.quality_gate import model_digest

    rec = record(entries, model=str(measured or "tiny"))
    if measured is not None:
        rec["model_config_sha256"] = model_digest(measured)
    path = tmp_path / "blend-quality.json"
    path.write_text(json.dumps(rec), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name", ["blend", "blend-disk"])
def test_the_shipped_blend_pipelines_load_with_the_gate_warning_that_no_record_exists(name):
    from flowkv.quality_gate import blend_setting, gate_warnings

    pipeline = load_pipeline(name, overrides=BLEND)
    assert (pipeline.quality.mode, pipeline.quality.min_agreement, pipeline.quality.record) == ("warn", 0.9, None)
    assert blend_setting(pipeline.blend) == BLEND_DEFAULT
    [warning] = gate_warnings(pipeline, "/models/any")
    assert "no quality record exists for this model" in warning and "'flowkv quality" in warning
    assert 'blend {"check_layers": [1], "recompute_ratio": 0.15}' in warning and "warn mode" in warning
    # A pipeline that does not blend and has no lossy codec is not gated at all.
    assert gate_warnings(load_pipeline("local-cpu", overrides={"quality.min_agreement": 0.9,
                                                                "quality.mode": "warn"}), "/models/any") == []


def test_a_blend_pipeline_set_to_enforce_loads_only_with_a_record_of_its_ratio(tmp_path):
    enforce = {**BLEND, "quality.mode": "enforce"}
    with pytest.raises(PipelineError) as caught:
        load_pipeline("blend", overrides=enforce)
    [diag] = caught.value.diagnostics
    assert diag.kind == "quality" and "no quality record exists for this model" in diag.message

    rec = blend_record(tmp_path, [("blend", {"check_layers": [1], "recompute_ratio": 0.15}, 0.93),
                                  ("blend", {"check_layers": [1], "recompute_ratio": 0.3}, 0.97)])
    assert load_pipeline("blend", overrides={**enforce, "quality.record": rec}).quality.mode == "enforce"
    # The ratio the pipeline runs at is the one looked up: another ratio, other check layers or too low an
    # agreement is refused.
    assert load_pipeline("blend", overrides={**enforce, "quality.record": rec, "blend.recompute_ratio": 0.3})
    with pytest.raises(PipelineError, match=r'no measurement of blend \{"check_layers": \[1\], "recompute_ratio": 0.05\}'):
        load_pipeline("blend", overrides={**enforce, "quality.record": rec, "blend.recompute_ratio": 0.05})
    with pytest.raises(PipelineError, match=r"no measurement of blend .*check_layers.*\[2\]"):
        load_pipeline("blend", overrides={**enforce, "quality.record": rec, "blend.check_layers": [2]})
    with pytest.raises(PipelineError, match=r"agreed with the uncompressed model on 93.0% .* below min_agreement 95.0%"):
        load_pipeline("blend", overrides={**enforce, "quality.record": rec, "quality.min_agreement": 0.95})


def test_warn_mode_loads_what_enforce_refuses_and_vllm_logs_each_reason(tmp_path):
    from flowkv.quality_gate import gate_warnings

    measured = model_folder(tmp_path / "measured", 64)
    other = model_folder(tmp_path / "other", 128)
    rec = blend_record(tmp_path, [("blend", BLEND_DEFAULT[1], 0.85)], measured)
    low = load_pipeline("blend", overrides={**BLEND, "quality.record": rec})
    [warning] = gate_warnings(low, str(measured))
    assert "85.0%" in warning and "below min_agreement 90.0%" in warning and 'mode = "enforce"' in warning
    fine = load_pipeline("blend", overrides={**BLEND, "quality.record": rec, "quality.min_agreement": 0.8})
    assert gate_warnings(fine, str(measured)) == []
    # A record of another model: enforce mode refuses to start, warn mode says so.
    [warning] = gate_warnings(fine, str(other))
    assert "measured model" in warning and "other" in warning
    with pytest.raises(ValueError, match="measured model"):
        gate_warnings(load_pipeline("blend", overrides={**BLEND, "quality.record": rec, "quality.min_agreement": 0.8,
                                                        "quality.mode": "enforce"}), str(other))


def test_quality_mode_is_enforce_or_warn(tmp_path):
    path = write(tmp_path, pipeline_text(quality={**GATE, "mode": "loud"}), record([("int8", INT8_PARAMS, 0.9)]))
    with pytest.raises(PipelineError) as caught:
        load_pipeline(path)
    [diag] = caught.value.diagnostics
    assert path.read_text().splitlines()[diag.line - 1].startswith("mode") and "'loud'" in diag.message
    assert load_pipeline(path, overrides={"quality.mode": "warn"}).quality.mode == "warn"
