"""Boxes of logical tensors and the arithmetic of resharding, as pure functions.

A box is a hyper-rectangle of a logical (unsharded) tensor: `offsets[d]` is its first index
along dimension d and `lengths[d]` its extent, in elements. A 0-dim tensor has the empty box.
Data of a box is stored contiguously in row-major (C) order of the box's own shape.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Iterable, Sequence

from ckptd.common.tiling import overlapping_pairs, tiling_residual

MAX_OVERLAPS_LISTED = 100  # pairs of overlapping boxes coverage_problems names


@dataclass(frozen=True, order=True, slots=True)
class Box:
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box has {len(self.offsets)} offsets but {len(self.lengths)} lengths")
        if self.offsets and (min(self.offsets) < 0 or min(self.lengths) < 0):
            raise ValueError(f"box offsets and lengths must be >= 0, got {self}")

    @staticmethod
    def full(shape: Sequence[int]) -> "Box":
        """The box covering a whole tensor of this shape."""
        lengths = tuple(map(int, shape))
        return Box((0,) * len(lengths), lengths)

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def fits_in(self, shape: Sequence[int]) -> bool:
        """True if the box lies inside a tensor of this shape."""
        if len(shape) != self.ndim:
            return False
        return all(map(operator.le, map(operator.add, self.offsets, self.lengths), shape))  # C-level: planners call it per tensor

    def is_full(self, shape: Sequence[int]) -> bool:
        return self == Box.full(shape)

    def __str__(self) -> str:
        if not self.lengths:
            return "[]"
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + "]"


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None if they do not overlap.

    Two 0-dim boxes overlap (both are the single element). Empty boxes overlap nothing.
    """
    if a == b:  # the common case of a load into the layout that saved: no arithmetic
        return None if 0 in a.lengths else a
    if len(a.lengths) != len(b.lengths):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    if 0 in a.lengths or 0 in b.lengths:
        return None
    # C-level maps, no generator per dimension: a load plans one call per wanted box and
    # fragment (2 ranks x 1,000 tensors x 3 fragments: 6,000 calls)
    offsets = tuple(map(max, a.offsets, b.offsets))
    lengths = tuple(map(operator.sub, map(min, map(operator.add, a.offsets, a.lengths), map(operator.add, b.offsets, b.lengths)), offsets))
    if lengths and min(lengths) <= 0:
        return None
    return Box(offsets, lengths)


def overlaps(a: Box, b: Box) -> bool:
    """Whether `intersect(a, b)` is not None, without making the common box (a load's planner
    asks it of every stored fragment of every wanted tensor)."""
    if a == b:
        return 0 not in a.lengths
    if len(a.lengths) != len(b.lengths):
        raise ValueError(f"boxes of different rank: {a} and {b}")
    if 0 in a.lengths or 0 in b.lengths:
        return False
    return all(map(operator.lt, a.offsets, map(operator.add, b.offsets, b.lengths))) and all(
        map(operator.lt, b.offsets, map(operator.add, a.offsets, a.lengths))
    )


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that select `inner` within a tensor holding the data of `outer`.

    `inner` must lie within `outer` (e.g. an intersection of `outer` with another box).
    """
    if inner.ndim != outer.ndim:
        raise ValueError(f"boxes of different rank: {inner} and {outer}")
    slices = []
    for io, il, oo, ol in zip(inner.offsets, inner.lengths, outer.offsets, outer.lengths):
        start = io - oo
        if start < 0 or start + il > ol:
            raise ValueError(f"box {inner} does not lie within {outer}")
        slices.append(slice(start, start + il))
    return tuple(slices)


def coverage_problems(shape: Sequence[int], boxes: Iterable[Box]) -> list[str]:
    """Why a set of boxes does not tile a tensor of `shape` exactly (empty if it does).

    Identical boxes (replicas) count once; empty boxes cover nothing. The verdict is exact.
    The problems: every box outside the tensor; else the pairs of boxes that overlap, in sorted
    order (the first MAX_OVERLAPS_LISTED, then how many more); else how many elements the boxes
    cover. O(n log n) for n boxes (common/tiling.py). Input made to slow the search for
    overlapping pairs (boxes that overlap along the dimensions it sweeps) stops it after
    tiling.MAX_COMPARED comparisons: then the problem is the sum of the volumes when it is not
    the tensor's, else an element covered twice or not at all; boxes split in so many
    dimensions that the exact check would take over tiling.MAX_CORNERS steps as well are a
    problem of their own.
    """
    shape = tuple(shape)
    boxes = list(boxes)
    if len(boxes) == 1 and boxes[0].lengths == shape and not any(boxes[0].offsets):
        return []  # one box of all of it (most tensors): covered exactly, nothing to sort or sweep
    # Distinct boxes in Box's order, as (offsets, lengths) keys: tuples hash and compare in C.
    unique = sorted({(b.offsets, b.lengths): b for b in boxes}.items())
    problems = []
    solid: list[Box] = []  # empty boxes overlap nothing and cover nothing
    spans = []
    for (offsets, lengths), b in unique:
        end = tuple(o + n for o, n in zip(offsets, lengths))
        if len(end) != len(shape) or any(e > s for e, s in zip(end, shape)):
            problems.append(f"box {b} lies outside shape {list(shape)}")
        elif 0 not in lengths:
            solid.append(b)
            spans.append((offsets, end))
    if problems:
        return problems
    covered, total = sum(math.prod(b.lengths) for b in solid), math.prod(shape)
    residual = tiling_residual(shape, spans) if covered == total else None
    if residual == {}:
        return []
    pairs, count, finished = overlapping_pairs(spans, MAX_OVERLAPS_LISTED)
    if pairs:
        problems = [_overlap_problem(solid[i], solid[j]) for i, j in pairs]
        if count > len(pairs) or not finished:
            problems.append(f"and {count - len(pairs)} more pairs of boxes overlap" if finished else "and more pairs of boxes may overlap")
        return problems
    if finished or covered != total:  # unfinished: a sum of volumes other than the total is still a gap or an overlap
        if covered == total:
            return []
        return [f"boxes cover {covered} of {total} elements" + ("" if covered < total else ": some overlap")]
    if residual is None:
        return [f"{len(solid)} boxes split in {len(shape)} dimensions are too many to check that they tile shape "
                f"{list(shape)}: split the tensor into fewer pieces or along fewer dimensions"]
    point = min(residual)  # covered other than once
    holders = [b for b in solid if all(o <= p < o + n for o, n, p in zip(b.offsets, b.lengths, point))]
    if len(holders) > 1:
        return [_overlap_problem(holders[0], b) for b in holders[1 : MAX_OVERLAPS_LISTED + 1]]
    return [f"element {list(point)} lies in no box, and other boxes overlap"]


def _overlap_problem(a: Box, b: Box) -> str:
    return f"boxes {a} and {b} overlap in {intersect(a, b)}"


def contiguous_runs(box: Box, shape: Sequence[int]) -> list[tuple[int, int, int]]:
    """Where the elements of `box` lie in a row-major tensor of `shape`, as contiguous runs.

    Returns (offset in the tensor, offset in the box's own row-major data, length), all in
    elements, in increasing order. Trailing dimensions that the box spans fully are merged,
    so a block of whole rows is one run.
    """
    if not box.fits_in(shape):
        raise ValueError(f"box {box} lies outside shape {list(shape)}")
    if box.numel == 0:
        return []
    ndim = len(shape)
    # The innermost dims that the box spans fully, plus the one before them, form one run.
    split = ndim
    run = 1
    while split > 0:
        split -= 1
        run *= box.lengths[split]
        if box.lengths[split] != shape[split]:
            break
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    base = sum(o * s for o, s in zip(box.offsets, strides))
    outer = [range(n) for n in box.lengths[:split]]
    runs = []
    for src, index in enumerate(itertools.product(*outer)):
        start = base + sum(i * strides[d] for d, i in enumerate(index))
        runs.append((start, src * run, run))
    return runs

