"""A small Llama trained here, on the CPU, on Python standard-library sources.

The random-weight models of :mod:`flowkv._testing.tiny_model` are right for
fast tests, but their logits are nearly tied at many positions, so what a
lossy KV codec does to them says little about a real model. This module
trains a reference model locally and deterministically, like the tokenizer,
with no download: a 4-layer Llama (hidden size 256, 4.2M parameters) with
grouped-query attention (4 query heads, 2 KV heads, head size 64) trained
with torch on the CPU on the sources of the Python standard library that
runs this code, for about four minutes on two cores.

>>> from flowkv._testing.trained_model import trained_model
>>> path = trained_model()                       # doctest: +SKIP
>>> # vllm.LLM(model=str(path), dtype="bfloat16", ...)

The build is keyed by its recipe: :data:`RECIPE` (architecture, data split,
optimizer, steps, seed), this module's ``_RECIPE_VERSION`` and a digest of
the training text. The folder is ``~/.cache/flowkv/models/trained-llama-
<digest>`` (``FLOWKV_CACHE`` moves the root), so a changed recipe builds a
new model and an unchanged one is reused. Training is deterministic for a
recipe on a given CPU and torch build: seeded, single process, a fixed
number of threads, fixed data order.

Held out from training: the first 36 standard-library files by name, the
files that the prompts of ``flowkv quality`` (32 documents of 1,024
tokens) and the documents of ``flowkv demo`` (4 of 3,000) are cut from, so
the model is measured on text it never saw (:func:`held_out_sources`). They
also give the held-out loss and the sample continuation in the build's
report (``flowkv_trained_model.json`` in the folder).

Run ``python -m flowkv._testing.trained_model`` to build it with a progress
bar and print the report.

The model this recipe built here ships beside this module
(``flowkv/_testing/trained-llama/``, 8 MB, with its build report): where the
recipe digest matches it (the same recipe, code version and training text,
i.e. the same Python standard library) it is copied into the cache instead of
trained, which saves the set-up several minutes of two busy cores and gives
every machine the weights the shipped quality records measured. Anywhere
else, or with ``FLOWKV_TRAIN=1``, the model is trained. After a change to the
recipe, ``python -m flowkv._testing.trained_model --ship`` trains it and
replaces the shipped copy.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowkv._testing.tiny_model import build_folder

# Bump when the training code changes in a way RECIPE does not show.
_RECIPE_VERSION = 1
_STAMP_FILE = "flowkv_trained_model.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", _STAMP_FILE)
# The first files by name, from which flowkv.integration.harness.documents cuts the quality prompts and the
# demo's documents (32 of the first 36 have 1,024 tokens): 290k of the 1.47M tokens.
_HELD_OUT_FILES = 36

#: Everything that decides the weights. Sized to train in about four minutes
#: on two cores (~13k tokens/s): at this budget (2.7M tokens) a smaller model
#: learns faster per token than a wider or deeper one, and head size 64 with
#: two KV heads keeps the KV cache's shape realistic for quantization.
#: Attention over long windows dominates the cost, so most steps use short
#: windows and the last phase teaches the model the positions that
#: ``flowkv quality`` prompts reach (1,024 + 24 prompt tokens, 16 generated).
RECIPE: dict[str, Any] = {
    "model": {
        "num_layers": 4,
        "hidden_size": 256,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
        "vocab_size": 2048,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
    },
    "data": {
        "source": "the running Python's standard library, top-level *.py, sorted by name",
        "held_out": f"the first {_HELD_OUT_FILES} files",
        "document_format": "Document: NAME\\n\\nTEXT</s>",
    },
    "train": {
        "seed": 0,
        "threads": 2,
        "dtype": "bfloat16",  # weights and activations; the optimizer keeps fp32 master weights
        "phases": [  # (tokens per window, windows per step, steps)
            {"seq_len": 256, "batch": 16, "steps": 600},
            {"seq_len": 1152, "batch": 4, "steps": 60},
        ],
        "lr": 3e-3,
        "min_lr": 3e-4,
        "warmup_steps": 30,
        "weight_decay": 0.1,
        "betas": [0.9, 0.95],
        "grad_clip": 1.0,
        "init_std": 0.02,
    },
    # Held-out loss over the first windows of the held-out files; the sample continues code from
    # the middle of one (the first held-out file opens with a long docstring).
    "eval": {"seq_len": 1024, "windows": 16, "sample_document": 8, "sample_start": 440, "sample_prompt_tokens": 160,
             "sample_tokens": 48},
}


def default_dir() -> Path:
    """Where trained models are cached: ``$FLOWKV_CACHE/models`` (default ``~/.cache/flowkv/models``)."""
    return Path(os.environ.get("FLOWKV_CACHE", Path.home() / ".cache" / "flowkv")) / "models"


# -- data ------------------------------------------------------------------------------


def _sources() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(stdlib.glob("*.py"), key=lambda p: p.name)
    if not sources:
        raise RuntimeError(f"no Python source found under {stdlib} to train on")
    return sources


def _document(path: Path) -> str:
    return f"Document: {path.name}\n\n{path.read_text(encoding='utf-8', errors='replace')}"


def training_sources() -> list[Path]:
    """The standard-library files the model trains on."""
    return _sources()[_HELD_OUT_FILES:]


def held_out_sources() -> list[Path]:
    """The standard-library files the model never sees in training: the first by name, which
    ``flowkv quality``'s default prompts and ``flowkv demo``'s documents come from."""
    return _sources()[:_HELD_OUT_FILES]


def recipe_digest() -> str:
    """sha256 over the recipe, the code version and the text the model trains and is evaluated on."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"version": _RECIPE_VERSION, "recipe": RECIPE}, sort_keys=True).encode())
    for path in _sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# -- the model being trained ---------------------------------------------------------


def _build_module(spec: dict[str, Any]) -> Any:
    """A Llama as torch modules, with fused q/k/v and gate/up projections for speed on the CPU.

    `_hf_state_dict` splits them into the Hugging Face Llama names vLLM loads.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    heads, kv_heads, head_dim = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    hidden, inter, eps = spec["hidden_size"], spec["intermediate_size"], spec["rms_norm_eps"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_norm = nn.Parameter(torch.ones(hidden))
            self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
            self.o = nn.Linear(heads * head_dim, hidden, bias=False)
            self.post_norm = nn.Parameter(torch.ones(hidden))
            self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
            self.down = nn.Linear(inter, hidden, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            batch, seq, _ = x.shape
            y = F.rms_norm(x, (hidden,), self.input_norm, eps)
            qkv = self.qkv(y).view(batch, seq, heads + 2 * kv_heads, head_dim).transpose(1, 2)
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(attn.transpose(1, 2).reshape(batch, seq, heads * head_dim))
            gate, up = self.gate_up(F.rms_norm(x, (hidden,), self.post_norm, eps)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(spec["vocab_size"], hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(spec["num_layers"]))
            self.norm = nn.Parameter(torch.ones(hidden))
            self.head = nn.Linear(hidden, spec["vocab_size"], bias=False)
            inv_freq = spec["rope_theta"] ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
            angles = torch.arange(spec["max_position_embeddings"], dtype=torch.float64)[:, None] * inv_freq[None]
            angles = torch.cat([angles, angles], dim=-1)
            self.register_buffer("cos", angles.cos().float(), persistent=False)
            self.register_buffer("sin", angles.sin().float(), persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            seq = ids.shape[1]
            x = self.embed(ids)
            cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
            for block in self.blocks:
                x = block(x, cos, sin)
            return self.head(F.rms_norm(x, (hidden,), self.norm, eps))

    return Llama()


def _rope(x: Any, cos: Any, sin: Any) -> Any:
    """Rotary embedding as Hugging Face's Llama applies it (halves, not interleaved pairs)."""
    import torch

    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def _init_weights(model: Any, spec: dict[str, Any], std: float) -> None:
    import torch

    residual_std = std / math.sqrt(2 * spec["num_layers"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm"):
                param.fill_(1.0)
            elif name.endswith(("o.weight", "down.weight")):
                param.normal_(0.0, residual_std)
            else:
                param.normal_(0.0, std)


def _hf_state_dict(model: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The trained weights under Hugging Face ``LlamaForCausalLM`` names, contiguous, in bf16."""
    import torch

    heads, kv_heads, head_dim = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    out = {
        "model.embed_tokens.weight": model.embed.weight,
        "model.norm.weight": model.norm,
        "lm_head.weight": model.head.weight,
    }
    for index, block in enumerate(model.blocks):
        prefix = f"model.layers.{index}."
        q, k, v = block.qkv.weight.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        gate, up = block.gate_up.weight.chunk(2)
        out.update({
            prefix + "input_layernorm.weight": block.input_norm,
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": block.o.weight,
            prefix + "post_attention_layernorm.weight": block.post_norm,
            prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": block.down.weight,
        })
    return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in out.items()}


def _hf_config(spec: dict[str, Any], digest: str) -> dict[str, Any]:
    """config.json, written by us so that its bytes depend on the recipe only.

    ``flowkv_recipe_sha256`` sets it apart from any other model's config,
    the random-weight models of the same shape included: the quality gate
    tells models apart by this file.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_layers"],
        "num_attention_heads": spec["num_heads"],
        "num_key_value_heads": spec["num_kv_heads"],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": spec["max_position_embeddings"],
        "rms_norm_eps": spec["rms_norm_eps"],
        "rope_parameters": {"rope_theta": spec["rope_theta"], "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "dtype": "bfloat16",
        "use_cache": True,
        "flowkv_recipe_sha256": digest,
    }


# -- training ----------------------------------------------------------------------------


def _token_stream(tokenizer: Any, sources: list[Path]) -> Any:
    import torch

    ids: list[int] = []
    for path in sources:
        ids += tokenizer.encode(_document(path), add_special_tokens=False, verbose=False)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def _lr(step: int, total: int, train: dict[str, Any]) -> float:
    """Linear warm-up, then cosine from ``lr`` down to ``min_lr``."""
    if step < train["warmup_steps"]:
        return train["lr"] * (step + 1) / train["warmup_steps"]
    progress = (step - train["warmup_steps"]) / max(1, total - train["warmup_steps"])
    return train["min_lr"] + 0.5 * (train["lr"] - train["min_lr"]) * (1 + math.cos(math.pi * progress))


def _train(model: Any, stream: Any, train: dict[str, Any], progress: bool) -> list[float]:
    """Train `model` (bf16) in place; returns the loss of every step."""
    import torch
    from torch.nn import functional as F

    params = list(model.parameters())
    master = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    decay = [m for m, p in zip(master, params) if p.dim() >= 2]
    no_decay = [m for m, p in zip(master, params) if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train["lr"], betas=tuple(train["betas"]), foreach=True,
    )
    generator = torch.Generator().manual_seed(train["seed"] + 1)
    total = sum(phase["steps"] for phase in train["phases"])
    losses: list[float] = []
    bar = _progress(total, "training the flowkv reference model", progress)
    step = 0
    try:
        for phase in train["phases"]:
            seq, batch = phase["seq_len"], phase["batch"]
            for _ in range(phase["steps"]):
                starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=generator)
                windows = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])
                for group in optimizer.param_groups:
                    group["lr"] = _lr(step, total, train)
                logits = model(windows[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())
                loss.backward()
                for m, p in zip(master, params):
                    m.grad = p.grad.float()
                    p.grad = None
                torch.nn.utils.clip_grad_norm_(master, train["grad_clip"], foreach=True)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m)
                losses.append(float(loss.detach()))
                step += 1
                bar.set_postfix(loss=f"{losses[-1]:.3f}", seq=seq, refresh=False)
                bar.update(1)
    finally:
        bar.close()
    return losses


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, leave=True)


def _evaluate(model: Any, stream: Any, spec: dict[str, Any]) -> dict[str, float]:
    """Mean loss (nats per token) over non-overlapping held-out windows, overall and by position."""
    import torch
    from torch.nn import functional as F

    seq, count = spec["seq_len"], spec["windows"]
    count = min(count, (stream.numel() - 1) // seq)
    windows = torch.stack([stream[i * seq : i * seq + seq + 1] for i in range(count)])
    losses = []
    with torch.no_grad():
        for window in windows.split(4):
            logits = model(window[:, :-1]).float()
            losses.append(F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten(), reduction="none")
                          .view(window.shape[0], seq))
    per_token = torch.cat(losses)
    quarter = seq // 4
    return {
        "held_out_loss": float(per_token.mean()),
        "held_out_loss_first_quarter": float(per_token[:, :quarter].mean()),
        "held_out_loss_last_quarter": float(per_token[:, -quarter:].mean()),
        "held_out_tokens": int(per_token.numel()),
    }


def _greedy(model: Any, ids: list[int], tokens: int) -> list[int]:
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(tokens):
            out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids):]


# -- the folder ------------------------------------------------------------------------


def _is_complete(folder: Path, digest: str) -> bool:
    if not all((folder / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        return json.loads((folder / _STAMP_FILE).read_text())["recipe_sha256"] == digest
    except (OSError, ValueError, KeyError):
        return False


def model_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """The folder the current recipe's model lives in (built or not)."""
    return Path(root or default_dir()) / f"trained-llama-{recipe_digest()[:12]}"


def report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The build report of a trained model folder: recipe, held-out loss, sample, build time."""
    return json.loads((Path(path) / _STAMP_FILE).read_text())


#: The model this recipe built, shipped with the code (used where its recipe digest matches).
SHIPPED_DIR = Path(__file__).with_name("trained-llama")


def trained_model(root: str | os.PathLike[str] | None = None, *, progress: bool = True, train: bool = False) -> Path:
    """Build (once) the trained reference model under ``root`` and return its folder.

    ``root`` defaults to :func:`default_dir`. The folder's name carries the
    recipe digest, so a folder that exists and is complete is the model of
    this recipe and is reused; otherwise the shipped build (`SHIPPED_DIR`) is
    copied there when it is this recipe's, else the model is trained. The
    build goes to a temporary sibling first (`flowkv._testing.tiny_model.
    build_folder`), so a crash never leaves a half-written model, and
    concurrent builders take turns.
    """
    digest = recipe_digest()
    target = model_dir(root)
    if _is_complete(target, digest):
        return target
    if not train and os.environ.get("FLOWKV_TRAIN") != "1" and _is_complete(SHIPPED_DIR, digest):
        return build_folder(target, lambda folder: _is_complete(folder, digest), _copy_shipped)
    return build_folder(target, lambda folder: _is_complete(folder, digest),
                        lambda staging: _build(staging, digest, progress))


def _copy_shipped(staging: Path) -> None:
    for name in sorted(os.listdir(SHIPPED_DIR)):
        shutil.copyfile(SHIPPED_DIR / name, staging / name)


def ship(path: Path) -> Path:
    """Replace the shipped copy with the model in ``path`` (a complete build of this recipe)."""
    if not _is_complete(path, recipe_digest()):
        raise ValueError(f"{path} is not a complete build of the current recipe")
    if SHIPPED_DIR.exists():
        shutil.rmtree(SHIPPED_DIR)
    SHIPPED_DIR.mkdir()
    for name in (*_REQUIRED_FILES, "generation_config.json"):
        if (path / name).is_file():
            shutil.copyfile(path / name, SHIPPED_DIR / name)
    return SHIPPED_DIR


def _build(folder: Path, digest: str, progress: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from flowkv._testing.tiny_model import _write_tokenizer

    spec, train = RECIPE["model"], RECIPE["train"]
    started = time.perf_counter()
    _write_tokenizer(folder, vocab_size=spec["vocab_size"], max_length=spec["max_position_embeddings"])
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    train_stream = _token_stream(tokenizer, training_sources())
    held_out_stream = _token_stream(tokenizer, held_out_sources())

    threads = torch.get_num_threads()
    rng_state = torch.random.get_rng_state()
    try:
        torch.set_num_threads(train["threads"])
        torch.manual_seed(train["seed"])
        model = _build_module(spec)
        _init_weights(model, spec, train["init_std"])
        model = model.to(getattr(torch, train["dtype"]))
        losses = _train(model, train_stream, train, progress)
        model.eval()
        evaluation = _evaluate(model, held_out_stream, RECIPE["eval"])
        evaluation_spec = RECIPE["eval"]
        sample_source = held_out_sources()[evaluation_spec["sample_document"]]
        start = evaluation_spec["sample_start"]
        sample_ids = tokenizer.encode(_document(sample_source), add_special_tokens=False, verbose=False)[
            start : start + evaluation_spec["sample_prompt_tokens"]]
        continuation = _greedy(model, sample_ids, evaluation_spec["sample_tokens"])
        state = _hf_state_dict(model, spec)
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng_state)

    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_hf_config(spec, digest), indent=2, sort_keys=True) + "\n")
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2) + "\n")
    weights = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    stamp = {
        "recipe_sha256": digest,
        "recipe_version": _RECIPE_VERSION,
        "recipe": RECIPE,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "weights_sha256": weights,
        "parameters": sum(t.numel() for t in state.values()),
        "training_tokens_seen": sum(p["seq_len"] * p["batch"] * p["steps"] for p in train["phases"]),
        "training_stream_tokens": int(train_stream.numel()),
        "final_train_loss": sum(losses[-10:]) / len(losses[-10:]),
        **evaluation,
        "sample_source": sample_source.name,
        "sample_prompt": tokenizer.decode(sample_ids),
        "sample_continuation": tokenizer.decode(continuation),
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    (folder / _STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flowkv._testing.trained_model",
                                     description="Build (once) the trained reference model and print its report.")
    parser.add_argument("--root", help=f"models folder (default {default_dir()})")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, print only the folder")
    parser.add_argument("--ship", action="store_true",
                        help=f"train it anew (in a temporary folder) and make it the shipped copy in {SHIPPED_DIR}")
    args = parser.parse_args(argv)
    if args.ship:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="flowkv-ship-") as folder:
            path = ship(trained_model(folder, progress=not args.quiet, train=True))
    else:
        path = trained_model(args.root, progress=not args.quiet)
    if args.quiet:
        print(path)
        return 0
    info = report(path)
    print(f"trained reference model: {path}")
    print(f"  {info['parameters'] / 1e6:.1f}M parameters, {info['training_tokens_seen']:,} training tokens seen, "
          f"built in {info['build_seconds']:.0f} s")
    print(f"  held-out loss {info['held_out_loss']:.3f} nats/token "
          f"(positions 0-{RECIPE['eval']['seq_len'] // 4 - 1}: {info['held_out_loss_first_quarter']:.3f}, "
          f"last quarter: {info['held_out_loss_last_quarter']:.3f})")
    print("  sample (held-out text, then the model's greedy continuation after >>>):")
    print(info["sample_prompt"][-300:] + ">>>" + info["sample_continuation"])
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
