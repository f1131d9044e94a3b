"""ckptd.client.ties: which tensors of a state are one, for the client and `ckptd import`."""

from __future__ import annotations

from typing import Hashable

import pytest
import torch

from ckptd.client.ties import memory_key, shared_names


@pytest.mark.parametrize(
    "named, expected",
    [
        ([], {}),
        ([("a", 1), ("b", 2)], {"a": [], "b": []}),
        ([("a", 1), ("b", 1), ("c", 2), ("d", 1)], {"a": ["b", "d"], "c": []}),
        ([("a", None), ("b", None)], {"a": [], "b": []}),  # a None key is never shared
        ([("b", 7), ("a", 7)], {"b": ["a"]}),  # the first name in order, not in sort order
    ],
)
def test_shared_names_groups_equal_keys_under_the_first_name(named: list[tuple[str, Hashable]], expected: dict[str, list[str]]) -> None:
    assert shared_names(named, lambda key: key) == expected


def test_memory_key_is_equal_for_the_same_memory_only() -> None:
    base = torch.arange(12.0)
    assert memory_key(base) == memory_key(base.view(12)) == memory_key(torch.nn.Parameter(base))
    assert memory_key(base) != memory_key(base.clone())  # equal values, other memory
    assert memory_key(base[:6]) != memory_key(base[6:])  # other offset
    assert memory_key(base.view(3, 4)) != memory_key(base.view(4, 3))  # other shape
    assert memory_key(base.view(3, 4)) != memory_key(base.view(4, 3).t())  # other strides
    assert memory_key(base.view(torch.int32)) != memory_key(base)  # other dtype


@pytest.mark.parametrize(
    "tensor",
    [torch.empty(0), torch.zeros(3, 0), torch.eye(3).to_sparse()],
    ids=["empty", "empty-2d", "sparse"],
)
def test_memory_key_says_nothing_of_an_empty_or_non_strided_tensor(tensor: torch.Tensor) -> None:
    assert memory_key(tensor) is None
