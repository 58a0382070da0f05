"""Bytes for people, in decimal and binary units side by side (25 GB/s of line
rate is 23.28 GiB/s)."""

from __future__ import annotations

_DECIMAL = ("B", "kB", "MB", "GB", "TB", "PB")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _scaled(n: float, base: int, units: tuple[str, ...], unit: str | None) -> str:
    if unit is not None:
        return f"{n / base ** units.index(unit):,.2f} {unit}"
    for name in units[:-1]:
        if abs(n) < base:
            return f"{n:,.0f} {name}" if name == "B" else f"{n:,.2f} {name}"
        n /= base
    return f"{n:,.2f} {units[-1]}"


def decimal(n: float, unit: str | None = None) -> str:
    """``decimal(25e9) == "25.00 GB"``; ``unit`` fixes the unit (``"GB"``)."""
    return _scaled(n, 1000, _DECIMAL, unit)


def binary(n: float, unit: str | None = None) -> str:
    """``binary(25e9) == "23.28 GiB"``; ``unit`` fixes the unit (``"GiB"``)."""
    return _scaled(n, 1024, _BINARY, unit)


def both(n: float, suffix: str = "") -> str:
    """``both(25e9, "/s") == "25.00 GB/s (23.28 GiB/s)"``"""
    return f"{decimal(n)}{suffix} ({binary(n)}{suffix})"


__all__ = ["binary", "both", "decimal"]
