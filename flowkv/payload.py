"""The payload format: a chunk's KV tensor as self-describing bytes.

Slow tiers (disk files, Redis) store payloads, never pickles. A payload is a
small header followed by the codec's body::

    offset  size      field
    0       4         magic b"FKVP"
    4       2         format version (3; versions 1 and 2 are read too)
    6       2         codec id (see flowkv.codecs)
    8       1         dtype code (1 fp16, 2 bf16, 3 fp32, 4 fp8 e4m3fn, 5 fp8 e5m2, 6 uint8)
    9       1         ndim
    10      2         length P of the codec parameters
    12      4         header length H (all of the header, checksum included)
    16      8         body length B
    24      8         xxh3-64 of the body
    32      8*ndim    shape
    ..      ndim      dim order of the body (versions 2 and 3; see below)
    ..      16        key digest: BLAKE2b-128 of the chunk's key (version 3; zeros: bound to no key)
    ..      2         option flags (version 3): bit 0 = a segment start follows; bit 1 = the body holds
                      the chunk's true tokens, unpacked from an engine's packed blocks; other bits must be 0
    ..      8         segment start position, u64 (version 3, only with flag bit 0; CacheBlend)
    ..      P         codec parameters, canonical JSON (UTF-8, sorted keys)
    H-8     8         xxh3-64 of header bytes [0, H-8)
    H       B         body

All integers are little-endian; the body holds tensor bytes in the
machine's (little-endian) order. The header checksum is checked before any
header field past the version is trusted, and the body checksum before the
codec runs, so corrupt data raises `PayloadError` instead of decoding.

**Dim order (version 2).** The shape is always the tensor's (for a chunk,
the logical ``(layers, kv, tokens, heads, head_size)``). A lossless codec
encodes the tensor's elements in the order its buffer holds them — a chunk in
its engine's format (`flowkv.kernels.KVGeometry.chunk_order`) is encoded
without a permuting copy — and the header names that order: the dims,
outermost first. A lossy codec sees the tensor in its own shape and writes
the identity order. Decoding lays the values out the same way again (into a
buffer of that order, or into ``out`` with a permuting copy when ``out`` is in
another order), so a payload can never be read in the wrong order. Version
1 payloads (written before chunk format 2) have no order field: their body
is in the shape's own order.

**Key digest (version 3).** A payload names the key it was written for, so
one copied, moved or planted under another key (a disk file renamed, a
Redis value set under another name) is refused like a corrupt one: a reader
that passes ``expect_key`` accepts only a version-3 payload whose digest is
its key's. The digest is no secret (anyone may compute it): it ties a
payload to its key, it does not say who wrote it. The option flags leave
room for fields a later feature adds to the same header (the segment start
position of a CacheBlend segment is the first); a reader refuses a flag it
does not know, so a payload is never read without a field its writer
meant.

**Unpacked tokens (option bit 1).** vLLM's CPU cache packs the tokens of a
block together (a row of it is not one token), so a chunk gathered as whole
blocks holds packed interiors. A lossy codec quantizes per key channel and
per token, so `encode` given the engine's packing (`flowkv.kernels.PackedBlockLayout`,
drawn from the engine's own cache-write op) hands the codec the chunk's true
tokens instead and sets this bit; `decode` packs them back through the
reader's table, and refuses such a payload when it has none. Lossless
codecs, and chunks that are not whole blocks, keep the engine's bytes as
they are (bit clear), so an older payload decodes as it always did.

Every way a stored payload can fail to parse — a checksum, a length, the
codec parameters' JSON (deep nesting included) or their types — raises
`PayloadError`; tiers count it as corrupt and drop the entry.

Example::

    >>> import torch
    >>> from flowkv import payload
    >>> kv = torch.randn(2, 2, 16, 4, 8).half()
    >>> blob = payload.encode(kv, "zstd", level=5)
    >>> payload.read_header(blob).codec_params["level"]
    5
    >>> torch.equal(payload.decode(blob, expect_shape=kv.shape, expect_dtype=torch.float16), kv)
    True
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import xxhash

from flowkv import codecs as _codecs

if TYPE_CHECKING:
    from flowkv.kernels import PackedBlockLayout

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "READABLE_VERSIONS",
    "MIN_HEADER_SIZE",
    "PayloadError",
    "PayloadHeader",
    "decode",
    "decode_into",
    "encode",
    "key_digest",
    "read_header",
    "verify",
]

MAGIC = b"FKVP"
FORMAT_VERSION = 3
#: Versions this flowkv reads.
READABLE_VERSIONS = (1, 2, 3)

# magic, version, codec id, dtype code, ndim, params length, header length,
# body length, body checksum
_PREFIX = struct.Struct("<4sHHBBHIQQ")
_CHECKSUM = struct.Struct("<Q")
#: Bytes a reader must have to learn the full header length (field at offset 12).
MIN_HEADER_SIZE = _PREFIX.size + _CHECKSUM.size
_MAX_NDIM = 16
_DIGEST_BYTES = 16
_UNBOUND = bytes(_DIGEST_BYTES)
_OPTIONS = struct.Struct("<H")
_SEGMENT_START = 1  # option flag: a u64 segment start position follows
_UNPACKED = 2  # option flag: the body is the chunk's true tokens, to be packed into the reader's blocks
_KNOWN_OPTIONS = _SEGMENT_START | _UNPACKED

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.uint8: 6,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts run vLLM
    raise ImportError("flowkv payloads are little-endian; this host is big-endian")


# What a codec may raise on a body or parameters that passed the checksums but not its own rules.
_DECODE_ERRORS = (ValueError, RuntimeError, TypeError, KeyError, ArithmeticError, RecursionError)


def _checksum(data: Any) -> int:
    # xxh3 runs ~28 GB/s here against ~10 GB/s for xxh64: a payload is
    # checked on every read from a slow tier, so the faster one.
    return xxhash.xxh3_64_intdigest(data)


class PayloadError(ValueError):
    """A payload cannot be decoded: corrupt, truncated, foreign or not the expected one."""


def key_digest(key: str) -> bytes:
    """The 16 bytes a version-3 payload carries for ``key`` (BLAKE2b-128 of its UTF-8)."""
    return hashlib.blake2b(key.encode(), digest_size=_DIGEST_BYTES).digest()


@attrs.frozen
class PayloadHeader:
    """What a payload's header says, after its checksum was verified."""

    #: Payload format version.
    version: int
    #: Name of the codec that wrote the body.
    codec: str
    #: The codec's parameters, as stored (read-only mapping).
    codec_params: Mapping[str, Any] = attrs.field(converter=lambda p: types.MappingProxyType(dict(p)))
    #: dtype of the decoded tensor.
    dtype: torch.dtype
    #: shape of the decoded tensor.
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    #: Length of the body in bytes.
    body_length: int
    #: xxh3-64 of the body.
    body_checksum: int
    #: Length of the header in bytes; the body starts here.
    header_length: int
    #: The order of the body's dims, outermost first (identity: the shape's own order).
    dim_order: tuple[int, ...] = attrs.field(converter=tuple, default=())
    #: BLAKE2b-128 of the key it was written for (empty: version 1 or 2; zeros: written for no key).
    key_digest: bytes = b""
    #: Where the tokens of a CacheBlend segment started in the prompt it was stored from (None: not a segment).
    segment_start: int | None = None
    #: The body holds the chunk's true tokens, unpacked from its writer's packed blocks (option bit 1).
    unpacked: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.dim_order:
            object.__setattr__(self, "dim_order", tuple(range(len(self.shape))))

    @property
    def body_shape(self) -> tuple[int, ...]:
        """The shape in the body's dim order."""
        return tuple(self.shape[d] for d in self.dim_order)

    @property
    def payload_length(self) -> int:
        """Header plus body: the whole payload's size in bytes."""
        return self.header_length + self.body_length

    @property
    def nbytes(self) -> int:
        """Size of the decoded tensor in bytes."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


def _flat_bytes(blob: Any) -> memoryview:
    try:
        view = memoryview(blob)
    except TypeError:
        raise PayloadError(f"a payload is bytes-like, got {type(blob).__name__}") from None
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise PayloadError("a payload buffer must be contiguous")
        view = view.cast("B")
    return view


def _identity(ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim))


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    order = tuple(order)
    return tuple(order.index(d) for d in range(len(order)))


def _buffer_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The order in which a dense tensor's buffer holds its dims (identity when it is
    contiguous, or not dense at all: then it is copied into that order)."""
    if tensor.dim() == 0 or tensor.is_contiguous():
        return _identity(tensor.dim())
    # Size-1 dims can sit anywhere; keep them in place to break ties.
    order = tuple(sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d) if tensor.shape[d] > 1 else 0, d)))
    return order if tensor.permute(order).is_contiguous() else _identity(tensor.dim())


def encode(tensor: torch.Tensor, codec: str = "none", *, key: str | None = None, segment_start: int | None = None,
           packing: PackedBlockLayout | None = None, **codec_params: Any) -> bytes:
    """Encode `tensor` as a payload with the named codec and its parameters.

    ``key`` binds the payload to the chunk key it is stored under (tiers
    refuse it under any other); ``segment_start`` records a CacheBlend
    segment's start position. ``packing`` is how the engine packs tokens
    inside its blocks: a lossy codec then encodes the chunk's true tokens
    (see "Unpacked tokens" above), when the chunk is whole blocks of it.

    A lossless codec encodes the elements in the order the tensor's buffer
    holds them (the header names it), so a chunk in its engine's format is
    not permuted; a lossy codec encodes the tensor in its own shape.

    Raises ValueError for an unknown codec or parameter, a dtype the format
    does not carry, or a tensor the codec cannot encode (lossy codecs need a
    float chunk tensor of shape (num_layers, kv, num_tokens, heads, head_size)).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"encode takes a torch.Tensor, got {type(tensor).__name__}")
    dtype_code = _DTYPE_CODES.get(tensor.dtype)
    if dtype_code is None:
        supported = ", ".join(str(d) for d in _DTYPE_CODES)
        raise ValueError(f"payloads carry {supported}; not {tensor.dtype}")
    if tensor.dim() > _MAX_NDIM:
        raise ValueError(f"payloads carry at most {_MAX_NDIM} dimensions, got {tensor.dim()}")
    impl = _codecs.get_codec(codec)
    params = impl.resolve_params(**codec_params)
    impl.check_tensor(tensor)
    tensor, options = _codec_input(tensor, impl, packing)
    extra = b""
    order = _buffer_order(tensor) if impl.lossless else _identity(tensor.dim())
    body = _codecs._as_bytes(impl.encode(tensor.permute(order) if tensor.dim() else tensor, params))
    params_json = json.dumps(impl.params_to_header(params), sort_keys=True, separators=(",", ":")).encode()
    if len(params_json) > 0xFFFF:
        raise ValueError(f"codec {codec!r} parameters take {len(params_json)} bytes in the header, at most 65535")
    shape = tuple(tensor.shape)
    if segment_start is not None:
        if not 0 <= segment_start < 1 << 64:
            raise ValueError(f"segment_start must be a position from 0, got {segment_start!r}")
        options, extra = options | _SEGMENT_START, extra + struct.pack("<Q", segment_start)
    digest = key_digest(key) if key is not None else _UNBOUND
    header_length = (_PREFIX.size + 9 * len(shape) + _DIGEST_BYTES + _OPTIONS.size + len(extra) + len(params_json)
                     + _CHECKSUM.size)
    head = (
        _PREFIX.pack(
            MAGIC,
            FORMAT_VERSION,
            impl.codec_id,
            dtype_code,
            len(shape),
            len(params_json),
            header_length,
            len(body),
            _checksum(body),
        )
        + struct.pack(f"<{len(shape)}Q", *shape)
        + bytes(order)
        + digest
        + _OPTIONS.pack(options)
        + extra
        + params_json
    )
    # bytes + buffer concatenates in one copy of the body.
    return head + _CHECKSUM.pack(_checksum(head)) + body


def _codec_input(tensor: torch.Tensor, impl: _codecs.Codec,
                 packing: PackedBlockLayout | None) -> tuple[torch.Tensor, int]:
    """What the codec encodes, and the option flags that say so: a lossy codec gets the true tokens
    of a chunk of whole packed blocks (option bit 1), anything else the tensor as it is."""
    if packing is not None and not impl.lossless and packing.whole_blocks(tensor):
        return packing.unpack_chunk(tensor), _UNPACKED
    return tensor, 0


def read_header(blob: bytes | bytearray | memoryview, *, expect_key: str | None = None) -> PayloadHeader:
    """Parse and verify a payload's header; the body need not be present.

    Raises PayloadError for wrong magic, an unknown version, codec, dtype or
    option, a header checksum mismatch, codec parameters that do not parse
    or validate, too few bytes for the header, or — with ``expect_key`` — a
    payload not written for that key.
    """
    view = _flat_bytes(blob)
    if len(view) < 6:
        raise PayloadError(f"payload truncated: {len(view)} bytes, a header needs at least {MIN_HEADER_SIZE}")
    if bytes(view[:4]) != MAGIC:
        raise PayloadError(f"not a flowkv payload: magic {bytes(view[:4])!r}, expected {MAGIC!r}")
    version = int.from_bytes(view[4:6], "little")
    if version not in READABLE_VERSIONS:
        raise PayloadError(f"unsupported payload format version {version} "
                           f"(this flowkv reads {', '.join(map(str, READABLE_VERSIONS[:-1]))} and "
                           f"{READABLE_VERSIONS[-1]})")
    if len(view) < MIN_HEADER_SIZE:
        raise PayloadError(f"payload truncated: {len(view)} bytes, a header needs at least {MIN_HEADER_SIZE}")
    _, _, codec_id, dtype_code, ndim, params_len, header_length, body_length, body_checksum = _PREFIX.unpack_from(view)
    order_len = ndim if version >= 2 else 0
    keyed_len = _DIGEST_BYTES + _OPTIONS.size if version >= 3 else 0
    fixed = _PREFIX.size + 8 * ndim + order_len + keyed_len + params_len + _CHECKSUM.size
    # The options' fields come before the checksum is checked only as a length: checked again after it.
    if not fixed <= header_length <= fixed + 8 * 16 or (header_length - fixed) % 8 or (
            not keyed_len and header_length != fixed):
        raise PayloadError(
            f"corrupt payload header: header length {header_length} does not match "
            f"ndim {ndim} and parameter length {params_len}"
        )
    if len(view) < header_length:
        raise PayloadError(f"payload truncated: {len(view)} bytes, its header alone is {header_length}")
    (stored,) = _CHECKSUM.unpack_from(view, header_length - _CHECKSUM.size)
    if _checksum(view[: header_length - _CHECKSUM.size]) != stored:
        raise PayloadError("corrupt payload header: header checksum mismatch")
    # From here on the fields are what the writer wrote.
    try:
        impl = _codecs.codec_by_id(codec_id)
    except _codecs.UnknownCodecError as exc:
        raise PayloadError(f"payload written with {exc}") from None
    dtype = _CODE_DTYPES.get(dtype_code)
    if dtype is None:
        raise PayloadError(f"payload has unknown dtype code {dtype_code}")
    shape = struct.unpack_from(f"<{ndim}Q", view, _PREFIX.size)
    order_at = _PREFIX.size + 8 * ndim
    order = tuple(view[order_at:order_at + order_len]) if order_len else _identity(ndim)
    if sorted(order) != list(range(ndim)):
        raise PayloadError(f"corrupt payload header: dim order {order} is not a permutation of {ndim} dims")
    digest, segment_start, options = b"", None, 0
    params_at = order_at + order_len
    if keyed_len:
        digest = bytes(view[params_at:params_at + _DIGEST_BYTES])
        (options,) = _OPTIONS.unpack_from(view, params_at + _DIGEST_BYTES)
        params_at += keyed_len
        if options & ~_KNOWN_OPTIONS:
            raise PayloadError(f"payload has options {options:#x} this flowkv does not know (a newer writer)")
        if header_length != fixed + (8 if options & _SEGMENT_START else 0):
            raise PayloadError(f"corrupt payload header: header length {header_length} does not match its options")
        if options & _SEGMENT_START:
            (segment_start,) = struct.unpack_from("<Q", view, params_at)
            params_at += 8
    if expect_key is not None and digest != key_digest(expect_key):
        why = "bound to no key" if digest in (b"", _UNBOUND) else "written for another key"
        raise PayloadError(f"payload {why}, read as {expect_key[:80]!r}: refused")
    try:
        params = json.loads(bytes(view[params_at : params_at + params_len]))
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        raise PayloadError(f"payload codec parameters are not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(params, dict):
        raise PayloadError(f"payload codec parameters are not a JSON object: {str(params)[:80]}")
    try:
        impl.params_from_header(params)  # wrong types or names: corrupt now, not when a decode meets them
    except (ValueError, TypeError, KeyError, ArithmeticError, RecursionError) as exc:
        raise PayloadError(f"payload codec parameters do not validate: {str(exc)[:200]}") from None
    return PayloadHeader(
        version=version,
        codec=impl.name,
        codec_params=params,
        dtype=dtype,
        shape=shape,
        body_length=body_length,
        body_checksum=body_checksum,
        header_length=header_length,
        dim_order=order,
        key_digest=digest,
        segment_start=segment_start,
        unpacked=bool(options & _UNPACKED),
    )


def _checked(
    blob: Any,
    expect_codec: str | None,
    expect_shape: Sequence[int] | None,
    expect_dtype: torch.dtype | None,
    expect_key: str | None = None,
) -> tuple[PayloadHeader, memoryview]:
    """Header and body of a payload whose checksums and expectations hold."""
    view = _flat_bytes(blob)
    header = read_header(view, expect_key=expect_key)
    if expect_codec is not None and header.codec != expect_codec:
        raise PayloadError(f"payload was written with codec {header.codec!r}, expected {expect_codec!r}")
    if expect_shape is not None and header.shape != tuple(expect_shape):
        raise PayloadError(f"payload holds shape {header.shape}, expected {tuple(expect_shape)}")
    if expect_dtype is not None and header.dtype != expect_dtype:
        raise PayloadError(f"payload holds dtype {header.dtype}, expected {expect_dtype}")
    end = header.payload_length
    if len(view) < end:
        raise PayloadError(f"payload truncated: {len(view)} bytes of {end} (body {header.body_length})")
    if len(view) > end:
        raise PayloadError(f"payload has {len(view) - end} bytes after its body: {len(view)} bytes, header says {end}")
    body = view[header.header_length : end]
    if _checksum(body) != header.body_checksum:
        raise PayloadError(f"corrupt payload body: checksum mismatch ({header.body_length} bytes, codec {header.codec!r})")
    return header, body


def verify(blob: bytes | bytearray | memoryview, *, expect_key: str | None = None) -> PayloadHeader:
    """Check a whole payload (header, length, body checksum; with ``expect_key``, its key) without decoding it."""
    header, _ = _checked(blob, None, None, None, expect_key)
    return header


def decode(
    blob: bytes | bytearray | memoryview,
    *,
    expect_shape: Sequence[int] | None = None,
    expect_dtype: torch.dtype | None = None,
    expect_codec: str | None = None,
    expect_key: str | None = None,
    packing: PackedBlockLayout | None = None,
) -> torch.Tensor:
    """Decode a payload into a new CPU tensor.

    With `expect_shape`, `expect_dtype`, `expect_codec` or `expect_key`
    given, a payload holding anything else is rejected. A payload of
    unpacked tokens comes back packed through ``packing`` (the reader's
    engine's), in the ``cpu`` layout's chunk order. Raises PayloadError
    for any problem with the bytes; never returns data that failed a check.
    """
    header, body = _checked(blob, expect_codec, expect_shape, expect_dtype, expect_key)
    _check_packing(header, packing)
    tensor = _decoded(header, body)
    return _packed(tensor, packing, None) if header.unpacked else tensor


def _decoded(header: PayloadHeader, body: memoryview) -> torch.Tensor:
    """The body decoded into a new tensor of the header's shape (its values in the body's order)."""
    impl = _codecs.get_codec(header.codec)
    try:
        params = impl.params_from_header(header.codec_params)
        tensor = impl.decode(body, header.body_shape, header.dtype, params)
    except _DECODE_ERRORS as exc:
        raise PayloadError(f"codec {header.codec!r} failed to decode the payload: {exc}") from exc
    if tuple(tensor.shape) != header.body_shape or tensor.dtype != header.dtype:
        raise PayloadError(
            f"codec {header.codec!r} decoded {tuple(tensor.shape)} {tensor.dtype}, "
            f"the header says {header.body_shape} {header.dtype}"
        )
    # Seen in the header's shape (no copy).
    return tensor.permute(_inverse(header.dim_order)) if tensor.dim() else tensor


def _check_packing(header: PayloadHeader, packing: PackedBlockLayout | None) -> None:
    if header.unpacked and packing is None:
        raise PayloadError("payload holds the true tokens of an engine that packs its blocks, and this reader "
                           "knows no packing to put them back in")


def _packed(tokens: torch.Tensor, packing: PackedBlockLayout, out: torch.Tensor | None) -> torch.Tensor:
    """Unpacked ``tokens`` packed through ``packing`` (into ``out`` when it is whole blocks of it)."""
    try:
        return packing.pack_chunk(tokens, out if out is not None and packing.whole_blocks(out) else None)
    except (ValueError, RuntimeError) as exc:
        raise PayloadError(f"payload of unpacked tokens does not fit this reader's packing: {exc}") from exc


def decode_into(
    blob: bytes | bytearray | memoryview,
    out: torch.Tensor,
    *,
    expect_codec: str | None = None,
    expect_key: str | None = None,
    packing: PackedBlockLayout | None = None,
) -> torch.Tensor:
    """Decode a payload into the preallocated `out` and return it.

    `out` must have the payload's shape and dtype. A CPU `out` whose buffer
    holds its dims in the payload's dim order (contiguous, for a payload in
    the shape's own order; a chunk in its engine's format, for a chunk
    payload of that engine) is written in place by the codec (no intermediate
    tensor for ``none`` and ``zstd``); a lossy codec dequantizes on `out`'s
    device; other cases decode on the CPU and copy. A payload of unpacked
    tokens is packed through ``packing`` (see `decode`). On any error `out`
    may hold partial data.
    """
    header, body = _checked(blob, expect_codec, tuple(out.shape), out.dtype, expect_key)
    _check_packing(header, packing)
    impl = _codecs.get_codec(header.codec)
    if header.unpacked:
        packed = _packed(_decoded(header, body), packing, out)
        if packed is not out:
            out.copy_(packed)
        return out
    try:
        params = impl.params_from_header(header.codec_params)
        target = out.permute(header.dim_order) if out.dim() else out
        if target.is_contiguous() and (out.device.type == "cpu" or not impl.lossless):
            impl.decode_into(body, params, target)
        else:
            out.copy_(impl.decode(body, header.body_shape, header.dtype, params).permute(_inverse(header.dim_order))
                      if out.dim() else impl.decode(body, header.shape, header.dtype, params))
    except _DECODE_ERRORS as exc:
        raise PayloadError(f"codec {header.codec!r} failed to decode the payload: {exc}") from exc
    return out
