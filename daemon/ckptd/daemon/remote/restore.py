"""Restoring a step from the bucket into the local root (blocking: runs on the tier's threads).

The step is written the way the writer writes a save, through the storage backend only: data
files as parts (`open_part`, written at their offsets from parallel ranged GETs, synced,
published), then committed by storage.step_commit.StepCommit (small files, the index last,
`latest`). Every byte is checked against the step's own
index before it is written: each data file unit by unit (header, tensors, chunks:
ckptd.format.units), each small file whole. A failure removes what was written (the step
directory holds no index until the end, so it is never served, and start-up recovery or
`ckptd gc` would remove it too).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import xxhash

from ckptd.daemon.errors import NoSpace
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FormatError, check_small_file
from ckptd.format.units import Unit, file_units, read_ranges
from ckptd.daemon.remote.objects import small_files
from ckptd.daemon.remote.store import ObjectStore, RemoteNotFound, Stopped, gather
from ckptd.daemon.storage import PartWriter, StorageBackend
from ckptd.daemon.storage.space import space_problem
from ckptd.daemon.storage.step_commit import StepCommit

log = logging.getLogger(__name__)

RANGE_BYTES = 8 << 20  # bytes per ranged GET (consecutive units grouped up to this)


class DownloadDamaged(FormatError):
    """What the bucket holds for a step does not match the step's index (or is missing)."""


@dataclass(frozen=True)
class Restored:
    job: str
    step: int
    nbytes: int  # bytes downloaded
    where: str  # the step's directory in the local root


class StepRestorer:
    """Downloads committed steps of the bucket into the local root (see the module docstring)."""

    def __init__(self, storage: StorageBackend, store: ObjectStore, transfers: ThreadPoolExecutor, stop: threading.Event,
                 disk_reserve: int) -> None:
        self.storage, self.store = storage, store
        self.location = store.location
        self._transfers, self._stop = transfers, stop
        self.disk_reserve = disk_reserve

    def restore(self, job: str, step: int, index_bytes: bytes) -> Restored:
        """Download step `step` of `job` (whose index object holds `index_bytes`) into the root.
        Raises DownloadDamaged, NoSpace, a RemoteError, or FileExistsError when the root
        committed that step meanwhile (nothing to do then)."""
        where = self.location.url_of(job, step)
        index = CheckpointIndex.of_step(index_bytes, job, step, f"{where}/{INDEX_NAME}")
        try:
            units = file_units(index)
        except FormatError as exc:
            raise DownloadDamaged(f"{where}: {exc}") from None
        self._check_space(job, index)
        self.storage.writing.prepare_step(job, step)
        commit = StepCommit(self.storage.writing, self.storage.catalog, job, step)
        try:
            nbytes, small = self._download(job, step, index, units)
            commit.publish({**small, INDEX_NAME: index_bytes})
        except BaseException:
            try:
                self.storage.janitor.remove_step(job, step)
            except OSError as exc:  # left for start-up recovery or `ckptd gc` (no index: never served)
                log.warning("could not remove the interrupted restore of step %s of job %s: %s", step, job, exc)
            raise
        commit.point_latest("newest")
        return Restored(job, step, nbytes + len(index_bytes), self.storage.catalog.step_location(job, step))

    def _check_space(self, job: str, index: CheckpointIndex) -> None:
        free = self.storage.writing.free_bytes(job)
        problem = space_problem(index.size_bytes, 0, self.disk_reserve, free.nbytes, free.where) if free is not None else None
        if problem is not None:
            raise NoSpace(f"step {index.step} of job {job!r} is not restored: {problem}")

    def _download(self, job: str, step: int, index: CheckpointIndex, units: dict[str, tuple[Unit, ...]]) -> tuple[int, dict[str, bytes]]:
        """Download and publish the step's data files; fetch and check its small files (written
        by the caller with the index). Returns the bytes downloaded and the small files."""
        parts: dict[str, PartWriter] = {}
        futures: list[Future[int]] = []
        try:
            for record in index.files:
                if record.name not in units:
                    continue
                part = self.storage.writing.open_part(job, step, record.name, record.size)
                parts[record.name] = part
                key = self.location.key(job, step, record.name)
                for start, end, group in read_ranges(units[record.name], RANGE_BYTES):
                    futures.append(self._transfers.submit(self._fetch_range, key, record.name, part, start, end, group))
            nbytes = sum(gather(futures))  # on an error, no range is still being written when the parts close below
            for part in parts.values():
                part.sync()
                part.close()
                part.publish()
        except BaseException:
            for future in futures:  # a part that could not be opened: the ranges already asked for stop first
                future.cancel()
            wait(futures)
            raise
        finally:
            for part in parts.values():
                part.close()
        small = {}
        for record in small_files(index, units):
            data = self.store.get(self.location.key(job, step, record.name))
            if data is None:
                raise DownloadDamaged(f"{self.location.url_of(job, step)}: {record.name}, which its index lists, is missing from the bucket")
            try:
                check_small_file(record, data)
            except FormatError as exc:
                raise DownloadDamaged(f"{self.location.url_of(job, step)}: {exc}") from None
            small[record.name] = data
            nbytes += len(data)
        return nbytes, small

    def _fetch_range(self, key: str, name: str, part: PartWriter, start: int, end: int, units: tuple[Unit, ...]) -> int:
        """GET bytes [start, end) of one file, check each unit in them, write them at their offset."""
        if self._stop.is_set():
            raise Stopped(f"the restore of {key} stopped: the daemon is shutting down")
        try:
            view = self.store.get_range(key, start, end)
        except RemoteNotFound:
            raise DownloadDamaged(f"{name}, which the index of {key.rsplit('/', 1)[0]} lists, is missing from the bucket") from None
        if len(view) != end - start:
            raise DownloadDamaged(f"{key}: asked for bytes [{start}, {end}), got {len(view)} (the object is shorter than its index says)")
        for unit in units:
            got = xxhash.xxh3_64_intdigest(view[unit.offset - start : unit.end - start])
            if got != unit.xxh3:
                raise DownloadDamaged(f"{key}: bytes [{unit.offset}, {unit.end}) do not match their checksum in the step's index: the object is damaged")
        part.pwrite(start, view)
        return len(view)
