"""Payload format: round trips through the header, and every kind of bad
bytes is refused with PayloadError rather than decoded."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import xxhash

from flowkv import payload
from flowkv.codecs import codec_names, get_codec
from flowkv.payload import PayloadError, PayloadHeader, decode, decode_into, encode, read_header, verify

SHAPE = (3, 2, 17, 2, 16)  # odd token count
MLA_SHAPE = (2, 1, 33, 1, 24)


def make_kv(shape=SHAPE, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=gen)
    kv[..., 0] *= 10
    return kv.to(dtype)


def resign(blob: bytes, **fields) -> bytes:
    """Rewrite header fields and recompute the header checksum, as a writer
    with a different flowkv (or a forger) would; `body_checksum=True`
    recomputes the body checksum too."""
    prefix = struct.Struct("<4sHHBBHIQQ")
    values = list(prefix.unpack_from(blob))
    names = ["magic", "version", "codec_id", "dtype_code", "ndim", "params_len", "header_length", "body_length", "body_checksum"]
    header_length = values[6]
    rest = bytearray(blob[prefix.size : header_length - 8])
    body = blob[header_length:]
    if "params" in fields:
        # shape, then (v2) the dim order, then (v3) the key digest and option flags (none set)
        params_at = 8 * values[4] + (values[4] if values[1] >= 2 else 0) + (18 if values[1] >= 3 else 0)
        params = json.dumps(fields.pop("params")).encode()
        rest = rest[:params_at] + params
        values[5] = len(params)
        values[6] = header_length = prefix.size + len(rest) + 8
    if fields.pop("body_checksum", None):
        values[8] = xxhash.xxh3_64_intdigest(body)
    for name, value in fields.items():
        values[names.index(name)] = value
    head = prefix.pack(*values) + bytes(rest)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + body


@pytest.mark.parametrize("shape", [SHAPE, MLA_SHAPE])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", codec_names())
def test_roundtrip_every_codec(codec, dtype, shape):
    kv = make_kv(shape, dtype)
    blob = encode(kv, codec)
    assert isinstance(blob, bytes)
    header = read_header(blob)
    assert header == verify(blob)
    assert (header.codec, header.dtype, header.shape, header.version) == (codec, dtype, shape, payload.FORMAT_VERSION)
    assert header.payload_length == len(blob)
    assert header.nbytes == kv.numel() * kv.element_size()
    decoded = decode(blob, expect_shape=shape, expect_dtype=dtype, expect_codec=codec)
    into = decode_into(bytearray(blob), torch.full_like(kv, 7.0))
    assert torch.equal(decoded, into)
    impl = get_codec(codec)
    if impl.lossless:
        assert torch.equal(decoded, kv)
    else:
        error = (decoded.double() - kv.double()).abs()
        assert bool((error <= impl.max_error(kv, impl.resolve_params())).all())


def test_codec_params_travel_in_the_header():
    kv = make_kv()
    header = read_header(encode(kv, "zstd", level=9))
    assert header.codec_params == {"level": 9}
    with pytest.raises(TypeError):
        header.codec_params["level"] = 1  # read-only
    blob = encode(kv, "int4", group_size=8)
    assert read_header(blob).codec_params == {"group_size": 8, "key_group_size": 0}
    # Decoding uses the stored group size (with the default, 16, the body
    # would not even have the right length).
    impl = get_codec("int4")
    error = (decode(blob).double() - kv.double()).abs()
    assert bool((error <= impl.max_error(kv, impl.resolve_params(group_size=8))).all())


def test_accepts_bytes_bytearray_memoryview_and_noncontiguous_input():
    kv = make_kv(dtype=torch.bfloat16)
    blob = encode(kv.transpose(2, 3).contiguous().transpose(2, 3), "lz4-shuffle")
    for form in (blob, bytearray(blob), memoryview(blob), memoryview(bytearray(blob))):
        assert torch.equal(decode(form), kv)
    # A multi-byte-format view of the same bytes is read as bytes.
    padded = blob + b"\0" * (4 - len(blob) % 4)  # at least one byte past the body
    as_ints = memoryview(bytearray(padded)).cast("I")
    with pytest.raises(PayloadError, match="after its body"):
        decode(as_ints)
    assert read_header(as_ints).codec == "lz4-shuffle"


def test_decode_into_writes_the_given_tensor():
    kv = make_kv()
    out = torch.empty_like(kv)
    assert decode_into(encode(kv, "zstd"), out) is out
    assert torch.equal(out, kv)
    with pytest.raises(PayloadError, match="expected"):
        decode_into(encode(kv, "zstd"), torch.empty(SHAPE, dtype=torch.bfloat16))
    with pytest.raises(PayloadError, match="shape"):
        decode_into(encode(kv, "zstd"), torch.empty(3, 2, 16, 2, 16, dtype=torch.float16))
    # Non-contiguous destination: decoded then copied.
    wide = torch.zeros(3, 2, 17, 2, 32, dtype=torch.float16)
    decode_into(encode(kv, "none"), wide[..., :16])
    assert torch.equal(wide[..., :16], kv) and not wide[..., 16:].any()


def test_rejects_payload_of_another_codec_when_expected():
    blob = encode(make_kv(), "lz4")
    with pytest.raises(PayloadError, match="written with codec 'lz4', expected 'zstd'"):
        decode(blob, expect_codec="zstd")
    with pytest.raises(PayloadError, match="expected 'int4'"):
        decode_into(blob, torch.empty(SHAPE, dtype=torch.float16), expect_codec="int4")


def test_rejects_wrong_shape_and_dtype_expectations():
    blob = encode(make_kv(), "none")
    with pytest.raises(PayloadError, match=r"holds shape \(3, 2, 17, 2, 16\), expected \(3, 2, 16, 2, 16\)"):
        decode(blob, expect_shape=(3, 2, 16, 2, 16))
    with pytest.raises(PayloadError, match="holds dtype torch.float16, expected torch.bfloat16"):
        decode(blob, expect_dtype=torch.bfloat16)
    assert decode(blob, expect_shape=torch.Size(SHAPE)).shape == SHAPE


@pytest.mark.parametrize("codec", codec_names())
def test_rejects_flipped_body_bytes(codec):
    blob = encode(make_kv(), codec)
    start = read_header(blob).header_length
    for at in (start, start + 1, (start + len(blob)) // 2, len(blob) - 1):
        broken = bytearray(blob)
        broken[at] ^= 0x10
        with pytest.raises(PayloadError, match="corrupt payload body: checksum mismatch"):
            decode(broken)
        with pytest.raises(PayloadError, match="checksum mismatch"):
            verify(broken)


def test_rejects_every_flipped_header_byte():
    blob = encode(make_kv(), "zstd", level=4)
    header_length = read_header(blob).header_length
    for at in range(header_length):
        for mask in (0x01, 0x80):
            broken = bytearray(blob)
            broken[at] ^= mask
            with pytest.raises(PayloadError):
                decode(broken)


@pytest.mark.parametrize("codec", ["none", "zstd-shuffle", "int4"])
def test_rejects_truncation_at_many_points(codec):
    blob = encode(make_kv(), codec)
    header_length = read_header(blob).header_length
    cuts = {0, 1, 3, 4, 5, 6, 20, payload.MIN_HEADER_SIZE - 1, payload.MIN_HEADER_SIZE, header_length - 1,
            header_length, header_length + 1, (header_length + len(blob)) // 2, len(blob) - 1}
    for cut in sorted(cuts):
        with pytest.raises(PayloadError, match="truncated"):
            decode(blob[:cut])
    with pytest.raises(PayloadError, match="truncated"):
        read_header(blob[: header_length - 1])
    assert read_header(blob[:header_length]).codec == codec  # the header alone is enough to read it


def test_rejects_trailing_bytes():
    blob = encode(make_kv(), "lz4")
    with pytest.raises(PayloadError, match="3 bytes after its body"):
        decode(blob + b"abc")


def test_rejects_wrong_magic_and_foreign_data():
    blob = encode(make_kv(), "none")
    with pytest.raises(PayloadError, match=r"not a flowkv payload: magic b'XKVP'"):
        decode(b"X" + blob[1:])
    with pytest.raises(PayloadError, match="not a flowkv payload"):
        decode(torch.randn(100).numpy().tobytes())
    with pytest.raises(PayloadError, match="bytes-like"):
        decode("FKVP...")


def test_rejects_unknown_version_even_with_valid_checksum():
    blob = encode(make_kv(), "none")
    with pytest.raises(PayloadError, match="unsupported payload format version 4 \\(this flowkv reads 1, 2 and 3\\)"):
        decode(resign(blob, version=4))


def test_rejects_unknown_codec_and_dtype_with_valid_checksum():
    blob = encode(make_kv(), "none")
    with pytest.raises(PayloadError, match="unknown codec id 4242"):
        decode(resign(blob, codec_id=4242))
    with pytest.raises(PayloadError, match="unknown dtype code 99"):
        read_header(resign(blob, dtype_code=99))
    with pytest.raises(PayloadError, match="header length"):
        read_header(resign(blob, ndim=4))


def test_rejects_bad_stored_params():
    blob = encode(make_kv(), "zstd")
    # Checked with the header (so a tier's verify finds it), not first when a decode meets it.
    with pytest.raises(PayloadError, match="do not validate.*no parameter 'levle'"):
        decode(resign(blob, params={"levle": 3}))
    with pytest.raises(PayloadError, match="not a JSON object"):
        read_header(resign(blob, params=[1, 2]))


@pytest.mark.parametrize("codec", ["lz4", "zstd", "zstd-shuffle", "none", "fp8", "int8", "int4"])
def test_codec_failure_behind_valid_checksums_is_a_payload_error(codec):
    # A body that passes its checksum but is not what the codec wrote (a
    # writer bug, or a forged payload): the codec's refusal surfaces as
    # PayloadError naming the codec.
    kv = make_kv()
    blob = encode(kv, codec)
    header_length = read_header(blob).header_length
    body = blob[header_length:]
    forged = blob[:header_length] + body[: len(body) // 2]
    forged = resign(forged, body_length=len(body) // 2, body_checksum=True)
    with pytest.raises(PayloadError, match=f"codec '{codec}' failed to decode"):
        decode(forged)


def test_header_is_frozen_and_compact():
    header = read_header(encode(make_kv(), "none"))
    assert isinstance(header, PayloadHeader)
    with pytest.raises(AttributeError):
        header.codec = "lz4"
    # 32-byte prefix + 5 dims + their order (version 2) + key digest and option flags (version 3)
    # + "{}" params + 8-byte checksum.
    assert header.header_length == 32 + 5 * 8 + 5 + 16 + 2 + 2 + 8


def test_encode_rejects_bad_requests():
    with pytest.raises(ValueError, match="unknown codec 'lz5'; did you mean 'lz4'"):
        encode(make_kv(), "lz5")
    with pytest.raises(ValueError, match="no parameter 'level'"):
        encode(make_kv(), "lz4", level=3)
    with pytest.raises(ValueError, match="not torch.float64"):
        encode(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="chunk tensor"):
        encode(torch.zeros(4, 8), "int8")
    with pytest.raises(TypeError, match="torch.Tensor"):
        encode(b"kv")


def test_scalar_and_zero_sized_tensors_roundtrip():
    for tensor in (torch.tensor(1.5), torch.empty(0, 4, dtype=torch.bfloat16)):
        for codec in ("none", "lz4", "zstd-shuffle"):
            decoded = decode(encode(tensor, codec), expect_shape=tensor.shape)
            assert torch.equal(decoded, tensor)


# -- version 2: the body's dim order -------------------------------------------------

def chunk_in_engine_format(layout="cpu", dtype=torch.bfloat16, seed=3):
    """A chunk tensor laid out as the engine's arena lays it out (a strided logical view)."""
    from flowkv.kernels import KVGeometry

    g = KVGeometry(layout, 3, 2, 16, 16, dtype)
    chunk = g.empty_chunk(17)
    chunk.copy_(make_kv(tuple(g.chunk_shape(17)), dtype, seed))
    return g, chunk


def as_version_1(blob: bytes) -> bytes:
    """The same payload as a flowkv before chunk format 2 wrote it (no order field, no key digest);
    only for payloads whose order is the identity and that set no option."""
    prefix = struct.Struct("<4sHHBBHIQQ")
    values = list(prefix.unpack_from(blob))
    ndim, header_length = values[4], values[6]
    order_at = prefix.size + 8 * ndim
    assert tuple(blob[order_at:order_at + ndim]) == tuple(range(ndim))
    assert blob[order_at + ndim + 16:order_at + ndim + 18] == b"\0\0"
    rest = blob[prefix.size:order_at] + blob[order_at + ndim + 18:header_length - 8]
    values[1], values[6] = 1, header_length - ndim - 18
    head = prefix.pack(*values) + rest
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + blob[header_length:]


@pytest.mark.parametrize("layout", ["cpu", "flash_kv_hnd"])
@pytest.mark.parametrize("codec", codec_names())
def test_chunk_in_engine_format_round_trips_every_codec(codec, layout):
    g, chunk = chunk_in_engine_format(layout)
    assert not chunk.is_contiguous()
    blob = encode(chunk, codec)
    header = read_header(blob)
    impl = get_codec(codec)
    # Lossless codecs take the buffer as it is; lossy ones see the chunk in its shape.
    assert header.dim_order == (g.chunk_order if impl.lossless else (0, 1, 2, 3, 4))
    assert header.shape == tuple(chunk.shape)
    decoded = decode(blob, expect_shape=chunk.shape, expect_dtype=chunk.dtype)
    same_format = g.empty_chunk(17)
    decode_into(blob, same_format)
    other_format = torch.empty(tuple(chunk.shape), dtype=chunk.dtype)
    decode_into(blob, other_format)
    assert torch.equal(decoded, same_format) and torch.equal(decoded, other_format)
    if impl.lossless:
        assert torch.equal(decoded, chunk)
        if layout == "cpu" and codec == "none":  # the body is the buffer's bytes, unpermuted
            physical = chunk.permute(g.chunk_order).contiguous()
            assert blob[header.header_length:] == physical.view(torch.uint8).numpy().tobytes()
    else:
        error = (decoded.double() - chunk.double()).abs()
        assert bool((error <= impl.max_error(chunk, impl.resolve_params())).all())


def test_version_1_payloads_still_decode_in_any_format():
    """A payload written before chunk format 2 (logical order, no order field) reads right into a
    chunk of the new format: the payload says its order, so it is never read as another."""
    kv = make_kv((3, 2, 17, 2, 16), torch.bfloat16)
    old = as_version_1(encode(kv, "zstd", level=3))
    header = read_header(old)
    assert (header.version, header.dim_order) == (1, (0, 1, 2, 3, 4))
    assert torch.equal(decode(old), kv)
    from flowkv.kernels import KVGeometry

    g = KVGeometry("cpu", 3, 2, 16, 16, torch.bfloat16)
    into = g.empty_chunk(17)
    decode_into(old, into)
    assert torch.equal(into, kv)


def test_rejects_a_dim_order_that_is_not_a_permutation():
    blob = bytearray(encode(chunk_in_engine_format()[1], "none"))
    order_at = 32 + 8 * 5
    blob[order_at:order_at + 5] = bytes([0, 0, 2, 1, 4])
    head_end = read_header(bytes(encode(make_kv(), "none"))).header_length  # same header length
    struct.pack_into("<Q", blob, head_end - 8, xxhash.xxh3_64_intdigest(bytes(blob[:head_end - 8])))
    with pytest.raises(PayloadError, match="dim order .* is not a permutation"):
        read_header(bytes(blob))


# -- version 3: the key digest and the option flags ------------------------------------


def with_raw_params(blob: bytes, params: bytes) -> bytes:
    """``blob`` with its codec parameters replaced by ``params`` (any bytes), re-signed as a forger would."""
    prefix = struct.Struct("<4sHHBBHIQQ")
    values = list(prefix.unpack_from(blob))
    header = read_header(blob)
    params_at = header.header_length - 8 - values[5]
    head = bytearray(blob[:params_at]) + params
    values[5], values[6] = len(params), len(head) + 8
    head[:prefix.size] = prefix.pack(*values)
    return bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head))) + blob[header.header_length:]


def test_a_payload_read_under_another_key_or_no_key_is_refused():
    kv = make_kv()
    blob = encode(kv, "zstd", key="model/chunk-a")
    assert read_header(blob).key_digest == payload.key_digest("model/chunk-a")
    assert torch.equal(decode(blob, expect_key="model/chunk-a"), kv)
    with pytest.raises(PayloadError, match="written for another key"):
        decode(blob, expect_key="model/chunk-b")
    with pytest.raises(PayloadError, match="written for another key"):
        payload.verify(blob, expect_key="model/chunk-b")
    unbound = encode(kv, "zstd")
    assert torch.equal(decode(unbound), kv)  # no key asked: read as before
    with pytest.raises(PayloadError, match="bound to no key"):
        decode(unbound, expect_key="model/chunk-a")
    with pytest.raises(PayloadError, match="bound to no key"):
        decode(as_version_1(encode(make_kv(), "none")), expect_key="model/chunk-a")


def test_a_segment_start_rides_in_the_options_and_an_unknown_option_is_refused():
    kv = make_kv()
    blob = encode(kv, "lz4", key="k", segment_start=4096)
    header = read_header(blob, expect_key="k")
    assert header.segment_start == 4096
    assert header.header_length == read_header(encode(kv, "lz4", key="k")).header_length + 8
    assert read_header(encode(kv, "lz4", key="k")).segment_start is None
    assert torch.equal(decode(blob, expect_key="k"), kv)
    # An option this flowkv does not know (a newer writer's): refused, never read without its field.
    head = bytearray(blob[:header.header_length - 8])
    options_at = 32 + 8 * kv.dim() + kv.dim() + 16
    struct.pack_into("<H", head, options_at, 0b101)
    forged = bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head))) + blob[header.header_length:]
    with pytest.raises(PayloadError, match="options 0x5 this flowkv does not know"):
        read_header(forged)
    with pytest.raises(ValueError, match="segment_start"):
        encode(kv, "none", segment_start=-1)


def dimension_major(key, value, key_cache, value_cache, slot_mapping, isa):
    """A cache-write op that packs as vLLM's ``vec`` kernels do: a block's keys channel by channel
    (all its tokens' channel 0, then channel 1, ...), its values token by token."""
    block_size, head_size = key_cache.shape[2], key_cache.shape[3]
    for row, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        key_cache[block].view(-1, head_size, block_size)[:, :, offset] = key[row]
        value_cache[block][:, offset] = value[row]


def packed_chunk(layout, num_tokens=16, layers=2, heads=2, seed=0):
    """True tokens with a few loud key channels (as trained keys have), and the chunk of whole packed
    blocks that gathering them out of an engine of ``layout`` gives."""
    gen = torch.Generator().manual_seed(seed)
    true = torch.randn(layers, 2, num_tokens, heads, layout.head_size, generator=gen)
    true[:, 0, :, :, ::4] *= 30  # key channels 0, 4, 8, ...
    true = true.to(layout.dtype)
    return true, layout.pack_chunk(true)


def test_a_lossy_codec_quantizes_the_true_tokens_of_packed_blocks_and_decode_packs_them_back():
    from flowkv.kernels import PackedBlockLayout

    layout = PackedBlockLayout.draw(dimension_major, isa="test", block_size=8, head_size=16, dtype=torch.bfloat16)
    true, chunk = packed_chunk(layout)
    assert layout.whole_blocks(chunk) and not torch.equal(layout.unpack_chunk(chunk), chunk)  # rows are not tokens
    codec = get_codec("int8")
    params = codec.resolve_params()
    bound = codec.max_error(true, params)  # per true key channel and value token

    blob = encode(chunk, "int8", key="k", packing=layout)
    assert read_header(blob).unpacked
    decoded = decode(blob, expect_key="k", expect_shape=chunk.shape, packing=layout)
    assert layout.whole_blocks(decoded)  # in the engine's chunk order, ready to scatter
    assert bool(((layout.unpack_chunk(decoded).double() - true.double()).abs() <= bound).all())
    into = torch.empty(2, 2, 16, 2, 16, dtype=torch.bfloat16).permute(0, 3, 2, 1, 4)
    assert decode_into(blob, into, packing=layout) is into and torch.equal(into, decoded)
    logical = torch.empty(chunk.shape, dtype=torch.bfloat16)  # not the engine's order: packed, then copied
    assert torch.equal(decode_into(blob, logical, packing=layout), decoded)
    # A reader without the table cannot put the tokens back: a miss, never packed bytes misread.
    for read in (lambda: decode(blob), lambda: decode_into(blob, into.clone())):
        with pytest.raises(PayloadError, match="knows no packing"):
            read()
    other = PackedBlockLayout.draw(dimension_major, isa="test", block_size=16, head_size=16, dtype=torch.bfloat16)
    with pytest.raises(PayloadError, match="does not fit this reader's packing"):
        decode(encode(*packed_chunk(layout, num_tokens=8)[1:], "int8", packing=layout), packing=other)

    # Quantizing the packed bytes as they lie (no table) breaks the per-channel bound: a loud key
    # channel shares its statistics with quiet ones.
    packed_way = layout.unpack_chunk(into.copy_(decode(encode(chunk, "int8"))))
    assert not bool(((packed_way.double() - true.double()).abs() <= bound).all())


def test_lossless_codecs_and_chunks_that_are_not_whole_blocks_keep_the_bytes_as_they_lie():
    from flowkv.kernels import PackedBlockLayout

    layout = PackedBlockLayout.draw(dimension_major, isa="test", block_size=8, head_size=16, dtype=torch.bfloat16)
    _, chunk = packed_chunk(layout)
    blob = encode(chunk, "zstd-shuffle", packing=layout)
    assert not read_header(blob).unpacked and torch.equal(decode(blob, packing=layout), chunk)
    part = chunk[:, :, :12]  # a block and a half: its rows hold tokens past it
    blob = encode(part, "int8", packing=layout)
    assert not read_header(blob).unpacked
    assert decode(blob, packing=layout).shape == part.shape


@pytest.mark.parametrize("params", [
    b"[" * 30_000 + b"]" * 30_000,  # nested past the parser's recursion limit
    b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    b'{"level": "fast"}',  # a wrong type
    b'{"level": 1e400}',  # inf
    b'{"level": [3]}',
    b"\xff\xfe",
])
def test_every_parse_error_of_stored_codec_parameters_is_a_payload_error(params):
    forged = with_raw_params(encode(make_kv(), "zstd", key="k"), params)
    for read in (read_header, payload.verify, decode):
        with pytest.raises(PayloadError):
            read(forged)
