"""Each request's chunk hashes, worked out once in vLLM's scheduler process.

A lookup, a load and a save name a request's chunks by their chained hashes
(32 bytes a chunk with ``sha256_cbor``), not by their tokens: the scheduler
hashes a request's chunks once, as its tokens become known, and ships the
hashes; each worker puts its own key prefix (model, rank, dtype, layout,
tags) in front of them. Nothing is hashed twice, and no step ships the
tokens a request had before it::

    request tokens  |--chunk 0--|--chunk 1--|--chunk 2--|-part-|
    ChunkChain      [ h0,         h1,         h2        ]        (full chunks, extended as tokens come)
    hashes(2, 3)                              [ h2 ]
    hashes(2, 3, partial=True)                [ h2,        H(h2, part) ]

**vLLM's own block hashes.** vLLM hashes every request's full blocks for its
prefix cache (``Request.block_hashes``). They *are* flowkv's chunk hashes,
and the chain takes them instead of hashing, when every one of these holds
(``VllmBlockHashes`` checks them):

- flowkv hashes with ``sha256_cbor`` and so does vLLM
  (``--prefix-caching-hash-algo sha256_cbor``; vLLM's default ``sha256``
  pickles its input, another digest);
- ``chunk_size`` equals vLLM's block size, so both chain over the same spans;
- vLLM's root hash (``NONE_HASH``) is flowkv's: vLLM derives it from a fixed
  seed for ``sha256_cbor`` unless ``PYTHONHASHSEED`` is set; checked once by
  hashing a block with vLLM's own ``hash_block_tokens``;
- the request has no extra keys: no LoRA adapter, no ``cache_salt``, no
  multimodal inputs, no prompt embeddings. vLLM mixes those into its hashes;
  flowkv keeps LoRA and salt in the key prefix (as tags) instead. Its first
  block's hash must also equal flowkv's (one chunk hashed per request, in
  case a later vLLM adds another extra key).

Otherwise the chain hashes the tokens itself, once per request. Pipelines that
cut chunks their own way (a segmenter in place of ``tokenize``) key chunks by
content the scheduler does not see: for them ``keyed_pipeline`` is False and
the connector ships tokens, as the engine hashes them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flowkv.keys import chain_hashes, default_hash_function_name, get_hash_function
from flowkv.registry import Facet

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from flowkv.pipeline_model import Pipeline, StageSpec

logger = logging.getLogger("flowkv.integration")

__all__ = ["ChunkChain", "VllmBlockHashes", "keyed_pipeline"]

def keyed_pipeline(pipeline: Pipeline) -> bool:
    """Whether every stage list keys fixed-size chunks by chained hash, so a caller's hashes can
    stand for the tokens: each list has a keyer (a stage that gives ``key``), and it and every
    stage before it declares ``accepts_hashes`` (``tokenize``, ``chunk-hash``; never a segmenter)."""
    return all(_keyed_list(pipeline.stages(kind)) for kind in ("store", "retrieve", "lookup"))


def _keyed_list(specs: Sequence[StageSpec]) -> bool:
    for spec in specs:
        if not spec.info.accepts_hashes:
            return False
        if Facet.KEY in spec.info.gives:
            return True
    return False


def _hash_name(pipeline: Pipeline) -> str:
    name = pipeline.section.hash
    return default_hash_function_name() if name == "auto" else name


class VllmBlockHashes:
    """Decides whether a request's ``block_hashes`` are flowkv's chunk hashes (see the module)."""

    def __init__(self, vllm_config: VllmConfig, pipeline: Pipeline) -> None:
        self.chunk_size = pipeline.chunk_size
        self.hash_fn = get_hash_function(_hash_name(pipeline))
        reasons = []
        if self.hash_fn.name != "sha256_cbor":
            reasons.append(f"flowkv hashes with {self.hash_fn.name}")
        algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
        if algo != "sha256_cbor":
            reasons.append(f"vLLM hashes with {algo} (--prefix-caching-hash-algo sha256_cbor would match)")
        block_size = vllm_config.cache_config.block_size
        if block_size != self.chunk_size:
            reasons.append(f"chunk size {self.chunk_size} is not vLLM's block size {block_size}")
        # None until the first request: vLLM sets its root hash after it built the connector.
        self._usable: bool | None = False if reasons else None
        self.why_not = "; ".join(reasons)

    def usable(self, request: Request) -> bool:
        """Whether ``request.block_hashes`` may stand for flowkv's chunk hashes of its tokens."""
        if self._usable is None:
            self._usable = self._same_root()
            if not self._usable:
                logger.info("flowkv: chunk hashes are flowkv's own, not vLLM's block hashes: %s", self.why_not)
        if not self._usable:
            return False
        if (getattr(request, "lora_request", None) is not None or getattr(request, "cache_salt", None)
                or getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None):
            return False
        blocks = request.block_hashes
        if not blocks:
            return False
        own = chain_hashes(request.all_token_ids[:self.chunk_size], self.chunk_size, self.hash_fn, partial=False)
        return bytes(blocks[0]) == own[0]

    def _same_root(self) -> bool:
        try:
            from vllm.utils.hashing import sha256_cbor
            from vllm.v1.core.kv_cache_utils import hash_block_tokens
        except ImportError:
            self.why_not = "this vLLM has no hash_block_tokens"
            return False
        probe = list(range(1, self.chunk_size + 1))
        try:
            theirs = bytes(hash_block_tokens(sha256_cbor, None, probe, None))
        except Exception as exc:  # NONE_HASH not set yet, or another signature
            self.why_not = f"vLLM's hash_block_tokens failed: {exc}"
            return False
        if theirs != chain_hashes(probe, self.chunk_size, self.hash_fn)[0]:
            self.why_not = "vLLM's root hash differs from flowkv's (is PYTHONHASHSEED set?)"
            return False
        logger.info("flowkv: lookups, loads and saves use vLLM's block hashes as chunk hashes")
        return True


class ChunkChain:
    """The chained hashes of one request's full chunks, from token 0; grown as tokens come."""

    __slots__ = ("_fn", "_size", "_vllm", "full")

    def __init__(self, request: Request, chunk_size: int, hash_fn: Any, vllm: VllmBlockHashes | None) -> None:
        self._size = chunk_size
        self._fn = hash_fn
        # vLLM's block hashes, when they are flowkv's for this request (decided once).
        self._vllm = vllm is not None and vllm.usable(request)
        #: hashes of chunks [0, len(full)), each over chunk_size tokens
        self.full: list[bytes] = []

    @property
    def from_vllm(self) -> bool:
        return self._vllm

    def extend(self, request: Request, num_chunks: int) -> None:
        """Hash the request's full chunks up to ``num_chunks`` (no-op for those already known)."""
        have = len(self.full)
        if num_chunks <= have:
            return
        if self._vllm and len(request.block_hashes) >= num_chunks:
            self.full.extend(bytes(h) for h in request.block_hashes[have:num_chunks])
            return
        size = self._size
        tokens = request.all_token_ids[have * size:num_chunks * size]
        parent = self.full[-1] if self.full else None
        self.full.extend(chain_hashes(tokens, size, self._fn, partial=False, parent=parent))

    def hashes(self, request: Request, start: int, end: int) -> list[bytes]:
        """Hashes of the chunks covering tokens ``[start, end)``: ``start`` on a chunk
        boundary, ``end`` anywhere (a partial last chunk is hashed, not kept)."""
        size = self._size
        assert start % size == 0, f"chunk hashes start on a chunk boundary, not at token {start}"
        full_end = end // size
        self.extend(request, full_end)
        out = self.full[start // size:full_end]
        if end % size:
            parent = self.full[full_end - 1] if full_end else None
            out += chain_hashes(request.all_token_ids[full_end * size:end], size, self._fn, parent=parent)
        return out
