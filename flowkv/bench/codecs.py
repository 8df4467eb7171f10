"""``flowkv bench codecs``: size, speed and error of every payload codec.

Each codec encodes and decodes the same chunk tensor through
`flowkv.payload` (header and checksums included, as a tier sees it). The
``none`` codec is measured in the same run and every ratio is against it.

Input, by default: the KV that the demo model (``flowkv.integration.harness.DEMO_MODEL``,
built locally by ``flowkv.testing.tiny_model``) computes with transformers
on CPU for real text (Python standard-library sources read from this
machine), cut into chunks of ``--tokens`` tokens as the cache stores them.
Each chunk is encoded on its own, so per-chunk statistics (the KIVI key
scales) are what a tier gets. The demo model has random weights: its KV has
the structure of a real Llama's (RoPE keys, per-head scales, values mixed
from real token embeddings) but not a trained model's statistics, and the
output says so. ``--model trained`` measures the KV of the trained reference
model (``flowkv._testing.trained_model``, built locally once) for the same
sources, which it never saw in training: a trained model's KV statistics.

Each document is one stored prefix: a codec's ``window`` keeps the last
tokens of each document exact, as the ``compress`` stage does, so the
ratio counts the window's raw bytes where a tier would hold them.

Other inputs: ``--kv-file`` (a tensor saved with ``torch.save``, shape
``(num_layers, kv, num_tokens, num_kv_heads, head_size)``), or
``--synthetic``: KV drawn to resemble a trained model's (keys after RoPE
with per-channel scales and outlier channels, values smooth along tokens).
Any synthetic shape option (``--layers``, ``--kv-heads``, ``--head-size``,
``--mla``, ``--seed``, ``--dtype``) selects synthetic KV too. When
transformers or the demo model cannot be built, the run falls back to
synthetic KV and says why.

The table ends with what the byte-plane shuffle buys on this KV: for lz4
and zstd, the size with and without it.

    flowkv bench codecs
    flowkv bench codecs --synthetic --json
    flowkv bench codecs --kv-file chunk.pt
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flowkv import payload
from flowkv.bench import best_seconds
from flowkv.codecs import codec_names, get_codec, prefix_window

__all__ = ["add_arguments", "document_spans", "measure", "model_kv", "parse_codecs", "run", "shuffle_gains", "synthetic_kv"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def synthetic_kv(
    *,
    num_layers: int = 8,
    num_tokens: int = 256,
    num_kv_heads: int = 8,
    head_size: int = 128,
    kv: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> torch.Tensor:
    """A chunk tensor whose statistics resemble real KV.

    Keys: each (layer, head, channel) has its own scale (log-normal) and
    offset, ~3% of channels are outliers 8-16x larger, the content varies
    slowly along tokens plus noise, and RoPE (base 10000) rotates channel
    pairs (i, i + head_size/2) by the token position. Values: per-layer scale
    ~0.3, no channel outliers, an AR(1) process along tokens (smooth) plus
    noise. With ``kv == 1`` only the values part is produced (an MLA latent).
    """
    if kv not in (1, 2):
        raise ValueError(f"kv must be 1 or 2, got {kv}")
    if head_size % 2:
        raise ValueError(f"head_size must be even for RoPE, got {head_size}")
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_tokens, num_kv_heads, head_size)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen)

    def smooth(rho: float) -> torch.Tensor:
        """Unit-variance AR(1) along tokens: a loop over tokens, not elements."""
        noise = randn(*shape)
        out = torch.empty(shape)
        out[:, 0] = noise[:, 0]
        keep, fresh = rho, math.sqrt(1 - rho * rho)
        for t in range(1, num_tokens):
            out[:, t] = keep * out[:, t - 1] + fresh * noise[:, t]
        return out

    values = 0.3 * torch.exp(0.3 * randn(num_layers, 1, 1, 1)) * (0.6 * smooth(0.95) + 0.4 * randn(*shape))
    if kv == 1:
        return values.unsqueeze(1).to(dtype)

    channel_scale = torch.exp(0.5 * randn(num_layers, 1, num_kv_heads, head_size))
    outlier = torch.rand((num_layers, 1, num_kv_heads, head_size), generator=gen) < 0.03
    channel_scale = torch.where(outlier, channel_scale * (8 + 8 * torch.rand(channel_scale.shape, generator=gen)), channel_scale)
    channel_offset = 0.5 * randn(num_layers, 1, num_kv_heads, head_size) * channel_scale
    keys = channel_offset + channel_scale * (0.7 * smooth(0.9) + 0.3 * randn(*shape))
    half = head_size // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = torch.arange(num_tokens, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = angle.cos().float()[None, :, None, :]
    sin = angle.sin().float()[None, :, None, :]
    first, second = keys[..., :half], keys[..., half:]
    keys = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return torch.stack([keys, values], dim=1).to(dtype)


def model_kv(
    model_dir: str | Path | None = None,
    *,
    documents: int = 2,
    doc_tokens: int = 1024,
    chunk_tokens: int = 256,
    model: str = "demo",
) -> list[torch.Tensor]:
    """Chunks of real KV: a model's keys and values for standard-library source text.

    `model` ``"demo"``: the random-weight demo model, built in `model_dir`
    (default: the demo's folder) if it is not there yet; ``"trained"``: the
    trained reference model (built once), which never saw these sources (the
    first standard-library files by name). Runs a transformers
    forward pass with ``use_cache`` on `documents` documents of `doc_tokens`
    tokens each, and returns chunk tensors ``(num_layers, 2, chunk_tokens,
    num_kv_heads, head_size)`` in the model's dtype (the last chunk of a
    document may be shorter). Keys are taken after RoPE, as a paged KV cache
    holds them.
    """
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flowkv.integration.harness import documents as read_documents
    from flowkv.integration.harness import model_folder

    if chunk_tokens <= 0 or doc_tokens <= 0 or documents <= 0:
        raise ValueError("documents, doc_tokens and chunk_tokens must be positive")
    if model == "trained":
        from flowkv._testing.trained_model import trained_model

        folder = trained_model()
    elif model == "demo":
        folder = model_folder(model_dir)
    else:
        raise ValueError(f"model must be 'demo' or 'trained', got {model!r}")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    llama = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    llama.eval()
    chunks: list[torch.Tensor] = []
    for ids in read_documents(tokenizer, documents, doc_tokens):
        with torch.no_grad():
            cache = llama(torch.tensor([ids]), use_cache=True).past_key_values
        # transformers 5: one DynamicLayer per layer, keys/values (batch, kv_heads, tokens, head_size).
        layers = [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
        doc = torch.stack(layers).permute(0, 1, 3, 2, 4)  # -> (layers, 2, tokens, kv_heads, head_size)
        chunks += [c.contiguous() for c in doc.split(chunk_tokens, dim=2)]
    return chunks


def load_kv_file(path: str) -> torch.Tensor:
    """A chunk tensor from a ``torch.save`` file (tensors only, no pickled code)."""
    tensor = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(tensor, dict) and len(tensor) == 1:
        (tensor,) = tensor.values()
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{path}: expected one tensor, found {type(tensor).__name__}")
    if tensor.dim() != 5 or tensor.shape[1] not in (1, 2):
        raise ValueError(
            f"{path}: expected shape (num_layers, kv, num_tokens, num_kv_heads, head_size) with kv 1 or 2, "
            f"got {tuple(tensor.shape)}"
        )
    return tensor.contiguous()


def _errors(kv: torch.Tensor, decoded: torch.Tensor) -> dict[str, float]:
    x = kv.double()
    err = (decoded.double() - x).abs()
    amax = x.abs().max().item() or 1.0
    mean_abs_x = x.abs().mean().item() or 1.0
    result = {
        "max_abs_err": err.max().item(),
        "mean_abs_err": err.mean().item(),
        # Relative to the tensor's scale: per-element |err|/|x| blows up at
        # the many values near zero and says little.
        "max_rel_err": err.max().item() / amax,
        "mean_rel_err": err.mean().item() / mean_abs_x,
        "rel_l2_err": (err.norm() / (x.norm() or 1.0)).item(),
    }
    if kv.shape[1] == 2:
        for index, part in ((0, "keys"), (1, "values")):
            result[f"{part}_rel_l2_err"] = (err[:, index].norm() / (x[:, index].norm() or 1.0)).item()
    return result


def document_spans(doc_lengths: Sequence[int], chunk_tokens: int) -> list[tuple[int, int, int]]:
    """(start, end, prefix end) of every chunk of documents of these lengths, cut as `model_kv` cuts them."""
    return [(start, min(start + chunk_tokens, length), length)
            for length in doc_lengths for start in range(0, length, chunk_tokens)]


def measure(
    kv: torch.Tensor | Sequence[torch.Tensor],
    codecs: list[tuple[str, dict[str, Any]]],
    *,
    repeats: int = 5,
    spans: Sequence[tuple[int, int, int]] | None = None,
) -> list[dict[str, Any]]:
    """Encode/decode `kv` (one chunk tensor or a list of them) with each (codec, params).

    ``none`` is always measured first. Each chunk is its own payload, as in a
    tier. `spans` gives each chunk's (start, end, prefix end) in its stored
    prefix, so that a ``window`` parameter keeps the prefix's last tokens
    exact (`flowkv.codecs.prefix_window`); by default every chunk is a
    prefix of its own. Returns one row per codec: payload bytes (all
    chunks), ratio (raw / payload), size and speed relative to ``none``,
    encode/decode GB/s of raw tensor bytes (best of `repeats` passes over
    all chunks), and for lossy codecs the errors over all chunks.
    """
    chunks = [kv] if isinstance(kv, torch.Tensor) else list(kv)
    if not chunks:
        raise ValueError("no KV to measure")
    if spans is None:
        spans = [(0, c.shape[2], c.shape[2]) for c in chunks]
    if len(spans) != len(chunks):
        raise ValueError(f"{len(spans)} spans for {len(chunks)} chunks")
    raw_bytes = sum(c.numel() * c.element_size() for c in chunks)
    plan = [("none", {})] + [(name, params) for name, params in codecs if (name, params) != ("none", {})]
    outs = [torch.empty_like(c) for c in chunks]
    rows = []
    for name, params in plan:
        per_chunk = [params if not params.get("window") else {**params, "window": prefix_window(params["window"], *span)}
                     for span in spans]
        blobs = [payload.encode(c, name, **p) for c, p in zip(chunks, per_chunk)]

        def encode_all() -> None:
            for c, p in zip(chunks, per_chunk):
                payload.encode(c, name, **p)

        def decode_all() -> None:
            for blob, out in zip(blobs, outs):
                payload.decode_into(blob, out)

        encode_s = best_seconds(encode_all, repeats)
        decode_s = best_seconds(decode_all, repeats)
        label = name + "".join(f" {k}={v}" for k, v in params.items())
        payload_bytes = sum(len(b) for b in blobs)
        row: dict[str, Any] = {
            "codec": label,
            "name": name,
            "params": dict(params),
            "lossless": get_codec(name).lossless,
            "payload_bytes": payload_bytes,
            "ratio": raw_bytes / payload_bytes,
            "encode_gbps": raw_bytes / encode_s / 1e9,
            "decode_gbps": raw_bytes / decode_s / 1e9,
        }
        if row["lossless"]:
            row["bitwise_equal"] = all(
                torch.equal(out.view(torch.uint8), c.view(torch.uint8)) for out, c in zip(outs, chunks)
            )
        else:
            row.update(_errors(torch.cat(chunks, dim=2), torch.cat(outs, dim=2)))
        rows.append(row)
    baseline = rows[0]
    for row in rows:
        row["size_vs_none"] = row["payload_bytes"] / baseline["payload_bytes"]
        row["encode_vs_none"] = row["encode_gbps"] / baseline["encode_gbps"]
        row["decode_vs_none"] = row["decode_gbps"] / baseline["decode_gbps"]
    return rows


def shuffle_gains(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the byte-plane shuffle buys: each ``X-shuffle`` row against plain ``X`` with the same params.

    One entry per pair measured: the size ratio (plain payload / shuffled
    payload, above 1 when the shuffle shrinks it) and the speed ratios.
    """
    by_key = {(row["name"], json.dumps(row["params"], sort_keys=True)): row for row in rows}
    gains = []
    for (name, params), shuffled in by_key.items():
        plain = by_key.get((name.removesuffix("-shuffle"), params)) if name.endswith("-shuffle") else None
        if plain is None:
            continue
        gains.append({
            "plain": plain["codec"],
            "shuffled": shuffled["codec"],
            "plain_ratio": plain["ratio"],
            "shuffled_ratio": shuffled["ratio"],
            "size_gain": plain["payload_bytes"] / shuffled["payload_bytes"],
            "encode_speed": shuffled["encode_gbps"] / plain["encode_gbps"],
            "decode_speed": shuffled["decode_gbps"] / plain["decode_gbps"],
        })
    return gains


def parse_codecs(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``"zstd,zstd:level=1,int4:group_size=32"`` -> [(name, params), ...]."""
    result = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, rest = item.partition(":")
        params: dict[str, Any] = {}
        for assignment in filter(None, rest.split(":")):
            key, eq, value = assignment.partition("=")
            if not eq:
                raise ValueError(f"codec parameter {assignment!r} in {item!r} is not KEY=VALUE")
            params[key] = json.loads(value) if value.lstrip("-").isdigit() or value in ("true", "false") else value
        get_codec(name).resolve_params(**params)  # fail before measuring anything
        result.append((name, params))
    return result


_DEFAULT_CODECS = ",".join(
    codec_names() + ["zstd:level=1", "zstd-shuffle:level=1", "zstd:level=9", "zstd-shuffle:level=9",
                     "fp8:group_size=64", "fp8:scaling=channel", "int8:group_size=32", "int8:scale_dtype=fp16",
                     "int4:group_size=32", "int4:scale_dtype=fp16", "int4:scale_dtype=fp16:window=64"]
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench codecs``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--kv-file", help="a torch.save'd tensor (num_layers, kv, num_tokens, num_kv_heads, head_size)")
    source.add_argument("--synthetic", action="store_true",
                        help="synthetic KV instead of the demo model's KV for real text")
    parser.add_argument(
        "--codecs",
        default=None,
        help="comma-separated codecs, NAME or NAME:KEY=VALUE[:KEY=VALUE] (default: all, plus zstd levels 1 "
        "and 9, fp8 group 64 and per-channel keys, int8 and int4 group 32 and fp16 scales, int4 with a "
        "64-token window)",
    )
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk (default 256)")
    parser.add_argument("--documents", type=int, default=2, help="model KV: documents (default 2)")
    parser.add_argument("--doc-tokens", type=int, default=1024, help="model KV: tokens per document (default 1024)")
    parser.add_argument("--model", choices=("demo", "trained"), default="demo",
                        help="model KV: the random-weight demo model (default) or the trained reference model")
    parser.add_argument("--model-dir", help="model KV: where the demo model is built (default: the demo's folder)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="synthetic KV dtype (default bf16)")
    parser.add_argument("--layers", type=int, help="synthetic: layers (default 8)")
    parser.add_argument("--kv-heads", type=int, help="synthetic: KV heads (default 8)")
    parser.add_argument("--head-size", type=int, help="synthetic: head size (default 128)")
    parser.add_argument("--mla", action="store_true", help="synthetic: kv=1 (MLA latent) instead of keys and values")
    parser.add_argument("--seed", type=int, help="synthetic: random seed (default 0)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the best counts (default 5)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


_SYNTHETIC_ONLY = ("dtype", "layers", "kv_heads", "head_size", "seed")


def _input(args: argparse.Namespace) -> tuple[list[torch.Tensor], list[tuple[int, int, int]] | None, str]:
    """The chunks to measure, their spans in their documents (None: a chunk each), and where they came from."""
    if args.kv_file:
        return [load_kv_file(args.kv_file)], None, f"file {args.kv_file}"
    synthetic = args.synthetic or args.mla or any(getattr(args, n) is not None for n in _SYNTHETIC_ONLY)
    why = ""
    if not synthetic:
        try:
            chunks = model_kv(args.model_dir, documents=args.documents, doc_tokens=args.doc_tokens,
                              chunk_tokens=args.tokens, model=args.model)
        except ImportError as exc:
            why = f" (model KV unavailable: {exc})"
        except (OSError, RuntimeError) as exc:
            why = f" (model KV unavailable: {type(exc).__name__}: {exc})"
        else:
            spans = document_spans([args.doc_tokens] * args.documents, args.tokens)
            if args.model == "trained":
                return chunks, spans, (
                    f"trained model KV (transformers, CPU) for {args.documents} held-out standard-library source "
                    f"document(s) of {args.doc_tokens} tokens, {len(chunks)} chunk(s)"
                )
            return chunks, spans, (
                f"demo model KV (transformers, CPU) for {args.documents} standard-library source document(s) "
                f"of {args.doc_tokens} tokens, {len(chunks)} chunk(s); random-weight model, not a trained one"
            )
    kv = synthetic_kv(
        num_layers=args.layers or 8,
        num_tokens=args.tokens,
        num_kv_heads=args.kv_heads or 8,
        head_size=args.head_size or 128,
        kv=1 if args.mla else 2,
        dtype=_DTYPES[args.dtype or "bf16"],
        seed=args.seed or 0,
    )
    return [kv], None, "synthetic KV (RoPE keys with outlier channels, smooth values); real KV will differ" + why


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    try:
        codecs = parse_codecs(args.codecs or _DEFAULT_CODECS)
        chunks, spans, source = _input(args)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"flowkv bench codecs: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(chunks, codecs, repeats=args.repeats, spans=spans)
    first = chunks[0]
    info = {
        "source": source,
        "shape": list(first.shape),
        "chunks": len(chunks),
        "dtype": str(first.dtype).removeprefix("torch."),
        "raw_bytes": sum(c.numel() * c.element_size() for c in chunks),
        "torch_threads": torch.get_num_threads(),
        "codecs": rows,
        "shuffle": shuffle_gains(rows),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"input: {source}")
    print(f"chunk shape {tuple(first.shape)} {info['dtype']} x {len(chunks)}, {info['raw_bytes'] / 2**20:.1f} MiB, "
          f"torch threads {info['torch_threads']}")
    print("ratio = raw / payload; x none = against the none codec in this run; GB/s of raw KV bytes")
    header = f"{'codec':<34} {'ratio':>6} {'size x none':>11} {'enc GB/s':>9} {'x none':>7} {'dec GB/s':>9} {'x none':>7}  error"
    print(header)
    print("-" * len(header))
    for row in rows:
        if row["lossless"]:
            error = "bitwise" if row["bitwise_equal"] else "NOT BITWISE EQUAL"
        else:
            error = (
                f"max {row['max_abs_err']:.3g} (rel {row['max_rel_err']:.2%}) mean {row['mean_abs_err']:.3g} "
                f"(rel {row['mean_rel_err']:.2%}) L2 {row['rel_l2_err']:.2%}"
            )
            if "keys_rel_l2_err" in row:
                error += f" [K {row['keys_rel_l2_err']:.2%} V {row['values_rel_l2_err']:.2%}]"
        print(
            f"{row['codec']:<34} {row['ratio']:>6.2f} {row['size_vs_none']:>11.3f} {row['encode_gbps']:>9.2f} "
            f"{row['encode_vs_none']:>7.3f} {row['decode_gbps']:>9.2f} {row['decode_vs_none']:>7.3f}  {error}"
        )
    if info["shuffle"]:
        print()
        print("byte-plane shuffle (size gain = plain payload / shuffled payload; speeds = shuffled / plain):")
        for gain in info["shuffle"]:
            print(f"  {gain['shuffled']:<28} ratio {gain['plain_ratio']:.2f} -> {gain['shuffled_ratio']:.2f}  "
                  f"size gain {gain['size_gain']:.2f}x  encode {gain['encode_speed']:.2f}x  "
                  f"decode {gain['decode_speed']:.2f}x")
    failed = [row["codec"] for row in rows if row["lossless"] and not row["bitwise_equal"]]
    return 1 if failed else 0
