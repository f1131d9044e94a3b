"""Uploading one committed step to the bucket (blocking: runs on the tier's worker threads).

Order, so that a step is visible in the bucket only when complete (its index is there): the
commit rule of storage/step_commit.py, kept on objects:

1. the step's index is read from the local root; if the bucket holds the same index, the step
   is already uploaded; if it holds another commit under the same step number (a job that
   rolled back and saved that number again), node 0 deletes it first, index first, and the
   other nodes wait until it is gone;
2. this node's files (objects.uploads_of) go up in parallel, `streams` requests in flight in
   all: data files as multipart uploads, each byte checked on the way against the index (a
   file damaged on this node's disk is never published under a good index: its object is
   deleted and the step reported), small files checked whole; a data file byte-identical to
   one of an earlier uploaded step (same size and units, objects.file_signature: the hard link
   of an incremental save) is copied inside the bucket instead;
3. node 0 waits until every file the index lists is in the bucket with its recorded size (the
   other nodes upload theirs), then writes the index, last, only if there is none.

A multipart upload that fails mid-way because the server went away cannot be aborted then: its
parts stay stored (and billed) under an upload id nobody will complete. The uploader remembers
the key, and the attempt that uploads (or copies) that file again first aborts the key's
unfinished uploads; the start-up sweep (tier.py) covers a daemon that died instead, and a step
that is never retried.

Every byte of a local file is read through the storage backend (a step's StepReader): no file
under the root is opened here by path.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptd.format.index import INDEX_NAME, CheckpointIndex, FileRecord, FormatError, check_small_file
from ckptd.format.units import Unit, UnitCheck, file_units
from ckptd.daemon.remote.catalog import BucketCatalog
from ckptd.daemon.remote.location import RemoteLocation
from ckptd.daemon.remote.objects import file_signature, uploads_of, writes_index
from ckptd.daemon.remote.store import ObjectStore, RemoteError, RemoteExists, RemoteNotFound, RemoteUnavailable, Stopped, gather
from ckptd.daemon.storage import ReadHandle, StorageBackend

log = logging.getLogger(__name__)

# Node 0 waits this long per attempt for the other nodes' files before it gives the step back
# to the retry loop (polling with backoff from 0.2 s up to 10 s between listings).
WAIT_FOR_NODES_S = 600.0
MAX_COPY_BYTES = 5 << 30  # S3's CopyObject limit: a larger file is uploaded again rather than copied


class StepGone(Exception):
    """The step is no longer in the local root (retention removed it): nothing to upload."""


class LocalDamage(Exception):
    """A file of the step on this node does not match its index: it is not uploaded (run
    `ckptd verify` on the step directory)."""


class NotReady(RemoteUnavailable):
    """Not this node's turn yet (the other nodes' files, or node 0 removing an older commit of the
    step): retried later like an unavailable server."""


@dataclass(frozen=True)
class Uploaded:
    """What one attempt did: bytes sent, bytes copied inside the bucket, whether this node wrote
    the index (the step became visible), whether the bucket already held the step."""

    sent: int = 0
    copied: int = 0
    published: bool = False
    already: bool = False


class Copies:
    """Objects this daemon uploaded (or found uploaded) by file signature, per job: the sources of
    copies inside the bucket. Thread-safe."""

    def __init__(self) -> None:
        self._by_job: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def add(self, job: str, signature: str, key: str) -> None:
        with self._lock:
            self._by_job.setdefault(job, {})[signature] = key

    def find(self, job: str, signature: str) -> str | None:
        with self._lock:
            return self._by_job.get(job, {}).get(signature)

    def drop_prefix(self, job: str, prefix: str) -> None:
        """Forget every source under `prefix` (a step deleted from the bucket)."""
        with self._lock:
            table = self._by_job.get(job, {})
            for signature in [s for s, key in table.items() if key.startswith(prefix)]:
                del table[signature]


class VerifyingBody:
    """A local data file read for an upload (obstore reads it in parts, in order), checked unit
    by unit against the index as the bytes stream by (units.UnitCheck). `problem()` after the
    upload: None when every byte was read in order and matched."""

    def __init__(self, handle: ReadHandle, size: int, units: tuple[Unit, ...], name: str, stop: threading.Event) -> None:
        self._handle, self._size, self._units, self._name, self._stop = handle, size, units, name, stop
        self._pos = 0
        self._check = UnitCheck(units)  # its position: the bytes checked in order from the start
        self._gap = False

    def read(self, size: int = -1) -> bytes:
        if self._stop.is_set():
            raise Stopped(f"stopped while uploading {self._name}")
        n = self._size - self._pos if size is None or size < 0 else min(size, self._size - self._pos)
        data = b""
        while len(data) < n:
            more = self._handle.pread(n - len(data), self._pos + len(data))
            if not more:
                break
            data += more
        if self._pos == self._check.position:
            self._check.feed(data)
        elif self._pos > self._check.position:
            self._gap = True
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._size + offset
        if self._pos == 0 and self._check.position:  # read again from the start: check again from the start
            self._check, self._gap = UnitCheck(self._units), False
        return self._pos

    def tell(self) -> int:
        return self._pos

    def problem(self) -> str | None:
        problem = self._check.problem()
        if self._check.bad is None and (self._gap or self._check.position != self._size):
            return f"{self._name} was not read in order from start to end ({self._check.position} of {self._size} bytes checked)"
        return None if problem is None else f"{self._name}: {problem}"


class StepUploader:
    """Uploads committed steps of this node's root (see the module docstring). `transfers`: the
    pool that runs file transfers (`streams` threads); `stop`: set at shutdown."""

    def __init__(self, storage: StorageBackend, store: ObjectStore, catalog: BucketCatalog, node: int, streams: int,
                 transfers: ThreadPoolExecutor, stop: threading.Event, copies: Copies) -> None:
        self.storage, self.store, self.catalog = storage, store, catalog
        self.location: RemoteLocation = store.location
        self.node, self.streams = node, streams
        self._transfers, self._stop, self.copies = transfers, stop, copies
        self._replaced: dict[tuple[str, int], set[str]] = {}  # (job, step) -> keys of an older commit node 0 removes
        self._abandoned: set[str] = set()  # keys whose multipart upload a failed attempt left unfinished
        self._abandoned_lock = threading.Lock()  # _put runs on the transfer threads

    def local_index(self, job: str, step: int) -> tuple[CheckpointIndex, bytes]:
        """The step's index in the local root (StepGone when it is not there)."""
        try:
            data = self.storage.files.read_small(job, step, INDEX_NAME)
        except FileNotFoundError:
            raise StepGone(f"step {step} of job {job!r} is no longer in {self.storage.location}") from None
        return CheckpointIndex.from_json_bytes(data, where=f"{self.storage.catalog.step_location(job, step)}/{INDEX_NAME}"), data

    def uploaded(self, job: str, step: int) -> bool:
        """Whether the bucket holds this very commit of the step (its index, byte for byte);
        remembers its files as copy sources when it does."""
        index, data = self.local_index(job, step)
        if self.store.get(self.location.key(job, step, INDEX_NAME)) != data:
            return False
        self.remember(job, step, index)
        return True

    def remember(self, job: str, step: int, index: CheckpointIndex, units: dict[str, tuple[Unit, ...]] | None = None) -> None:
        """Note the step's data files (in the bucket now) as sources of later copies."""
        if units is None:
            try:
                units = file_units(index)
            except FormatError:
                return
        for record in index.files:
            if record.name in units:
                self.copies.add(job, file_signature(record, units[record.name]), self.location.key(job, step, record.name))

    def upload(self, job: str, step: int, shared_root: bool) -> Uploaded:
        """Upload this node's part of the step (and, on node 0, its index, last). Raises StepGone,
        LocalDamage, Stopped, NotReady or a RemoteError; safe to call again after any of them."""
        index, data = self.local_index(job, step)
        try:
            units = file_units(index)
        except FormatError as exc:
            raise LocalDamage(f"step {step} of job {job!r}: {exc}") from None
        index_key = self.location.key(job, step, INDEX_NAME)
        there = self.store.get(index_key)
        if there == data:
            self.remember(job, step, index, units)
            return Uploaded(already=True)
        if there is not None:
            self._make_room(job, step, there)
        elif not self._older_commit_gone(job, step):
            raise NotReady(f"step {step} of job {job!r}: waiting for node 0 to finish removing the older commit of this step from {self.location.url}")
        mine = uploads_of(index, self.node, shared_root)
        data_files = [f for f in mine if f.name in units]
        per_file = max(1, self.streams // max(1, min(len(data_files), self.streams)))
        signatures = {f.name: file_signature(f, units[f.name]) for f in mine if f.name in units}
        seen: set[str] = set()
        later: set[str] = set()  # files with the bytes of an earlier file of the step (the PEFT adapter copy): copied once it is up
        for record in mine:
            signature = signatures.get(record.name, record.name)
            if signature in seen:
                later.add(record.name)
            seen.add(signature)
        sent = copied = 0
        try:
            for batch in ([f for f in mine if f.name not in later], [f for f in mine if f.name in later]):
                futures = [self._transfers.submit(self._put, job, step, record, units.get(record.name), signatures.get(record.name, ""),
                                                  per_file) for record in batch]
                for got_sent, got_copied in gather(futures):
                    sent, copied = sent + got_sent, copied + got_copied
        except LocalDamage:  # the step never gets its index: what this node sent of it goes (no leftover)
            self.store.delete([self.location.key(job, step, f.name) for f in mine])
            raise
        if not writes_index(self.node):
            self.remember(job, step, index, units)
            return Uploaded(sent, copied)
        if len(mine) < len(index.files):  # other nodes upload the rest: wait until every file is there
            self._wait_for_files(job, step, index)
        try:
            self.store.put_bytes(index_key, data, create=True)
        except RemoteExists:
            if self.store.get(index_key) != data:
                raise RemoteExists(f"another index of step {step} of job {job!r} appeared in {self.location.url} while this one was uploaded") from None
        self.remember(job, step, index, units)
        return Uploaded(sent + len(data), copied, published=True)

    def _abort_abandoned(self, key: str) -> None:
        """Before `key` is uploaded again: abort the multipart upload a failed attempt left of it
        (see the module docstring). A server that does not answer fails this attempt (it is
        retried); one that refuses the listing (credentials without the right to list multipart
        uploads) leaves it to the sweep at the next start, logged."""
        with self._abandoned_lock:
            if key not in self._abandoned:
                return
        try:
            aborted = self.store.abort_uploads_of(key)
        except RemoteError as exc:
            if exc.transient:
                raise
            log.warning("the unfinished multipart upload of %s that a failed attempt left is not aborted (%s): the next start sweeps it", key, exc)
            aborted = 0
        with self._abandoned_lock:
            self._abandoned.discard(key)
        if aborted:
            log.info("aborted %s unfinished multipart upload(s) of %s that a failed attempt left", aborted, key)

    def _make_room(self, job: str, step: int, there: bytes) -> None:
        """The bucket holds another commit of the step: node 0 deletes it (index first), the
        others wait until it is gone (NotReady until then)."""
        try:
            old = CheckpointIndex.from_json_bytes(there, where=self.location.key(job, step, INDEX_NAME))
        except FormatError:
            old = None
        if writes_index(self.node):
            log.warning("step %s of job %s: %s holds another commit of this step; replacing it", step, job, self.location.url_of(job, step))
            self.catalog.delete_step(job, step, old)
            self.copies.drop_prefix(job, self.location.step_prefix(job, step))
            return
        if old is not None:
            self._replaced[(job, step)] = {self.location.key(job, step, f.name) for f in old.files}
        raise NotReady(f"step {step} of job {job!r}: waiting for node 0 to remove the older commit of this step from {self.location.url}")

    def _older_commit_gone(self, job: str, step: int) -> bool:
        """A node other than 0 that saw an older commit of the step in the bucket: whether node 0
        has removed all of it (it deletes that commit's own files last, BucketCatalog.delete_step)."""
        old = self._replaced.get((job, step))
        if old is None:
            return True
        if old & set(self.store.list_objects(self.location.step_prefix(job, step))):
            return False
        del self._replaced[(job, step)]
        return True

    def _put(self, job: str, step: int, record: FileRecord, units: tuple[Unit, ...] | None, signature: str, streams: int) -> tuple[int, int]:
        """Upload one file (or copy it inside the bucket); returns (bytes sent, bytes copied).
        `units` and `signature` (objects.py): a data file's; None and "" for a small file."""
        if self._stop.is_set():
            raise Stopped("stopped")
        key = self.location.key(job, step, record.name)
        reader = self.storage.files.step_reader(job, step)
        if units is None:
            try:
                payload = reader.read_small(record.name, limit=record.size)
                check_small_file(record, payload)
            except FileNotFoundError:
                raise StepGone(f"{record.name} of step {step} of job {job!r} is no longer in {self.storage.location}") from None
            except (FormatError, OSError) as exc:
                raise LocalDamage(f"step {step} of job {job!r}: {exc}") from None
            self.store.put_bytes(key, payload)
            return len(payload), 0
        self._abort_abandoned(key)
        source = self.copies.find(job, signature)
        if source is not None and source != key and record.size <= MAX_COPY_BYTES:
            try:
                self.store.copy(source, key)
            except RemoteNotFound:
                self.copies.drop_prefix(job, source)  # deleted from the bucket meanwhile: upload it
            else:
                return 0, record.size
        try:
            handle = reader.open(record.name)
        except FileNotFoundError:
            raise StepGone(f"{record.name} of step {step} of job {job!r} is no longer in {self.storage.location}") from None
        with handle:
            if handle.size != record.size:
                raise LocalDamage(f"{record.name} of step {step} of job {job!r} has {handle.size} bytes, its index says {record.size}")
            body = VerifyingBody(handle, record.size, units, record.name, self._stop)
            try:
                self.store.put_body(key, body, record.size, streams)
            except RemoteError:  # a multipart upload may be left unfinished: aborted at the next attempt
                with self._abandoned_lock:
                    self._abandoned.add(key)
                raise
            problem = body.problem()
        if problem is not None:
            self.store.delete([key])
            raise LocalDamage(f"step {step} of job {job!r} is not uploaded: {problem} (check it with `ckptd verify`)")
        self.copies.add(job, signature, key)  # the source of a copy later in this step (the adapter file) or in later steps
        return record.size, 0

    def _wait_for_files(self, job: str, step: int, index: CheckpointIndex) -> None:
        """Node 0: return once every file the index lists is in the bucket with its size (other
        nodes upload theirs); NotReady after WAIT_FOR_NODES_S."""
        prefix = self.location.step_prefix(job, step)
        deadline = time.monotonic() + WAIT_FOR_NODES_S
        delay = 0.2
        while True:
            listed = self.store.list_objects(prefix)
            missing = [f for f in index.files if listed.get(prefix + f.name) != f.size]
            if not missing:
                return
            if time.monotonic() > deadline:
                nodes = sorted({f.node for f in missing})
                raise NotReady(
                    f"step {step} of job {job!r}: {len(missing)} file(s) not in {self.location.url} after {WAIT_FOR_NODES_S:.0f} s "
                    f"({', '.join(f.name for f in missing[:3])}...), written by node(s) {nodes}: are their daemons running with --remote?"
                )
            if self._stop.wait(delay):
                raise Stopped("stopped while waiting for the other nodes' files")
            delay = min(delay * 2, 10.0)


def transient(exc: BaseException) -> bool:
    """Whether a failed attempt is worth retrying as it is (else it needs a fix first; it is
    still retried, less often, since credentials and buckets get fixed while the daemon runs)."""
    return isinstance(exc, RemoteError) and exc.transient
