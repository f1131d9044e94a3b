"""The bucket as the tier sees it: jobs, committed steps (a step directory holding its index),
their indexes, deleting a step (never half visible), retention on the bucket by its own
settings, and the sweep of what interrupted uploads left. Blocking: call from worker threads.

A step in the bucket is committed when `PREFIX/JOB/step-NNNNNNNN/ckptd.index.json` exists: the
commit rule of storage/step_commit.py, kept on objects. The uploader writes the index last and
only after every file it lists is there; deleting goes the other way: the index first (the step is invisible from then on), then the files.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterable, Sequence

from ckptd.format.index import INDEX_NAME, CheckpointIndex, FormatError
from ckptd.daemon.plan.retention import RetentionPolicy
from ckptd.daemon.remote.store import ObjectStore

log = logging.getLogger(__name__)

# An unfinished multipart upload older than this is abandoned whoever started it.
STALE_UPLOAD = timedelta(hours=24)


class BucketCatalog:
    """Committed steps of the bucket and their indexes (an index object is written once and never
    changed: parsed indexes are cached until the step is deleted). Thread-safe."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.location = store.location
        self._indexes: dict[tuple[str, int], CheckpointIndex] = {}
        self._lock = threading.Lock()

    def objects(self, job: str) -> dict[int, set[str]]:
        """step -> the file names the bucket holds for it, for every step of the job with any
        object (one paginated listing of the job's prefix; an empty "directory" some servers
        keep after a deletion is no step)."""
        found: dict[int, set[str]] = {}
        for key in self.store.list_objects(self.location.job_prefix(job)):
            parsed = self.location.parse_key(key)
            if parsed is not None and parsed[0] == job:
                found.setdefault(parsed[1], set()).add(parsed[2])
        return found

    def incomplete(self, job: str, indexes: Sequence[CheckpointIndex]) -> dict[int, list[str]]:
        """step -> the files its index lists that the bucket lacks or holds with another size (a
        name, or a name and both sizes),
        for each of `indexes` (the job's) that is not complete; one listing of the job's prefix.
        A step is complete when its index is written (upload.py), but objects can be deleted
        after that: by hand, by a lifecycle rule."""
        listed = self.store.list_objects(self.location.job_prefix(job))
        gaps = {}
        for index in indexes:
            prefix = self.location.step_prefix(job, index.step)
            lacking = [_gap(f.name, listed.get(prefix + f.name), f.size) for f in index.files if listed.get(prefix + f.name) != f.size]
            if lacking:
                gaps[index.step] = lacking
        return gaps

    def index_bytes(self, job: str, step: int) -> bytes | None:
        """The step's index object as stored now, or None (not committed in the bucket)."""
        return self.store.get(self.location.key(job, step, INDEX_NAME))

    def index(self, job: str, step: int) -> CheckpointIndex | None:
        """The step's parsed index (cached), or None when the bucket has none (or a damaged one, logged)."""
        with self._lock:
            cached = self._indexes.get((job, step))
        if cached is not None:
            return cached
        data = self.index_bytes(job, step)
        if data is None:
            return None
        try:
            index = CheckpointIndex.of_step(data, job, step, self.location.key(job, step, INDEX_NAME))
        except FormatError as exc:
            log.warning("%s", exc)
            return None
        with self._lock:
            self._indexes[(job, step)] = index
        return index

    def committed(self, job: str, map_: Callable[..., Iterable[CheckpointIndex | None]] = map,
                  objects: dict[int, set[str]] | None = None) -> list[CheckpointIndex]:
        """The job's committed steps in the bucket in commit order (the index's created_at, then the
        step number), oldest first. `map_`: how to fetch the indexes not cached yet (a pool's map).
        `objects`: the job's `objects()` when the caller has just listed them (else listed here)."""
        steps = sorted(step for step, names in (self.objects(job) if objects is None else objects).items() if INDEX_NAME in names)
        with self._lock:
            for key in [k for k in self._indexes if k[0] == job and k[1] not in steps]:
                del self._indexes[key]  # deleted by another daemon
        indexes = [i for i in map_(lambda s: self.index(job, s), steps) if i is not None]
        return sorted(indexes, key=lambda i: (i.created_at, i.step))

    def forget(self, job: str, step: int) -> None:
        with self._lock:
            self._indexes.pop((job, step), None)

    def delete_step(self, job: str, step: int, old: CheckpointIndex | None = None) -> None:
        """Delete a step from the bucket: its index first, then every other object under it, the
        files `old` (its index, when known) lists last, so that a node waiting for them to be gone
        knows the deletion is over."""
        prefix = self.location.step_prefix(job, step)
        index_key = prefix + INDEX_NAME  # first: the commit rule (storage/step_commit.py) undone
        self.store.delete([index_key])
        self.forget(job, step)
        listed = set(self.store.list_objects(prefix)) - {index_key}
        last = {prefix + f.name for f in old.files} & listed if old is not None else set()
        self.store.delete(sorted(listed - last))
        self.store.delete(sorted(last))

    def apply_retention(self, job: str, policy: RetentionPolicy, protected: set[int], map_: Callable[..., Iterable[CheckpointIndex | None]] = map) -> list[int]:
        """Delete the job's committed steps in the bucket that `policy` does not keep (never the
        newest, never a protected one); returns them."""
        if policy.keeps_all:
            return []
        indexes = self.committed(job, map_)
        order = [i.step for i in indexes]
        metrics = {i.step: i.metric for i in indexes if i.metric is not None}
        doomed = policy.to_delete(order, protected, metrics)
        by_step = {i.step: i for i in indexes}
        for step in doomed:
            self.delete_step(job, step, by_step[step])
            log.info("bucket retention removed %s", self.location.url_of(job, step), extra={"job": job, "step": step})
        return doomed

    def sweep_leftovers(self, job: str, keep: set[int]) -> list[int]:
        """Delete step directories of the job that hold no index (an upload interrupted for good:
        its step is no longer in the local root), except the steps in `keep`; returns them."""
        removed = []
        for step, names in sorted(self.objects(job).items()):
            if step in keep or INDEX_NAME in names:
                continue
            self.store.delete(sorted(self.location.key(job, step, name) for name in names))
            removed.append(step)
            log.info("removed %s: an upload left it without an index", self.location.url_of(job, step), extra={"job": job, "step": step})
        return removed

    def sweep_uploads(self, job: str, mine: Callable[[int, str], bool]) -> int:
        """Abort the job's unfinished multipart uploads that this node started (`mine(step, file
        name)`: it uploads that file) or that are older than STALE_UPLOAD; returns how many."""
        now = datetime.now(timezone.utc)
        aborted = 0
        for key, upload_id, initiated in list(self.store.unfinished_uploads(self.location.job_prefix(job))):
            parsed = self.location.parse_key(key)
            if initiated.tzinfo is None:
                initiated = initiated.replace(tzinfo=timezone.utc)
            if (parsed is not None and parsed[0] == job and mine(parsed[1], parsed[2])) or now - initiated > STALE_UPLOAD:
                self.store.abort_upload(key, upload_id)
                aborted += 1
        return aborted


def _gap(name: str, stored: int | None, size: int) -> str:
    """A file of a step the bucket does not hold as its index says: its name, and the sizes when
    an object of another size holds its place (overwritten, or cut short)."""
    return name if stored is None else f"{name} ({stored} bytes in the bucket, {size} in the index)"
