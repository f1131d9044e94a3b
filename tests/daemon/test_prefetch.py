"""A replaced node's parts staged before its ranks ask (engine/prefetch.py): each part node 0
names is prefetched, one that cannot be is logged and skipped, and a node 0 that does not
answer stages nothing. The staging itself runs through Loads.prefetch (tested with real daemons
in tests/integration/test_replicas.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import pytest

from ckptd.daemon.engine.prefetch import prefetch_parts
from ckptd.daemon.errors import NotFound, Unavailable


def run(answer: Sequence[tuple[str, int, tuple[int, ...]]] | str, staged: dict[tuple[str, int], int | Exception]) -> tuple[int, list[tuple[str, int]]]:
    asked: list[tuple[str, int]] = []

    async def held_parts() -> Sequence[tuple[str, int, tuple[int, ...]]] | str:
        return answer

    async def prefetch(job: str, step: int) -> int:
        asked.append((job, step))
        outcome = staged[(job, step)]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return asyncio.run(prefetch_parts(held_parts, prefetch)), asked


def test_every_part_node_0_names_is_staged_and_one_that_fails_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    parts = [("a", 3, (2,)), ("b", 7, (2, 3)), ("c", 1, (0,)), ("d", 9, (2,))]
    staged: dict[tuple[str, int], int | Exception] = {
        ("a", 3): 100, ("b", 7): Unavailable("node 2 does not answer"), ("c", 1): 0, ("d", 9): NotFound("step 9 is gone"),
    }
    with caplog.at_level(logging.INFO, logger="ckptd.daemon.engine.prefetch"):
        total, asked = run(parts, staged)
    assert total == 100 and asked == [("a", 3), ("b", 7), ("c", 1), ("d", 9)]
    text = caplog.text
    assert "step 3 of job a: staged this node's part (100 B, held by nodes [2])" in text
    assert "step 7 of job b: this node's part was not staged ahead of its ranks' load (node 2 does not answer); the load stages it" in text
    assert "job c" not in text  # its root had the part: nothing to say
    assert "step 9 is gone" in text
    assert "other nodes hold this node's part of 4 job(s)' newest step; 100 B of it staged ahead of the ranks" in text


def test_nothing_is_staged_when_node_0_does_not_answer(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ckptd.daemon.engine.prefetch"):
        total, asked = run("UNAVAILABLE", {})
    assert (total, asked) == (0, [])
    assert "could not ask node 0 where this node's parts are held (UNAVAILABLE)" in caplog.text
