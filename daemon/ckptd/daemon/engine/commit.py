"""The commit: each node writes its data files of a complete snapshot and reports them to the
coordinator, which writes the step's index last (the commit) once every node has, or aborts the
step everywhere. One protocol for one node and for many: a single node's coordinator runs in
this process (cluster.SingleNode), node 0's serves the others over the peer port.

A node with a root of its own (not node 0) marks its part prepared before reporting, so that
after a restart it asks node 0 whether the step was committed (`resolve_prepared`) and then
records node 0's commit or removes its part.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar

from ckptd.daemon.engine.context import Engine
from ckptd.daemon.heap import after_commit
from ckptd.daemon.engine.requests import ReportManifest
from ckptd.daemon.engine.sessions import JobState, SaveSession
from ckptd.daemon.engine.tiers import Committed, Tiers
from ckptd.daemon.errors import CkptdError, NoSpace
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FormatError, check_small_file
from ckptd.daemon.plan.files import NodeManifest
from ckptd.daemon.plan.node_files import NodeFilePlans
from ckptd.daemon.records import LastCommit
from ckptd.daemon.storage.step_commit import StepCommit
from ckptd.daemon.thread_priority import BackgroundPriority
from ckptd.daemon.write.request import PersistRequest
from ckptd.daemon.write.writer import write_node_files

log = logging.getLogger(__name__)
T = TypeVar("T")

RECORD_RETRY_S = 2.0  # a node that could not record node 0's commit (its disk full) tries again this often
HEAP_SETTLE_DELAY_S = 0.05  # after a commit, before the heap's housekeeping: WaitDurable's answers go out first


async def _settle_heap() -> None:
    """heap.after_commit (a full collection when due: ~30 ms holding the GIL at 4,000 tensors),
    once the commit's answers are sent: not on the path to durable."""
    await asyncio.sleep(HEAP_SETTLE_DELAY_S)
    await asyncio.to_thread(after_commit)


Retention = Callable[[str, int], Awaitable[object]]  # (job, the step just committed) -> apply retention


class Commit:
    """Writes complete snapshots and commits them (one writer thread: saves are written in order)."""

    def __init__(self, engine: Engine, retention: Retention, executor: "ThreadPool", tiers: Tiers) -> None:
        self.engine = engine
        self._retention = retention
        self._executor = executor
        self._tiers = tiers  # told of each commit recorded here (Tier.after_commit): replicas pushed, uploads queued
        self._resolving = asyncio.Lock()  # resolve_prepared: one step at a time
        self._file_plans = NodeFilePlans()  # each job's files, planned again only when its save plan changes

    async def _previous(self, state: JobState, session: SaveSession) -> CheckpointIndex | None:
        """The job's newest committed step, whose unchanged files of frozen tensors the writer
        links (write/reuse.py); None when the plan has no frozen tensor, linking is off, or there is
        no readable previous step (then every file is written)."""
        assert session.plan is not None
        engine = self.engine
        if not engine.config.link_unchanged or not any(t.frozen for t in session.plan.tensors):
            return None
        last = state.last_committed()
        step = last.step if last is not None else await asyncio.to_thread(engine.storage.catalog.latest_step, session.job)
        if step is None or step == session.step:
            return None
        try:
            return await engine.index(session.job, step)
        except (CkptdError, FormatError, OSError) as exc:
            log.warning("step %s of job %s is written whole: the previous step %s cannot be read (%s)", session.step, session.job, step, exc)
            return None

    def _request(self, session: SaveSession, previous: CheckpointIndex | None = None) -> PersistRequest:
        """What the writer writes for `session`: this node's data files (the coordinator commits
        the index, the extras and the model files)."""
        assert session.plan is not None and session.arenas is not None
        config = self.engine.config
        compression = session.compression  # decided when the save was planned (Saves)
        assert compression is not None
        return PersistRequest(
            job=session.job,
            step=session.step,
            plan=session.plan,
            arenas=session.arenas,
            extras={},  # the coordinator commits the extras and model files (report)
            model_files={},
            metric=session.metric,
            max_file_bytes=config.max_file_bytes,
            write_threads=config.write_threads,
            throttle_bytes_per_s=config.write_throttle,
            node=self.engine.node,
            shared_dir=session.shared_root,
            quantize=compression.quantize,
            master_weights=compression.master_weights,
            quantization=compression.record,
            disk_reserve=config.disk_reserve,
            previous=previous,
            file_plans=self._file_plans,
        )

    def _committed_here(self, state: JobState, session: SaveSession, index: CheckpointIndex) -> None:
        """Record the commit: the save's outcome, the held snapshot (for restores), metrics."""
        assert session.arenas is not None and session.plan is not None
        engine = self.engine
        engine.indexes.put((session.job, session.step), index)
        session.commit(engine.storage.catalog.step_location(session.job, session.step))
        engine.counters.committed += 1
        state.pool.hold(session.arenas, session.step, session.plan, dict(session.committed))
        latency = time.monotonic() - session.snapshot_done
        engine.last_commit = state.last_commit = LastCommit(session.job, session.step, time.time(), latency, index.size_bytes, session.step_dir)
        engine.metrics.commits.labels(session.job).inc()
        engine.metrics.commit_latency.labels(session.job).observe(latency)
        engine.metrics.last_commit.labels(session.job).set(engine.last_commit.committed_at)
        engine.metrics.last_step.labels(session.job).set(session.step)
        self._after_commit(Committed(session.job, session.step, index, session.shared_root))

    def _after_commit(self, commit: Committed) -> None:
        for tier in self._tiers:
            tier.after_commit(commit)

    def _wrote(self, job: str, manifest: NodeManifest, seconds: float) -> tuple[int, int]:
        """Count the data bytes this node wrote for a step (metrics: bytes, throughput), the
        bytes it linked from the previous step instead (incremental saves), and the linked files
        it found damaged and wrote again; returns (written, linked) bytes of its files."""
        engine = self.engine
        linked = set(manifest.linked)
        mine = [f for f in manifest.files if f.node == engine.node and f.name.endswith(".safetensors")]
        nbytes = sum(f.size for f in mine if f.name not in linked)
        engine.counters.bytes_written += nbytes
        engine.counters.link_mismatches += len(manifest.rewritten)
        engine.metrics.bytes_written.labels(job).inc(nbytes)
        linked_bytes = sum(f.size for f in mine if f.name in linked)
        engine.metrics.bytes_linked.labels(job).inc(linked_bytes)
        if manifest.rewritten:
            engine.metrics.link_mismatches.labels(job).inc(len(manifest.rewritten))
        if seconds > 0:
            engine.metrics.throughput.labels(job).set(nbytes / seconds)
        return nbytes, linked_bytes

    async def write(self, state: JobState, session: SaveSession) -> None:
        """Write this node's files of the complete snapshot of `session`, report them to the
        coordinator, and commit or fail the save as it decides (a single node's coordinator is
        in this process: it commits at once). The save always ends: an unexpected error fails it
        (a save left "writing" would hold its arenas and keep a graceful stop waiting forever)."""
        try:
            await self._write(state, session)
        except Exception as exc:
            log.exception("step %s of job %s: writing or committing failed unexpectedly", session.step, session.job)
            await self.engine.fail(state, session, f"internal error while writing: {exc}", "internal")

    async def _write(self, state: JobState, session: SaveSession) -> None:
        assert session.plan is not None and session.arenas is not None and session.progress is not None
        engine = self.engine
        node, storage = engine.node, engine.storage
        request = self._request(session, await self._previous(state, session))
        manifest: NodeManifest | None = None
        error = ""
        cause = "write_error"
        started = time.monotonic()
        try:
            manifest = await self._executor.run(write_node_files, storage, request, session.progress)
            session.progress.settle(*self._wrote(session.job, manifest, time.monotonic() - started))
        except NoSpace as exc:  # refused before writing: the coordinator aborts the step on every node
            engine.metrics.refused_no_space.labels(session.job).inc()
            error, cause = str(exc), "no_space"
        except Exception as exc:
            log.exception("writing node %s's part of step %s of job %s failed", node, session.step, session.job)
            error = f"writing failed on node {node}: {exc}" if engine.cluster is not None else f"writing failed: {exc}"
        if manifest is not None and not session.shared_root and node != 0:
            try:  # kept at a restart until node 0 says whether the step was committed
                await asyncio.to_thread(storage.janitor.mark_prepared, session.job, session.step, session.global_id, node)
            except OSError as exc:
                manifest, error = None, f"node {node} could not mark its part written: {exc}"
        written = time.monotonic()
        session.reported = True
        outcome = await engine.coordination.report(
            ReportManifest(session.job, session.step, session.global_id, manifest, error, dict(session.committed), session.model_files)
        )
        if outcome.committed:
            try:
                if outcome.step_files and node != 0:  # node-local root: the same index here
                    await asyncio.to_thread(self._write_commit_here, session.job, session.step, outcome.step_files)
                index = outcome.index  # the coordinator's, when it is in this process
                if index is None:
                    index = await asyncio.to_thread(storage.files.read_index, session.job, session.step)
            except (OSError, FormatError) as exc:
                log.exception("step %s of job %s is committed but node %s could not record it", session.step, session.job, node)
                await engine.fail(
                    state, session, f"not on node {node}, whose root could not record node 0's commit ({exc}); node {node} keeps its "
                    "part and records the commit as soon as it can (free the space or fix the root)", "write_error",
                )
                if node != 0 and not session.shared_root:  # its part stays prepared: node 0's commit is adopted when it can be
                    engine.spawn(self.resolve_prepared(retry_s=RECORD_RETRY_S))
                return
            self._committed_here(state, session, index)
            if node != 0 and outcome.step_files:
                await self._retention(session.job, session.step)  # node 0 applies it for a shared root (Coordinator.on_commit)
            linked = sum(f.size for f in manifest.files if f.name in manifest.linked) if manifest is not None else 0
            log.info(
                "committed step %s of job %s: %.1f MiB written (%.1f MiB more linked, unchanged) in %.2f s, committed %.3f s later, %.2f s after the snapshot",
                session.step, session.job, (session.plan.total_bytes - linked) / 2**20, linked / 2**20, written - started,
                time.monotonic() - written, time.monotonic() - session.snapshot_done,
                extra={"job": session.job, "step": session.step},
            )
            state.finish(session)
            engine.memory.settle(state)
            engine.spawn(_settle_heap())
            return
        if not outcome.decided and manifest is not None and not session.shared_root and node != 0:
            # Node 0 went away before it answered: it may have committed the step (its index is
            # written before the answer). The part stays, marked prepared, until node 0 says.
            await engine.fail(state, session, f"{outcome.error}; node {node} keeps its part until node 0 says whether it committed the step", "peer")
            engine.spawn(self.resolve_prepared(retry_s=1.0))
            return
        # Node 0 too: the coordinator removed the step from its root when it aborted, but node 0's
        # own writer may have started after that (another node refused the step at once: NoSpace).
        names = [f.name for f in manifest.files] if manifest is not None else []
        try:
            await asyncio.to_thread(storage.janitor.discard_part, session.job, session.step, names, session.shared_root)
        except OSError as exc:  # left for start-up recovery or `ckptd gc`; the save fails either way
            log.warning("could not remove node %s's part of the aborted step %s of job %s: %s", node, session.step, session.job, exc)
        # the coordinator's reason (the node that failed first, for every node); a single node's own
        reason = error if error and engine.cluster is None else outcome.error
        await engine.fail(state, session, reason, cause if error else "peer")

    def _write_commit_here(self, job: str, step: int, files: dict[str, bytes]) -> None:
        """Record node 0's commit in this node's own root (unmark_prepared also removes the
        temporaries of a daemon that died writing this commit before)."""
        storage = self.engine.storage
        StepCommit(storage.writing, storage.catalog, job, step).commit(files, latest="newest")  # by node 0's created_at
        storage.janitor.unmark_prepared(job, step)

    async def resolve_prepared(self, retry_s: float = 10.0) -> None:
        """Several nodes with their own roots: finish or discard the parts this node wrote before
        it restarted, or whose save node 0 never answered. Node 0 decides: a step it committed
        gets its index here too; a step it neither committed nor is still saving is removed.
        Runs until every part is resolved; the parts of saves in flight here are left to them.
        Several of these may run at once: one step is resolved by one of them at a time."""
        engine = self.engine
        assert engine.cluster is not None

        async def pending_now() -> list[tuple[str, int]]:
            return [(job, step) for job, step in await asyncio.to_thread(engine.storage.janitor.prepared_steps) if not engine.saving(job, step)]

        pending = await pending_now()
        while pending:
            unresolved = []
            for job, step in pending:
                async with self._resolving:
                    if (job, step) not in await pending_now():
                        continue  # resolved meanwhile, or saved again
                    if not await self._resolve_one(job, step):
                        unresolved.append((job, step))
            pending = unresolved
            if pending:
                await asyncio.sleep(retry_s)
                pending = [p for p in await pending_now() if p in pending]

    async def _resolve_one(self, job: str, step: int) -> bool:
        """Resolve one prepared part with node 0 (resolve_prepared); False: not yet."""
        engine = self.engine
        assert engine.cluster is not None
        answer = await engine.cluster.inventory(0, job, step)
        if isinstance(answer, str) or (answer.in_flight and not answer.committed):  # unreachable, or still deciding
            return False
        try:
            if answer.committed:
                await self._adopt_commit(job, step)
                await self._retention(job, step)  # as after a commit it heard of (_write_node)
            else:
                log.warning("removing node %s's part of step %s of job %s: node 0 did not commit it", engine.node, step, job)
                await asyncio.to_thread(engine.storage.janitor.remove_step, job, step)
        except (CkptdError, FormatError, OSError) as exc:
            log.warning("could not resolve step %s of job %s with node 0 yet: %s", step, job, exc)
            return False
        return True

    async def _adopt_commit(self, job: str, step: int) -> None:
        """Write the index (and the small files) that node 0 committed for a step whose data
        files this node wrote before it restarted, or before its root could record the commit."""
        cluster = self.engine.cluster
        assert cluster is not None
        data = await cluster.fetch_bytes(0, job, step, INDEX_NAME)
        index = CheckpointIndex.of_step(data, job, step, f"node 0's {INDEX_NAME}")
        files = {}
        for record in index.files:
            if not record.name.endswith(".safetensors"):
                files[record.name] = await cluster.fetch_bytes(0, job, step, record.name)
                check_small_file(record, files[record.name])  # FormatError: not written, resolved later
        files[INDEX_NAME] = data
        await asyncio.to_thread(self._write_commit_here, job, step, files)
        self._after_commit(Committed(job, step, index, False, adopted=True))  # a node-local root's part, committed by node 0 before this restart
        log.info("step %s of job %s: node 0 had committed it; node %s recorded the commit now (after a restart, or once its root could)", step, job, self.engine.node)


class ThreadPool:
    """The writer's thread: one, so a job's snapshots are written in the order they completed.

    priority: what it runs at (`--background-nice` and friends); the writer's own pool threads,
    created from it, inherit it."""

    def __init__(self, priority: BackgroundPriority | None = None) -> None:
        initializer = priority.initializer() if priority is not None else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-persist", initializer=initializer)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
