"""The state machine of one save, and a job's saves.

A save of step S of a job is collective: every rank of this node joins it (`arrive`); once all
have, the engine plans it and takes an arena set (`start_snapshot`, or `skip` when none is free
under the "skip" policy); each rank copies its slots and hands its part over (`hand_over`); the
last hand-over closes the snapshot and the engine writes it (state "writing"); the save ends
committed (`commit`), failed (`fail`, from any state before the end) or skipped. `JobState.finish`
files an ended save among the job's recent results.

    gathering --start_snapshot--> snapshotting --hand_over (last rank)--> writing --commit--> committed
        |  \\--skip--> skipped          |                                     |
        +--------------fail------------+-------------------------------------+--> failed

Pure except for asyncio events (no I/O, no metrics): tests/daemon/test_sessions.py drives every
transition in process. The side effects of an outcome (counters, metrics, releasing the arenas,
telling the coordinator) are the engine's (engine/context.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterator, Mapping

from ckptd.daemon.engine.plan_inputs import JobPlans
from ckptd.daemon.errors import InvalidRequest, Precondition, listed
from ckptd.daemon.handoff.arena import ArenaPool, ArenaSet, SetState
from ckptd.daemon.plan.compression import Compression, SaveOptions
from ckptd.daemon.plan.save_plan import SavePlan, TensorSpec
from ckptd.daemon.records import LastCommit
from ckptd.daemon.write.request import Progress

RECENT_RESULTS = 16  # ended saves a job remembers (WaitDurable of a save that just ended)


class SaveState(StrEnum):
    """Where a save is; the values are the wire's `SaveProgress.state` strings."""

    GATHERING = "gathering"  # ranks are joining
    SNAPSHOTTING = "snapshotting"  # planned, arenas taken: ranks are copying
    WRITING = "writing"  # every rank handed over: the snapshot is being written
    COMMITTED = "committed"
    FAILED = "failed"
    SKIPPED = "skipped"


ENDED = (SaveState.COMMITTED, SaveState.FAILED, SaveState.SKIPPED)


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
    run: str = ""  # the run whose ranks save it (engine/runs.py; "" a client older than run ids)
    resumed: bool = False  # that run loaded a step of the job before its first save
    kept: str = ""  # committed before: a resumed run's save of a step it redid, kept as it was (why, for the rank)
    global_id: str = ""  # several nodes: the coordinator's id of the save
    reported: bool = False  # several nodes: this node's part (or failure) went to the coordinator
    shared_root: bool = False  # several nodes writing into one storage root
    snapshot_done: float = 0.0  # when the last rank handed its part over (monotonic)
    write_started: float = 0.0  # when writing started (monotonic); 0 before
    arrived: dict[int, str] = field(default_factory=dict)  # rank -> digest of its metadata (plan.spec_digest)
    clients: dict[int, str] = field(default_factory=dict)  # rank -> the client id it arrived from (when it sent one)
    committed: dict[int, Any] = field(default_factory=dict)  # rank -> extras tree
    model_files: dict[str, bytes] = field(default_factory=dict)  # e.g. config.json, from rank 0
    plan: SavePlan | None = None
    arenas: ArenaSet | None = None
    skip_reason: str | None = None
    memory_short: str | None = None  # why its snapshot waits for an arena set, while it does (engine/memory.py: shortage)
    state: SaveState = SaveState.GATHERING
    error: str = ""
    refused: bool = False  # failed because the request itself was bad (INVALID_ARGUMENT)
    run_refused: bool = False  # failed because node 0 refused the run (errors.RunRefused)
    step_dir: str = ""
    progress: Progress | None = None
    options: SaveOptions = SaveOptions()
    lineage: int = 0  # quantization generation of the checkpoint the ranks last loaded
    compression: Compression | None = None  # decided when the save is planned (plan/compression.py)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # plan + arenas decided (or failed)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # no longer open: handed over, failed or skipped
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # committed, failed or skipped

    @property
    def open(self) -> bool:
        """Ranks may still join or hand over."""
        return self.state in (SaveState.GATHERING, SaveState.SNAPSHOTTING)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def joining(self) -> bool:
        """Every rank of this node has arrived and the save is not planned yet: with several
        nodes, this node waits at the coordinator for the other nodes' ranks."""
        return self.state is SaveState.GATHERING and self.plan is None and len(self.arrived) == self.local_ranks

    @property
    def bytes_total(self) -> int:
        """The bytes `progress` counts toward: the plan's while writing, the files' once written (Progress.settle)."""
        return self.progress.total if self.progress is not None else 0

    # The transitions. Each checks that it is allowed now and raises a CkptdError that says why
    # not (the engine passes it to the rank); `fail` never raises.

    def arrive(self, rank: int, fingerprint: str, options: SaveOptions, lineage: int, local_ranks: int) -> bool:
        """Rank `rank` joins; True when it is the last of this node's ranks to do so."""
        if rank in self.arrived:  # not the caller's state: a rank of the run restarted (engine/saves.py ends such a save first)
            raise Precondition(f"rank {rank} joined the save of step {self.step} twice")
        if self.state is not SaveState.GATHERING:
            raise Precondition(f"save of step {self.step} is {self.state}, ranks can no longer join it")
        if not self.arrived:
            self.options = options
        elif options != self.options:
            raise InvalidRequest(
                f"rank {rank} asks for {options.describe()} in step {self.step} "
                f"but an earlier rank asked for {self.options.describe()}; "
                "every rank must pass the same"
            )
        if local_ranks != self.local_ranks:
            raise InvalidRequest(f"rank {rank} says this node serves {local_ranks} ranks, an earlier rank said {self.local_ranks}")
        self.lineage = max(self.lineage, lineage)
        self.arrived[rank] = fingerprint
        return len(self.arrived) == self.local_ranks

    def plan_with(self, plan: SavePlan) -> None:
        """The save's plan is known (arenas not yet taken)."""
        self.plan = plan
        self.progress = Progress(plan.total_bytes)

    def start_snapshot(self, arenas: ArenaSet) -> bool:
        """The arenas are taken: ranks may copy. False (arenas unused) if the save ended meanwhile."""
        if self.state is not SaveState.GATHERING:
            return False
        self.arenas = arenas
        self.state = SaveState.SNAPSHOTTING
        return True

    def skip(self, reason: str) -> None:
        """No arena set was free under the "skip" policy: the save ends without a snapshot."""
        self.skip_reason = reason
        self.state = SaveState.SKIPPED

    def check_hand_over(self, rank: int) -> None:
        """Raise unless `rank` may hand its part over now."""
        if self.state is not SaveState.SNAPSHOTTING:
            raise Precondition(f"save of step {self.step} is {self.state}, it cannot take a snapshot now")
        if rank not in self.arrived:
            raise InvalidRequest(f"rank {rank} did not join the save of step {self.step}")
        if rank in self.committed:
            raise InvalidRequest(f"rank {rank} handed its snapshot of step {self.step} over twice")

    def hand_over(self, rank: int, extras: Any, model_files: Mapping[str, bytes] | None = None) -> bool:
        """Rank `rank`'s part is in its arena; True when the snapshot is complete (now "writing")."""
        self.check_hand_over(rank)
        self.committed[rank] = extras
        if rank == 0 and model_files:
            self.model_files = dict(model_files)
        if len(self.committed) < self.local_ranks:
            return False
        assert self.arenas is not None
        self.state = SaveState.WRITING
        self.snapshot_done = self.write_started = time.monotonic()
        self.arenas.state = SetState.PERSISTING
        self.arenas.step = self.step
        self.closed.set()
        return True

    def fail(self, reason: str) -> bool:
        """End the save as failed; False (nothing changed) when it had already ended."""
        if self.ended:
            return False
        self.state = SaveState.FAILED
        self.error = reason
        self.ready.set()
        return True

    def commit(self, step_dir: str) -> None:
        """The step is committed (its index is on disk)."""
        if self.state is not SaveState.WRITING:
            raise Precondition(f"save of step {self.step} is {self.state}; only a snapshot being written can be committed")
        self.state = SaveState.COMMITTED
        self.step_dir = step_dir

    def timeout_reason(self) -> str:
        """Why the save did not complete in time (for the watchdog's failure)."""
        waiting = sorted(set(range(self.world_size)) - set(self.committed))
        missing = sorted(set(range(self.world_size)) - set(self.arrived))
        if self.state is SaveState.GATHERING and self.plan is not None and self.arenas is None and self.memory_short:
            return f"no shared memory for its snapshot within {self.timeout_s:.0f} s: {self.memory_short}"
        if self.joining and missing:  # several nodes: this node's ranks are all here
            what = f"ranks {listed(missing)} of the other nodes never joined it"
        else:
            what = f"ranks {listed(missing)} never started it" if missing else f"ranks {listed(waiting)} did not hand their snapshot over"
        return f"{what} within {self.timeout_s:.0f} s"


@dataclass
class JobState:
    """A job's saves on this daemon, its cached metadata and plans, and its arenas.

    The caches are the job's own: what another job sends never reaches them. Metadata is kept
    under the daemon's digest of it (plan.spec_digest); a rank's fingerprint only names the
    digest of what that rank sent with it (`names`)."""

    world_size: int
    pool: ArenaPool
    names: dict[tuple[int, str], str] = field(default_factory=dict)  # (rank, its fingerprint) -> digest of the metadata sent with it
    cache: JobPlans = field(init=False)  # metadata by (rank, digest), plans by the coordinator's plan key (the coordinator's kind)
    announced: set[tuple[int, str]] = field(default_factory=set)  # (rank, digest) whose metadata the coordinator has
    sessions: dict[int, SaveSession] = field(default_factory=dict)  # open or writing, by step
    recent: dict[int, SaveSession] = field(default_factory=dict)  # ended, newest RECENT_RESULTS, in the order they ended
    acquire_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    arena_freed: asyncio.Condition = field(default_factory=asyncio.Condition)
    lineage: int = 0  # quantization generation of the step this job last loaded from this daemon
    last_commit: LastCommit | None = None  # this job's newest commit here (`ckptd status --job`)
    last_error: str = ""  # why this job's last failed save failed

    def __post_init__(self) -> None:
        self.cache = JobPlans(self.world_size)

    @property
    def specs(self) -> dict[tuple[int, str], tuple[TensorSpec, ...]]:
        """(rank, digest) -> metadata."""
        return self.cache.specs

    @property
    def plans(self) -> OrderedDict[str, SavePlan]:
        """Plan key (plan_input.plan_key over digests) -> plan, at most plan_input.PLANS_KEPT."""
        return self.cache.plans

    def resize(self, world_size: int, job: str) -> None:
        """An elastic restart with another world size: forget the cached metadata and plans
        (arenas stay: snapshots being written or held for restores are still valid)."""
        if world_size == self.world_size:
            return
        if any(s.open for s in self.sessions.values()):
            raise Precondition(  # not the caller's state: an elastic restart while the old world's save is still open
                f"job {job!r} has a save in flight with world size {self.world_size}, this rank says {world_size}: "
                "save again once that save has finished or timed out (all ranks of a save must agree on the world size)"
            )
        self.world_size = world_size
        self.names.clear()
        self.cache = JobPlans(world_size)

    def describe(self, rank: int, fingerprint: str, specs: tuple[TensorSpec, ...], digest: str) -> bool:
        """Rank `rank` sent `specs` (digest: their plan.spec_digest) under `fingerprint`: its
        saves are planned from what it sends. True when the fingerprint named other metadata
        before; then the job's cached plans are dropped too (a plan is taken only for the
        metadata it was made from)."""
        before = self.names.get((rank, fingerprint))
        self.names[(rank, fingerprint)] = digest
        self.specs[(rank, digest)] = specs
        changed = before is not None and before != digest
        if changed:
            self.plans.clear()
        return changed

    def saved_specs(self, rank: int, fingerprint: str) -> tuple[TensorSpec, ...] | None:
        """The metadata `rank` last sent with `fingerprint` to a save (validated then), or None."""
        digest = self.names.get((rank, fingerprint))
        return None if digest is None else self.specs.get((rank, digest))

    def committed_recently(self, step: int) -> bool:
        return step in self.recent and self.recent[step].state is SaveState.COMMITTED

    def find(self, save_id: str) -> SaveSession | None:
        """The save with this id, in flight or recently ended."""
        for session in list(self.sessions.values()) + list(self.recent.values()):
            if session.save_id == save_id:
                return session
        return None

    def left_behind(self, rank: int, step: int | None, run: str = "") -> Iterator[SaveSession]:
        """Open saves other than `step` that `rank` (of `run`) joined but never handed over: a
        rank that starts another save or a load will never finish them. Another run's rank of
        the same number is not this rank: its saves are not left behind."""
        for other in list(self.sessions.values()):
            if run and other.run and other.run != run:
                continue
            if other.step != step and other.open and rank in other.arrived and rank not in other.committed:
                yield other

    def finish(self, session: SaveSession) -> None:
        """File an ended save among the recent results and wake whoever waits for it. Its extras
        and model files go (the held snapshot keeps its own): a state's extras are ~280 KiB of
        objects per 1,000 tensors, and RECENT_RESULTS saves of them grew the daemon by 4 MiB."""
        session.committed = dict.fromkeys(session.committed)  # which ranks handed over, without their extras
        session.model_files = {}
        self.sessions.pop(session.step, None)
        self.recent.pop(session.step, None)  # re-inserted: `recent` is in the order saves finished
        self.recent[session.step] = session
        while len(self.recent) > RECENT_RESULTS:
            self.recent.pop(next(iter(self.recent)))  # the earliest finished (a rolled-back job's newest save has a low step)
        session.closed.set()
        session.finished.set()

    def last_committed(self) -> SaveSession | None:
        """The save that committed most recently here, if one is remembered."""
        done = [s for s in self.recent.values() if s.state is SaveState.COMMITTED]
        return done[-1] if done else None

    def writing(self) -> list[SaveSession]:
        return [s for s in self.sessions.values() if s.state is SaveState.WRITING]
