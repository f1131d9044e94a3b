"""Byte counts for people: the one formatter of sizes in messages, logs and `ckptd` output.

Binary units (KiB = 1024 B), the units sizes are configured in (`--shm-budget 4GiB`), with at
most one decimal and none when it is zero: 1536 -> "1.5 KiB", 2**48 -> "256 TiB", 1023 -> "1023 B".
"""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(nbytes: float) -> str:
    """`nbytes` in the largest binary unit that keeps the value at 1 or more (bytes below 1 KiB);
    negative values keep their sign (a difference of sizes)."""
    if abs(nbytes) < 1024:
        return f"{int(nbytes)} B"
    value = float(nbytes) / 1024
    power = 0
    while abs(value) >= 1023.95 and power < len(_UNITS) - 1:  # 1023.95 shows as 1024.0: the next unit
        value /= 1024
        power += 1
    return f"{value:.1f}".removesuffix(".0") + f" {_UNITS[power]}"
