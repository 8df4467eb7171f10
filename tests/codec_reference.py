"""Float64 quantizers written from the lossy codecs' documented schemes, without the codecs'
code: the independent reference the codec tests hold the codecs to.

A codec must land within half a reference step of every input, and on the reference's own
value for all but the few elements where fp32 arithmetic tips a rounding tie the other way.
"""

from __future__ import annotations

import math

import torch


def _half_toward(x: torch.Tensor, toward: float) -> torch.Tensor:
    """float64 `x` rounded to a float16 on the side of `toward`, with numpy (not the codec's torch path)."""
    import numpy as np

    values = x.numpy()
    half = values.astype(np.float16)
    off = half.astype(np.float64) > values if toward < 0 else half.astype(np.float64) < values
    half = np.where(off, np.nextafter(half, np.float16(toward)), half)
    return torch.from_numpy(half.astype(np.float64))


def reference_int(kv: torch.Tensor, bits: int, *, group_size=0, key_group_size=0, window=0, scale_dtype="fp32"):
    """(dequantized, step) per element, float64: KIVI grouping, asymmetric, exact window."""
    x = kv.double()
    layers, kvs, tokens, heads, head_size = x.shape
    exact = min(window, tokens)
    if exact and key_group_size:
        exact += (tokens - exact) % key_group_size
    quantized = tokens - exact
    levels = 2**bits - 1
    out, step = x.clone(), torch.zeros_like(x)
    for index in range(kvs):
        part = x[:, index, :quantized]
        if kvs == 2 and index == 0:  # keys: per channel, over groups of tokens
            group = key_group_size or quantized
            grouped = part.reshape(layers, quantized // group, group, heads, head_size) if quantized else part
            dim = 2
        else:  # values: per token, over groups of channels of one head
            group = group_size or head_size
            grouped = part.reshape(layers, quantized, heads, head_size // group, group)
            dim = 4
        if not grouped.numel():
            continue
        lo, hi = grouped.amin(dim, keepdim=True), grouped.amax(dim, keepdim=True)
        if scale_dtype == "fp16":
            lo = _half_toward(lo, -math.inf)
        scale = torch.where(hi > lo, (hi - lo) / levels, torch.ones_like(lo))
        if scale_dtype == "fp16":
            scale = _half_toward(scale, math.inf)
        codes = torch.round((grouped - lo) / scale).clamp(0, levels)
        out[:, index, :quantized] = (lo + codes * scale).reshape(part.shape)
        step[:, index, :quantized] = scale.expand(grouped.shape).reshape(part.shape)
    return out, step


def _e4m3(y: torch.Tensor) -> torch.Tensor:
    """float64 values (|y| <= 448) rounded to float8 e4m3fn: 3 mantissa bits, exponents from -6, subnormal step 2^-9."""
    exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    quantum = 2.0 ** (exponent - 3)
    return torch.round(y / quantum) * quantum


def reference_fp8(kv: torch.Tensor, *, group_size=0, scaling="token", window=0):
    """(dequantized, quantum) per element, float64."""
    x = kv.double()
    layers, kvs, tokens, heads, head_size = x.shape
    quantized = tokens - min(window, tokens)
    out, quantum = x.clone(), torch.zeros_like(x)
    row = heads * head_size
    for index in range(kvs):
        part = x[:, index, :quantized]
        if scaling == "channel" and kvs == 2 and index == 0:
            amax = part.abs().amax(1, keepdim=True).expand(part.shape) if part.numel() else part
        else:
            group = group_size or row
            grouped = part.reshape(layers, quantized, row // group, group)
            amax = grouped.abs().amax(3, keepdim=True).expand(grouped.shape).reshape(part.shape)
        if not part.numel():
            continue
        scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        y = part / scale
        out[:, index, :quantized] = _e4m3(y) * scale
        exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
        quantum[:, index, :quantized] = 2.0 ** (exponent - 3) * scale
    return out, quantum


def check_against_reference(kv, decoded, reference, step):
    """Every element within half a reference step (plus fp32 and output rounding) of the input;
    nearly every element on the reference's own value."""
    x = kv.double()
    u, tiny = {torch.float16: (2.0**-11, 2.0**-24), torch.bfloat16: (2.0**-8, 2.0**-133),
               torch.float32: (2.0**-24, 2.0**-149)}[kv.dtype]
    magnitude = x.abs() + step
    slack = 1e-4 * step + 2.0**-21 * magnitude + u * magnitude + tiny  # fp32 arithmetic, output rounding
    error = (decoded.double() - x).abs()
    assert bool((error <= step / 2 + slack).all()), f"max excess {(error - step / 2 - slack).max().item()}"
    off_reference = (decoded.double() - reference.to(kv.dtype).double()).abs() > slack
    assert off_reference.double().mean().item() < 0.01
    exact = step == 0
    assert torch.equal(decoded[exact], kv[exact])  # the window, bit for bit


