"""CheckpointClient's arguments are checked when it is made, with a message saying what to pass."""

from __future__ import annotations

import pytest

from ckptd.client import CheckpointClient
from ckptd.client.layout import LayoutRules


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "fast"}, "mode='fast': use one of"),
        ({"on_error": "ignore"}, "on_error='ignore': use 'warn' or 'raise'"),
        ({"rank": 2, "world_size": 2}, r"rank 2 is not in \[0, world_size=2\)"),
        ({"local_world_size": 3, "rank": 0, "world_size": 2}, "local_world_size=3 must be between 1 and world_size=2"),
        ({"read_files": "yes"}, "read_files='yes': use None"),
        ({"layout": LayoutRules([])}, r"layout rules need coords=RankCoords"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_pass(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointClient("job", address="unix:///nonexistent.sock", **{"rank": 0, "world_size": 1, **kwargs})


def test_a_bad_job_id_is_refused() -> None:
    with pytest.raises(ValueError, match="job"):
        CheckpointClient("bad/job", address="unix:///nonexistent.sock", rank=0, world_size=1)
