"""What the connector takes from vLLM's configuration and from each request.

- ``ConnectorSettings``: ``kv_connector_extra_config`` split into the keys the
  connector reads itself (``pipeline``, ``model_name``, ``ipc_dir``,
  ``async_loads``) and
  pipeline overrides by dotted path (the ``[vllm]`` table's ``save_decode``
  ``lookup_timeout_ms`` and ``remote_prefill_wait_ms`` may be given bare).
- ``Instance``: the vLLM instance a connector serves (its id, data-parallel
  rank and number of workers), which names the workers' lookup sockets.
- ``request_tags``: a request's cache-key tags and skip-save flag, from its
  ``kv_transfer_params``, ``cache_salt`` and LoRA adapter; ``request_recompute_ratio``
  its own blend ``recompute_ratio`` (``flowkv.blend.recompute_ratio``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowkv.integration._ipc import default_ipc_dir, socket_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = logging.getLogger("flowkv.integration")

__all__ = ["ConnectorSettings", "Instance", "request_recompute_ratio", "request_tags"]

DEFAULT_PIPELINE = "local-cpu"
TAG_PREFIX = "flowkv.tag."
SKIP_SAVE_KEY = "flowkv.skip_save"
# A request's own [blend] recompute_ratio (blend pipelines), in its kv_transfer_params.
RECOMPUTE_RATIO_KEY = "flowkv.blend.recompute_ratio"
# Extra-config keys the connector reads itself; every other key overrides the pipeline.
_CONNECTOR_KEYS = ("pipeline", "model_name", "ipc_dir", "async_loads")
# When vLLM waits for a load between steps instead of in the step that needs it.
ASYNC_LOADS = ("auto", "always", "off")
# Bare extra-config keys that live in the pipeline's [vllm] table.
_VLLM_SECTION_KEYS = ("save_decode", "lookup_timeout_ms", "remote_prefill_wait_ms")


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector takes from ``kv_connector_extra_config``."""

    pipeline: str
    # Pipeline settings by dotted path, passed on to the pipeline loader.
    overrides: dict[str, Any]
    model_name: str
    ipc_dir: Path
    # "auto": hits that lie (partly) below memory load asynchronously; "always": every hit; "off": none.
    async_loads: str = "auto"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, default_model: str) -> ConnectorSettings:
        """Split the extra config into connector keys and pipeline overrides."""
        extra = dict(extra or {})
        pipeline = extra.get("pipeline", DEFAULT_PIPELINE)
        if not isinstance(pipeline, (str, os.PathLike)) or not str(pipeline):
            raise ValueError(
                f"kv_connector_extra_config 'pipeline' must be a built-in pipeline name or a TOML path, "
                f"got {pipeline!r}"
            )
        model_name = extra.get("model_name", default_model)
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"kv_connector_extra_config 'model_name' must be a non-empty string, got {model_name!r}")
        async_loads = extra.get("async_loads", "auto")
        if async_loads not in ASYNC_LOADS:
            raise ValueError(f"kv_connector_extra_config 'async_loads' must be one of {', '.join(ASYNC_LOADS)}, "
                             f"got {async_loads!r}")
        overrides: dict[str, Any] = {}
        for key, value in extra.items():
            if key in _CONNECTOR_KEYS:
                continue
            if key == "controller" and isinstance(value, Mapping):
                # {"controller": {"url": ...}} sets the pipeline's [controller] table.
                overrides.update({f"controller.{name}": setting for name, setting in value.items()})
                continue
            overrides[f"vllm.{key}" if key in _VLLM_SECTION_KEYS else key] = value
        return cls(
            pipeline=str(pipeline),
            overrides=overrides,
            model_name=model_name,
            ipc_dir=Path(extra["ipc_dir"]) if extra.get("ipc_dir") else default_ipc_dir(),
            async_loads=async_loads,
        )

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> ConnectorSettings:
        """The settings of a vLLM configuration whose KV connector is flowkv."""
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config if transfer else None
        return cls.from_extra_config(extra, default_model=vllm_config.model_config.model)


@dataclass(frozen=True)
class Instance:
    """The vLLM instance a connector serves.

    The scheduler and every worker of one instance see the same
    ``instance_id``; each worker serves lookups on the socket of its rank.
    """

    instance_id: str
    dp_rank: int
    # Workers per data-parallel rank: tensor x pipeline parallel.
    world_size: int

    @classmethod
    def of(cls, vllm_config: VllmConfig) -> Instance:
        parallel = vllm_config.parallel_config
        return cls(
            instance_id=vllm_config.instance_id,
            dp_rank=parallel.data_parallel_rank,
            world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
        )

    def socket(self, ipc_dir: Path, rank: int) -> Path:
        """The lookup socket of worker ``rank``."""
        return socket_path(ipc_dir, self.instance_id, self.dp_rank, rank)


def request_tags(request: Request) -> tuple[dict[str, str], bool]:
    """Cache-key tags and the skip-save flag of a vLLM request."""
    tags: dict[str, str] = {}
    params = request.kv_transfer_params or {}
    for key, value in params.items():
        if isinstance(key, str) and key.startswith(TAG_PREFIX):
            name = key[len(TAG_PREFIX):]
            if not name:
                # Raising here would take down vLLM's engine core, not just this request.
                logger.warning("flowkv: ignoring kv_transfer_params key %r: it names no tag", key)
                continue
            tags[name] = str(value)
    if getattr(request, "cache_salt", None):
        tags["cache_salt"] = str(request.cache_salt)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        tags["lora"] = str(getattr(lora, "lora_name", None) or getattr(lora, "lora_int_id", ""))
    return tags, bool(params.get(SKIP_SAVE_KEY, False))


def request_recompute_ratio(request: Request) -> float | None:
    """A request's own ``recompute_ratio`` (``flowkv.blend.recompute_ratio`` in its
    ``kv_transfer_params``), None when it sets none or one outside 0..1 (then the pipeline's holds)."""
    value = (request.kv_transfer_params or {}).get(RECOMPUTE_RATIO_KEY)
    if value is None:
        return None
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        # Raising here would take down vLLM's engine core, not just this request.
        logger.warning("flowkv: ignoring %s=%r: a share between 0 and 1 is needed", RECOMPUTE_RATIO_KEY, value)
        return None
    return ratio


def whole_block_chunk_size(chunk_size: int, block_size: int | None, *, packed_blocks: bool) -> int:
    """The chunk size flowkv uses beside an engine whose blocks are packed: a multiple of the block size.

    vLLM's CPU backend packs each block's keys and values by ISA (on ``vec`` the keys are stored
    dimension-major), so the bytes of a chunk that ends inside a block carry parts of the tokens
    after its end, which its key does not cover: two requests that share a chunk but not the rest
    of its block would hand a third one a block mixed from both. Chunks of whole blocks never mix.
    Elsewhere (CUDA layouts keep one token per row) the configured size stands.

    >>> whole_block_chunk_size(64, 128, packed_blocks=True), whole_block_chunk_size(192, 128, packed_blocks=True)
    (128, 256)
    >>> whole_block_chunk_size(256, 128, packed_blocks=True), whole_block_chunk_size(64, 128, packed_blocks=False)
    (256, 64)
    """
    if not packed_blocks or not block_size or chunk_size % block_size == 0:
        return chunk_size
    return -(-chunk_size // block_size) * block_size

