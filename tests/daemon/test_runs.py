"""Job identity (issue 30, finding 6; engine/runs.py, admission.py): which run may save into a
job, run by run, first as pure rules, then through the engine in process (service.CheckpointService
without gRPC, one node), then node 0's coordinator with other nodes that answer without a network: a second live run is refused with what to do, a resumed run takes the
job over, a run that ended makes way, a client that goes away fails the save it left open; and
the resumed run's save of a step it redid is kept as committed (finding 7)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.engine.coordinator import Coordinator
from ckptd.daemon.engine.requests import BeginSave, CommitSnapshot, JoinSave, PlanLoad
from ckptd.daemon.engine.runs import Client, RunClaim, Runs
from ckptd.daemon.engine.sessions import SaveState
from ckptd.daemon.errors import Aborted, AlreadyExists, Precondition, RunRefused
from ckptd.daemon.rpc.peer_links import PeerLinks
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.daemon.plan.rollback import passed_over, rollbacks
from ckptd.daemon.engine.sessions import SaveSession
from ckptd.daemon.service import CheckpointService
from ckptd.daemon.storage import Storage
from ckptd.format.index import CheckpointIndex
from ckptd.wire.v1 import peer_pb2 as ppb


def _client(run: str, rank: int = 0) -> Client:
    return Client(run, rank, 1234, "host-a", time.time())


# ------------------------------------------------------------------ the rules, pure


# issue 30 finding 6
@pytest.mark.parametrize(
    ("owner", "owner_live", "run", "resumed", "refused", "owner_after", "displaced"),
    [
        ("", False, "b", False, "", "b", ""),  # the first run owns the job
        ("a", True, "a", False, "", "a", ""),  # the owner saves
        ("a", True, "b", False, "belongs to another run that is still live: run a", "a", ""),  # a second live run: refused
        ("a", False, "b", False, "", "b", "a"),  # the owner ended: the next run takes over
        ("a", True, "b", True, "", "b", "a"),  # a resumed run takes over, however live the owner looks
        ("a", False, "b", True, "", "b", "a"),
    ],
)
def test_who_may_save_into_a_job(owner: str, owner_live: bool, run: str, resumed: bool, refused: str, owner_after: str, displaced: str) -> None:
    runs = Runs()
    if owner:
        runs.claim("j", owner, False, False)
    if refused:
        with pytest.raises(RunRefused, match=refused):
            runs.claim("j", run, resumed, owner_live)
    else:
        assert runs.claim("j", run, resumed, owner_live) == displaced
    assert runs.owner("j") == owner_after


# issue 30 finding 6
def test_a_superseded_run_stays_refused_even_if_it_resumed_once() -> None:
    runs = Runs()
    runs.claim("j", "a", True, False)
    runs.claim("j", "b", True, True)  # b resumed: a is superseded
    runs.attach("j", "cb", _client("b"))  # b is live here
    for resumed in (False, True):
        with pytest.raises(RunRefused, match="run a no longer owns job 'j': run b took the job over"):
            runs.claim("j", "a", resumed, True)
        with pytest.raises(RunRefused, match="no longer owns"):
            runs.check("j", "a", resumed)
    runs.check("j", "b", False)  # the owner passes
    assert runs.claim("j", "", False, True) == "" and runs.owner("j") == "b"  # a client older than run ids: not told apart


# issue 31 item 6
def test_a_superseded_run_id_that_resumes_after_the_owner_ended_is_a_new_start() -> None:
    """torchrun in a new pod derives the id of the first attempt again (restart count 0, same
    --rdzv-id and master address): once the run that took over has ended, that id resumes."""
    runs = Runs()
    runs.claim("j", "a", False, False)
    runs.claim("j", "b", True, False)  # attempt 1 resumed: a (attempt 0, killed) is superseded
    with pytest.raises(RunRefused, match="no longer owns"):
        runs.claim("j", "a", False, False)  # not resumed: refused, even with b ended
    runs.check("j", "a", True)  # b is not live here: node 0 decides
    assert runs.claim("j", "a", True, False) == "b" and runs.owner("j") == "a"  # resumed, b ended: takes over
    runs.claim("j", "a", False, False)  # the owner again, its later saves too
    runs.check("j", "b", True)
    assert runs.claim("j", "b", True, False) == "a"  # and the other way round


# issue 30 finding 6
def test_liveness_follows_the_attached_clients() -> None:
    runs = Runs()
    first, second = _client("a", 0), _client("a", 1)
    ended = runs.attach("j", "c0", first)
    runs.attach("j", "c1", second)
    runs.claim("j", "a", False, False)
    assert runs.live("j", "a") and not runs.live("j", "b") and not runs.live("other", "a")
    assert "ranks 0, 1 attached to this daemon, pid 1234 on host-a" in runs.describe("j", "a")
    with pytest.raises(RunRefused, match="belongs to another run that is still live: run a .ranks 0, 1 attached"):
        runs.check("j", "b", False)
    assert runs.end_reason("j", "a", "b", True, runs.live("j", "a")) == "run b resumed the job"
    with pytest.raises(RunRefused, match="belongs to another run that is still live"):
        runs.end_reason("j", "a", "b", False, runs.live("j", "a"))
    assert runs.detach("j", "c0") is first and ended.is_set() and runs.live("j", "a")
    assert runs.detach("j", "c0") is None  # once
    runs.attach("j", "c1", _client("a", 1))  # attached again under its id (a restarted daemon's client)
    assert runs.detach("j", "c1", only=second) is None and runs.live("j", "a")  # the old call's end leaves the new one
    runs.detach("j", "c1")
    assert not runs.live("j", "a") and runs.end_reason("j", "a", "b", False, runs.live("j", "a")) == "run b began it after run a ended"
    runs.check("j", "b", False)  # the owner ended: node 0 decides (claim)


def test_a_rollback_passes_over_the_higher_committed_steps() -> None:
    assert passed_over([], 5) == [] and passed_over([10, 20], 30) == [] and passed_over([10, 20], 20) == []
    assert passed_over([10, 30, 20], 15) == [20, 30]  # commit order: 20 is the newest
    assert passed_over([10, 30, 20], 25) == []  # above the newest: the timeline goes on
    assert rollbacks([10, 20, 30, 15, 16, 5]) == {15: [20, 30], 5: [10, 15, 16, 20, 30]}  # 16 goes on from 15
    assert rollbacks([1, 2, 3]) == {}


# ------------------------------------------------------------------ through the engine


SPEC = TensorSpec("model/w", "model", "F32", (4,), Box.full((4,)))


@pytest.fixture
def service(tmp_path: Path) -> Any:
    (tmp_path / "shm").mkdir()
    config = DaemonConfig(root=tmp_path / "root", socket=tmp_path / "s.sock", shm_dir=tmp_path / "shm", save_timeout_s=30, disk_reserve=0)
    svc = CheckpointService(config)
    svc.start()
    yield svc
    svc.close()


async def _begin(service: CheckpointService, run: str, rank: int, step: int, world: int = 2, resumed_from: int | None = None) -> SaveSession:
    return await service.begin_save(
        BeginSave("job", rank, world, step, "fp", [SPEC], None, 30.0, run=run, resumed_from=resumed_from, client_id=f"{run}client{rank}")
    )


async def _hand_over(service: CheckpointService, session: SaveSession, rank: int) -> None:
    await service.commit_snapshot(CommitSnapshot("job", rank, session.save_id, json.dumps({"rank": rank})))


async def _save(service: CheckpointService, run: str, step: int, world: int = 1, resumed_from: int | None = None) -> SaveSession:
    """Every rank of `run` saves `step` and the step is committed (or kept)."""
    sessions = await asyncio.gather(*(_begin(service, run, r, step, world, resumed_from) for r in range(world)))
    if sessions[0].kept:
        return sessions[0]
    for r, session in enumerate(sessions):
        await _hand_over(service, session, r)
    async for _ in service.progress("job", step, 30.0):
        pass
    assert sessions[0].state is SaveState.COMMITTED, sessions[0].error
    return sessions[0]


def _attach(service: CheckpointService, run: str, rank: int = 0) -> Client:
    client = _client(run, rank)
    service.attach("job", f"{run}client{rank}", client)
    return client


# issue 30 finding 6
def test_a_second_live_run_cannot_join_the_first_runs_save(service: CheckpointService) -> None:
    """The issue's reproduction: run b's rank 0 began the step run a's rank 0 had begun; it used
    to join a's save (InvalidState "rank 0 joined the save of step 10 twice")."""

    async def run() -> None:
        for rank in (0, 1):
            _attach(service, "a", rank)
            _attach(service, "b", rank)
        a0 = asyncio.ensure_future(_begin(service, "a", 0, 10))
        await asyncio.sleep(0.05)  # a's save gathers
        with pytest.raises(RunRefused, match="job 'job' belongs to another run that is still live: run a .* new job name.*load the job"):
            await _begin(service, "b", 0, 10)
        a1 = await _begin(service, "a", 1, 10)
        session = await a0
        assert session is a1 and session.run == "a"
        for r in (0, 1):
            await _hand_over(service, session, r)
        async for _ in service.progress("job", 10, 30.0):
            pass
        assert session.state is SaveState.COMMITTED
        with pytest.raises(RunRefused, match="belongs to another run"):  # also at a step of its own
            await _begin(service, "b", 1, 20)
        assert service.storage.catalog.committed_steps("job") == [10]

    asyncio.run(run())


# issue 30 finding 6
def test_a_run_that_ended_makes_way_and_its_open_save_fails_at_once(service: CheckpointService) -> None:
    async def run() -> None:
        _attach(service, "a")
        await _save(service, "a", 1)
        waiting = asyncio.ensure_future(_begin(service, "a", 0, 2, world=2))  # rank 1 of a never comes
        await asyncio.sleep(0.05)
        service.detach("job", "aclient0")  # a's process ended
        with pytest.raises(Exception, match="rank 0's process ended before it handed its snapshot over"):
            await waiting
        _attach(service, "b")
        await _save(service, "b", 2)  # a fresh run after a: allowed, b owns the job
        assert service.runs.owner("job") == "b" and service.storage.catalog.committed_steps("job") == [1, 2]

    asyncio.run(run())


# issue 30 finding 6
def test_a_resumed_run_takes_the_job_over_from_a_live_one(service: CheckpointService) -> None:
    """Crash-and-resume is never refused: the new run loaded a step first, so it wins even while
    the old run still looks live (a hung process whose sockets are open)."""

    async def run() -> None:
        _attach(service, "a")
        await _save(service, "a", 1)
        hung = asyncio.ensure_future(_begin(service, "a", 0, 2, world=2))  # a's open save: rank 1 never comes
        await asyncio.sleep(0.05)
        _attach(service, "b")
        await _save(service, "b", 2, resumed_from=1)
        with pytest.raises(Exception, match="run b resumed the job"):
            await hung  # a's open save was ended for b
        with pytest.raises(RunRefused, match="run a no longer owns job 'job': run b took the job over"):
            await _begin(service, "a", 0, 3, world=1)
        assert service.runs.owner("job") == "b" and service.storage.catalog.committed_steps("job") == [1, 2]

    asyncio.run(run())


# issue 30 finding 7
def test_a_resumed_runs_save_of_a_step_it_redid_is_kept(service: CheckpointService) -> None:
    async def run() -> None:
        for step in (10, 20, 30):
            await _save(service, "a", step)
        before = service.storage.files.read_index("job", 20).created_at
        kept = await _save(service, "b", 20, resumed_from=10)  # resumed from 10 (a stale pointer), redid 10..20
        assert kept.state is SaveState.COMMITTED and "is committed already and this run resumed from step 10" in kept.kept
        assert service.storage.files.read_index("job", 20).created_at == before  # not written again
        assert "this run resumed from it" in (await _save(service, "b", 30, resumed_from=30)).kept
        # the rolled-back timeline: b goes on from 10 with 15, then a run resumed from 15 saves 20, which b passed over
        await _save(service, "b", 15, resumed_from=10)
        with pytest.raises(AlreadyExists, match="step 20 of job 'job' is already committed.*resumed from step 15.*timeline it rolled back from"):
            await _begin(service, "c", 0, 20, world=1, resumed_from=15)
        with pytest.raises(AlreadyExists, match="loaded no step of the job before saving.*new job name.*load the job's newest step"):
            await _begin(service, "b", 0, 10, world=1)  # no resume: refused as before, with advice that fits

    asyncio.run(run())


# issue 30 finding 6
def test_a_rollback_is_logged_with_the_steps_it_passes_over(service: CheckpointService, caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        for step in (10, 20, 30):
            await _save(service, "a", step)
        with caplog.at_level(logging.WARNING, logger="ckptd.daemon.engine.admission"):
            await _save(service, "a", 15)
            await _save(service, "a", 16)  # newer than 15, the newest now: no rollback
        rollback = [r.getMessage() for r in caplog.records if "rollback" in r.getMessage()]
        assert rollback == [
            "job job saves step 15 below its newest committed step 30: a rollback. It passes over steps 20, 30, which stay on disk "
            "but are no longer the newest (`ckptd ls` marks the rollback)"
        ]
        assert all(r.levelno == logging.WARNING for r in caplog.records if "rollback" in r.getMessage())

    asyncio.run(run())


# ------------------------------------------------------------------ node 0 (the coordinator, several nodes)


class Peers(PeerLinks):
    """Two other nodes that answer Inventory without a network: `attached` lists the runs each has
    a client of (node -> runs)."""

    def __init__(self, attached: dict[int, set[str]]) -> None:
        super().__init__(["n0", "n1", "n2"], "t" * 16)
        self.attached = attached
        self.asked: list[tuple[int, str]] = []

    def stub(self, node: int) -> Any:
        links = self

        class Stub:
            async def Inventory(self, request: ppb.InventoryRequest, **_: Any) -> ppb.InventoryResponse:
                links.asked.append((node, request.run_id))
                return ppb.InventoryResponse(run_attached=request.run_id in links.attached.get(node, set()))

        return Stub()


async def _no_retention(index: CheckpointIndex) -> None:
    return None


def _join(coord: Coordinator, node: int, step: int, claim: RunClaim, world: int = 1, rank: int = 0) -> Any:
    spec = (TensorSpec("model/w", "model", "F32", (4,), Box.full((4,))),)
    return coord.join(JoinSave("job", step, world, {rank: "fp"}, {rank: spec}, [], 30.0, None, claim=claim), node, "root")


# issue 30 finding 6
def test_node_0_asks_the_other_nodes_whether_the_owner_lives(tmp_path: Path) -> None:
    async def run() -> None:
        peers = Peers({2: {"a"}})
        coord = Coordinator(Storage(tmp_path), peers, "root", _no_retention)
        await _join(coord, 1, 1, RunClaim("a"))  # a's only rank is on node 1; a owns the job
        assert peers.asked == []  # nobody asked while the owner did not change
        with pytest.raises(RunRefused, match="job 'job' belongs to another run that is still live: run a .attached to another node"):
            await _join(coord, 0, 2, RunClaim("b"))
        assert sorted(peers.asked) == [(1, "a"), (2, "a")]  # node 2 has a client of a
        peers.attached = {}
        await _join(coord, 0, 3, RunClaim("b"))  # a ended everywhere: b takes over
        with pytest.raises(RunRefused, match="run a no longer owns job 'job'"):
            await _join(coord, 1, 4, RunClaim("a"))
        await _join(coord, 2, 5, RunClaim("c", resumed=True))  # a resumed run takes over at once
        assert coord.admission.runs.owner("job") == "c"

    asyncio.run(run())


# issue 30 finding 6
def test_node_0_never_mixes_two_runs_in_one_save(tmp_path: Path) -> None:
    async def run() -> None:
        peers = Peers({1: {"a"}})
        coord = Coordinator(Storage(tmp_path), peers, "root", _no_retention)
        first = asyncio.ensure_future(_join(coord, 1, 7, RunClaim("a"), world=2, rank=0))  # a's rank 1 is still to come
        await asyncio.sleep(0.05)
        with pytest.raises(RunRefused, match="belongs to another run that is still live: run a"):
            await _join(coord, 0, 7, RunClaim("b"), world=2, rank=1)  # b's rank 1 would complete a's save
        with pytest.raises(Precondition, match="node 1 joined the save of step 7 twice"):  # a restarted daemon's node: not a refused state
            await _join(coord, 1, 7, RunClaim("a"), world=2, rank=1)
        peers.attached = {}  # a's processes ended: its half-joined save makes way for b
        second = asyncio.ensure_future(_join(coord, 0, 7, RunClaim("b"), world=2, rank=1))
        with pytest.raises(Aborted, match="run b began it after run a ended"):
            await first
        await _join(coord, 1, 7, RunClaim("b"), world=2, rank=0)
        assert (await second).save_id

    asyncio.run(run())


# issue 30 finding 6
def test_a_load_by_another_run_leaves_a_live_runs_open_save_alone(service: CheckpointService) -> None:
    """An evaluation reading the job (rank 0 of a run of its own) is not the training run's rank
    0 moving on: the training run's save in flight stays open (it used to fail, "rank 0 moved on")."""

    async def run() -> None:
        _attach(service, "a")
        await _save(service, "a", 1)
        open_save = asyncio.ensure_future(_begin(service, "a", 0, 2, world=2))
        await asyncio.sleep(0.05)
        plan = await service.plan_load(PlanLoad("job", 0, 1, None, [SPEC], ["model"], True, run="eval"))
        service.load_done(plan.load_id)
        assert plan.step == 1 and not open_save.done()
        session = await asyncio.gather(_begin(service, "a", 1, 2, world=2), open_save)
        assert session[0] is session[1] and session[0].state is SaveState.SNAPSHOTTING
        plan = await service.plan_load(PlanLoad("job", 1, 2, None, [SPEC], ["model"], True, run="a"))  # a's own rank 1 moves on: its save ends
        service.load_done(plan.load_id)
        assert session[0].state is SaveState.FAILED and "moved on" in session[0].error

    asyncio.run(run())
