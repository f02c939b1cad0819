"""Human-friendly numbers for the planner's inputs: ``10T`` tokens, ``175B`` parameters, ``1e15``."""

from __future__ import annotations

import re

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGTP]?)\s*$", re.IGNORECASE)


def parse_count(text: str | float | int, what: str = "value") -> float:
    """'10T' → 1e13, '175B' → 1.75e11, '2.5e9' → 2.5e9 (K, M, B or G, T, P are powers of 1000)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _NUMBER.match(text)
        if not match:
            raise ValueError(f"{what} {text!r} is not a number; use e.g. 175e9, 175B, 10T, 2M")
        value = float(match.group(1)) * _SUFFIX[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return value


def fmt_count(value: float) -> str:
    """1.75e11 → '175B' (three significant digits)."""
    for suffix, scale in (("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"
