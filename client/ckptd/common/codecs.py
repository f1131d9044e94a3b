"""The quantization codecs by name (docs/architecture.md §8): what each codec is, the registry
that finds one by the name the index records, and the schemes (O1, O2) built from it.

A codec turns the values of a stored piece (a whole tensor or a fragment with box F) into codes
and per-block scales, and back. Each family is one class (`Linear`, `Log`); each variant a
subclass that states its name, bits, levels, codes dtype, whether its codes are stored as zstd
row frames (`framed`) and its default block. Nothing is derived from the name. Adding a codec:
write its class (encode/decode of its own, or a family's) and list it in `_BUILTIN_CODECS`; the
writer, the reader and the index then know it by name.

Torch-free and pure: the daemon's event loop and its configuration import this module (torch
costs seconds). `encode`/`decode` import the torch math (`ckptd.common.quant`) when first called;
that module loads the native encoder only at the first encode, so a client that only decodes
never loads it.

The master-weight modes ("cast", "residual-bf16", `ckptd.common.quant_options`) are not codecs
here: they turn two tensors (master, model weight) into one and back, not values into codes and
scales, and have no block, no scales and no frames.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Final, Iterable, Protocol, Sequence

from ckptd.common.blocks import QuantError, nblocks
from ckptd.common.boxes import Box

if TYPE_CHECKING:
    import torch

    from ckptd.common.quant import Scratch

__all__ = [
    "Codec", "CodecClass", "Blockwise", "Linear", "Log", "LinearInt8", "LinearInt4", "LogU8", "LogU4", "Scheme", "Registry",
    "builtin", "codec", "codec_names", "codec_for",
]

LOSSLESS_MAX_ELEMENTS: Final = 4096  # tensors this small stay lossless (so do 1-D tensors)
FIRST_MOMENT_FIELDS: Final = ("exp_avg",)  # optimizer/state/<param>/<field>
SECOND_MOMENT_FIELDS: Final = ("exp_avg_sq",)
FLOAT_DTYPES: Final = ("F32", "BF16", "F16")


class Codec(Protocol):
    """What every codec offers the writer (encode, the stored dtypes and shapes, framing), the
    reader (decode) and the index (name, block)."""

    @property
    def name(self) -> str:
        """The codec's name in the index (QuantRecord.codec); never changes once written."""

    @property
    def block(self) -> int:
        """Elements per block along the last dim, in logical (unsharded) coordinates."""

    @property
    def bits(self) -> int:
        """Bits per stored code (codes pack along each row; rows start on a byte boundary)."""

    @property
    def codes_dtype(self) -> str:
        """The safetensors dtype the codes are stored in ("I8", "U8")."""

    @property
    def framed(self) -> bool:
        """Whether the stored codes are zstd frames of whole rows (ckptd.common.frames) rather
        than the codes as they are."""

    def codes_shape(self, lengths: Sequence[int]) -> tuple[int, ...]:
        """The shape of the (unframed) codes of a piece of these lengths."""

    def scales_shape(self, box: Box) -> tuple[int, ...]:
        """The shape of the float32 scales of a piece with this box."""

    def encode(self, values: torch.Tensor, box: Box, scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of the values (shape box.lengths) of the piece with box `box`; with
        `scratch`, views of its buffers. Raises QuantError for values it cannot code (the
        caller then stores them losslessly)."""

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, region: Box, want: Box) -> torch.Tensor:
        """The float32 values of box `want` (inside `region`) from the codes and scales of
        `region` (a stored piece, or whole rows of it). Raises QuantError when their shapes do
        not match the region."""


class CodecClass(Protocol):
    """A registrable codec class: its name, its default block, and made from a block size."""

    name: str
    default_block: int

    def __call__(self, block: int) -> Codec: ...


@dataclass(frozen=True)
class Blockwise:
    """The blockwise codecs' shared shape rules and math (ckptd.common.quant: the native
    encoder, torch decoding). A subclass states its constants; `block` is the only parameter.

    Codes are 4 or 8 bits (the kernels' two packings), `bits` per element along each row (int4: element 2i in the low nibble, 2i+1 in
    the high one, a row of odd length ends in a zero nibble); each (row, block) has
    `scale_width` float32 scales."""

    block: int

    name: ClassVar[str]
    bits: ClassVar[int]
    levels: ClassVar[int]  # Q: the largest code magnitude (linear) or the number of non-zero codes (log)
    codes_dtype: ClassVar[str]
    framed: ClassVar[bool]
    default_block: ClassVar[int]
    is_log: ClassVar[bool]  # which of the kernel's two codings (the native encoder takes it as a flag)
    scale_width: ClassVar[int]
    zero: ClassVar[int] = 0  # the stored code of the value 0 (signed 4-bit codes are stored as q + 8)

    def __post_init__(self) -> None:
        if self.block < 2 or self.block % 2:
            raise QuantError(f"block size {self.block} must be an even number >= 2")

    def codes_shape(self, lengths: Sequence[int]) -> tuple[int, ...]:
        """The last dim holds ceil(n * bits / 8) bytes (int4: half, rounded up)."""
        return (*lengths[:-1], -(-lengths[-1] * self.bits // 8))

    def scales_shape(self, box: Box) -> tuple[int, ...]:
        """(*rows, blocks that the box's columns meet, scale_width)."""
        return (*box.lengths[:-1], nblocks(box.offsets[-1], box.lengths[-1], self.block), self.scale_width)

    def encode(self, values: torch.Tensor, box: Box, scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        from ckptd.common import quant  # torch: only where values are coded

        return quant.encode_blockwise(self, values, box, scratch)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, region: Box, want: Box) -> torch.Tensor:
        from ckptd.common import quant

        return quant.decode_blockwise(self, codes, scales, region, want)


class Linear(Blockwise):
    """Signed values (the first moment): q = round(x / absmax * Q), one fp32 absmax per block.
    |decoded - x| <= absmax / (2 Q) (+ float32 rounding). 4-bit codes are stored as q + 8."""

    is_log = False
    scale_width = 1


class Log(Blockwise):
    """Non-negative values v (the second moment): sqrt(v) on a log2 scale between the block's
    smallest and largest non-zero sqrt(v), two fp32 scales per block (their log2). Code 0 only
    for v == 0; a non-zero v never decodes to zero; |log2(decoded) - log2(v)| <= (hi - lo) / (Q - 1)."""

    is_log = True
    scale_width = 2


class LinearInt8(Linear):
    name = "lin-i8"
    bits = 8
    levels = 127
    codes_dtype = "I8"
    framed = False  # int8 codes compress too little to pay for the frames
    default_block = 256


class LinearInt4(Linear):
    name = "lin-i4"
    bits = 4
    levels = 7
    codes_dtype = "U8"
    zero = 8
    framed = True  # a Huffman stage takes about a fifth off int4 codes
    default_block = 128


class LogU8(Log):
    name = "log-u8"
    bits = 8
    levels = 255
    codes_dtype = "U8"
    framed = False
    default_block = 256


class LogU4(Log):
    name = "log-u4"
    bits = 4
    levels = 15
    codes_dtype = "U8"
    framed = True
    default_block = 128


_BUILTIN_CODECS: Final[tuple[CodecClass, ...]] = (LinearInt8, LinearInt4, LogU8, LogU4)


@dataclass(frozen=True)
class Scheme:
    """A compression option of a save (`quantize=`): the codec of each Adam moment, by name."""

    name: str
    first: str  # codec of the first moment (exp_avg, signed)
    second: str  # codec of the second moment (exp_avg_sq, >= 0)
    summary: str  # a word for messages: "int8"


_BUILTIN_SCHEMES: Final = (Scheme("O1", "lin-i8", "log-u8", "int8"), Scheme("O2", "lin-i4", "log-u4", "int4"))


class Registry:
    """Codec classes and schemes by name. Immutable: `with_codec` returns a larger registry."""

    def __init__(self, codecs: Iterable[CodecClass], schemes: Iterable[Scheme] = ()) -> None:
        self._codecs: dict[str, CodecClass] = {}
        for cls in codecs:
            if cls.name in self._codecs:
                raise QuantError(f"codec {cls.name!r} is registered twice")
            self._codecs[cls.name] = cls
        self._schemes = {s.name: s for s in schemes}
        for s in self._schemes.values():
            for used in (s.first, s.second):
                self.codec(used)  # a scheme names registered codecs only

    def with_codec(self, cls: CodecClass) -> Registry:
        return Registry((*self._codecs.values(), cls), self._schemes.values())

    def with_scheme(self, scheme: Scheme) -> Registry:
        return Registry(self._codecs.values(), (*self._schemes.values(), scheme))

    def codec_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._codecs))

    def codec(self, name: str, block: int | None = None) -> Codec:
        """The codec called `name` with `block` elements per block (None: its default).
        Raises QuantError (a ValueError) naming the known codecs for an unknown name."""
        cls = self._codecs.get(name)
        if cls is None:
            raise QuantError(f"unknown codec {name!r}; this ckptd knows {', '.join(self.codec_names())} — upgrade ckptd to read it")
        return cls(cls.default_block if block is None else block)

    def scheme_names(self) -> tuple[str, ...]:
        return tuple(self._schemes)

    def schemes(self) -> tuple[Scheme, ...]:
        return tuple(self._schemes.values())

    def scheme(self, name: str) -> Scheme:
        found = self._schemes.get(name)
        if found is None:
            raise QuantError(f"unknown scheme {name!r}; expected one of {', '.join(self._schemes)}")
        return found


@functools.cache
def builtin() -> Registry:
    """The codecs and schemes this ckptd writes and reads."""
    return Registry(_BUILTIN_CODECS, _BUILTIN_SCHEMES)


def codec(name: str, block: int | None = None) -> Codec:
    """builtin().codec: the codec the index calls `name`."""
    return builtin().codec(name, block)


def codec_names() -> tuple[str, ...]:
    return builtin().codec_names()


def codec_for(scheme: str | None, name: str, kind: str, dtype: str, shape: Sequence[int], registry: Registry | None = None) -> Codec | None:
    """The codec for a logical tensor under `scheme`, or None when it stays lossless.

    Only optimizer state fields known to be Adam moments are quantized (exp_avg: the scheme's
    first codec, exp_avg_sq: its second), only floating point, only with >= 2 dims and more
    than LOSSLESS_MAX_ELEMENTS elements. Everything else (step, unknown fields, norms, biases)
    is stored as it is.
    """
    if scheme is None or kind != "optimizer" or dtype not in FLOAT_DTYPES or len(shape) < 2:
        return None
    if math.prod(shape) <= LOSSLESS_MAX_ELEMENTS or shape[-1] == 0:
        return None
    field = name.rsplit("/", 1)[-1]
    table = registry or builtin()
    chosen = table.scheme(scheme)
    if field in FIRST_MOMENT_FIELDS:
        return table.codec(chosen.first)
    if field in SECOND_MOMENT_FIELDS:
        return table.codec(chosen.second)
    return None
