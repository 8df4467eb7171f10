"""vLLM in this process, with flowkv as its connector: what the demo, ``flowkv quality`` and the vLLM benchmarks share.

- the demo model (``DEMO_MODEL``: a random-weight Llama built locally once,
  in ``default_model_dir()``) and the demo workload (``documents``: Python
  standard-library sources, and ``QUESTIONS`` to ask about them);
- ``setup_environment`` (no model hub, every core, a small KV pool),
  ``build_llm`` (prefix caching off, so every reused token comes from the
  connector), ``flowkv_config`` (the ``KVTransferConfig`` selecting flowkv),
  ``time_to_first_token`` and ``shutdown``;
- ``kv_bytes_per_token`` of a model folder.

Imports vLLM only inside the functions that start it.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

__all__ = [
    "DEMO_MODEL",
    "QUESTIONS",
    "build_llm",
    "compare_generation",
    "default_model_dir",
    "documents",
    "flowkv_config",
    "kv_bytes_per_token",
    "model_config",
    "model_folder",
    "reference_margin",
    "setup_environment",
    "shutdown",
    "time_to_first_token",
]

DEMO_MODEL = dict(num_layers=4, hidden_size=1024, num_heads=16, num_kv_heads=4, intermediate_size=2816,
                  vocab_size=2048, max_position_embeddings=32768)
QUESTIONS = (
    "\n\nQuestion: Which functions does this module define, and what do they return?\nAnswer:",
    "\n\nQuestion: Summarize in one sentence what this code is for.\nAnswer:",
)


def default_model_dir() -> Path:
    """Where the demo model is built (``$FLOWKV_CACHE/models/demo-llama``, default under ``~/.cache/flowkv``)."""
    return Path(os.environ.get("FLOWKV_CACHE", Path.home() / ".cache" / "flowkv")) / "models" / "demo-llama"


def model_folder(model_dir: str | os.PathLike[str] | None = None) -> Path:
    """The model a command runs: the model in ``model_dir`` when that folder holds one (a user's own
    model, used as it is and never rebuilt), else the demo model, built there once. The default folder
    (``default_model_dir()``) always holds the demo model, rebuilt when its recipe changes."""
    folder = Path(model_dir).expanduser() if model_dir else default_model_dir()
    if (folder / "config.json").exists() and folder.resolve() != default_model_dir().resolve():
        return folder
    from flowkv.testing import tiny_model

    return tiny_model(folder, **DEMO_MODEL)


def model_config(model: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the model in folder ``model``."""
    return json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))


def setup_environment() -> None:
    """vLLM on this CPU: no hub, both cores, a small KV pool."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cores = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}" if cores > 1 else "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # vLLM's processes warn about torch deprecations


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of bf16 keys and values one token takes over all layers of the model in folder ``model``."""
    config = model_config(model)
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * heads * head_dim * 2


def documents(tokenizer: Any, count: int, doc_tokens: int) -> list[list[int]]:
    """``count`` documents of exactly ``doc_tokens`` tokens: standard-library sources, read locally."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)
    docs: list[list[int]] = []
    for path in sources:
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer.encode(f"Document: {path.name}\n\n{text}", add_special_tokens=False)
        if len(ids) >= doc_tokens:
            docs.append(ids[:doc_tokens])
        if len(docs) == count:
            return docs
    raise RuntimeError(f"found only {len(docs)} standard-library files of {doc_tokens} tokens")


def build_llm(model: Path, *, kv_transfer_config: Any = None, max_model_len: int | None = None,
              kv_cache_memory_bytes: int | None = None, enable_prefix_caching: bool = False) -> Any:
    """A vLLM engine for the model in folder ``model``; prefix caching off (unless asked for) so every reuse
    comes from the connector. ``max_model_len`` defaults to 16,384 tokens, or the model's own limit if lower."""
    from vllm import LLM

    if max_model_len is None:
        max_model_len = min(16384, int(model_config(model).get("max_position_embeddings") or 16384))
    kwargs: dict[str, Any] = {}
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    return LLM(
        model=str(model),
        dtype="bfloat16",
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        kv_transfer_config=kv_transfer_config,
        disable_log_stats=True,
        seed=0,
        **kwargs,
    )


def flowkv_config(pipeline: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="FlowKVConnector",
        kv_connector_module_path="flowkv.integration.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"pipeline": pipeline, **extra},
    )


def time_to_first_token(llm: Any, prompt_ids: list[int], *, skip_save: bool = False) -> tuple[float, int]:
    """Seconds to the first generated token of one prompt, and the tokens the connector served.

    ``skip_save`` asks flowkv not to store the prompt (a read-only request).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"flowkv.skip_save": True}} if skip_save else None
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
    started = time.perf_counter()
    [output] = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)
    return time.perf_counter() - started, int(output.num_cached_tokens or 0)


def shutdown(llm: Any) -> None:
    """Stop a vLLM engine and its processes before another starts.

    An engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) froze the heap it started with
    (``gc.freeze``, to shorten a long-lived server's collections): unfrozen, the stopped engine's
    model and KV pool are collected before the next engine allocates its own, and its distributed
    groups are torn down. An engine in processes of its own leaves this process's groups alone: they
    may be another engine's, running here.

    What is left is this process's own heap (vLLM, torch and the caller's objects), and it is frozen
    again: vLLM collects the whole heap several times while it starts an engine (around loading the
    model, before it freezes), each collection of a heap of vLLM's size ~0.4 s of CPU on its own; a
    frozen heap is not scanned, so the next engine's start pays for its own objects only.
    """
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.v1.engine.core_client import InprocClient

    core = llm.llm_engine.engine_core
    in_this_process = isinstance(core, InprocClient)
    try:
        core.shutdown()
    except Exception:
        pass
    del llm, core
    if in_this_process:
        cleanup_dist_env_and_memory()  # unfreezes, tears the groups down and collects
    else:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    """Once: the heap unfrozen when the program ends, so that its last collection frees what is left
    (else nanobind, whose objects triton holds, reports them as leaked at exit)."""
    atexit.register(gc.unfreeze)


def compare_generation(reference: Any, candidate: Any) -> dict[str, Any]:
    """Agreement and log-probability differences of one prompt's generation against the reference."""
    ref_tokens = list(reference.token_ids)
    new_tokens = list(candidate.token_ids)
    equal = sum(a == b for a, b in zip(ref_tokens, new_tokens))
    diffs = []
    for position, token in enumerate(ref_tokens):
        ref_lp = reference.logprobs[position].get(token)
        new_lp = candidate.logprobs[position].get(token) if position < len(candidate.logprobs) else None
        if ref_lp is not None and new_lp is not None:
            diffs.append(abs(ref_lp.logprob - new_lp.logprob))
        if position >= len(new_tokens) or new_tokens[position] != token:
            break  # past here the two generations have different contexts
    first_diff = next((i for i, (a, b) in enumerate(zip(ref_tokens, new_tokens)) if a != b), None)
    return {"equal": equal, "total": len(ref_tokens), "logprob_diffs": diffs, "first_difference": first_diff,
            "flip_margin": None if first_diff is None else reference_margin(reference.logprobs[first_diff])}


def reference_margin(logprobs: Any) -> float | None:
    """How far the reference's top token was ahead of its runner-up (nats) at one position.

    A lossy codec that changes a greedy token at a position whose margin is
    below its own ``max |dlogprob|`` flipped a near-tie, as any rounding can.
    """
    top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else None
