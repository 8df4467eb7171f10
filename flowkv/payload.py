"""The payload format: a chunk's KV tensor as self-describing bytes.

Slow tiers (disk files, Redis) store payloads, never pickles. A payload is a
small header followed by the codec's body::

    offset  size      field
    0       4         magic b"FKVP"
    4       2         format version (1)
    6       2         codec id (see flowkv.codecs)
    8       1         dtype code (1 fp16, 2 bf16, 3 fp32, 4 fp8 e4m3fn, 5 fp8 e5m2, 6 uint8)
    9       1         ndim
    10      2         length P of the codec parameters
    12      4         header length H (all of the header, checksum included)
    16      8         body length B
    24      8         xxh3-64 of the body
    32      8*ndim    shape
    ..      P         codec parameters, canonical JSON (UTF-8, sorted keys)
    H-8     8         xxh3-64 of header bytes [0, H-8)
    H       B         body

All integers are little-endian; the body holds tensor bytes in the
machine's (little-endian) order. The header checksum is checked before any
header field past the version is trusted, and the body checksum before the
codec runs, so corrupt data raises `PayloadError` instead of decoding.

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

import json
import struct
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import xxhash

from flowkv import codecs as _codecs

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MIN_HEADER_SIZE",
    "PayloadError",
    "PayloadHeader",
    "decode",
    "decode_into",
    "encode",
    "read_header",
    "verify",
]

MAGIC = b"FKVP"
FORMAT_VERSION = 1

# magic, version, codec id, dtype code, ndim, params length, header length,
# body length, body checksum
_PREFIX = struct.Struct("<4sHHBBHIQQ")
_CHECKSUM = struct.Struct("<Q")
#: Bytes a reader must have to learn the full header length (field at offset 12).
MIN_HEADER_SIZE = _PREFIX.size + _CHECKSUM.size
_MAX_NDIM = 16

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


def _checksum(data: Any) -> int:
    # xxh3 runs ~28 GB/s here against ~10 GB/s for xxh64: a payload is
    # checked on every read from a slow tier, so the faster one.
    return xxhash.xxh3_64_intdigest(data)


class PayloadError(ValueError):
    """A payload cannot be decoded: corrupt, truncated, foreign or not the expected one."""


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


def encode(tensor: torch.Tensor, codec: str = "none", **codec_params: Any) -> bytes:
    """Encode `tensor` as a payload with the named codec and its parameters.

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
    body = _codecs._as_bytes(impl.encode(tensor, params))
    params_json = json.dumps(impl.params_to_header(params), sort_keys=True, separators=(",", ":")).encode()
    if len(params_json) > 0xFFFF:
        raise ValueError(f"codec {codec!r} parameters take {len(params_json)} bytes in the header, at most 65535")
    shape = tuple(tensor.shape)
    header_length = _PREFIX.size + 8 * len(shape) + len(params_json) + _CHECKSUM.size
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
        + params_json
    )
    # bytes + buffer concatenates in one copy of the body.
    return head + _CHECKSUM.pack(_checksum(head)) + body


def read_header(blob: bytes | bytearray | memoryview) -> PayloadHeader:
    """Parse and verify a payload's header; the body need not be present.

    Raises PayloadError for wrong magic, an unknown version, codec or dtype,
    a header checksum mismatch, or too few bytes for the header.
    """
    view = _flat_bytes(blob)
    if len(view) < 6:
        raise PayloadError(f"payload truncated: {len(view)} bytes, a header needs at least {MIN_HEADER_SIZE}")
    if bytes(view[:4]) != MAGIC:
        raise PayloadError(f"not a flowkv payload: magic {bytes(view[:4])!r}, expected {MAGIC!r}")
    version = int.from_bytes(view[4:6], "little")
    if version != FORMAT_VERSION:
        raise PayloadError(f"unsupported payload format version {version} (this flowkv reads {FORMAT_VERSION})")
    if len(view) < MIN_HEADER_SIZE:
        raise PayloadError(f"payload truncated: {len(view)} bytes, a header needs at least {MIN_HEADER_SIZE}")
    _, _, codec_id, dtype_code, ndim, params_len, header_length, body_length, body_checksum = _PREFIX.unpack_from(view)
    if header_length != _PREFIX.size + 8 * ndim + params_len + _CHECKSUM.size:
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
    params_at = _PREFIX.size + 8 * ndim
    try:
        params = json.loads(bytes(view[params_at : params_at + params_len]))
    except ValueError as exc:
        raise PayloadError(f"payload codec parameters are not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise PayloadError(f"payload codec parameters are not a JSON object: {params!r}")
    return PayloadHeader(
        version=version,
        codec=impl.name,
        codec_params=params,
        dtype=dtype,
        shape=shape,
        body_length=body_length,
        body_checksum=body_checksum,
        header_length=header_length,
    )


def _checked(
    blob: Any,
    expect_codec: str | None,
    expect_shape: Sequence[int] | None,
    expect_dtype: torch.dtype | None,
) -> tuple[PayloadHeader, memoryview]:
    """Header and body of a payload whose checksums and expectations hold."""
    view = _flat_bytes(blob)
    header = read_header(view)
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


def verify(blob: bytes | bytearray | memoryview) -> PayloadHeader:
    """Check a whole payload (header, length, body checksum) without decoding it."""
    header, _ = _checked(blob, None, None, None)
    return header


def decode(
    blob: bytes | bytearray | memoryview,
    *,
    expect_shape: Sequence[int] | None = None,
    expect_dtype: torch.dtype | None = None,
    expect_codec: str | None = None,
) -> torch.Tensor:
    """Decode a payload into a new CPU tensor.

    With `expect_shape`, `expect_dtype` or `expect_codec` given, a payload
    holding anything else is rejected. Raises PayloadError for any problem
    with the bytes; never returns data that failed a check.
    """
    header, body = _checked(blob, expect_codec, expect_shape, expect_dtype)
    impl = _codecs.get_codec(header.codec)
    try:
        params = impl.params_from_header(header.codec_params)
        tensor = impl.decode(body, header.shape, header.dtype, params)
    except (ValueError, RuntimeError) as exc:
        raise PayloadError(f"codec {header.codec!r} failed to decode the payload: {exc}") from exc
    if tuple(tensor.shape) != header.shape or tensor.dtype != header.dtype:
        raise PayloadError(
            f"codec {header.codec!r} decoded {tuple(tensor.shape)} {tensor.dtype}, "
            f"the header says {header.shape} {header.dtype}"
        )
    return tensor


def decode_into(
    blob: bytes | bytearray | memoryview,
    out: torch.Tensor,
    *,
    expect_codec: str | None = None,
) -> torch.Tensor:
    """Decode a payload into the preallocated `out` and return it.

    `out` must have the payload's shape and dtype. A contiguous CPU `out` is
    written in place by the codec (no intermediate tensor for ``none`` and
    ``zstd``); a lossy codec dequantizes on `out`'s device; other cases
    decode on the CPU and copy. On any error `out` may hold partial data.
    """
    header, body = _checked(blob, expect_codec, tuple(out.shape), out.dtype)
    impl = _codecs.get_codec(header.codec)
    try:
        params = impl.params_from_header(header.codec_params)
        if out.is_contiguous() and (out.device.type == "cpu" or not impl.lossless):
            impl.decode_into(body, params, out)
        else:
            out.copy_(impl.decode(body, header.shape, header.dtype, params))
    except (ValueError, RuntimeError) as exc:
        raise PayloadError(f"codec {header.codec!r} failed to decode the payload: {exc}") from exc
    return out
