"""Housekeeping: retention after each commit and at start-up, `ckptd gc`, and what the daemon
reports about itself (`ckptd status`, `ckptd ls`, the metrics' gauges)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.sessions import SaveState
from ckptd.daemon.engine.tiers import Listing, Tiers
from ckptd.daemon.errors import Precondition
from ckptd.daemon.metrics import LiveState
from ckptd.daemon.plan.files import VERSION
from ckptd.daemon.plan.retention import RetentionPolicy, policy_of_record
from ckptd.daemon.records import InFlightSave, StatusSnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Collected:
    """One thing `collect` removed (or would remove, dry run)."""

    job: str
    step: int  # -1: not a step directory
    path: str
    reason: str  # "retention" | "uncommitted" | "temporary" | "memory" (an idle arena set given back)
    bytes: int


class Housekeeping:
    """Retention, garbage collection and the daemon's reports."""

    def __init__(self, engine: Engine, leased_steps: Callable[[str], set[int]], loads_active: Callable[[], int], tiers: Tiers) -> None:
        self.engine = engine
        self._tiers = tiers  # what they keep from retention, add to listings and report
        self._leased_steps = leased_steps  # Loads.leased_steps: steps being read are kept
        self._loads_active = loads_active
        self._retention_locks: dict[str, asyncio.Lock] = {}  # job -> held while its retention runs

    async def retention_at_start(self) -> None:
        """Apply retention to every job once at start-up, on a single node and on node 0 (the
        node that applies it to a shared root): a daemon that died after a commit but before
        that commit's retention ran would otherwise list, until the next commit, a step that
        other nodes have already deleted (and so no longer loads)."""
        if self.engine.cluster is not None and self.engine.node != 0:
            return
        for job in await asyncio.to_thread(self.engine.storage.catalog.jobs):
            await self._retention_logged(job, None, "at start-up")

    async def member_retention_at_start(self) -> None:
        """retention_at_start for a member (node != 0) with a root of its own (node 0 applies it
        to a shared root): run in the background once serving, as it asks node 0 for its root's
        id; when node 0 does not answer, the next commit applies it."""
        cluster = self.engine.cluster
        assert cluster is not None and self.engine.node != 0
        for job in await asyncio.to_thread(self.engine.storage.catalog.jobs):
            answer = await cluster.inventory(0, job, 0)
            if isinstance(answer, str):
                log.info("retention at start-up left to the next commit: node 0 did not answer (%s)", answer)
                return
            if answer.root_id == cluster.root_id:
                return  # a root shared with node 0: its retention is node 0's
            await self._retention_logged(job, None, "at start-up")

    async def after_commit(self, job: str, step: int) -> None:
        """Retention after `step` of `job` was committed (that step is kept). Never raises: the
        step is committed whatever retention meets (a root it cannot list or order, a step it
        cannot remove), which is logged; the next commit, or the next start, applies it again."""
        await self._retention_logged(job, step, f"after the commit of step {step}")

    async def _retention_logged(self, job: str, committed: int | None, when: str) -> None:
        """apply_retention, its failure logged: a commit stands, and a daemon starts, whatever
        one job's retention meets; the daemon serves every other job."""
        try:
            await self.apply_retention(job, committed=committed)
        except Exception:  # retention runs again at the next commit
            log.exception("retention of job %s %s failed; nothing else is affected", job, when, extra={"job": job})

    async def apply_retention(self, job: str, dry_run: bool = False, committed: int | None = None) -> list[Collected]:
        """Delete the job's committed steps that the retention policy does not keep; returns them.

        The policy sees the steps in commit order (a rolled-back job's newest step may have a
        lower number than older ones). Never deleted: `committed` (the step whose commit runs
        this), the step `latest` names (written before this runs), steps being loaded. One run
        per job at a time: two commits' runs overlapping would remove the same step twice."""
        lock = self._retention_locks.get(job)
        if lock is None:
            lock = self._retention_locks[job] = asyncio.Lock()
        async with lock:  # (a commit's reply may so wait for a `ckptd gc` of its job: seconds at most)
            return await self._apply_retention(job, dry_run, committed)

    async def _apply_retention(self, job: str, dry_run: bool, committed: int | None) -> list[Collected]:
        engine = self.engine
        storage = engine.storage
        steps = await asyncio.to_thread(storage.catalog.commit_order, job)
        protected: set[int | None] = set(self._leased_steps(job))
        for tier in self._tiers:
            protected |= tier.protected(job)  # e.g. kept until uploaded to the object store
        protected.add(await asyncio.to_thread(storage.catalog.latest_named, job))
        protected.add(committed)
        protected.discard(None)
        policy = await self.policy(job, steps)
        metrics = await self._step_metrics(job, steps) if policy.keep_best else {}
        removed = []
        doomed = policy.to_delete(steps, {s for s in protected if s is not None}, metrics)
        loaded_elsewhere = await self._loaded_on_sharing_nodes(job, doomed) if doomed else set()
        for step in doomed:
            if step in loaded_elsewhere:
                log.info("retention keeps step %s of job %s for now: another node sharing this root is loading it", step, job)
                continue
            where = storage.catalog.step_location(job, step)
            size = await asyncio.to_thread(storage.catalog.step_bytes, job, step)
            if not dry_run:
                try:
                    await asyncio.to_thread(storage.janitor.remove_step, job, step, True)
                except OSError as exc:
                    log.error("retention could not remove step %s of job %s: %s", step, job, exc, extra={"job": job, "step": step})
                    continue
                engine.indexes.pop((job, step))
                engine.metrics.retention_deleted.labels(job).inc()
                log.info("retention removed step %s of job %s", step, job, extra={"job": job, "step": step})
            removed.append(Collected(job, step, where, "retention", size))
        return removed

    async def _loaded_on_sharing_nodes(self, job: str, steps: Sequence[int]) -> set[int]:
        """Of `steps`, those that another node sharing this root is loading (node 0 applies a
        shared root's retention for every node, and each node leases only its own loads): asked
        of every other node, a few RPCs per step about to go (node-local roots: none, each node
        keeps its own loads' steps). A node that does not answer loads nothing that counts: its
        loads fail with it."""
        cluster = self.engine.cluster
        state = self.engine.jobs.get(job)
        last = state.last_committed() if state is not None else None
        if cluster is None or self.engine.node != 0 or last is None or not last.shared_root:
            return set()
        others = [n for n in range(cluster.nodes) if n != self.engine.node]
        loading = set()
        for step in steps:
            answers = await asyncio.gather(*(cluster.inventory(n, job, step) for n in others))
            if any(not isinstance(a, str) and a.loading and a.root_id == cluster.root_id for a in answers):
                loading.add(step)
        return loading

    async def policy(self, job: str, steps: Sequence[int]) -> RetentionPolicy:
        """The retention policy of `job`: the one its newest committed step's index records (the
        job asked for its own, node 0 merged it into its flags: every node follows the same), else
        this daemon's flags. `steps`: the job's committed steps in commit order."""
        if not steps:
            return self.engine.retention
        try:
            record = (await self.engine.index(job, steps[-1])).retention
        except (Precondition, OSError) as exc:
            log.warning("retention: cannot read the index of step %s of job %s (%s), so the daemon's flags apply", steps[-1], job, exc)
            return self.engine.retention
        if record is None:
            return self.engine.retention
        try:
            return policy_of_record(record)
        except (TypeError, ValueError) as exc:
            log.warning("retention: step %s of job %s records a retention the daemon cannot use (%s), so its flags apply", steps[-1], job, exc)
            return self.engine.retention

    async def _step_metrics(self, job: str, steps: Sequence[int]) -> dict[int, float]:
        """step -> the metric it was saved with, for the steps that have one (keep-best retention)."""
        out = {}
        for step in steps:
            try:
                summary = await self.engine.summary(job, step)
            except (Precondition, OSError) as exc:
                log.warning("retention: cannot read the metric of step %s of job %s: %s", step, job, exc)
                continue
            if summary.metric is not None:
                out[step] = summary.metric
        return out

    async def collect(self, job: str | None, dry_run: bool) -> list[Collected]:
        """`ckptd gc`: apply retention now, remove uncommitted leftovers and give back the shared
        memory of idle arena sets (held snapshots: those steps then restore from disk), for one
        job or all.

        Never touches a step this daemon is saving, nor arenas in flight or being read; with
        several nodes, step directories changed within the last save timeout are left alone too
        (another node may be writing them)."""
        engine = self.engine
        released = await engine.memory.collect(job, dry_run)
        jobs = [job] if job else await asyncio.to_thread(engine.storage.catalog.jobs)
        removed: list[Collected] = []
        min_age = engine.config.save_timeout_s if engine.cluster is not None else 0.0
        for name in jobs:
            state = engine.jobs.get(name)
            busy = set(state.sessions) if state is not None else set()
            leftovers = await asyncio.to_thread(engine.storage.janitor.leftovers, name, busy, min_age, dry_run)
            removed += [Collected(name, left.step, left.where, left.reason, left.nbytes) for left in leftovers]
            if self._applies_retention(name):
                removed += await self.apply_retention(name, dry_run)
        return removed + [Collected(name, step, files, "memory", nbytes) for name, step, files, nbytes in released]

    def _applies_retention(self, job: str) -> bool:
        """Whether this daemon applies the job's retention: a single node, node 0 (the coordinator;
        in a shared root it does so for every node), or a node with its own root (as after commits)."""
        engine = self.engine
        if engine.cluster is None or engine.node == 0:
            return True
        state = engine.jobs.get(job)
        last = state.last_committed() if state is not None else None
        return last is not None and not last.shared_root

    async def list_checkpoints(self, job: str) -> Listing:
        """The job's committed steps in commit order, oldest first: the last is the newest (what
        load() without a step restores), whatever its number."""
        engine = self.engine
        steps = await asyncio.to_thread(engine.storage.catalog.commit_order, job)
        out = []
        for step in steps:
            try:
                summary = await engine.summary(job, step)
            except Precondition as exc:
                log.warning("%s", exc)
                continue
            in_memory = any(tier.snapshot(job, step) is not None for tier in self._tiers)
            out.append((summary, engine.storage.catalog.step_location(job, step), in_memory))
        for tier in self._tiers:  # and the steps the tiers hold that are not here (the bucket's)
            out = await tier.listing(job, out)
        return out

    def live_state(self) -> LiveState:
        """The gauges of the metrics endpoint (read on the event loop)."""
        jobs = self.engine.jobs
        holders = self.engine.memory.holders()
        state = LiveState(
            queue_depth={job: len(state.writing()) for job, state in jobs.items()},
            open_saves={job: sum(1 for s in state.sessions.values() if s.open) for job, state in jobs.items()},
            arena_bytes=sum(s.pool.nbytes for s in jobs.values()),
            arenas=sum(s.pool.count for s in jobs.values()),
            loads_active=self._loads_active(),
            draining=self.engine.draining,
            job_arena_bytes={h.job: h.bytes for h in holders},
            job_idle_s={h.job: h.idle_s for h in holders},
            shm_budget=self.engine.memory.budget or 0,
            staging_bytes=self.engine.memory.staging_bytes(),
        )
        for tier in self._tiers:
            state = tier.live(state)
        return state

    def status(self, job: str | None = None) -> StatusSnapshot:
        """`ckptd status`: saves in flight, arenas, counters, the newest commit, the tiers';
        of `job` alone when given (StatusSnapshot.of_job: its newest commit and last failure)."""
        engine = self.engine
        now = time.monotonic()
        in_flight = tuple(
            InFlightSave(
                job=job,
                step=session.step,
                state=session.state,
                bytes_total=session.bytes_total,
                bytes_written=session.progress.written if session.progress else 0,
                bytes_linked=session.progress.linked if session.progress else 0,
                age_s=now - session.created,
                ranks_arrived=len(session.committed) if session.state is SaveState.SNAPSHOTTING else len(session.arrived),
                ranks_expected=session.local_ranks,
                write_s=now - session.write_started if session.write_started else 0.0,
            )
            for job, state in engine.jobs.items()
            for session in state.sessions.values()
        )
        counters = engine.counters
        status = StatusSnapshot(
            version=VERSION,
            root=engine.storage.location,
            in_flight=in_flight,
            arena_bytes=sum(s.pool.nbytes for s in engine.jobs.values()),
            arena_count=sum(s.pool.count for s in engine.jobs.values()),
            committed_total=counters.committed,
            failed_total=counters.failed,
            skipped_total=counters.skipped,
            last_error=counters.last_error,
            draining=engine.draining,
            queue_depth=engine.writing_count(),
            last_commit=engine.last_commit,
            node_rank=engine.node,
            nodes=engine.cluster.nodes if engine.cluster is not None else 1,
            bytes_written_total=counters.bytes_written,
            link_mismatches_total=counters.link_mismatches,
            uptime_s=time.time() - engine.started_at,
            loads_active=self._loads_active(),
            arena_holders=tuple(engine.memory.holders()),
            shm_budget=engine.memory.budget or 0,
            shm_free=engine.memory.free(),
            shm_staging=engine.memory.staging_bytes(),
        )
        for tier in self._tiers:
            status = replace(status, **tier.status_fields(job))  # remote, replicas: None without the tier
        if job is None:
            return status
        state = engine.jobs.get(job)
        return status.of_job(job, state.last_commit if state is not None else None, state.last_error if state is not None else "")
