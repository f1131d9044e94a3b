"""rank_and_world: one resolution of this process's rank and world size, for the client and the integrations."""

from __future__ import annotations

import pytest

from ckptd.client import rank_and_world


@pytest.mark.parametrize(
    "rank, world_size, env, expected",
    [
        (None, None, {}, (0, 1)),
        (None, None, {"RANK": "3", "WORLD_SIZE": "8"}, (3, 8)),
        (2, None, {"RANK": "3", "WORLD_SIZE": "8"}, (2, 8)),
        (None, 4, {"RANK": "3", "WORLD_SIZE": "8"}, (3, 4)),
        (1, 2, {"RANK": "3", "WORLD_SIZE": "8"}, (1, 2)),
        (5, 2, {}, (5, 2)),  # not checked against each other: the caller does
    ],
)
def test_given_else_the_environment_else_one_process(
    rank: int | None, world_size: int | None, env: dict[str, str], expected: tuple[int, int]
) -> None:
    assert rank_and_world(rank, world_size, env) == expected  # torch.distributed is not initialized in this process


@pytest.mark.parametrize("env", [{"RANK": "abc"}, {"WORLD_SIZE": "two"}, {"RANK": "1.5", "WORLD_SIZE": "4"}])
def test_an_environment_variable_that_is_not_an_integer_is_named(env: dict[str, str]) -> None:
    """Found by a probe: int()'s bare "invalid literal for int() with base 10: 'abc'"."""
    name = next(k for k, v in env.items() if not v.isdigit())
    with pytest.raises(ValueError, match=rf"\${name}='.*' is not an integer: set it to this process's .*, or unset it"):
        rank_and_world(None, None, env)
