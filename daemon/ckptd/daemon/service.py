"""The daemon's domain layer: save sessions, arenas, persisting, committed steps, load plans.

Runs on the event loop; blocking work (arena allocation, persisting, reading indexes) goes
to threads. The servicer (servicer.py) validates requests, calls this and maps `CkptdError`s
to gRPC status codes.

A save of step S of a job is collective: every rank calls BeginSave(S). The last rank to
arrive plans the save (cached by the ranks' fingerprints) and takes an arena set; every rank
then copies its slots and calls CommitSnapshot. When all have, the snapshot is complete and
is persisted in the background; WaitDurable reports progress until it is committed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Sequence, NamedTuple

from ckptd.common.boxes import intersect
from ckptd.common.frames import Frames
from ckptd.common.names import MAX_EXTRAS_DEPTH, MAX_EXTRAS_JSON_DEPTH, json_depth
from ckptd.common.quant_options import CAST
from ckptd.daemon.arena import ARENA_PREFIX, ArenaPool, ArenaSet, SetState, remove_stale_arenas
from ckptd.daemon.cluster import Cluster, JoinResult
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.errors import AlreadyExists, CkptdError, Aborted, Exhausted, InvalidRequest, NoSpace, NotFound, Precondition, Timeout, Unavailable
from ckptd.daemon.gpu import GpuStaging, StagedRange
from ckptd.daemon.format import (
    EXTRA_JSON, INDEX_NAME, CheckpointIndex, FileRecord, FormatError, TensorRecord, check_small_file, parse_extra_json,
)
from ckptd.daemon.peer_tls import PeerTls
from ckptd.daemon.metrics import LiveState, Metrics
from ckptd.daemon.pipeline import VERSION, NodeManifest, PersistRequest, Progress, persist, write_node_files, write_step_files
from ckptd.daemon.plan import PlanError, SavePlan, TensorSpec, make_save_plan
from ckptd.daemon.storage import Storage, read_file, tree_bytes

log = logging.getLogger(__name__)

INDEX_CACHE_ENTRIES = 16  # parsed indexes kept (about 1 KiB per tensor each): the steps loaded or committed last


class IndexCache:
    """The parsed indexes of the `entries` committed steps used most recently, by (job, step).

    Bounded: a job that keeps every 50th step for months has thousands of committed steps, and
    an index of every one of them in memory grew the daemon by about 190 KiB per step (200
    tensors) in the soak benchmark (tests/bench/soak.py)."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[tuple[str, int], CheckpointIndex] = OrderedDict()

    def get(self, key: tuple[str, int]) -> CheckpointIndex | None:
        index = self._items.get(key)
        if index is not None:
            self._items.move_to_end(key)
        return index

    def put(self, key: tuple[str, int], index: CheckpointIndex) -> None:
        self._items[key] = index
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)

    def pop(self, key: tuple[str, int]) -> CheckpointIndex | None:
        return self._items.pop(key, None)

MAX_EXTRAS_BYTES = 64 * 2**20
LOAD_LEASE_S = 3600.0
RECENT_RESULTS = 16
OPTIONAL_PREFIXES = ("rng/",)  # per-rank RNG states: never "missing" nor "unexpected"
# Settings a running daemon cannot change (reconfigure keeps their old values; restart instead).
RESTART_SETTINGS = (
    "root", "socket", "shm_dir", "max_inflight", "node_rank", "peers", "peer_token", "peer_tls_cert", "peer_tls_key", "peer_tls_ca",
    "metrics_port", "metrics_host", "health_port", "log_json",
)


@dataclass
class SaveSession:
    job: str
    step: int
    world_size: int
    save_id: str
    metric: float | None
    timeout_s: float
    local_ranks: int  # ranks of the job this daemon serves (all of them on a single node)
    created: float = field(default_factory=time.monotonic)
    global_id: str = ""  # several nodes: the coordinator's id of the save
    reported: bool = False  # several nodes: this node's part (or failure) went to the coordinator
    shared_root: bool = False  # several nodes writing into one storage root
    snapshot_done: float = 0.0  # when the last rank handed its part over (monotonic)
    write_started: float = 0.0  # when writing started (monotonic); 0 before
    arrived: dict[int, str] = field(default_factory=dict)  # rank -> fingerprint
    committed: dict[int, Any] = field(default_factory=dict)  # rank -> extras tree
    model_files: dict[str, bytes] = field(default_factory=dict)  # e.g. config.json, from rank 0
    plan: SavePlan | None = None
    arenas: ArenaSet | None = None
    skip_reason: str | None = None
    state: str = "gathering"  # gathering | snapshotting | writing | committed | failed | skipped
    error: str = ""
    refused: bool = False  # failed because the request itself was bad (INVALID_ARGUMENT)
    step_dir: str = ""
    progress: Progress | None = None
    # compression asked for by the ranks (None: the daemon's default), see _compression()
    quantize: str | None = None
    no_quantize: bool = False
    master_weights: str | None = None
    lineage: int = 0  # quantization generation of the checkpoint the ranks last loaded
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # plan + arenas decided (or failed)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # no longer open: handed over, failed or skipped
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # committed, failed or skipped

    @property
    def open(self) -> bool:
        return self.state in ("gathering", "snapshotting")

    @property
    def bytes_total(self) -> int:
        return self.plan.total_bytes if self.plan else 0


@dataclass
class LoadLease:
    job: str
    step: int
    arenas: ArenaSet | None
    expires: float


@dataclass
class JobState:
    world_size: int
    pool: ArenaPool
    specs: dict[tuple[int, str], tuple[TensorSpec, ...]] = field(default_factory=dict)  # (rank, fingerprint)
    plans: dict[Any, SavePlan] = field(default_factory=dict)  # by the ranks' fingerprints (or the coordinator's plan key)
    announced: set[tuple[int, str]] = field(default_factory=set)  # (rank, fingerprint) whose metadata the coordinator has
    sessions: dict[int, SaveSession] = field(default_factory=dict)  # open or writing, by step
    recent: dict[int, SaveSession] = field(default_factory=dict)  # finished, newest RECENT_RESULTS
    acquire_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    arena_freed: asyncio.Condition = field(default_factory=asyncio.Condition)
    lineage: int = 0  # quantization generation of the step this job last loaded from this daemon


class PieceInfo(NamedTuple):
    """One source of bytes for (part of) a requested tensor (a named tuple: a load makes one
    per tensor, and a tuple is made in C)."""

    name: str  # the requested name
    source: str  # "shm" | "file"
    path: str
    offset: int
    nbytes: int
    fragment: Any  # Box
    dtype: str
    checksum: str
    chunk_bytes: int = 0  # file pieces: the fragment's chunk checksums (FragmentRecord)
    chunk_xxh3: str = ""
    decode: "DecodeInfo | None" = None  # the bytes are codes or a residual, not values


@dataclass(frozen=True)
class DecodeInfo:
    """How the client turns a piece's bytes into values (ckptd.common.quant)."""

    codec: str
    block: int
    scales: PieceInfo | None
    base: PieceInfo | None
    frames: Frames | None = None  # the codes are stored in zstd frames


@dataclass(frozen=True)
class Compression:
    """What one save stores lossily, decided from the request, the daemon's defaults and the
    lineage (the compounding guard); `record` goes into the index (None: nothing to record)."""

    quantize: str | None
    master_weights: str
    record: dict[str, Any] | None


@dataclass(frozen=True)
class LoadPlan:
    load_id: str
    step: int
    pieces: tuple[PieceInfo, ...]
    extras: Any
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    tier: str
    generation: int = 0
    plan_id: str = ""  # memory tier: a digest of `pieces` (see _MemoryPlans)


@dataclass(frozen=True, eq=False)
class _MemoryPlan:
    """Pieces of a load served wholly from a held snapshot, for the same request again."""

    held: ArenaSet
    layout: SavePlan  # the held snapshot's plan when these pieces were derived
    wanted: Sequence[TensorSpec]
    pieces: tuple[PieceInfo, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    plan_id: str


class _MemoryPlans:
    """Memory-tier load plans by (job, rank, options, held arena set): a rank that loads the same
    tensors (the very specs object its fingerprint resolved to) from an arena set laid out by the
    same save plan again gets the same pieces (they name arena paths and offsets, not steps)
    without their per-tensor derivation. Keeps the last `keep` plans."""

    def __init__(self, keep: int = 32) -> None:
        self._keep = keep
        self._plans: dict[tuple[Any, ...], _MemoryPlan] = {}

    def get(self, key: tuple[Any, ...], held: ArenaSet | None, wanted: Sequence[TensorSpec], step: int) -> _MemoryPlan | None:
        plan = self._plans.get(key)
        if plan is None or held is None or plan.held is not held or plan.wanted is not wanted or plan.layout is not held.plan:
            return None
        if held.state is not SetState.HELD or held.step != step:
            return None
        return plan

    def put(self, key: tuple[Any, ...], plan: _MemoryPlan) -> None:
        self._plans.pop(key, None)
        self._plans[key] = plan
        while len(self._plans) > self._keep:
            del self._plans[next(iter(self._plans))]


def _plan_digest(pieces: Sequence[PieceInfo]) -> str:
    h = hashlib.sha256()
    for p in pieces:
        h.update(f"{p.name}|{p.path}|{p.offset}|{p.nbytes}|{p.fragment.offsets}|{p.fragment.lengths}|{p.dtype}\n".encode())
    return h.hexdigest()[:32]


@dataclass
class Counters:
    committed: int = 0
    failed: int = 0
    skipped: int = 0
    last_error: str = ""
    bytes_written: int = 0


@dataclass(frozen=True)
class CommitRecord:
    """The newest commit this daemon made or recorded (for `ckptd status`)."""

    job: str
    step: int
    committed_at: float  # unix seconds
    latency_s: float  # complete snapshot -> committed
    bytes: int
    step_dir: str


@dataclass(frozen=True)
class Collected:
    """One thing `collect` removed (or would remove, dry run)."""

    job: str
    step: int  # -1: not a step directory
    path: str
    reason: str  # "retention" | "uncommitted" | "temporary"
    bytes: int


class CheckpointService:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.storage = Storage(config.root)
        self.retention = config.retention_policy()
        self.metrics = Metrics(config.node_rank)
        self.started_at = time.time()
        self.last_commit: CommitRecord | None = None
        self.jobs: dict[str, JobState] = {}
        self.leases: dict[str, LoadLease] = {}
        self.counters = Counters()
        self.draining = False
        self._persist_executor = ThreadPoolExecutor(1, thread_name_prefix="ckptd-persist")
        self._index_cache = IndexCache(INDEX_CACHE_ENTRIES)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._resolving = asyncio.Lock()  # resolve_prepared: one step at a time
        self.node = config.node_rank
        tls = PeerTls.from_files(*config.peer_tls_files) if config.peer_tls_files is not None else None
        self.cluster = (
            Cluster(config.node_rank, config.peers, config.peer_token, self.storage, self._apply_retention, tls) if config.multi_node else None
        )
        self._fetches: dict[tuple[str, int, str, int], asyncio.Task[None]] = {}
        # (job, step) -> loads being planned: their peer fetches' staging files must stay
        self._planning: dict[tuple[str, int], int] = {}
        self._memory_plans = _MemoryPlans()
        self.gpu = GpuStaging()  # mode "ipc": loads CUDA only when a rank opens a staging buffer

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Prepare the root and shared memory: remove what crashed daemons left behind."""
        self.config.root.mkdir(parents=True, exist_ok=True)
        for path in self.storage.clean_uncommitted():
            log.warning("removed uncommitted leftover %s", path)
        self.config.shm_dir.mkdir(parents=True, exist_ok=True)
        for path in remove_stale_arenas(self.config.shm_dir, os.getpid()):
            log.warning("removed stale shared-memory arena %s", path)
        if self.cluster is not None:
            self.cluster.start()

    def reconfigure(self, new: DaemonConfig) -> list[str]:
        """Take the settings of `new` that can change while serving (SIGHUP, `systemctl reload`):
        retention, arena policy, timeouts, writing, logging. Returns the changed settings that
        need a restart instead (they keep their old values)."""
        fixed = [n for n in RESTART_SETTINGS if getattr(new, n) != getattr(self.config, n)]
        self.config = replace(new, **{n: getattr(self.config, n) for n in RESTART_SETTINGS})
        self.retention = new.retention_policy()
        return fixed

    async def drain(self, grace_s: float) -> None:
        """Stop taking saves; let open snapshots complete (up to `grace_s`) and persisting finish."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        for job in self.jobs.values():
            for session in list(job.sessions.values()):
                if session.open:
                    try:
                        await asyncio.wait_for(session.closed.wait(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        pass  # still incomplete at the deadline: aborted below
                    if session.open:
                        await self._fail(job, session, "the daemon shut down before every rank handed its snapshot over", "shutdown")
        for job in self.jobs.values():
            for session in list(job.sessions.values()):
                await session.finished.wait()

    def close(self) -> None:
        self._persist_executor.shutdown(wait=True)
        self.gpu.shutdown()
        for job in self.jobs.values():
            job.pool.close()
        for path in self.config.shm_dir.glob(f"{ARENA_PREFIX}{os.getpid()}-fetch-*"):
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------ save

    def _job(self, job: str, world_size: int) -> JobState:
        """The job's state. A new world size (an elastic restart) forgets the cached plans but
        keeps the arenas: snapshots still being written or held for restores stay valid."""
        state = self.jobs.get(job)
        if state is None:
            state = JobState(world_size=world_size, pool=ArenaPool(self.config.shm_dir, job, self.config.max_inflight))
            self.jobs[job] = state
        elif state.world_size != world_size:
            if any(s.open for s in state.sessions.values()):
                raise Precondition(  # not the caller's state: an elastic restart while the old world's save is still open
                    f"job {job!r} has a save in flight with world size {state.world_size}, this rank says {world_size}: "
                    "save again once that save has finished or timed out (all ranks of a save must agree on the world size)"
                )
            state.world_size = world_size
            state.specs.clear()
            state.plans.clear()
        return state

    async def begin_save(
        self,
        job: str,
        rank: int,
        world_size: int,
        step: int,
        fingerprint: str,
        specs: Sequence[TensorSpec] | None,
        metric: float | None,
        timeout_s: float,
        local_world_size: int = 0,
        quantize: str | None = None,
        master_weights: str | None = None,
        lineage: int = 0,
        no_quantize: bool = False,
    ) -> SaveSession:
        """Join the save of `step`; returns once the plan and arenas are decided (all ranks arrived).

        local_world_size: the job's ranks this daemon serves (0: all, on a single node).
        quantize, master_weights, no_quantize: this rank's compression options (every rank must
        give the same); lineage: the quantization generation of the step the rank last loaded."""
        if self.draining:
            raise Unavailable("the daemon is shutting down and takes no new saves; retry once it is back")
        local_ranks = self._local_ranks(world_size, local_world_size)
        if self.gpu.buffers:  # mode "ipc": a restarted trainer needs the GPU memory its dead predecessor held
            await self.gpu.reap_dead()
        state = self._job(job, world_size)
        if specs is not None:
            state.specs[(rank, fingerprint)] = tuple(specs)
        elif (rank, fingerprint) not in state.specs:
            raise Precondition("unknown fingerprint: send the tensor metadata with this request")
        if step in state.recent and state.recent[step].state == "committed" or await self._committed(job, step):
            raise AlreadyExists(
                f"step {step} of job {job!r} is already committed (after a rollback, the abandoned timeline's steps stay): "
                "save under a step number not on disk (`ckptd ls` lists them), or move that step's directory out of the root first"
            )
        await self._abort_left_behind(state, rank, step)
        session = state.sessions.get(step)
        if session is None or not session.open:
            if session is not None:
                raise AlreadyExists(f"step {step} of job {job!r} is already being written; save under a new step")
            session = SaveSession(
                job, step, world_size, uuid.uuid4().hex, metric, min(timeout_s, self.config.save_timeout_s) if timeout_s else self.config.save_timeout_s, local_ranks
            )
            state.sessions[step] = session
            self._spawn(self._watchdog(state, session))
        if rank in session.arrived:
            raise InvalidRequest(f"rank {rank} joined the save of step {step} twice")
        options = (quantize, master_weights, no_quantize)
        if not session.arrived:
            session.quantize, session.master_weights, session.no_quantize = options
        elif options != (session.quantize, session.master_weights, session.no_quantize):
            raise InvalidRequest(
                f"rank {rank} asks for quantize={quantize!r}, master_weights={master_weights!r} in step {step} but an earlier "
                f"rank asked for quantize={session.quantize!r}, master_weights={session.master_weights!r}; every rank must pass the same"
            )
        session.lineage = max(session.lineage, lineage)
        if local_ranks != session.local_ranks:
            raise InvalidRequest(f"rank {rank} says this node serves {local_ranks} ranks, an earlier rank said {session.local_ranks}")
        session.arrived[rank] = fingerprint
        if len(session.arrived) == local_ranks:
            self._spawn(self._prepare(state, session))
        await session.ready.wait()
        if session.state == "failed":
            if session.refused:
                raise InvalidRequest(session.error)
            raise Aborted(f"save of step {step} aborted: {session.error}")
        return session

    def _local_ranks(self, world_size: int, local_world_size: int) -> int:
        if self.cluster is None:
            if local_world_size not in (0, world_size):
                raise InvalidRequest(
                    f"this daemon runs as a single node (no --peers) but the job has {world_size} ranks and this node "
                    f"{local_world_size} (LOCAL_WORLD_SIZE); start every node's daemon with --node-rank and --peers"
                )
            return world_size
        if not 1 <= local_world_size <= world_size:
            raise InvalidRequest(
                f"this daemon is node {self.node} of {self.cluster.nodes}: it needs the number of the job's ranks on "
                "this node; set LOCAL_WORLD_SIZE (torchrun does) or pass local_world_size= to CheckpointClient"
            )
        return local_world_size

    async def _committed(self, job: str, step: int) -> bool:
        return await asyncio.to_thread(self.storage.is_committed, job, step)

    async def _abort_left_behind(self, state: JobState, rank: int, step: int | None) -> None:
        """A rank that starts another save or a load will never finish an older open one."""
        for other in list(state.sessions.values()):
            if other.step != step and other.open and rank in other.arrived and rank not in other.committed:
                await self._fail(state, other, f"rank {rank} moved on (it restarted or gave up on step {other.step})", "rank_restarted")

    async def _prepare(self, state: JobState, session: SaveSession) -> None:
        try:
            if self.cluster is None:
                key = tuple(session.arrived[r] for r in range(session.world_size))
                plan = state.plans.get(key)
                if plan is None:
                    specs = [state.specs[(r, fp)] for r, fp in enumerate(key)]
                    plan = await asyncio.to_thread(make_save_plan, specs)
                    state.plans[key] = plan
            else:
                plan = await self._join_nodes(state, session)
            session.plan = plan
            session.progress = Progress(plan.total_bytes)
            session.arenas = await self._acquire(state, session, plan)
            if session.arenas is not None:
                session.state = "snapshotting"
                self._spawn(self._prewarm(state, plan))
        except (PlanError, Exhausted, InvalidRequest, Aborted, Unavailable) as exc:
            session.refused = isinstance(exc, (PlanError, InvalidRequest))
            cause = "invalid" if session.refused else "no_arena" if isinstance(exc, Exhausted) else "peer"
            await self._fail(state, session, str(exc), cause)
        except Exception as exc:
            log.exception("planning step %s of job %s failed", session.step, session.job)
            await self._fail(state, session, f"internal error while planning: {exc}", "internal")
        finally:
            session.ready.set()

    async def _join_nodes(self, state: JobState, session: SaveSession) -> SavePlan:
        """Several nodes: join the save at the coordinator; plan from what it sends back."""
        assert self.cluster is not None
        fingerprints = dict(session.arrived)

        async def join(resend: bool) -> JoinResult:
            assert self.cluster is not None
            specs = {r: state.specs[(r, fp)] for r, fp in fingerprints.items() if resend or (r, fp) not in state.announced}
            return await self.cluster.join_save(
                session.job, session.step, session.world_size, fingerprints, specs, [k for k in state.plans if isinstance(k, str)],
                session.timeout_s, session.metric,
            )

        try:
            result = await join(resend=False)
        except Precondition:  # the coordinator restarted and forgot the metadata
            result = await join(resend=True)
        state.announced.update(fingerprints.items())
        plan = state.plans.get(result.plan_key)
        if plan is None:
            if result.specs is None:
                raise Aborted(f"the coordinator assumed this node knows plan {result.plan_key[:12]}; retry the save")
            plan = await asyncio.to_thread(make_save_plan, result.specs, result.node_of_rank)
            state.plans[result.plan_key] = plan
        session.global_id = result.save_id
        session.shared_root = result.shared_root
        return plan

    async def _acquire(self, state: JobState, session: SaveSession, plan: SavePlan) -> ArenaSet | None:
        deadline = session.created + session.timeout_s
        while True:
            async with state.acquire_lock:
                arenas = await asyncio.to_thread(state.pool.acquire, plan.arena_bytes_of(self.node))
            if arenas is not None:
                return arenas
            if self.config.arena_policy == "skip":
                session.skip_reason = (
                    f"all {self.config.max_inflight} snapshots of job {session.job!r} are still being written"
                )
                session.state = "skipped"
                self.counters.skipped += 1
                self.metrics.skipped.labels(session.job).inc()
                self._finish(state, session)
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Exhausted(f"no free arena for step {session.step} within {session.timeout_s:.0f} s")
            async with state.arena_freed:
                try:
                    await asyncio.wait_for(state.arena_freed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass

    async def _prewarm(self, state: JobState, plan: SavePlan) -> None:
        """Allocate the next arena set in the background while this snapshot is copied and written."""
        try:
            async with state.acquire_lock:
                if await asyncio.to_thread(state.pool.prewarm, plan.arena_bytes_of(self.node)):
                    await _notify(state.arena_freed)
        except Exhausted as exc:
            log.warning("could not prepare a second arena set for job %s (saves will wait for the first): %s", state.pool.job, exc)

    async def commit_snapshot(
        self,
        job: str,
        rank: int,
        save_id: str,
        extras_json: str,
        model_files: dict[str, bytes] | None = None,
        staged: tuple[str, Sequence[StagedRange]] | None = None,
        stall_s: float = 0.0,
    ) -> None:
        """The rank's part of the snapshot is complete. staged: (staging id, ranges) of a rank in
        mode "ipc", copied from its staging buffer into its arena first; if that fails the save
        fails (nothing of it is persisted). stall_s: seconds its save() blocked training so far
        (0: not reported)."""
        state, session = self._session(job, save_id)
        if session.state != "snapshotting":
            raise Precondition(f"save of step {session.step} is {session.state}, it cannot take a snapshot now")
        if rank not in session.arrived:
            raise InvalidRequest(f"rank {rank} did not join the save of step {session.step}")
        if rank in session.committed:
            raise InvalidRequest(f"rank {rank} handed its snapshot of step {session.step} over twice")
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
        if staged is not None:
            assert session.arenas is not None
            arena = session.arenas.arenas[rank] if rank < len(session.arenas.arenas) else None
            try:
                await self.gpu.drain(job, rank, staged[0], arena, staged[1])
            except Aborted as exc:
                await self._fail(state, session, str(exc), "gpu_staging")
                raise
            if session.state != "snapshotting":  # failed or timed out while copying
                raise Aborted(f"save of step {session.step} is {session.state}: {session.error}")
        session.committed[rank] = extras
        if stall_s > 0:
            self.metrics.stall.labels(job).observe(stall_s)
        if rank == 0 and model_files:
            session.model_files = dict(model_files)
        if len(session.committed) == session.local_ranks:
            session.state = "writing"
            session.snapshot_done = session.write_started = time.monotonic()
            assert session.arenas is not None
            session.arenas.state = SetState.PERSISTING
            session.arenas.step = session.step
            session.closed.set()
            self._spawn(self._persist(state, session))

    async def abort_save(self, job: str, rank: int, save_id: str, reason: str) -> None:
        state, session = self._session(job, save_id)
        if session.open:
            await self._fail(state, session, f"rank {rank} aborted: {reason or 'no reason given'}", "rank_aborted")

    def _session(self, job: str, save_id: str) -> tuple[JobState, SaveSession]:
        state = self.jobs.get(job)
        if state is not None:
            for session in list(state.sessions.values()) + list(state.recent.values()):
                if session.save_id == save_id:
                    return state, session
        raise NotFound(f"no save {save_id!r} in job {job!r} (it finished, timed out or the daemon restarted)")

    async def _persist(self, state: JobState, session: SaveSession) -> None:
        assert session.plan is not None and session.arenas is not None and session.progress is not None
        if self.cluster is not None:
            await self._persist_node(state, session)
            return
        request = self._persist_request(state, session)
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            index = await loop.run_in_executor(self._persist_executor, persist, self.storage, request, session.progress)
        except NoSpace as exc:  # refused before anything was written: the previous step is as it was
            self.metrics.refused_no_space.labels(session.job).inc()
            await self._fail(state, session, str(exc), "no_space")
            return
        except Exception as exc:
            log.exception("writing step %s of job %s failed", session.step, session.job)
            await self._fail(state, session, f"writing failed: {exc}", "write_error")
            return
        written = time.monotonic()
        self._wrote(session.job, index.files, written - started)
        self._committed_here(state, session, index)
        await self._apply_retention(session.job, committed=session.step)  # before finishing: a durable step has its retention applied
        log.info(
            "committed step %s of job %s: %.1f MiB written in %.2f s, retention %.3f s, %.2f s after the snapshot",
            session.step, session.job, session.plan.total_bytes / 2**20, written - started,
            time.monotonic() - written, time.monotonic() - session.snapshot_done,
            extra={"job": session.job, "step": session.step},
        )
        self._finish(state, session)
        await _notify(state.arena_freed)

    def _compression(self, state: JobState, session: SaveSession) -> Compression:
        """The compression of this save: the ranks' options, else the daemon's defaults; lossless
        (and master weights kept) once the lineage has config.quant_max_generations lossy cycles
        behind it, so that error does not pile up over repeated resumes."""
        scheme = None if session.no_quantize else session.quantize or (None if self.config.quantize == "none" else self.config.quantize)
        master = session.master_weights or self.config.master_weights
        lineage = max(session.lineage, state.lineage)
        limit = self.config.quant_max_generations
        if limit and lineage >= limit and (scheme is not None or master == "drop"):
            log.info(
                "step %s of job %s is saved losslessly: its values come from a checkpoint %s lossy cycle(s) deep "
                "(limit quant_max_generations=%s)", session.step, session.job, lineage, limit,
            )
            scheme = None
            master = "keep" if master == "drop" else master
        generation = lineage + (1 if scheme is not None or master == "drop" else 0)
        record = None
        if generation or scheme is not None or master != "keep":
            record = {"generation": generation, "quantize": scheme, "master_weights": master}
        return Compression(scheme, master, record)

    def _committed_here(self, state: JobState, session: SaveSession, index: CheckpointIndex) -> None:
        assert session.arenas is not None and session.plan is not None
        self._index_cache.put((session.job, session.step), index)
        session.state = "committed"
        session.step_dir = str(self.storage.step_dir(session.job, session.step))
        self.counters.committed += 1
        state.pool.hold(session.arenas, session.step, session.plan, dict(session.committed))
        latency = time.monotonic() - session.snapshot_done
        self.last_commit = CommitRecord(session.job, session.step, time.time(), latency, index.size_bytes, session.step_dir)
        self.metrics.commits.labels(session.job).inc()
        self.metrics.commit_latency.labels(session.job).observe(latency)
        self.metrics.last_commit.labels(session.job).set(self.last_commit.committed_at)
        self.metrics.last_step.labels(session.job).set(session.step)

    def _persist_request(self, state: JobState, session: SaveSession) -> PersistRequest:
        """What the pipeline writes for `session`: the whole step on a single node; with several
        nodes, this node's data files (node 0 commits the extras and model files)."""
        assert session.plan is not None and session.arenas is not None
        compression = self._compression(state, session)
        several = self.cluster is not None
        return PersistRequest(
            job=session.job,
            step=session.step,
            plan=session.plan,
            arenas=session.arenas,
            extras={} if several else dict(session.committed),
            model_files={} if several else dict(session.model_files),
            metric=session.metric,
            max_file_bytes=self.config.max_file_bytes,
            write_threads=self.config.write_threads,
            throttle_bytes_per_s=self.config.write_throttle,
            node=self.node,
            shared_dir=session.shared_root,
            quantize=compression.quantize,
            master_weights=compression.master_weights,
            quantization=compression.record,
            disk_reserve=self.config.disk_reserve,
        )

    def _wrote(self, job: str, files: Sequence[FileRecord], seconds: float) -> None:
        """Count the data bytes this node wrote for a step (metrics: bytes, throughput)."""
        nbytes = sum(f.size for f in files if f.node == self.node and f.name.endswith(".safetensors"))
        self.counters.bytes_written += nbytes
        self.metrics.bytes_written.labels(job).inc(nbytes)
        if seconds > 0:
            self.metrics.throughput.labels(job).set(nbytes / seconds)

    async def _persist_node(self, state: JobState, session: SaveSession) -> None:
        """Several nodes: write this node's files, report them, and commit or abort as the
        coordinator decides."""
        assert self.cluster is not None
        request = self._persist_request(state, session)
        loop = asyncio.get_running_loop()
        manifest: NodeManifest | None = None
        error = ""
        cause = "write_error"
        started = time.monotonic()
        try:
            manifest = await loop.run_in_executor(self._persist_executor, write_node_files, self.storage, request, session.progress)
            self._wrote(session.job, manifest.files, time.monotonic() - started)
        except NoSpace as exc:  # refused before writing: the coordinator aborts the step on every node
            self.metrics.refused_no_space.labels(session.job).inc()
            error, cause = str(exc), "no_space"
        except Exception as exc:
            log.exception("writing node %s's part of step %s of job %s failed", self.node, session.step, session.job)
            error = f"writing failed on node {self.node}: {exc}"
        if manifest is not None and not session.shared_root and self.node != 0:
            try:  # kept at a restart until node 0 says whether the step was committed
                await asyncio.to_thread(self.storage.mark_prepared, session.job, session.step, session.global_id, self.node)
            except OSError as exc:
                manifest, error = None, f"node {self.node} could not mark its part written: {exc}"
        session.reported = True
        extras = {r: json.dumps(e) for r, e in session.committed.items()}
        outcome = await self.cluster.report(session.job, session.step, session.global_id, manifest, error, extras, session.model_files)
        if outcome.committed:
            try:
                if outcome.step_files and self.node != 0:  # node-local root: the same index here
                    await asyncio.to_thread(self._write_commit_here, session.job, session.step, outcome.step_files)
                index = await asyncio.to_thread(self.storage.read_index, session.job, session.step)
            except (OSError, FormatError) as exc:
                log.exception("step %s of job %s is committed but node %s could not record it", session.step, session.job, self.node)
                await self._fail(state, session, f"committed elsewhere, but node {self.node} could not write its index: {exc}", "write_error")
                return
            self._committed_here(state, session, index)
            if self.node != 0 and outcome.step_files:
                await self._apply_retention(session.job, committed=session.step)  # node 0 applies it for a shared root (Coordinator.on_commit)
            self._finish(state, session)
            await _notify(state.arena_freed)
            return
        if not outcome.decided and manifest is not None and not session.shared_root and self.node != 0:
            # Node 0 went away before it answered: it may have committed the step (its index is
            # written before the answer). The part stays, marked prepared, until node 0 says.
            await self._fail(state, session, f"{outcome.error}; node {self.node} keeps its part until node 0 says whether it committed the step", "peer")
            self._spawn(self.resolve_prepared(retry_s=1.0))
            return
        # Node 0 too: the coordinator removed the step from its root when it aborted, but node 0's
        # own writer may have started after that (another node refused the step at once: NoSpace).
        names = [f.name for f in manifest.files] if manifest is not None else []
        await asyncio.to_thread(self.storage.discard_part, session.job, session.step, names, session.shared_root)
        await self._fail(state, session, outcome.error, cause if error else "peer")

    def _write_commit_here(self, job: str, step: int, files: dict[str, bytes]) -> None:
        """Record node 0's commit in this node's own root (unmark_prepared also removes the
        temporaries of a daemon that died writing this commit before)."""
        write_step_files(self.storage, job, step, files)
        self.storage.unmark_prepared(job, step)
        newest = self.storage.latest_step(job)  # the most recently committed, by node 0's created_at: normally `step`
        self.storage.write_latest(job, step if newest is None else newest)

    def saving(self, job: str, step: int) -> bool:
        """Whether this daemon has a save of the job's step open or being written."""
        state = self.jobs.get(job)
        return state is not None and step in state.sessions

    async def resolve_prepared(self, retry_s: float = 10.0) -> None:
        """Several nodes with their own roots: finish or discard the parts this node wrote before
        it restarted, or whose save node 0 never answered. Node 0 decides: a step it committed
        gets its index here too; a step it neither committed nor is still saving is removed.
        Runs until every part is resolved; the parts of saves in flight here are left to them.
        Several of these may run at once: one step is resolved by one of them at a time."""
        assert self.cluster is not None

        async def pending_now() -> list[tuple[str, int]]:
            return [(job, step) for job, step in await asyncio.to_thread(self.storage.prepared_steps) if not self.saving(job, step)]

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
        assert self.cluster is not None
        answer = await self.cluster.inventory(0, job, step)
        if isinstance(answer, str) or (answer[3] and not answer[1]):  # unreachable, or still deciding
            return False
        try:
            if answer[1]:
                await self._adopt_commit(job, step)
                await self._apply_retention(job, committed=step)  # as after a commit it heard of (_persist_node)
            else:
                log.warning("removing node %s's part of step %s of job %s: node 0 did not commit it", self.node, step, job)
                await asyncio.to_thread(self.storage.remove_step, job, step)
        except (CkptdError, FormatError, OSError) as exc:
            log.warning("could not resolve step %s of job %s with node 0 yet: %s", step, job, exc)
            return False
        return True

    async def _adopt_commit(self, job: str, step: int) -> None:
        """Write the index (and the small files) that node 0 committed for a step whose data
        files this node wrote before it restarted."""
        assert self.cluster is not None
        data = await self.cluster.fetch_bytes(0, job, step, INDEX_NAME)
        index = CheckpointIndex.from_json_bytes(data, where=f"node 0's {INDEX_NAME}")
        if index.job != job or index.step != step:
            raise FormatError(f"node 0 sent the index of job {index.job!r} step {index.step} for step {step} of job {job!r}")
        files = {}
        for record in index.files:
            if not record.name.endswith(".safetensors"):
                files[record.name] = await self.cluster.fetch_bytes(0, job, step, record.name)
                check_small_file(record, files[record.name])  # FormatError: not written, resolved later
        files[INDEX_NAME] = data
        await asyncio.to_thread(self._write_commit_here, job, step, files)
        log.info("step %s of job %s: node 0 had committed it; node %s recorded the commit after its restart", step, job, self.node)

    async def _report_failure(self, session: SaveSession) -> None:
        """Several nodes: tell the coordinator this node's part of the save failed, so every node aborts."""
        assert self.cluster is not None
        outcome = await self.cluster.report(session.job, session.step, session.global_id, None, session.error, {}, {})
        log.info("step %s of job %s: reported node %s's failure; outcome: %s", session.step, session.job, self.node, outcome.error)

    async def retention_at_start(self) -> None:
        """Apply retention to every job once at start-up, on a single node and on node 0 (the
        node that applies it to a shared root): a daemon that died after a commit but before
        that commit's retention ran would otherwise list, until the next commit, a step that
        other nodes have already deleted (and so no longer loads)."""
        if self.cluster is not None and self.node != 0:
            return
        for job in await asyncio.to_thread(self.storage.jobs):
            await self._apply_retention(job)

    async def member_retention_at_start(self) -> None:
        """retention_at_start for a member (node != 0) with a root of its own (node 0 applies it
        to a shared root): run in the background once serving, as it asks node 0 for its root's
        id; when node 0 does not answer, the next commit applies it."""
        assert self.cluster is not None and self.node != 0
        for job in await asyncio.to_thread(self.storage.jobs):
            answer = await self.cluster.inventory(0, job, 0)
            if isinstance(answer, str):
                log.info("retention at start-up left to the next commit: node 0 did not answer (%s)", answer)
                return
            if answer[0] == self.cluster.root_id:
                return  # a root shared with node 0: its retention is node 0's
            await self._apply_retention(job)

    async def _apply_retention(self, job: str, dry_run: bool = False, committed: int | None = None) -> list[Collected]:
        """Delete the job's committed steps that the retention policy does not keep; returns them.

        The policy sees the steps in commit order (a rolled-back job's newest step may have a
        lower number than older ones). Never deleted: `committed` (the step whose commit runs
        this), the step `latest` names (written before this runs), steps being loaded."""
        steps = await asyncio.to_thread(self.storage.commit_order, job)
        self._expire_leases()
        protected = {lease.step for lease in self.leases.values() if lease.job == job}
        protected.add(await asyncio.to_thread(self.storage.latest_named, job))
        protected.add(committed)
        protected.discard(None)
        metrics = await self._step_metrics(job, steps) if self.retention.keep_best else {}
        removed = []
        for step in self.retention.to_delete(steps, protected, metrics):
            path = self.storage.step_dir(job, step)
            size = await asyncio.to_thread(tree_bytes, path)
            if not dry_run:
                try:
                    await asyncio.to_thread(self.storage.remove_step, job, step, True)
                except OSError as exc:
                    log.error("retention could not remove step %s of job %s: %s", step, job, exc, extra={"job": job, "step": step})
                    continue
                self._index_cache.pop((job, step))
                self.metrics.retention_deleted.labels(job).inc()
                log.info("retention removed step %s of job %s", step, job, extra={"job": job, "step": step})
            removed.append(Collected(job, step, str(path), "retention", size))
        return removed

    async def _step_metrics(self, job: str, steps: Sequence[int]) -> dict[int, float]:
        """step -> the metric it was saved with, for the steps that have one (keep-best retention)."""
        out = {}
        for step in steps:
            try:
                index = await self.index(job, step)
            except (Precondition, OSError) as exc:
                log.warning("retention: cannot read the metric of step %s of job %s: %s", step, job, exc)
                continue
            if index.metric is not None:
                out[step] = index.metric
        return out

    async def collect(self, job: str | None, dry_run: bool) -> list[Collected]:
        """`ckptd gc`: apply retention now and remove uncommitted leftovers, for one job or all.

        Never touches a step this daemon is saving; with several nodes, step directories changed
        within the last save timeout are left alone too (another node may be writing them)."""
        jobs = [job] if job else await asyncio.to_thread(self.storage.jobs)
        removed: list[Collected] = []
        min_age = self.config.save_timeout_s if self.cluster is not None else 0.0
        for name in jobs:
            state = self.jobs.get(name)
            busy = set(state.sessions) if state is not None else set()
            leftovers = await asyncio.to_thread(self.storage.leftovers, name, busy, min_age, dry_run)
            removed += [Collected(name, step, str(path), reason, size) for path, step, reason, size in leftovers]
            if self._applies_retention(name):
                removed += await self._apply_retention(name, dry_run)
        return removed

    def _applies_retention(self, job: str) -> bool:
        """Whether this daemon applies the job's retention: a single node, node 0 (the coordinator;
        in a shared root it does so for every node), or a node with its own root (as after commits)."""
        if self.cluster is None or self.node == 0:
            return True
        state = self.jobs.get(job)
        done = [s for s in state.recent.values() if s.state == "committed"] if state is not None else []
        return bool(done) and not done[-1].shared_root  # the most recently finished

    def live_state(self) -> LiveState:
        """The gauges of the metrics endpoint (read on the event loop)."""
        queue: dict[str, int] = {}
        open_saves: dict[str, int] = {}
        for job, state in self.jobs.items():
            queue[job] = sum(1 for s in state.sessions.values() if s.state == "writing")
            open_saves[job] = sum(1 for s in state.sessions.values() if s.open)
        return LiveState(
            queue_depth=queue,
            open_saves=open_saves,
            arena_bytes=sum(s.pool.nbytes for s in self.jobs.values()),
            arenas=sum(s.pool.count for s in self.jobs.values()),
            loads_active=len(self.leases),
            draining=self.draining,
        )

    async def _fail(self, state: JobState, session: SaveSession, reason: str, cause: str = "internal") -> None:
        """Fail the save. cause: the label of ckptd_save_failures_total (metrics.FAILURE_CAUSES)."""
        if session.state in ("committed", "failed", "skipped"):
            return
        session.state = "failed"
        session.error = reason
        self.counters.failed += 1
        self.counters.last_error = f"job {session.job} step {session.step}: {reason}"
        self.metrics.failed(cause)
        log.warning("save of step %s of job %s failed: %s", session.step, session.job, reason, extra={"job": session.job, "step": session.step, "cause": cause})
        if session.arenas is not None:
            state.pool.release(session.arenas)
            await _notify(state.arena_freed)
        session.ready.set()
        self._finish(state, session)
        if self.cluster is not None and session.global_id and not session.reported:
            session.reported = True
            self._spawn(self._report_failure(session))

    def _finish(self, state: JobState, session: SaveSession) -> None:
        state.sessions.pop(session.step, None)
        state.recent.pop(session.step, None)  # re-inserted: `recent` is in the order saves finished
        state.recent[session.step] = session
        while len(state.recent) > RECENT_RESULTS:
            state.recent.pop(next(iter(state.recent)))  # the earliest finished (a rolled-back job's newest save has a low step)
        session.closed.set()
        session.finished.set()

    async def _watchdog(self, state: JobState, session: SaveSession) -> None:
        try:
            await asyncio.wait_for(session.closed.wait(), session.timeout_s)
        except asyncio.TimeoutError:
            waiting = sorted(set(range(session.world_size)) - set(session.committed))
            missing = sorted(set(range(session.world_size)) - set(session.arrived))
            what = f"ranks {missing} never started it" if missing else f"ranks {waiting} did not hand their snapshot over"
            await self._fail(state, session, f"{what} within {session.timeout_s:.0f} s", "timeout")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def progress(self, job: str, step: int, timeout_s: float) -> AsyncIterator[SaveSession | str]:
        """Yield the session at each change until it is finished; a str "committed" for a step
        committed earlier (e.g. before this daemon started)."""
        state = self.jobs.get(job)
        session = None
        if state is not None:
            session = state.sessions.get(step) or state.recent.get(step)
        if session is None:
            if await self._committed(job, step):
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
                pass

    # ------------------------------------------------------------ load

    async def plan_load(
        self,
        job: str,
        rank: int,
        world_size: int,
        step: int | None,
        wanted: Sequence[TensorSpec],
        kinds: Sequence[str],
        strict: bool,
        direct_read: bool = True,
        decodes: bool = True,
        decodes_frames: bool = True,
    ) -> LoadPlan:
        """Where the bytes of each wanted tensor box are. direct_read: the rank reads committed
        files in this node's root itself; else this daemon copies the needed fragments into
        shared memory first (once however many local ranks want them), for ranks that cannot
        see the root. decodes / decodes_frames: the client decodes quantized codes and residuals
        / codes in zstd frames; a client that cannot is refused (Precondition) before any bytes
        are fetched or staged for it."""
        state = self.jobs.get(job)
        if state is not None:
            await self._abort_left_behind(state, rank, None)
        if step is None:
            if state is not None:
                await self._wait_for_writes(state)
            step = await asyncio.to_thread(self.storage.latest_step, job)
            if step is None:
                raise NotFound(f"job {job!r} has no committed checkpoint in {self.storage.root}")
        elif not await self._committed(job, step):
            raise NotFound(f"step {step} of job {job!r} is not committed in {self.storage.root}")
        index = await self.index(job, step)
        coded, framed = _needs_decoding(index, wanted)
        if coded and not decodes:
            raise Precondition(
                f"step {step} of job {job!r} is compressed (quantized optimizer state or master-weight residuals) and this "
                "client cannot decode it; upgrade the ckptd client, or load an uncompressed step"
            )
        if framed and not decodes_frames:
            raise Precondition(f"step {step} of job {job!r} stores quantized codes in zstd frames, which this client cannot read; upgrade the ckptd client")
        if state is not None:
            state.lineage = index.generation  # the compounding guard of this job's next saves
        self._planning[(job, step)] = self._planning.get((job, step), 0) + 1
        try:
            return await self._plan_load(job, rank, step, index, state, wanted, kinds, strict, direct_read)
        finally:
            self._planning[(job, step)] -= 1
            if not self._planning[(job, step)]:
                del self._planning[(job, step)]
            self._release_staging(job, step)

    async def _plan_load(
        self,
        job: str,
        rank: int,
        step: int,
        index: CheckpointIndex,
        state: JobState | None,
        wanted: Sequence[TensorSpec],
        kinds: Sequence[str],
        strict: bool,
        direct_read: bool,
    ) -> LoadPlan:
        held = state.pool.held(step) if state is not None else None
        memo_key = (job, rank, direct_read, strict, tuple(kinds), id(held))
        memo = self._memory_plans.get(memo_key, held, wanted, step)
        if memo is not None:
            return await self._lease(job, rank, step, held, index, memo.pieces, memo.missing, memo.unexpected, memo.plan_id)
        table = index.by_name()
        where = await self._file_sources(index) if self.cluster is not None else {}

        missing = []
        pieces: list[PieceInfo] = []
        found: set[str] = set()
        for spec in wanted:
            record = table.get(spec.name)
            if record is None:
                if not spec.name.startswith(OPTIONAL_PREFIXES):
                    missing.append(spec.name)
                continue
            found.add(record.name)
            if tuple(record.shape) != tuple(spec.shape):
                raise InvalidRequest(
                    f"tensor {spec.name!r} has shape {list(record.shape)} in step {step} but the state being "
                    f"loaded has {list(spec.shape)}; build the model with the configuration it was saved with"
                )
            pieces += await self._pieces_for(spec, record, index, held, where, direct_read)
        requested_keys = set(kinds)
        unexpected = sorted(
            t.name
            for t in index.tensors
            if t.name not in found and t.name.split("/", 1)[0] in requested_keys and not t.name.startswith(OPTIONAL_PREFIXES)
        )
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing from step {step}: {_names(missing)}")
            if unexpected:
                parts.append(f"in step {step} but not in the state being loaded: {_names(unexpected)}")
            raise InvalidRequest("; ".join(parts) + " (pass strict=False to load the rest)")
        plan_id = ""
        if held is not None and pieces and all(p.source == "shm" for p in pieces):
            plan_id = _plan_digest(pieces)
            self._memory_plans.put(memo_key, _MemoryPlan(held, held.plan, wanted, tuple(pieces), tuple(missing), tuple(unexpected), plan_id))
        return await self._lease(job, rank, step, held, index, tuple(pieces), tuple(missing), tuple(unexpected), plan_id)

    async def _lease(
        self,
        job: str,
        rank: int,
        step: int,
        held: ArenaSet | None,
        index: CheckpointIndex,
        pieces: tuple[PieceInfo, ...],
        missing: tuple[str, ...],
        unexpected: tuple[str, ...],
        plan_id: str,
    ) -> LoadPlan:
        """The plan of a load with this rank's extras, leased (the held snapshot stays until LoadDone)."""
        # the held snapshot has the extras of this node's ranks; others (more ranks than at save
        # time, or ranks of other nodes) come from extra.json
        extras_by_rank = held.extras if held is not None and rank in held.extras else await self._extras(job, step)
        extras = extras_by_rank.get(rank)
        if extras is None:  # more ranks than at save time: rank 0's extras, without its RNG state
            extras = {k: v for k, v in extras_by_rank.get(0, {}).items() if k != "rng"}
        load_id = uuid.uuid4().hex
        if held is not None:
            held.readers += 1
        self.leases[load_id] = LoadLease(job, step, held, time.monotonic() + LOAD_LEASE_S)
        self._expire_leases()
        kinds_used = {p.source for p in pieces}
        tier = "memory" if kinds_used == {"shm"} or (held is not None and not pieces) else "disk" if "shm" not in kinds_used else "mixed"
        self.metrics.loads.labels(tier).inc()
        return LoadPlan(load_id, step, pieces, extras, missing, unexpected, tier, index.generation, plan_id)

    async def _wait_for_writes(self, state: JobState) -> None:
        """A restarted trainer asking for the newest step gets the one every rank already handed
        over, not an older one: wait for snapshots that are being written."""
        for session in [s for s in state.sessions.values() if s.state == "writing"]:
            try:
                await asyncio.wait_for(session.finished.wait(), session.timeout_s)
            except asyncio.TimeoutError:
                log.warning("step %s of job %s still not written after %s s; loading an older step", session.step, session.job, session.timeout_s)

    async def _pieces_for(
        self, spec: TensorSpec, record: TensorRecord, index: CheckpointIndex, held: ArenaSet | None, where: dict[str, int], direct_read: bool
    ) -> list[PieceInfo]:
        """Where the bytes of `spec`'s box are: this daemon's arenas when it holds every
        overlapping fragment of the newest snapshot, else the committed files (fetched from the
        node that has them when they are not in this node's root: `where`; copied into shared
        memory when not `direct_read`)."""
        if held is not None and not record.lossy:  # a compressed tensor loads as stored, from any tier
            out = []
            for slot in held.plan.slots_named(record.name):
                if intersect(slot.box, spec.box) is None:
                    continue
                arena = held.arenas[slot.rank]
                if arena is None:  # copied by a rank of another node: not all of it is here
                    break
                out.append(PieceInfo(spec.name, "shm", arena.path_text, slot.offset, slot.nbytes, slot.box, record.dtype, ""))
            else:
                return out
        step_dir = self.storage.step_dir(index.job, index.step)

        async def path_of(file: str, offset: int, nbytes: int) -> str:
            node = where.get(file, self.node)
            if node != self.node or not direct_read:
                return await self._fetched(index, file, node, offset, nbytes)
            return str(step_dir / file)

        out = []
        for frag in record.fragments:
            if intersect(frag.box, spec.box) is None:
                continue
            path = await path_of(frag.file, frag.offset, frag.nbytes)
            decode = None
            if frag.quant is not None and frag.quant.codec != CAST:  # "cast": the model weight's bytes, converted as any dtype
                sides = []
                for side in (frag.quant.scales, frag.quant.base):
                    if side is None:
                        sides.append(None)
                        continue
                    side_path = await path_of(side.file, side.offset, side.nbytes)
                    sides.append(
                        PieceInfo(
                            spec.name, "file", side_path, side.offset, side.nbytes, frag.box, side.dtype, side.checksum,
                            chunk_bytes=side.chunk_bytes, chunk_xxh3=side.chunk_xxh3,
                        )
                    )
                decode = DecodeInfo(frag.quant.codec, frag.quant.block, sides[0], sides[1], frag.quant.frames)
            out.append(
                PieceInfo(
                    spec.name, "file", path, frag.offset, frag.nbytes, frag.box, frag.dtype, frag.checksum,
                    chunk_bytes=frag.chunk_bytes, chunk_xxh3=frag.chunk_xxh3, decode=decode,
                )
            )
        return out

    async def _file_sources(self, index: CheckpointIndex) -> dict[str, int]:
        """Several nodes: which node to read each data file of the step from (this one when it
        has the file). Checked before any byte is served, so a load either finds one complete
        copy on the nodes present or fails with every missing tensor and the node that wrote it.
        Asked on every load that needs another node's files: nodes come and go between loads."""
        assert self.cluster is not None
        data_files = [f for f in index.files if f.name.endswith(".safetensors")]
        step_dir = self.storage.step_dir(index.job, index.step)
        local = await asyncio.to_thread(_present, step_dir, data_files)
        where = {name: self.node for name in local}
        unreachable: dict[int, str] = {}
        if len(local) < len(data_files):
            for node in range(self.cluster.nodes):
                if node == self.node:
                    continue
                answer = await self.cluster.inventory(node, index.job, index.step)
                if isinstance(answer, str):
                    unreachable[node] = answer
                    continue
                _, _, sizes, _ = answer
                for f in data_files:
                    if f.name not in where and sizes.get(f.name) == f.size:
                        where[f.name] = node
        missing = [f for f in data_files if f.name not in where]
        if missing:
            raise Precondition(_incomplete_message(index, missing, unreachable, self.cluster.describe))
        return where

    async def _fetched(self, index: CheckpointIndex, file: str, node: int, offset: int, nbytes: int) -> str:
        """A copy of bytes [offset, offset + nbytes) of `node`'s file (this node's, or a peer's),
        at the same offset of a staging file in shared memory; made once however many local
        ranks ask, removed once no load of the step uses it (_release_staging)."""
        staging = self._staging_path(index.job, index.step, file)
        key = (index.job, index.step, file, offset)
        task = self._fetches.get(key)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.get_running_loop().create_task(self._fetch_into(staging, node, index, file, offset, nbytes))
            self._fetches[key] = task
        await asyncio.shield(task)
        return str(staging)

    def _staging_path(self, job: str, step: int, file: str) -> Path:
        return self.config.shm_dir / f"{ARENA_PREFIX}{os.getpid()}-fetch-{job}-{step}-{file}"

    async def _fetch_into(self, staging: Path, node: int, index: CheckpointIndex, file: str, offset: int, nbytes: int) -> None:
        fd = await asyncio.to_thread(os.open, staging, os.O_WRONLY | os.O_CREAT, 0o640)
        try:
            if node == self.node:
                try:
                    await asyncio.to_thread(self.storage.copy_range, index.job, index.step, file, fd, offset, nbytes)
                except (FormatError, OSError) as exc:
                    # A data file of the step is missing, unreadable or short: name it and say what
                    # to do, as a damaged extra.json or index does (_extras, index).
                    path = self.storage.step_dir(index.job, index.step) / file
                    problem = (
                        f"{path} is missing" if isinstance(exc, FileNotFoundError)
                        else f"cannot read {path}: {exc.strerror or exc}" if isinstance(exc, OSError)
                        else str(exc)
                    )
                    older = [s for s in await asyncio.to_thread(self.storage.committed_steps, index.job) if s < index.step]
                    example = f"load(state, step={older[-1]})" if older else "load(state, step=N)"
                    raise Precondition(
                        f"step {index.step} of job {index.job!r} cannot be loaded: {problem}; load an older step (`{example}`), "
                        f"and see what else is damaged with `ckptd verify {path.parent}`"
                    ) from None
            else:
                assert self.cluster is not None
                await self.cluster.fetch(node, index.job, index.step, file, offset, nbytes, fd)
        finally:
            os.close(fd)

    async def index(self, job: str, step: int) -> CheckpointIndex:
        """The committed step's index (cached). Raises Precondition if it is damaged, OSError if absent."""
        key = (job, step)
        index = self._index_cache.get(key)
        if index is None:
            try:
                index = await asyncio.to_thread(self.storage.read_index, job, step)
            except FormatError as exc:
                raise Precondition(f"step {step} of job {job!r} has a damaged index: {exc}") from None
            self._index_cache.put(key, index)
        return index

    async def _extras(self, job: str, step: int) -> dict[int, Any]:
        """Every rank's extras from the step's extra.json, its bytes checked against the index
        first (a file the index does not list is not part of the step: no extras)."""
        record = next((f for f in (await self.index(job, step)).files if f.name == EXTRA_JSON), None)
        if record is None:
            return {}
        path = self.storage.step_dir(job, step) / EXTRA_JSON
        try:
            return parse_extra_json(await asyncio.to_thread(read_file, path), record)  # no link followed, no FIFO waited on
        except (OSError, FormatError) as exc:
            problem = f"{EXTRA_JSON} is missing" if isinstance(exc, FileNotFoundError) else str(exc)
            older = [s for s in await asyncio.to_thread(self.storage.committed_steps, job) if s < step]
            example = f"load(state, step={older[-1]})" if older else "load(state, step=N)"
            raise Precondition(
                f"step {step} of job {job!r} cannot be loaded: {problem}; load an older step (`{example}`), "
                f"and see what else is damaged with `ckptd verify {path.parent}`"
            ) from None

    def load_done(self, load_id: str) -> None:
        lease = self.leases.pop(load_id, None)
        if lease is None:
            return
        if lease.arenas is not None:
            lease.arenas.readers = max(0, lease.arenas.readers - 1)
        self._release_staging(lease.job, lease.step)

    def _release_staging(self, job: str, step: int) -> None:
        """Remove the step's peer-fetch staging files (shared memory) once no load of the step
        is being planned or reading: they would otherwise hold host memory until shutdown. A
        later load of the step fetches again."""
        if (job, step) in self._planning or any(lease.job == job and lease.step == step for lease in self.leases.values()):
            return
        keys = [k for k in self._fetches if k[:2] == (job, step)]
        if any(not self._fetches[k].done() for k in keys):  # fetches run inside plan_load: not expected
            return
        for key in keys:
            del self._fetches[key]
            self._staging_path(job, step, key[2]).unlink(missing_ok=True)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for load_id, lease in list(self.leases.items()):
            if lease.expires < now:
                self.load_done(load_id)

    # ------------------------------------------------------------ queries

    async def list_checkpoints(self, job: str) -> list[tuple[CheckpointIndex, Path, bool]]:
        """The job's committed steps in commit order, oldest first: the last is the newest (what
        load() without a step restores), whatever its number."""
        steps = await asyncio.to_thread(self.storage.commit_order, job)
        state = self.jobs.get(job)
        out = []
        for step in steps:
            try:
                index = await self.index(job, step)
            except Precondition as exc:
                log.warning("%s", exc)
                continue
            in_memory = state is not None and state.pool.held(step) is not None
            out.append((index, self.storage.step_dir(job, step), in_memory))
        return out

    def status(self) -> dict[str, Any]:
        in_flight = []
        now = time.monotonic()
        for job, state in self.jobs.items():
            for session in state.sessions.values():
                in_flight.append(
                    {
                        "job": job,
                        "step": session.step,
                        "state": session.state,
                        "bytes_total": session.bytes_total,
                        "bytes_written": session.progress.written if session.progress else 0,
                        "age_s": now - session.created,
                        "ranks_arrived": len(session.committed) if session.state == "snapshotting" else len(session.arrived),
                        "ranks_expected": session.local_ranks,
                        "write_s": now - session.write_started if session.write_started else 0.0,
                    }
                )
        return {
            "version": VERSION,
            "root": str(self.storage.root),
            "in_flight": in_flight,
            "arena_bytes": sum(s.pool.nbytes for s in self.jobs.values()),
            "arena_count": sum(s.pool.count for s in self.jobs.values()),
            "committed_total": self.counters.committed,
            "failed_total": self.counters.failed,
            "skipped_total": self.counters.skipped,
            "last_error": self.counters.last_error,
            "draining": self.draining,
            "queue_depth": sum(1 for s in self.jobs.values() for x in s.sessions.values() if x.state == "writing"),
            "last_commit": self.last_commit,
            "node_rank": self.node,
            "nodes": self.cluster.nodes if self.cluster is not None else 1,
            "bytes_written_total": self.counters.bytes_written,
            "uptime_s": time.time() - self.started_at,
            "loads_active": len(self.leases),
        }


async def _notify(condition: asyncio.Condition) -> None:
    async with condition:
        condition.notify_all()


def _present(step_dir: Path, files: Sequence[FileRecord]) -> list[str]:
    """The names of `files` that are in `step_dir` with their recorded size."""
    present = []
    for f in files:
        try:
            if (step_dir / f.name).stat().st_size == f.size:
                present.append(f.name)
        except FileNotFoundError:
            continue
    return present


def _needs_decoding(index: CheckpointIndex, wanted: Sequence[TensorSpec]) -> tuple[bool, bool]:
    """Whether the pieces of `wanted` include quantized codes or residuals (which a load always
    reads as stored, whatever the tier), and whether some of those codes are in zstd frames.
    "cast" fragments (a dropped master weight: the model weight's bytes) need no decoding."""
    table = index.by_name()
    coded = [
        f.quant for spec in wanted if spec.name in table for f in table[spec.name].fragments
        if f.quant is not None and f.quant.codec != CAST and intersect(f.box, spec.box) is not None
    ]
    return bool(coded), any(q.frames is not None for q in coded)


def _incomplete_message(index: CheckpointIndex, missing: Sequence[FileRecord], unreachable: dict[int, str], describe: Any) -> str:
    lost = {f.name for f in missing}
    tensors = sorted({t.name for t in index.tensors for frag in t.fragments if frag.file in lost})
    writers = sorted({f.node for f in missing})
    parts = [
        f"step {index.step} of job {index.job!r} is not complete on the nodes present: "
        f"{len(missing)} files ({_names([f.name for f in missing], 5)}) with tensors {_names(tensors, 10)} were written by "
        + ", ".join(describe(n) for n in writers)
    ]
    for node, why in sorted(unreachable.items()):
        parts.append(f"{describe(node)} did not answer ({why})")
    parts.append("start the missing nodes' daemons on their storage, or load an older step")
    return "; ".join(parts)


def _names(names: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
