"""What a flowkv worker answers on its socket, and asking it from tools and tests.

Each worker serves on its own Unix socket (``flowkv.integration._ipc``):
``lookup`` (tokens or chunk hashes) and ``release`` from the scheduler-side connector, ``stats``,
``flush_traces`` and ``ping`` from anyone (``worker_stats``,
``flush_worker_traces``). ``answer`` is the worker's side of every question.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flowkv.integration._ipc import query_worker
from flowkv.integration.vllm.settings import ConnectorSettings, Instance

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["answer", "flush_worker_traces", "pack_hashes", "unpack_hashes", "worker_socket", "worker_stats"]


def pack_hashes(hashes: list[bytes]) -> np.ndarray:
    """Chunk hashes as an IPC body: their bytes end to end (the transport sends int64 words;
    every digest is a whole number of them)."""
    return np.frombuffer(b"".join(hashes), dtype="<i8")


def unpack_hashes(body: np.ndarray, digest_size: int) -> list[bytes]:
    """The chunk hashes ``pack_hashes`` sent."""
    raw = body.tobytes()
    if len(raw) % digest_size:
        raise ValueError(f"a body of {len(raw)} bytes is not whole {digest_size}-byte chunk hashes")
    return [raw[i:i + digest_size] for i in range(0, len(raw), digest_size)]


def answer(engine: Any, engine_lock: threading.Lock, header: dict[str, Any], tokens: np.ndarray) -> dict[str, Any]:
    """A worker's reply to one IPC request (runs on the server thread; ``engine`` is its ``CacheEngine``).

    A lookup carries the request's tokens, or (with ``num_tokens`` in the
    header) its chunk hashes, which the scheduler worked out once.
    """
    op = header.get("op")
    if op == "lookup":
        keyed = "num_tokens" in header
        counted = header.get("counted")
        with engine_lock:
            found = engine.lookup_result(
                None if keyed else torch.from_numpy(tokens.copy()),
                chunk_hashes=unpack_hashes(tokens, engine.hash_fn.digest_size) if keyed else None,
                num_tokens=int(header["num_tokens"]) if keyed else None,
                pin=True, tags=header.get("tags") or None, lookup_id=header["lookup_id"],
                counted=tuple(counted) if counted and counted[0] else None,
            )
        return {"hit_tokens": found.hit_tokens, "memory_tokens": found.memory_tokens}
    if op == "release":
        with engine_lock:
            engine.release(header["lookup_id"])
        return {}
    if op == "stats":
        with engine_lock:
            return {"stats": engine.stats(), "healthy": bool(engine.is_healthy())}
    if op == "flush_traces":
        from flowkv import telemetry

        telemetry.flush()
        return {}
    if op == "ping":
        return {}
    raise ValueError(f"unknown flowkv IPC op {op!r}")


def worker_socket(vllm_config: VllmConfig, rank: int = 0) -> Path:
    """The lookup socket of one worker of a running vLLM instance."""
    return Instance.of(vllm_config).socket(ConnectorSettings.of(vllm_config).ipc_dir, rank)


def flush_worker_traces(vllm_config: VllmConfig, rank: int = 0, *, timeout_ms: int = 10000) -> None:
    """Make one worker of a running vLLM instance export every span it finished.

    Trace files (``[telemetry] exporter = "file"``) are complete up to now
    when this returns; for tools and tests that read them while vLLM runs.
    """
    query_worker(worker_socket(vllm_config, rank), "flush_traces", timeout_ms=timeout_ms)


def worker_stats(vllm_config: VllmConfig, rank: int = 0, *, timeout_ms: int = 5000) -> dict[str, Any]:
    """The flowkv engine statistics of one worker of a running vLLM instance.

    >>> llm = vllm.LLM(model=..., kv_transfer_config=...)          # doctest: +SKIP
    >>> worker_stats(llm.llm_engine.vllm_config)["tiers"]["memory"]["pinned_objects"]  # doctest: +SKIP
    0
    """
    return query_worker(worker_socket(vllm_config, rank), "stats", timeout_ms=timeout_ms)["stats"]
