"""Whether boxes tile a tensor, in O(n log n) for n boxes: the algorithms behind
`boxes.coverage_problems`, over plain (offsets, ends) tuples.

A box here is `(offsets, ends)`: per dimension its first index and one past its last, in
elements; every box is non-empty and lies inside the tensor (the caller checks both). The
check runs on every save plan and on untrusted input (a DCP `.metadata` names any number of
chunks), so each algorithm has a bound on its work and says when it stopped at it.

- `tiling_residual` decides exactly whether the boxes cover every element once. A box's
  indicator is a signed sum of its 2^k corner orthants (k: the dimensions in which it ends
  before the tensor does), so the boxes tile the tensor iff their signed corners cancel to the
  tensor's one corner at the origin: a dictionary of corner counts, O(sum of 2^k).
- `overlapping_pairs` lists the pairs that overlap: a sweep along one dimension with the boxes
  it crosses kept in an interval index along a second one, each pair overlapping in both checked
  in the rest. O(n log n + pairs overlapping in the two dimensions), which are chosen as those
  in which the fewest pairs overlap.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Iterable, Sequence

Span = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, ends) of a non-empty box

# The bounds on work (each unit is one dictionary update or one pair compared, well under a
# microsecond): far above what real layouts need (40,000 chunks split in 5 dimensions need 1.3M
# corners), low enough that crafted input is refused in about a second.
MAX_CORNERS = 1 << 21
MAX_COMPARED = 1 << 18


def tiling_residual(shape: Sequence[int], spans: Sequence[Span], max_corners: int | None = None) -> dict[tuple[int, ...], int] | None:
    """The signed corner counts that do not cancel: {} when the spans cover every element of a
    tensor of `shape` exactly once; None when that would take more than `max_corners` terms
    (None: MAX_CORNERS).

    Otherwise the lexicographically first key is an element covered other than once (no other
    non-zero corner lies below it in every dimension, so its count is the coverage there minus 1).
    """
    limit = MAX_CORNERS if max_corners is None else max_corners
    cuts = []  # per box, the dimensions in which it ends before the tensor does
    corners = 0
    dims = range(len(shape))
    for _, ends in spans:
        cut = [d for d in dims if ends[d] < shape[d]]
        corners += 1 << len(cut)
        if corners > limit:
            return None
        cuts.append(cut)
    counts: dict[tuple[int, ...], int] = {}
    for (offsets, ends), cut in zip(spans, cuts):
        # Per dimension the box's indicator is H(x - offset) - H(x - end); H(x - end) is 0 inside
        # the tensor where the box reaches its end, so only the cut dimensions have two terms.
        terms = [(offsets, 1)]
        for d in cut:
            terms += [(c[:d] + (ends[d],) + c[d + 1 :], -sign) for c, sign in terms]
        for corner, sign in terms:
            counts[corner] = counts.get(corner, 0) + sign
    origin = tuple(0 for _ in shape)
    counts[origin] = counts.get(origin, 0) - 1
    return {corner: n for corner, n in counts.items() if n}


def overlapping_pairs(spans: Sequence[Span], keep: int, max_compared: int | None = None) -> tuple[list[tuple[int, int]], int, bool]:
    """The pairs (i, j), i < j, of indices into `spans` whose boxes overlap: the first `keep` in
    order, how many there are in all, and whether the search finished (False: it stopped after
    comparing `max_compared` pairs (None: MAX_COMPARED), and the list and count are what it found
    until then)."""
    n = len(spans)
    if n < 2:
        return [], 0, True
    ndim = len(spans[0][0])
    if ndim == 0:
        return [], 0, True
    crossing = list(range(ndim))
    if ndim > 2:  # sweep the two dimensions along which the fewest pairs overlap; check the others
        along = [_pairs_overlapping_along(spans, d) for d in range(ndim)]
        crossing.sort(key=lambda d: along[d])
        if along[crossing[0]] == 0:
            return [], 0, True
    a, rest = crossing[0], crossing[2:]
    index = _IntervalIndex([s[0][crossing[1]] for s in spans], [s[1][crossing[1]] for s in spans]) if ndim > 1 else None
    limit = MAX_COMPARED if max_compared is None else max_compared
    found = _Found(keep)
    active: set[int] = set()
    leaving: list[tuple[int, int]] = []  # (end along a, index) of the active boxes
    compared = 0
    for i in sorted(range(n), key=lambda k: spans[k][0][a]):
        offsets, ends = spans[i]
        while leaving and leaving[0][0] <= offsets[a]:
            _, j = heapq.heappop(leaving)
            active.discard(j)
            if index is not None:
                index.remove(j)
        candidates: Iterable[int] = active if index is None else index.overlapping(i)
        for j in candidates:
            compared += 1
            if compared > limit:
                return found.pairs(), found.count, False
            other_offsets, other_ends = spans[j]
            for d in rest:
                if offsets[d] >= other_ends[d] or other_offsets[d] >= ends[d]:
                    break
            else:
                found.add(min(i, j), max(i, j))
        active.add(i)
        heapq.heappush(leaving, (ends[a], i))
        if index is not None:
            index.add(i)
    return found.pairs(), found.count, True


def _pairs_overlapping_along(spans: Sequence[Span], d: int) -> int:
    """How many pairs of boxes overlap along dimension d (whatever the others): per box, the
    boxes starting at or after it (later in start order) and before its end."""
    order = sorted((s[0][d], s[1][d]) for s in spans)
    starts = [start for start, _ in order]
    return sum(bisect.bisect_left(starts, end) - k - 1 for k, (_, end) in enumerate(order))


class _Found:
    """The first `keep` pairs in (i, j) order (a bounded max-heap) and how many were added."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._heap: list[tuple[int, int]] = []  # negated pairs: the largest kept is on top
        self.count = 0

    def add(self, i: int, j: int) -> None:
        self.count += 1
        if len(self._heap) < self._keep:
            heapq.heappush(self._heap, (-i, -j))
        elif self._keep and (-i, -j) > self._heap[0]:
            heapq.heapreplace(self._heap, (-i, -j))

    def pairs(self) -> list[tuple[int, int]]:
        return sorted((-i, -j) for i, j in self._heap)


class _IntervalIndex:
    """Intervals [starts[k], ends[k]) (all non-empty) present in a set that changes, asked for
    those that overlap one of them: the ones that start inside it (a sorted list of starts)
    and the ones that contain its start (a segment tree over the distinct coordinates, each
    interval kept at O(log n) nodes)."""

    def __init__(self, starts: Sequence[int], ends: Sequence[int]) -> None:
        self._starts, self._ends = starts, ends
        coords = sorted(set(starts) | set(ends))
        self._leaf = {c: k for k, c in enumerate(coords)}
        self._size = 1 << max(1, len(coords) - 1).bit_length()
        self._nodes: list[set[int] | None] = [None] * (2 * self._size)
        self._by_start: list[tuple[int, int]] = []
        self._held_at: dict[int, list[int]] = {}  # present interval -> its tree nodes

    def _tree_nodes(self, k: int) -> list[int]:
        """The segment tree nodes that together cover interval k's leaves."""
        lo, hi = self._leaf[self._starts[k]] + self._size, self._leaf[self._ends[k]] + self._size
        out = []
        while lo < hi:
            if lo & 1:
                out.append(lo)
                lo += 1
            if hi & 1:
                hi -= 1
                out.append(hi)
            lo >>= 1
            hi >>= 1
        return out

    def add(self, k: int) -> None:
        self._held_at[k] = nodes = self._tree_nodes(k)
        for node in nodes:
            held = self._nodes[node]
            if held is None:
                held = self._nodes[node] = set()
            held.add(k)
        bisect.insort(self._by_start, (self._starts[k], k))

    def remove(self, k: int) -> None:
        for node in self._held_at.pop(k):
            held = self._nodes[node]
            if held is not None:
                held.discard(k)
        del self._by_start[bisect.bisect_left(self._by_start, (self._starts[k], k))]

    def overlapping(self, k: int) -> list[int]:
        """The intervals present that overlap interval k (k itself need not be present)."""
        start, end = self._starts[k], self._ends[k]
        out: list[int] = []
        node = self._leaf[start] + self._size
        while node:
            held = self._nodes[node]
            if held:
                out.extend(held)  # they contain `start`: they start at or before it
            node >>= 1
        lo = bisect.bisect_right(self._by_start, (start, len(self._starts)))
        hi = bisect.bisect_left(self._by_start, (end, -1))
        out.extend(j for _, j in self._by_start[lo:hi])
        return out
