"""Single tokens inside vLLM's packed CPU KV blocks, through a table the cache-write op draws.

vLLM's CPU backend keeps one tensor per layer, ``(num_blocks, num_kv_heads,
block_size, 2 * head_size)``, but a row of it is not one token: for each
block and head the block's keys come first, then its values, each packed the
way the attention kernel of the ISA in use reads them::

    one (block, head) of a layer, block_size * 2 * head_size elements
    ├── keys:   block_size * head_size   element i holds key (token t, channel d) = KEY_TABLE[i]
    └── values: block_size * head_size   element i holds value (t, d)             = VALUE_TABLE[i]

    seen here (vLLM 0.32): vec/vec16 keys dimension-major (d, t), values token-major (t, d);
                           amx keys in token pairs of 2 channels, values in channel pairs of 2 tokens

Rather than re-deriving each ISA's packing (and silently going wrong when
vLLM changes it), `PackedBlockLayout.draw` asks the engine's own cache-write
op: it writes index-coded keys and values into a small scratch cache of the
same geometry and reads back where each (token, channel) landed. The op is
passed in (kernels never import vLLM): any callable with the signature of
vLLM's ``cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
slot_mapping, isa)`` where ``key_cache`` / ``value_cache`` are the two halves
of ``layer.view(blocks, heads, 2 * block_size, head_size)`` along dim 2,
as ``do_kv_cache_update`` hands them.

Then `read_tokens` gathers any tokens' keys and values (``(tokens, heads,
head_size)``, exact), `write_tokens` scatters them through the table, and
`unpack` / `pack` turn a whole block's packed keys into ``(..., block_size,
head_size)`` and back, for code that needs true key channels (lossy codecs).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import attrs
import torch

__all__ = ["CacheWriteOp", "PackedBlockLayout", "PackingError"]

#: ``op(key, value, key_cache, value_cache, slot_mapping, isa)``, as vLLM's ``cpu_attn_reshape_and_cache``
CacheWriteOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str], None]

# Codes are written one base-256 digit at a time: every integer 0..255 is exact
# in bf16, fp16 and fp32, so no digit is rounded whatever the cache dtype.
_DIGIT = 256
# Scratch geometry: two blocks and two heads, enough to see that every block
# and head is packed alike and that the op keeps them apart.
_SCRATCH_BLOCKS = 2
_SCRATCH_HEADS = 2


class PackingError(RuntimeError):
    """The cache-write op does not pack blocks the way this module can read them."""


@attrs.frozen(eq=False)
class PackedBlockLayout:
    """Where every token's key and value channels sit inside one (block, head) of the cache."""

    isa: str
    block_size: int
    head_size: int
    dtype: torch.dtype
    # (block_size, head_size) int64: element of the (block, head)'s key region holding key (t, d)
    key_offsets: torch.Tensor
    # (block_size, head_size) int64: element of its value region holding value (t, d)
    value_offsets: torch.Tensor
    # Per kind, the table as a strided view when it is one (every packing seen so far is):
    # ((token groups, tokens per group, channel groups, channels per group), their strides).
    _views: tuple = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_views", (_as_strides(self.key_offsets), _as_strides(self.value_offsets)))

    # -- drawing the table --------------------------------------------------------------

    @classmethod
    def draw(cls, op: CacheWriteOp, *, isa: str, block_size: int, head_size: int,
             dtype: torch.dtype) -> PackedBlockLayout:
        """The layout ``op`` packs blocks in, found by writing index-coded K/V through it.

        Raises `PackingError` if some element of a block is never written, if
        the op mixes heads or blocks, or if two blocks or heads are packed
        differently; the op's own error if it refuses the ISA or geometry.
        """
        region = block_size * head_size
        # Token t channel d is coded t * head_size + d, written one digit per pass.
        code = torch.arange(region, dtype=torch.int64).view(block_size, head_size)
        digits = max(1, math.ceil(math.log(region, _DIGIT)))
        found = [torch.zeros(_SCRATCH_BLOCKS, _SCRATCH_HEADS, region, dtype=torch.int64) for _ in range(2)]
        slots = torch.arange(_SCRATCH_BLOCKS * block_size, dtype=torch.int64)
        for place in range(digits):
            digit = (code // _DIGIT**place) % _DIGIT
            tokens = digit.repeat(_SCRATCH_BLOCKS, 1).unsqueeze(1).expand(-1, _SCRATCH_HEADS, -1)
            keys_values = _write_scratch(op, isa, block_size, head_size, dtype, slots, tokens.to(dtype))
            for kind in range(2):
                written = keys_values[:, :, kind]
                if bool((written < 0).any()):
                    raise PackingError(f"{isa}: the cache-write op left elements of a block unwritten "
                                       f"(block_size {block_size}, head_size {head_size}, {dtype})")
                found[kind] += written.to(torch.int64) * _DIGIT**place
        # Each (block, head) tagged by its own number: the op must keep them apart.
        tag = torch.arange(_SCRATCH_BLOCKS * _SCRATCH_HEADS, dtype=torch.float32).view(_SCRATCH_BLOCKS, 1,
                                                                                        _SCRATCH_HEADS, 1)
        tags = tag.expand(-1, block_size, -1, head_size).reshape(-1, _SCRATCH_HEADS, head_size)
        tagged = _write_scratch(op, isa, block_size, head_size, dtype, slots, tags.to(dtype))
        expected = tag.view(_SCRATCH_BLOCKS, _SCRATCH_HEADS, 1, 1).to(dtype).expand_as(tagged)
        if not torch.equal(tagged, expected):
            raise PackingError(f"{isa}: the cache-write op writes a token outside its own block and head")
        offsets = []
        for kind, name in ((0, "keys"), (1, "values")):
            table = found[kind]
            if not bool((table == table[:1, :1]).all()):
                raise PackingError(f"{isa}: {name} of different blocks or heads are packed differently")
            table = table[0, 0]
            if not torch.equal(torch.sort(table).values, torch.arange(region)):
                raise PackingError(f"{isa}: {name} of a block are not a permutation of its tokens' channels")
            inverse = torch.empty_like(table)
            inverse[table] = torch.arange(region)
            offsets.append(inverse.view(block_size, head_size))
        return cls(isa=isa, block_size=block_size, head_size=head_size, dtype=dtype,
                   key_offsets=offsets[0], value_offsets=offsets[1])

    def fingerprint(self) -> str:
        """A short tag for where this packing puts every token's channels: two layouts with the same
        tag hold a block's bytes in the same places, whatever their ISA is called. Raw chunks copied
        out of packed blocks are interchangeable only between caches of the same tag, so the engine
        adds it to its chunk keys' layout (a payload written on an ``amx`` machine is never read as
        ``vec`` blocks through a shared tier)."""
        digest = hashlib.sha256()
        for table in (self.key_offsets, self.value_offsets):
            digest.update(repr(tuple(table.shape)).encode())
            digest.update(table.to(torch.int64).contiguous().numpy().tobytes())
        return f"pk{digest.hexdigest()[:10]}"

    # -- single tokens ----------------------------------------------------------------

    def regions(self, layer: torch.Tensor) -> torch.Tensor:
        """``layer`` as ``(num_blocks, num_kv_heads, 2, block_size * head_size)``: keys then values."""
        num_blocks, num_heads, block_size, width = layer.shape
        if block_size != self.block_size or width != 2 * self.head_size:
            raise ValueError(f"layer of shape {tuple(layer.shape)} is not of this layout (block_size "
                             f"{self.block_size}, 2 * head_size {2 * self.head_size})")
        return layer.view(num_blocks, num_heads, 2, block_size * self.head_size)

    def token_view(self, regions: torch.Tensor, kind: int) -> torch.Tensor | None:
        """``regions[..., kind, :]`` (keys 0, values 1) as a strided view ``(..., T1, T0, D1, D0)``
        with token ``t = t1 * T0 + t0`` and channel ``d = d1 * D0 + d0``; None when the
        packing is no strided view (then `read_tokens` goes through the table)."""
        plan = self._views[kind]
        if plan is None:
            return None
        shape, strides = plan
        packed = regions.select(-2, kind)
        step = packed.stride(-1)
        return packed.as_strided((*packed.shape[:-1], *shape),
                                 (*packed.stride()[:-1], *(s * step for s in strides)),
                                 packed.storage_offset())

    def _flat_index(self, layer: torch.Tensor, slots: torch.Tensor, kind: int) -> torch.Tensor:
        """Element numbers in ``layer.view(-1)`` of the tokens at ``slots``, ``(n, heads, head_size)``."""
        num_blocks, num_heads = self.regions(layer).shape[:2]
        region = self.block_size * self.head_size
        slots = slots.to(torch.int64)
        table = self.key_offsets if kind == 0 else self.value_offsets
        base = ((slots // self.block_size)[:, None] * num_heads + torch.arange(num_heads)) * (2 * region)
        return (base + kind * region)[:, :, None] + table[slots % self.block_size][:, None, :]

    def read_tokens(self, layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the tokens at ``slots``, each ``(len(slots), num_kv_heads, head_size)``."""
        regions = self.regions(layer)
        slots = slots.to(torch.int64)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        used, where = torch.unique(blocks, return_inverse=True)
        if len(used) * self.block_size <= 2 * len(slots):
            # Dense runs (a document's tokens): copy the blocks whole, unpack them, then pick
            # the rows — whole-block copies run at memory speed, scattered elements do not.
            picked = regions.index_select(0, used)
            return tuple(self.unpack(picked[:, :, kind], kind)[where, :, offsets] for kind in (0, 1))
        out = []
        for kind in (0, 1):
            view = self.token_view(regions, kind)
            if view is None:
                index = self._flat_index(layer, slots, kind)
                out.append(layer.view(-1).index_select(0, index.view(-1)).view(index.shape))
                continue
            group = view.shape[3]
            picked = view[blocks, :, offsets // group, offsets % group]  # (n, heads, D1, D0)
            out.append(picked.reshape(len(slots), regions.shape[1], self.head_size))
        return out[0], out[1]

    def write_tokens(self, layer: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> None:
        """Put ``keys`` / ``values`` ``(len(slots), num_kv_heads, head_size)`` at ``slots``, through the table."""
        flat = layer.view(-1)
        for kind, data in ((0, keys), (1, values)):
            index = self._flat_index(layer, slots, kind)
            flat.index_copy_(0, index.view(-1), data.to(layer.dtype).reshape(-1))

    # -- whole blocks ---------------------------------------------------------------

    def unpack(self, packed: torch.Tensor, kind: int) -> torch.Tensor:
        """``(..., block_size * head_size)`` packed keys (kind 0) or values (1) as ``(..., block_size, head_size)``."""
        plan = self._views[kind]
        if plan is None:
            table = self.key_offsets if kind == 0 else self.value_offsets
            return packed[..., table]
        shape, strides = plan
        step = packed.stride(-1)
        view = packed.as_strided((*packed.shape[:-1], *shape), (*packed.stride()[:-1], *(s * step for s in strides)),
                                 packed.storage_offset())
        return view.reshape(*packed.shape[:-1], self.block_size, self.head_size)

    def whole_blocks(self, chunk: torch.Tensor) -> bool:
        """Whether ``chunk`` (logical ``(layers, kv, tokens, heads, head_size)``) is whole packed
        blocks of this layout in the ``cpu`` layout's buffer order: what `unpack_chunk` takes."""
        if chunk.dim() != 5 or chunk.shape[1] != 2 or chunk.shape[4] != self.head_size:
            return False
        return chunk.shape[2] % self.block_size == 0 and chunk.permute(0, 3, 2, 1, 4).is_contiguous()

    def unpack_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        """A chunk gathered as whole packed blocks (its logical ``(layers, 2, tokens, heads,
        head_size)`` view over the copied bytes) as true per-token keys and values, same shape:
        what a lossy codec must quantize (key channels, value tokens)."""
        regions = _chunk_regions(chunk, self.block_size, self.head_size)
        layers, heads, blocks = regions.shape[:3]
        kinds = [self.unpack(regions[:, :, :, kind], kind).reshape(layers, heads, blocks * self.block_size,
                                                                    self.head_size) for kind in (0, 1)]
        return torch.stack(kinds, dim=1).permute(0, 1, 3, 2, 4).contiguous()

    def pack_chunk(self, tokens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of `unpack_chunk`: true ``(layers, 2, tokens, heads, head_size)`` into
        ``out``, a chunk buffer of whole packed blocks (as gather fills and scatter reads; a new
        one in the ``cpu`` layout's order when None)."""
        if out is None:
            layers, kv, count, heads, dim = tokens.shape
            out = torch.empty(layers, heads, count, kv, dim, dtype=tokens.dtype).permute(0, 3, 2, 1, 4)
        regions = _chunk_regions(out, self.block_size, self.head_size)
        layers, heads, blocks = regions.shape[:3]
        for kind in (0, 1):
            per_block = tokens[:, kind].permute(0, 2, 1, 3).reshape(layers, heads, blocks, self.block_size,
                                                                    self.head_size)
            regions[:, :, :, kind] = self.pack(per_block, kind)
        return out

    def pack(self, tokens: torch.Tensor, kind: int) -> torch.Tensor:
        """The inverse of `unpack`: ``(..., block_size, head_size)`` into the packed order."""
        table = self.key_offsets if kind == 0 else self.value_offsets
        packed = tokens.new_empty((*tokens.shape[:-2], self.block_size * self.head_size))
        packed[..., table.reshape(-1)] = tokens.reshape(*tokens.shape[:-2], -1)
        return packed


def _chunk_regions(chunk: torch.Tensor, block_size: int, head_size: int) -> torch.Tensor:
    """A chunk buffer of whole packed blocks (chunk format 2 of the ``cpu`` layout, buffer
    ``(layers, heads, tokens, kv, head_size)``) as ``(layers, heads, blocks, 2, block_size * head_size)``."""
    layers, kv, tokens, heads, dim = chunk.shape
    if kv != 2 or dim != head_size or tokens % block_size:
        raise ValueError(f"a chunk of shape {tuple(chunk.shape)} is not whole packed blocks of {block_size} tokens")
    physical = chunk.permute(0, 3, 2, 1, 4)
    if not physical.is_contiguous():
        raise ValueError("the chunk's buffer is not in the cpu layout's order (layers, heads, tokens, kv, dim)")
    return physical.view(layers, heads, tokens // block_size, 2, block_size * head_size)


def _as_strides(table: torch.Tensor) -> tuple | None:
    """``table`` (token, channel) -> offset as ``(T1, T0, D1, D0)`` and strides, if it is one.

    Kernels pack in small tiles (pairs of tokens or channels for AMX's VNNI
    rows, whole columns for the vector kernels): split tokens and channels
    each into groups of a power of two and see whether the offsets are affine."""
    block_size, head_size = table.shape
    for tokens_per in (1, 2, 4, 8, 16, 32):
        for channels_per in (1, 2, 4, 8, 16, 32):
            if block_size % tokens_per or head_size % channels_per:
                continue
            shape = (block_size // tokens_per, tokens_per, head_size // channels_per, channels_per)
            tiled = table.view(shape[0], tokens_per, shape[2], channels_per)
            origin = int(tiled[0, 0, 0, 0])
            strides = tuple(
                int(tiled[(1 if i == 0 else 0), (1 if i == 1 else 0), (1 if i == 2 else 0), (1 if i == 3 else 0)])
                - origin if shape[i] > 1 else 0
                for i in range(4)
            )
            if origin != 0 or any(s < 0 for s in strides):
                continue
            grid = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
            if torch.equal(sum(g * s for g, s in zip(grid, strides)), tiled):
                return shape, strides
    return None


def _write_scratch(op: CacheWriteOp, isa: str, block_size: int, head_size: int, dtype: torch.dtype,
                   slots: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Write ``tokens`` as both keys and values into a fresh scratch cache filled with -1;
    answer it as ``(blocks, heads, 2, block_size * head_size)``."""
    cache = torch.full((_SCRATCH_BLOCKS, _SCRATCH_HEADS, block_size, 2 * head_size), -1, dtype=dtype)
    key_cache, value_cache = cache.view(_SCRATCH_BLOCKS, _SCRATCH_HEADS, 2 * block_size, head_size).chunk(2, dim=2)
    op(tokens.contiguous(), tokens.contiguous(), key_cache, value_cache, slots, isa)
    return cache.view(_SCRATCH_BLOCKS, _SCRATCH_HEADS, 2, block_size * head_size)
