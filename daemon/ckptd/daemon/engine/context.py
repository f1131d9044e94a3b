"""What the engine's parts share: settings, storage, metrics, the cluster, the jobs, and how a
save's outcome is recorded.

The parts (saves.py, commit.py, loads.py, housekeeping.py) each take an `Engine`; none calls
another's private methods. Runs on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.engine.memory import ArenaMemory
from ckptd.daemon.engine.peers import Coordination, Peers
from ckptd.daemon.engine.requests import ReportManifest
from ckptd.daemon.engine.runs import Runs
from ckptd.daemon.engine.sessions import JobState, SaveSession, SaveState
from ckptd.daemon.engine.single_flight import SingleFlight
from ckptd.daemon.errors import Precondition
from ckptd.format.index import CheckpointIndex, FormatError
from ckptd.daemon.handoff.arena import ArenaPool
from ckptd.daemon.handoff.transports import DaemonTransport, daemon_transports
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.plan.compression import Compression, SaveOptions, decide_compression
from ckptd.daemon.plan.retention import RetentionPolicy
from ckptd.daemon.records import LastCommit, StepSummary
from ckptd.daemon.storage import StorageBackend

log = logging.getLogger(__name__)

INDEX_CACHE_ENTRIES = 16  # parsed indexes kept: the steps loaded or committed last
INDEX_CACHE_TENSORS = 1024  # and at most this many tensor records in all (about 1.3 KiB each)
SUMMARIES_KEPT = 16384  # StepSummary of the steps whose index was read or committed (five numbers each)


class IndexCache:
    """The parsed indexes of the committed steps used most recently, by (job, step): at most
    `entries` of them and `tensors` tensor records in all; the newest is kept whatever its size.

    Bounded: a job that keeps every 50th step for months has thousands of committed steps, and
    an index of every one of them in memory grew the daemon by about 190 KiB per step (200
    tensors) in the soak benchmark (tests/bench/soak.py); 16 indexes of a 1,000-tensor job took
    20 MiB, 8% of its 256 MiB state (issue 30 finding 5). An index not cached is read again.

    An index being read is read once however many ask for it at once from the same source
    (`read`): the local ranks of a restarted daemon all plan their loads together, and parsing a
    1,000-tensor index costs ~50 ms of the event loop each time. Readers of another source do not
    join that read: a member's loads read node 0's index from a peer while its own root, which
    has not recorded the commit yet, fails to have it (a peer's Fetch of its prepared part asks).

    The summary of every index read or put is kept longer (`summary`, at most SUMMARIES_KEPT):
    a listing reads each committed step's, and at 4,000 tensors parsing each index again for
    every List took ~100 ms a step (HF Trainer's integration lists at every save)."""

    def __init__(self, entries: int, tensors: int = INDEX_CACHE_TENSORS) -> None:
        self.entries = entries
        self.tensors = tensors
        self._items: OrderedDict[tuple[str, int], CheckpointIndex] = OrderedDict()
        self._records = 0
        self._reading: SingleFlight[tuple[str, int, str], CheckpointIndex] = SingleFlight()
        self._summaries: OrderedDict[tuple[str, int], StepSummary] = OrderedDict()

    async def read(self, key: tuple[str, int], read: Callable[[], Coroutine[Any, Any, CheckpointIndex]], source: str = "root") -> CheckpointIndex:
        """The cached index of `key`, else the one `read()` returns (then cached), read once for
        all who ask meanwhile from the same `source` (SingleFlight): this root's, or "peers"."""
        index = self.get(key)
        if index is not None:
            return index
        return await self._reading.run((*key, source), read, lambda index: self.put(key, index))

    def get(self, key: tuple[str, int]) -> CheckpointIndex | None:
        index = self._items.get(key)
        if index is not None:
            self._items.move_to_end(key)
        return index

    def summary(self, key: tuple[str, int]) -> StepSummary | None:
        """The summary of the index of `key` read or put last (None: none since it was popped)."""
        found = self._summaries.get(key)
        if found is not None:
            self._summaries.move_to_end(key)
        return found

    def put(self, key: tuple[str, int], index: CheckpointIndex) -> None:
        self.pop(key)
        self._summaries[key] = StepSummary.of(index)
        while len(self._summaries) > SUMMARIES_KEPT:
            self._summaries.popitem(last=False)
        self._items[key] = index
        self._records += len(index.tensors)
        while len(self._items) > 1 and (len(self._items) > self.entries or self._records > self.tensors):
            _, old = self._items.popitem(last=False)
            self._records -= len(old.tensors)

    def pop(self, key: tuple[str, int]) -> CheckpointIndex | None:
        self._summaries.pop(key, None)
        index = self._items.pop(key, None)
        if index is not None:
            self._records -= len(index.tensors)
        return index


class ExtrasTexts:
    """Ranks' extras and the JSON text they travel as, both ways; extras are never changed in place.

    A load sends the text of the extras, kept per (job, step, rank) while the extras are the
    very same object (`text`): a held snapshot's were parsed at its save from the text the rank
    sent (`parse` remembers it), so the first load of a step encodes nothing either. Encoding a
    rank's extras on a load cost 4-7 ms of the event loop at 4,000 tensors.

    A save hands them over as text (`parse`): a rank that sends the same text as at its last
    hand-over (nearly every save: a state's extras are its structure with a placeholder per
    tensor, ~300 KB at 4,000 tensors) gets that hand-over's object back without a parse (2.5 ms
    of the event loop a save at 4,000 tensors), and node 0's commit finds their extra.json text
    by that object (plan/files.CompactExtras). Those last texts are kept up to `max_bytes`, the
    least recently handed over (job, rank) forgotten first."""

    def __init__(self, size: int = 64, max_bytes: int = 16 * 2**20) -> None:
        self._size = size
        self._texts: dict[tuple[str, int, int], tuple[Any, str]] = {}
        self.max_bytes = max_bytes
        self._handed: dict[tuple[str, int], tuple[str, Any]] = {}  # (job, rank) -> (text, extras) of its last hand-over
        self._handed_bytes = 0

    def parse(self, key: tuple[str, int, int], text: str, parse: Callable[[str], Any]) -> Any:
        """The extras of the hand-over `text` of rank key[2] for step key[1]: the object of the
        rank's last hand-over when it sent this same text, else parse(text) (which raises on bad
        text); remembered for `key` ("" is not: no extras)."""
        job, _, rank = key
        last = self._handed.pop((job, rank), None)
        if last is not None:
            self._handed_bytes -= len(last[0])
        if last is None or last[0] != text:
            last = (text, parse(text))
        if len(text) <= self.max_bytes:
            self._handed[job, rank] = last
            self._handed_bytes += len(text)
        while self._handed_bytes > self.max_bytes:
            self._handed_bytes -= len(self._handed.pop(next(iter(self._handed)))[0])
        if text:
            self.remember(key, last[1], last[0])
        return last[1]

    def remember(self, key: tuple[str, int, int], extras: Any, text: str) -> None:
        """`text` is the JSON text `extras` was parsed from (json.loads(text) gave `extras`)."""
        self._texts.pop(key, None)
        self._texts[key] = (extras, text)
        while len(self._texts) > self._size:
            del self._texts[next(iter(self._texts))]

    def text(self, key: tuple[str, int, int], extras: Any) -> str:
        """`extras` as JSON text (json.dumps), encoded once while `key` names the same object."""
        known = self._texts.get(key)
        if known is not None and known[0] is extras:
            return known[1]
        text = json.dumps(extras)
        self.remember(key, extras, text)
        return text


@dataclass
class Counters:
    committed: int = 0
    failed: int = 0
    skipped: int = 0
    last_error: str = ""
    bytes_written: int = 0
    link_mismatches: int = 0  # files of the previous step that an incremental save found damaged and wrote again


class Engine:
    """The state the engine's parts share, and the outcomes every part records the same way.

    cluster: the other nodes (None: a single node); coordination: where saves are committed
    (the cluster, or an in-process coordinator of one node); runs: the runs attached here and the
    jobs' owners (engine/runs.py), shared with the coordinator."""

    def __init__(
        self, config: DaemonConfig, storage: StorageBackend, cluster: Peers | None, coordination: Coordination, runs: Runs | None = None
    ) -> None:
        self.config = config
        self.runs = runs if runs is not None else Runs()
        self.storage = storage
        self.cluster = cluster
        self.coordination = coordination
        self.node = config.node_rank
        self.retention: RetentionPolicy = config.retention_policy()
        self.metrics = Metrics(config.node_rank)
        self.transports: dict[str, DaemonTransport] = daemon_transports()  # the daemon's side of hand-offs (handoff/transports.py)
        self.jobs: dict[str, JobState] = {}
        self.memory = ArenaMemory(lambda: self.config, self.jobs, self.metrics, self.spawn)  # the arenas of all jobs, one budget
        self.counters = Counters()
        self.indexes = IndexCache(INDEX_CACHE_ENTRIES)
        self.extras_texts = ExtrasTexts()  # the JSON texts of held snapshots' extras, for loads
        self.last_commit: LastCommit | None = None
        self.started_at = time.time()
        self.draining = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` in the background, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def job(self, job: str, world_size: int) -> JobState:
        """The job's state, made at its first save (see JobState.resize for a new world size)."""
        state = self.jobs.get(job)
        if state is None:
            state = JobState(world_size=world_size, pool=ArenaPool(self.config.shm_dir, job, self.config.max_inflight))
            self.jobs[job] = state
        else:
            state.resize(world_size, job)
        return state

    def compression(self, options: SaveOptions, lineage: int) -> Compression:
        """A save's compression under this daemon's current settings (plan/compression.py)."""
        config = self.config
        decided = decide_compression(options, lineage, config.quantize, config.master_weights, config.quant_max_generations)
        if decided.capped:
            log.info(
                "a save is stored losslessly: its values come from a checkpoint %s lossy cycle(s) deep (limit quant_max_generations=%s)",
                lineage, config.quant_max_generations,
            )
        return decided

    async def committed(self, job: str, step: int) -> bool:
        return await asyncio.to_thread(self.storage.catalog.is_committed, job, step)

    async def index(self, job: str, step: int) -> CheckpointIndex:
        """The committed step's index (cached). Raises Precondition if it is damaged, OSError if absent."""

        async def read() -> CheckpointIndex:
            try:
                return await asyncio.to_thread(self.storage.files.read_index, job, step)
            except FormatError as exc:
                raise Precondition(f"step {step} of job {job!r} has a damaged index: {exc}") from None

        return await self.indexes.read((job, step), read)

    async def summary(self, job: str, step: int) -> StepSummary:
        """The committed step's summary: kept, else its index's (read, cached). Raises as index()."""
        found = self.indexes.summary((job, step))
        return found if found is not None else StepSummary.of(await self.index(job, step))

    async def fail(self, state: JobState, session: SaveSession, reason: str, cause: str = "internal") -> None:
        """Fail the save (no-op once it ended). cause: the label of ckptd_save_failures_total
        (metrics.FAILURE_CAUSES). Releases its arenas (engine/memory.py decides whether the job
        keeps them), and with several nodes tells the coordinator, so that every node aborts it."""
        if not session.fail(reason):
            return
        self.counters.failed += 1
        self.counters.last_error = state.last_error = f"job {session.job} step {session.step}: {reason}"
        self.metrics.failed(cause)
        log.warning(
            "save of step %s of job %s failed: %s", session.step, session.job, reason, extra={"job": session.job, "step": session.step, "cause": cause}
        )
        if session.arenas is not None:
            state.pool.release(session.arenas)
            self.memory.settle(state)
        state.finish(session)
        if session.global_id and not session.reported:
            session.reported = True
            self.spawn(self._report_failure(session))

    def skip(self, state: JobState, session: SaveSession, reason: str) -> None:
        session.skip(reason)
        self.counters.skipped += 1
        self.metrics.skipped.labels(session.job).inc()
        state.finish(session)

    async def _report_failure(self, session: SaveSession) -> None:
        """Tell the coordinator this node's part of the save failed, so every node aborts it."""
        outcome = await self.coordination.report(ReportManifest(session.job, session.step, session.global_id, None, session.error))
        log.info("step %s of job %s: reported node %s's failure; outcome: %s", session.step, session.job, self.node, outcome.error)

    def saving(self, job: str, step: int) -> bool:
        """Whether this daemon has a save of the job's step open or being written."""
        state = self.jobs.get(job)
        return state is not None and step in state.sessions

    def writing_count(self) -> int:
        return sum(1 for s in self.jobs.values() for x in s.sessions.values() if x.state is SaveState.WRITING)

