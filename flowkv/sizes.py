"""Byte sizes as people write them in pipeline files: ``"4GiB"``, ``"512MB"``, ``1048576``."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``"4GiB"`` (binary), ``"4GB"`` (decimal), ``"512 MiB"``, ``"100B"``.

    Units: B, KB/KiB, MB/MiB, GB/GiB, TB/TiB (case-insensitive); a bare
    number or an int is bytes. Fractions are allowed when they come to whole
    bytes (``"1.5GiB"``).

    >>> parse_size("4GiB"), parse_size("4GB"), parse_size("1.5 KiB")
    (4294967296, 4000000000, 1536)
    """
    if isinstance(text, bool):
        raise ValueError(f"size must be a string like '4GiB' or an int, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"size must be a string like '4GiB' or an int, got {type(text).__name__}")
    match = _SIZE_RE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if match is None or (unit and unit not in _SIZE_UNITS):
        raise ValueError(
            f"invalid size {text!r}: expected a number and a unit among "
            "B, KB, KiB, MB, MiB, GB, GiB, TB, TiB (e.g. '4GiB', '512MB')"
        )
    try:
        exact = Decimal(match.group(1)) * _SIZE_UNITS[unit or "B"]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"invalid size {text!r}") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"size {text!r} is not a whole number of bytes ({exact} B)")
    return int(exact)


def format_size(nbytes: int) -> str:
    """A byte count for people, in binary units with one decimal (the inverse of :func:`parse_size`, rounded).

    >>> format_size(512), format_size(1536), format_size(20 * 2**30)
    ('512 B', '1.5 KiB', '20.0 GiB')
    """
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            break
    else:
        unit = "TiB"
        value /= 1024
    return f"{value:.1f} {unit}"
