"""Decoding quantized or residual pieces into a load's targets (ckptd.common.codecs, ckptd.common.quant).

What a codec needs on the client side: the rows of codes (plain or zstd frames) and of scales,
or of a residual and the model weight it adds to, read through ckptd.client.reader.pieces, decoded
into the target's wanted box.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ckptd.client.reader.pieces import Source, read_framed_rows, read_rows
from ckptd.client.errors import CheckpointError
from ckptd.common.blocks import QuantError
from ckptd.common.boxes import Box, relative
from ckptd.common.codecs import codec as codec_named
from ckptd.common.quant_options import RESIDUAL


def fill_decoded(src: Source, target: torch.Tensor, want: Box, common: Box) -> None:
    """Decode the part `common` of a quantized or residual fragment into `target`, which holds
    box `want` of its logical tensor.

    Reads only the fragment's rows (dim 0) that hold `common`, of the codes and of the scales
    (or of the residual and of the model weight), whole bytes (int4: two codes per byte, rows
    start on a byte boundary), and decodes the columns wanted (the codec's `decode`).
    """
    from ckptd.common import quant  # torch math: only where values are decoded

    decoding = src.decode
    assert decoding is not None
    box = src.box
    r0, r1 = (common.offsets[0] - box.offsets[0], common.end[0] - box.offsets[0]) if box.ndim else (0, 1)
    region = Box((box.offsets[0] + r0, *box.offsets[1:]), (r1 - r0, *box.lengths[1:])) if box.ndim else box
    dst = target[relative(common, want)]
    try:
        if decoding.codec == RESIDUAL:
            if decoding.base is None:
                raise CheckpointError(f"tensor {src.name!r}: a residual without the model weight it adds to; load an older step")
            residual = read_rows(src, "BF16", box.lengths, r0, r1)
            base = read_rows(decoding.base, decoding.base.dtype, box.lengths, r0, r1)
            inside = relative(common, region)
            # only the wanted columns; a float32 target is written in place (no temporaries)
            values = quant.residual_decode(base[inside], residual[inside], out=dst if dst.dtype == torch.float32 else None)
        else:
            codec = codec_named(decoding.codec, decoding.block)
            if decoding.scales is None:
                raise CheckpointError(f"tensor {src.name!r}: quantized without scales; load an older step")
            codes_shape = codec.codes_shape(box.lengths)
            if decoding.frames is None:
                codes = read_rows(src, codec.codes_dtype, codes_shape, r0, r1)
            else:
                codes = read_framed_rows(src, decoding.frames, codec.codes_dtype, codes_shape, r0, r1)
            scales = read_rows(decoding.scales, "F32", codec.scales_shape(box), r0, r1)
            values = codec.decode(codes, scales, region, common)
    except QuantError as exc:
        raise CheckpointError(f"tensor {src.name!r} in {Path(src.path).name}: {exc}") from None
    if values is not dst:  # decoded into the target already
        dst.copy_(values)
