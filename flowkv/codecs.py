"""Codecs: how a chunk's KV tensor becomes a payload body, and back.

A codec turns one KV tensor into a body (bytes) and a body back into a
tensor of the same shape and dtype. `flowkv.payload` wraps the body in a
header that names the codec by its numeric id and stores the codec's
parameters, so a payload decodes without out-of-band knowledge. Codecs take
any strided tensor of the chunk's logical shape, contiguous or not.

Built-in codecs:

=============== ===== ========= ==========================================
name            id    lossless  what
=============== ===== ========= ==========================================
``none``        0     yes       the raw bytes
``lz4``         1     yes       LZ4 block (fast)
``lz4-shuffle`` 2     yes       byte planes (high bytes apart from low), LZ4
``zstd``        3     yes       Zstandard, ``level`` (default 3)
``zstd-shuffle``4     yes       byte planes, then Zstandard
``fp8``         16    no        float8 e4m3, fp32 scales per token or group,
                                or per key channel (``scaling``)
``int8``        17    no        KIVI-style: keys per channel, values per token
``int4``        18    no        as ``int8``, 4 bits, two values per byte
=============== ===== ========= ==========================================

Lossy codecs see the chunk layout ``(num_layers, kv, num_tokens,
num_kv_heads, head_size)``: with ``kv == 2`` index 0 of dim 1 is keys and
index 1 values; with ``kv == 1`` (MLA) the single latent is treated as values.
Each lossy codec states its error bound as a formula (``error_bound``) and
computes it per element (`Codec.max_error`), which the tests check against
an independent float64 quantizer. Every lossy codec takes ``window``: the
chunk's last ``window`` tokens stay exact. In a pipeline, the ``compress``
stage's ``window`` means the last tokens of each stored prefix, and
`prefix_window` gives each chunk its share.

Body layouts are versioned by the header's parameters: a parameter added
after its codec shipped is written to the header only when it differs from
its default, and its default keeps the earlier layout. Payloads written
before it existed decode unchanged; a flowkv that predates it refuses such a
payload (an unknown parameter: a miss) rather than misread it.

Ids 0-1023 are reserved for built-ins; a codec from another package
registers with `register_codec` and an id of 1024 or more.

Example::

    >>> import torch
    >>> from flowkv.codecs import get_codec
    >>> codec = get_codec("zstd")
    >>> params = codec.resolve_params(level=5)
    >>> kv = torch.zeros(2, 2, 16, 4, 8, dtype=torch.float16)
    >>> body = codec.encode(kv, params)
    >>> torch.equal(codec.decode(memoryview(body), kv.shape, kv.dtype, params), kv)
    True
"""

from __future__ import annotations

import abc
import difflib
import math
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import lz4.block
import numpy as np
import torch
import zstandard

__all__ = [
    "Codec",
    "CodecDataError",
    "UnknownCodecError",
    "codec_by_id",
    "codec_names",
    "get_codec",
    "register_codec",
]

# Dtypes any codec may carry; lossy codecs accept only the float ones.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Unit roundoff of the dtype a lossy codec writes back into, and half its
# smallest subnormal: rounding an fp32 result into it adds at most
# `u * |y| + tiny`.
_ROUNDOFF = {
    torch.float16: (2.0**-11, 2.0**-25),
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float32: (2.0**-24, 2.0**-150),
}

_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


class CodecDataError(ValueError):
    """A body does not decode: wrong size, bad compressed stream, bad params."""


class UnknownCodecError(ValueError):
    """No codec is registered under the asked name or id."""


def _as_bytes(buf: Any) -> memoryview:
    """A flat, byte-format memoryview over `buf` without copying."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _byte_view(kv: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 numpy array (CPU, no copy if contiguous)."""
    kv = kv.detach()
    if kv.device.type != "cpu":
        kv = kv.cpu()
    # view(uint8) needs a contiguous tensor; reshape(-1) copies only if not.
    return kv.contiguous().reshape(-1).view(torch.uint8).numpy()


def _tensor_from_body(body: memoryview, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """`count` elements of `dtype` from `body` at byte `offset`.

    A writable buffer is viewed in place; a read-only one (``bytes``) is
    copied once, since torch refuses to alias memory it may not write.
    """
    nbytes = count * dtype.itemsize
    if offset + nbytes > len(body):
        raise CodecDataError(f"body too short: needs {offset + nbytes} bytes, has {len(body)}")
    if count == 0:
        return torch.empty(0, dtype=dtype)
    section = body[offset : offset + nbytes]
    if section.readonly:
        flat = torch.empty(nbytes, dtype=torch.uint8)
        flat.numpy()[:] = np.frombuffer(section, dtype=np.uint8)
        return flat.view(dtype)
    return torch.frombuffer(section, dtype=torch.uint8).view(dtype)


def _check_body_size(codec: str, body: memoryview, expected: int) -> None:
    if len(body) != expected:
        raise CodecDataError(f"{codec} body is {len(body)} bytes, the header's shape needs {expected}")


@attrs.frozen
class NoParams:
    """Codec without parameters."""


class Codec(abc.ABC):
    """One way to encode a KV tensor into a payload body.

    Subclasses set the class attributes and implement `encode` and
    `decode_into`; `decode` defaults to allocating and calling `decode_into`.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossless: ClassVar[bool]
    #: The error bound in words; "exact" for lossless codecs.
    error_bound: ClassVar[str] = "exact (bitwise)"
    #: attrs class of the codec's parameters; all of them go into the header.
    Params: ClassVar[type] = NoParams

    # -- parameters -------------------------------------------------------
    def resolve_params(self, **params: Any) -> Any:
        """Validate keyword parameters and fill in defaults.

        Raises ValueError naming unknown parameters and the accepted ones.
        """
        known = [f.name for f in attrs.fields(self.Params)]
        unknown = sorted(set(params) - set(known))
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            accepted = ", ".join(known) if known else "none"
            raise ValueError(f"codec {self.name!r} has no parameter {', '.join(hints)}; it accepts: {accepted}")
        try:
            return self.Params(**params)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"codec {self.name!r}: {exc}") from exc

    def params_to_header(self, params: Any) -> dict[str, Any]:
        """The parameters as a JSON-able mapping for the payload header.

        Parameters added after a codec first shipped are left out while they
        have their default (see ``_HEADER_OMITS_DEFAULT``).
        """
        return {
            field.name: getattr(params, field.name)
            for field in attrs.fields(type(params))
            if not (field.metadata.get("header_omits_default") and getattr(params, field.name) == field.default)
        }

    def params_from_header(self, stored: Mapping[str, Any]) -> Any:
        """Rebuild parameters from a header; raises CodecDataError if they do not validate."""
        try:
            return self.resolve_params(**dict(stored))
        except ValueError as exc:
            raise CodecDataError(f"stored parameters do not validate: {exc}") from exc

    # -- tensors ----------------------------------------------------------
    def check_tensor(self, kv: torch.Tensor) -> None:
        """Raise ValueError if this codec cannot encode `kv`."""

    @abc.abstractmethod
    def encode(self, kv: torch.Tensor, params: Any) -> Any:
        """Encode `kv` into a body: any object exposing the buffer protocol."""

    def decode(self, body: memoryview, shape: tuple[int, ...], dtype: torch.dtype, params: Any) -> torch.Tensor:
        """Decode `body` into a new CPU tensor of `shape` and `dtype`."""
        out = torch.empty(shape, dtype=dtype)
        self.decode_into(body, params, out)
        return out

    @abc.abstractmethod
    def decode_into(self, body: memoryview, params: Any, out: torch.Tensor) -> None:
        """Decode `body` into `out`, a contiguous tensor of the payload's shape and dtype."""

    def max_error(self, kv: torch.Tensor, params: Any) -> torch.Tensor | None:
        """Per-element bound on |decoded - kv| (float64), or None when exact."""
        return None

    def __repr__(self) -> str:
        return f"<codec {self.name!r} id={self.codec_id} lossless={self.lossless}>"


# ---------------------------------------------------------------------------
# Lossless
# ---------------------------------------------------------------------------


def _shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Group byte k of every element together: plane k holds all k-th bytes.

    On little-endian machines plane 0 holds the low (mantissa) bytes and the
    last plane the high (sign/exponent) bytes, which repeat a lot in KV and so
    compress far better once they sit next to each other.
    """
    if itemsize == 1:
        return raw
    elements = raw.reshape(-1, itemsize)
    planes = np.empty((itemsize, elements.shape[0]), dtype=np.uint8)
    # One strided copy per plane: measured ~3.5 GB/s here, against ~0.5 GB/s
    # for a single transposing copy.
    for k in range(itemsize):
        planes[k] = elements[:, k]
    return planes.reshape(-1)


def _unshuffle_into(planes: np.ndarray, itemsize: int, out_bytes: np.ndarray) -> None:
    if itemsize == 1:
        out_bytes[:] = planes
        return
    planes = planes.reshape(itemsize, -1)
    elements = out_bytes.reshape(-1, itemsize)
    for k in range(itemsize):
        elements[:, k] = planes[k]


def _out_bytes(out: torch.Tensor) -> np.ndarray:
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("decode_into needs a contiguous CPU tensor")
    return out.reshape(-1).view(torch.uint8).numpy()


class NoneCodec(Codec):
    """The raw bytes of the tensor, in native (little-endian) order."""

    name = "none"
    codec_id = 0
    lossless = True

    def encode(self, kv: torch.Tensor, params: Any) -> Any:
        return _byte_view(kv)

    def decode_into(self, body: memoryview, params: Any, out: torch.Tensor) -> None:
        dest = _out_bytes(out)
        _check_body_size(self.name, body, dest.size)
        dest[:] = np.frombuffer(body, dtype=np.uint8)


class _CompressingCodec(Codec):
    """A lossless byte compressor, optionally after a byte-plane shuffle."""

    lossless = True
    shuffle: ClassVar[bool] = False

    @abc.abstractmethod
    def _compress(self, data: np.ndarray, params: Any) -> Any:
        """Compress the (possibly shuffled) bytes."""

    @abc.abstractmethod
    def _decompress_into(self, body: memoryview, params: Any, dest: np.ndarray) -> None:
        """Decompress `body` into `dest` (exactly the raw size)."""

    def encode(self, kv: torch.Tensor, params: Any) -> Any:
        raw = _byte_view(kv)
        if raw.size == 0:
            return b""  # compressors disagree on empty input; an empty body is unambiguous
        if self.shuffle:
            raw = _shuffle(raw, kv.element_size())
        return self._compress(raw, params)

    def decode_into(self, body: memoryview, params: Any, out: torch.Tensor) -> None:
        dest = _out_bytes(out)
        if dest.size == 0:
            _check_body_size(self.name, body, 0)
            return
        if self.shuffle and out.element_size() > 1:
            planes = np.empty(dest.size, dtype=np.uint8)
            self._decompress_into(body, params, planes)
            _unshuffle_into(planes, out.element_size(), dest)
        else:
            self._decompress_into(body, params, dest)


@attrs.frozen
class Lz4Params:
    """LZ4 block parameters.

    `acceleration` > 1 trades ratio for speed (LZ4 "fast" mode).
    """

    acceleration: int = attrs.field(default=1, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])


class Lz4Codec(_CompressingCodec):
    """LZ4 block format; the size is known from the header, so not stored."""

    name = "lz4"
    codec_id = 1
    Params = Lz4Params

    def _compress(self, data: np.ndarray, params: Lz4Params) -> Any:
        if params.acceleration > 1:
            return lz4.block.compress(data, mode="fast", acceleration=params.acceleration, store_size=False)
        return lz4.block.compress(data, store_size=False)

    def _decompress_into(self, body: memoryview, params: Any, dest: np.ndarray) -> None:
        try:
            # python-lz4 has no decompress-into; one copy from its buffer.
            raw = lz4.block.decompress(body, uncompressed_size=dest.size, return_bytearray=True)
        except lz4.block.LZ4BlockError as exc:
            raise CodecDataError(f"lz4 stream is corrupt: {exc}") from exc
        if len(raw) != dest.size:
            raise CodecDataError(f"lz4 body decompressed to {len(raw)} bytes, the header's shape needs {dest.size}")
        dest[:] = np.frombuffer(raw, dtype=np.uint8)


class Lz4ShuffleCodec(Lz4Codec):
    """Byte-plane shuffle, then LZ4."""

    name = "lz4-shuffle"
    codec_id = 2
    shuffle = True


@attrs.frozen
class ZstdParams:
    """Zstandard parameters: `level` from -7 (fastest) to 22 (smallest)."""

    level: int = attrs.field(
        default=3,
        validator=[attrs.validators.instance_of(int), attrs.validators.ge(-7), attrs.validators.le(22)],
    )


# Zstandard contexts must not be shared between threads at the same time.
_zstd_local = threading.local()


def _zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_zstd_local, "compressors", None)
    if cache is None:
        cache = _zstd_local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_zstd_local, "decompressor", None)
    if dctx is None:
        dctx = _zstd_local.decompressor = zstandard.ZstdDecompressor()
    return dctx


class ZstdCodec(_CompressingCodec):
    """Zstandard, one frame; decompresses straight into the destination."""

    name = "zstd"
    codec_id = 3
    Params = ZstdParams

    def _compress(self, data: np.ndarray, params: ZstdParams) -> Any:
        return _zstd_compressor(params.level).compress(data)

    def _decompress_into(self, body: memoryview, params: Any, dest: np.ndarray) -> None:
        target = memoryview(dest)
        filled = 0
        try:
            with _zstd_decompressor().stream_reader(body, read_across_frames=False) as reader:
                while filled < dest.size:
                    n = reader.readinto(target[filled:])
                    if n == 0:
                        break
                    filled += n
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise CodecDataError(f"zstd stream is corrupt: {exc}") from exc
        if filled != dest.size or extra:
            raise CodecDataError(
                f"zstd body decompressed to {'more than ' if extra else ''}{filled} bytes, "
                f"the header's shape needs {dest.size}"
            )


class ZstdShuffleCodec(ZstdCodec):
    """Byte-plane shuffle, then Zstandard."""

    name = "zstd-shuffle"
    codec_id = 4
    shuffle = True


# ---------------------------------------------------------------------------
# Lossy
# ---------------------------------------------------------------------------

# Marks a parameter added after its codec first shipped. The header leaves it
# out while it has its default, which keeps the body layout the codec had
# before: payloads written before the parameter existed decode unchanged, and
# a flowkv that predates it refuses a payload that sets it (an unknown
# parameter, so a miss) instead of misreading the body.
_HEADER_OMITS_DEFAULT = {"header_omits_default": True}


def _choice(*choices: str) -> Any:
    """An attrs validator: the value is one of `choices`; the error names them and the closest."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{attribute.name!r} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}")

    return check


def _window_field() -> Any:
    return attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)],
                       metadata=_HEADER_OMITS_DEFAULT)


def prefix_window(window: int, start: int, end: int, prefix_end: int) -> int:
    """How many of chunk ``[start, end)``'s tokens lie in the last `window` tokens before `prefix_end`.

    That is the chunk's codec ``window`` when the last `window` tokens of a
    stored prefix ending at `prefix_end` stay exact; the tokens it counts
    are always the chunk's last ones.

    >>> [prefix_window(64, s, s + 256, 1024) for s in (0, 256, 512, 768)]
    [0, 0, 0, 64]
    >>> prefix_window(300, 512, 768, 1024), prefix_window(0, 768, 1024, 1024)
    (44, 0)
    """
    if window <= 0:
        return 0
    return max(0, end - max(start, prefix_end - window))


def _check_kv_layout(codec: str, kv: torch.Tensor) -> None:
    if kv.dtype not in FLOAT_DTYPES:
        raise ValueError(f"codec {codec!r} encodes fp16, bf16 or fp32 KV, not {kv.dtype}")
    if kv.dim() != 5 or kv.shape[1] not in (1, 2):
        raise ValueError(
            f"codec {codec!r} needs a chunk tensor (num_layers, kv, num_tokens, num_kv_heads, head_size) "
            f"with kv 1 or 2, got shape {tuple(kv.shape)}"
        )


def _output_rounding(bound: torch.Tensor, kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Widen a bound on the fp32 result by the rounding into the output dtype."""
    u, tiny = _ROUNDOFF[dtype]
    return bound + u * (kv.abs() + bound) + tiny


def _section(body: memoryview, dtype: torch.dtype, count: int, offset: int, device: torch.device) -> tuple[torch.Tensor, int]:
    values = _tensor_from_body(body, dtype, count, offset)
    if device.type != "cpu":
        values = values.to(device)
    return values, offset + values.numel() * values.element_size()


def _new_body(nbytes: int, device: torch.device) -> torch.Tensor:
    """The encoded body, written in place by the quantizer on `device`."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _finish_body(body: torch.Tensor) -> np.ndarray:
    return body.cpu().numpy()


def _align4(nbytes: int) -> int:
    return (nbytes + 3) & ~3


def _pack_nibbles(codes: torch.Tensor, packed: torch.Tensor) -> None:
    """Codes 0..15 (flat uint8) into `packed`: element 2i low nibble, 2i+1 high.

    Viewed as little-endian int16, a pair (a, b) is a + 256 b, and
    (v & 15) | (v >> 4) is a + 16 b: three vectorized ops, no strided access.
    """
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(torch.int16)
    packed.copy_(torch.bitwise_or(pairs & 15, pairs >> 4))


def _unpack_nibbles(packed: torch.Tensor, count: int) -> torch.Tensor:
    wide = packed.to(torch.int16)
    pairs = torch.bitwise_or(wide & 15, (wide & 0xF0) << 4)
    return pairs.view(torch.uint8)[:count]


def _to_half(x: torch.Tensor, toward: float) -> torch.Tensor:
    """fp32 `x` as the nearest float16 on the side of `toward` (-inf: at or below x, +inf: at or above)."""
    half = x.half()
    off = half.float() > x if toward < 0 else half.float() < x
    return torch.where(off, torch.nextafter(half, torch.full_like(half, toward)), half)


class _LossyCodec(Codec):
    """A quantizer for chunk tensors, with an exact window of the chunk's last tokens.

    Body: the quantizer's statistics (fp32 or fp16, padded to 4 bytes), then
    the window's tokens as they came in (the input dtype, shape (layers, kv,
    window, heads, head_size)), then the quantizer's codes for the tokens
    before the window. Without a window it is the body these codecs always
    had. Subclasses quantize any (layers, kv, tokens, heads, head_size)
    tensor, strided or not.
    """

    lossless = False

    def check_tensor(self, kv: torch.Tensor) -> None:
        _check_kv_layout(self.name, kv)

    def _exact_tokens(self, shape: tuple[int, ...], params: Any) -> int:
        """Tokens at the end of a chunk of `shape` that the body keeps exact."""
        return min(params.window, shape[2])

    @abc.abstractmethod
    def _sizes(self, shape: tuple[int, ...], params: Any) -> tuple[int, int]:
        """(statistics bytes, code bytes) for quantizing a tensor of `shape`."""

    @abc.abstractmethod
    def _quantize(self, part: torch.Tensor, params: Any, stats: torch.Tensor, codes: torch.Tensor) -> None:
        """Write `part`'s statistics and codes into the uint8 tensors `stats` and `codes`."""

    @abc.abstractmethod
    def _dequantize(self, stats: memoryview, codes: memoryview, params: Any, out: torch.Tensor) -> None:
        """Write the values that `stats` and `codes` encode into `out` (a strided view)."""

    @abc.abstractmethod
    def _bound(self, part: torch.Tensor, params: Any) -> torch.Tensor:
        """Per-element bound (float64) on the quantization error of `part`."""

    def _split(self, shape: tuple[int, ...], params: Any) -> tuple[int, int, int, int]:
        """(quantized tokens, statistics bytes, window bytes per element, code bytes)."""
        tokens = shape[2] - self._exact_tokens(shape, params)
        stat_bytes, code_bytes = self._sizes(shape[:2] + (tokens,) + shape[3:], params)
        return tokens, _align4(stat_bytes), stat_bytes, code_bytes

    def encode(self, kv: torch.Tensor, params: Any) -> Any:
        kv = kv.detach()
        shape = tuple(kv.shape)
        tokens, stats_end, stat_bytes, code_bytes = self._split(shape, params)
        part, window = kv[:, :, :tokens], kv[:, :, tokens:]
        window_bytes = window.numel() * kv.element_size()
        body = _new_body(stats_end + window_bytes + code_bytes, kv.device)
        if window.numel():
            if not bool(torch.isfinite(window).all()):
                raise ValueError(f"{self.name} codec cannot encode non-finite values (inf or nan in the KV)")
            body[stats_end : stats_end + window_bytes].view(kv.dtype).view(window.shape).copy_(window)
        body[stat_bytes:stats_end] = 0
        if part.numel():
            self._quantize(part, params, body[:stat_bytes], body[stats_end + window_bytes :])
        return _finish_body(body)

    def decode_into(self, body: memoryview, params: Any, out: torch.Tensor) -> None:
        shape = tuple(out.shape)
        if len(shape) != 5 or shape[1] not in (1, 2):
            raise CodecDataError(f"{self.name} payload has shape {shape}, not a chunk shape")
        tokens, stats_end, stat_bytes, code_bytes = self._split(shape, params)
        window_count = out[:, :, tokens:].numel()
        window_bytes = window_count * out.element_size()
        _check_body_size(self.name, body, stats_end + window_bytes + code_bytes)
        if window_count:
            window, _ = _section(body, out.dtype, window_count, stats_end, out.device)
            out[:, :, tokens:].copy_(window.view(out[:, :, tokens:].shape))
        if tokens and out.numel():
            self._dequantize(body[:stat_bytes], body[stats_end + window_bytes :], params, out[:, :, :tokens])

    def max_error(self, kv: torch.Tensor, params: Any) -> torch.Tensor:
        tokens = kv.shape[2] - self._exact_tokens(tuple(kv.shape), params)
        bound = torch.zeros(kv.shape, dtype=torch.float64)
        if kv[:, :, :tokens].numel():
            bound[:, :, :tokens] = self._bound(kv[:, :, :tokens], params)
        return bound


@attrs.frozen
class Fp8Params:
    """fp8 parameters.

    `scaling` ``"token"``: one scale per token (all heads of one layer and kv
    index), or with `group_size` N > 0 one per N consecutive channels of a
    token (N must divide num_kv_heads * head_size). ``"channel"``: keys get
    one scale per channel (per layer, head and channel, over the chunk's
    tokens), values per token as with ``"token"``. `window`: the chunk's
    last `window` tokens stay exact.
    """

    group_size: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    scaling: str = attrs.field(default="token", validator=_choice("token", "channel"),
                               metadata=_HEADER_OMITS_DEFAULT)
    window: int = _window_field()


class Fp8Codec(_LossyCodec):
    """float8 e4m3 values with fp32 scales.

    scale = amax(|x| in group) / 448; stored q = e4m3(x / scale). e4m3 keeps
    3 mantissa bits at every magnitude, so the scale matters for the range
    it maps into e4m3's normal numbers, not for the relative precision.
    Statistics: the scales in group order (``"channel"``: key scales, then
    value scales); codes: the e4m3 bytes in tensor order.
    """

    name = "fp8"
    codec_id = 16
    error_bound = (
        "|x' - x| <= 2^-4 |x| + 2^-10 * amax/448 per group (e4m3 rounding, normal and subnormal), "
        "plus rounding into the output dtype; 0 in the window"
    )
    Params = Fp8Params

    @staticmethod
    def _group(shape: tuple[int, ...], params: Fp8Params) -> int:
        row = shape[3] * shape[4]
        group = params.group_size or row
        if row and row % group:
            raise ValueError(
                f"fp8 group_size {group} does not divide num_kv_heads * head_size = {row}"
            )
        return group

    def _channel_keys(self, shape: tuple[int, ...], params: Fp8Params) -> bool:
        return params.scaling == "channel" and shape[1] == 2

    def _scale_count(self, shape: tuple[int, ...], params: Fp8Params) -> int:
        layers, kvs, tokens, heads, head_size = shape
        groups = layers * tokens * heads * head_size // self._group(shape, params) if tokens else 0
        if self._channel_keys(shape, params):
            return layers * heads * head_size + groups  # key channels, then value groups
        return kvs * groups

    def _sizes(self, shape: tuple[int, ...], params: Fp8Params) -> tuple[int, int]:
        count = 1
        for dim in shape:
            count *= dim
        return 4 * self._scale_count(shape, params), count

    def _grouped(self, part: torch.Tensor, params: Fp8Params) -> list[tuple[int | None, torch.Tensor, int]]:
        """(kv index or None for all, fp32 values shaped for their scales, the dim a scale covers)."""
        group = self._group(tuple(part.shape), params)
        layers, kvs, tokens, heads, head_size = part.shape
        x = part.float()
        if self._channel_keys(tuple(part.shape), params):
            return [(0, x[:, 0], 1), (1, x[:, 1].reshape(layers, tokens, heads * head_size // group, group), 3)]
        return [(None, x.reshape(layers, kvs, tokens, heads * head_size // group, group), 4)]

    @staticmethod
    def _amax(x: torch.Tensor, dim: int) -> torch.Tensor:
        if x.numel():
            return x.abs().amax(dim=dim, keepdim=True)
        shape = list(x.shape)
        shape[dim] = 1
        return x.new_zeros(shape)

    def _quantize(self, part: torch.Tensor, params: Fp8Params, stats: torch.Tensor, codes: torch.Tensor) -> None:
        scales = stats.view(torch.float32)
        codes = codes.view(torch.float8_e4m3fn).view(part.shape)
        offset = 0
        for index, x, dim in self._grouped(part, params):
            amax = self._amax(x, dim)
            if not bool(torch.isfinite(amax).all()):
                raise ValueError("fp8 codec cannot encode non-finite values (inf or nan in the KV)")
            scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
            scales[offset : offset + scale.numel()].copy_(scale.reshape(-1))
            offset += scale.numel()
            target = codes if index is None else codes[:, index]
            # x / scale may land a hair above 448 through rounding; e4m3fn has no
            # infinity, so an unclamped overflow would become nan.
            target.view(x.shape).copy_(torch.div(x, scale).clamp_(-_FP8_MAX, _FP8_MAX))

    def _dequantize(self, stats: memoryview, codes: memoryview, params: Fp8Params, out: torch.Tensor) -> None:
        shape = tuple(out.shape)
        scales, _ = _section(stats, torch.float32, self._scale_count(shape, params), 0, out.device)
        q, _ = _section(codes, torch.float8_e4m3fn, out.numel(), 0, out.device)
        q = q.view(shape)
        offset = 0
        for index, x, dim in self._grouped(q, params):
            stat_shape = list(x.shape)
            stat_shape[dim] = 1
            count = math.prod(stat_shape)
            scale = scales[offset : offset + count].view(stat_shape)
            offset += count
            target = out if index is None else out[:, index]
            target.view(x.shape).copy_(x.mul_(scale))

    def _bound(self, part: torch.Tensor, params: Fp8Params) -> torch.Tensor:
        bound = torch.empty(part.shape, dtype=torch.float64)
        for index, x, dim in self._grouped(part, params):
            scale = self._amax(x, dim).double() / _FP8_MAX
            x = x.double()
            piece = 2.0**-4 * x.abs() + 2.0**-10 * scale
            piece = piece * (1 + 1e-6)  # fp32 arithmetic in x / scale and q * scale
            piece = _output_rounding(piece, x, part.dtype)
            (bound if index is None else bound[:, index]).view(piece.shape).copy_(piece)
        return bound


@attrs.frozen
class IntParams:
    """KIVI-style integer quantization parameters.

    Keys get a scale and zero point per channel (per layer, head and
    channel), since key outliers sit in fixed channels, over groups of
    `key_group_size` consecutive tokens; 0 means all the chunk's tokens, N
    must divide num_tokens. Values get them per token, over groups of
    `group_size` channels of one head; 0 means a whole head (head_size
    channels), N must divide head_size. `window`: the chunk's last `window`
    tokens stay exact (tokens that would leave a key group short join them).
    `scale_dtype`: ``"fp32"`` or ``"fp16"`` scales and zero points (fp16
    halves their cost; zero points are rounded down and scales up, so every
    value stays within half a step).
    """

    group_size: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    key_group_size: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    window: int = _window_field()
    scale_dtype: str = attrs.field(default="fp32", validator=_choice("fp32", "fp16"),
                                   metadata=_HEADER_OMITS_DEFAULT)


class _IntCodec(_LossyCodec):
    """Asymmetric uniform quantization, KIVI layout.

    Statistics: key minima, key scales, value minima, value scales (no key
    ones when kv == 1); codes: the whole quantized tensor in (layer, kv,
    token, head, channel) order; int4 packs element 2i in the low nibble and
    2i+1 in the high nibble of byte i.
    """

    bits: ClassVar[int]
    Params = IntParams

    @property
    def _levels(self) -> int:
        return (1 << self.bits) - 1

    def _exact_tokens(self, shape: tuple[int, ...], params: IntParams) -> int:
        exact = min(params.window, shape[2])
        if exact and params.key_group_size:
            exact += (shape[2] - exact) % params.key_group_size
        return exact

    def _group_sizes(self, shape: tuple[int, ...], params: IntParams) -> tuple[int, int]:
        """Channels per value group and tokens per key group of a chunk of `shape` (0: the whole dim)."""
        groups = []
        for setting, group, what, size in (("group_size", params.group_size, "head_size", shape[4]),
                                           ("key_group_size", params.key_group_size, "num_tokens", shape[2])):
            group = group or size
            if size and size % group:
                raise ValueError(f"{self.name} {setting} {group} does not divide {what} {size}")
            groups.append(group)
        return groups[0], groups[1]

    def _grouped(self, part: torch.Tensor, index: int, kvs: int, group: int, key_group: int) -> tuple[torch.Tensor, int]:
        """One kv index of the chunk (layers, tokens, heads, head_size), shaped
        for its statistics, and the dim they reduce over."""
        layers, tokens, heads, head_size = part.shape
        if kvs == 2 and index == 0:
            # Keys: reduce over a token group -> (min, scale) per layer, token group, head, channel.
            return part.reshape(layers, tokens // key_group if key_group else 0, key_group, heads, head_size), 2
        per_head = head_size // group if group else 0
        return part.reshape(layers, tokens, heads, per_head, group), -1

    def _stat_counts(self, shape: tuple[int, ...], params: IntParams) -> list[int]:
        layers, kvs, tokens, heads, head_size = shape
        group, key_group = self._group_sizes(shape, params)
        value_stats = layers * tokens * heads * (head_size // group if group else 0)
        if kvs == 2:
            return [layers * (tokens // key_group if key_group else 0) * heads * head_size, value_stats]
        return [value_stats]

    def _stat_dtype(self, params: IntParams) -> torch.dtype:
        return torch.float16 if params.scale_dtype == "fp16" else torch.float32

    def _sizes(self, shape: tuple[int, ...], params: IntParams) -> tuple[int, int]:
        count = 1
        for dim in shape:
            count *= dim
        stat_bytes = 2 * self._stat_dtype(params).itemsize * sum(self._stat_counts(shape, params))
        return stat_bytes, count if self.bits == 8 else (count + 1) // 2

    def _stats(self, part: torch.Tensor, params: IntParams) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(kv index, grouped fp32 view, min, scale) for keys then values, as stored (fp16-rounded or not)."""
        group, key_group = self._group_sizes(tuple(part.shape), params)
        x = part.float()
        parts = []
        for index in range(part.shape[1]):
            grouped, dim = self._grouped(x[:, index], index, part.shape[1], group, key_group)
            if grouped.numel():
                lo, hi = torch.aminmax(grouped, dim=dim, keepdim=True)
            else:
                stat_shape = list(grouped.shape)
                stat_shape[dim] = 1
                lo = hi = grouped.new_zeros(stat_shape)
            if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
                raise ValueError(f"{self.name} codec cannot encode non-finite values (inf or nan in the KV)")
            if params.scale_dtype == "fp16":
                lo = _to_half(lo, -math.inf).float()
            span = hi - lo
            scale = torch.where(span > 0, span / self._levels, torch.ones_like(span))
            if params.scale_dtype == "fp16":
                scale = _to_half(scale, math.inf).float()
                if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(scale).all())):
                    raise ValueError(f"{self.name} scale_dtype 'fp16' cannot hold this KV's range "
                                     f"(beyond +-65504); use scale_dtype 'fp32'")
            elif not bool(torch.isfinite(scale).all()):
                raise ValueError(f"{self.name} codec cannot encode non-finite values (inf or nan in the KV)")
            parts.append((index, grouped, lo, scale))
        return parts

    def _quantize(self, part: torch.Tensor, params: IntParams, stats: torch.Tensor, codes: torch.Tensor) -> None:
        stats = stats.view(self._stat_dtype(params))
        quantized = codes if self.bits == 8 else torch.empty(part.numel(), dtype=torch.uint8, device=part.device)
        quantized = quantized.view(part.shape)
        offset = 0
        for index, grouped, lo, scale in self._stats(part, params):
            for stat in (lo, scale):
                stats[offset : offset + stat.numel()].copy_(stat.reshape(-1))
                offset += stat.numel()
            q = torch.sub(grouped, lo).div_(scale).round_().clamp_(0, self._levels)
            quantized[:, index].view(q.shape).copy_(q)
        if self.bits == 4:
            _pack_nibbles(quantized.view(-1), codes)

    def _dequantize(self, stats: memoryview, codes: memoryview, params: IntParams, out: torch.Tensor) -> None:
        shape = tuple(out.shape)
        group, key_group = self._group_sizes(shape, params)
        counts = self._stat_counts(shape, params)
        stat_dtype = self._stat_dtype(params)
        values, _ = _section(stats, stat_dtype, 2 * sum(counts), 0, out.device)
        count = out.numel()
        q, _ = _section(codes, torch.uint8, count if self.bits == 8 else (count + 1) // 2, 0, out.device)
        if self.bits == 4:
            q = _unpack_nibbles(q, count)
        q = q.view(shape)
        offset = 0
        for index, stat_count in enumerate(counts):
            grouped, dim = self._grouped(q[:, index], index, shape[1], group, key_group)
            stat_shape = list(grouped.shape)
            stat_shape[dim] = 1
            lo = values[offset : offset + stat_count].view(stat_shape).float()
            scale = values[offset + stat_count : offset + 2 * stat_count].view(stat_shape).float()
            offset += 2 * stat_count
            if grouped.numel():
                out[:, index].view(grouped.shape).copy_(torch.addcmul(lo, grouped.float(), scale))

    def _bound(self, part: torch.Tensor, params: IntParams) -> torch.Tensor:
        bound = torch.empty(part.shape, dtype=torch.float64)
        for index, grouped, lo, scale in self._stats(part, params):
            lo, scale = lo.double(), scale.double()
            hi = lo + scale * self._levels
            # Half a step from rounding, plus fp32 error in (x - lo) / scale
            # and q * scale + lo, relative to the group's magnitude.
            fp32_slack = 4 * 2.0**-24 * (lo.abs() + hi.abs() + scale)
            piece = (scale / 2 + fp32_slack).expand(grouped.shape)
            piece = _output_rounding(piece, grouped.double(), part.dtype)
            bound[:, index].view(piece.shape).copy_(piece)
        return bound


class Int8Codec(_IntCodec):
    """8-bit KIVI-style quantization."""

    name = "int8"
    codec_id = 17
    bits = 8
    error_bound = (
        "|x' - x| <= scale/2 with scale = (max - min)/255 per key channel (over a token group) "
        "or per value token group, plus fp32 and output-dtype rounding; 0 in the window"
    )


class Int4Codec(_IntCodec):
    """4-bit KIVI-style quantization, two codes per byte."""

    name = "int4"
    codec_id = 18
    bits = 4
    error_bound = (
        "|x' - x| <= scale/2 with scale = (max - min)/15 per key channel (over a token group) "
        "or per value token group, plus fp32 and output-dtype rounding; 0 in the window"
    )


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------

_BY_NAME: dict[str, Codec] = {}
_BY_ID: dict[int, Codec] = {}
_registry_lock = threading.Lock()


def register_codec(codec: Codec, *, builtin: bool = False) -> Codec:
    """Register `codec` under its name and id; returns it.

    Raises ValueError when the name or the id is taken, or when a non-built-in
    codec uses a reserved id (below 1024).
    """
    if not isinstance(codec, Codec):
        raise TypeError(f"register_codec takes a Codec instance, got {type(codec).__name__}")
    if not isinstance(codec.codec_id, int) or not 0 <= codec.codec_id <= 0xFFFF:
        raise ValueError(f"codec {codec.name!r}: id must be an int in 0..65535, got {codec.codec_id!r}")
    if not builtin and codec.codec_id < 1024:
        raise ValueError(f"codec {codec.name!r}: ids below 1024 are reserved for flowkv's own codecs")
    with _registry_lock:
        if codec.name in _BY_NAME:
            raise ValueError(f"codec name {codec.name!r} is already registered by {_BY_NAME[codec.name]!r}")
        if codec.codec_id in _BY_ID:
            raise ValueError(f"codec id {codec.codec_id} is already registered by {_BY_ID[codec.codec_id]!r}")
        _BY_NAME[codec.name] = codec
        _BY_ID[codec.codec_id] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The codec registered as `name`; UnknownCodecError (with a suggestion) if none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(_BY_NAME), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownCodecError(f"unknown codec {name!r}{hint} (known: {', '.join(codec_names())})") from None


def codec_by_id(codec_id: int) -> Codec:
    """The codec registered with numeric id `codec_id`; UnknownCodecError if none."""
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise UnknownCodecError(
            f"unknown codec id {codec_id} (this flowkv knows: "
            + ", ".join(f"{c.name}={c.codec_id}" for c in _BY_ID.values())
            + ")"
        ) from None


def codec_names() -> list[str]:
    """Names of all registered codecs, in id order."""
    return [c.name for c in sorted(_BY_NAME.values(), key=lambda c: c.codec_id)]


for _codec in (
    NoneCodec(),
    Lz4Codec(),
    Lz4ShuffleCodec(),
    ZstdCodec(),
    ZstdShuffleCodec(),
    Fp8Codec(),
    Int8Codec(),
    Int4Codec(),
):
    register_codec(_codec, builtin=True)
del _codec
