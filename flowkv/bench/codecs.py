"""``flowkv bench codecs``: size, speed and error of every payload codec.

Each codec encodes and decodes the same chunk tensor through
`flowkv.payload` (header and checksums included, as a tier sees it). The
``none`` codec is measured in the same run and every ratio is against it.

Input is a KV tensor saved with ``torch.save`` (``--kv-file``), of shape
``(num_layers, kv, num_tokens, num_kv_heads, head_size)``, or by default a
synthetic KV whose statistics resemble a trained model's: keys after RoPE
with per-channel scales and a few outlier channels, values smaller and
smooth along tokens. Synthetic numbers say how the codecs behave on that
kind of data, not what a given model gets; the output says which it used.

    flowkv bench codecs
    flowkv bench codecs --kv-file chunk.pt --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from flowkv import payload
from flowkv.codecs import codec_names, get_codec

__all__ = ["add_arguments", "measure", "run", "synthetic_kv"]

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


def _best_seconds(step: Callable[[], object], repeats: int) -> float:
    step()  # warm-up: first-touch page faults, per-thread contexts
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


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


def measure(kv: torch.Tensor, codecs: list[tuple[str, dict[str, Any]]], *, repeats: int = 5) -> list[dict[str, Any]]:
    """Encode/decode `kv` with each (codec, params); ``none`` is always measured first.

    Returns one row per codec: payload bytes, ratio (raw / payload),
    size and speed relative to ``none``, encode/decode GB/s of raw tensor
    bytes (best of `repeats`), and for lossy codecs the errors.
    """
    raw_bytes = kv.numel() * kv.element_size()
    plan = [("none", {})] + [(name, params) for name, params in codecs if (name, params) != ("none", {})]
    out = torch.empty_like(kv)
    rows = []
    for name, params in plan:
        blob = payload.encode(kv, name, **params)
        encode_s = _best_seconds(lambda: payload.encode(kv, name, **params), repeats)
        decode_s = _best_seconds(lambda: payload.decode_into(blob, out), repeats)
        label = name + "".join(f" {k}={v}" for k, v in params.items())
        row: dict[str, Any] = {
            "codec": label,
            "lossless": get_codec(name).lossless,
            "payload_bytes": len(blob),
            "ratio": raw_bytes / len(blob),
            "encode_gbps": raw_bytes / encode_s / 1e9,
            "decode_gbps": raw_bytes / decode_s / 1e9,
        }
        if row["lossless"]:
            row["bitwise_equal"] = bool(torch.equal(out.view(torch.uint8), kv.view(torch.uint8)))
        else:
            row.update(_errors(kv, out))
        rows.append(row)
    baseline = rows[0]
    for row in rows:
        row["size_vs_none"] = row["payload_bytes"] / baseline["payload_bytes"]
        row["encode_vs_none"] = row["encode_gbps"] / baseline["encode_gbps"]
        row["decode_vs_none"] = row["decode_gbps"] / baseline["decode_gbps"]
    return rows


def _parse_codecs(text: str) -> list[tuple[str, dict[str, Any]]]:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flowkv bench codecs``."""
    parser.add_argument("--kv-file", help="a torch.save'd tensor (num_layers, kv, num_tokens, num_kv_heads, head_size); default: synthetic KV")
    parser.add_argument(
        "--codecs",
        default=",".join(codec_names() + ["zstd:level=1", "int4:group_size=32"]),
        help="comma-separated codecs, NAME or NAME:KEY=VALUE[:KEY=VALUE] (default: all, plus zstd level 1 and int4 group 32)",
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="synthetic KV dtype (default bf16)")
    parser.add_argument("--layers", type=int, default=8, help="synthetic: layers (default 8)")
    parser.add_argument("--tokens", type=int, default=256, help="synthetic: tokens per chunk (default 256)")
    parser.add_argument("--kv-heads", type=int, default=8, help="synthetic: KV heads (default 8)")
    parser.add_argument("--head-size", type=int, default=128, help="synthetic: head size (default 128)")
    parser.add_argument("--mla", action="store_true", help="synthetic: kv=1 (MLA latent) instead of keys and values")
    parser.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the best counts (default 5)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (or JSON). Returns the exit status."""
    try:
        codecs = _parse_codecs(args.codecs)
        if args.kv_file:
            kv = load_kv_file(args.kv_file)
            source = f"file {args.kv_file}"
        else:
            kv = synthetic_kv(
                num_layers=args.layers,
                num_tokens=args.tokens,
                num_kv_heads=args.kv_heads,
                head_size=args.head_size,
                kv=1 if args.mla else 2,
                dtype=_DTYPES[args.dtype],
                seed=args.seed,
            )
            source = "synthetic KV (RoPE keys with outlier channels, smooth values); real KV will differ"
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"flowkv bench codecs: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(kv, codecs, repeats=args.repeats)
    info = {
        "source": source,
        "shape": list(kv.shape),
        "dtype": str(kv.dtype).removeprefix("torch."),
        "raw_bytes": kv.numel() * kv.element_size(),
        "torch_threads": torch.get_num_threads(),
        "codecs": rows,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"input: {source}")
    print(f"shape {tuple(kv.shape)} {info['dtype']}, {info['raw_bytes'] / 2**20:.1f} MiB, torch threads {info['torch_threads']}")
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
    failed = [row["codec"] for row in rows if row["lossless"] and not row["bitwise_equal"]]
    return 1 if failed else 0
