"""What every reader of an index checks before it trusts the index's records (format/index.py).

The data files' checksums cannot vouch for the index itself: one flipped bit in a fragment's
offsets (`[0,0]` -> `[1,0]`) left its bytes and checksum as they were, and every load put them
one row off, leaving row 0 as it was, and said nothing. So an index is taken only when each
tensor's records could have been written by a save:

- its dtype is one ckptd stores, its shape has non-negative dimensions and at most
  MAX_TENSOR_BYTES bytes;
- its fragments' boxes have the tensor's rank, non-negative offsets and lengths, and tile the
  tensor exactly: inside it, no box listed twice or overlapping another, every element covered
  (common.boxes.coverage_problems);
- each fragment's byte range is non-negative; stored as its values (not quantized), it has the
  tensor's dtype and exactly the bytes of its box.

Pure: the records are read by attribute (this module cannot import index.py, which imports it).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from ckptd.common import dtypes
from ckptd.common.boxes import coverage_problems

MAX_TENSOR_BYTES = 1 << 60  # one tensor: far past any real one, well below what overflows a size computation


def tensor_problem(t: Any) -> str | None:
    """Why the TensorRecord `t` cannot have been written by a save (one reason), or None."""
    try:
        size = dtypes.itemsize(t.dtype)
    except dtypes.UnknownDtypeError as exc:
        return str(exc)
    shape = t.shape
    if any(d < 0 for d in shape):
        return f"its shape {list(shape)} has a negative dimension"
    if math.prod(shape) * size > MAX_TENSOR_BYTES:
        return f"its shape {list(shape)} of {t.dtype} is more than {MAX_TENSOR_BYTES} bytes"
    fragments = t.fragments
    if len(fragments) == 1:  # nearly every tensor: one fragment of all of it
        box = fragments[0].box
        if box.lengths == shape and not any(box.offsets):
            return _fragment_problem(fragments[0], t.dtype, size)
    keys = set()
    for f in fragments:
        box = f.box
        if len(box.offsets) != len(shape) or len(box.lengths) != len(shape):
            return f"a fragment's box {box} has another rank than its shape {list(shape)}"
        if any(o < 0 for o in box.offsets) or any(n < 0 for n in box.lengths):
            return f"a fragment's box {box} has a negative offset or length"
        key = (box.offsets, box.lengths)
        if key in keys:
            return f"the fragment {box} is listed twice"
        keys.add(key)
        problem = _fragment_problem(f, t.dtype, size)
        if problem is not None:
            return problem
    boxes = [f.box for f in fragments]
    if _grid(shape, boxes):
        return None
    problems = coverage_problems(shape, boxes)
    if problems:
        return f"its fragments do not tile its shape {list(shape)} exactly: {problems[0]}"
    return None


def _grid(shape: tuple[int, ...], boxes: list[Any]) -> bool:
    """Whether distinct `boxes` are every cell of a grid over the tensor: along each dimension
    their spans tile it back to back from 0 to its end, and there are as many boxes as cells
    (row or column shards, and their products: TP within FSDP), which tiles it exactly; False
    says nothing (coverage_problems decides). O(boxes x rank)."""
    cells = 1
    for d, size in enumerate(shape):
        spans = sorted({(b.offsets[d], b.lengths[d]) for b in boxes})
        at = 0
        for offset, length in spans:
            if offset != at or length == 0:
                return False
            at += length
        if at != size:
            return False
        cells *= len(spans)
    return cells == len(boxes)  # distinct boxes, each a cell: all of them


def _fragment_problem(f: Any, dtype: str, size: int) -> str | None:
    for record in _stored_records(f):
        if record.offset < 0 or record.nbytes < 0:
            return f"a fragment {f.box} is stored at bytes [{record.offset}, +{record.nbytes}) of {record.file!r}"
        try:
            dtypes.itemsize(record.dtype)
        except dtypes.UnknownDtypeError as exc:
            return f"a fragment {f.box} is stored as {exc}"
    if f.chunk_bytes < 0:
        return f"a fragment {f.box} records chunks of {f.chunk_bytes} bytes"
    if f.quant is None:
        if f.dtype != dtype:
            return f"a fragment {f.box} is stored as {f.dtype} without a codec, but the tensor is {dtype}"
        if f.nbytes != f.box.numel * size:
            return f"a fragment {f.box} is stored in {f.nbytes} bytes, but its box holds {f.box.numel * size}"
    return None


def _stored_records(f: Any) -> Iterable[Any]:
    """The fragment's record and its side records (a quantized fragment's scales, a residual's base)."""
    yield f
    if f.quant is not None:
        yield from (side for side in (f.quant.scales, f.quant.base) if side is not None)
