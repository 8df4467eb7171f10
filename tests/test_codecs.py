"""Codecs: every codec round-trips within its stated bound; the registry and
parameters reject misuse with clear messages."""

from __future__ import annotations

import re

import pytest
import torch

from codec_reference import check_against_reference, reference_fp8, reference_int

from flowkv import codecs
from flowkv.codecs import CodecDataError, UnknownCodecError, codec_names, get_codec, register_codec

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
LOSSLESS = ["none", "lz4", "lz4-shuffle", "zstd", "zstd-shuffle"]
LOSSY = ["fp8", "int8", "int4"]
# (num_layers, kv, num_tokens, num_kv_heads, head_size): odd token counts,
# MLA (kv=1, one head), a single token.
SHAPES = [(3, 2, 17, 2, 16), (2, 1, 31, 1, 24), (1, 2, 1, 4, 8)]


def kv_like(shape, dtype, seed=0):
    """Keys with a few outlier channels, values near zero: what KV looks like."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=gen)
    kv[..., 1] *= 20  # an outlier channel in every head
    kv[:, -1] *= 0.1  # values (or the MLA latent) smaller than keys
    return kv.to(dtype)


def roundtrip(name, kv, **params):
    codec = get_codec(name)
    resolved = codec.resolve_params(**params)
    body = codec.encode(kv, resolved)
    return codec, resolved, codec.decode(memoryview(body).cast("B"), tuple(kv.shape), kv.dtype, resolved), body


def bits(t):
    """A tensor's raw bits, so that -0.0 and NaN payloads compare exactly."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32}[t.element_size()]
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_roundtrip_is_bitwise(name, dtype, shape):
    kv = kv_like(shape, dtype)
    kv.view(-1)[0] = float("nan")
    kv.view(-1)[-1] = -0.0
    codec, _, decoded, _ = roundtrip(name, kv)
    assert codec.lossless and codec.max_error(kv, codec.resolve_params()) is None
    assert decoded.dtype == dtype and decoded.shape == kv.shape
    assert torch.equal(bits(decoded), bits(kv))


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_lossless_carries_fp8_kv_caches(name, dtype):
    kv = torch.randint(0, 120, (2, 2, 9, 2, 8), dtype=torch.uint8).view(dtype)
    _, _, decoded, _ = roundtrip(name, kv)
    assert torch.equal(bits(decoded), bits(kv))


@pytest.mark.parametrize("name", ["lz4", "lz4-shuffle", "zstd", "zstd-shuffle"])
def test_compressors_shrink_repetitive_kv(name):
    kv = torch.zeros(2, 2, 64, 2, 32, dtype=torch.float16)
    _, _, decoded, body = roundtrip(name, kv)
    assert len(memoryview(body).cast("B")) < kv.numel() * kv.element_size() // 20
    assert torch.equal(decoded, kv)


@pytest.mark.parametrize("compressor", ["lz4", "zstd"])
def test_shuffle_puts_high_bytes_together(compressor):
    # Random low bytes, one repeated high byte: interleaved, LZ4 finds no
    # repeats and zstd only entropy-codes; as planes, half the body is one run.
    gen = torch.Generator().manual_seed(1)
    low = torch.randint(0, 256, (1 << 14,), generator=gen, dtype=torch.int32)
    kv = (low | (0x3C << 8)).to(torch.int16).view(torch.float16).reshape(4, 2, 64, 2, 16)
    plain = len(memoryview(roundtrip(compressor, kv)[3]).cast("B"))
    codec, _, decoded, body = roundtrip(f"{compressor}-shuffle", kv)
    assert torch.equal(decoded, kv)
    assert len(memoryview(body).cast("B")) < 0.85 * plain
    assert len(memoryview(body).cast("B")) < 0.55 * kv.numel() * 2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", LOSSY)
def test_lossy_roundtrip_within_stated_bound(name, dtype, shape):
    kv = kv_like(shape, dtype, seed=LOSSY.index(name))
    codec, params, decoded, _ = roundtrip(name, kv)
    assert not codec.lossless and codec.error_bound
    bound = codec.max_error(kv, params)
    error = (decoded.double() - kv.double()).abs()
    assert decoded.dtype == dtype and decoded.shape == kv.shape
    assert bool((error <= bound).all()), f"max excess {(error - bound).max().item()}"
    # The bound is not vacuous: some element comes close to its own bound.
    assert (error / bound).max() > 0.25


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "name,params",
    [("fp8", {"group_size": 8}), ("int8", {"group_size": 4, "key_group_size": 19}), ("int4", {"group_size": 8, "key_group_size": 1})],
)
def test_lossy_group_sizes(name, params, dtype):
    kv = kv_like((2, 2, 19, 2, 16), dtype)
    codec, resolved, decoded, _ = roundtrip(name, kv, **params)
    assert bool(((decoded.double() - kv.double()).abs() <= codec.max_error(kv, resolved)).all())
    # Smaller groups fit the data better than the default.
    _, _, coarse, _ = roundtrip(name, kv)
    assert (decoded.float() - kv.float()).abs().mean() < (coarse.float() - kv.float()).abs().mean()


def test_kivi_keys_are_quantized_per_channel():
    # One huge key channel must not cost the other channels their precision
    # (it would with per-token key scales).
    kv = torch.zeros(1, 2, 32, 1, 8)
    kv[:, 0, :, :, :] = torch.linspace(-1, 1, 32).reshape(1, 32, 1, 1)
    kv[:, 0, :, :, 3] *= 1000
    _, _, decoded, _ = roundtrip("int4", kv)
    normal = [c for c in range(8) if c != 3]
    assert (decoded[:, 0, :, :, normal] - kv[:, 0, :, :, normal]).abs().max() <= 2 / 15 / 2 + 1e-6


def test_mla_latent_is_quantized_per_token():
    # kv=1: each token row gets its own range, so a token of tiny values
    # next to a token of big ones keeps its precision.
    kv = torch.zeros(1, 1, 2, 1, 8)
    kv[0, 0, 0, 0] = torch.linspace(-1e-3, 1e-3, 8)
    kv[0, 0, 1, 0] = torch.linspace(-100, 100, 8)
    _, _, decoded, _ = roundtrip("int8", kv)
    assert (decoded[0, 0, 0] - kv[0, 0, 0]).abs().max() < 1e-5


def test_int4_body_packs_two_codes_per_byte():
    layers, kv_n, tokens, heads, head_size = shape = (2, 2, 17, 2, 16)
    _, _, _, body = roundtrip("int4", kv_like(shape, torch.float16))
    codes = (layers * kv_n * tokens * heads * head_size + 1) // 2
    stats = 2 * 4 * (layers * heads * head_size + layers * tokens * heads)
    assert len(memoryview(body).cast("B")) == codes + stats


def test_constant_and_empty_chunks():
    for name in LOSSY + LOSSLESS:
        const = torch.full((1, 2, 5, 1, 8), 3.5, dtype=torch.float16)
        assert torch.equal(roundtrip(name, const)[2], const), name
        empty = torch.empty((2, 2, 0, 1, 8), dtype=torch.bfloat16)
        assert roundtrip(name, empty)[2].shape == empty.shape, name


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_rejects_non_finite_and_non_chunk_input(name):
    codec = get_codec(name)
    params = codec.resolve_params()
    bad = torch.zeros(1, 2, 4, 1, 8)
    bad[0, 1, 2, 0, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(bad, params)
    with pytest.raises(ValueError, match="chunk tensor"):
        codec.check_tensor(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="chunk tensor"):
        codec.check_tensor(torch.zeros(1, 3, 4, 1, 8))
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        codec.check_tensor(torch.zeros(1, 2, 4, 1, 8, dtype=torch.float64))


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide"):
        get_codec("int4").encode(torch.zeros(1, 2, 4, 1, 12), get_codec("int4").resolve_params(group_size=5))
    with pytest.raises(ValueError, match="key_group_size 3 does not divide num_tokens 4"):
        get_codec("int8").encode(torch.zeros(1, 2, 4, 1, 12), get_codec("int8").resolve_params(key_group_size=3))
    with pytest.raises(ValueError, match="does not divide"):
        get_codec("fp8").encode(torch.zeros(1, 2, 4, 1, 12), get_codec("fp8").resolve_params(group_size=5))


def test_params_are_validated_with_hints():
    with pytest.raises(ValueError, match=r"no parameter 'levle' \(did you mean 'level'\?\); it accepts: level"):
        get_codec("zstd").resolve_params(levle=3)
    with pytest.raises(ValueError, match="codec 'zstd'"):
        get_codec("zstd").resolve_params(level=99)
    with pytest.raises(ValueError, match="codec 'zstd'"):
        get_codec("zstd").resolve_params(level="3")
    with pytest.raises(ValueError, match="it accepts: none"):
        get_codec("none").resolve_params(level=3)
    assert get_codec("zstd").resolve_params().level == 3


def test_zstd_levels_trade_size():
    kv = kv_like((2, 2, 64, 2, 32), torch.bfloat16)
    fast = len(memoryview(roundtrip("zstd", kv, level=1)[3]).cast("B"))
    small = len(memoryview(roundtrip("zstd", kv, level=19)[3]).cast("B"))
    assert small < fast


def test_corrupt_compressed_streams_raise_codec_data_error():
    kv = kv_like((2, 2, 16, 2, 16), torch.float16)
    for name in ["lz4", "zstd", "lz4-shuffle", "zstd-shuffle"]:
        codec = get_codec(name)
        params = codec.resolve_params()
        body = bytes(memoryview(codec.encode(kv, params)).cast("B"))
        for broken in (body[: len(body) // 2], body + b"\0" * 7, b"\xff" * len(body)):
            with pytest.raises(CodecDataError):
                codec.decode(memoryview(broken), tuple(kv.shape), kv.dtype, params)
    for name in ["none"] + LOSSY:
        codec = get_codec(name)
        params = codec.resolve_params()
        body = bytes(memoryview(codec.encode(kv, params)).cast("B"))
        with pytest.raises(CodecDataError, match="bytes"):
            codec.decode(memoryview(body[:-1]), tuple(kv.shape), kv.dtype, params)


def test_registry_names_ids_and_errors():
    assert codec_names() == ["none", "lz4", "lz4-shuffle", "zstd", "zstd-shuffle", "fp8", "int8", "int4"]
    assert {get_codec(n).codec_id for n in codec_names()} == {0, 1, 2, 3, 4, 16, 17, 18}
    assert codecs.codec_by_id(3).name == "zstd"
    with pytest.raises(UnknownCodecError, match=re.escape("did you mean 'zstd'?")):
        get_codec("zstdd")
    with pytest.raises(UnknownCodecError, match="unknown codec id 999"):
        codecs.codec_by_id(999)

    # Concrete codecs (a NoneCodec body) under names and ids the registry must refuse.
    class Clash(codecs.NoneCodec):
        name = "zstd"
        codec_id = 5000
        lossless = True

    with pytest.raises(ValueError, match="already registered"):
        register_codec(Clash())

    class Reserved(codecs.NoneCodec):
        name = "mine"
        codec_id = 7
        lossless = True

    with pytest.raises(ValueError, match="reserved"):
        register_codec(Reserved())
    assert "mine" not in codec_names()


def test_int_key_groups_split_the_token_range():
    # RoPE makes key channels oscillate along tokens; groups of fewer tokens
    # see smaller ranges, and the body carries one (min, scale) per group.
    layers, kv_n, tokens, heads, head_size = shape = (1, 2, 32, 2, 16)
    kv = kv_like(shape, torch.float32)
    kv[:, 0] += torch.linspace(-50, 50, tokens).reshape(1, tokens, 1, 1)  # drift along tokens
    codec, params, grouped, body = roundtrip("int4", kv, key_group_size=8)
    _, _, whole, _ = roundtrip("int4", kv)
    assert (grouped[:, 0] - kv[:, 0]).abs().max() < 0.5 * (whole[:, 0] - kv[:, 0]).abs().max()
    assert bool(((grouped.double() - kv.double()).abs() <= codec.max_error(kv, params)).all())
    stats = 2 * 4 * (layers * (tokens // 8) * heads * head_size + layers * tokens * heads)
    assert len(memoryview(body).cast("B")) == layers * kv_n * tokens * heads * head_size // 2 + stats


def _bench(argv):
    import argparse

    from flowkv.bench import codecs as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


def test_bench_reports_every_codec_against_none(capsys, tmp_path):
    import json

    small = ["--layers", "2", "--tokens", "32", "--kv-heads", "2", "--head-size", "16", "--repeats", "1"]
    assert _bench(small + ["--json", "--codecs", "zstd,int4:key_group_size=8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"].startswith("synthetic") and report["shape"] == [2, 2, 32, 2, 16]
    rows = {row["codec"]: row for row in report["codecs"]}
    assert list(rows) == ["none", "zstd", "int4 key_group_size=8"]
    assert rows["none"]["size_vs_none"] == 1.0 and rows["zstd"]["bitwise_equal"]
    assert rows["int4 key_group_size=8"]["ratio"] > 1.3 and 0 < rows["int4 key_group_size=8"]["rel_l2_err"] < 0.2

    kv_file = tmp_path / "chunk.pt"
    torch.save(kv_like((2, 1, 9, 1, 8), torch.float16), kv_file)
    assert _bench(["--kv-file", str(kv_file), "--codecs", "fp8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert f"input: file {kv_file}" in out and "fp8" in out

    torch.save(torch.zeros(3, 4), kv_file)
    assert _bench(["--kv-file", str(kv_file)]) == 2
    assert "expected shape" in capsys.readouterr().err
    assert _bench(small + ["--codecs", "zstd:levle=3"]) == 2
    assert "did you mean 'level'" in capsys.readouterr().err


# -- against an independent float64 reference (tests/codec_reference.py) -------------------------

INT_CASES = [
    {},
    {"group_size": 8},
    {"key_group_size": 8},
    {"window": 5},
    {"window": 5, "key_group_size": 8},  # 27 quantized tokens do not fill 8s: 3 more join the window
    {"scale_dtype": "fp16"},
    {"group_size": 16, "key_group_size": 16, "window": 16, "scale_dtype": "fp16"},
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("params", INT_CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
@pytest.mark.parametrize("name,bits", [("int8", 8), ("int4", 4)])
def test_int_codecs_match_a_float64_reference(name, bits, params, dtype):
    kv = kv_like((2, 2, 32, 2, 32), dtype, seed=bits)
    kv[:, 0] += 3.0  # keys off zero: the zero point matters
    codec, resolved, decoded, _ = roundtrip(name, kv, **params)
    reference, step = reference_int(kv, bits, **params)
    check_against_reference(kv, decoded, reference, step)
    # The codec's own bound holds too, and is no looser than the reference's half step needs.
    bound = codec.max_error(kv, resolved)
    assert bool(((decoded.double() - kv.double()).abs() <= bound).all())
    assert bool((bound <= step / 2 * 1.01 + 2.0**-7 * (kv.double().abs() + step) + 1e-30).all())


FP8_CASES = [{}, {"group_size": 16}, {"scaling": "channel"}, {"window": 7}, {"scaling": "channel", "window": 3}]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("params", FP8_CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
def test_fp8_matches_a_float64_reference(params, dtype):
    kv = kv_like((2, 2, 24, 2, 16), dtype, seed=3)
    kv[0, 1, 5] *= 1e-6  # a tiny token: e4m3 subnormals
    codec, resolved, decoded, _ = roundtrip("fp8", kv, **params)
    reference, quantum = reference_fp8(kv, **params)
    check_against_reference(kv, decoded, reference, quantum)
    assert bool(((decoded.double() - kv.double()).abs() <= codec.max_error(kv, resolved)).all())


# -- strided input ------------------------------------------------------------------------------


def permuted_copy(kv: torch.Tensor) -> torch.Tensor:
    """`kv`'s values in a tensor whose memory runs (layers, tokens, kv, heads, head_size): a
    non-contiguous view of the chunk shape, as a chunk buffer laid out for long copies hands it."""
    storage = kv.permute(0, 2, 1, 3, 4).contiguous()
    view = storage.permute(0, 2, 1, 3, 4)
    assert not view.is_contiguous() and torch.equal(view, kv)
    return view


@pytest.mark.parametrize("name,params", [
    ("none", {}), ("lz4", {}), ("zstd-shuffle", {}), ("fp8", {}), ("fp8", {"scaling": "channel", "window": 4}),
    ("int8", {}), ("int4", {"group_size": 8, "key_group_size": 8, "window": 6, "scale_dtype": "fp16"}),
])
def test_codecs_encode_non_contiguous_chunks_like_contiguous_ones(name, params):
    kv = kv_like((2, 2, 24, 2, 16), torch.bfloat16, seed=5)
    codec = get_codec(name)
    resolved = codec.resolve_params(**params)
    strided = permuted_copy(kv)
    body = bytes(memoryview(codec.encode(strided, resolved)).cast("B"))
    assert body == bytes(memoryview(codec.encode(kv, resolved)).cast("B"))
    decoded = codec.decode(memoryview(body), tuple(kv.shape), kv.dtype, resolved)
    if codec.lossless:
        assert torch.equal(bits(decoded), bits(kv))
    else:
        assert torch.equal(codec.max_error(strided, resolved), codec.max_error(kv, resolved))
    # Through the payload format too, decoding into a strided destination.
    from flowkv import payload

    blob = payload.encode(strided, name, **params)
    out = permuted_copy(torch.zeros_like(kv))
    payload.decode_into(blob, out)
    assert torch.equal(bits(out), bits(decoded))


# -- windows, scale dtypes and the header --------------------------------------------------------


def test_window_keeps_the_last_tokens_exact_and_costs_their_raw_bytes():
    layers, kv_n, tokens, heads, head_size = shape = (2, 2, 64, 2, 16)
    kv = kv_like(shape, torch.bfloat16)
    _, _, plain, plain_body = roundtrip("int4", kv)
    codec, params, windowed, body = roundtrip("int4", kv, window=16)
    assert torch.equal(windowed[:, :, 48:], kv[:, :, 48:])
    assert not torch.equal(windowed[:, :, :48], kv[:, :, :48])
    assert bool((codec.max_error(kv, params)[:, :, 48:] == 0).all())
    codes = layers * kv_n * 48 * heads * head_size // 2
    stats = 2 * 4 * (layers * heads * head_size + layers * 48 * heads)
    raw_window = layers * kv_n * 16 * heads * head_size * 2
    assert len(memoryview(body).cast("B")) == stats + raw_window + codes
    # A window as long as the chunk stores it raw, plus nothing else.
    _, _, whole, body = roundtrip("int8", kv, window=100)
    assert torch.equal(whole, kv) and len(memoryview(body).cast("B")) == kv.numel() * 2


def test_fp16_scales_halve_the_statistics_and_refuse_what_fp16_cannot_hold():
    shape = (2, 2, 32, 2, 16)
    kv = kv_like(shape, torch.float32)
    _, _, _, fp32_body = roundtrip("int4", kv)
    _, _, _, fp16_body = roundtrip("int4", kv, scale_dtype="fp16")
    stat_count = 2 * (2 * 2 * 16 + 2 * 32 * 2)
    assert len(memoryview(fp32_body).cast("B")) - len(memoryview(fp16_body).cast("B")) == 2 * stat_count
    huge = kv.clone()
    huge[0, 0, 0, 0, 0] = -1e5  # a zero point below fp16's -65504
    with pytest.raises(ValueError, match="scale_dtype 'fp16' cannot hold"):
        get_codec("int8").encode(huge, get_codec("int8").resolve_params(scale_dtype="fp16"))


def test_new_parameters_stay_out_of_the_header_at_their_defaults():
    # Payloads and quality records written before window, scale_dtype and scaling existed
    # name the same parameters, and a payload without them decodes with the old layout.
    from flowkv import payload

    int8 = get_codec("int8")
    assert int8.params_to_header(int8.resolve_params()) == {"group_size": 0, "key_group_size": 0}
    assert int8.params_to_header(int8.resolve_params(window=8, scale_dtype="fp16")) == {
        "group_size": 0, "key_group_size": 0, "window": 8, "scale_dtype": "fp16"}
    fp8 = get_codec("fp8")
    assert fp8.params_to_header(fp8.resolve_params(window=0, scaling="token")) == {"group_size": 0}
    kv = kv_like((1, 2, 16, 2, 8), torch.bfloat16)
    blob = payload.encode(kv, "int8", window=4)
    assert dict(payload.read_header(blob).codec_params) == {"group_size": 0, "key_group_size": 0, "window": 4}
    assert torch.equal(payload.decode(blob)[:, :, 12:], kv[:, :, 12:])
    with pytest.raises(CodecDataError, match="window"):
        get_codec("zstd").params_from_header({"level": 3, "window": 4})


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_window_rejects_non_finite_values_too(name):
    kv = torch.zeros(1, 2, 8, 1, 8)
    kv[0, 1, 7, 0, 0] = float("nan")
    codec = get_codec(name)
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(kv, codec.resolve_params(window=2))


def test_prefix_window_gives_each_chunk_its_share():
    from flowkv.codecs import prefix_window

    assert [prefix_window(64, s, s + 256, 1024) for s in (0, 256, 512, 768)] == [0, 0, 0, 64]
    assert [prefix_window(300, s, s + 256, 1024) for s in (0, 256, 512, 768)] == [0, 0, 44, 256]
    assert prefix_window(64, 0, 20, 20) == 20 and prefix_window(0, 0, 256, 256) == 0


def test_pipeline_files_validate_every_new_codec_option(tmp_path):
    from flowkv.pipeline import PipelineError, dumps_pipeline, load_pipeline

    # (the compress stage's settings, the error's line from the stage's table, what it says)
    stages = [
        ({"codec": "int4", "window": -1}, 0, "stage 'compress': codec 'int4': 'window' must be >= 0"),
        ({"codec": "int8", "scale_dtype": "fp18"}, 0,
         "codec 'int8': 'scale_dtype' must be one of 'fp32', 'fp16', got 'fp18' (did you mean 'fp16'?)"),
        ({"codec": "fp8", "scaling": "chanel"}, 0,
         "codec 'fp8': 'scaling' must be one of 'token', 'channel', got 'chanel' (did you mean 'channel'?)"),
        ({"codec": "zstd", "window": 64}, 0, "stage 'compress': codec 'zstd' has no parameter 'window'"),
        ({"codec": "fp8", "scale_dtype": "fp16"}, 0, "stage 'compress': codec 'fp8' has no parameter 'scale_dtype'"),
        ({"codec": "int8", "window": "64"}, 3, "stage 'compress' window: expected int, got str '64'"),
    ]

    def text(compress_stages):
        return dumps_pipeline(pipeline={"name": "lossy"}, tiers={"memory": {"kind": "memory", "capacity": "64MiB"}},
                              store=["tokenize", "chunk-hash", "allocate", "gather"]
                              + [("compress", settings) for settings in compress_stages] + ["put"],
                              retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"])

    path = tmp_path / "lossy.toml"
    path.write_text(text([settings for settings, _, _ in stages]))
    with pytest.raises(PipelineError) as caught:
        load_pipeline(path)
    found = caught.value.diagnostics
    lines = path.read_text().splitlines()
    tables = [n + 1 for n, line in enumerate(lines) if line == "[[store.stages]]"][4:]
    assert len(found) == len(stages)
    for diag, table, (_, offset, message) in zip(found, tables, stages):
        assert (diag.file, diag.line, diag.col) == (str(path), table + offset, 1), str(diag)
        assert message in str(diag), str(diag)

    path.write_text(text([{"codec": "int4", "window": 64, "scale_dtype": "fp16"}]))
    settings = load_pipeline(path).store[4].settings()
    assert (settings["window"], settings["scale_dtype"]) == (64, "fp16")


def test_compress_stage_keeps_the_last_window_tokens_of_each_stored_prefix_exact(tmp_path):
    """Through the engine: 600 tokens store two 256-token chunks (no partial chunks); with
    window = 64 the stored prefix's last 64 tokens come back bit-exact, the rest int4."""
    from flowkv import CacheEngine, KVTransfer
    from flowkv._testing.paged import make_paged_kv, random_slot_mapping
    from flowkv.kernels import KVGeometry, gather
    from flowkv.pipeline import dumps_pipeline

    path = tmp_path / "windowed.toml"
    path.write_text(dumps_pipeline(
        pipeline={"name": "windowed", "chunk_size": 256},
        tiers={"memory": {"kind": "memory", "capacity": "16MiB"}},
        store=["tokenize", "chunk-hash", "allocate", "gather",
               ("compress", {"codec": "int4", "window": 64, "key_group_size": 32}), "put"],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"],
    ))
    geometry = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    engine = CacheEngine.from_pipeline(str(path), geometry=geometry, model_name="tiny")
    try:
        tokens = torch.randint(0, 32000, (600,), generator=torch.Generator().manual_seed(0))
        src = make_paged_kv(geometry, 64, seed=1)
        slots = random_slot_mapping(600, geometry, 64, seed=2)
        assert engine.store(KVTransfer(tokens=tokens, kv_caches=src, slot_mapping=slots)).stored_tokens == 512
        dst = make_paged_kv(geometry, 64, seed=0, fill=False)
        mask = engine.retrieve(KVTransfer(tokens=tokens, kv_caches=dst, slot_mapping=slots)).ret_mask
        assert int(mask.sum()) == 512

        def region(kv_caches):
            return gather(kv_caches, geometry, slots[:512], torch.empty(geometry.chunk_shape(512), dtype=geometry.dtype))

        exact, loaded = region(src), region(dst)
        assert torch.equal(loaded[:, :, 448:].view(torch.int16), exact[:, :, 448:].view(torch.int16))
        assert not torch.equal(loaded[:, :, :448], exact[:, :, :448])
        reference, step = reference_int(exact[:, :, 256:], 4, key_group_size=32, window=64)
        check_against_reference(exact[:, :, 256:], loaded[:, :, 256:], reference, step)
    finally:
        engine.close()
