"""The ground floor of quantization, torch-free: the block arithmetic, what the math reads of a
blockwise codec (`BlockCoding`) and `QuantError`.

ckptd.common.codecs (the codecs by name) and ckptd.common.quant (their torch math) both build
on this module; the math imports no codec, so imports point one way: quant_options → codecs →
quant → blocks.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ckptd.common.boxes import Box

__all__ = ["BlockCoding", "QuantError", "nblocks"]


class QuantError(ValueError):
    """Input that cannot be quantized (non-finite values, a negative second moment, a bad
    option or codec name); the message says what and what to do."""


def nblocks(offset: int, length: int, block: int) -> int:
    """How many logical blocks the columns [offset, offset + length) meet."""
    if length == 0:
        return 0
    return (offset + length - 1) // block - offset // block + 1


class BlockCoding(Protocol):
    """What the blockwise math (ckptd.common.quant) reads of a codec (ckptd.common.codecs.Blockwise)."""

    @property
    def name(self) -> str: ...

    @property
    def block(self) -> int:
        """Elements per block along the last dim."""

    @property
    def bits(self) -> int:
        """4 or 8 bits per code."""

    @property
    def levels(self) -> int:
        """Q: the largest code magnitude (linear) or the number of non-zero codes (log)."""

    @property
    def codes_dtype(self) -> str: ...

    @property
    def is_log(self) -> bool: ...

    @property
    def scale_width(self) -> int:
        """float32 scales per (row, block)."""

    @property
    def zero(self) -> int:
        """The stored code of the value 0."""

    def codes_shape(self, lengths: Sequence[int]) -> tuple[int, ...]: ...

    def scales_shape(self, box: Box) -> tuple[int, ...]: ...
