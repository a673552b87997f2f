"""Byte counts for people: one formatter for conversion reports (decimal units) and disk messages (binary units,
as ``df -h`` and filesystem sizes are given)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float, *, binary: bool = False) -> str:
    """``n`` bytes as ``"1.23 MB"`` (decimal, two decimals) or, ``binary``, ``"1.2 MiB"`` (one decimal)."""
    base, units, digits = (1024, ("B", "KiB", "MiB", "GiB", "TiB"), 1) if binary else \
        (1000, ("B", "KB", "MB", "GB", "TB"), 2)
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= base
    raise AssertionError("unreachable")
