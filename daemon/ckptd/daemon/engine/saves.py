"""Saves: ranks join a save, the last one plans it and takes arenas, each hands its part over;
the complete snapshot goes to the commit (engine/commit.py).

A save of step S of a job is collective: every rank calls BeginSave(S). The last rank to arrive
plans the save (cached per job by the digests of the ranks' metadata, plan.spec_digest; with
several nodes, node 0 plans it for all) and takes an arena set; every rank then copies its slots and calls CommitSnapshot. When all
have, the snapshot is complete and is written in the background; WaitDurable reports progress
(`progress`) until it is committed. The save's states: engine/sessions.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Coroutine

from ckptd.common.names import MAX_EXTRAS_DEPTH, MAX_EXTRAS_JSON_DEPTH, json_depth
from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.requests import BeginSave, CommitSnapshot, JoinSave
from ckptd.daemon.engine.runs import RunClaim
from ckptd.daemon.engine.sessions import JobState, SaveSession, SaveState
from ckptd.daemon.errors import Aborted, AlreadyExists, Exhausted, InvalidRequest, NotFound, Precondition, RunRefused, Timeout, Unavailable, UnknownFingerprint, bounded
from ckptd.daemon.handoff.arena import ArenaSet
from ckptd.daemon.plan.save_plan import PlanError, SavePlan, make_save_plan, spec_digest
from ckptd.daemon.records import JoinResult

log = logging.getLogger(__name__)

MAX_EXTRAS_BYTES = 64 * 2**20

Writer = Callable[[JobState, SaveSession], Coroutine[Any, Any, None]]


class Saves:
    """BeginSave, CommitSnapshot, AbortSave and WaitDurable's progress, over the engine's jobs."""

    def __init__(self, engine: Engine, write: Writer) -> None:
        self.engine = engine
        self._write = write  # writes and commits a complete snapshot (Commit.write)

    async def begin(self, request: BeginSave) -> SaveSession:
        """Join the save of `request.step`; returns once the plan and arenas are decided (all ranks arrived).

        Raises RunRefused when the request's run may not save into the job (engine/runs.py). A
        resumed run's save of a step committed at or after the step it resumed from is kept:
        the session returned is committed (`kept` says why)."""
        job, rank, step, run = request.job, request.rank, request.step, request.run
        resumed_from = request.resumed_from
        engine = self.engine
        if engine.draining:
            raise Unavailable("the daemon is shutting down and takes no new saves; retry once it is back")
        local_ranks = self._local_ranks(request.world_size, request.local_world_size)
        for transport in engine.transports.values():
            await transport.before_save()
        if run:
            engine.runs.check(job, run, resumed_from is not None)
            await self._end_other_runs(job, run, resumed_from is not None)
        state = engine.job(job, request.world_size)
        digest = self._describe(state, request)
        if resumed_from is not None:
            await self._outcome_of_writing(state, step)
        if state.committed_recently(step) or await engine.committed(job, step):
            return await self._already_committed(request, local_ranks)
        await self.abort_left_behind(state, rank, step, run)
        session = state.sessions.get(step)
        client_id = request.client_id
        if session is not None and session.open and client_id and rank in session.arrived and session.clients.get(rank) != client_id:
            # another client of this rank began the step: the rank restarted (a retry of one client is refused by arrive)
            await engine.fail(state, session, (
                f"rank {rank} began step {step} again from another client: the rank restarted, or two clients of job {job!r} "
                f"claim rank {rank} (each process of a job needs its own RANK)"
            ), "rank_restarted")
            session = state.sessions.get(step)
        if session is None or not session.open:
            if session is not None:
                raise AlreadyExists(f"step {step} of job {job!r} is already being written; save under a new step")
            timeout_s = min(request.timeout_s, engine.config.save_timeout_s) if request.timeout_s else engine.config.save_timeout_s
            session = SaveSession(job, step, request.world_size, uuid.uuid4().hex, request.metric, timeout_s, local_ranks, run=run)
            session.resumed = resumed_from is not None
            state.sessions[step] = session
            engine.spawn(self._watchdog(state, session))
        if session.arrive(rank, digest, request.options, request.lineage, local_ranks):
            engine.spawn(self._prepare(state, session))
        if client_id:
            session.clients[rank] = client_id
        await session.ready.wait()
        if session.state is SaveState.FAILED:
            if session.refused:
                raise InvalidRequest(session.error)
            if session.run_refused:
                raise RunRefused(session.error)
            raise Aborted(f"save of step {step} aborted: {session.error}")
        return session

    @staticmethod
    def _describe(state: JobState, request: BeginSave) -> str:
        """The digest of the rank's metadata (plan.spec_digest): of its specs when sent, else of
        what it sent under its fingerprint before (UnknownFingerprint when nothing)."""
        rank, fingerprint, specs = request.rank, request.fingerprint, request.specs
        if specs is None:
            digest = state.names.get((rank, fingerprint))
            if digest is None:
                raise UnknownFingerprint()
            return digest
        digest = spec_digest(specs)
        if state.describe(rank, fingerprint, tuple(specs), digest):
            log.warning(
                "rank %s of job %s sent other tensor metadata under fingerprint %s than before; its saves are planned from the new metadata",
                rank, request.job, fingerprint[:16],
            )
        return digest

    async def _end_other_runs(self, job: str, run: str, resumed: bool) -> None:
        """Open saves of the job by other runs: refused (RunRefused) while such a run is live
        here and `run` started afresh; else failed, so that `run`'s ranks begin their own (the
        other run ended, or `run` resumed and takes the job over)."""
        state = self.engine.jobs.get(job)
        if state is None:
            return
        runs = self.engine.runs
        for other in list(state.sessions.values()):
            if not other.open or not other.run or other.run == run:
                continue
            reason = runs.end_reason(job, other.run, run, resumed, runs.live(job, other.run))
            await self.engine.fail(state, other, reason, "run_ended")

    async def client_gone(self, job: str, client_id: str) -> None:
        """A client detached (it closed, or its process ended): the open saves it joined and
        did not hand its part of over can never complete, so they fail now instead of at their
        timeout (their arenas free, a resumed run's load does not wait for them)."""
        state = self.engine.jobs.get(job)
        if state is None:
            return
        for session in list(state.sessions.values()):
            gone = [r for r, c in session.clients.items() if c == client_id and r not in session.committed]
            if session.open and gone:
                await self.engine.fail(state, session, f"rank {gone[0]}'s process ended before it handed its snapshot over", "run_ended")

    async def _outcome_of_writing(self, state: JobState, step: int) -> None:
        """A resumed run saves a step that is being written (the run before it handed it over,
        then stopped): wait for its outcome, which decides whether this save is kept."""
        session = state.sessions.get(step)
        if session is not None and session.state is SaveState.WRITING:
            try:
                await asyncio.wait_for(session.finished.wait(), session.timeout_s)
            except asyncio.TimeoutError:
                pass  # still writing: refused below as "being written"

    async def _already_committed(self, request: BeginSave, local_ranks: int) -> SaveSession:
        """`step` of the job is committed. A run that resumed from it, or from a step committed
        before it, redid that interval: the committed step is kept and the save counts as
        committed (a session that says so). Any other save is refused (AlreadyExists): ckptd
        never overwrites a step."""
        job, step, resumed_from = request.job, request.step, request.resumed_from
        order = await asyncio.to_thread(self.engine.storage.catalog.commit_order, job)
        if resumed_from is not None and resumed_from in order and step in order and order.index(step) >= order.index(resumed_from):
            kept = SaveSession(job, step, request.world_size, uuid.uuid4().hex, request.metric, 0.0, local_ranks)
            kept.state = SaveState.COMMITTED
            since = "it" if resumed_from == step else f"step {resumed_from}, committed before it (it redid that interval)"
            kept.kept = f"step {step} of job {job!r} is committed already and this run resumed from {since}: the committed step is kept, this save is not written again"
            kept.step_dir = self.engine.storage.catalog.step_location(job, step)
            log.info("%s", kept.kept)
            return kept
        state = self.engine.jobs.get(job)
        earlier = state.recent.get(step) if state is not None else None
        if request.run and earlier is not None and earlier.run == request.run:
            advice = (
                "this run saved it already (two saves of one step, such as a periodic and an end-of-epoch one?): "
                "save each step once, or the second under another step number"
            )
        elif resumed_from is not None and resumed_from in order:
            advice = (
                f"this run resumed from step {resumed_from}, committed after step {step}: step {step} belongs to the timeline it "
                "rolled back from. Save under step numbers not on disk (`ckptd ls` lists them), or give the new timeline a new job name"
            )
        else:
            advice = (
                "this run loaded no step of the job before saving (a new run under a used job name?): give it a new job name, "
                "or load the job's newest step first (load() without a step) to resume it; its saves after that step are kept"
            )
        raise AlreadyExists(f"step {step} of job {job!r} is already committed and ckptd never overwrites a step: {advice}")

    def _local_ranks(self, world_size: int, local_world_size: int) -> int:
        cluster = self.engine.cluster
        if cluster is None:
            if local_world_size not in (0, world_size):
                raise InvalidRequest(
                    f"this daemon runs as a single node (no --peers) but the job has {world_size} ranks and this node "
                    f"{local_world_size} (LOCAL_WORLD_SIZE); start every node's daemon with --node-rank and --peers"
                )
            return world_size
        if not 1 <= local_world_size <= world_size:
            raise InvalidRequest(
                f"this daemon is node {self.engine.node} of {cluster.nodes}: it needs the number of the job's ranks on "
                "this node; set LOCAL_WORLD_SIZE (torchrun does) or pass local_world_size= to CheckpointClient"
            )
        return local_world_size

    async def abort_left_behind(self, state: JobState, rank: int, step: int | None, run: str = "") -> None:
        """A rank (of `run`) that starts another save or a load will never finish an older open one."""
        for other in state.left_behind(rank, step, run):
            await self.engine.fail(state, other, f"rank {rank} moved on (it restarted or gave up on step {other.step})", "rank_restarted")

    async def _prepare(self, state: JobState, session: SaveSession) -> None:
        engine = self.engine
        try:
            plan, plan_key = await self._join(state, session)
            session.plan_with(plan)
            arenas = await self._acquire(state, session, plan)
            state.cache.keep(plan_key, plan)  # kept once the save got past its refusals (a refused save's plan is not)
            if arenas is not None:
                if session.start_snapshot(arenas):
                    engine.spawn(self._prewarm(state, plan))
                else:  # failed (timed out) while waiting for the arenas
                    state.pool.release(arenas)
                    engine.memory.settle(state)
        except (PlanError, Exhausted, InvalidRequest, Aborted, Unavailable, Precondition) as exc:  # RunRefused is a Precondition
            session.refused = isinstance(exc, (PlanError, InvalidRequest))
            session.run_refused = isinstance(exc, RunRefused)
            cause = "invalid" if session.refused else "no_arena" if isinstance(exc, Exhausted) else "run_refused" if session.run_refused else "peer"
            await engine.fail(state, session, str(exc), cause)
        except Exception as exc:
            log.exception("planning step %s of job %s failed", session.step, session.job)
            await engine.fail(state, session, f"internal error while planning: {exc}", "internal")
        finally:
            session.ready.set()

    async def _join(self, state: JobState, session: SaveSession) -> tuple[SavePlan, str]:
        """Join the save at the coordinator (node 0's, or in process on a single node); plan
        from what it sends back (the coordinator's plan itself when it is in this process).
        Returns the plan and its key (plan_input.plan_key)."""
        coordination = self.engine.coordination
        digests = dict(session.arrived)

        async def join(resend: bool) -> JoinResult:
            specs = {r: state.specs[(r, d)] for r, d in digests.items() if resend or (r, d) not in state.announced}
            return await coordination.join_save(JoinSave(
                session.job, session.step, session.world_size, digests, specs, tuple(state.plans),
                session.timeout_s, session.metric, session.options, lineage, RunClaim(session.run, session.resumed),
            ))

        lineage = max(session.lineage, state.lineage)

        try:
            result = await join(resend=False)
        except UnknownFingerprint:  # the coordinator restarted and forgot the metadata
            result = await join(resend=True)
        state.announced.update(digests.items())
        self.engine.runs.accepted(session.job, session.run)
        plan = result.plan or state.cache.plan(result.plan_key)
        if plan is None:
            if result.specs is None:
                raise Aborted(f"the coordinator assumed this node knows plan {result.plan_key[:12]}; retry the save")
            plan = await asyncio.to_thread(make_save_plan, result.specs, result.node_of_rank)
        session.global_id = result.save_id
        session.shared_root = result.shared_root
        # node 0's decision, which every node obeys (an older coordinator sends none: decide here)
        session.compression = result.compression or self.engine.compression(session.options, lineage)
        return plan, result.plan_key

    async def _acquire(self, state: JobState, session: SaveSession, plan: SavePlan) -> ArenaSet | None:
        """An arena set for the snapshot (engine/memory.py: the budget, other jobs' idle
        memory); None when the save was skipped (policy "skip")."""
        engine = self.engine
        deadline = session.created + session.timeout_s
        sizes = plan.arena_bytes_of(engine.node)
        waiter = (session.job, session.save_id)  # its turn among the saves waiting for room (ArenaMemory.acquire)
        try:
            while True:
                async with state.acquire_lock:
                    arenas = await engine.memory.acquire(state, sizes, waiter=waiter)
                if arenas is not None:
                    return arenas
                session.memory_short = engine.memory.shortage(state.pool, sizes, waiter=waiter)
                if engine.config.arena_policy == "skip":
                    engine.skip(state, session, session.memory_short)
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Exhausted(f"no arena set for step {session.step} within {session.timeout_s:.0f} s: {session.memory_short}")
                async with state.arena_freed:
                    try:
                        await asyncio.wait_for(state.arena_freed.wait(), remaining)
                    except asyncio.TimeoutError:
                        pass  # the deadline: checked at the top
        finally:
            engine.memory.stop_waiting(waiter)  # its turn goes to the next save waiting, whatever ended the wait

    async def _prewarm(self, state: JobState, plan: SavePlan) -> None:
        """With hold_while_saving: allocate the next arena set in the background while this
        snapshot is copied and written, when the budget has room (engine/memory.py)."""
        try:
            async with state.acquire_lock:
                await self.engine.memory.prewarm(state, plan.arena_bytes_of(self.engine.node))
        except Exhausted as exc:
            log.warning("could not prepare a second arena set for job %s (saves will wait for the first): %s", state.pool.job, exc)

    async def hand_over(self, request: CommitSnapshot) -> None:
        """The rank's part of the snapshot is complete. A rank in mode "ipc" hands its part over
        staged (`request.staged`): copied from its staging buffer into its arena first; if that
        fails the save fails (nothing of it is persisted); see handoff/transports.py."""
        job, rank, staged = request.job, request.rank, request.staged
        engine = self.engine
        state, session = self.find(job, request.save_id)
        session.check_hand_over(rank)
        extras = engine.extras_texts.parse((job, session.step, rank), request.extras_json, lambda text: parse_extras(rank, text))
        if staged is not None:
            assert session.arenas is not None
            arena = session.arenas.arenas[rank] if rank < len(session.arenas.arenas) else None
            transport = engine.transports.get(staged.transport)
            if transport is None:
                raise InvalidRequest(f"rank {rank} handed over through transport {staged.transport!r}, which this daemon does not have")
            try:
                await transport.drain(job, rank, staged.staging_id, arena, staged.ranges)
            except Aborted as exc:
                await engine.fail(state, session, str(exc), "gpu_staging")
                raise
            if session.state is not SaveState.SNAPSHOTTING:  # failed or timed out while copying
                raise Aborted(f"save of step {session.step} is {session.state}: {session.error}")
        if request.stall_s > 0:
            engine.metrics.stall.labels(job).observe(request.stall_s)
        if session.hand_over(rank, extras, request.model_files):
            engine.spawn(self._write(state, session))

    async def abort(self, job: str, rank: int, save_id: str, reason: str) -> None:
        state, session = self.find(job, save_id)
        if session.open:
            # the reason is the rank's own text: kept to a size a message (and the log) can carry
            await self.engine.fail(state, session, f"rank {rank} aborted: {bounded(reason, 1024) or 'no reason given'}", "rank_aborted")

    def find(self, job: str, save_id: str) -> tuple[JobState, SaveSession]:
        state = self.engine.jobs.get(job)
        session = state.find(save_id) if state is not None else None
        if state is None or session is None:
            raise NotFound(f"no save {save_id!r} in job {job!r} (it finished, timed out or the daemon restarted)")
        return state, session

    async def _watchdog(self, state: JobState, session: SaveSession) -> None:
        try:
            await asyncio.wait_for(session.closed.wait(), session.timeout_s)
        except asyncio.TimeoutError:
            cluster = self.engine.cluster
            problem = cluster.coordinator_problem(session.timeout_s) if cluster is not None and session.joining else None
            if problem is not None:  # this node's ranks are here, node 0 is not: say so, not which ranks
                await self.engine.fail(state, session, problem, "peer")
            else:
                await self.engine.fail(state, session, session.timeout_reason(), "timeout")

    async def progress(self, job: str, step: int, timeout_s: float) -> AsyncIterator[SaveSession | str]:
        """Yield the session at each change until it is finished; a str "committed" for a step
        committed earlier (e.g. before this daemon started)."""
        state = self.engine.jobs.get(job)
        session = None
        if state is not None:
            session = state.sessions.get(step) or state.recent.get(step)
        if session is None:
            if await self.engine.committed(job, step):
                yield "committed"
                return
            raise NotFound(f"job {job!r} has no save of step {step} in flight and no such committed step")
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        while True:
            # whether it was finished when yielded: a save that finishes while the consumer holds
            # the yield (a save refused at once) is yielded once more, with its outcome
            finished = session.finished.is_set()
            yield session
            if finished:
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise Timeout(f"step {step} of job {job!r} is not durable after {timeout_s} s (state {session.state})")
            try:
                await asyncio.wait_for(session.finished.wait(), min(0.5, remaining) if remaining is not None else 0.5)
            except asyncio.TimeoutError:
                pass  # not finished yet: yield the session's state again


def parse_extras(rank: int, extras_json: str) -> Any:
    """A rank's extras (JSON text, checked against the size and depth limits)."""
    if len(extras_json) > MAX_EXTRAS_BYTES:
        raise InvalidRequest(f"extras of rank {rank} are {len(extras_json)} bytes; the limit is {MAX_EXTRAS_BYTES}")
    try:
        extras = json.loads(extras_json) if extras_json else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"extras of rank {rank} are not valid JSON: {exc}") from None
    except RecursionError:  # nested deeper than the parser goes: far past the limit
        too_deep = True
    else:
        too_deep = json_depth(extras) > MAX_EXTRAS_JSON_DEPTH
    if too_deep:
        raise InvalidRequest(
            f"extras of rank {rank} nest deeper than {MAX_EXTRAS_JSON_DEPTH} JSON levels, the limit (a client "
            f"refuses values nested more than {MAX_EXTRAS_DEPTH} containers deep before sending); flatten them"
        )
    return extras
