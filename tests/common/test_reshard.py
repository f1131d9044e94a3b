import math
import random

import numpy as np
import pytest

from ckptd.common.boxes import Box, coverage_problems, relative
from ckptd.common.reshard import CopyRun, copy_runs, even_shards, read_ranges, row_block, run_count, shard_boxes


@pytest.mark.parametrize(
    "fragment, want, itemsize, runs",
    [
        # 1-D: the overlap of [2:7] and [0:4] is [2:4]
        (Box((2,), (5,)), Box((0,), (4,)), 4, [(0, 8, 8)]),
        # row split: whole rows are one run
        (Box((0, 0), (4, 3)), Box((2, 0), (2, 3)), 2, [(12, 0, 12)]),
        # column split: one run per row
        (Box((0, 0), (2, 4)), Box((0, 1), (2, 2)), 1, [(1, 0, 2), (5, 2, 2)]),
        # a block out of a whole tensor, and a block into a whole tensor
        (Box((0, 0), (4, 4)), Box((1, 1), (2, 2)), 1, [(5, 0, 2), (9, 2, 2)]),
        (Box((2, 2), (2, 2)), Box((0, 0), (4, 4)), 1, [(0, 10, 2), (2, 14, 2)]),
        # a block of rows of one fragment into a column block of the wanted box
        (Box((1, 0), (2, 4)), Box((0, 2), (4, 2)), 1, [(2, 2, 2), (6, 4, 2)]),
        # 3-D: the middle dim split, the last spanned fully
        (Box((0, 0, 0), (2, 2, 3)), Box((0, 1, 0), (2, 1, 3)), 1, [(3, 0, 3), (9, 3, 3)]),
        # 3-D: the first dim split, the rest whole: one run
        (Box((0, 0, 0), (4, 2, 3)), Box((1, 0, 0), (2, 2, 3)), 2, [(12, 0, 24)]),
        # 0-dim: the single element
        (Box((), ()), Box((), ()), 8, [(0, 0, 8)]),
        # empty and disjoint boxes: nothing to copy
        (Box((0,), (0,)), Box((0,), (4,)), 4, []),
        (Box((0,), (2,)), Box((2,), (2,)), 4, []),
        (Box((0, 0), (2, 2)), Box((0, 2), (2, 2)), 4, []),
        # the whole tensor on both sides
        (Box((0, 0), (3, 4)), Box((0, 0), (3, 4)), 4, [(0, 0, 48)]),
    ],
)
def test_copy_runs(fragment: Box, want: Box, itemsize: int, runs: list[tuple[int, int, int]]) -> None:
    assert copy_runs(fragment, want, itemsize) == [CopyRun(*r) for r in runs]


@pytest.mark.parametrize(
    "fragment, want, block",
    [
        # 1-D: the overlap of [2:7] and [0:4] is [2:4]
        (Box((2,), (5,)), Box((0,), (4,)), (0, 2, 2)),
        # a row slice of a fragment of whole rows: rows 2..3 of the fragment, all of the wanted box
        (Box((0, 0), (4, 3)), Box((2, 0), (2, 3)), (6, 0, 6)),
        # a fragment that covers the second half of the wanted rows
        (Box((4, 0), (4, 3)), Box((2, 0), (4, 3)), (0, 6, 6)),
        # the same box: all of it
        (Box((0, 0), (3, 4)), Box((0, 0), (3, 4)), (0, 0, 12)),
        # 3-D, later dims equal but not starting at 0 (a column block of rows)
        (Box((2, 1, 0), (4, 2, 3)), Box((3, 1, 0), (5, 2, 3)), (6, 0, 18)),
        # no overlap: rows that only touch, rows of no length, rows of nothing
        (Box((0, 0), (2, 3)), Box((2, 0), (2, 3)), (0, 0, 0)),
        (Box((0, 0), (0, 3)), Box((0, 0), (2, 3)), (0, 0, 0)),
        (Box((0, 0), (4, 0)), Box((1, 0), (2, 0)), (0, 0, 0)),
        # not row slices of each other: the general path
        (Box((0, 0), (2, 4)), Box((0, 1), (2, 2)), None),
        (Box((0, 0), (2, 4)), Box((0, 2), (2, 4)), None),
        (Box((0, 0, 0), (2, 2, 3)), Box((0, 1, 0), (2, 1, 3)), None),
        (Box((), ()), Box((), ()), None),
        (Box((0,), (4,)), Box((0, 0), (4, 1)), None),
    ],
)
def test_row_block(fragment: Box, want: Box, block: tuple[int, int, int] | None) -> None:
    assert row_block(fragment, want) == block


def test_row_block_agrees_with_copy_runs() -> None:
    """Wherever row_block answers, its run is copy_runs' only run (scaled by the itemsize), and
    no run at all when it says (0, 0, 0)."""
    rng = random.Random(7)
    answered = 0
    for _ in range(3000):
        ndim = rng.randint(1, 3)
        tail_off = tuple(rng.randint(0, 2) for _ in range(ndim - 1))
        tail_len = tuple(rng.randint(0, 3) for _ in range(ndim - 1))
        boxes = []
        for _ in range(2):
            other = rng.random() < 0.2  # sometimes a later dim differs
            offsets = (rng.randint(0, 6), *(o + (rng.randint(0, 1) if other else 0) for o in tail_off))
            boxes.append(Box(offsets, (rng.randint(0, 6), *tail_len)))
        fragment, want = boxes
        itemsize = rng.choice([1, 2, 4])
        block = row_block(fragment, want)
        if block is None:
            continue
        answered += 1
        runs = copy_runs(fragment, want, itemsize)
        if block[2] == 0:
            assert runs == [], (fragment, want)
        else:
            assert runs == [CopyRun(block[0] * itemsize, block[1] * itemsize, block[2] * itemsize)], (fragment, want)
    assert answered > 1000


@pytest.mark.parametrize(
    "runs, max_gap, max_len, ranges",
    [
        ([], 64, None, []),
        ([(0, 0, 10), (20, 10, 10)], 64, None, [(0, 30)]),
        ([(0, 0, 10), (20, 10, 10)], 10, None, [(0, 30)]),  # a gap of exactly max_gap is read through
        ([(0, 0, 10), (20, 10, 10)], 9, None, [(0, 10), (20, 10)]),
        ([(20, 10, 10), (0, 0, 10)], 0, None, [(0, 10), (20, 10)]),  # sorted by fragment offset
        ([(0, 0, 10), (10, 10, 10), (20, 20, 10)], 0, None, [(0, 30)]),  # adjacent runs
        ([(0, 0, 10), (10, 10, 10), (20, 20, 10)], 0, 20, [(0, 20), (20, 10)]),  # capped length
        ([(0, 0, 50), (50, 50, 10)], 0, 20, [(0, 50), (50, 10)]),  # a run longer than max_len alone
    ],
)
def test_read_ranges(
    runs: list[tuple[int, int, int]], max_gap: int, max_len: int | None, ranges: list[tuple[int, int]]
) -> None:
    assert read_ranges([CopyRun(*r) for r in runs], max_gap, max_len) == ranges


@pytest.mark.parametrize(
    "n, parts, shards",
    [
        (8, 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
        (5, 4, [(0, 2), (2, 2), (4, 1), (5, 0)]),
        (6, 4, [(0, 2), (2, 2), (4, 2), (6, 0)]),  # torch.chunk makes 3 chunks; DTensor pads with an empty one
        (1, 3, [(0, 1), (1, 0), (1, 0)]),
        (0, 2, [(0, 0), (0, 0)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_even_shards(n: int, parts: int, shards: list[tuple[int, int]]) -> None:
    assert even_shards(n, parts) == shards


def test_even_shards_match_dtensor() -> None:
    placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
    for n in range(0, 20):
        for parts in range(1, 9):
            expected = [placement_types.Shard.local_shard_size_and_offset(n, parts, r)[::-1] for r in range(parts)]
            assert even_shards(n, parts) == [tuple(map(int, e)) for e in expected], (n, parts)


def test_shard_boxes() -> None:
    assert shard_boxes((5, 3), 0, 2) == [Box((0, 0), (3, 3)), Box((3, 0), (2, 3))]
    assert shard_boxes((5, 3), 1, 2) == [Box((0, 0), (5, 2)), Box((0, 2), (5, 1))]
    with pytest.raises(ValueError, match="not a dim"):
        shard_boxes((5, 3), 2, 2)
    with pytest.raises(ValueError, match="parts >= 1"):
        even_shards(5, 0)


# ---------------------------------------------------------------- N -> M, every pair in 1..8

SHAPES = [(7,), (13, 5), (5, 11, 3)]
SCHEMES = ["dim0", "dim1", "blocks", "ragged"]


def layout(shape: tuple[int, ...], scheme: str, n: int) -> list[Box]:
    """`n` boxes tiling a tensor of `shape` (some possibly empty)."""
    if scheme == "dim0":
        return shard_boxes(shape, 0, n)
    if scheme == "dim1":
        return shard_boxes(shape, 1, n)
    if scheme == "blocks":  # an a x b grid over dims 0 and 1, a the largest divisor of n <= sqrt(n)
        a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        rows, cols = shard_boxes(shape, 0, a), shard_boxes(shape, 1, n // a)
        return [
            Box((r.offsets[0], c.offsets[1], *r.offsets[2:]), (r.lengths[0], c.lengths[1], *r.lengths[2:]))
            for r in rows
            for c in cols
        ]
    # ragged: dim 0 cut at random points (Megatron-like uneven splits), empty pieces allowed
    rng = random.Random(f"{shape}-{n}")
    cuts = sorted(rng.randint(0, shape[0]) for _ in range(n - 1))
    edges = [0, *cuts, shape[0]]
    return [Box((lo, *(0,) * (len(shape) - 1)), (hi - lo, *shape[1:])) for lo, hi in zip(edges, edges[1:])]


def cases() -> list[tuple[tuple[int, ...], str, str]]:
    return [
        (shape, saved, loaded)
        for shape in SHAPES
        for saved in SCHEMES
        for loaded in SCHEMES
        if len(shape) >= 2 or ("dim1" not in (saved, loaded) and "blocks" not in (saved, loaded))
    ]


@pytest.mark.parametrize("shape, saved, loaded", cases())
def test_n_to_m_restores_every_slice_exactly(shape: tuple[int, ...], saved: str, loaded: str) -> None:
    full = Box.full(shape)
    whole = np.arange(math.prod(shape), dtype="<i4").reshape(shape) * 7 + 3
    itemsize = whole.itemsize
    for n in range(1, 9):
        fragments = layout(shape, saved, n)
        assert coverage_problems(shape, [f for f in fragments if f.numel]) == []
        stored = [np.ascontiguousarray(whole[relative(f, full)]).tobytes() for f in fragments]
        for m in range(1, 9):
            for want in layout(shape, loaded, m):
                out = bytearray(want.numel * itemsize)
                dst = np.frombuffer(out, dtype=np.uint8)
                writes = np.zeros(len(out), dtype=np.int64)
                for fragment, data in zip(fragments, stored):
                    src = np.frombuffer(data, dtype=np.uint8)
                    runs = copy_runs(fragment, want, itemsize)
                    check_runs(runs, len(src), len(out))
                    assert run_count(fragment, want) == len(runs)
                    for r in runs:
                        dst[r.dst : r.dst + r.nbytes] = src[r.src : r.src + r.nbytes]
                        writes[r.dst : r.dst + r.nbytes] += 1
                    for max_gap, max_len in [(0, None), (4, 16), (64 * 1024, None)]:
                        check_ranges(runs, read_ranges(runs, max_gap, max_len), len(src))
                assert (writes == 1).all(), (n, m, want)
                restored = np.frombuffer(out, dtype="<i4").reshape(want.lengths)
                np.testing.assert_array_equal(restored, whole[relative(want, full)])


def check_runs(runs: list[CopyRun], src_len: int, dst_len: int) -> None:
    """Runs lie inside both buffers, go forward on both sides, and are merged where they can be."""
    for r in runs:
        assert r.nbytes > 0 and 0 <= r.src and r.src + r.nbytes <= src_len and 0 <= r.dst and r.dst + r.nbytes <= dst_len
    for a, b in zip(runs, runs[1:]):
        assert a.src + a.nbytes <= b.src and a.dst + a.nbytes <= b.dst
        assert not (a.src + a.nbytes == b.src and a.dst + a.nbytes == b.dst), f"{a} and {b} should be one run"


def check_ranges(runs: list[CopyRun], ranges: list[tuple[int, int]], src_len: int) -> None:
    """Ranges are sorted, disjoint, inside the fragment, and every run lies inside one of them."""
    for (lo, n), (lo2, _) in zip(ranges, ranges[1:]):
        assert lo + n <= lo2
    assert all(n > 0 and lo >= 0 and lo + n <= src_len for lo, n in ranges)
    for r in runs:
        assert any(lo <= r.src and r.src + r.nbytes <= lo + n for lo, n in ranges), r
