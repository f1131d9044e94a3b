"""Blockwise quantization of optimizer state and master-weight residuals (docs/architecture.md §8), as pure
functions: no file system, no RPC. Encoding is native (ckptd.common._codec, one pass over the
values); decoding is torch tensor math. Imported by the daemon (encoding, in its background
writer) and by the client (decoding the slices it reads itself).

Blocks are defined in the logical (unsharded) tensor's coordinates: block j of a row holds the
elements whose last-dim index c satisfies j*B <= c < (j+1)*B. A stored piece (a whole tensor or
a fragment with box F) has one scale entry per row and per block that meets F's columns, so its
scale tensor has shape (*F.lengths[:-1], nblocks(F), width). A fragment that cuts a block (only
possible for a tensor sharded along its last dim across nodes) computes that block's scale over
its own part; every element's decoded value depends only on its own code and the scale entry of
(its row, its block) in the piece that stores it, so any slice of any piece decodes exactly as
the same elements of the whole piece do.

The codecs (their names in the index, bits, levels, error bounds, framing) are classes in
ckptd.common.codecs; this module is their shared math: `encode_blockwise` (the native kernel,
ckptd.common._codec, given the family's flag, bits and levels) and `decode_blockwise` (torch),
and the master weights' residual:

- "residual-bf16" (master weights): master - float(model) stored in bfloat16; the master weight
  comes back as float(model) + float(residual) (relative error about 2^-16 of the weight).

int4 codes pack two per byte along each row of the stored piece: element 2i of the row in the
low nibble, 2i+1 in the high nibble; a row of odd length has its last high nibble zero. Signed
int4 codes are stored as q + 8 (1..15). Rows always start on a byte boundary, so a slice reads
whole rows and whole bytes and unpacks.
"""

from __future__ import annotations

import math
from typing import Final

import torch

from ckptd.common import dtypes
from ckptd.common.boxes import Box, relative
from ckptd.common.blocks import BlockCoding, QuantError, nblocks

__all__ = ["Scratch", "unpack4", "residual_encode", "residual_decode", "encode_blockwise", "decode_blockwise"]

_TINY: Final = torch.finfo(torch.float32).tiny


def _needs_padding(rows: torch.Tensor, offset: int, block: int) -> bool:
    """Whether `rows` (r, n), starting at logical column `offset`, must be copied into a float32
    buffer of whole blocks before coding (else the encoder reads them in place: contiguous
    float32 rows of whole blocks)."""
    return offset % block != 0 or rows.shape[1] % block != 0 or rows.dtype != torch.float32 or not rows.is_contiguous()


def _blocked(x: torch.Tensor, offset: int, block: int, out: torch.Tensor) -> torch.Tensor:
    """`out` (r, nblocks, block), of any dtype, holding x (r, n) converted, at its logical
    columns, zero padded."""
    r, n = x.shape
    left = offset % block
    nb = nblocks(offset, n, block)
    flat = out.view(r, nb * block)
    flat[:, :left].zero_()
    flat[:, left + n :].zero_()
    flat[:, left : left + n].copy_(x)
    return out


CHUNK_ELEMENTS: Final = 1 << 19  # rows are converted or decoded in chunks of about this many elements: temporaries stay in cache


def _chunk_rows(nb: int, block: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, nb * block))


class Scratch:
    """Buffers that `encode` reuses from call to call instead of allocating its output and work
    space anew: fresh memory costs the kernel a page fault and zeroing per 4 KiB touched, about
    as much as the coding itself. Grow-only (it holds as much as the largest piece coded with it
    needs); for one thread at a time. What `encode` returns with a Scratch are views of its
    buffers: valid until the Scratch is used again."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of `shape` and `dtype` in the buffer called `name`."""
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes].view(dtype).view(shape)


def encode_blockwise(codec: BlockCoding, x: torch.Tensor, box: Box, scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the values `x` (shape box.lengths, any float dtype) of the piece with box `box`.

    Returns (codes, scales): codes of shape codec.codes_shape(box.lengths) and dtype int8/uint8,
    scales float32 of shape codec.scales_shape(box); with `scratch`, both are views of its
    buffers. Raises QuantError for non-finite values or (second moment) negative values: the
    caller stores such a tensor losslessly.

    The coding itself is native (ckptd.common._codec, one pass over the values, the GIL
    released); float32 rows of whole blocks are read in place, anything else is first converted
    into a float32 buffer of whole blocks, chunk by chunk. The extension is imported here, not
    with this module: a client that only decodes never loads it.
    """
    from ckptd.common import _codec

    if tuple(x.shape) != box.lengths or box.ndim < 1:
        raise QuantError(f"values of shape {list(x.shape)} do not match box {box}")
    space = scratch or Scratch()
    n, offset = box.lengths[-1], box.offsets[-1]
    nb = nblocks(offset, n, codec.block)
    count = math.prod(box.lengths[:-1])
    codes = space.tensor("codes", (count, codec.codes_shape((n,))[0]), getattr(torch, dtypes.torch_name(codec.codes_dtype)))
    scales = space.tensor("scales", (count, nb, codec.scale_width), torch.float32)
    if codes.numel():
        rows = x.reshape(count, n)
        padding = _needs_padding(rows, offset, codec.block)
        step = _chunk_rows(nb, codec.block) if padding else count
        padded = space.tensor("padded", (min(step, count), nb, codec.block), torch.float32) if padding else None
        for r in range(0, count, step):
            rr = slice(r, r + step)
            part = rows[rr]
            blocked = _blocked(part, offset, codec.block, padded[: part.shape[0]]) if padded is not None else part
            status = _codec.encode_blocks(
                codec.is_log, codec.bits, codec.levels, blocked.numpy(), part.shape[0], nb, codec.block,
                offset % codec.block, n, codes[rr].numpy(), scales[rr].numpy(),
            )
            if status == _codec.NEGATIVE:
                raise QuantError("second moment has negative values; it is stored losslessly")
            if status == _codec.NON_FINITE:
                raise QuantError("tensor has non-finite values (inf or nan); it is stored losslessly")
    return codes.view(codec.codes_shape(box.lengths)), scales.view(codec.scales_shape(box))


def decode_blockwise(codec: BlockCoding, codes: torch.Tensor, scales: torch.Tensor, region: Box, want: Box) -> torch.Tensor:
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
    n = c1 - c0
    part = codes[lead]
    outer = part.shape[:-1]
    first_col = region.offsets[-1] + c0
    skip = first_col // codec.block - region.offsets[-1] // codec.block
    nb = nblocks(first_col, n, codec.block)
    out = torch.empty((math.prod(outer), n), dtype=torch.float32)
    if out.numel():
        rows = part.reshape(out.shape[0], part.shape[-1])
        per_block = scales[lead][..., skip : skip + nb, :].reshape(-1, nb, codec.scale_width)  # from the block holding first_col
        step = _chunk_rows(nb, codec.block)
        for r in range(0, out.shape[0], step):
            rr = slice(r, r + step)
            _decode_rows(codec, rows[rr], per_block[rr], c0, first_col, out[rr])
    return out.view(*outer, n)


def _decode_rows(codec: BlockCoding, rows: torch.Tensor, per_block: torch.Tensor, c0: int, first_col: int, out: torch.Tensor) -> None:
    """Decode columns c0.. of stored code rows `rows` (c0: logical column first_col) into out (r, n)."""
    r, n = out.shape
    block = codec.block
    if codec.bits == 4:
        b0, b1 = c0 // 2, (c0 + n + 1) // 2
        part = unpack4(rows[:, b0:b1])[:, c0 - 2 * b0 : c0 - 2 * b0 + n]
    else:
        part = rows[:, c0 : c0 + n]
    nb = per_block.shape[1]
    left = first_col % block
    whole = left == 0 and nb * block == n
    if whole:
        blocked, values = part.reshape(r, nb, block), out.view(r, nb, block)
    else:  # pad codes are decoded and dropped
        blocked = _blocked(part, first_col, block, torch.empty((r, nb, block), dtype=part.dtype))
        values = torch.empty((r, nb, block), dtype=torch.float32)
    if codec.is_log:
        # one value per (block, code), then a lookup per element
        torch.gather(_log_table(codec, per_block), -1, blocked.to(torch.int64), out=values)
    else:
        values.copy_(blocked)
        if codec.zero:
            values.sub_(codec.zero)
        values.mul_(per_block[..., 0:1] / codec.levels)
    if not whole:
        out.copy_(values.view(r, -1)[:, left : left + n])


def _log_table(codec: BlockCoding, bounds: torch.Tensor) -> torch.Tensor:
    """(r, nb, Q + 1) float32: the decoded v of each code of each block (code 0: 0).

    Computed in float64 and rounded once, with exp2 on a buffer padded to a multiple of 64
    elements so that every value takes the same (vectorized) path: torch's vectorized and scalar
    exp2 differ in the last bit, and a slice must decode bit for bit as the whole piece does.
    """
    q = codec.levels
    lo, hi = bounds[..., 0:1].to(torch.float64), bounds[..., 1:2].to(torch.float64)
    k = torch.arange(q, dtype=torch.float64)
    count = lo.numel() * q
    s = torch.zeros(-(-count // 64) * 64, dtype=torch.float64)
    args = s[:count].view(*lo.shape[:-1], q)
    torch.mul(k, (hi - lo) / (q - 1), out=args).add_(lo)
    s = torch.exp2(s, out=s)
    table = torch.empty((*lo.shape[:-1], q + 1), dtype=torch.float32)
    table[..., 0] = 0.0
    table[..., 1:].copy_(args.mul_(args)).clamp_(min=_TINY)
    return table


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """int4 codes as stored, (*lead, m) bytes -> (*lead, 2m) codes 0..15 (the module docstring
    gives the nibble order; the encoder packs them)."""
    w = packed.to(torch.int16, memory_format=torch.contiguous_format)
    # low nibble to the low byte, high nibble to the high byte of each int16
    return w.bitwise_or((w << 4)).bitwise_and_(0x0F0F).view(torch.uint8)


def residual_encode(master: torch.Tensor, model: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """master - float(model) in bfloat16 (same shape; with `scratch`, a view of its buffers).
    Raises QuantError on a shape mismatch."""
    if master.shape != model.shape:
        raise QuantError(f"master weight of shape {list(master.shape)} and model weight of shape {list(model.shape)} differ")
    space = scratch or Scratch()
    shape = tuple(master.shape)
    difference = torch.sub(master.to(torch.float32), model, out=space.tensor("work", shape, torch.float32))
    return space.tensor("residual", shape, torch.bfloat16).copy_(difference)


def residual_decode(model: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float(model) + float(residual): the master weight, float32; written into `out` (a float32
    tensor of their shape, any strides) when given, without temporaries."""
    if out is None:
        return model.to(torch.float32) + residual.to(torch.float32)
    return out.copy_(model).add_(residual)
