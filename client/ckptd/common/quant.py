"""Blockwise quantization of optimizer state and master-weight residuals (DESIGN.md §8), as pure
functions: torch tensor math only, no file system, no RPC. Imported by the daemon (encoding,
in its background writer) and by the client (decoding the slices it reads itself).

Blocks are defined in the logical (unsharded) tensor's coordinates: block j of a row holds the
elements whose last-dim index c satisfies j*B <= c < (j+1)*B. A stored piece (a whole tensor or
a fragment with box F) has one scale entry per row and per block that meets F's columns, so its
scale tensor has shape (*F.lengths[:-1], nblocks(F), width). A fragment that cuts a block (only
possible for a tensor sharded along its last dim across nodes) computes that block's scale over
its own part; every element's decoded value depends only on its own code and the scale entry of
(its row, its block) in the piece that stores it, so any slice of any piece decodes exactly as
the same elements of the whole piece do.

Codecs (the scheme's name in the index):

- "lin-i8" / "lin-i4" (first moment, signed): q = round(x / absmax * Q), Q = 127 or 7, one fp32
  absmax per block. |decoded - x| <= absmax / (2 Q) (+ float32 rounding).
- "log-u8" / "log-u4" (second moment v >= 0): s = sqrt(v) is coded on a log2 scale between the
  block's smallest and largest non-zero s: code 0 only for v == 0 exactly, codes 1..Q
  (Q = 255 or 15) for the rest, two fp32 values per block (log2 of the smallest and largest s).
  A non-zero v never decodes to zero (decoded values are clamped to >= float32 `tiny`), and
  |log2(decoded v) - log2(v)| <= (hi - lo) / (Q - 1) where hi - lo is the block's log2 range of s.
- "residual-bf16" (master weights): master - float(model) stored in bfloat16; the master weight
  comes back as float(model) + float(residual) (relative error about 2^-16 of the weight).

int4 codes pack two per byte along each row of the stored piece: element 2i of the row in the
low nibble, 2i+1 in the high nibble; a row of odd length has its last high nibble zero. Signed
int4 codes are stored as q + 8 (1..15). Rows always start on a byte boundary, so a slice reads
whole rows and whole bytes and unpacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Sequence

import torch

from ckptd.common.boxes import Box, relative
from ckptd.common.quant_options import MASTER_MODES, SCHEMES, QuantError, check_master_mode, check_scheme

__all__ = [
    "MASTER_MODES", "SCHEMES", "QuantError", "check_master_mode", "check_scheme", "Codec", "codec_for", "encode", "decode",
    "pack4", "unpack4", "nblocks", "residual_encode", "residual_decode",
]

LOSSLESS_MAX_ELEMENTS: Final = 4096  # tensors this small stay lossless (so do 1-D tensors)
FIRST_MOMENT_FIELDS: Final = ("exp_avg",)  # optimizer/state/<param>/<field>
SECOND_MOMENT_FIELDS: Final = ("exp_avg_sq",)
FLOAT_DTYPES: Final = ("F32", "BF16", "F16")
RESIDUAL: Final = "residual-bf16"
CAST: Final = "cast"  # master weight dropped: the stored model weight, upcast on load
_TINY: Final = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Codec:
    """How one stored piece is coded. name: see the module docstring; block: elements per block
    along the last dim, in logical coordinates."""

    name: str
    block: int

    def __post_init__(self) -> None:
        if self.name not in _LEVELS:
            raise QuantError(f"unknown codec {self.name!r}; expected one of {', '.join(sorted(_LEVELS))}")
        if self.block < 2 or self.block % 2:
            raise QuantError(f"block size {self.block} must be an even number >= 2")

    @property
    def bits(self) -> int:
        return 4 if self.name.endswith("4") else 8

    @property
    def levels(self) -> int:
        """Q: the largest code magnitude (linear) or the number of non-zero codes (log)."""
        return _LEVELS[self.name]

    @property
    def is_log(self) -> bool:
        return self.name.startswith("log")

    @property
    def codes_dtype(self) -> str:
        """The safetensors dtype the codes are stored in."""
        return "I8" if self.name == "lin-i8" else "U8"

    @property
    def scale_width(self) -> int:
        """Scale values per block: absmax (linear), or log2 of the smallest and largest sqrt(v) (log)."""
        return 2 if self.is_log else 1

    def codes_shape(self, lengths: Sequence[int]) -> tuple[int, ...]:
        """The stored shape of the codes of a piece of these lengths (int4: half the last dim, rounded up)."""
        n = lengths[-1]
        return (*lengths[:-1], (n + 1) // 2 if self.bits == 4 else n)

    def scales_shape(self, box: Box) -> tuple[int, ...]:
        """The stored shape of the scales of a piece with this box."""
        return (*box.lengths[:-1], nblocks(box.offsets[-1], box.lengths[-1], self.block), self.scale_width)


_LEVELS: Final = {"lin-i8": 127, "lin-i4": 7, "log-u8": 255, "log-u4": 15}
# scheme -> (first-moment codec, second-moment codec)
_SCHEME_CODECS: Final = {
    "O1": (Codec("lin-i8", 256), Codec("log-u8", 256)),
    "O2": (Codec("lin-i4", 128), Codec("log-u4", 128)),
}


def nblocks(offset: int, length: int, block: int) -> int:
    """How many logical blocks the columns [offset, offset + length) meet."""
    if length == 0:
        return 0
    return (offset + length - 1) // block - offset // block + 1


def codec_for(scheme: str | None, name: str, kind: str, dtype: str, shape: Sequence[int]) -> Codec | None:
    """The codec for a logical tensor under `scheme`, or None when it stays lossless.

    Only optimizer state fields known to be Adam moments are quantized (exp_avg: signed,
    exp_avg_sq: log of its square root), only floating point, only with >= 2 dims and more
    than LOSSLESS_MAX_ELEMENTS elements. Everything else (step, unknown fields, norms, biases)
    is stored as it is.
    """
    if scheme is None or kind != "optimizer" or dtype not in FLOAT_DTYPES or len(shape) < 2:
        return None
    if math.prod(shape) <= LOSSLESS_MAX_ELEMENTS or shape[-1] == 0:
        return None
    field = name.rsplit("/", 1)[-1]
    first, second = _SCHEME_CODECS[scheme]
    if field in FIRST_MOMENT_FIELDS:
        return first
    if field in SECOND_MOMENT_FIELDS:
        return second
    return None


def _blocked(x: torch.Tensor, offset: int, block: int, fill: float) -> torch.Tensor:
    """x (*lead, n) padded with `fill` to whole logical blocks: (*lead, nblocks, block)."""
    n = x.shape[-1]
    left = offset % block
    total = nblocks(offset, n, block) * block
    if left == 0 and total == n:
        return x.reshape(*x.shape[:-1], total // block, block)
    padded = torch.full((*x.shape[:-1], total), fill, dtype=x.dtype)
    padded[..., left : left + n] = x
    return padded.view(*x.shape[:-1], total // block, block)


CHUNK_ELEMENTS: Final = 1 << 18  # rows are coded in chunks of about this many elements: temporaries stay in cache


def encode(codec: Codec, x: torch.Tensor, box: Box) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the values `x` (shape box.lengths, any float dtype) of the piece with box `box`.

    Returns (codes, scales): codes of shape codec.codes_shape(box.lengths) and dtype int8/uint8,
    scales float32 of shape codec.scales_shape(box). Raises QuantError for non-finite values or
    (second moment) negative values: the caller stores such a tensor losslessly.
    """
    if tuple(x.shape) != box.lengths or box.ndim < 1:
        raise QuantError(f"values of shape {list(x.shape)} do not match box {box}")
    n = box.lengths[-1]
    rows = x.reshape(-1, n)
    codes = torch.empty((rows.shape[0], codec.codes_shape((n,))[0]), dtype=torch.int8 if codec.codes_dtype == "I8" else torch.uint8)
    scales = torch.empty((rows.shape[0], nblocks(box.offsets[-1], n, codec.block), codec.scale_width), dtype=torch.float32)
    step = max(1, CHUNK_ELEMENTS // max(1, n))
    for r in range(0, rows.shape[0], step):
        _encode_rows(codec, rows[r : r + step], box.offsets[-1], codes[r : r + step], scales[r : r + step])
    return codes.view(codec.codes_shape(box.lengths)), scales.view(codec.scales_shape(box))


def _encode_rows(codec: Codec, x: torch.Tensor, offset: int, codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
    """Code rows x (r, n) whose first column is logical column `offset` into codes_out, scales_out."""
    x = x.to(torch.float32)
    n, block, q = x.shape[-1], codec.block, codec.levels
    left = offset % block
    xb = _blocked(x, offset, block, 0.0)  # (r, nb, B), a view when the row is whole blocks
    if codec.is_log:
        hi_v = xb.amax(-1, keepdim=True)  # NaN propagates: checked below on the small tensor
        if bool(xb.amin() < 0):
            raise QuantError("second moment has negative values; it is stored losslessly")
        if not bool(torch.isfinite(hi_v).all()):
            raise QuantError("tensor has non-finite values (inf or nan); it is stored losslessly")
        # the smallest non-zero v per block without a mask: non-negative floats order as their
        # bit patterns; (bits - 1) & 0x7fffffff turns 0 into the largest int32 and keeps the order
        bits = xb.view(torch.int32)
        lo_bits = bits.sub(1).bitwise_and_(0x7FFFFFFF).amin(-1, keepdim=True).add_(1)
        empty = lo_bits < 0  # a block of zeros: the largest int32 + 1
        lo_v = lo_bits.view(torch.float32)
        # log2 of sqrt(v) = 0.5 * log2(v): only the block's bounds need the square root's log
        lo = torch.where(empty, 0.0, lo_v.log2() * 0.5)
        hi = torch.where(empty, 0.0, hi_v.log2() * 0.5)
        span = hi - lo
        inv = torch.where(span > 0, (q - 1) / span, 1.0)
        # non-zero v: >= lo, so codes 1..Q; v == 0: log2 = -inf, clamped to -1, code 0
        coded = xb.log2().mul_(0.5).sub_(lo).mul_(inv).round_().clamp_(-1, q - 1).add_(1)
        codes = coded.to(torch.uint8)
        scales_out.copy_(torch.cat([lo, hi], dim=-1))
    else:
        absmax = xb.abs().amax(-1, keepdim=True)
        if not bool(torch.isfinite(absmax).all()):
            raise QuantError("tensor has non-finite values (inf or nan); it is stored losslessly")
        inv = torch.where(absmax > 0, q / absmax, 0.0)
        coded = (xb * inv).round_().clamp_(-q, q)
        codes = coded.to(torch.int8) if codec.bits == 8 else coded.add_(8).to(torch.uint8)
        scales_out.copy_(absmax)
    codes = codes.view(x.shape[0], -1)[:, left : left + n]
    if codec.bits == 4:
        codes = pack4(codes)
    codes_out.copy_(codes)


def decode(codec: Codec, codes: torch.Tensor, scales: torch.Tensor, region: Box, want: Box) -> torch.Tensor:
    """The float32 values of box `want` from the codes and scales of `region`.

    `region` is a stored piece, or the rows of it that were read: any sub-box with the piece's
    full last-dim range (codes and scales are its rows, of codec.codes_shape(region.lengths) and
    codec.scales_shape(region)). `want` must lie inside `region`.
    """
    if tuple(codes.shape) != codec.codes_shape(region.lengths) or tuple(scales.shape) != codec.scales_shape(region):
        raise QuantError(
            f"codes {list(codes.shape)} / scales {list(scales.shape)} do not match region {region} for codec {codec.name}: "
            f"expected {list(codec.codes_shape(region.lengths))} / {list(codec.scales_shape(region))}; the index and the data disagree"
        )
    inside = relative(want, region)
    lead, cols = inside[:-1], inside[-1]
    c0, c1 = cols.start, cols.stop
    part = codes[lead]
    if codec.bits == 4:
        b0, b1 = c0 // 2, (c1 + 1) // 2
        part = unpack4(part[..., b0:b1])[..., c0 - 2 * b0 : c0 - 2 * b0 + (c1 - c0)]
    else:
        part = part[..., c0:c1]
    n = c1 - c0
    first_col = region.offsets[-1] + c0
    skip = first_col // codec.block - region.offsets[-1] // codec.block
    nb = nblocks(first_col, n, codec.block)
    block_scales = scales[lead][..., skip : skip + nb, :]  # the blocks from the one holding column first_col
    outer = part.shape[:-1]
    rows = part.reshape(-1, n)
    blocked = _blocked(rows, first_col, codec.block, 0)  # (r, nb, B): each element beside its block's scales
    per_block = block_scales.reshape(-1, nb, codec.scale_width)
    if codec.is_log:
        # one value per (block, code), computed in float64 and rounded once: vectorized and
        # scalar exp2 differ in the last float32 bit, and a slice must decode bit for bit as the
        # whole piece does; then a lookup per element
        values = torch.gather(_log_table(codec, per_block), -1, blocked.to(torch.int64))
    else:
        signed = blocked.to(torch.float32) if codec.bits == 8 else blocked.to(torch.float32) - 8
        values = signed * (per_block[..., 0:1] / codec.levels)
    left = first_col % codec.block
    return values.reshape(rows.shape[0], -1)[:, left : left + n].reshape(*outer, n)


def _log_table(codec: Codec, bounds: torch.Tensor) -> torch.Tensor:
    """(r, nb, Q + 1) float32: the decoded v of each code of each block (code 0: 0)."""
    q = codec.levels
    lo, hi = bounds[..., 0:1].to(torch.float64), bounds[..., 1:2].to(torch.float64)
    k = torch.arange(q, dtype=torch.float64)
    s = torch.exp2(lo + k * ((hi - lo) / (q - 1)))
    v = (s * s).to(torch.float32).clamp_(min=_TINY)
    return torch.cat([torch.zeros((*v.shape[:-1], 1), dtype=torch.float32), v], dim=-1)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 of shape (*lead, n) packed two per byte: (*lead, ceil(n/2))."""
    n = codes.shape[-1]
    if n % 2:
        codes = torch.cat([codes, torch.zeros((*codes.shape[:-1], 1), dtype=torch.uint8)], dim=-1)
    pairs = codes.view(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack4: (*lead, m) bytes -> (*lead, 2m) codes 0..15."""
    out = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return out.view(*packed.shape[:-1], packed.shape[-1] * 2)


def residual_encode(master: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """master - float(model) in bfloat16 (same shape). Raises QuantError on a shape mismatch."""
    if master.shape != model.shape:
        raise QuantError(f"master weight of shape {list(master.shape)} and model weight of shape {list(model.shape)} differ")
    return (master.to(torch.float32) - model.to(torch.float32)).to(torch.bfloat16)


def residual_decode(model: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """float(model) + float(residual): the master weight, float32."""
    return model.to(torch.float32) + residual.to(torch.float32)
