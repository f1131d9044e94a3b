"""Boxes of logical tensors and the arithmetic of resharding, as pure functions.

A box is a hyper-rectangle of a logical (unsharded) tensor: `offsets[d]` is its first index
along dimension d and `lengths[d]` its extent, in elements. A 0-dim tensor has the empty box.
Data of a box is stored contiguously in row-major (C) order of the box's own shape.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence


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
        return Box(tuple(0 for _ in shape), tuple(int(n) for n in shape))

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
        return all(o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape))

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
    if a.ndim != b.ndim:
        raise ValueError(f"boxes of different rank: {a} and {b}")
    if a.numel == 0 or b.numel == 0:
        return None
    offsets = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    ends = tuple(min(x, y) for x, y in zip(a.end, b.end))
    if any(e <= o for o, e in zip(offsets, ends)):
        return None
    return Box(offsets, tuple(e - o for o, e in zip(offsets, ends)))


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
    """Why a set of distinct boxes does not tile a tensor of `shape` exactly (empty if it does).

    Identical boxes (replicas) must be removed by the caller first. The check is exact:
    the boxes must lie inside the tensor, must not overlap, and their volumes must add up.
    """
    unique = sorted(set(boxes))
    problems = [f"box {b} lies outside shape {list(shape)}" for b in unique if not b.fits_in(shape)]
    if problems:
        return problems
    for i, a in enumerate(unique):
        for b in unique[i + 1 :]:
            # Sorted by offsets: once b starts past a's end along dim 0 nothing later overlaps a.
            if a.ndim and b.offsets[0] >= a.end[0]:
                break
            common = intersect(a, b)
            if common is not None:
                problems.append(f"boxes {a} and {b} overlap in {common}")
    if problems:
        return problems
    covered = sum(b.numel for b in unique)
    total = math.prod(shape)
    if covered != total:
        problems.append(f"boxes cover {covered} of {total} elements")
    return problems


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

