"""KV geometry: what shape the engine's paged KV cache has, and how to read it.

The engine keeps one tensor per attention layer. Each supported layout names
the *logical* order of that tensor's dimensions; strides may be anything (a
layer may be a strided view into one buffer shared by all layers, as on
vLLM's CPU backend). Every layout is read through one canonical view::

    (kv, num_blocks, block_size, num_kv_heads, head_size)
     │       │           │           │            └─ contiguous (stride 1)
     │       │           │           └─ 1 for MLA
     │       │           └─ token offset inside a block
     │       └─ physical block; slot = block * block_size + offset
     └─ 0 = keys, 1 = values (MLA: only 0)

Layouts, per layer tensor:

===================  ==================================================
``cpu``              ``(num_blocks, num_kv_heads, block_size, 2*head_size)``;
                     keys in ``[..., :head_size]``, values after (vLLM CPU)
``flash_kv_nhd``     ``(2, num_blocks, block_size, num_kv_heads, head_size)``
``flash_kv_hnd``     ``(2, num_blocks, num_kv_heads, block_size, head_size)``
``flash_blocks_nhd`` ``(num_blocks, 2, block_size, num_kv_heads, head_size)``
``flash_blocks_hnd`` ``(num_blocks, 2, num_kv_heads, block_size, head_size)``
``mla``              ``(num_blocks, block_size, head_size)``
===================  ==================================================

The chunk buffer
----------------

A chunk's KV, out of the cache, is seen by everything outside ``kernels/``
through one *logical* shape, ``(num_layers, kv, num_tokens, num_kv_heads,
head_size)`` (`KVGeometry.chunk_shape`). Its bytes are laid out in the
cache's own order where that keeps the cache's rows long (chunk format 2):

===================  =====================================  ============
layout               physical order of the chunk buffer     one copy is
===================  =====================================  ============
``cpu``              ``(layers, heads, tokens, kv, dim)``    a block of one head
                                                            (keys and values)
``flash_*_hnd``      ``(layers, kv, heads, tokens, dim)``    a block of one head
``flash_*_nhd``,     ``(layers, kv, tokens, heads, dim)``    a block (all heads)
``mla``              (the logical order)
===================  =====================================  ============

``KVGeometry.chunk_order`` is that order as a permutation of the logical
dims; `KVGeometry.chunk_view` gives the logical (strided) view of a physical
buffer, and `KVGeometry.chunk_shape` returns a `ChunkShape`, a tuple that
also carries the order, so an allocator lays a chunk out this way
(`flowkv.memory.MemoryArena.allocate`). The format does not depend on the
chunk's length: a partial chunk, or one that does not start on a block,
is laid out alike and copied in shorter rows (one token's keys and values of
one head on ``cpu``). A chunk of another order still moves correctly, in
shorter rows. Chunks of another format never meet: the order is part of
`KVGeometry.fingerprint`, which is part of every cache key, and payloads
carry it in their header (`flowkv.payload`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import attrs
import torch

__all__ = ["LAYOUTS", "ChunkShape", "KVGeometry", "detect_layout", "canonical_view", "as_layer_list", "dense_order"]

LAYOUTS: tuple[str, ...] = (
    "cpu",
    "flash_kv_nhd",
    "flash_kv_hnd",
    "flash_blocks_nhd",
    "flash_blocks_hnd",
    "mla",
)

# Short dtype names keep fingerprints readable and independent of torch's repr.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.uint8: "u8",
    torch.int8: "i8",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _name.replace("float", "f")


# Physical order of a chunk buffer, as a permutation of the logical dims
# (layers, kv, tokens, heads, head_size); see "The chunk buffer" above.
_LOGICAL_ORDER = (0, 1, 2, 3, 4)
_CHUNK_ORDERS: dict[str, tuple[int, ...]] = {
    "cpu": (0, 3, 2, 1, 4),
    "flash_kv_hnd": (0, 1, 3, 2, 4),
    "flash_blocks_hnd": (0, 1, 3, 2, 4),
    "flash_kv_nhd": _LOGICAL_ORDER,
    "flash_blocks_nhd": _LOGICAL_ORDER,
    "mla": _LOGICAL_ORDER,
}
# One letter per logical dim, for fingerprints: layers, kv, tokens, heads, dim.
_DIM_LETTERS = "lkthd"


class ChunkShape(tuple):
    """A chunk's logical shape that also names the order its buffer is laid out in.

    Equal to (and usable as) the plain shape tuple; ``dim_order`` is the
    physical order of the dims, outermost first, as a permutation of them.

    >>> shape = ChunkShape((2, 2, 16, 4, 8), (0, 3, 2, 1, 4))
    >>> shape == (2, 2, 16, 4, 8), shape.physical
    (True, (2, 4, 16, 2, 8))
    """

    dim_order: tuple[int, ...]

    def __new__(cls, shape, dim_order) -> ChunkShape:
        self = super().__new__(cls, (int(d) for d in shape))
        order = tuple(int(d) for d in dim_order)
        if sorted(order) != list(range(len(self))):
            raise ValueError(f"dim_order {order} is not a permutation of the {len(self)} dims of {tuple(self)}")
        self.dim_order = order
        return self

    @property
    def physical(self) -> tuple[int, ...]:
        """The buffer's shape in its physical order."""
        return tuple(self[d] for d in self.dim_order)

    def __reduce__(self):
        return ChunkShape, (tuple(self), self.dim_order)


def dense_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The order of a tensor's dims (outermost first) in which its elements are one contiguous
    run, or None when they are not (a slice with gaps, a broadcast view).

    >>> dense_order(torch.empty(2, 3, 4).permute(2, 0, 1))
    (1, 2, 0)
    """
    return _dense_order(tuple(tensor.shape), tensor.stride())


@functools.lru_cache(maxsize=256)
def _dense_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    # Size-1 dims can sit anywhere: they go innermost, in their own order.
    order = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d] if shape[d] > 1 else 0, d)))
    if 0 in shape:
        return order
    expected = 1
    for d in reversed(order):
        if shape[d] > 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return order


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"KVGeometry.{attribute.name} must be a positive int, got {value!r}")


def _known_layout(instance, attribute, value) -> None:
    if value not in LAYOUTS:
        raise ValueError(f"unknown KV layout {value!r}; known layouts: {', '.join(LAYOUTS)}")


@attrs.frozen
class KVGeometry:
    """The shape of one worker's paged KV cache, independent of its strides.

    >>> g = KVGeometry("cpu", num_layers=2, num_kv_heads=8, head_size=128,
    ...                block_size=16, dtype=torch.bfloat16)
    >>> g.chunk_shape(256)
    (2, 2, 256, 8, 128)
    >>> g.token_bytes
    8192
    """

    layout: str = attrs.field(validator=_known_layout)
    num_layers: int = attrs.field(validator=_positive)
    # For MLA this is 1: the latent cache has no head dimension.
    num_kv_heads: int = attrs.field(validator=_positive)
    head_size: int = attrs.field(validator=_positive)
    block_size: int = attrs.field(validator=_positive)
    dtype: torch.dtype = attrs.field(validator=attrs.validators.instance_of(torch.dtype))

    def __attrs_post_init__(self) -> None:
        if self.layout == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"an MLA cache has one latent head, got num_kv_heads={self.num_kv_heads}")
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported KV cache dtype {self.dtype}")

    @property
    def kv(self) -> int:
        """2 (keys and values) or 1 (MLA's single latent)."""
        return 1 if self.layout == "mla" else 2

    @property
    def chunk_order(self) -> tuple[int, ...]:
        """The physical order of a chunk buffer's dims, as a permutation of the logical
        ``(layers, kv, tokens, heads, head_size)`` (see "The chunk buffer" above).

        >>> KVGeometry("cpu", 2, 8, 128, 16, torch.bfloat16).chunk_order
        (0, 3, 2, 1, 4)
        """
        return _CHUNK_ORDERS[self.layout]

    def chunk_shape(self, num_tokens: int) -> ChunkShape:
        """The logical shape of a chunk of ``num_tokens`` tokens of every layer,
        ``(layers, kv, tokens, heads, head_size)``, carrying `chunk_order`."""
        return ChunkShape((self.num_layers, self.kv, num_tokens, self.num_kv_heads, self.head_size),
                          self.chunk_order)

    def chunk_view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The logical view of a chunk buffer laid out in `chunk_order` (its physical shape).

        >>> g = KVGeometry("cpu", 2, 8, 128, 16, torch.bfloat16)
        >>> buffer = torch.empty(g.chunk_shape(32).physical, dtype=g.dtype)
        >>> g.chunk_view(buffer).shape
        torch.Size([2, 2, 32, 8, 128])
        """
        order = self.chunk_order
        inverse = tuple(order.index(d) for d in range(len(order)))
        return buffer.permute(inverse)

    def empty_chunk(self, num_tokens: int, *, device: str | torch.device = "cpu") -> torch.Tensor:
        """A new chunk buffer of ``num_tokens`` tokens in this geometry's format (logical view)."""
        return self.chunk_view(torch.empty(self.chunk_shape(num_tokens).physical, dtype=self.dtype, device=device))

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The engine's tensor shape for one layer in this layout, with ``num_blocks`` blocks.

        >>> KVGeometry("cpu", 2, 8, 128, 16, torch.bfloat16).layer_shape(4)
        (4, 8, 16, 256)
        """
        H, D, B = self.num_kv_heads, self.head_size, self.block_size
        return {
            "cpu": (num_blocks, H, B, 2 * D),
            "flash_kv_nhd": (2, num_blocks, B, H, D),
            "flash_kv_hnd": (2, num_blocks, H, B, D),
            "flash_blocks_nhd": (num_blocks, 2, B, H, D),
            "flash_blocks_hnd": (num_blocks, 2, H, B, D),
            "mla": (num_blocks, B, D),
        }[self.layout]

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies over all layers, keys and values."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.kv * self.num_kv_heads * self.head_size * itemsize

    def fingerprint(self) -> str:
        """A short string, stable across processes and versions, that changes
        whenever chunks of this geometry stop being interchangeable: a chunk
        buffer whose order is not the logical one adds it (chunk format 2).

        >>> KVGeometry("cpu", 2, 8, 128, 16, torch.bfloat16).fingerprint()
        'cpu-l2-h8-d128-b16-bf16-lhtkd'
        >>> KVGeometry("flash_kv_nhd", 2, 8, 128, 16, torch.bfloat16).fingerprint()
        'flash_kv_nhd-l2-h8-d128-b16-bf16'
        """
        order = "" if self.chunk_order == _LOGICAL_ORDER else "-" + "".join(_DIM_LETTERS[d] for d in self.chunk_order)
        return (
            f"{self.layout}-l{self.num_layers}-h{self.num_kv_heads}-d{self.head_size}"
            f"-b{self.block_size}-{_DTYPE_NAMES[self.dtype]}{order}"
        )


def as_layer_list(kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The per-layer tensors in layer order; vLLM passes ``dict[layer_name, Tensor]``
    in model order, so a mapping keeps its insertion order."""
    layers = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not layers:
        raise ValueError("kv_caches is empty: expected one tensor per attention layer")
    for index, layer in enumerate(layers):
        if not isinstance(layer, torch.Tensor):
            raise TypeError(f"kv_caches[{index}] is {type(layer).__name__}, expected a torch.Tensor")
    return layers


def _shape_candidates(shape: tuple[int, ...], num_kv_heads: int, head_size: int) -> dict[str, int]:
    """Layouts whose logical shape fits ``shape``, each with the block size it implies."""
    found: dict[str, int] = {}
    H, D = num_kv_heads, head_size
    if len(shape) == 3 and shape[2] == D:
        found["mla"] = shape[1]
    elif len(shape) == 4 and shape[1] == H and shape[3] == 2 * D:
        found["cpu"] = shape[2]
    elif len(shape) == 5 and shape[4] == D:
        for prefix, is_pair in (("flash_kv", shape[0] == 2), ("flash_blocks", shape[1] == 2)):
            if not is_pair:
                continue
            if shape[3] == H:
                found[f"{prefix}_nhd"] = shape[2]
            if shape[2] == H:
                found[f"{prefix}_hnd"] = shape[3]
    return found


# Hint words -> layouts they allow: vLLM attention backend names, and layout
# names as vLLM's KVCacheLayout and flashinfer spell them.
_NHD = frozenset({"flash_kv_nhd", "flash_blocks_nhd"})
_HND = frozenset({"flash_kv_hnd", "flash_blocks_hnd", "cpu"})
_HINT_WORDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("CPU", frozenset({"cpu"})),
    ("TORCH_SDPA", frozenset({"cpu"})),
    ("FLASHINFER", frozenset({"flash_blocks_nhd", "flash_blocks_hnd"})),
    ("TRITON_ATTN", frozenset({"flash_blocks_nhd", "flash_blocks_hnd"})),
    ("FLASH_ATTN", frozenset({"flash_kv_nhd", "flash_kv_hnd"})),
    ("NHD", _NHD),
    ("LBNHC", _NHD),
    ("BLNHC", _NHD),
    ("HND", _HND),
    ("LBHNC", _HND),
    ("BLHNC", _HND),
    ("BHLNC", _HND),
    ("LHBNC", _HND),
)


def _hint_layouts(hint: str) -> frozenset[str] | None:
    """Layouts one hint allows, or None when the hint names nothing known."""
    if hint.lower() in LAYOUTS:
        return frozenset({hint.lower()})
    upper = hint.upper()
    # Every MLA backend name (FLASHMLA, TRITON_MLA, FLASH_ATTN_MLA, ...) says MLA.
    if "MLA" in upper:
        return frozenset({"mla"})
    matched = [layouts for word, layouts in _HINT_WORDS if word in upper]
    return frozenset.intersection(*matched) if matched else None


def detect_layout(
    kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    *,
    num_kv_heads: int,
    head_size: int,
    block_size: int | None = None,
    backend_hint: str | Sequence[str] | None = None,
) -> KVGeometry:
    """Infer the layout of an engine's per-layer KV tensors from their shapes.

    ``backend_hint`` (the vLLM attention backend name such as ``"CPU_ATTN"`` /
    ``"FLASHINFER"``, a layout name such as ``"LBHNC"`` / ``"NHD"``, or a
    flowkv layout name) only breaks ties between layouts the shape allows;
    a shape that fits exactly one layout wins over a hint. Raises ValueError,
    naming the shape, when the shape fits no layout or several that the hints
    cannot tell apart.

    >>> caches = [torch.zeros(4, 2, 32, 128)] * 3
    >>> detect_layout(caches, num_kv_heads=2, head_size=64).layout
    'cpu'
    """
    layers = as_layer_list(kv_caches)
    first = layers[0]
    shape = tuple(first.shape)
    for index, layer in enumerate(layers[1:], start=1):
        if tuple(layer.shape) != shape or layer.dtype != first.dtype or layer.device != first.device:
            raise ValueError(
                f"KV layers disagree: layer 0 is {shape} {first.dtype} on {first.device}, "
                f"layer {index} is {tuple(layer.shape)} {layer.dtype} on {layer.device}"
            )
    candidates = _shape_candidates(shape, num_kv_heads, head_size)
    if block_size is not None:
        candidates = {name: bs for name, bs in candidates.items() if bs == block_size}
    if len(candidates) > 1 and backend_hint is not None:
        hints = [backend_hint] if isinstance(backend_hint, str) else list(backend_hint)
        for hint in hints:
            allowed = _hint_layouts(hint)
            if allowed is not None:
                candidates = {name: bs for name, bs in candidates.items() if name in allowed}
    if len(candidates) != 1:
        what = "fits no known KV layout" if not candidates else f"is ambiguous between {sorted(candidates)}"
        raise ValueError(
            f"KV cache tensor shape {shape} {what} "
            f"(num_kv_heads={num_kv_heads}, head_size={head_size}, block_size={block_size}, "
            f"backend_hint={backend_hint!r}); known layouts: {', '.join(LAYOUTS)}"
        )
    (layout, found_block_size), = candidates.items()
    return KVGeometry(
        layout=layout,
        num_layers=len(layers),
        num_kv_heads=1 if layout == "mla" else num_kv_heads,
        head_size=head_size,
        block_size=found_block_size,
        dtype=first.dtype,
    )


def canonical_view(layer: torch.Tensor, geometry: KVGeometry) -> torch.Tensor:
    """A view (no copy) of one layer's tensor as
    ``(kv, num_blocks, block_size, num_kv_heads, head_size)``."""
    g = geometry
    expected = g.layer_shape(-1)  # -1 stands for any number of blocks
    shape = tuple(layer.shape)
    if len(shape) != len(expected) or any(want not in (-1, got) for want, got in zip(expected, shape)):
        named = tuple("num_blocks" if want == -1 else want for want in expected)
        raise ValueError(f"KV layer of shape {shape} does not match layout {g.layout!r} {named}")
    if layer.dtype != g.dtype:
        raise ValueError(f"KV layer dtype {layer.dtype} does not match geometry dtype {g.dtype}")
    if g.layout == "cpu":
        # Splitting the last dim needs only its stride to be 1, not a contiguous tensor.
        split = layer.unflatten(3, (2, g.head_size))  # (nb, H, B, 2, D)
        return split.permute(3, 0, 2, 1, 4)
    if g.layout == "flash_kv_nhd":
        return layer
    if g.layout == "flash_kv_hnd":
        return layer.permute(0, 1, 3, 2, 4)
    if g.layout == "flash_blocks_nhd":
        return layer.permute(1, 0, 2, 3, 4)
    if g.layout == "flash_blocks_hnd":
        return layer.permute(1, 0, 3, 2, 4)
    return layer.unsqueeze(0).unsqueeze(3)  # mla: (1, nb, B, 1, D)
