"""A tiny random-weight Llama with a locally trained tokenizer, for tests.

Tests and benchmarks need a model that vLLM loads and runs in seconds on a
CPU, with no download: :func:`tiny_model` writes one into a folder and returns
the folder, which ``vllm.LLM(model=str(path))`` accepts as is.

>>> from flowkv._testing.tiny_model import tiny_model
>>> path = tiny_model("/tmp/flowkv-tiny")            # doctest: +SKIP
>>> # vllm.LLM(model=str(path), dtype="bfloat16", ...)

The weights are random but deterministic (``seed``), and scaled up from the
usual initialisation so that attention is sharp and the logits have wide
margins: greedy decoding then depends on the whole context (a wrong KV cache
shows up as different tokens) and is stable against the small numeric
differences between a full prefill and a prefill that reuses cached KV.

The tokenizer is a byte-level BPE trained on the source files of the Python
standard library that runs this code, so any text round-trips and nothing is
fetched from the network.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

# Bump when the recipe changes, so folders built by an older recipe are rebuilt.
_RECIPE_VERSION = 1
_SPEC_FILE = "flowkv_tiny_model.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
# Bounds the tokenizer's training text: enough for a varied 2k vocabulary,
# small enough to train in a couple of seconds.
_TRAINING_TEXT_BYTES = 3_000_000


def tiny_model(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int = 2048,
    dtype: str = "bfloat16",
    max_position_embeddings: int = 8192,
    seed: int = 0,
) -> Path:
    """Build (or reuse) a tiny Llama model folder at ``path`` and return it.

    The folder holds a Hugging Face model (``config.json``,
    ``model.safetensors``) and a ``PreTrainedTokenizerFast``. If ``path``
    already holds a complete model built with the same arguments, nothing is
    rebuilt; a folder built with other arguments is replaced. The build goes
    to a temporary sibling folder first, so a crash or a concurrent builder
    never leaves a half-written model behind.

    ``head_dim`` defaults to ``hidden_size // num_heads`` and
    ``intermediate_size`` to ``2 * hidden_size``.
    """
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}; pass head_dim"
            )
        head_dim = hidden_size // num_heads
    if intermediate_size is None:
        intermediate_size = 2 * hidden_size
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if vocab_size < 256 + len(_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below the 259 a byte-level tokenizer needs")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype={dtype!r}: expected 'bfloat16', 'float16' or 'float32'")
    for name, value in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("intermediate_size", intermediate_size),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if value <= 0:
            raise ValueError(f"{name}={value} must be positive")

    spec = {
        "recipe": _RECIPE_VERSION,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }
    target = Path(path)
    if _is_complete(target, spec):
        return target

    def build(staging: Path) -> None:
        _write_tokenizer(staging, vocab_size=vocab_size, max_length=max_position_embeddings)
        _write_model(staging, spec)
        (staging / _SPEC_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")

    return build_folder(target, lambda folder: _is_complete(folder, spec), build)


def build_folder(target: Path, complete: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """Have `build` write a model folder, then move it to `target`; returns `target`.

    The build goes to a temporary sibling folder first, so a crash never
    leaves a half-written model behind. Builders of one folder take turns (a
    lock file beside it): one that waited for another finds the folder
    complete and returns it, so a model that takes minutes to train is
    trained once, however many processes ask for it at the same time (the
    test command builds the trained model beside the suite; the tests that
    need it wait here).
    """
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a builder dies
        if target.exists() and complete(target):
            return target
        return _build_folder(target, complete, build)


def _build_folder(target: Path, complete: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
    try:
        build(staging)
        if target.exists():
            if complete(target):  # a concurrent builder won the race
                return target
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not complete(target):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(folder: Path, spec: dict) -> bool:
    if not all((folder / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        return json.loads((folder / _SPEC_FILE).read_text()) == spec
    except (OSError, ValueError):
        return False


def _training_texts() -> list[str]:
    """Source text of the running Python's standard library, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for source in sorted(stdlib.glob("*.py")):
        try:
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= _TRAINING_TEXT_BYTES:
            break
    if not texts:
        raise RuntimeError(f"no Python source found under {stdlib} to train the tokenizer on")
    return texts


def _write_tokenizer(folder: Path, *, vocab_size: int, max_length: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_texts(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_length,
    )
    tokenizer.save_pretrained(folder)


def _write_model(folder: Path, spec: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = spec["hidden_size"]
    config = LlamaConfig(
        vocab_size=spec["vocab_size"],
        hidden_size=hidden,
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"],
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=spec["dtype"],
        # Random weights: the usual 0.02 gives near-uniform attention, so the
        # output hardly depends on tokens far back; 1/sqrt(hidden) makes a
        # change 1,000 tokens back change the next logits by ~10.
        initializer_range=hidden**-0.5,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec["seed"])
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            # Wide logit margins keep greedy decoding stable against the
            # rounding differences between full and cache-reusing prefills.
            model.lm_head.weight.mul_(4.0)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(getattr(torch, spec["dtype"]))
    model.save_pretrained(folder, safe_serialization=True)
