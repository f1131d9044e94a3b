"""The object-store tier of one daemon (`ckptd serve --remote s3://BUCKET/PREFIX`), on the event loop.

- Start (`start`): credentials and endpoint (credentials.py), one listing of the prefix. Refused
  credentials or a missing bucket stop the daemon at start with the message that says what to
  fix: a daemon that runs without the tier it was told to use would leave the job with no copy
  that survives the loss of its machines, and nobody would know until that copy is needed. A
  server that does not answer is not a configuration error: the daemon starts, reports the
  tier as retrying, and uploads once the server is back. Then the background catch-up: unfinished
  multipart uploads of this node are aborted, committed steps of the local root not in the
  bucket yet are queued (the index in the bucket is the proof of an upload), and node 0 removes
  step directories an interrupted upload left without an index.
The BUCKET tier of engine/tiers.py: the engine's parts reach it only through that protocol.

- Upload (`after_commit`, from engine/commit.py once a step is committed and durable here): the
  step is queued; one step at a time, in commit order, uploaded on worker threads (upload.py),
  never on the event loop and never in the save's path. A failed attempt is retried with
  exponential backoff, as long as the step is in the local root; local retention keeps a step
  until its upload is done. After node 0 uploads a step, retention applies to the bucket with
  its own settings (--remote-keep-last, --remote-keep-every).
- Restore and listing (`locate`, `newest` from engine/loads.py, `listing` from
  engine/housekeeping.py): reads.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ckptd.daemon.engine.tiers import Committed, Listing, Located, Tier
from ckptd.daemon.errors import Unavailable
from ckptd.daemon.faults import objects as faults
from ckptd.format.index import FormatError
from ckptd.daemon.plan.load_plan import TierName
from ckptd.daemon.plan.retention import RetentionPolicy
from ckptd.daemon.records import RemoteStatus
from ckptd.daemon.remote.catalog import BucketCatalog
from ckptd.daemon.remote.credentials import CredentialsError, resolve
from ckptd.daemon.remote.location import parse_location
from ckptd.daemon.remote.objects import uploads_of
from ckptd.daemon.remote.reads import BucketReads
from ckptd.daemon.remote.restore import StepRestorer
from ckptd.daemon.remote.status import TierCounters, TierMetrics
from ckptd.daemon.remote.store import RETRY_TIMEOUT_S, ObjectStore, RemoteAccessDenied, RemoteBucketMissing, RemoteError, Stopped, open_store, require_client
from ckptd.daemon.remote.upload import Copies, LocalDamage, NotReady, StepGone, StepUploader, Uploaded, transient

if TYPE_CHECKING:
    from ckptd.daemon.config import DaemonConfig
    from ckptd.daemon.engine.context import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

BACKOFF_S = (1.0, 30.0)  # a transient failure: first wait, cap (doubling)
FIX_BACKOFF_S = (10.0, 300.0)  # refused credentials, missing bucket: retried less often while someone fixes them
MIN_PART_BYTES = 5 << 20  # S3 refuses smaller parts (but the last)


def backoff_s(failures: int, first_s: float, cap_s: float) -> float:
    """Seconds to wait after the `failures`-th failure in a row (>= 1): `first_s`, doubling each
    time, at most `cap_s`. (The exponent is bounded: after days of failures 2.0 ** n overflows.)"""
    return min(cap_s, first_s * 2.0 ** min(failures - 1, 40))


class RemoteStartError(RuntimeError):
    """The tier cannot work as configured (credentials, bucket, client): the daemon does not start."""


class RemoteTier(Tier):
    """See the module docstring. Built by the service when `config.remote` is set; `start` once
    serving. Everything public runs on the event loop."""

    name = TierName.BUCKET

    def __init__(self, config: "DaemonConfig", engine: "Engine") -> None:
        self.location = parse_location(config.remote)
        self.engine = engine
        self.streams = config.remote_streams
        self.part_bytes = config.remote_part_bytes
        self.policy = RetentionPolicy(keep_last=config.remote_keep_last, keep_every=config.remote_keep_every)
        self.disk_reserve = config.disk_reserve
        self.counters = TierCounters()
        self.endpoint = ""
        self._started = False
        self._caught_up = False  # the start-up catch-up (catch_up) is done
        self._retrying = False  # the last attempt (start, catch-up or upload) failed
        self._max_backoff_s = FIX_BACKOFF_S[1]  # lowered by the test-only CKPTD_FAULT_S3_RETRY_S
        self._stop = threading.Event()
        initializer = config.background_priority.initializer()  # uploads run below the trainer (thread_priority.py)
        self._transfers = ThreadPoolExecutor(self.streams, thread_name_prefix="ckptd-remote", initializer=initializer)
        self._control = ThreadPoolExecutor(4, thread_name_prefix="ckptd-remote-ctl", initializer=initializer)  # step drivers: never wait on themselves
        self._queue: dict[tuple[str, int], tuple[bool | None, float]] = {}  # (job, step) -> (shared root, committed at), commit order
        self._current: tuple[str, int] | None = None
        self._wake = asyncio.Event()
        self._shares_root: bool | None = None  # a member: whether node 0's root is this node's (None: not known yet)
        self._tasks: list[asyncio.Task[Any]] = []
        self.metrics = TierMetrics(engine.metrics.registry, lambda: float(len(self._queue)), self.lag)
        self.store: ObjectStore | None = None
        self.catalog: BucketCatalog | None = None
        self.uploader: StepUploader | None = None
        self.reads: BucketReads | None = None

    @property
    def state(self) -> str:
        """What the tier does now: starting, catching-up, uploading, restoring, retrying, idle or stopped."""
        if self._stop.is_set():
            return "stopped"
        if not self._started:
            return "starting"
        if self.reads is not None and self.reads.restoring:
            return "restoring"
        if self._retrying:
            return "retrying"
        if not self._caught_up:
            return "catching-up"
        return "uploading" if self._current is not None else "idle"

    # ------------------------------------------------------------ lifecycle

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._control, fn, *args)

    async def start(self) -> None:
        """Open the store and check it (RemoteStartError: the daemon must not start), then start
        the catch-up and the upload worker in the background."""
        if self.part_bytes < MIN_PART_BYTES:
            raise RemoteStartError(f"--remote-part-bytes {self.part_bytes}: S3 needs parts of at least 5MiB (e.g. 16MiB)")
        hook, retry_s = None, RETRY_TIMEOUT_S
        if any(os.environ.get(name) for name in faults.ENVS):  # tests only
            hook, retry_s = faults.from_env(os.environ), faults.retry_s_from_env(os.environ) or retry_s
            self._max_backoff_s = min(self._max_backoff_s, 2 * retry_s)
            log.warning("object-store fault injection is on: this daemon is for tests only")
        try:
            require_client()
            settings = await self._run(resolve, dict(os.environ))
            store = open_store(self.location, settings, self.part_bytes, hook, retry_s)
        except (CredentialsError, RuntimeError) as exc:
            raise RemoteStartError(f"--remote {self.location.url}: {exc}") from None
        self.endpoint = settings.shown_endpoint
        try:
            await self._run(store.check)
        except (RemoteAccessDenied, RemoteBucketMissing) as exc:
            raise RemoteStartError(f"--remote {self.location.url}: {exc}") from None
        except RemoteError as exc:
            self._failed("unavailable", f"at start: {exc}")
            log.warning("the object store is not reachable yet; uploads start once it answers: %s", exc)
        self.store, self.catalog = store, BucketCatalog(store)
        storage = self.engine.storage
        self.uploader = StepUploader(storage, store, self.catalog, self.engine.node, self.streams, self._transfers, self._stop, Copies())
        restorer = StepRestorer(storage, store, self._transfers, self._stop, self.disk_reserve)
        self.reads = BucketReads(self.engine, self.catalog, restorer, self._run, self._transfers.map, self.shares_node0_root,
                                 self.counters, self.metrics)
        log.info("object-store tier %s at %s, credentials from %s: %s streams, bucket retention %s", self.location.url, self.endpoint,
                 settings.source, self.streams, f"keep_last={self.policy.keep_last}" if not self.policy.keeps_all else "keeps every step")
        self._started = True
        self._tasks.append(asyncio.get_running_loop().create_task(self._work()))

    def reconfigure(self, config: "DaemonConfig") -> None:
        """SIGHUP: the bucket's retention may change while serving (the location, streams and
        part size need a restart: service.RESTART_SETTINGS)."""
        self.policy = RetentionPolicy(keep_last=config.remote_keep_last, keep_every=config.remote_keep_every)

    async def close(self) -> None:
        """Stop: uploads in flight stop at their next part (resumed at the next start)."""
        self._stop.set()
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass  # what close asked for
        # Queued transfers are not cancelled (a cancelled future never wakes concurrent.futures.wait
        # in the step driver waiting on it): each one starts, sees the stop and ends at once.
        self._transfers.shutdown(wait=False)
        self._control.shutdown(wait=False)

    # ------------------------------------------------------------ uploads

    def after_commit(self, commit: Committed) -> None:
        """A step was committed and is durable here: queue its upload (see the module docstring)."""
        if self.engine.cluster is not None and self.engine.node != 0 and commit.shared_root:
            return  # node 0 uploads everything of a shared root
        self._queue[(commit.job, commit.step)] = (commit.shared_root, commit.index.created_at)
        self._wake.set()

    def protected(self, job: str) -> set[int]:
        """Steps of the job local retention must keep: queued or being uploaded; before the
        start-up catch-up knows which steps the bucket lacks, every committed step."""
        if not self._caught_up and not self._stop.is_set():
            return set(self.engine.storage.catalog.committed_steps(job))
        return {step for j, step in self._queue if j == job}

    def lag(self, job: str | None = None) -> float:
        """Seconds since the commit of the oldest step (of `job`, when given) not uploaded yet (0: none)."""
        oldest = min((created for (j, _), (_, created) in list(self._queue.items()) if job is None or j == job), default=None)
        return 0.0 if oldest is None else max(0.0, time.time() - oldest)

    async def _work(self) -> None:
        """The upload worker: the catch-up, then each queued step in commit order, retried with backoff."""
        await self._catch_up_until_done()
        failures = 0
        while not self._stop.is_set():
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            (job, step), (shared, created_at) = next(iter(self._queue.items()))
            try:
                await self._upload_one(job, step, shared)
                failures = 0
            except Stopped:
                return
            except (StepGone, LocalDamage) as exc:
                self._queue.pop((job, step), None)
                if isinstance(exc, LocalDamage):
                    self._failed("local", str(exc), job)
                    log.error("step %s of job %s is not uploaded: %s", step, job, exc, extra={"job": job, "step": step})
                else:
                    log.info("step %s of job %s is not uploaded: %s", step, job, exc, extra={"job": job, "step": step})
            except Exception as exc:
                failures += 1
                first, cap = BACKOFF_S if transient(exc) or not isinstance(exc, RemoteError) else FIX_BACKOFF_S
                delay = backoff_s(failures, first, min(cap, self._max_backoff_s))
                self._failed(_reason(exc), str(exc), job)
                if not isinstance(exc, (RemoteError, OSError, FormatError)):
                    log.exception("uploading step %s of job %s failed unexpectedly", step, job)
                log.warning("uploading step %s of job %s failed (attempt %s), retrying in %.0f s: %s", step, job, failures, delay, exc,
                            extra={"job": job, "step": step})
                try:
                    await asyncio.wait_for(self._wake_on_stop(), delay)
                except asyncio.TimeoutError:
                    pass  # the backoff is over: try again
            finally:
                self._current = None

    async def _wake_on_stop(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(0.2)

    async def _upload_one(self, job: str, step: int, shared: bool | None) -> None:
        assert self.uploader is not None and self.catalog is not None
        if shared is None:
            shared = await self._root_shared(job, step)
        self._current = (job, step)
        started = time.monotonic()
        result: Uploaded = await self._run(self.uploader.upload, job, step, shared)
        self._queue.pop((job, step), None)
        self._retrying = False
        counters = self.counters
        counters.uploaded_bytes += result.sent
        counters.copied_bytes += result.copied
        self.metrics.uploaded_bytes.labels(job).inc(result.sent)
        self.metrics.copied_bytes.labels(job).inc(result.copied)
        if result.already:
            return
        counters.last_uploaded = counters.job_uploaded[job] = f"job {job} step {step}"
        if result.published:
            counters.uploaded_steps += 1
            self.metrics.uploaded_steps.labels(job).inc()
            assert self.reads is not None
            self.reads.forget_listing(job)
            log.info("uploaded step %s of job %s to %s: %.1f MiB sent, %.1f MiB copied in the bucket, %.2f s", step, job,
                     self.location.url_of(job, step), result.sent / 2**20, result.copied / 2**20, time.monotonic() - started,
                     extra={"job": job, "step": step})
            await self._bucket_retention(job)

    async def _bucket_retention(self, job: str) -> None:
        assert self.catalog is not None and self.reads is not None and self.uploader is not None
        protected = {step for j, step in self.reads.restoring if j == job}
        deleted = await self._run(self.catalog.apply_retention, job, self.policy, protected, self._transfers.map)
        if deleted:
            for step in deleted:
                self.uploader.copies.drop_prefix(job, self.location.step_prefix(job, step))
            self.metrics.deleted_steps.labels(job).inc(len(deleted))
            self.reads.forget_listing(job)

    async def _root_shared(self, job: str, step: int) -> bool:
        """For a step queued at start: whether this node's root is node 0's (node 0: whether it holds
        every file of the step, as a shared root does). NotReady when node 0 does not answer."""
        engine = self.engine
        if engine.cluster is None:
            return False
        if engine.node == 0:
            assert self.uploader is not None
            index, _ = await self._run(self.uploader.local_index, job, step)
            sizes = await self._run(engine.storage.files.step_file_sizes, job, step)
            return all(f.name in sizes for f in index.files)
        try:
            return await self.shares_node0_root(job)
        except Unavailable as exc:
            raise NotReady(str(exc)) from None

    async def _catch_up_until_done(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                await self._catch_up()
                return
            except Exception as exc:
                failures += 1
                delay = backoff_s(failures, BACKOFF_S[0], min(BACKOFF_S[1], self._max_backoff_s))
                self._failed(_reason(exc), f"catching up: {exc}")
                log.warning("catching up with %s failed, retrying in %.0f s: %s", self.location.url, delay, exc)
                try:
                    await asyncio.wait_for(self._wake_on_stop(), delay)
                except asyncio.TimeoutError:
                    pass  # try again

    async def _catch_up(self) -> None:
        """At start: sweep this node's unfinished multipart uploads, queue the local root's
        committed steps that are not in the bucket (in commit order, before anything committed
        since), and (node 0) remove step directories left without an index for good."""
        assert self.uploader is not None and self.catalog is not None
        storage, uploader, catalog = self.engine.storage, self.uploader, self.catalog
        found: dict[tuple[str, int], tuple[bool | None, float]] = {}
        for job in await self._run(storage.catalog.jobs):
            steps = await self._run(storage.catalog.commit_order, job)
            try:  # a member on node 0's root sweeps nothing: node 0 uploads that root's files, and may be uploading now
                member_of_shared = self.engine.cluster is not None and self.engine.node != 0 and await self.shares_node0_root(job)
            except Unavailable:
                member_of_shared = True  # not known yet: leave the sweep to a later start
            aborted = 0
            if not member_of_shared:
                aborted = await self._run(catalog.sweep_uploads, job, lambda step, name: self._uploads_here(job, step, name, steps))
            if aborted:
                log.info("aborted %s unfinished multipart upload(s) of job %s under %s", aborted, job, self.location.url)
            for step in steps:
                try:
                    if not await self._run(uploader.uploaded, job, step):
                        index, _ = await self._run(uploader.local_index, job, step)
                        found[(job, step)] = (None, index.created_at)
                except StepGone:
                    continue
            if self.engine.node == 0:
                keep = set(await self._run(storage.catalog.committed_steps, job))
                await self._run(catalog.sweep_leftovers, job, keep)
                await self._bucket_retention(job)  # as after an upload (a daemon may have died in between)
        self._queue = {**found, **self._queue}
        if found:
            log.info("%s committed step(s) of this node are not in %s yet: uploading them", len(found), self.location.url)
        self._retrying = False
        self._caught_up = True
        self._wake.set()

    def _uploads_here(self, job: str, step: int, name: str, committed: list[int]) -> bool:
        """(worker thread) Whether this node uploads file `name` of a step: by the step's local
        index, or (a step not committed here) a single node's. Not called on a member whose root
        is node 0's (_catch_up); node 0's root is shared when it holds every file of the step."""
        if self.engine.cluster is None:
            return True
        if step not in committed:
            return False
        assert self.uploader is not None
        try:
            index, _ = self.uploader.local_index(job, step)
        except (StepGone, FormatError):
            return False
        sizes = self.engine.storage.files.step_file_sizes(job, step)
        shared = self.engine.node == 0 and all(f.name in sizes for f in index.files)
        return any(f.name == name for f in uploads_of(index, self.engine.node, shared))

    def _failed(self, reason: str, message: str, job: str | None = None) -> None:
        """Count a failed attempt; `job`: the job whose step failed (None: every job's, e.g. the
        store unreachable)."""
        self._retrying = reason != "local"
        self.counters.failures += 1
        self.counters.last_error = message
        self.counters.job_errors.pop(job, None)  # put back last: the newest
        self.counters.job_errors[job] = message
        self.metrics.failures.labels(reason).inc()

    # ------------------------------------------------------------ restores and listings

    async def listing(self, job: str, rows: Listing) -> Listing:
        """BucketReads.listing (before the tier started: the root's steps alone)."""
        return rows if self.reads is None else await self.reads.listing(job, rows)

    async def locate(self, job: str, step: int) -> Located | None:
        """A step neither the root nor the peers hold: restored into the root when the bucket
        has it (BucketReads.restore_step; not before the tier started)."""
        restored = self.reads is not None and await self.reads.restore_step(job, step)
        return Located(step) if restored else None

    async def newest(self, job: str, found: Located | None) -> Located | None:
        """Unless the step comes from the peers: the bucket's newest step, restored into the root
        when it was committed after the root's newest (BucketReads.restore_newest)."""
        if found is not None and found.copy is not None:
            return None
        if self.reads is None or not await self.reads.restore_newest(job):
            return None
        step = await asyncio.to_thread(self.engine.storage.catalog.latest_step, job)
        return None if step is None else Located(step)

    async def shares_node0_root(self, job: str) -> bool:
        """A member (node != 0): whether its root is node 0's (asked once, then known).
        Unavailable when node 0 does not answer."""
        cluster = self.engine.cluster
        assert cluster is not None
        if self._shares_root is None:
            answer = await cluster.inventory(0, job, 0)
            if isinstance(answer, str):
                raise Unavailable(f"node 0 does not answer ({answer}): whether this node's root is node 0's is not known yet")
            self._shares_root = answer.root_id == cluster.root_id
        return self._shares_root

    # ------------------------------------------------------------ status

    def status_fields(self, job: str | None = None) -> dict[str, Any]:
        return {"remote": self.status(job)}

    def status(self, job: str | None = None) -> RemoteStatus:
        """The tier's counters since the daemon started; told of `job` when given: its steps
        waiting, its lag, its newest upload and failure (a failure of no one job included)."""
        c = self.counters
        pending = sum(1 for j, _ in list(self._queue) if job is None or j == job)
        last_uploaded, last_error = c.last_uploaded, c.last_error
        if job is not None:
            last_uploaded = c.job_uploaded.get(job, "")
            last_error = next((m for j, m in reversed(c.job_errors.items()) if j in (job, None)), "")
        return RemoteStatus(
            location=self.location.url, endpoint=self.endpoint, state=self.state, uploaded_steps=c.uploaded_steps,
            uploaded_bytes=c.uploaded_bytes, copied_bytes=c.copied_bytes, failures=c.failures, pending_steps=pending,
            lag_s=self.lag(job), last_uploaded=last_uploaded, last_error=last_error, restored_steps=c.restored_steps,
            restored_bytes=c.restored_bytes,
        )


def _reason(exc: BaseException) -> str:
    """The failure label of an upload attempt's error (status.FAILURE_REASONS)."""
    if isinstance(exc, NotReady):
        return "waiting"
    if isinstance(exc, RemoteAccessDenied):
        return "access"
    if isinstance(exc, RemoteBucketMissing):
        return "bucket"
    if isinstance(exc, (RemoteError, OSError)):
        return "unavailable"
    return "internal"
