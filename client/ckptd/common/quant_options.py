"""The names of the compression options (docs/architecture.md §8), without torch: the daemon checks them
on its event loop and in its configuration, where importing torch would cost seconds. The scheme
names come from the codec registry (ckptd.common.codecs)."""

from __future__ import annotations

from typing import Final

from ckptd.common.blocks import QuantError
from ckptd.common.codecs import builtin

__all__ = ["SCHEMES", "MASTER_MODES", "CAST", "RESIDUAL", "check_scheme", "check_master_mode"]

SCHEMES: Final = builtin().scheme_names()  # ("O1", "O2"); O1: int8 optimizer moments, O2: int4
MASTER_MODES: Final = ("keep", "drop", "residual")
CAST: Final = "cast"  # the index's codec of a dropped master weight: the stored model weight, upcast on load
RESIDUAL: Final = "residual-bf16"  # the index's codec of a master weight stored as its bf16 difference to the model weight


def check_scheme(scheme: str | None) -> str | None:
    """None/"" (lossless) or a registered scheme ("O1"/"O2"); raises QuantError naming the choices otherwise."""
    if scheme in (None, ""):
        return None
    if scheme not in SCHEMES:
        choices = [f"{s.name!r} ({s.summary})" for s in builtin().schemes()]
        raise QuantError(f"quantize={scheme!r}: use {', '.join(choices)}, 'none' (lossless) or None (the daemon's --quantize)")
    return scheme


def check_master_mode(mode: str | None) -> str | None:
    """None/"" (the daemon's default) or one of keep, drop, residual; raises QuantError otherwise."""
    if mode in (None, ""):
        return None
    if mode not in MASTER_MODES:
        raise QuantError(f"master_weights={mode!r}: use 'keep', 'drop' or 'residual'")
    return mode
