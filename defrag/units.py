"""Byte sizes: parse "8GiB"/"512MiB"/ints, format bytes for people, and the pool's placement grain."""

from __future__ import annotations

import re
from fractions import Fraction

# Every block's size is rounded up to this many bytes and every block starts on a multiple of it, as
# PyTorch rounds its own allocations (the native heap's kAlignment, defrag/native/heap.h).
ALIGNMENT = 512

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value, *, what: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "512MiB", "1.5GB", "4096".

    Raises ValueError naming `what` and the bad value for anything else
    (negative numbers, unknown units, bools, floats, strings that are not a
    whole number of bytes such as "1.5B").
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count or a string like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS:
            number = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]  # exact, unlike float
            if number.denominator == 1:
                return int(number)
    raise ValueError(f"{what} must be a byte count or a string like '8GiB' or '512MiB', got {value!r}")


def format_bytes(n: float) -> str:
    """A short human form: 1536 -> '1.50 KiB'."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
