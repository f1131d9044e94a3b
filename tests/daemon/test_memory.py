"""Shared memory for snapshots (engine/memory.py), in process: a job keeps one arena set between
saves, one budget over all jobs, idle memory given back under pressure, after an idle time and
by gc (never a snapshot in flight or being read), and the reports of who holds what.

Issue 30 finding 5 (a): every test here; (b): the one-set-per-job default and hold_while_saving.
Ranks are coroutines that copy their bytes into the arenas, as in test_engine.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import time
from pathlib import Path
from typing import Any, Callable, Coroutine

import pytest


from ckptd.common.boxes import Box
from ckptd.daemon.handoff.arena import Arena, SetState
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.engine.requests import BeginSave, CommitSnapshot, PlanLoad
from ckptd.daemon.engine.sessions import SaveState
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.daemon.records import ArenaHolder
from ckptd.daemon.engine.sessions import SaveSession
from ckptd.daemon.errors import Exhausted
from ckptd.daemon.engine import memory as memory_module
from ckptd.daemon.service import CheckpointService
from ckptd.daemon.handoff.shm_dir import ShmBudget

MiB = 1 << 20
SLOW = 1 << 20  # --write-throttle: a 1 MiB snapshot takes about 1 s to write


def _spec(nbytes: int) -> TensorSpec:
    return TensorSpec("model/w", "model", "F32", (nbytes // 4,), Box.full((nbytes // 4,)))


def _service(tmp_path: Path, **settings: Any) -> CheckpointService:
    (tmp_path / "shm").mkdir(parents=True, exist_ok=True)
    base = dict(root=tmp_path / "root", socket=tmp_path / "s.sock", shm_dir=tmp_path / "shm", keep_last=2, save_timeout_s=30, disk_reserve=0)
    service = CheckpointService(DaemonConfig(**{**base, **settings}))
    service.start()
    return service


async def _save(service: CheckpointService, job: str, step: int, nbytes: int = MiB, timeout_s: float = 30.0) -> SaveSession:
    """One rank saves `nbytes` of value `step` (mod 256) and hands them over."""
    session = await service.begin_save(BeginSave(job, 0, 1, step, f"fp-{nbytes}", [_spec(nbytes)], None, timeout_s))
    if session.state is SaveState.SKIPPED:
        return session
    assert session.arenas is not None and session.plan is not None
    slot = session.plan.slots[0]
    arena = session.arenas.arenas[0]
    assert arena is not None
    arena.view(slot.offset, slot.nbytes)[:] = bytes([step % 256]) * slot.nbytes
    await service.commit_snapshot(CommitSnapshot(job, 0, session.save_id, json.dumps({"step": step})))
    return session


async def _durable(service: CheckpointService, job: str, step: int) -> SaveState:
    last: Any = None
    async for item in service.progress(job, step, 30.0):
        last = item
    return SaveState.COMMITTED if last == "committed" else last.state


async def _saved(service: CheckpointService, job: str, step: int, nbytes: int = MiB) -> None:
    await _save(service, job, step, nbytes)
    assert await _durable(service, job, step) is SaveState.COMMITTED


async def _load(service: CheckpointService, job: str, step: int, nbytes: int = MiB, done: bool = True) -> tuple[str, str]:
    """Load the step, check every byte; returns (its tier, the load id)."""
    plan = await service.plan_load(PlanLoad(job, 0, 1, step, [_spec(nbytes)], ["model"], True))
    got = bytearray()
    for piece in plan.pieces:
        fd = os.open(piece.path, os.O_RDONLY)
        try:
            got += os.pread(fd, piece.nbytes, piece.offset)
        finally:
            os.close(fd)
    assert bytes(got) == bytes([step % 256]) * nbytes
    if done:
        service.load_done(plan.load_id)
    return plan.tier, plan.load_id


def _run(service: CheckpointService, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a test's coroutine, then close the service whatever happened."""
    try:
        asyncio.run(run())
    finally:
        service.close()


def _arena_files(service: CheckpointService) -> list[str]:
    return sorted(p.name for p in service.config.shm_dir.iterdir() if "-fetch-" not in p.name)


def _released(service: CheckpointService, reason: str) -> float | None:
    return service.metrics.registry.get_sample_value("ckptd_arena_released_bytes_total", {"reason": reason})


def _writing(service: CheckpointService, job: str, step: int) -> bool:
    session = service.jobs[job].sessions.get(step)
    return session is not None and session.state is SaveState.WRITING


# ------------------------------------------------------------------ one arena set per job


# issue 30 finding 5 (b): by default a job holds its state's size once, and the next save reuses it
def test_a_job_keeps_one_arena_set_and_each_save_reuses_it(tmp_path: Path) -> None:
    service = _service(tmp_path)

    async def run() -> None:
        await _saved(service, "a", 1)
        pool = service.jobs["a"].pool
        first = pool.sets[0].arenas[0]
        for step in (2, 3):
            await _saved(service, "a", step)
        await asyncio.sleep(0.1)  # a spare set would be given back in the background
        assert [(s.state, s.step) for s in pool.sets] == [(SetState.HELD, 3)]
        assert pool.sets[0].arenas[0] is first and pool.nbytes == MiB  # the same pages, reused
        assert len(_arena_files(service)) == 1
        assert (await _load(service, "a", 3))[0] == "memory"  # the restore from memory is kept

    _run(service, run)


# issue 30 finding 5 (b): a second set only while saves overlap, given back once idle
def test_a_save_while_the_previous_one_is_written_takes_a_second_set_given_back_once_idle(tmp_path: Path) -> None:
    service = _service(tmp_path, write_throttle=SLOW)

    async def run() -> None:
        await _saved(service, "a", 1)
        await _save(service, "a", 2)  # reuses step 1's arenas: step 1 is on disk only now
        assert _writing(service, "a", 2)
        assert (await _load(service, "a", 1))[0] == "disk"
        await _save(service, "a", 3)  # step 2 still being written: a second set
        pool = service.jobs["a"].pool
        assert len(pool.sets) == 2 and pool.nbytes == 2 * MiB
        assert await _durable(service, "a", 2) is SaveState.COMMITTED and await _durable(service, "a", 3) is SaveState.COMMITTED
        await asyncio.sleep(0.2)
        assert [(s.state, s.step) for s in pool.sets] == [(SetState.HELD, 3)] and len(_arena_files(service)) == 1
        assert _released(service, "spare") == MiB
        assert (await _load(service, "a", 3))[0] == "memory"

    _run(service, run)


# issue 30 finding 5 (b): hold_while_saving keeps the restore from memory during the next save
def test_hold_while_saving_keeps_the_held_snapshot_while_the_next_save_is_written(tmp_path: Path) -> None:
    service = _service(tmp_path, write_throttle=SLOW, hold_while_saving=True)

    async def run() -> None:
        await _saved(service, "a", 1)
        await _save(service, "a", 2)
        assert _writing(service, "a", 2)
        assert (await _load(service, "a", 1))[0] == "memory"
        assert await _durable(service, "a", 2) is SaveState.COMMITTED
        assert service.jobs["a"].pool.nbytes == 2 * MiB  # the price: twice the state

    _run(service, run)


# ------------------------------------------------------------------ one budget, given back under pressure


# issue 30 finding 5 (a): another job's idle snapshot goes back, the longest idle first
def test_a_save_over_the_budget_takes_other_jobs_idle_snapshots_longest_idle_first(tmp_path: Path) -> None:
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=2 * MiB + MiB // 2))

    async def run() -> None:
        await _saved(service, "a", 1)
        await _saved(service, "b", 1)
        await _saved(service, "c", 1)  # over the budget: a's snapshot, idle longest, goes back
        assert [len(service.jobs[j].pool.sets) for j in "abc"] == [0, 1, 1]
        assert service.engine.memory.in_use() <= 2 * MiB + MiB // 2
        assert (await _load(service, "a", 1))[0] == "disk"  # its step restores from disk, intact
        await _load(service, "c", 1)  # c used now: b is the longest idle
        await _saved(service, "a", 2)
        assert [len(service.jobs[j].pool.sets) for j in "abc"] == [1, 0, 1]
        assert _released(service, "pressure") == 2 * MiB

    _run(service, run)


# issue 30 finding 5 (a): never a snapshot in flight (the only copy of a step not yet durable) or being read
def test_pressure_never_takes_a_snapshot_being_written_or_read(tmp_path: Path) -> None:
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=MiB + MiB // 2), write_throttle=SLOW, arena_policy="skip")

    async def run() -> None:
        await _saved(service, "a", 1)
        await _save(service, "a", 2)  # in step 1's arenas, being written: the only copy of step 2
        assert _writing(service, "a", 2)
        skipped = await _save(service, "b", 1)
        assert skipped.state is SaveState.SKIPPED and "job 'a' 1 MiB: step 2 (being written)" in (skipped.skip_reason or "")
        assert "Raise --shm-budget" in (skipped.skip_reason or "")
        assert await _durable(service, "a", 2) is SaveState.COMMITTED
        tier, load_id = await _load(service, "a", 2, done=False)  # a load reads the held snapshot
        assert tier == "memory"
        skipped = await _save(service, "b", 2)
        assert skipped.state is SaveState.SKIPPED and "step 2 (held, read by 1 load(s))" in (skipped.skip_reason or "")
        service.load_done(load_id)
        await _saved(service, "b", 3)  # now idle: given back to b
        assert not service.jobs["a"].pool.sets and (await _load(service, "a", 2))[0] == "disk"

    _run(service, run)


# issue 30 finding 5 (a): a save waiting for memory gets it once another job's snapshot is durable
def test_a_save_waits_for_another_jobs_snapshot_to_be_durable_then_takes_its_memory(tmp_path: Path) -> None:
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=MiB + MiB // 2), write_throttle=SLOW)

    async def run() -> None:
        await _save(service, "a", 1)
        assert _writing(service, "a", 1)
        await _saved(service, "b", 1)  # waited for a's commit, then took a's arenas
        assert service.jobs["a"].recent[1].state is SaveState.COMMITTED
        assert not service.jobs["a"].pool.sets and (await _load(service, "a", 1))[0] == "disk"

    _run(service, run)


def test_a_job_saving_back_to_back_does_not_starve_another_jobs_save(tmp_path: Path) -> None:
    """Found by an attacker's probe: job a saving back to back reused each of its sets the moment
    it went idle, so job b's saves never found idle memory to take and all timed out (most
    reported as ranks that "did not hand their snapshot over"). Saves waiting for room are served
    oldest first across jobs: b gets a's idle set, and a goes on saving."""
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=2 * MiB + MiB // 2), write_throttle=4 * MiB)

    async def run() -> None:
        stop = asyncio.Event()
        handed: list[int] = []

        async def saving_a() -> None:
            step = 0
            while not stop.is_set():
                step += 1
                session = await _save(service, "a", step, timeout_s=20)
                assert session.state is not SaveState.FAILED, session.error
                handed.append(step)

        a = asyncio.create_task(saving_a())
        await asyncio.sleep(1.0)  # a holds two sets, both busy most of the time
        before = len(handed)
        session = await _save(service, "b", 1, timeout_s=8)
        assert await _durable(service, "b", 1) is SaveState.COMMITTED, session.error
        await asyncio.sleep(0.5)
        stop.set()
        await a
        assert len(handed) > before, "a stopped saving"
        assert (await _load(service, "b", 1, done=True))[0] in ("memory", "disk")

    _run(service, run)


def test_a_save_that_times_out_waiting_for_memory_says_so(tmp_path: Path) -> None:
    """A save that never got memory fails naming the shortage, not its ranks (whichever ends it
    first: its own wait's deadline or the session's watchdog, SaveSession.memory_short)."""
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=MiB + MiB // 2), write_throttle=MiB // 4)

    async def run() -> None:
        await _save(service, "a", 1)  # written for about 4 s: its memory is not idle meanwhile
        task = asyncio.create_task(_save(service, "b", 1, timeout_s=1))
        await asyncio.sleep(2.0)
        session = service.jobs["b"].recent[1]
        assert session.state is SaveState.FAILED
        assert "shared memory" in session.error and "did not hand" not in session.error, session.error
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    _run(service, run)


# ------------------------------------------------------------------ idle time and gc


# issue 30 finding 5 (a): a job idle for idle_release_s gives its memory back; one saving does not
def test_a_job_idle_for_idle_release_s_gives_its_arenas_back(tmp_path: Path) -> None:
    service = _service(tmp_path, idle_release_s=60.0, write_throttle=SLOW)

    async def run() -> None:
        await _saved(service, "a", 1)
        await _saved(service, "b", 1)
        memory = service.engine.memory
        assert await memory.release_idle(now=time.monotonic() + 30) == 0  # not idle long enough
        await _save(service, "b", 2)  # b is saving
        assert await memory.release_idle(now=time.monotonic() + 61) == MiB  # a only
        assert not service.jobs["a"].pool.sets and len(service.jobs["b"].pool.sets) == 1
        assert len(_arena_files(service)) == 1
        assert (await _load(service, "a", 1))[0] == "disk"
        assert _released(service, "idle") == MiB

    _run(service, run)
    never = _service(tmp_path / "never", idle_release_s=0)
    try:
        asyncio.run(_saved(never, "a", 1))
        assert asyncio.run(never.engine.memory.release_idle(now=time.monotonic() + 10**6)) == 0
    finally:
        never.close()


# issue 30 finding 5 (a): ckptd gc gives back idle arenas (a dry run only lists them), never one in flight
def test_gc_gives_back_idle_arenas_but_not_a_snapshot_being_written(tmp_path: Path) -> None:
    service = _service(tmp_path, write_throttle=SLOW)

    async def run() -> None:
        await _saved(service, "a", 1)
        await _saved(service, "b", 1)
        await _save(service, "b", 2)  # b's only set is being written
        listed = [c for c in await service.collect(None, dry_run=True) if c.reason == "memory"]
        assert [(c.job, c.step, c.bytes) for c in listed] == [("a", 1, MiB)] and len(service.jobs["a"].pool.sets) == 1
        assert Path(listed[0].path).exists()
        removed = [c for c in await service.collect("a", dry_run=False) if c.reason == "memory"]
        assert [(c.job, c.step) for c in removed] == [("a", 1)] and not Path(removed[0].path).exists()
        assert not service.jobs["a"].pool.sets and len(service.jobs["b"].pool.sets) == 1
        assert await _durable(service, "b", 2) is SaveState.COMMITTED
        assert (await _load(service, "b", 2))[0] == "memory" and (await _load(service, "a", 1))[0] == "disk"

    _run(service, run)


# ------------------------------------------------------------------ loads' staging files


async def _staged_load(service: CheckpointService, job: str, step: int, nbytes: int = MiB) -> tuple[str, str]:
    """A load by a rank that cannot read the root: the daemon stages what it reads (checked as _load)."""
    plan = await service.plan_load(PlanLoad(job, 0, 1, step, [_spec(nbytes)], ["model"], True, direct_read=False))
    assert plan.pieces and all("-fetch-" in p.path for p in plan.pieces)
    for piece in plan.pieces:
        fd = os.open(piece.path, os.O_RDONLY)
        try:
            assert os.pread(fd, piece.nbytes, piece.offset) == bytes([step % 256]) * piece.nbytes
        finally:
            os.close(fd)
    return plan.tier, plan.load_id


async def _on_disk_only(service: CheckpointService, job: str, step: int) -> None:
    """Save the step, then give its snapshot back: it loads from the root only."""
    await _saved(service, job, step)
    await service.collect(job, dry_run=False)
    assert not service.jobs[job].pool.sets


def _staging_files(service: CheckpointService) -> list[str]:
    return sorted(p.name for p in service.config.shm_dir.iterdir() if "-fetch-" in p.name)


# a load's staging files count against --shm-budget: idle snapshots go back to make room, as for a save
def test_a_loads_staging_counts_against_the_budget_and_takes_idle_snapshots_first(tmp_path: Path) -> None:
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=2 * MiB + MiB // 2))
    memory = service.engine.memory

    async def run() -> None:
        await _on_disk_only(service, "a", 1)
        await _saved(service, "b", 1)
        await _saved(service, "c", 1)
        _, load_id = await _staged_load(service, "a", 1)  # 1 MiB staged: b's snapshot, idle longest, goes back
        assert memory.staging_bytes() == MiB and _staging_files(service)
        assert [len(service.jobs[j].pool.sets) for j in "bc"] == [0, 1] and _released(service, "pressure") == MiB
        assert memory.in_use() == 2 * MiB <= memory.budget
        assert service.live_state().staging_bytes == MiB and service.status().shm_staging == MiB
        await _saved(service, "b", 2)  # a save sees the staging as in use: c's snapshot goes back, never the load's files
        assert [len(service.jobs[j].pool.sets) for j in "bc"] == [1, 0] and memory.in_use() == 2 * MiB
        service.load_done(load_id)
        assert memory.staging_bytes() == 0 and not _staging_files(service)

    _run(service, run)


# staging kept for a node's ranks that have not loaded yet (engine/staging_holds.py) gives way
# when a save finds nothing else to give back: the late rank stages again, the save is not refused
def test_staging_kept_for_ranks_not_come_yet_gives_way_to_a_save(tmp_path: Path) -> None:
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=MiB + MiB // 2))
    memory = service.engine.memory

    async def run() -> None:
        await _on_disk_only(service, "a", 1)
        plan = await service.plan_load(PlanLoad("a", 0, 2, 1, [_spec(MiB)], ["model"], True, direct_read=False, local_world_size=2))
        service.load_done(plan.load_id)
        assert memory.staging_bytes() == MiB and _staging_files(service)  # kept for rank 1, which has not loaded
        await _saved(service, "b", 1)
        assert memory.staging_bytes() == 0
        await asyncio.sleep(0.1)  # the pages are freed off the loop
        assert not _staging_files(service)
        _, load_id = await _staged_load(service, "a", 1)  # rank 1's load, late, stages again
        service.load_done(load_id)

    _run(service, run)


# a load waits for a save in flight (the only copy of its step) to be written, then takes its memory
def test_a_staged_load_waits_for_a_save_in_flight_then_stages(tmp_path: Path) -> None:
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=MiB + MiB // 2), write_throttle=SLOW)

    async def run() -> None:
        await _on_disk_only(service, "a", 1)
        await _save(service, "b", 1)
        assert _writing(service, "b", 1)
        _, load_id = await _staged_load(service, "a", 1)
        assert service.jobs["b"].recent[1].state is SaveState.COMMITTED and not service.jobs["b"].pool.sets
        service.load_done(load_id)
        assert service.engine.memory.staging_bytes() == 0

    _run(service, run)


# staging that can never fit fails at once, saying what to change; nothing is staged or counted
def test_staging_more_than_the_budget_fails_with_what_to_change(tmp_path: Path) -> None:
    service = _service(tmp_path)

    async def run() -> None:
        await _on_disk_only(service, "a", 1)
        service.reconfigure(DaemonConfig(**{**service.config.__dict__, "shm_budget": ShmBudget(nbytes=MiB // 2)}))
        try:
            await _staged_load(service, "a", 1)
        except Exhausted as exc:
            assert "staging 1 MiB of step 1 of job 'a'" in str(exc) and "--shm-budget" in str(exc)
            assert "let the ranks read the checkpoint files themselves" in str(exc)
        else:
            raise AssertionError("the load staged more than the budget")
        assert service.engine.memory.staging_bytes() == 0 and not _staging_files(service)
        assert (await _load(service, "a", 1))[0] == "disk"  # a rank that reads the root stages nothing

    _run(service, run)


# a prefetch's call (Loads.prefetch: evict=False, no wait) takes only free memory: no other job's snapshot
def test_a_prefetch_takes_only_free_memory(tmp_path: Path) -> None:
    service = _service(tmp_path, shm_budget=ShmBudget(nbytes=2 * MiB))
    memory = service.engine.memory

    async def run() -> None:
        await _saved(service, "b", 1)
        with pytest.raises(Exhausted, match="no room for staging 2 MiB of step 1 of job 'a'"):
            await memory.stage_room("a", 1, 2 * MiB, 0.0, evict=False)  # only with b's snapshot given back
        assert memory.staging_bytes() == 0 and len(service.jobs["b"].pool.sets) == 1
        await memory.stage_room("a", 1, MiB, 0.0, evict=False)
        assert memory.staging_bytes() == MiB
        memory.staging_removed("a", 1)
        assert memory.staging_bytes() == 0

    _run(service, run)


# two loads counted at once must both fit in the directory: staged bytes not written yet count
def test_staging_counted_but_not_yet_written_counts_against_the_directorys_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = _service(tmp_path)
    memory = service.engine.memory
    monkeypatch.setattr(memory_module, "free_bytes", lambda _: MiB + MiB // 2)  # a nearly full directory

    async def run() -> None:
        await memory.stage_room("a", 1, MiB, 0.0)  # fits; nothing of it written yet
        with pytest.raises(Exhausted, match="no room for staging 1 MiB of step 2 of job 'b'"):
            await memory.stage_room("b", 2, MiB, 0.0)
        memory.staging_removed("a", 1)
        await memory.stage_room("b", 2, MiB, 0.0)

    _run(service, run)


# ------------------------------------------------------------------ reports


# issue 30 finding 5 (a): status and the metrics say who holds what
def test_status_and_metrics_say_who_holds_what(tmp_path: Path) -> None:
    service = _service(tmp_path, write_throttle=SLOW, shm_budget=ShmBudget(nbytes=64 * MiB))

    async def run() -> None:
        await _saved(service, "a", 1)
        await _save(service, "b", 1, nbytes=2 * MiB)
        status = service.status()
        a, b = status.arena_holders
        assert isinstance(a, ArenaHolder) and (a.job, a.bytes, a.sets, a.held_steps, a.in_flight, a.readers) == ("a", MiB, 1, (1,), 0, 0)
        assert a.idle_s > 0 and (b.job, b.bytes, b.in_flight, b.idle_s) == ("b", 2 * MiB, 1, 0.0)
        assert status.shm_budget == 64 * MiB and status.shm_free > 0
        live = service.live_state()
        assert live.job_arena_bytes == {"a": MiB, "b": 2 * MiB} and live.job_idle_s["b"] == 0.0 and live.shm_budget == 64 * MiB
        await _durable(service, "b", 1)

    _run(service, run)


# issue 30 finding 5: the budget and the release settings change on SIGHUP (CheckpointService.reconfigure)
def test_the_memory_settings_change_without_a_restart(tmp_path: Path) -> None:
    service = _service(tmp_path)
    try:
        assert service.engine.memory.budget is None
        fixed = service.reconfigure(DaemonConfig(**{**service.config.__dict__, "shm_budget": ShmBudget(nbytes=3 * MiB), "idle_release_s": 5.0}))
        assert fixed == [] and service.engine.memory.budget == 3 * MiB and service.config.idle_release_s == 5.0
    finally:
        service.close()


# issue 30 review: Arena.close frees the pages at once (libc's fallocate, loaded once), even
# while a trainer still maps the file
def test_closed_arenas_give_their_pages_back_while_a_trainer_still_maps_them(tmp_path: Path) -> None:
    for n in range(2):  # the second close reuses the loaded fallocate
        arena = Arena(tmp_path / f"ckptd-test-{n}", 4 * MiB)
        arena.view(0, 4 * MiB)[:] = b"\x01" * (4 * MiB)
        trainer = os.open(arena.path, os.O_RDWR)
        try:
            mapping = mmap.mmap(trainer, 4 * MiB)
            assert os.fstat(trainer).st_blocks * 512 >= 4 * MiB
            arena.close()
            assert os.fstat(trainer).st_blocks == 0 and mapping[:4] == b"\x00" * 4
            mapping.close()
        finally:
            os.close(trainer)
