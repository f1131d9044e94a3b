"""The state machine of a save (engine/sessions.py), driven in process: every transition, and
every refusal with the error a rank gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.handoff.arena import ArenaPool, ArenaSet, SetState
from ckptd.daemon.plan.compression import SaveOptions
from ckptd.daemon.engine.sessions import RECENT_RESULTS, JobState, SaveSession, SaveState
from ckptd.daemon.errors import InvalidRequest, Precondition
from ckptd.daemon.plan.save_plan import TensorSpec, make_save_plan
from arena_rig import take_arenas  # tests/arena_rig.py


def _session(step: int = 1, ranks: int = 2, world: int = 2) -> SaveSession:
    return SaveSession("job", step, world, f"id-{step}", None, 60.0, ranks)


def _plan(ranks: int = 2) -> Any:
    specs = [[TensorSpec(f"model/w{r}", "model", "F32", (4,), Box.full((4,)))] for r in range(ranks)]
    return make_save_plan(specs)


def _arenas(tmp_path: Path, plan: Any) -> ArenaSet:
    shm = tmp_path / f"shm{len(list(tmp_path.iterdir()))}"  # a pool of its own: arena names repeat per pool
    shm.mkdir()
    pool = ArenaPool(shm, "job", 2)
    arenas = take_arenas(pool, plan.arena_bytes)
    assert arenas is not None
    return arenas


def _snapshotting(tmp_path: Path, ranks: int = 2) -> SaveSession:
    session = _session(ranks=ranks, world=ranks)
    for r in range(ranks):
        session.arrive(r, f"fp{r}", SaveOptions(), 0, ranks)
    plan = _plan(ranks)
    session.plan_with(plan)
    assert session.start_snapshot(_arenas(tmp_path, plan))
    return session


def test_a_save_gathers_until_every_local_rank_arrived() -> None:
    session = _session()
    assert session.state is SaveState.GATHERING and session.open
    assert session.arrive(0, "fp0", SaveOptions(), 0, 2) is False
    assert session.arrive(1, "fp1", SaveOptions(), 3, 2) is True
    assert session.arrived == {0: "fp0", 1: "fp1"} and session.lineage == 3


@pytest.mark.parametrize(
    ("second", "local_ranks", "error"),
    [
        ((1, SaveOptions(quantize="O1")), 2, "every rank must pass the same"),
        ((1, SaveOptions(no_quantize=True)), 2, "every rank must pass the same"),
        ((1, SaveOptions()), 3, "rank 1 says this node serves 3 ranks, an earlier rank said 2"),
    ],
)
def test_a_rank_that_disagrees_with_the_save_is_refused(second: tuple[int, SaveOptions], local_ranks: int, error: str) -> None:
    session = _session()
    session.arrive(0, "fp0", SaveOptions(), 0, 2)
    with pytest.raises(InvalidRequest, match=error):
        session.arrive(second[0], "fp", second[1], 0, local_ranks)
    assert session.arrived == {0: "fp0"}  # the refused rank did not join


# issue 30 finding 6: a rank joining twice is no caller error (a restarted rank, or a second run)
def test_a_rank_that_joins_twice_is_a_precondition_not_a_refused_state() -> None:
    session = _session()
    session.arrive(0, "fp0", SaveOptions(), 0, 2)
    with pytest.raises(Precondition, match="rank 0 joined the save of step 1 twice"):
        session.arrive(0, "fp0", SaveOptions(), 0, 2)
    assert session.arrived == {0: "fp0"}


def test_no_rank_joins_a_save_that_is_already_snapshotting(tmp_path: Path) -> None:
    session = _snapshotting(tmp_path, ranks=1)
    with pytest.raises(Precondition, match="is snapshotting, ranks can no longer join"):
        session.arrive(5, "fp", SaveOptions(), 0, 1)


def test_the_last_hand_over_closes_the_snapshot_and_marks_the_arenas_persisting(tmp_path: Path) -> None:
    session = _snapshotting(tmp_path)
    assert session.state is SaveState.SNAPSHOTTING
    assert session.hand_over(1, {"epoch": 1}) is False
    assert session.state is SaveState.SNAPSHOTTING and not session.closed.is_set()
    assert session.hand_over(0, {"epoch": 1}, {"config.json": b"{}"}) is True
    assert session.state is SaveState.WRITING and not session.open and session.closed.is_set()
    assert session.arenas is not None and session.arenas.state is SetState.PERSISTING and session.arenas.step == 1
    assert session.model_files == {"config.json": b"{}"} and session.snapshot_done > 0


def test_model_files_come_from_rank_0_only(tmp_path: Path) -> None:
    session = _snapshotting(tmp_path)
    session.hand_over(1, {}, {"config.json": b"rank 1"})
    assert session.model_files == {}


@pytest.mark.parametrize(
    ("rank", "error", "exc"),
    [
        (7, "rank 7 did not join the save of step 1", InvalidRequest),
        (0, "rank 0 handed its snapshot of step 1 over twice", InvalidRequest),
    ],
)
def test_a_hand_over_the_save_cannot_take_is_refused(tmp_path: Path, rank: int, error: str, exc: type[Exception]) -> None:
    session = _snapshotting(tmp_path)
    session.hand_over(0, {})
    with pytest.raises(exc, match=error):
        session.hand_over(rank, {})


def test_no_hand_over_before_the_arenas_are_taken_or_after_the_save_failed(tmp_path: Path) -> None:
    session = _session()
    session.arrive(0, "fp0", SaveOptions(), 0, 2)
    with pytest.raises(Precondition, match="is gathering, it cannot take a snapshot now"):
        session.hand_over(0, {})
    failed = _snapshotting(tmp_path)
    failed.fail("boom")
    with pytest.raises(Precondition, match="is failed"):
        failed.hand_over(0, {})


def test_fail_ends_a_save_once_and_wakes_the_ranks_waiting_for_the_plan() -> None:
    session = _session()
    assert session.fail("rank 1 aborted") is True
    assert session.state is SaveState.FAILED and session.error == "rank 1 aborted" and session.ready.is_set()
    assert session.fail("a second reason") is False
    assert session.error == "rank 1 aborted"


def test_an_ended_save_cannot_fail_or_start_its_snapshot(tmp_path: Path) -> None:
    session = _snapshotting(tmp_path, ranks=1)
    session.hand_over(0, {})
    session.commit("/root/job/step-00000001")
    assert session.state is SaveState.COMMITTED and session.step_dir.endswith("step-00000001")
    assert session.fail("too late") is False and session.state is SaveState.COMMITTED
    late = _session()
    late.fail("timed out while the arenas were being allocated")
    assert late.start_snapshot(_arenas(tmp_path, _plan())) is False  # the engine releases them
    assert late.state is SaveState.FAILED and late.arenas is None


def test_only_a_snapshot_being_written_commits() -> None:
    session = _session()
    with pytest.raises(Precondition, match="only a snapshot being written can be committed"):
        session.commit("x")


def test_skip_ends_the_save_without_a_snapshot() -> None:
    session = _session()
    session.skip("all 2 snapshots are still being written")
    assert session.state is SaveState.SKIPPED and session.ended and session.skip_reason is not None


@pytest.mark.parametrize(
    ("arrived", "handed", "reason"),
    [
        ([0], [], "ranks [1, 2] never started it within 60 s"),
        ([0, 1, 2], [1], "ranks [0, 2] did not hand their snapshot over within 60 s"),
    ],
)
def test_the_watchdogs_reason_names_the_ranks_that_held_the_save_up(arrived: list[int], handed: list[int], reason: str) -> None:
    session = _session(ranks=3, world=3)
    session.arrived = {r: "fp" for r in arrived}
    session.committed = {r: {} for r in handed}
    assert session.timeout_reason() == reason


# issue 30 finding 11
def test_issue30_finding11_a_node_whose_ranks_all_arrived_is_joining_and_waits_for_the_other_nodes() -> None:
    session = _session(ranks=2, world=4)  # this node serves ranks 2 and 3 of 4
    session.arrived = {2: "fp"}
    assert not session.joining and session.timeout_reason() == "ranks [0, 1, 3] never started it within 60 s"
    session.arrived[3] = "fp"
    assert session.joining and session.timeout_reason() == "ranks [0, 1] of the other nodes never joined it within 60 s"
    session.plan_with(_plan(4))
    assert not session.joining


def test_a_job_files_ended_saves_in_the_order_they_ended_and_keeps_the_newest(tmp_path: Path) -> None:
    job = JobState(world_size=1, pool=ArenaPool(tmp_path, "job", 2))
    for step in range(RECENT_RESULTS + 3, 0, -1):  # a rolled-back job: newest saves have low steps
        session = _session(step)
        job.sessions[step] = session
        session.fail("x")
        job.finish(session)
        assert session.finished.is_set() and session.closed.is_set() and step not in job.sessions
    assert len(job.recent) == RECENT_RESULTS
    assert list(job.recent)[-1] == 1 and RECENT_RESULTS + 3 not in job.recent


def test_a_job_finds_saves_by_id_and_the_ones_a_rank_left_behind(tmp_path: Path) -> None:
    job = JobState(world_size=2, pool=ArenaPool(tmp_path, "job", 2))
    old, new = _session(1), _session(2)
    old.arrive(0, "fp", SaveOptions(), 0, 2)
    job.sessions = {1: old, 2: new}
    assert job.find("id-1") is old and job.find("nope") is None
    assert list(job.left_behind(0, 2)) == [old] and list(job.left_behind(1, 2)) == []
    assert list(job.left_behind(0, None)) == [old]  # a load leaves every open save behind


def test_a_new_world_size_forgets_plans_unless_a_save_is_open(tmp_path: Path) -> None:
    job = JobState(world_size=2, pool=ArenaPool(tmp_path, "job", 2))
    job.plans["k"] = _plan()
    job.resize(4, "job")
    assert job.world_size == 4 and not job.plans
    job.sessions[1] = _session(ranks=4, world=4)
    with pytest.raises(Precondition, match="has a save in flight with world size 4"):
        job.resize(8, "job")


def test_the_last_committed_save_is_the_one_that_ended_last(tmp_path: Path) -> None:
    job = JobState(world_size=1, pool=ArenaPool(tmp_path, "job", 2))
    assert job.last_committed() is None
    for step in (5, 3):
        session = _snapshotting(tmp_path, ranks=1)
        session.step = step
        session.hand_over(0, {})
        session.commit(f"step-{step}")
        job.finish(session)
    last = job.last_committed()
    assert last is not None and last.step == 3 and job.committed_recently(5) and not job.committed_recently(4)


def test_a_fingerprint_names_the_metadata_its_rank_sent_last_and_a_change_drops_the_jobs_plans(tmp_path: Path) -> None:
    """Issue 30 finding 1: JobState keeps metadata under the daemon's digest of it; a fingerprint
    only names that digest for the rank that sent it."""
    state = JobState(world_size=2, pool=ArenaPool(tmp_path, "job", 2))
    a = (TensorSpec("model/w", "model", "BF16", (2,), Box.full((2,))),)
    b = (TensorSpec("model/w", "model", "F16", (2,), Box.full((2,))),)
    assert not state.describe(0, "fp", a, "da")
    state.plans["k"] = make_save_plan([a])
    assert not state.describe(0, "fp", a, "da") and "k" in state.plans  # the same metadata again
    assert not state.describe(1, "fp", b, "db")  # another rank's name is its own
    assert state.describe(0, "fp", b, "db") and state.plans == {}
    assert state.names == {(0, "fp"): "db", (1, "fp"): "db"} and state.specs[(0, "db")] == b and state.specs[(0, "da")] == a


def test_a_save_keeps_the_metadata_a_load_finds_by_fingerprint(tmp_path: Path) -> None:
    """JobState.saved_specs: what a rank sent with a fingerprint to a save, for that rank only
    (rpc/checkpoint._LoadSpecs takes it for a load that names the fingerprint alone)."""
    from ckptd.common.boxes import Box
    from ckptd.daemon.plan.save_plan import TensorSpec

    state = JobState(world_size=2, pool=ArenaPool(tmp_path, "job", 2))
    specs = (TensorSpec("model/w", "model", "F32", (4,), Box((0,), (4,))),)
    assert state.saved_specs(0, "fp") is None
    state.describe(0, "fp", specs, "digest-a")
    assert state.saved_specs(0, "fp") is specs and state.saved_specs(1, "fp") is None and state.saved_specs(0, "other") is None
    state.resize(3, "job")  # an elastic restart forgets it
    assert state.saved_specs(0, "fp") is None
