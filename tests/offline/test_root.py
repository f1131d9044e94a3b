"""ckptd.offline.root: a storage root's committed steps, read-only; links and FIFOs are never followed or waited on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptd.format.index import INDEX_NAME, CheckpointIndex, FormatError
from ckptd.offline.root import StepRoot


def _commit(root: Path, job: str, step: int, created_at: float, indented: bool = False) -> Path:
    step_dir = root / job / f"step-{step:08d}"
    step_dir.mkdir(parents=True)
    data = CheckpointIndex(job, step, created_at, 1, (), ()).to_json_bytes()
    if indented:  # as an older daemon wrote it: created_at is not in the head's form
        data = json.dumps(json.loads(data), indent=2).encode()
    (step_dir / INDEX_NAME).write_bytes(data)
    return step_dir


@pytest.mark.parametrize(
    ("commits", "order"),
    [
        ([(1, 10.0), (2, 20.0), (3, 30.0)], [1, 2, 3]),
        ([(1, 10.0), (5, 20.0), (3, 30.0)], [1, 5, 3]),  # a rollback commits a lower step last
        ([(2, 10.0), (1, 10.0)], [1, 2]),  # ties by step number
        ([], []),
    ],
)
def test_steps_are_in_commit_order(tmp_path: Path, commits: list[tuple[int, float]], order: list[int]) -> None:
    (tmp_path / "j").mkdir()
    for step, created in commits:
        _commit(tmp_path, "j", step, created)
    assert StepRoot(tmp_path).commit_order("j") == order


def test_an_indented_index_orders_by_its_whole_file(tmp_path: Path) -> None:
    _commit(tmp_path, "j", 1, 50.0, indented=True)
    _commit(tmp_path, "j", 2, 10.0)
    assert StepRoot(tmp_path).commit_order("j") == [2, 1]


@pytest.mark.parametrize("planted", ["link step", "link index", "no index", "link job", "not a step name"])
def test_what_is_not_a_committed_step(tmp_path: Path, planted: str) -> None:
    elsewhere = _commit(tmp_path / "other", "j", 1, 1.0)
    root = tmp_path / "root"
    (root / "j").mkdir(parents=True)
    if planted == "link step":
        (root / "j" / "step-00000001").symlink_to(elsewhere)
    elif planted == "link index":
        (root / "j" / "step-00000001").mkdir()
        (root / "j" / "step-00000001" / INDEX_NAME).symlink_to(elsewhere / INDEX_NAME)
    elif planted == "no index":
        (root / "j" / "step-00000001").mkdir()
    elif planted == "link job":
        (root / "j").rmdir()
        (root / "j").symlink_to(elsewhere.parent)
    else:
        os.rename(elsewhere, root / "j" / "step-1")
    steps = StepRoot(root)
    assert steps.commit_order("j") == [] and not steps.is_committed("j", 1)


def test_the_index_and_small_files_are_read_checked(tmp_path: Path) -> None:
    step_dir = _commit(tmp_path, "j", 7, 1.0)
    (step_dir / "extra.json").write_bytes(b"{}")
    os.mkfifo(step_dir / "fifo.json")
    (step_dir / "link.json").symlink_to(step_dir / "extra.json")
    steps = StepRoot(tmp_path)
    assert steps.read_index("j", 7).step == 7
    assert steps.read_small("j", 7, "extra.json") == b"{}"
    with pytest.raises(OSError, match="larger than the 1 bytes"):
        steps.read_small("j", 7, "extra.json", limit=1)
    with pytest.raises(OSError, match="not a regular file"):
        steps.read_small("j", 7, "fifo.json")  # never waits for a writer
    with pytest.raises(OSError, match="symbolic link"):
        steps.read_small("j", 7, "link.json")
    with pytest.raises(ValueError):
        steps.file_path("j", 7, "../x")
    (step_dir / INDEX_NAME).write_bytes(b"{")
    with pytest.raises(FormatError):
        steps.read_index("j", 7)
