"""Human sizes and ranges: ``parse_size("2GiB") == 2 * 2**30``,
``parse_span("24:64") == (24, 64)``."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``"512MiB"``, ``"2GB"``, ``"4096"`` or an int.

    ``what`` names the flag in the error, e.g. ``parse_size(v, "--l1-size")``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = match[2].lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{what}: cannot read {text!r} as a size; write e.g. 512MiB, 2GiB or 4096"
            )
        value = int(float(match[1]) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{what}: must be positive, got {text!r}")
    return value


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_span(text: str) -> tuple[int, int]:
    """``(MIN, MAX)`` from ``"MIN:MAX"`` (or ``"N"`` for ``N:N``); an argparse type."""
    low, sep, high = text.partition(":")
    try:
        return int(low), int(high if sep else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX token counts, got {text!r}") from None
