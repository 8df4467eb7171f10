"""Codecs: every codec round-trips within its stated bound; the registry and
parameters reject misuse with clear messages."""

from __future__ import annotations

import re

import pytest
import torch

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
