"""Rollbacks: a job that saves a step numbered below steps it committed before (pure).

"Newest" is the most recently committed step, whatever its number (docs/architecture.md §9).
A save below the newest step is a rollback: the daemon logs it with the steps it passes over
(cluster.Coordinator), and `ckptd ls` marks each committed step that was one (tools/ops.py).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from typing import Sequence


def passed_over(order: Sequence[int], step: int) -> list[int]:
    """The committed steps numbered above `step`, ascending, when saving `step` now is a rollback
    (it is below the newest step of `order`, the job's committed steps in commit order); else []."""
    if not order or step >= order[-1]:
        return []
    return sorted(s for s in order if s > step)


def rollbacks(order: Sequence[int]) -> dict[int, list[int]]:
    """For each step of `order` (commit order) that was a rollback when it was committed (below
    the step committed just before it): the steps committed before it with higher numbers (those
    still on disk), ascending. The steps after a rollback that go on from it are not marked."""
    marked: dict[int, list[int]] = {}
    seen: list[int] = []  # the steps committed so far, ascending
    for i, step in enumerate(order):
        if i and step < order[i - 1]:
            marked[step] = seen[bisect_right(seen, step):]
        insort(seen, step)
    return marked
