"""The read side of the object-store tier, on the event loop: listing the bucket's steps beside the
root's, and restoring a step the root lacks before a load is planned (engine/loads.py).

- `listing`: the root's steps and the bucket's steps that are not in the root (shown with their
  s3:// URL), in commit order: what `ckpt.list()` and the List RPC return. When the bucket does
  not answer, the root's steps alone (logged).
- `restore_step`, `restore_newest`: the last tier of a load (engine/loads.py asks after the
  root and, with several nodes, the peers): a step that only the bucket has, or for a load of
  the newest step the bucket's newest when it was committed after the root's newest (a new
  machine, or a root that lost its steps), is downloaded into the root first (restore.py:
  verified, index last); one download per step whatever the number of ranks asking. With
  several nodes each node downloads the whole step into its own root; a node whose root is
  node 0's waits for node 0's download instead (its ranks load the same step). A step whose
  index is in the bucket but some of whose files are not (deleted after the upload: by hand, a
  lifecycle rule) is not downloaded: the load fails saying which files are gone and which step
  to load instead (the newest complete one committed before it, in the bucket or the root).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from ckptd.daemon.errors import Precondition, Unavailable
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FormatError
from ckptd.daemon.remote.catalog import BucketCatalog
from ckptd.daemon.remote.location import RemoteLocation
from ckptd.daemon.remote.restore import DownloadDamaged, StepRestorer
from ckptd.daemon.remote.status import TierCounters, TierMetrics
from ckptd.daemon.remote.store import RemoteError
from ckptd.daemon.engine.tiers import Listing
from ckptd.daemon.records import StepSummary

if TYPE_CHECKING:
    from ckptd.daemon.engine.context import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

LISTING_TTL_S = 2.0  # a bucket listing is reused this long (every rank of a node asks at once)
Run = Callable[..., Awaitable[Any]]  # runs a blocking call on the tier's control threads


class BucketReads:
    """Listings and restores (see the module docstring). `run`: the tier's way to run blocking
    calls off the loop; `map_`: a pool's map for fetching many indexes; `shares_node0_root`: a
    member's question whether its root is node 0's."""

    def __init__(self, engine: "Engine", catalog: BucketCatalog, restorer: StepRestorer, run: Run, map_: Callable[..., Any],
                 shares_node0_root: Callable[[str], Awaitable[bool]], counters: TierCounters, metrics: TierMetrics) -> None:
        self.engine, self.catalog, self.restorer = engine, catalog, restorer
        self.location: RemoteLocation = catalog.location
        self._run, self._map, self._shares_node0_root = run, map_, shares_node0_root
        self.counters, self.metrics = counters, metrics
        self._restores: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._listings: dict[str, tuple[float, list[CheckpointIndex]]] = {}

    @property
    def restoring(self) -> set[tuple[str, int]]:
        """(job, step) being downloaded now (bucket retention keeps them)."""
        return set(self._restores)

    def forget_listing(self, job: str) -> None:
        """The bucket changed (an upload, a deletion): list it again next time."""
        self._listings.pop(job, None)

    async def committed_in_bucket(self, job: str) -> list[CheckpointIndex]:
        """The job's committed steps in the bucket, commit order (reused for LISTING_TTL_S)."""
        cached = self._listings.get(job)
        if cached is not None and time.monotonic() - cached[0] < LISTING_TTL_S:
            return cached[1]
        indexes: list[CheckpointIndex] = await self._run(self.catalog.committed, job, self._map)
        self._listings[job] = (time.monotonic(), indexes)
        return indexes

    async def listing(self, job: str, local: Listing) -> Listing:
        """`local` (the root's steps: summary, where, in memory) and the bucket's steps not in the
        root (where: their s3:// URL), in commit order."""
        try:
            remote = await self.committed_in_bucket(job)
        except RemoteError as exc:
            log.warning("listing %s failed, listing the local root only: %s", self.location.url, exc)
            return local
        here = {summary.step for summary, _, _ in local}
        extra = [(StepSummary.of(index), self.location.url_of(job, index.step), False) for index in remote if index.step not in here]
        return sorted(local + extra, key=lambda item: (item[0].created_at, item[0].step))

    async def restore_step(self, job: str, step: int) -> bool:
        """A load of `step`, which the root lacks: download it from the bucket when the bucket has
        it. Returns whether the root holds the step now. Raises Unavailable (the bucket does not
        answer), Precondition (what it holds does not match the step's index) or NoSpace."""
        await self._restore_once(job, step)
        return await self.engine.committed(job, step)

    async def restore_newest(self, job: str) -> bool:
        """A load of the newest step: download the bucket's newest step when it was committed after
        the root's newest (or the root has none). Returns whether one was downloaded (or waited
        for); raises as restore_step."""
        try:
            target = await self._newer_in_bucket(job)
        except RemoteError as exc:
            raise Unavailable(f"the object store {self.location.url} cannot be listed: {exc}") from None
        if target is None:
            return False
        await self._restore_once(job, target)
        return True

    async def _restore_once(self, job: str, step: int) -> None:
        """One download per step, whatever the number of ranks asking at once."""
        key = (job, step)
        task = self._restores.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._restore(job, step))
            self._restores[key] = task
            task.add_done_callback(lambda done: self._ended(key, done))
        await asyncio.shield(task)

    def _ended(self, key: tuple[str, int], task: "asyncio.Task[None]") -> None:
        self._restores.pop(key, None)
        if not task.cancelled() and task.exception() is not None:  # also retrieved when every waiter went away
            log.warning("restoring step %s of job %s failed: %s", key[1], key[0], task.exception())

    async def _newer_in_bucket(self, job: str) -> int | None:
        """The bucket's newest step when the root has no step committed as recently, else None."""
        remote = await self.committed_in_bucket(job)
        if not remote:
            return None
        newest = remote[-1]
        local = await asyncio.to_thread(self.engine.storage.catalog.latest_step, job)
        if local is not None:
            if local == newest.step or (await self.engine.index(job, local)).created_at >= newest.created_at:
                return None
            if await self.engine.committed(job, newest.step):
                return None  # that step number is here as another commit: the root's steps win
        return newest.step

    async def _restore(self, job: str, step: int) -> None:
        engine = self.engine
        if engine.cluster is not None and engine.node != 0 and await self._shares_node0_root(job):
            await self._wait_for_node0(job, step)
            return
        started = time.monotonic()
        try:
            data = await self._run(self.catalog.index_bytes, job, step)
            if data is None:
                return  # not in the bucket either: the load reports it missing
            await self._check_complete(job, CheckpointIndex.of_step(data, job, step, self.location.key(job, step, INDEX_NAME)))
            restored = await self._run(self.restorer.restore, job, step, data)
        except FileExistsError:
            return  # committed here meanwhile
        except (DownloadDamaged, FormatError) as exc:
            raise Precondition(f"step {step} of job {job!r} cannot be restored from {self.location.url}: {exc}") from None
        except RemoteError as exc:
            raise Unavailable(f"step {step} of job {job!r} cannot be restored from {self.location.url}: {exc}") from None
        self.counters.restored_steps += 1
        self.counters.restored_bytes += restored.nbytes
        self.metrics.restored_steps.labels(job).inc()
        self.metrics.restored_bytes.labels(job).inc(restored.nbytes)
        log.info("restored step %s of job %s from %s into %s: %.1f MiB in %.2f s", step, job, self.location.url_of(job, step),
                 restored.where, restored.nbytes / 2**20, time.monotonic() - started, extra={"job": job, "step": step})

    async def _check_complete(self, job: str, index: CheckpointIndex) -> None:
        """Precondition when the bucket lacks files of the step that `index` commits, naming them
        and the step to load instead: the newest committed before it that is complete in the
        bucket, or committed in the root."""
        step = index.step
        before = [i for i in await self.committed_in_bucket(job) if (i.created_at, i.step) < (index.created_at, index.step)]
        gaps = await self._run(self.catalog.incomplete, job, [index, *before])
        lacking = gaps.get(step)
        if not lacking:
            return
        candidates = [(i.created_at, i.step, self.location.url_of(job, i.step)) for i in before if i.step not in gaps]
        local = await asyncio.to_thread(self.engine.storage.catalog.latest_step, job)
        if local is not None and local != step:
            created = (await self.engine.index(job, local)).created_at
            if created < index.created_at:
                candidates.append((created, local, self.engine.storage.catalog.step_location(job, local)))
        shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        if candidates:
            _, instead, where = max(candidates)
            advice = f"the newest complete step committed before it is step {instead} ({where}): load it with `load(state, step={instead})`"
        else:
            advice = f"no complete step of the job was committed before it, in the bucket or in {self.engine.storage.location}"
        raise DownloadDamaged(
            f"its index is in the bucket but {len(lacking)} of the {len(index.files)} files it lists {'is' if len(lacking) == 1 else 'are'} "
            f"missing or of another size ({shown}): deleted or replaced after the upload (by hand, or a lifecycle rule); {advice}"
        )

    async def _wait_for_node0(self, job: str, step: int) -> None:
        """A node sharing node 0's root: node 0 downloads the step (its ranks load it too)."""
        deadline = time.monotonic() + self.engine.config.save_timeout_s
        while not await self.engine.committed(job, step):
            if time.monotonic() > deadline:
                raise Unavailable(f"step {step} of job {job!r}: node 0 did not restore it from {self.location.url} into the shared root in time")
            await asyncio.sleep(0.2)
