import pytest

from ckptd.common.boxes import Box, contiguous_runs, coverage_problems, intersect, relative


@pytest.mark.parametrize(
    "a, b, expected",
    [
        (Box((0,), (4,)), Box((2,), (4,)), Box((2,), (2,))),
        (Box((0,), (2,)), Box((2,), (2,)), None),
        (Box((0, 0), (2, 4)), Box((1, 2), (3, 3)), Box((1, 2), (1, 2))),
        (Box((), ()), Box((), ()), Box((), ())),
        (Box((0,), (0,)), Box((0,), (4,)), None),
    ],
)
def test_intersect(a: Box, b: Box, expected: Box | None) -> None:
    assert intersect(a, b) == expected
    assert intersect(b, a) == expected


def test_relative_selects_inner_box() -> None:
    assert relative(Box((3, 2), (1, 2)), Box((2, 0), (2, 4))) == (slice(1, 2), slice(2, 4))
    with pytest.raises(ValueError, match="does not lie within"):
        relative(Box((0,), (3,)), Box((1,), (3,)))


@pytest.mark.parametrize(
    "box, shape, runs",
    [
        (Box((1, 0), (2, 4)), (4, 4), [(4, 0, 8)]),  # whole rows: one run
        (Box((1, 1), (2, 2)), (4, 4), [(5, 0, 2), (9, 2, 2)]),
        (Box((0, 1, 0), (2, 1, 3)), (2, 2, 3), [(3, 0, 3), (9, 3, 3)]),
        (Box((), ()), (), [(0, 0, 1)]),
        (Box((0,), (0,)), (5,), []),
        (Box((2,), (3,)), (5,), [(2, 0, 3)]),
    ],
)
def test_contiguous_runs(box: Box, shape: tuple[int, ...], runs: list[tuple[int, int, int]]) -> None:
    assert contiguous_runs(box, shape) == runs


@pytest.mark.parametrize(
    "shape, boxes, problem",
    [
        ((4,), [Box((0,), (2,)), Box((2,), (2,))], None),
        ((4,), [Box((0,), (2,))], "cover 2 of 4"),
        ((4,), [Box((0,), (3,)), Box((2,), (2,))], "overlap"),
        ((4,), [Box((0,), (5,))], "outside"),
        ((2, 2), [Box((0, 0), (2, 1)), Box((0, 1), (2, 1))], None),
        ((), [Box((), ())], None),
    ],
)
def test_coverage_problems(shape: tuple[int, ...], boxes: list[Box], problem: str | None) -> None:
    problems = coverage_problems(shape, boxes)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems
