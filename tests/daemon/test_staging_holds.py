"""engine/staging_holds.py: how long a step's staging files stay for loads that have not come."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine

import pytest

from ckptd.daemon.engine import staging_holds
from ckptd.daemon.engine.staging_holds import StagingHolds

KEY = ("job", 7)


class Recorder:
    """A StagingHolds whose timers are kept (to run at will) and whose releases are recorded."""

    def __init__(self) -> None:
        self.timers: list[Coroutine[Any, Any, None]] = []
        self.released: list[tuple[str, int]] = []
        self.holds = StagingHolds(self.timers.append, lambda job, step: self.released.append((job, step)))

    def run_timers(self) -> None:
        timers, self.timers = self.timers, []
        for timer in timers:
            asyncio.run(timer)


def test_the_files_stay_until_every_rank_of_the_node_has_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_holds, "SIBLINGS_WAIT_S", 0.001)  # the timers below end at once
    r = Recorder()
    r.holds.load_done(KEY, rank=0, local_ranks=3)
    assert KEY in r.holds  # ranks 1 and 2 have not loaded: kept for them
    r.holds.load_done(KEY, rank=0, local_ranks=3)  # the same rank again counts once
    assert KEY in r.holds
    r.holds.load_done(KEY, rank=1, local_ranks=3)
    assert KEY in r.holds
    r.holds.load_done(KEY, rank=2, local_ranks=3)
    assert KEY not in r.holds  # all three loaded: nothing keeps them
    r.run_timers()
    assert r.released == []  # the ended hold's timer does not release twice


def test_a_rank_that_never_comes_is_waited_for_siblings_wait_s_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_holds, "SIBLINGS_WAIT_S", 0.0)
    r = Recorder()
    r.holds.load_done(KEY, rank=0, local_ranks=2)
    assert KEY in r.holds
    r.run_timers()
    assert KEY not in r.holds and r.released == [KEY]


def test_a_single_rank_keeps_nothing() -> None:
    r = Recorder()
    r.holds.load_done(KEY, rank=0, local_ranks=1)
    assert KEY not in r.holds and r.timers == []


def test_a_prefetch_is_held_while_staging_and_for_its_ranks_after(monkeypatch: pytest.MonkeyPatch) -> None:
    r = Recorder()
    r.holds.prefetching(KEY)
    r.holds.load_done(KEY, rank=0, local_ranks=1)  # a load done while the prefetch stages: it is not ended
    assert KEY in r.holds
    r.holds.forget(KEY)
    r.holds.prefetched(KEY)
    timers = len(r.timers)
    r.holds.load_done(KEY, rank=0, local_ranks=2)
    assert KEY in r.holds and len(r.timers) == timers  # rank 1 has not come: the prefetch's longer hold stays, not cut to 60 s
    r.holds.load_done(KEY, rank=1, local_ranks=2)
    assert KEY not in r.holds
    monkeypatch.setattr(staging_holds, "PREFETCH_HOLD_S", 0.0)
    r.holds.forget(KEY)
    r.holds.prefetched(KEY)
    for stale in r.timers[:-1]:  # the ended holds' (600 s); the newest one ends this hold
        stale.close()
    r.timers = r.timers[-1:]
    r.run_timers()
    assert KEY not in r.holds and r.released == [KEY]


def test_a_failed_prefetch_keeps_nothing() -> None:
    r = Recorder()
    r.holds.prefetching(KEY)
    r.holds.drop(KEY)
    assert KEY not in r.holds


def test_memory_short_ends_every_hold_but_a_prefetch_still_staging() -> None:
    r = Recorder()
    r.holds.load_done(KEY, rank=0, local_ranks=2)
    r.holds.prefetching(("job", 8))
    assert r.holds.end_waiting() == [KEY]
    assert KEY not in r.holds and ("job", 8) in r.holds
    for timer in r.timers:
        timer.close()
