"""The daemon's engine behind one facade: what the servicers (rpc/checkpoint.py, rpc/peer.py) and
the server's lifecycle (app/server.py) call.

The engine's parts, each a module of `ckptd.daemon.engine`:

    sessions      the state machine of a save and a job's saves
    compression   the one compression decision of a save (pure)
    saves         BeginSave, CommitSnapshot, AbortSave, WaitDurable's progress
    commit        writing a complete snapshot; the coordinator commits it (one protocol for one node or many)
    loads         PlanLoad and LoadDone: the step from the tiers, staging through them, leases
    tiers, root   the tiers' protocol (implemented in tiers/, remote/ and engine/root.py)
    housekeeping  retention, gc, status
    context       what they share (settings, storage, metrics, the jobs) and a save's outcomes

Runs on the event loop; blocking work (arena allocation, writing, reading indexes) goes to
threads. The servicers validate requests (rpc/validate.py), call this and convert (rpc/convert.py);
`CkptdError`s become gRPC status codes in one interceptor (rpc/errors.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.engine.commit import Commit, ThreadPool
from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.coordinator import SingleNode
from ckptd.daemon.engine.housekeeping import Collected, Housekeeping
from ckptd.daemon.engine.loads import Loads
from ckptd.daemon.engine.prefetch import prefetch_parts
from ckptd.daemon.engine.requests import BeginSave, CommitSnapshot, PlanLoad
from ckptd.daemon.engine.root import Root
from ckptd.daemon.engine.runs import Client, Runs
from ckptd.daemon.engine.saves import Saves
from ckptd.daemon.engine.sessions import JobState, SaveSession
from ckptd.daemon.engine.tiers import Listing, Tier, Tiers
from ckptd.format.index import CheckpointIndex
from ckptd.daemon.handoff.arena import HeldPart, remove_stale_arenas
from ckptd.daemon.handoff.gpu_ipc import GpuStaging
from ckptd.daemon.metrics import LiveState, Metrics
from ckptd.daemon.plan.compression import Compression, SaveOptions
from ckptd.daemon.plan.load_plan import LoadPlan
from ckptd.daemon.plan.retention import JobRetention, RetentionPolicy, merge
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.daemon.records import StatusSnapshot
from ckptd.daemon.rpc.peer_client import PeerClient
from ckptd.daemon.rpc.tls import PeerTls
from ckptd.daemon.storage import Storage, StorageBackend
from ckptd.daemon.tiers.held import HeldSnapshots
from ckptd.daemon.tiers.peer_disks import PeerDisks
from ckptd.daemon.tiers.replica_links import ReplicaLinks
from ckptd.daemon.tiers.replica_store import ReplicaStore
from ckptd.daemon.tiers.replica_tiers import ReplicasHere, ReplicasOnPeers
from ckptd.daemon.tiers.replicas import Replication

if TYPE_CHECKING:
    from ckptd.daemon.remote.tier import RemoteTier

__all__ = ["CheckpointService"]

log = logging.getLogger(__name__)

# Settings a running daemon cannot change (reconfigure keeps their old values; restart instead).
RESTART_SETTINGS = (
    "root", "socket", "shm_dir", "max_inflight", "node_rank", "peers", "peer_token", "peer_tls_cert", "peer_tls_key", "peer_tls_ca",
    "metrics_port", "metrics_host", "health_port", "log_json", "remote", "remote_streams", "remote_part_bytes",
    "replicas", "replica_memory", "replica_port", "replica_prefetch", "background_nice", "background_ionice", "background_cpus",
)


class CheckpointService:
    """One daemon's engine: builds the parts and routes each call to the one that owns it."""

    def __init__(self, config: DaemonConfig, storage: StorageBackend | None = None) -> None:
        """storage: where checkpoints live (default: the POSIX root `config.root`)."""
        storage = storage if storage is not None else Storage(config.root)
        tls = PeerTls.from_files(*config.peer_tls_files) if config.peer_tls_files is not None else None
        runs = Runs()  # the runs attached here and the jobs' owners: the engine's and the coordinator's
        cluster = (
            PeerClient(config.node_rank, config.peers, config.peer_token, storage, self._retention_after_coordinator_commit, tls, self._decide, runs,
                    self._job_policy)
            if config.multi_node else None
        )
        coordination = cluster if cluster is not None else SingleNode(storage, self._retention_after_coordinator_commit, self._decide, runs, self._job_policy)
        self.engine = Engine(config, storage, cluster, coordination, runs)
        self._writer = ThreadPool(config.background_priority)
        # the tiers (engine/tiers.py), in TierName's order: the arenas, replicas of nodes' parts in
        # the daemons' memory and the peers' roots (several nodes), this root, the object store
        self.replication = (
            Replication(self.engine, ReplicaStore(config.shm_dir, config.replica_memory, self.engine.metrics), ReplicaLinks(cluster))
            if cluster is not None else None
        )
        self.remote: RemoteTier | None = None
        if config.remote:  # the object-store tier; obstore is imported only when it starts
            from ckptd.daemon.remote.tier import RemoteTier

            self.remote = RemoteTier(config, self.engine)
        root = Root(self.engine)
        tiers: list[Tier] = [HeldSnapshots(self.engine)]
        if self.replication is not None:
            tiers += [ReplicasHere(self.replication), ReplicasOnPeers(self.replication)]
        tiers.append(root)
        if cluster is not None:
            tiers.append(PeerDisks(self.engine))
        if self.remote is not None:
            tiers.append(self.remote)
        self.tiers = Tiers(tiers)
        self.loads = Loads(self.engine, self._abort_left_behind, self.tiers, root)
        self.engine.memory.track_staging_files(self.loads.staging.written_bytes, self.loads.drop_kept_staging)  # one budget for arenas and staging
        self.housekeeping = Housekeeping(self.engine, self.loads.leased_steps, lambda: len(self.loads.leases), self.tiers)
        self.commit = Commit(self.engine, self.housekeeping.after_commit, self._writer, self.tiers)
        self.saves = Saves(self.engine, self.commit.write)

    # What the servicers and the server read.

    @property
    def config(self) -> DaemonConfig:
        return self.engine.config

    @property
    def storage(self) -> StorageBackend:
        return self.engine.storage

    @property
    def cluster(self) -> PeerClient | None:
        return self.engine.cluster

    @property
    def metrics(self) -> Metrics:
        return self.engine.metrics

    @property
    def gpu(self) -> GpuStaging:
        """Mode "ipc"'s daemon side (its OpenStaging/CloseStaging RPCs reach it)."""
        gpu = self.engine.transports[GpuStaging.name]
        assert isinstance(gpu, GpuStaging)
        return gpu

    @property
    def jobs(self) -> dict[str, JobState]:
        return self.engine.jobs

    def saved_specs(self, job: str, rank: int, fingerprint: str) -> Sequence[TensorSpec] | None:
        """The metadata that `rank` of `job` sent with `fingerprint` to a save, validated then
        (JobState.saved_specs), or None: a load names the same structure by that fingerprint."""
        state = self.engine.jobs.get(job)
        return None if state is None else state.saved_specs(rank, fingerprint)

    def held_part(self, job: str, rank: int) -> HeldPart | None:
        """Where `rank`'s part of `job`'s newest held snapshot lies (ArenaPool.held_part), or None."""
        state = self.engine.jobs.get(job)
        return None if state is None else state.pool.held_part(rank)

    @property
    def draining(self) -> bool:
        return self.engine.draining

    # Lifecycle.

    def start(self) -> None:
        """Prepare the root and shared memory: remove what crashed daemons left behind. The
        root's node lock is taken first (StorageBackend.claim): a second daemon for this node
        of the root stops here (RootInUse), before anything is removed."""
        config = self.engine.config
        self.engine.storage.claim(config.node_rank, str(config.socket))
        for left in self.engine.storage.janitor.clean_uncommitted(config.save_timeout_s):  # a shared root: only what gc would remove
            log.warning("removed uncommitted leftover %s", left.where)
        config.shm_dir.mkdir(parents=True, exist_ok=True)
        for path in remove_stale_arenas(config.shm_dir, os.getpid()):
            log.warning("removed stale shared-memory arena %s", path)
        if self.engine.cluster is not None:
            self.engine.cluster.start()

    def start_replication(self) -> None:
        """Open the replicas' bulk port (several nodes with --replicas > 0), after `start` and
        after the --peers port is bound (app/server.py)."""
        if self.replication is not None:
            self.replication.start()

    def reconfigure(self, new: DaemonConfig) -> list[str]:
        """Take the settings of `new` that can change while serving (SIGHUP, `systemctl reload`):
        retention, arena policy, timeouts, writing, logging. Returns the changed settings that
        need a restart instead (they keep their old values)."""
        old = self.engine.config
        fixed = [n for n in RESTART_SETTINGS if getattr(new, n) != getattr(old, n)]
        self.engine.config = replace(new, **{n: getattr(old, n) for n in RESTART_SETTINGS})
        self.engine.retention = new.retention_policy()
        if self.remote is not None:
            self.remote.reconfigure(new)
        return fixed

    async def drain(self, grace_s: float) -> None:
        """Stop taking saves; let open snapshots complete (up to `grace_s`) and writing finish."""
        engine = self.engine
        engine.draining = True
        deadline = time.monotonic() + grace_s
        for job in engine.jobs.values():
            for session in list(job.sessions.values()):
                if session.open:
                    try:
                        await asyncio.wait_for(session.closed.wait(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        pass  # still incomplete at the deadline: failed below
                    if session.open:
                        await engine.fail(job, session, "the daemon shut down before every rank handed its snapshot over", "shutdown")
        for job in engine.jobs.values():
            for session in list(job.sessions.values()):
                await session.finished.wait()
        engine.runs.end_all()  # the clients' Attach calls return (they attach again to the next daemon)

    async def start_remote(self) -> None:
        """Start the object-store tier (--remote), once serving: RemoteStartError (a RuntimeError)
        when its credentials are refused or its bucket does not exist."""
        if self.remote is not None:
            await self.remote.start()

    async def close_remote(self) -> None:
        if self.remote is not None:
            await self.remote.close()

    def close(self) -> None:
        self._writer.shutdown()
        for transport in self.engine.transports.values():
            transport.shutdown()
        for job in self.engine.jobs.values():
            job.pool.close()
        self.loads.close()
        if self.replication is not None:
            self.replication.close()
        self.engine.storage.release()

    # Saves.

    async def begin_save(self, request: BeginSave) -> SaveSession:
        """Saves.begin."""
        return await self.saves.begin(request)

    # Runs (engine/runs.py).

    @property
    def runs(self) -> Runs:
        return self.engine.runs

    def attach(self, job: str, client_id: str, client: Client) -> asyncio.Event:
        """A client lives (its Attach call is open): returns the event that ends the call."""
        ended = self.engine.runs.attach(job, client_id, client)
        if self.engine.draining:
            ended.set()
        return ended

    def detach(self, job: str, client_id: str, only: Client | None = None) -> None:
        """A client detached (Detach, or its process ended; `only`: that attachment only): the
        open saves it joined and did not hand its part of over fail (Saves.client_gone, in the
        background), the loads it did not finish are done (Loads.client_gone) and the GPU staging
        buffers it opened are closed (GpuStaging.client_gone)."""
        if self.engine.runs.detach(job, client_id, only) is not None:
            self.loads.client_gone(job, client_id)
            self.engine.spawn(self.saves.client_gone(job, client_id))
            if self.gpu.buffers:
                self.engine.spawn(self.gpu.client_gone(job, client_id))

    async def commit_snapshot(self, request: CommitSnapshot) -> None:
        """Saves.hand_over."""
        await self.saves.hand_over(request)

    async def abort_save(self, job: str, rank: int, save_id: str, reason: str) -> None:
        await self.saves.abort(job, rank, save_id, reason)

    def progress(self, job: str, step: int, timeout_s: float) -> AsyncIterator[SaveSession | str]:
        return self.saves.progress(job, step, timeout_s)

    def saving(self, job: str, step: int) -> bool:
        return self.engine.saving(job, step)

    async def resolve_prepared(self, retry_s: float = 10.0) -> None:
        await self.commit.resolve_prepared(retry_s)

    async def _abort_left_behind(self, state: JobState, rank: int, step: int | None, run: str = "") -> None:
        await self.saves.abort_left_behind(state, rank, step, run)

    def _job_policy(self, asked: JobRetention) -> RetentionPolicy:
        """A job's retention request merged into this daemon's flags (as they are now: SIGHUP reloads them)."""
        return merge(self.engine.retention, asked)

    def _decide(self, options: SaveOptions, lineage: int) -> Compression:
        """Node 0: a save's compression for every node, under this daemon's settings."""
        return self.engine.compression(options, lineage)

    async def _retention_after_coordinator_commit(self, index: CheckpointIndex) -> None:
        self.engine.indexes.put((index.job, index.step), index)  # retention reads the newest step's policy: from memory, not the disk
        await self.housekeeping.after_commit(index.job, index.step)

    # Loads.

    async def plan_load(self, request: PlanLoad) -> LoadPlan:
        """Loads.plan."""
        return await self.loads.plan(request)

    def load_done(self, load_id: str) -> None:
        self.loads.done(load_id)

    async def index(self, job: str, step: int) -> CheckpointIndex:
        return await self.engine.index(job, step)

    async def fetched_range(self, index: CheckpointIndex, name: str, offset: int, nbytes: int) -> bytes:
        """Bytes of a step's file a peer fetches: a data file from the load broadcast's blocks
        (read once for every node that fetches it, engine/broadcast.py), else from the root (no
        link followed, no FIFO waited on; a short file is FormatError, not a short answer)."""
        served = await self.loads.broadcast.serve(index, name, offset, nbytes)
        if served is not None:
            return served
        return await asyncio.to_thread(self.storage.files.read_range, index.job, index.step, name, offset, nbytes)

    # Housekeeping and reports.

    async def retention_at_start(self) -> None:
        await self.housekeeping.retention_at_start()

    async def prefetch_parts(self) -> None:
        """A member on a root that lacks its part of a job's newest step (a replaced node):
        stage it from the replicas before its ranks ask (--replica-prefetch; engine/prefetch.py)."""
        if self.replication is not None and self.engine.config.replica_prefetch and self.engine.config.replicas > 0:
            await prefetch_parts(self.replication.calls.held_parts, self.loads.prefetch)

    async def member_retention_at_start(self) -> None:
        await self.housekeeping.member_retention_at_start()

    async def release_idle_arenas(self) -> None:
        """Give back the arenas of jobs idle for idle_release_s, until cancelled (engine/memory.py)."""
        await self.engine.memory.release_idle_forever()

    async def collect(self, job: str | None, dry_run: bool) -> list[Collected]:
        return await self.housekeeping.collect(job, dry_run)

    async def list_checkpoints(self, job: str) -> Listing:
        return await self.housekeeping.list_checkpoints(job)

    def live_state(self) -> LiveState:
        return self.housekeeping.live_state()

    def status(self, job: str | None = None) -> StatusSnapshot:
        return self.housekeeping.status(job)
