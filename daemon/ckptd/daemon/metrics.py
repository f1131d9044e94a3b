"""Prometheus metrics of the daemon, served over HTTP on `--metrics-port` (0 = off).

One `Metrics` object per daemon with its own registry (no process-global state). Counters and
histograms are updated by the service as events happen (prometheus_client makes that
thread-safe); gauges that describe the service's current state (queue depth, arena memory,
saves in flight) are read at scrape time on the event loop, so a scrape sees a consistent
picture and never races the loop. The HTTP server is prometheus_client's own thread server:
it never blocks the grpc.aio event loop.

Every series, with its unit and meaning, is listed in docs/operations.md (Metrics).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
# Stall: a hand-off is milliseconds to seconds; commit latency: seconds to many minutes.
STALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# Causes of a failed save (label `cause` of ckptd_save_failures_total).
FAILURE_CAUSES = (
    "timeout",  # ranks did not arrive or hand over within --save-timeout
    "rank_aborted",  # a rank gave up (its copy failed) and called AbortSave
    "rank_restarted",  # a rank moved on to another step or a load (it restarted)
    "no_arena",  # no free arena within the timeout (policy wait), or shared memory full
    "invalid",  # the save itself was refused (bad plan, inconsistent ranks)
    "write_error",  # writing or fsyncing the files failed (disk full, I/O error)
    "no_space",  # refused before writing: the files would not fit in the free space less --disk-reserve
    "peer",  # another node failed, stopped answering, or the coordinator aborted the step
    "shutdown",  # the daemon stopped before every rank handed over
    "gpu_staging",  # mode "ipc": copying a rank's device staging buffer into its arena failed
    "run_refused",  # another live run owns the job, or this run was superseded (engine/runs.py)
    "run_ended",  # the run's ranks ended (their clients detached) or another run took the job over before every rank handed over
    "internal",  # a bug: see the daemon's log
)


# Why a job's arena memory went back (label `reason` of ckptd_arena_released_bytes_total).
RELEASE_REASONS = (
    "spare",  # a job's second arena set, idle again: a job keeps one between saves
    "pressure",  # another save needed the memory (over --shm-budget, or the shared-memory directory full)
    "idle",  # the job saved or loaded nothing here for --idle-release
    "gc",  # `ckptd gc`
)


@dataclass(frozen=True)
class LiveState:
    """The service's current state, as read on the event loop at scrape time.

    queue_depth: job -> snapshots handed over and not yet committed (being written).
    open_saves: job -> saves waiting for ranks or copying (not yet handed over).
    arena_bytes / arenas: shared memory reserved for snapshots (bytes / count), all jobs.
    job_arena_bytes / job_idle_s: per job, its arena sets' bytes and seconds since its last save
        or load (0 while in use); shm_budget: --shm-budget in bytes (0: none).
    staging_bytes: shared memory counted for loads' staging files (against the same budget).
    loads_active: loads being read (their steps are protected from retention).
    draining: 1 while shutting down.
    """

    queue_depth: dict[str, int] = field(default_factory=dict)
    open_saves: dict[str, int] = field(default_factory=dict)
    arena_bytes: int = 0
    arenas: int = 0
    loads_active: int = 0
    draining: bool = False
    replica_bytes: int = 0  # memory held (and being received into) for other nodes' replicas
    replicas: int = 0  # other nodes' parts held
    job_arena_bytes: dict[str, int] = field(default_factory=dict)
    job_idle_s: dict[str, float] = field(default_factory=dict)
    shm_budget: int = 0
    staging_bytes: int = 0


class _LiveCollector(Collector):
    """Gauges read from the service at scrape time (see module docstring)."""

    def __init__(self, read: Callable[[], LiveState | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._read()
        if state is None:
            return
        queue = GaugeMetricFamily("ckptd_queue_depth", "Snapshots handed over and not yet committed (being written), per job.", labels=["job"])
        for job, n in sorted(state.queue_depth.items()):
            queue.add_metric([job], n)
        yield queue
        open_saves = GaugeMetricFamily("ckptd_saves_open", "Saves waiting for ranks or being copied into the arenas, per job.", labels=["job"])
        for job, n in sorted(state.open_saves.items()):
            open_saves.add_metric([job], n)
        yield open_saves
        yield GaugeMetricFamily("ckptd_arena_bytes", "Shared memory reserved for snapshot arenas, in bytes (all jobs).", value=state.arena_bytes)
        yield GaugeMetricFamily("ckptd_arenas", "Snapshot arenas allocated (all jobs).", value=state.arenas)
        job_bytes = GaugeMetricFamily("ckptd_job_arena_bytes", "Shared memory held by a job's snapshot arenas, in bytes.", labels=["job"])
        for job, n in sorted(state.job_arena_bytes.items()):
            job_bytes.add_metric([job], n)
        yield job_bytes
        job_idle = GaugeMetricFamily(
            "ckptd_job_arena_idle_seconds", "Seconds since a job holding arenas last saved or loaded here (0 while in use).", labels=["job"]
        )
        for job, s in sorted(state.job_idle_s.items()):
            job_idle.add_metric([job], s)
        yield job_idle
        yield GaugeMetricFamily("ckptd_shm_budget_bytes", "--shm-budget in bytes (0: none, the shared-memory directory's size).", value=state.shm_budget)
        yield GaugeMetricFamily(
            "ckptd_staging_bytes", "Shared memory counted for loads' staging files (bytes fetched for ranks), within --shm-budget.", value=state.staging_bytes
        )
        yield GaugeMetricFamily("ckptd_loads_active", "Loads in progress (their steps are kept by retention).", value=state.loads_active)
        yield GaugeMetricFamily("ckptd_draining", "1 while the daemon is shutting down and takes no new saves.", value=int(state.draining))
        yield GaugeMetricFamily("ckptd_replica_bytes", "Memory held for other nodes' replicas (the replica tiers), received and being received, in bytes.", value=state.replica_bytes)
        yield GaugeMetricFamily("ckptd_replicas", "Other nodes' parts of committed steps held in this daemon's memory (the replica tiers).", value=state.replicas)


class Metrics:
    """The daemon's metrics. Methods are safe to call from any thread."""

    def __init__(self, node: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.node = node
        r = self.registry
        self.stall = Histogram(
            "ckptd_stall_seconds", "Seconds a rank's save() blocked training (the hand-off), as reported by the client.",
            ["job"], buckets=STALL_BUCKETS, registry=r,
        )
        self.bytes_written = Counter("ckptd_written_bytes", "Bytes of checkpoint data this daemon wrote to its storage.", ["job"], registry=r)
        self.bytes_linked = Counter(
            "ckptd_linked_bytes", "Bytes of unchanged files of frozen tensors linked from the previous step instead of written (incremental saves).", ["job"], registry=r
        )
        self.link_mismatches = Counter(
            "ckptd_link_mismatches", "Files an incremental save linked from the previous step and found damaged on disk when it read them back (then written again from the snapshot).",
            ["job"], registry=r,
        )
        self.throughput = Gauge(
            "ckptd_write_throughput_bytes_per_second", "Write rate of the newest step this daemon wrote: its bytes / seconds spent writing and fsyncing.",
            ["job"], registry=r,
        )
        self.commit_latency = Histogram(
            "ckptd_commit_latency_seconds", "Seconds from a complete snapshot (every rank handed over) to the commit (index written, durable).",
            ["job"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.commits = Counter("ckptd_commits", "Steps committed (made durable and visible).", ["job"], registry=r)
        self.last_commit = Gauge("ckptd_last_commit_timestamp_seconds", "Unix time of the newest commit.", ["job"], registry=r)
        self.last_step = Gauge("ckptd_last_committed_step", "The newest committed step.", ["job"], registry=r)
        self.failures = Counter("ckptd_save_failures", "Saves that failed, by cause (see docs/operations.md).", ["cause"], registry=r)
        for cause in FAILURE_CAUSES:
            self.failures.labels(cause)  # every cause is exported from the start, at 0
        self.skipped = Counter("ckptd_saves_skipped", "Saves skipped because no arena was free (--arena-policy skip).", ["job"], registry=r)
        self.refused_no_space = Counter(
            "ckptd_saves_refused_no_space", "Saves refused before writing because their files would not fit in the storage root's free space less --disk-reserve.",
            ["job"], registry=r,
        )
        self.retention_deleted = Counter("ckptd_retention_deleted_steps", "Committed steps deleted by retention (after commits and by ckptd gc).", ["job"], registry=r)
        self.arena_released = Counter(
            "ckptd_arena_released_bytes", "Shared memory of snapshot arenas given back, by reason: spare (a job's second set, idle again), "
            "pressure (another save needed it), idle (no save or load for --idle-release), gc.", ["reason"], registry=r,
        )
        for reason in RELEASE_REASONS:
            self.arena_released.labels(reason)
        self.loads = Counter("ckptd_loads", "Load plans served, by tier: memory (the daemon's arenas), disk or mixed.", ["tier"], registry=r)
        self.info = Gauge("ckptd_info", "Constant 1; labels: the daemon's version and node rank.", ["version", "node"], registry=r)
        # the replica tiers: replicas of nodes' parts in other daemons' memory (tiers/replicas.py)
        self.replica_pushes = Counter("ckptd_replica_pushes", "Pushes of this node's part of a committed step to its buddies, by outcome: ok, failed (some buddy does not hold it), cancelled (a newer commit).", ["outcome"], registry=r)
        self.replica_pushed_bytes = Counter("ckptd_replica_pushed_bytes", "Bytes of this node's parts sent to buddies' memory.", registry=r)
        self.replica_received_bytes = Counter("ckptd_replica_received_bytes", "Bytes of other nodes' parts received, checked and held.", registry=r)
        self.replica_refused = Counter("ckptd_replica_refused", "Replica offers refused (over --replica-memory or shared memory full).", registry=r)
        self.replica_evicted = Counter("ckptd_replica_evicted", "Held replicas dropped to make room for a newer one of the same node.", registry=r)
        self.replica_damaged = Counter(
            "ckptd_replica_damaged", "Replicas whose bytes did not match the step's checksums, by where: arrival (a buddy did not keep it), "
            "load (a load read the range from the writer's disk instead; the log names the holder).", ["where"], registry=r,
        )
        for where in ("arrival", "load"):
            self.replica_damaged.labels(where)
        self.replica_served_bytes = Counter("ckptd_replica_served_bytes", "Bytes of held replicas sent to loading nodes.", registry=r)
        self.load_staged_bytes = Counter("ckptd_load_staged_bytes", "Bytes copied into staging files for loads, by tier: memory-local (a replica held here), memory-peer, disk-local, disk-peer.", ["tier"], registry=r)
        self.load_broadcast_bytes = Counter(
            "ckptd_load_broadcast_bytes", "Load broadcast: bytes of data files read from this root once for this node's ranks and the peers (read), "
            "sent to peers from those reads (served), read from the shared root because their writer did not send them (fallback).", ["kind"], registry=r,
        )
        self.bulk_port_healthy = Gauge("ckptd_bulk_port_healthy", "1 while the bulk port (replica bytes) accepts connections; 0 for a minute after accepting failed (no file descriptors).", registry=r)
        self.bulk_accept_errors = Counter("ckptd_bulk_accept_errors", "Connections the bulk port failed to accept (out of file descriptors or kernel memory); it keeps retrying.", registry=r)
        self.bulk_refused = Counter(
            "ckptd_bulk_refused", "Connections the bulk port closed before a valid ticket, by reason: no-ticket (none or a wrong one), timeout (none within 5 s), "
            "per-source and too-many (over the caps of connections without a ticket), closed (the peer hung up first).", ["reason"], registry=r,
        )
        self.recoverable_step = Gauge("ckptd_recoverable_step", "Node 0: the newest step whose every node's part is held in memory by another node too.", ["job"], registry=r)
        self._server: object | None = None
        self._thread: threading.Thread | None = None

    def watch(self, read: Callable[[], LiveState | None]) -> None:
        """Export the gauges of LiveState, read by `read` at each scrape."""
        self.registry.register(_LiveCollector(read))

    def failed(self, cause: str) -> None:
        self.failures.labels(cause if cause in FAILURE_CAUSES else "internal").inc()

    def serve(self, host: str, port: int) -> None:
        """Start the HTTP endpoint (http://host:port/metrics) in a daemon thread.

        Raises OSError when the port cannot be bound (in use, or the host is not this machine's)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        log.info("Prometheus metrics on http://%s:%s/metrics", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
            self._server = None


def read_on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], LiveState]) -> Callable[[], LiveState | None]:
    """A reader for Metrics.watch that runs `read` on `loop` (from the HTTP thread) and waits for it.

    Returns None (the gauges are left out of that scrape) when the loop does not answer in time."""

    def from_thread() -> LiveState | None:
        if loop.is_closed():
            return None
        done: concurrent.futures.Future[LiveState] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(read())
            except Exception as exc:  # reported to the waiting thread below
                done.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
            return done.result(SNAPSHOT_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:
            log.warning("metrics: the daemon's state could not be read for a scrape: %s", exc)
            return None

    return from_thread
