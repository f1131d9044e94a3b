"""ckptd.common.names: the per-rank names of a rank's own extras tensors (issue 30 finding 3); json_depth; decimal."""

from __future__ import annotations

import pytest

from ckptd.common.names import MAX_STEP, check_step, decimal, json_depth, per_rank_name, shared_name


@pytest.mark.parametrize(
    ("name", "rank", "own"),
    [
        ("extra/t", 1, "extra/rank1/t"),
        ("sampler/state/pos/0", 12, "sampler/rank12/state/pos/0"),
        ("t", 0, "t/rank0"),  # a tensor at the top of the state
        ("extra/rank1/t", 1, "extra/rank1/rank1/t"),  # a user's own "rank1" key stays a path part
    ],
)
def test_issue30_finding3_per_rank_names_round_trip(name: str, rank: int, own: str) -> None:
    assert per_rank_name(name, rank) == own
    assert shared_name(own, rank) == name


@pytest.mark.parametrize(("name", "rank"), [("extra/rank1/t", 0), ("extra/t", 1), ("extra/rank10/t", 1), ("t", 0), ("extra/rank1x", 1)])
def test_issue30_finding3_a_name_without_the_rank_after_its_key_is_no_per_rank_name(name: str, rank: int) -> None:
    assert shared_name(name, rank) is None


@pytest.mark.parametrize(
    ("value", "depth"),
    [
        (1, 0), ("x", 0), (None, 0), ([], 1), ({}, 1), ([[1]], 2), ({"a": [1, {"b": []}]}, 4),
        ([1, [2, [3]], {}], 3), ({"a": {"b": {}}, "c": []}, 3), ([{"__tensor__": "m/w"}] * 4, 2),
    ],
)
def test_json_depth_counts_the_deepest_nesting(value: object, depth: int) -> None:
    assert json_depth(value) == depth


def test_json_depth_of_a_value_deeper_than_python_recurses() -> None:
    deep: list[object] = []
    inner = deep
    for _ in range(50_000):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    assert json_depth({"k": deep}) == 50_002


@pytest.mark.parametrize("step", [-1, True, False, 1.0, 1.5, "3", None, MAX_STEP + 1, 2**64])
def test_a_step_that_is_no_step_number_is_refused_saying_what_one_is(step: object) -> None:
    with pytest.raises(ValueError, match=r"step must be an integer from 0 to 2\*\*63 - 1"):
        check_step(step)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [0, 1, 10**8, MAX_STEP])
def test_every_int64_step_from_zero_is_one(step: int) -> None:
    assert check_step(step) == step


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("0", 0), ("00000042", 42), ("9223372036854775807", MAX_STEP),
        ("", None), ("-1", None), ("+1", None), (" 1", None), ("1 ", None), ("1_000", None), ("0x10", None),
        ("²", None), ("²²²²²²²²", None), ("١٢", None), ("１２", None),  # other scripts' digits: str.isdigit() takes them, int() not all
        ("1" * 20, None),  # more digits than an int64 has
    ],
)
def test_decimal_takes_ascii_digits_alone(text: str, number: int | None) -> None:
    """Found by an attacker's probe: a directory named step-²²²²²²²² under the root stopped the
    daemon from starting (str.isdigit() said yes, int() raised)."""
    assert decimal(text) == number
