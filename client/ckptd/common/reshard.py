"""The arithmetic of resharding: which bytes of a stored fragment land where in a wanted box.

Pure functions, no I/O. Both a fragment's data and a wanted box's data are the row-major (C)
bytes of the box's own shape (see boxes.py); offsets here are in bytes of that data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ckptd.common.boxes import Box, intersect


@dataclass(frozen=True)
class CopyRun:
    """Copy `nbytes` from byte `src` of a stored fragment's data to byte `dst` of the wanted box's data (both row-major)."""

    src: int
    dst: int
    nbytes: int


def _strides(lengths: Sequence[int]) -> list[int]:
    """Row-major strides, in elements, of a box of these lengths."""
    return [math.prod(lengths[d + 1 :]) for d in range(len(lengths))]


def _starts(common: Box, outer: Box, split: int) -> list[int]:
    """Element offsets, within `outer`'s data, of the runs of `common` (a box inside `outer`) that
    start at each index of `common`'s first `split` dims, in row-major order."""
    strides = _strides(outer.lengths)
    starts = [sum((c - o) * s for c, o, s in zip(common.offsets, outer.offsets, strides))]
    for d in range(split):
        step = strides[d]
        starts = [s + i * step for s in starts for i in range(common.lengths[d])]
    return starts


def copy_runs(fragment: Box, want: Box, itemsize: int) -> list[CopyRun]:
    """The byte runs that move the intersection of `fragment` and `want` from the fragment's
    row-major data into the wanted box's row-major data.

    Runs are in increasing order on both sides and as long as they can be: the innermost dims
    that the intersection spans fully in both boxes merge with the one before them (whole rows
    are one run). Empty when the boxes do not overlap; one run of `itemsize` bytes for 0-dim.
    """
    if itemsize <= 0:
        raise ValueError(f"itemsize must be > 0, got {itemsize}")
    common = intersect(fragment, want)
    if common is None:
        return []
    split, run = _run_shape(common, fragment, want)
    nbytes = run * itemsize
    return [
        CopyRun(s * itemsize, d * itemsize, nbytes)
        for s, d in zip(_starts(common, fragment, split), _starts(common, want, split))
    ]


def _run_shape(common: Box, fragment: Box, want: Box) -> tuple[int, int]:
    """(split, run): dims split..ndim-1 of `common` form one run of `run` elements; all of them
    are spanned fully in both boxes except `split`."""
    split = common.ndim
    run = 1
    while split > 0:
        split -= 1
        run *= common.lengths[split]
        if common.lengths[split] != fragment.lengths[split] or common.lengths[split] != want.lengths[split]:
            break
    return split, run


def run_count(fragment: Box, want: Box) -> int:
    """len(copy_runs(fragment, want, ...)), without building the runs (a column slice of a
    large matrix has a run per row)."""
    common = intersect(fragment, want)
    if common is None:
        return 0
    split, _ = _run_shape(common, fragment, want)
    return math.prod(common.lengths[:split])


def row_block(fragment: Box, want: Box) -> tuple[int, int, int] | None:
    """The overlap of two boxes that span the same range of every dim but the first (row slices
    of the same tensor) as one run, in elements: (offset in the fragment's row-major data, offset
    in the wanted box's, length); (0, 0, 0) when they do not overlap. None for any other pair
    (0-dim boxes, or boxes that differ in a later dim), which copy_runs handles.

    Equals copy_runs(fragment, want, 1) wherever it is not None, without building a Box or a
    CopyRun: a load of many row slices asks once per piece.
    """
    fo, fl, wo, wl = fragment.offsets, fragment.lengths, want.offsets, want.lengths
    if not fl or fl[1:] != wl[1:] or fo[1:] != wo[1:]:
        return None
    row = math.prod(fl[1:])
    lo, hi = max(fo[0], wo[0]), min(fo[0] + fl[0], wo[0] + wl[0])
    if hi <= lo or row == 0:
        return (0, 0, 0)
    return ((lo - fo[0]) * row, (lo - wo[0]) * row, (hi - lo) * row)


def read_ranges(runs: Sequence[CopyRun], max_gap: int = 64 * 1024, max_len: int | None = None) -> list[tuple[int, int]]:
    """The byte ranges (offset, nbytes) of the fragment to read so that every run's source is read.

    Runs closer than `max_gap` bytes are read as one range: reading a little extra beats many
    small reads. With `max_len`, a range stops growing before it would exceed `max_len` bytes
    (a single run longer than that is a range of its own). Sorted, not overlapping.
    """
    ranges: list[tuple[int, int]] = []
    lo = hi = 0
    for r in sorted(runs, key=lambda r: r.src):
        if r.nbytes == 0:
            continue
        end = r.src + r.nbytes
        if ranges and r.src - hi <= max_gap and (max_len is None or max(hi, end) - lo <= max_len):
            hi = max(hi, end)
            ranges[-1] = (lo, hi - lo)
        else:
            lo, hi = r.src, end
            ranges.append((lo, hi - lo))
    return ranges


def even_shards(n: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of each of `parts` shards of `n` elements, as DTensor's Shard splits a dim.

    Like torch.chunk: the first shards get ceil(n / parts) elements and the rest what is left,
    possibly 0 (an empty shard starts at n). E.g. even_shards(5, 4) == [(0, 2), (2, 2), (4, 1), (5, 0)].
    """
    if parts <= 0 or n < 0:
        raise ValueError(f"cannot split {n} elements into {parts} parts: need n >= 0 and parts >= 1")
    chunk = -(-n // parts)
    return [(min(n, chunk * i), max(0, min(n, chunk * (i + 1)) - chunk * i)) for i in range(parts)]


def shard_boxes(shape: Sequence[int], dim: int, parts: int) -> list[Box]:
    """The boxes of a tensor of `shape` split into `parts` shards along `dim` (see even_shards)."""
    if not 0 <= dim < len(shape):
        raise ValueError(f"dim {dim} is not a dim of shape {list(shape)}")
    boxes = []
    for offset, length in even_shards(shape[dim], parts):
        offsets = tuple(offset if d == dim else 0 for d in range(len(shape)))
        lengths = tuple(length if d == dim else int(n) for d, n in enumerate(shape))
        boxes.append(Box(offsets, lengths))
    return boxes
