"""The algorithms behind coverage_problems (issue 30 finding 10), against brute force."""

import itertools
import random

from ckptd.common.tiling import Span, overlapping_pairs, tiling_residual


def _overlap(x: Span, y: Span) -> bool:
    return all(max(a, b) < min(c, d) for a, c, b, d in zip(x[0], x[1], y[0], y[1]))


def _random_spans(rng: random.Random, shape: tuple[int, ...], n: int) -> list[Span]:
    spans = []
    for _ in range(n):
        offsets = tuple(rng.randrange(s) for s in shape)
        ends = tuple(rng.randint(o + 1, min(s, o + 1 + s // 2)) for o, s in zip(offsets, shape))
        spans.append((offsets, ends))
    return spans


# issue 30 finding 10
def test_overlapping_pairs_are_those_of_brute_force() -> None:
    rng = random.Random(30)
    for _ in range(400):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 9) for _ in range(ndim))
        spans = _random_spans(rng, shape, rng.randint(0, 30))
        expected = [(i, j) for i, j in itertools.combinations(range(len(spans)), 2) if _overlap(spans[i], spans[j])]
        keep = rng.randint(0, 12)
        assert overlapping_pairs(spans, keep) == (expected[:keep], len(expected), True)


# issue 30 finding 10
def test_overlapping_pairs_stop_at_their_bound() -> None:
    spans = [((i,), (i + 10,)) for i in range(10)]  # 45 overlapping pairs
    pairs, count, finished = overlapping_pairs(spans, 3, max_compared=5)
    assert (len(pairs), count, finished) == (3, 5, False)
    assert all(_overlap(spans[i], spans[j]) for i, j in pairs)


# issue 30 finding 10
def test_tiling_residual_finds_an_element_covered_other_than_once() -> None:
    rng = random.Random(10)
    for _ in range(400):
        ndim = rng.randint(0, 3)
        shape = tuple(rng.randint(1, 4) for _ in range(ndim))
        spans = _random_spans(rng, shape, rng.randint(0, 5))
        counts = {p: sum(all(o <= x < e for x, o, e in zip(p, *s)) for s in spans) for p in itertools.product(*map(range, shape))}
        residual = tiling_residual(shape, spans)
        assert residual is not None
        if all(c == 1 for c in counts.values()):
            assert residual == {}
        else:
            point = min(residual)
            assert counts[point] != 1 and counts[point] == 1 + residual[point]


# issue 30 finding 10
def test_tiling_residual_stops_at_its_bound() -> None:
    spans = [((0, 0), (1, 1))]  # cut in both dimensions: 4 corner terms
    assert tiling_residual((2, 2), spans, max_corners=3) is None
    assert tiling_residual((2, 2), spans, max_corners=4) == {(1, 0): -1, (0, 1): -1, (1, 1): 1}
