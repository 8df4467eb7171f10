"""Shared pieces of the tests that run flowkv inside a real vLLM (CPU build).

Each ``vllm.LLM`` start costs 20-50 s on two cores, so test modules share one
engine per module through these helpers. The tiny model is built once into a
cache folder (``FLOWKV_TEST_CACHE``, default ``~/.cache/flowkv/test-models``)
and reused across runs.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from flowkv import stage
from flowkv._testing.tiny_model import tiny_model
from flowkv.items import Chunk
from flowkv.pipeline import dumps_pipeline

BLOCK_SIZE = 128
CHUNK_SIZE = 256
# The tests run the tiny model in float32: a bf16 model's greedy tokens change with the batch a
# request lands in (near-ties flip, eager kernels more often than compiled ones), and the tests
# compare tokens across batches. float32 leaves no such near-ties on these prompts.
DTYPE = "float32"
# The tiny model's KV: 2 layers x 2 KV heads x 64 x (K, V) x float32 = 2 KiB per token.
KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2 * 4
KV_BYTES_PER_BLOCK = KV_BYTES_PER_TOKEN * BLOCK_SIZE

# How long the scheduler waits for the workers' lookup answer in tests: tests assert exact
# hit counts, and one answer later than the default 200 ms on a busy machine would be 0 hits.
# Readiness, not a performance claim; a test of the timeout itself sets its own.
LOOKUP_TIMEOUT_MS = 60_000

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")


def test_models() -> Path:
    """Where the tests build their models (``$FLOWKV_TEST_CACHE``, else ``~/.cache/flowkv/test-models``)."""
    return Path(os.environ.get("FLOWKV_TEST_CACHE", Path.home() / ".cache" / "flowkv" / "test-models"))


def tiny_model_dir() -> Path:
    """The tiny Llama the vLLM tests run, built on first use."""
    return tiny_model(test_models() / "tiny-llama-l2-h256")


def demo_model_dir() -> Path:
    """The demo model's folder in the tests' model cache (the CLI builds it there on first use)."""
    return test_models() / "demo-llama"


@contextlib.contextmanager
def own_environment() -> Iterator[None]:
    """The environment back as it was afterwards: ``flowkv demo`` and ``bench`` set vLLM's (log level,
    KV pool size) for their run; later tests get theirs back."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def make_llm(
    extra_config: dict[str, Any],
    *,
    kv_cache_blocks: int = 512,
    max_model_len: int = 4096,
    max_num_batched_tokens: int | None = None,
    connector: tuple[str, str] = ("FlowKVConnector", "flowkv.integration.vllm"),
    separate_processes: bool = False,
    **llm_kwargs: Any,
):
    """A ``vllm.LLM`` on the tiny model with flowkv as its KV connector.

    Prefix caching is off unless asked for, so ``RequestOutput.num_cached_tokens``
    counts exactly the tokens flowkv loaded. ``kv_cache_blocks`` sizes vLLM's
    KV pool in blocks. ``connector`` is the connector's (class name, module).
    The lookup timeout is ``LOOKUP_TIMEOUT_MS`` unless ``extra_config`` sets one.

    Engines are eager and, unless ``separate_processes``, run in the test's own process
    (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and the worker in-process,
    flowkv's scheduler and worker sides still talking over their sockets): a start then costs
    ~2 s instead of 20-40 s on two cores. ``separate_processes=True`` starts vLLM's default
    process layout (engine core and worker spawned), as ``vllm.LLM`` runs for a user.
    """
    extra_config = {"lookup_timeout_ms": LOOKUP_TIMEOUT_MS, **extra_config}
    if max_num_batched_tokens is not None:
        llm_kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    llm_kwargs.setdefault("enable_prefix_caching", False)
    llm_kwargs.setdefault("enforce_eager", True)
    llm_kwargs.setdefault("dtype", DTYPE)
    # vLLM's CPU platform lets this variable override kv_cache_memory_bytes.
    saved_space = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        with engine_processes(separate=separate_processes):
            return _make_llm(extra_config, kv_cache_blocks * KV_BYTES_PER_BLOCK, max_model_len, connector,
                             llm_kwargs)
    finally:
        if saved_space is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved_space


_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def engine_processes(*, separate: bool) -> Iterator[None]:
    """vLLM's process layout for the engines built inside: ``separate`` (engine core and worker
    spawned, vLLM's default) or all in this process. vLLM reads the variable while it builds the
    engine and then caches its variables (``envs.enable_envs_cache``): the cache is dropped first,
    so this engine reads the value set here."""
    from vllm import envs

    envs.disable_envs_cache()
    saved = os.environ.get(_MULTIPROCESSING)
    os.environ[_MULTIPROCESSING] = "1" if separate else "0"
    try:
        yield
    finally:
        envs.disable_envs_cache()
        if saved is None:
            os.environ.pop(_MULTIPROCESSING, None)
        else:
            os.environ[_MULTIPROCESSING] = saved


def _make_llm(extra_config: dict[str, Any], kv_bytes: int, max_model_len: int, connector: tuple[str, str],
              llm_kwargs: dict[str, Any]):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
        model=str(tiny_model_dir()),
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        seed=0,
        kv_cache_memory_bytes=kv_bytes,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector[0],
            kv_connector_module_path=connector[1],
            kv_role="kv_both",
            kv_connector_extra_config=extra_config,
        ),
        **llm_kwargs,
    )


def shutdown_llm(llm) -> None:
    """Stop vLLM's engine-core and worker processes now, not at interpreter exit (an engine in this
    process: its engine core, worker and flowkv connector, and free what it held)."""
    from flowkv.integration.harness import shutdown

    shutdown(llm)


def random_tokens(seed: int, count: int) -> list[int]:
    """Token ids drawn from the tiny model's vocabulary, skipping its 3 special tokens."""
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(count)]


def request(
    token_ids: Sequence[int],
    *,
    max_tokens: int = 16,
    tags: dict[str, str] | None = None,
    cache_salt: str | None = None,
    skip_save: bool = False,
) -> tuple[dict[str, Any], Any]:
    """A (prompt, greedy SamplingParams) pair carrying flowkv's per-request settings."""
    from vllm import SamplingParams

    params: dict[str, Any] = {f"flowkv.tag.{name}": value for name, value in (tags or {}).items()}
    if skip_save:
        params["flowkv.skip_save"] = True
    prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params else None,
    )
    return prompt, sampling


def generate(llm, requests: Sequence[tuple[dict[str, Any], Any]]) -> list[tuple[list[int], int]]:
    """Run requests as one batch; (generated token ids, num_cached_tokens) per request."""
    prompts = [prompt for prompt, _ in requests]
    params = [sampling for _, sampling in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(out.outputs[0].token_ids), out.num_cached_tokens) for out in outputs]


def stats(llm) -> dict[str, Any]:
    """The flowkv engine statistics of the LLM's worker (rank 0)."""
    from flowkv.integration.vllm import worker_stats

    return worker_stats(llm.llm_engine.vllm_config)


def pipeline_file(
    folder: Path, *, name: str, retrieve_before_get: Sequence[str] = (), retrieve_before_scatter: Sequence[str] = (),
) -> Path:
    """Write a local-cpu-like pipeline file; the named stages go into retrieve before ``get`` or ``scatter``."""
    path = folder / f"{name}.toml"
    path.write_text(
        dumps_pipeline(
            pipeline={"name": name, "chunk_size": CHUNK_SIZE},
            tiers={"memory": {"kind": "memory", "capacity": "256MiB"}},
            store=["tokenize", "chunk-hash", "allocate", "gather", ("compress", {"codec": "none"}), "put"],
            retrieve=["tokenize", "chunk-hash", "lookup", *retrieve_before_get, "get", "decompress",
                      *retrieve_before_scatter, "scatter"],
        ),
        encoding="utf-8",
    )
    return path


EVICT_TAG = "test_evict_chunk"


@stage("test-evict-chunk", kinds=("retrieve",), needs={"hit"}, gives={"hit"})
def evict_chunk(chunks: Iterator[Chunk], *, ctx) -> Iterator[Chunk]:
    """Remove one chunk from the memory tier after lookup found it, before ``get`` reads it.

    The chunk is the one whose index the request's ``test_evict_chunk`` tag
    names: what an eviction between vLLM's lookup and its load looks like to
    the rest of the retrieve pipeline. Requests without the tag pass untouched.

    TOML::

        [[retrieve.stages]]
        use = "vllm_helpers:evict_chunk"
    """
    for chunk in chunks:
        target = chunk.request.tags.get(EVICT_TAG)
        if target is not None and chunk.index == int(target) and chunk.key_str is not None:
            ctx.services.storage.remove(chunk.key_str)
        yield chunk


DROP_LAYER_TAG = "test_drop_layer"


@stage("test-drop-layer", kinds=("retrieve",), needs={"kv"}, gives={"kv"}, per_layer=True)
def drop_layer(chunks: Iterator[Chunk], *, ctx) -> Iterator[Chunk]:
    """Keep one layer of one chunk from reaching ``scatter`` in a layerwise retrieve.

    The request's ``test_drop_layer`` tag names ``"LAYER:CHUNK"``: that chunk
    misses that layer, what a transfer failing after the forward pass began
    looks like to the rest of the pipeline. Requests without the tag pass
    untouched. Runs once per layer (``per_layer``), so it must sit inside
    the per-layer block, before ``scatter``.

    TOML::

        [[retrieve.stages]]
        use = "vllm_helpers:drop_layer"
    """
    for chunk in chunks:
        target = chunk.request.tags.get(DROP_LAYER_TAG)
        if target is not None:
            layer, index = (int(part) for part in target.split(":"))
            if ctx.layer == layer and chunk.index == index:
                continue
        yield chunk


WRONG_KV_TAG = "test_wrong_kv"


@stage("test-wrong-kv", kinds=("retrieve",), needs={"kv"}, gives={"kv"})
def wrong_kv(chunks: Iterator[Chunk], *, ctx) -> Iterator[Chunk]:
    """Hand ``scatter`` wrong KV for requests tagged ``test_wrong_kv``: the canary of every test that
    compares greedy tokens after a hit (such a test proves something only if wrong KV changes them).

    ``shift``: each chunk's blocks one block late, as an off-by-one-block slot mapping would write
    them: a block holds the KV of the block before it, the first keeps its own, the last one's is
    lost. (Blocks merely swapped would change nothing: the tokens after a chunk attend to its KV
    as a set, positions being in the rotated keys, not in the slots.) ``stale``: each chunk gets the
    next chunk's KV (another document's bytes at these positions, as a mis-keyed entry would give);
    the last chunk keeps its own. The stored entries are never touched (new tensors). Requests
    without the tag pass untouched.

    TOML::

        [[retrieve.stages]]
        use = "vllm_helpers:wrong_kv"
    """
    import torch

    held: list[Chunk] = []
    for chunk in chunks:
        mode = chunk.request.tags.get(WRONG_KV_TAG)
        if mode is None or chunk.kv is None:
            yield from held
            held.clear()
            yield chunk
            continue
        if mode == "shift":
            late = chunk.kv.clone()
            late[:, :, BLOCK_SIZE:] = chunk.kv[:, :, :-BLOCK_SIZE]
            chunk.kv = late
            yield chunk
        elif mode == "stale":
            held.append(chunk)
            if len(held) == 2:
                first, second = held
                if first.kv.shape == second.kv.shape:
                    first.kv = second.kv.clone()
                yield first
                held[:] = [second]
        else:
            raise ValueError(f"{WRONG_KV_TAG} is 'shift' or 'stale', not {mode!r}")
    yield from held
