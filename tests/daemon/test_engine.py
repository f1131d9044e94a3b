"""The engine in process (service.CheckpointService without gRPC): saves through their states
to a commit, failures and their side effects, and loads from each tier. Ranks are coroutines
that copy their bytes into the arenas the engine hands out, as a client does.

Every test runs on both storage backends: the POSIX root, and the in-memory test double
(tests/memory_backend.py), which has no local files, so its loads are staged into shared memory."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.engine.requests import BeginSave, CommitSnapshot, PlanLoad
from ckptd.daemon.engine.sessions import SaveState
from ckptd.daemon.errors import Aborted, AlreadyExists, NotFound, Unavailable, UnknownFingerprint
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.daemon.engine.sessions import SaveSession
from ckptd.daemon.service import CheckpointService
from ckptd.daemon.storage import Storage, StorageBackend
from memory_backend import MemoryStorage


def _specs(rank: int, world: int) -> list[TensorSpec]:
    """Rank `rank` holds rows [2 rank, 2 rank + 2) of a (2 world, 3) weight and a bias of its own."""
    return [
        TensorSpec("model/w", "model", "F32", (2 * world, 3), Box((2 * rank, 0), (2, 3))),
        TensorSpec(f"model/b{rank}", "model", "F32", (3,), Box.full((3,))),
    ]


def _values(step: int, spec: TensorSpec) -> np.ndarray:
    seed = sum(map(ord, spec.name)) + 97 * step + 31 * spec.box.offsets[0]
    return np.random.default_rng(seed).standard_normal(spec.box.lengths).astype(np.float32)


@pytest.fixture
def config(tmp_path: Path) -> DaemonConfig:
    (tmp_path / "shm").mkdir()
    return DaemonConfig(root=tmp_path / "root", socket=tmp_path / "s.sock", shm_dir=tmp_path / "shm", keep_last=2, save_timeout_s=30, disk_reserve=0)


@pytest.fixture(params=["posix", "memory"])
def storage(request: pytest.FixtureRequest, config: DaemonConfig) -> StorageBackend:
    return Storage(config.root) if request.param == "posix" else MemoryStorage()


def _service(config: DaemonConfig, storage: StorageBackend, **settings: Any) -> CheckpointService:
    svc = CheckpointService(DaemonConfig(**{**config.__dict__, **settings}), storage)
    svc.start()
    return svc


@pytest.fixture
def service(config: DaemonConfig, storage: StorageBackend) -> Iterator[CheckpointService]:
    svc = _service(config, storage)
    yield svc
    svc.close()


def _steps(service: CheckpointService) -> list[int]:
    return service.storage.catalog.committed_steps("job")


async def _save(service: CheckpointService, step: int, world: int = 2, hand_over: tuple[int, ...] | None = None) -> list[SaveSession]:
    """Every rank joins the save; the ranks in `hand_over` (all) copy their bytes and hand over."""

    async def rank(r: int) -> SaveSession:
        specs = _specs(r, world)
        session = await service.begin_save(BeginSave("job", r, world, step, f"fp{r}", specs, None, 30.0))
        if hand_over is None or r in hand_over:
            assert session.plan is not None and session.arenas is not None
            arena = session.arenas.arenas[r]
            for slot in session.plan.slots:
                if slot.rank == r:
                    spec = next(s for s in specs if s.name == slot.name and s.box == slot.box)
                    arena.view(slot.offset, slot.nbytes)[:] = _values(step, spec).tobytes()
            await service.commit_snapshot(CommitSnapshot("job", r, session.save_id, json.dumps({"rank": r, "step": step})))
        return session

    return list(await asyncio.gather(*(rank(r) for r in range(world))))


async def _durable(service: CheckpointService, step: int) -> SaveSession | str:
    last: SaveSession | str = ""
    async for item in service.progress("job", step, 30.0):
        last = item
    return last


def _read(piece: Any) -> bytes:
    fd = os.open(piece.path, os.O_RDONLY)
    try:
        return os.pread(fd, piece.nbytes, piece.offset)
    finally:
        os.close(fd)


async def _check_load(service: CheckpointService, step: int | None, expect_step: int, world: int = 2) -> str:
    """Load the whole state as one rank of a new world of one; check every byte; return the tier."""
    whole = [TensorSpec("model/w", "model", "F32", (2 * world, 3), Box.full((2 * world, 3)))]
    whole += [TensorSpec(f"model/b{r}", "model", "F32", (3,), Box.full((3,))) for r in range(world)]
    plan = await service.plan_load(PlanLoad("job", 0, 1, step, whole, ["model"], True))
    assert plan.step == expect_step and not plan.missing and not plan.unexpected
    for spec in whole:
        got = np.zeros(spec.shape, np.float32)
        for piece in (p for p in plan.pieces if p.name == spec.name):
            values = np.frombuffer(_read(piece), np.float32).reshape(piece.fragment.lengths)
            got[tuple(slice(o, o + n) for o, n in zip(piece.fragment.offsets, piece.fragment.lengths))] = values
        for r in range(world):
            part = _specs(r, world)[0 if spec.name == "model/w" else 1]
            if part.name != spec.name:
                continue
            box = tuple(slice(o, o + n) for o, n in zip(part.box.offsets, part.box.lengths))
            np.testing.assert_array_equal(got[box], _values(expect_step, part))
    assert plan.extras == {"rank": 0, "step": expect_step}
    service.load_done(plan.load_id)
    return plan.tier


def test_a_save_goes_through_its_states_to_a_commit_and_loads_from_memory_then_disk(
    config: DaemonConfig, storage: StorageBackend, service: CheckpointService
) -> None:
    async def run() -> None:
        sessions = await _save(service, 10)
        assert all(s is sessions[0] for s in sessions)  # one session for the step
        outcome = await _durable(service, 10)
        assert isinstance(outcome, SaveSession) and outcome.state is SaveState.COMMITTED
        assert _steps(service) == [10] and outcome.step_dir == storage.catalog.step_location("job", 10)
        assert service.status().committed_total == 1 and service.engine.last_commit is not None
        assert service.status("job").last_commit == service.engine.last_commit and service.status("other").last_commit is None
        assert await _check_load(service, None, 10) == "memory"  # the held snapshot
        assert await _durable(service, 10) is outcome  # a finished save is reported as it ended

    asyncio.run(run())
    restarted = _service(config, storage)  # the same storage, a new daemon: nothing held in memory
    try:
        assert asyncio.run(_check_load(restarted, 10, 10)) == "disk"
        assert asyncio.run(_durable(restarted, 10)) == "committed"  # committed before this daemon started
    finally:
        restarted.close()


def test_retention_keeps_the_newest_steps_after_each_commit(service: CheckpointService) -> None:
    async def run() -> None:
        for step in (1, 2, 3):
            await _save(service, step)
            await _durable(service, step)
        assert _steps(service) == [2, 3]
        with pytest.raises(AlreadyExists, match="step 3 of job 'job' is already committed"):
            await _save(service, 3)

    asyncio.run(run())


def test_a_commit_stands_when_the_retention_after_it_fails(service: CheckpointService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found by an attacker's probe: retention that raised after a commit (it refused a listing
    with a step twice) turned the committed, acknowledged step into a failed save. The commit
    stands; the failure is logged; the next commit applies retention again."""
    real = service.housekeeping.apply_retention
    failing = [True]

    async def apply_retention(job: str, dry_run: bool = False, committed: int | None = None) -> list[Any]:
        if failing[0]:
            raise ValueError("committed steps [1] are listed more than once")
        return await real(job, dry_run, committed)

    monkeypatch.setattr(service.housekeeping, "apply_retention", apply_retention)

    async def run() -> None:
        for step in (1, 2, 3):
            await _save(service, step)
            done = await _durable(service, step)
            assert isinstance(done, SaveSession) and done.state is SaveState.COMMITTED, done
        assert _steps(service) == [1, 2, 3]  # nothing removed while retention fails
        failing[0] = False
        await _save(service, 4)
        await _durable(service, 4)
        assert _steps(service) == [3, 4]

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert "retention of job job after the commit of step 3 failed" in caplog.text


def test_two_retention_runs_of_a_job_take_turns(service: CheckpointService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Found by an attacker's probe: the retention runs of two commits in quick succession
    overlapped and both removed the same step (the second logged "could not remove step 90").
    A job's runs take turns: each step is removed once, by one of them."""
    async def no_retention(job: str, step: int) -> None:
        return None

    monkeypatch.setattr(service.housekeeping, "after_commit", no_retention)
    monkeypatch.setattr(service.commit, "_retention", no_retention)
    removing: list[int] = []
    at_once = [0, 0]  # now, most
    real_remove = service.storage.janitor.remove_step

    def remove_step(job: str, step: int, recycle: bool = False) -> Any:
        at_once[0] += 1
        at_once[1] = max(at_once)
        removing.append(step)
        time.sleep(0.05)
        try:
            return real_remove(job, step, recycle)
        finally:
            at_once[0] -= 1

    monkeypatch.setattr(service.storage.janitor, "remove_step", remove_step)

    async def run() -> list[list[Any]]:
        for step in (1, 2, 3, 4):
            await _save(service, step)
            await _durable(service, step)
        assert _steps(service) == [1, 2, 3, 4]
        return await asyncio.gather(service.housekeeping.apply_retention("job"), service.housekeeping.apply_retention("job"))

    with caplog.at_level(logging.ERROR):
        first, second = asyncio.run(run())
    assert sorted(removing) == [1, 2] and at_once[1] == 1, (removing, at_once)
    assert sorted(c.step for c in first + second) == [1, 2] and _steps(service) == [3, 4]
    assert "could not remove" not in caplog.text


def test_a_save_reads_no_index_back_from_the_storage(service: CheckpointService, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention after each commit reads the newest step's policy from the index the commit
    made, not from the disk (a 4,000-tensor index took ~40 ms of the daemon's CPU to parse)."""
    read: list[tuple[str, int]] = []
    real = service.storage.files.read_index

    def read_index(job: str, step: int) -> object:
        read.append((job, step))
        return real(job, step)

    monkeypatch.setattr(service.storage.files, "read_index", read_index)

    async def run() -> None:
        for step in (1, 2, 3):
            await _save(service, step)
            assert isinstance(await _durable(service, step), SaveSession)
        assert _steps(service) == [2, 3]  # retention ran

    asyncio.run(run())
    assert read == []


def test_a_rank_that_never_hands_over_fails_the_save_at_its_timeout_and_frees_the_arenas(config: DaemonConfig, storage: StorageBackend) -> None:
    service = _service(config, storage, save_timeout_s=0.5)

    async def run() -> None:
        sessions = await _save(service, 5, hand_over=(0,))
        outcome = await _durable(service, 5)
        assert isinstance(outcome, SaveSession) and outcome.state is SaveState.FAILED
        assert outcome.error.startswith("ranks [1] did not hand their snapshot over within")
        assert sessions[0].arenas is not None and service.jobs["job"].pool.count >= 1
        assert service.status().failed_total == 1 and "step 5" in service.status().last_error
        assert "step 5" in service.status("job").last_error and service.status("other").last_error == ""  # not another job's
        assert _steps(service) == [] and not service.storage.files.step_file_sizes("job", 5)
        await _save(service, 6)  # the arenas came back: the next save gets them
        assert (await _durable(service, 6)).state is SaveState.COMMITTED  # type: ignore[union-attr]

    try:
        asyncio.run(run())
    finally:
        service.close()


def test_a_rank_that_aborts_fails_the_save_for_every_rank(service: CheckpointService) -> None:
    async def run() -> None:
        sessions = await _save(service, 7, hand_over=())
        await service.abort_save("job", 1, sessions[0].save_id, "out of memory")
        assert sessions[0].state is SaveState.FAILED and sessions[0].error == "rank 1 aborted: out of memory"
        with pytest.raises(NotFound, match="no save 'nope'"):
            await service.abort_save("job", 0, "nope", "")

    asyncio.run(run())


def test_a_rank_that_starts_another_save_leaves_the_old_one_failed(service: CheckpointService) -> None:
    async def run() -> None:
        old = (await _save(service, 8, hand_over=()))[0]
        await _save(service, 9)
        assert old.state is SaveState.FAILED and "moved on" in old.error
        assert (await _durable(service, 9)).state is SaveState.COMMITTED  # type: ignore[union-attr]

    asyncio.run(run())


def test_the_skip_policy_skips_a_save_when_every_arena_is_busy(config: DaemonConfig, storage: StorageBackend) -> None:
    service = _service(config, storage, arena_policy="skip", max_inflight=1, write_throttle=40)  # 40 B/s: ~2 s per step

    async def run() -> None:
        first = (await _save(service, 1))[0]
        second = (await _save(service, 2, hand_over=()))[0]
        assert first.state is SaveState.WRITING
        assert second.state is SaveState.SKIPPED and "still being written" in (second.skip_reason or "")
        assert service.status().skipped_total == 1
        assert (await _durable(service, 1)).state is SaveState.COMMITTED  # type: ignore[union-attr]

    try:
        asyncio.run(run())
    finally:
        service.close()


def test_loading_a_step_that_is_not_committed_says_so(service: CheckpointService) -> None:
    with pytest.raises(NotFound, match="has no committed checkpoint"):
        asyncio.run(service.plan_load(PlanLoad("job", 0, 1, None, [], [], False)))
    with pytest.raises(NotFound, match="step 4 of job 'job' is not committed"):
        asyncio.run(service.plan_load(PlanLoad("job", 0, 1, 4, [], [], False)))


def test_a_draining_daemon_takes_no_new_save(service: CheckpointService) -> None:
    async def run() -> None:
        await service.drain(0.1)
        with pytest.raises(Unavailable, match="shutting down"):
            await _save(service, 1)

    asyncio.run(run())


def test_a_hand_over_through_a_transport_the_daemon_lacks_is_refused(service: CheckpointService) -> None:
    """Daemon-side transports are looked up by name (handoffs.daemon_transports): "ipc" is there."""
    from ckptd.daemon.errors import InvalidRequest
    from ckptd.daemon.handoff.transports import StagedHandOver

    async def run() -> None:
        session = (await _save(service, 3, hand_over=()))[0]
        with pytest.raises(InvalidRequest, match="through transport 'rdma', which this daemon does not have"):
            await service.commit_snapshot(CommitSnapshot("job", 0, session.save_id, "{}", staged=StagedHandOver("rdma", "s", ())))
        assert sorted(service.engine.transports) == ["ipc"] and session.state is SaveState.SNAPSHOTTING

    asyncio.run(run())


def test_a_save_ends_failed_when_its_commit_breaks_unexpectedly(service: CheckpointService) -> None:
    """A save left "writing" would hold its arenas and keep a graceful stop waiting forever (seen
    in CI: a race of two removals of an aborted step escaped Commit.write)."""

    async def broken_report(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the coordinator broke")

    service.engine.coordination.report = broken_report  # type: ignore[method-assign]

    async def run() -> None:
        await _save(service, 4)
        outcome = await _durable(service, 4)
        assert isinstance(outcome, SaveSession) and outcome.state is SaveState.FAILED
        assert "internal error while writing: the coordinator broke" in outcome.error
        await service.drain(1.0)  # nothing left waiting

    asyncio.run(run())


# ------------------------------------------------------------------ issue 30 finding 1
# A save is planned from the metadata its ranks sent (the daemon's digest of it, per job), never
# from what a fingerprint named for another job or before, and a refused save keeps no plan.


def _whole(dtype: str, shape: tuple[int, ...] = (4, 2)) -> list[TensorSpec]:
    return [TensorSpec("model/w", "model", dtype, shape, Box.full(shape))]


def test_a_save_is_planned_from_the_metadata_its_rank_sent_under_a_known_fingerprint(service: CheckpointService) -> None:
    async def run() -> None:
        first = await service.begin_save(BeginSave("job", 0, 1, 1, "fp", _whole("BF16"), None, 30.0))
        assert first.plan is not None and first.plan.tensors[0].dtype == "BF16"
        changed = await service.begin_save(BeginSave("job", 0, 1, 2, "fp", _whole("F16"), None, 30.0))  # fails step 1: the rank moved on
        assert changed.plan is not None and changed.plan.tensors[0].dtype == "F16"
        named = await service.begin_save(BeginSave("job", 0, 1, 3, "fp", None, None, 30.0))  # the fingerprint alone: what it sent last
        assert named.plan is not None and named.plan.tensors[0].dtype == "F16"
        with pytest.raises(UnknownFingerprint):  # another job never sent metadata under "fp"
            await service.begin_save(BeginSave("other", 0, 1, 1, "fp", None, None, 30.0))

    asyncio.run(run())


def test_a_save_refused_for_its_arena_keeps_no_plan_and_touches_no_other_job(service: CheckpointService) -> None:
    async def run() -> None:
        with pytest.raises(Aborted, match=r"cannot reserve 256 TiB of shared memory") as refused:
            await service.begin_save(BeginSave("evil", 0, 1, 1, "fp", _whole("F32", (1 << 46,)), None, 30.0))
        assert "MiB" not in str(refused.value)
        assert service.engine.jobs["evil"].plans == {}
        victim = await service.begin_save(BeginSave("victim", 0, 1, 1, "fp", _whole("F32"), None, 30.0))
        assert victim.plan is not None and victim.plan.total_bytes == 32 and victim.arenas is not None
        retry = await service.begin_save(BeginSave("evil", 0, 1, 2, "fp", _whole("F32"), None, 30.0))  # fixed: planned anew
        assert retry.plan is not None and retry.plan.total_bytes == 32

    asyncio.run(run())
