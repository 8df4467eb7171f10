"""Chunk keys: named chunk hash functions, chained chunk hashes, and `CacheKey`.

A token sequence is cut into fixed-size chunks. Chunk ``i``'s hash is::

    H(hash of chunk i-1 | root hash for chunk 0,  tokens of chunk i,  extra keys)

so two sequences with an equal prefix share the keys of that prefix, and a
change anywhere changes the key of that chunk and of every chunk after it.

A chunk hash alone does not say whether stored KV may be reused: a
`KeyPrefix` adds what makes KV incompatible (model, world size, worker rank,
dtype, KV layout, request tags) and a `CacheKey` is a prefix plus one chunk
hash, printable as a string that tiers use as a file name or a Redis key.

Example::

    >>> from flowkv.keys import CacheKey, KeyPrefix, chain_hashes
    >>> hashes = chain_hashes(list(range(600)), 256, "sha256")
    >>> len(hashes)                      # two full chunks and a partial one
    3
    >>> prefix = KeyPrefix.build(model="org/model", world_size=1, worker_rank=0,
    ...                          dtype="bfloat16", layout="lbhnc-h2-d64")
    >>> key = prefix.key(hashes[0])
    >>> CacheKey.from_str(key.to_str()) == key
    True
"""

from __future__ import annotations

import array
import abc
import collections
import difflib
import hashlib
import re
import struct
import sys
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import cbor2
import numpy as np
import xxhash

__all__ = [
    "DEFAULT_HASH_FUNCTION",
    "HASH_FUNCTIONS",
    "CacheKey",
    "ChunkHashFunction",
    "ChunkKeys",
    "KeyPrefix",
    "chain_hashes",
    "chain_span_hashes",
    "chunk_spans",
    "default_hash_function_name",
    "segment_hashes",
    "get_hash_function",
    "tags_digest",
]


# --------------------------------------------------------------------------
# Chunk spans
# --------------------------------------------------------------------------


def chunk_spans(num_tokens: int, chunk_size: int, *, save_partial: bool) -> list[tuple[int, int]]:
    """Cut ``num_tokens`` tokens into ``[start, end)`` chunk spans.

    Full chunks of ``chunk_size`` tokens come first; the trailing
    ``num_tokens % chunk_size`` tokens form one partial chunk only when
    ``save_partial`` is true.

    >>> chunk_spans(600, 256, save_partial=True)
    [(0, 256), (256, 512), (512, 600)]
    >>> chunk_spans(600, 256, save_partial=False)
    [(0, 256), (256, 512)]
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    full_end = num_tokens - num_tokens % chunk_size
    spans = [(start, start + chunk_size) for start in range(0, full_end, chunk_size)]
    if save_partial and full_end < num_tokens:
        spans.append((full_end, num_tokens))
    return spans


# --------------------------------------------------------------------------
# Hash functions
# --------------------------------------------------------------------------

# Token ids are held as little-endian uint32 and packed so by the binary hash
# functions: vocabularies are far below 2**32, and half the bytes of int64
# means about twice the hashing speed.
_TOKEN_DTYPE = np.dtype("<u4")
_MAX_TOKEN_ID = 2**32 - 1
_COUNT = struct.Struct("<I")


class ChunkHashFunction(abc.ABC):
    """A named, process-independent chunk hash function.

    Subclasses define how one chunk is hashed; `chain_hashes` drives them.
    Nothing here depends on ``PYTHONHASHSEED``, so equal inputs give equal
    hashes in every process and after every restart.
    """

    #: name used in pipeline files
    name: str = ""
    #: length of every hash in bytes
    digest_size: int = 0
    #: parent hash of chunk 0
    root_hash: bytes = b""

    def hash_chunk(self, parent: bytes | None, token_ids: Any, extra: tuple | None = None) -> bytes:
        """Hash one chunk given its parent's hash (``None`` for chunk 0)."""
        _check_extra(extra)
        prepared = self._prepare(_as_token_array(token_ids))
        spans = [(0, _token_count(prepared))]
        return self._chain(prepared, spans, extra, self._parent(parent))[0]

    def _parent(self, parent: bytes | None) -> bytes:
        if parent is None:
            return self.root_hash
        if not isinstance(parent, bytes) or len(parent) != self.digest_size:
            raise ValueError(
                f"{self.name}: parent hash must be {self.digest_size} bytes, got {parent!r:.80}"
            )
        return parent

    # Subclass hooks: `_prepare` converts the whole token array once per call,
    # `_chain` hashes every span from that one converted form.
    @abc.abstractmethod
    def _prepare(self, tokens: np.ndarray) -> Any:
        """The token array in the form `_chain` hashes."""

    @abc.abstractmethod
    def _chain(self, prepared: Any, spans: list[tuple[int, int]], extra: tuple | None, parent: bytes) -> list[bytes]:
        """One chained hash per span, starting from `parent`."""

    def __repr__(self) -> str:
        return f"<ChunkHashFunction {self.name}>"


class _Sha256Cbor(ChunkHashFunction):
    """sha256 over canonical CBOR of ``(parent, tuple(token_ids), extra)``.

    This is the construction vLLM uses for its prefix-cache block hashes, and
    the root is the one vLLM derives when ``PYTHONHASHSEED`` is unset, so with
    ``chunk_size == block_size`` flowkv's chunk hashes equal vLLM's block
    hashes. Unlike vLLM, the root here never follows ``PYTHONHASHSEED``.
    """

    name = "sha256_cbor"
    digest_size = 32

    def __init__(self) -> None:
        self.root_hash = self._digest("vllm-none-hash")

    @staticmethod
    def _digest(value: Any) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    def _prepare(self, tokens: np.ndarray) -> list[int]:
        # CBOR must see Python ints: numpy scalars are not encodable.
        return tokens.tolist()

    def _chain(self, prepared, spans, extra, parent):
        hashes = []
        dumps, sha256 = cbor2.dumps, hashlib.sha256
        for start, end in spans:
            parent = sha256(dumps((parent, tuple(prepared[start:end]), extra), canonical=True)).digest()
            hashes.append(parent)
        return hashes


class _BinaryPacked(ChunkHashFunction):
    """A digest over ``parent || uint32 count || uint32-LE token ids || CBOR(extra)``.

    The parent has a fixed length and the token count is explicit, so the
    packing is unambiguous; extra keys are CBOR-encoded once per call.
    """

    _new: Any = None

    def _prepare(self, tokens: np.ndarray) -> memoryview:
        return memoryview(tokens).cast("B")

    def _chain(self, prepared, spans, extra, parent):
        extra_bytes = cbor2.dumps(extra, canonical=True)
        itemsize = _TOKEN_DTYPE.itemsize
        new, pack = self._new, _COUNT.pack
        hashes = []
        for start, end in spans:
            hasher = new(parent)
            hasher.update(pack(end - start))
            hasher.update(prepared[start * itemsize:end * itemsize])
            hasher.update(extra_bytes)
            parent = hasher.digest()
            hashes.append(parent)
        return hashes


class _Sha256(_BinaryPacked):
    """sha256 over a fixed binary packing (no CBOR), several times faster than ``sha256_cbor``."""

    name = "sha256"
    digest_size = 32
    _new = staticmethod(hashlib.sha256)
    root_hash = hashlib.sha256(b"flowkv chunk hash root: sha256").digest()


class _Xxh3_128(_BinaryPacked):
    """xxh3 128-bit over the same packing as ``sha256``: the fastest.

    Not collision resistant against an adversary who chooses prompts: use it
    where all tenants are trusted, or keep tenants apart with a tag.
    """

    name = "xxh3_128"
    digest_size = 16
    _new = staticmethod(xxhash.xxh3_128)
    root_hash = xxhash.xxh3_128_digest(b"flowkv chunk hash root: xxh3_128")


#: every hash function by name
HASH_FUNCTIONS: Mapping[str, ChunkHashFunction] = {
    fn.name: fn for fn in (_Sha256Cbor(), _Sha256(), _Xxh3_128())
}

#: the default when vLLM is not installed
DEFAULT_HASH_FUNCTION = "sha256"

# Names people reach for that must not be used, and why.
_REFUSED = {
    "hash": "Python's builtin hash() is salted per process (PYTHONHASHSEED), "
            "so keys would differ between processes and after a restart",
    "builtin": "Python's builtin hash() is salted per process (PYTHONHASHSEED), "
               "so keys would differ between processes and after a restart",
    "python": "Python's builtin hash() is salted per process (PYTHONHASHSEED), "
              "so keys would differ between processes and after a restart",
    "xxhash": "vLLM's 'xxhash' pickles its input, and vLLM seeds it randomly per process; "
              "flowkv's fast deterministic hash is 'xxh3_128'",
    "xxhash_cbor": "vLLM seeds 'xxhash_cbor' randomly per process; "
                   "flowkv's fast deterministic hash is 'xxh3_128'",
}


def default_hash_function_name() -> str:
    """``"sha256_cbor"`` when vLLM is importable (to match its block hashes), else ``"sha256"``."""
    import importlib.util

    return "sha256_cbor" if importlib.util.find_spec("vllm") is not None else DEFAULT_HASH_FUNCTION


def get_hash_function(name: str | ChunkHashFunction) -> ChunkHashFunction:
    """Return the chunk hash function called ``name``.

    >>> get_hash_function("xxh3_128").digest_size
    16

    Raises `ValueError` naming the valid functions (with a "did you mean")
    for an unknown name, and explaining why for names that are refused.
    """
    if isinstance(name, ChunkHashFunction):
        return name
    if not isinstance(name, str):
        raise TypeError(f"hash function name must be a str, got {type(name).__name__}")
    fn = HASH_FUNCTIONS.get(name)
    if fn is not None:
        return fn
    valid = ", ".join(sorted(HASH_FUNCTIONS))
    refused = _REFUSED.get(name.strip().lower())
    if refused is not None:
        raise ValueError(f"hash function {name!r} is refused: it is not deterministic across "
                         f"processes for flowkv's use ({refused}); valid names: {valid}")
    close = difflib.get_close_matches(name, list(HASH_FUNCTIONS), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown hash function {name!r}; valid names: {valid}{hint}")


# --------------------------------------------------------------------------
# Chaining
# --------------------------------------------------------------------------


def _as_token_array(tokens: Any) -> np.ndarray:
    """Convert a token sequence, once, to a 1-D little-endian uint32 array.

    Every hash function starts from this one form, so a list, a numpy array
    and a torch tensor of equal ids always hash alike. Ids must lie in
    ``[0, 2**32)``; bools in a list count as 0/1, as Python ints do.
    """
    if isinstance(tokens, (list, tuple, range)):
        try:
            # array.array converts and range-checks in C: several times
            # faster than np.asarray on a list of Python ints.
            packed = array.array("I", tokens)
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
        except TypeError as exc:
            raise ValueError(f"token ids must be ints: {exc}") from None
        ids = np.frombuffer(packed, dtype=np.uint32)
        return ids.byteswap() if sys.byteorder == "big" else ids
    if isinstance(tokens, np.ndarray):
        ids = tokens
    elif _is_torch_tensor(tokens):
        ids = tokens.detach().cpu().numpy()
    else:
        raise TypeError(f"tokens must be a list of ints or a 1-D integer tensor/array, got {type(tokens).__name__}")
    if ids.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"tokens must have an integer dtype, got {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > _MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in [0, 2**32), got min {int(ids.min())} max {int(ids.max())}")
    return np.ascontiguousarray(ids, dtype=_TOKEN_DTYPE)


def _is_torch_tensor(value: Any) -> bool:
    torch = __import__("sys").modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _token_count(prepared: Any) -> int:
    if isinstance(prepared, memoryview):
        return len(prepared) // _TOKEN_DTYPE.itemsize
    return len(prepared)


def _check_extra(extra: Any) -> None:
    if extra is not None and not isinstance(extra, tuple):
        raise TypeError(f"extra keys must be a tuple or None, got {type(extra).__name__}")


def chain_hashes(
    tokens: Any,
    chunk_size: int,
    hash_fn: str | ChunkHashFunction,
    *,
    extra: tuple | None = None,
    partial: bool = True,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of the chunks of ``tokens``, one per `chunk_spans` span.

    ``tokens`` is a list of ints or a 1-D integer numpy array / torch tensor;
    it is converted once per call. ``extra`` (a tuple of CBOR-encodable values,
    e.g. multimodal hashes) enters every chunk's hash. ``partial`` adds the
    hash of a trailing partial chunk. ``parent`` continues an earlier chain
    (the hash of the chunk before ``tokens[0]``) instead of starting at the root.

    >>> a = chain_hashes([1, 2, 3, 4, 5], 2, "xxh3_128")
    >>> b = chain_hashes([1, 2, 3, 4, 9], 2, "xxh3_128")
    >>> a[:2] == b[:2], a[2] == b[2]
    (True, False)
    """
    fn = get_hash_function(hash_fn)
    _check_extra(extra)
    token_ids = _as_token_array(tokens)
    spans = chunk_spans(int(token_ids.shape[0]), chunk_size, save_partial=partial)
    if not spans:
        return []
    try:
        return fn._chain(fn._prepare(token_ids), spans, extra, fn._parent(parent))
    except cbor2.CBOREncodeError as exc:
        raise ValueError(f"extra keys are not CBOR-encodable: {exc}") from None


def chain_span_hashes(
    tokens: Any,
    spans: Sequence[tuple[int, int]],
    hash_fn: str | ChunkHashFunction,
    *,
    extra: tuple | None = None,
) -> list[bytes]:
    """Chained hashes of arbitrary consecutive spans ``[(start, end), ...]`` of ``tokens``.

    For segmenters that cut chunks at content boundaries instead of every
    ``chunk_size`` tokens; with fixed-size spans it equals `chain_hashes`.
    """
    fn = get_hash_function(hash_fn)
    _check_extra(extra)
    array = _as_token_array(tokens)
    _check_consecutive(spans, int(array.shape[0]))
    if not spans:
        return []
    return fn._chain(fn._prepare(array), list(spans), extra, fn._parent(None))


def _check_consecutive(spans: Sequence[tuple[int, int]], num_tokens: int) -> None:
    expected = 0
    for start, end in spans:
        if start != expected or end <= start or end > num_tokens:
            raise ValueError(f"spans must be consecutive, non-empty and within {num_tokens} tokens; "
                             f"got ({start}, {end}) after {expected}")
        expected = end


# The chain of a segment starts from this root, not the prefix root: a segment key
# and a prefix key of the same tokens must never meet, because a prefix chunk's KV
# was computed at its place in the prompt and a segment's is loaded at another.
_SEGMENT_DOMAIN = ("flowkv segment key",)
_segment_roots: dict[str, bytes] = {}


def _segment_root(fn: ChunkHashFunction) -> bytes:
    root = _segment_roots.get(fn.name)
    if root is None:
        empty = fn._prepare(np.zeros(0, dtype=_TOKEN_DTYPE))
        root = _segment_roots[fn.name] = fn._chain(empty, [(0, 0)], _SEGMENT_DOMAIN, fn.root_hash)[0]
    return root


def segment_hashes(
    tokens: Any,
    spans: Sequence[tuple[int, int]],
    segment_starts: Sequence[int],
    hash_fn: str | ChunkHashFunction,
    *,
    extra: tuple | None = None,
) -> list[bytes]:
    """Segment keys' hashes of consecutive ``spans``: each depends only on its own segment.

    ``segment_starts[i]`` is where the segment holding span ``i`` begins (a
    document cut into several spans gives each the same start). The chain
    restarts at every segment, from a root of its own: a span's hash is
    that of the spans before it *in its segment* and its tokens, never of what
    precedes the segment, so a document hashes alike wherever it sits in a
    prompt. The key prefix (model, rank, dtype, layout, tags) still isolates it.

    >>> a, b = [5, 6, 7], [8, 9]
    >>> one = segment_hashes(a + b, [(0, 3), (3, 5)], [0, 3], "xxh3_128")
    >>> two = segment_hashes(b + a, [(0, 2), (2, 5)], [0, 2], "xxh3_128")
    >>> one == two[::-1], one[0] == chain_hashes(a, 3, "xxh3_128")[0]
    (True, False)
    """
    fn = get_hash_function(hash_fn)
    _check_extra(extra)
    array = _as_token_array(tokens)
    _check_consecutive(spans, int(array.shape[0]))
    if len(segment_starts) != len(spans):
        raise ValueError(f"{len(segment_starts)} segment starts given for {len(spans)} spans")
    prepared = fn._prepare(array)
    root = _segment_root(fn)
    hashes: list[bytes] = []
    i = 0
    while i < len(spans):
        start = segment_starts[i]
        if spans[i][0] != start:
            raise ValueError(f"span {spans[i]} opens a segment that starts at token {start}")
        j = i
        while j < len(spans) and segment_starts[j] == start:
            j += 1
        hashes += fn._chain(prepared, list(spans[i:j]), extra, root)
        i = j
    return hashes


# --------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------

_EMPTY_TAGS = "notags"
_TAGS_DIGEST_RE = re.compile(r"(notags|[0-9a-f]{32})")
_HEX_RE = re.compile(r"([0-9a-f]{2})+")
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]*")


def tags_digest(tags: Mapping[str, str] | None) -> str:
    """An order-independent digest of request tags (LoRA name, cache salt, ...).

    128 bits of sha256, because a tenant salt is a security boundary and a
    shorter digest could be collided on purpose. No tags give ``"notags"``.
    """
    if not tags:
        return _EMPTY_TAGS
    for name, value in tags.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"tags must map str to str, got {name!r}: {value!r}")
    # Canonical CBOR sorts map keys, which makes the digest order-independent.
    return hashlib.sha256(cbor2.dumps(dict(tags), canonical=True)).hexdigest()[:32]


def _quote(text: str) -> str:
    # Percent-encoding is injective and reversible, so two model names can
    # never share a slug, and the slug holds no '/' or other unsafe byte.
    return urllib.parse.quote(text, safe="")


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if not _DTYPE_RE.fullmatch(name):
        raise ValueError(f"dtype must be a dtype name like 'bfloat16', got {dtype!r}")
    return name


def _nonempty_str(field_name: str):
    def check(_instance, _attribute, value):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{field_name} must be a non-empty str, got {value!r}")
    return check


@attrs.frozen
class KeyPrefix:
    """What makes stored KV incompatible with a request, shared by all its chunk keys."""

    #: model name or path as the engine knows it (e.g. ``"meta-llama/Llama-3.1-8B"``)
    model: str = attrs.field(validator=_nonempty_str("model"))
    #: tensor-parallel world size: each rank stores its own shard of the KV
    world_size: int = attrs.field()
    #: rank of the worker whose shard this is
    worker_rank: int = attrs.field()
    #: KV dtype name (``"bfloat16"``); a torch dtype is accepted and named
    dtype: str = attrs.field(converter=_dtype_name)
    #: KV layout fingerprint given by the caller (geometry, block layout, codec)
    layout: str = attrs.field(validator=_nonempty_str("layout"))
    #: `tags_digest` of the request tags
    tags_digest: str = attrs.field(default=_EMPTY_TAGS)
    # The printable prefix, computed once: every chunk key repeats it.
    _prefix_str: str = attrs.field(init=False, eq=False, repr=False, hash=False)

    @world_size.validator
    def _check_world_size(self, _attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"world_size must be an int >= 1, got {value!r}")

    @worker_rank.validator
    def _check_rank(self, _attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.world_size:
            raise ValueError(f"worker_rank must be an int in [0, {self.world_size}), got {value!r}")

    @tags_digest.validator
    def _check_tags_digest(self, _attribute, value):
        if not isinstance(value, str) or not _TAGS_DIGEST_RE.fullmatch(value):
            raise ValueError(f"tags_digest must come from tags_digest(), got {value!r}")

    def __attrs_post_init__(self) -> None:
        text = (f"{_quote(self.model)}/{self.world_size}.{self.worker_rank}/"
                f"{self.dtype}/{_quote(self.layout)}/{self.tags_digest}")
        object.__setattr__(self, "_prefix_str", text)

    @classmethod
    def build(cls, *, model: str, world_size: int, worker_rank: int, dtype: Any, layout: str,
              tags: Mapping[str, str] | None = None) -> KeyPrefix:
        """Build a prefix from request tags (digested here)."""
        return cls(model=model, world_size=world_size, worker_rank=worker_rank, dtype=dtype,
                   layout=layout, tags_digest=tags_digest(tags))

    def to_str(self) -> str:
        """``<model>/<world_size>.<rank>/<dtype>/<layout>/<tags-digest>``, percent-encoded parts."""
        return self._prefix_str

    def key(self, chunk_hash: bytes) -> CacheKey:
        """The key of one chunk under this prefix."""
        return CacheKey(prefix=self, chunk_hash=chunk_hash)

    def keys(self, chunk_hashes: Sequence[bytes]) -> list[CacheKey]:
        """The keys of several chunks under this prefix."""
        return [CacheKey(prefix=self, chunk_hash=h) for h in chunk_hashes]


def _check_chunk_hash(_instance, _attribute, value):
    if not isinstance(value, bytes) or not value:
        raise ValueError(f"chunk_hash must be non-empty bytes, got {value!r:.80}")


@attrs.frozen
class CacheKey:
    """The key of one stored chunk: a `KeyPrefix` plus the chunk's chained hash."""

    #: what the KV is compatible with
    prefix: KeyPrefix
    #: the chunk's chained hash (`chain_hashes`)
    chunk_hash: bytes = attrs.field(validator=_check_chunk_hash)

    def to_str(self) -> str:
        """A stable printable key: ``<prefix>/<hex chunk hash>``.

        Only ``[A-Za-z0-9._~%-]`` and ``/`` appear, so tiers can use it as a
        Redis key or, with ``/`` as directories, as a file path.
        """
        return f"{self.prefix.to_str()}/{self.chunk_hash.hex()}"

    @classmethod
    def from_str(cls, text: str) -> CacheKey:
        """Parse a `to_str` string back into a key; `ValueError` if it is not one."""
        parts = text.split("/") if isinstance(text, str) else []
        if len(parts) != 6:
            raise ValueError(f"not a flowkv cache key (want 6 '/'-separated parts): {text!r}")
        model, ranks, dtype, layout, digest, hex_hash = parts
        world_size, _, rank = ranks.partition(".")
        if not (world_size.isdigit() and rank.isdigit()):
            raise ValueError(f"not a flowkv cache key (bad '<world_size>.<rank>' {ranks!r}): {text!r}")
        if not _HEX_RE.fullmatch(hex_hash):
            raise ValueError(f"not a flowkv cache key (bad chunk hash {hex_hash!r}): {text!r}")
        prefix = KeyPrefix(model=urllib.parse.unquote(model), world_size=int(world_size),
                           worker_rank=int(rank), dtype=dtype,
                           layout=urllib.parse.unquote(layout), tags_digest=digest)
        key = cls(prefix=prefix, chunk_hash=bytes.fromhex(hex_hash))
        if key.to_str() != text:
            # e.g. a non-canonical percent-encoding: two strings for one key would
            # let a tier hold the same chunk twice.
            raise ValueError(f"not a canonical flowkv cache key: {text!r}")
        return key


class ChunkKeys:
    """The chunk keys of one engine's requests: a `KeyPrefix` per tag set, then chained hashes.

    Lookup, retrieve and store of one request hash the same tokens; a small
    cache keyed by a fast digest of the tokens does it once. Thread-safe.

    Example::

        >>> keys = ChunkKeys(model="org/model", world_size=1, rank=0, dtype="bfloat16",
        ...                  layout="lbhnc-h2-d64", chunk_size=256, hash_function="sha256")
        >>> len(keys.of(np.arange(600)))     # two full chunks and a partial one
        3
    """

    _CACHED = 64  # token lists remembered

    def __init__(self, *, model: str, world_size: int, rank: int, dtype: Any, layout: str,
                 chunk_size: int, hash_function: str | ChunkHashFunction = "auto") -> None:
        self.model = model
        self.world_size = world_size
        self.rank = rank
        self.dtype = dtype
        self.layout = layout
        self.chunk_size = chunk_size
        if hash_function == "auto":
            hash_function = default_hash_function_name()
        self.hash_fn = get_hash_function(hash_function)
        self._prefixes: dict[tuple[tuple[str, str], ...], KeyPrefix] = {}
        self._lock = threading.Lock()
        #: recent token lists' keys (``cache.clear()`` makes the next call hash afresh)
        self.cache: collections.OrderedDict[tuple[Any, ...], list[CacheKey]] = collections.OrderedDict()

    def prefix(self, tags: Mapping[str, str] | None = None) -> KeyPrefix:
        """The key prefix of requests with ``tags``."""
        frozen = tuple(sorted((tags or {}).items()))
        prefix = self._prefixes.get(frozen)
        if prefix is None:
            prefix = KeyPrefix.build(model=self.model, world_size=self.world_size, worker_rank=self.rank,
                                     dtype=self.dtype, layout=self.layout, tags=dict(frozen))
            self._prefixes[frozen] = prefix
        return prefix

    def of(self, tokens: Any, tags: Mapping[str, str] | None = None,
           spans: Sequence[tuple[int, int]] | None = None, *,
           hashes: Sequence[bytes] | None = None,
           segment_starts: Sequence[int] | None = None,
           num_tokens: int | None = None) -> list[CacheKey]:
        """Keys of every ``chunk_size`` tokens (a partial last one included), or of the
        given consecutive ``spans`` (from a segmenter).

        ``segment_starts`` (one per span) asks for segment keys instead of the
        prefix chain: each span's key depends only on its own segment's tokens
        (`segment_hashes`). Without it the keys are chained from token 0.

        ``hashes`` are the chunks' chained hashes when the caller has them (the
        vLLM scheduler hashes a request once and sends them): the keys are made
        from them, and the tokens are not read (``tokens`` may then be None, with
        ``num_tokens`` the count). They key fixed-size chunks only.
        """
        prefix = self.prefix(tags)
        if segment_starts is not None:
            if hashes is not None or spans is None or tokens is None:
                raise ValueError("segment keys need the spans and are hashed from the tokens, not given hashes")
            return prefix.keys(segment_hashes(tokens, spans, segment_starts, self.hash_fn))
        if hashes is not None:
            return self._given(prefix, len(tokens) if tokens is not None else int(num_tokens or 0), spans, hashes)
        if tokens is None:
            raise ValueError("keys of a request that came without its tokens need its chunk hashes")
        array_ = np.ascontiguousarray(tokens.numpy() if hasattr(tokens, "numpy") else np.asarray(tokens))
        num_tokens = len(array_)
        digest = xxhash.xxh3_128_digest(array_)  # no copy when contiguous
        size = self.chunk_size
        regular = spans is None or all(
            start == i * size and end == min(start + size, num_tokens) for i, (start, end) in enumerate(spans)
        )
        cache_key = (prefix, digest, num_tokens, None if regular else tuple(spans))
        with self._lock:
            keys = self.cache.get(cache_key)
            if keys is not None:
                self.cache.move_to_end(cache_key)
                return keys
        if regular:
            hashes = chain_hashes(tokens, size, self.hash_fn, partial=True)
        else:
            hashes = chain_span_hashes(tokens, spans, self.hash_fn)
        keys = prefix.keys(hashes)
        with self._lock:
            self.cache[cache_key] = keys
            while len(self.cache) > self._CACHED:
                self.cache.popitem(last=False)
        return keys

    def _given(self, prefix: KeyPrefix, num_tokens: int, spans: Sequence[tuple[int, int]] | None,
               hashes: Sequence[bytes]) -> list[CacheKey]:
        size = self.chunk_size
        if spans is None:
            spans = chunk_spans(num_tokens, size, save_partial=True)
        if not all(start == i * size and end == min(start + size, num_tokens) for i, (start, end) in enumerate(spans)):
            raise ValueError("chunk hashes given by the caller key fixed-size chunks only, not segments")
        if len(hashes) < len(spans):
            raise ValueError(f"{len(hashes)} chunk hashes given for {len(spans)} chunks")
        for chunk_hash in hashes[:len(spans)]:
            if not isinstance(chunk_hash, bytes) or len(chunk_hash) != self.hash_fn.digest_size:
                raise ValueError(f"a given chunk hash is not a {self.hash_fn.digest_size}-byte "
                                 f"{self.hash_fn.name} digest: {chunk_hash!r:.80}")
        return prefix.keys(hashes[:len(spans)])
