"""Extras trees: exact round trips through strict JSON, tensor naming, and refusals."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from ckptd.client import tree


def round_trip(value: Any, prefix: str = "extra") -> tuple[Any, dict[str, torch.Tensor]]:
    """Encode, pass through strict JSON text, decode; return the value and the tensors by name."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = tree.encode(value, prefix, tensors.__setitem__)
    text = json.dumps(encoded, allow_nan=False)
    return tree.decode(json.loads(text), tensors.__getitem__), tensors


def assert_same(a: Any, b: Any) -> None:
    """Equal values of exactly the same types, all the way down (NaN equals NaN)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_same(ka, kb)
            assert_same(va, vb)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    elif isinstance(a, float):
        assert a == b and math.copysign(1, a) == math.copysign(1, b)
    elif isinstance(a, torch.Tensor):
        assert a is b
    else:
        assert a == b


ROUND_TRIPS = [
    None,
    True,
    False,
    0,
    -7,
    2**100,
    1.5,
    -0.0,
    1e-310,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "héllo",
    b"",
    b"\x00\xff\x10",
    [],
    (),
    {},
    [1, [2, [3, []]]],
    (1, (2.5, "x"), [None]),
    {"a": {"b": {"c": [1, 2, (3,)]}}},
    {1: "int key", 2: "other"},
    {(1, "a"): 3, None: 4, 2.5: 5, b"k": 6, False: 7},
    {"x": {0: [math.nan, -math.inf]}},
    # user dicts that look like tags must not be taken for tags
    {"__tensor__": "model/w"},
    {"__tuple__": [1, 2]},
    {"__float__": "nan"},
    {"__dict__": [[1, 2]]},
    {"__tensor__": "x", "other": 1},
    [{"__bytes__": "AA=="}],
    {"__ndarray__": {"dtype": "<f4", "shape": [], "data": ""}},
    np.arange(6, dtype=np.uint32).reshape(2, 3),
    np.array([math.nan, -0.0, math.inf], dtype=np.float64),
    np.zeros((0, 3), dtype=np.int16),
    np.array([1 + 2j], dtype=np.complex64),
    np.array([[True, False]]),
    np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # not contiguous
    np.float32(1.25),
    np.int64(-3),
    np.bool_(True),
    ("MT19937", np.arange(4, dtype=np.uint32), 2, 0, 0.0),  # the shape of np.random.get_state()
]


@pytest.mark.parametrize("value", ROUND_TRIPS, ids=repr)
def test_round_trip_is_exact(value: Any) -> None:
    back, tensors = round_trip(value)
    assert_same(value if not isinstance(value, np.ndarray) else np.ascontiguousarray(value), back)
    assert tensors == {}


def test_subclasses_come_back_as_their_base_type() -> None:
    back, _ = round_trip({"o": OrderedDict(b=1, a=2), "size": torch.Size([2, 3])})
    assert_same(back, {"o": {"b": 1, "a": 2}, "size": (2, 3)})


def test_the_same_list_twice_is_not_a_cycle() -> None:
    shared = [1, 2]
    back, _ = round_trip({"a": shared, "b": shared})
    assert back == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("T", ["extra"]),
        ({"a": "T"}, ["extra/a"]),
        ({"a": ["T", {"b": "T"}]}, ["extra/a/0", "extra/a/1/b"]),
        ({3: "T", (1, 2): "T"}, ["extra/3", "extra/(1, 2)"]),
        (("T", "T"), ["extra/0", "extra/1"]),
        ({"__tensor__": "T"}, ["extra/__tensor__"]),
    ],
)
def test_tensors_are_named_by_their_path(value: Any, names: list[str]) -> None:
    made: list[torch.Tensor] = []

    def with_tensors(v: Any) -> Any:
        if v == "T":
            made.append(torch.arange(3) + len(made))
            return made[-1]
        if isinstance(v, dict):
            return {k: with_tensors(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(with_tensors(x) for x in v)
        return v

    value = with_tensors(value)
    back, tensors = round_trip(value)
    assert list(tensors) == names
    assert [t for t in tensors.values()] == made  # in order, the very tensors given
    assert_same(value, back)  # and decode puts the tensors the callback returns back in place


def test_decode_uses_the_tensors_it_is_given() -> None:
    encoded = tree.encode({"w": torch.zeros(2)}, "extra", lambda name, t: None)
    replacement = torch.ones(2)
    assert tree.decode(encoded, {"extra/w": replacement}.__getitem__)["w"] is replacement


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"a": Opaque()}, r"'extra/a'.*test_tree\.Opaque"),
        ({"a": [1, {2, 3}]}, r"'extra/a/1'.*set"),
        ({"f": lambda x: x}, r"'extra/f'.*function"),
        ({"dev": torch.device("cpu")}, r"'extra/dev'.*torch\.device"),
        ({"dtype": torch.float32}, r"'extra/dtype'.*torch\.dtype"),
        ({"k": {torch.zeros(1): 1}}, r"'extra/k/tensor\(\[0\.\]\)'.*a dict key of type torch\.Tensor"),
        ({"arr": np.array(["a", None], dtype=object)}, r"'extra/arr'.*NumPy dtype object"),
        ({"when": np.datetime64("2024-01-01")}, r"'extra/when'.*NumPy dtype datetime64"),
    ],
)
def test_unsupported_values_are_refused_with_their_path_and_a_fix(value: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match) as info:
        tree.encode(value, "extra", lambda name, t: None)
    if "NumPy" not in match:
        assert "state_dict()/load_state_dict()" in str(info.value)


def test_a_container_that_contains_itself_is_refused() -> None:
    loop: list[Any] = [1]
    loop.append({"again": loop})
    with pytest.raises(TypeError, match=r"'extra/1/again'.*contains itself"):
        tree.encode(loop, "extra", lambda name, t: None)


@pytest.mark.parametrize(
    "bad",
    [
        {"__float__": "nope"},
        {"__tuple__": "not a list"},
        {"__bytes__": "###"},
        {"__dict__": [[1]]},
        {"__ndarray__": {"dtype": "|O", "shape": [1], "data": ""}},
        {"__ndarray__": {"dtype": "<f4", "shape": [2], "data": "AAAA"}},
        {"__tensor__": 5},
    ],
    ids=repr,
)
def test_malformed_trees_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError):
        tree.decode(bad, lambda name: torch.zeros(1))
