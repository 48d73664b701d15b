"""Sizes as a human reads them: bytes in the binary unit (B, KiB, MiB, GiB, TiB, PiB) that shows the figure with
at least three significant digits, so that 1000 bytes never reads "0.00 GiB"."""

from __future__ import annotations

import math

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def byte_size(nbytes: float) -> str:
    """`nbytes` (bytes) as "512 B", "1.50 KiB", "23.4 MiB", "194.0 GiB", "1.25 TiB" (PiB from 1024 TiB on)."""
    if not math.isfinite(nbytes):
        return f"{nbytes} B"
    value, unit = float(abs(nbytes)), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    sign = "-" if nbytes < 0 else ""
    if unit == 0:
        return f"{sign}{value:.0f} B"
    digits = 2 if value < 10 else 1  # 1.50 KiB, 23.4 MiB, 194.0 GiB (as plans written before this module read)
    return f"{sign}{value:.{digits}f} {_UNITS[unit]}"
