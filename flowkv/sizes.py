"""Byte sizes as people write them in pipeline files: ``"4GiB"``, ``"512MB"``, ``1048576``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: an int, or a number with B, KB/KiB, MB/MiB, GB/GiB or TB/TiB."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size like '4GiB', got {value!r}")
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {value!r}: write a number and a unit, one of "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.4g}{unit}"
    return f"{num_bytes}B"
