"""Typed records that cross the daemon's wire edge (no grpc here; `rpc_convert` turns them into
messages and back): the coordinator's answers to a join and a report, a peer's inventory of a
step, and the daemon's status snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ckptd.format.index import CheckpointIndex
from ckptd.daemon.plan.compression import Compression
from ckptd.daemon.plan.save_plan import SavePlan, TensorSpec


@dataclass(frozen=True)
class JoinResult:
    """The coordinator's answer to a node joining a save: the plan's input."""

    save_id: str
    plan_key: str
    node_of_rank: tuple[int, ...]  # every rank's; on the wire, empty when the plan key was known (it covers the nodes)
    specs: tuple[tuple[TensorSpec, ...], ...] | None  # every rank's, None when the plan key was known
    shared_root: bool
    compression: Compression | None = None  # the save's, decided by the coordinator (None: an older coordinator)
    plan: SavePlan | None = field(default=None, compare=False)  # in process only (node 0): the coordinator's plan itself
    # every rank's metadata digest (plan.spec_digest), in rank order (empty: not known): ranks of
    # equal digests (data-parallel replicas) have equal metadata, which the wire then carries once
    fingerprints: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepSummary:
    """What a listing (List, the bucket tier's listing, keep-best retention) shows of a committed
    step: its index less the tensor records and the files, small however large the step."""

    step: int
    created_at: float  # unix seconds: the commit
    size_bytes: int
    file_count: int  # the step's files, its index included
    metric: float | None

    @classmethod
    def of(cls, index: CheckpointIndex) -> "StepSummary":
        return cls(index.step, index.created_at, index.size_bytes, len(index.files) + 1, index.metric)


@dataclass(frozen=True)
class Outcome:
    """How a save across nodes ended, as the coordinator answers a node's report."""

    committed: bool
    error: str = ""
    step_files: dict[str, bytes] = field(default_factory=dict)  # for nodes with their own root
    # False: nobody who saw the save decided it (the coordinator did not answer, or restarted and
    # knows no such save): node 0 may have committed the step before it went away, so a node's
    # written part must stay until node 0's root says (Service.resolve_prepared)
    decided: bool = True
    index: CheckpointIndex | None = field(default=None, compare=False)  # in process only (node 0): the committed index


@dataclass(frozen=True)
class PeerInventory:
    """What a peer daemon holds of one step (its Inventory answer)."""

    root_id: str  # the peer's storage root id: equal to ours when the root is shared
    committed: bool  # the step's index is on the peer's root
    sizes: dict[str, int]  # data file name -> bytes (empty unless committed, or its part prepared: written, its commit not recorded yet)
    in_flight: bool  # the peer is saving (or, on node 0, deciding) the step now
    replicas: tuple[tuple[int, str, int], ...] = ()  # (node, file, size) the peer holds in memory for other nodes (the replica tiers)
    newest: int | None = None  # when asked: the peer's newest committed step of the job (None: none)
    loading: bool = False  # a load of the step is in progress on the peer (a shared root's retention keeps it)


@dataclass(frozen=True)
class BulkAnswer:
    """A daemon's answer to OfferReplica / ReadReplica: a ticket for its bulk port (tiers/bulk.py)."""

    accepted: bool
    reason: str = ""  # why it was refused
    held: bool = False  # OfferReplica: that replica is held already (nothing to send)
    port: int = 0
    ticket: bytes = b""


@dataclass(frozen=True)
class InFlightSave:
    """One save this daemon has not finished (ckptd status)."""

    job: str
    step: int
    state: str
    bytes_total: int
    bytes_written: int
    age_s: float  # seconds since the save began
    ranks_arrived: int  # ranks of this node that joined the save
    ranks_expected: int  # ranks of this node the save waits for
    write_s: float  # seconds since writing started (0 before)
    bytes_linked: int = 0  # linked from the previous step instead of written (incremental saves)


@dataclass(frozen=True)
class ArenaHolder:
    """One job's arena sets in `ckptd status`: who holds how much shared memory, and since when idle."""

    job: str
    bytes: int  # shared memory of its arena sets
    sets: int
    held_steps: tuple[int, ...]  # committed snapshots kept for restores from memory
    in_flight: int  # sets being filled or written
    readers: int  # loads reading its held snapshots
    idle_s: float  # seconds since its last save or load here; 0 while a save is open or a set is in use


@dataclass(frozen=True)
class LastCommit:
    """The newest commit this daemon made or recorded."""

    job: str
    step: int
    committed_at: float  # unix seconds
    latency_s: float  # complete snapshot -> committed
    bytes: int
    step_dir: str


@dataclass(frozen=True)
class RemoteStatus:
    """The object-store tier (`ckptd serve --remote`) in `ckptd status`: counters since the daemon started."""

    location: str  # s3://BUCKET/PREFIX
    endpoint: str  # where requests go (AWS_ENDPOINT_URL, or AWS S3 and its region)
    state: str  # starting | catching-up | idle | uploading | restoring | retrying | stopped
    uploaded_steps: int  # steps this daemon made visible in the bucket (their index written)
    uploaded_bytes: int  # bytes sent
    copied_bytes: int  # bytes copied inside the bucket (files unchanged since an uploaded step)
    failures: int  # failed attempts (each retried with backoff)
    pending_steps: int  # committed steps of this node not uploaded yet
    lag_s: float  # seconds since the commit of the oldest of them; 0 when none
    last_uploaded: str  # "job J step N", "" before the first upload
    last_error: str  # the newest failure, "" before any
    restored_steps: int  # steps downloaded into the local root
    restored_bytes: int


@dataclass(frozen=True)
class JobReplicas:
    """The replica tiers of one job in `ckptd status`: where this node's newest part is held; node 0: what is recoverable."""

    job: str
    pushed_step: int  # this node's newest part offered to its buddies; -1: none
    holders: tuple[int, ...]  # the buddies that hold it
    push_error: str  # why a buddy does not ("" when all do)
    pushing: bool  # still being sent
    recoverable_step: int  # node 0: the newest step whose every node's part is held by another node too; -1: none
    not_recoverable: str  # node 0: why the newest step reported is not


@dataclass(frozen=True)
class BulkPortStatus:
    """The bulk port (the replica tiers' bytes, tiers/bulk.py) in `ckptd status`."""

    port: int
    healthy: bool
    problem: str  # why not healthy ("" when it is): accepting failed recently, or it stopped
    accept_errors: int  # failed accepts since the daemon started (no descriptors, ...)
    refused: int  # connections closed before a valid ticket: none or a wrong one, too slow, over the per-source cap
    opening: int  # connections waiting to present their ticket now


@dataclass(frozen=True)
class ReplicaStatus:
    """The replica tiers in `ckptd status`: other nodes' parts held here, and this node's parts' holders."""

    held_bytes: int  # memory held and being received into for other nodes' parts
    memory_limit: int  # --replica-memory
    held: tuple[tuple[str, int, int, int], ...]  # (job, node, step, bytes) of the other nodes' parts held here
    jobs: tuple[JobReplicas, ...]
    bulk_port: BulkPortStatus | None = None  # None: this node holds no replicas (--replicas 0)


@dataclass(frozen=True)
class StatusSnapshot:
    """The daemon's state for `ckptd status` (StatusResponse)."""

    version: str
    root: str
    in_flight: tuple[InFlightSave, ...]
    arena_bytes: int
    arena_count: int
    committed_total: int
    failed_total: int
    skipped_total: int
    last_error: str
    draining: bool
    queue_depth: int  # snapshots handed over and not yet committed (being written)
    last_commit: LastCommit | None  # None before the first commit
    node_rank: int
    nodes: int  # 1: a single node
    bytes_written_total: int
    uptime_s: float
    loads_active: int  # loads being read (their steps are kept by retention)
    remote: "RemoteStatus | None" = None  # the object-store tier (--remote); None without one
    replicas: "ReplicaStatus | None" = None  # the replica tiers; None on a single node
    link_mismatches_total: int = 0  # linked files incremental saves found damaged and wrote again
    arena_holders: tuple[ArenaHolder, ...] = ()  # the jobs with arena sets
    shm_budget: int = 0  # --shm-budget in bytes; 0: none (the shared-memory directory's size)
    shm_free: int = 0  # bytes free in the shared-memory directory
    shm_staging: int = 0  # bytes counted for loads' staging files (within the budget)

    def of_job(self, job: str, last_commit: LastCommit | None, last_error: str) -> "StatusSnapshot":
        """The same snapshot told of `job` alone: its saves in flight, arena sets and replicas,
        its newest commit and its last failure (`last_commit`, `last_error`: the job's own);
        the daemon-wide counters and totals stay."""
        replicas = self.replicas
        if replicas is not None:
            replicas = replace(replicas, held=tuple(h for h in replicas.held if h[0] == job), jobs=tuple(j for j in replicas.jobs if j.job == job))
        return replace(
            self, in_flight=tuple(f for f in self.in_flight if f.job == job), arena_holders=tuple(h for h in self.arena_holders if h.job == job),
            last_commit=last_commit, last_error=last_error, replicas=replicas,
        )
