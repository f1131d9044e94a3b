"""One step in the bucket read as a StepReader (storage/base.py), for the operator tools: `ckptd
verify`, `inspect` and `export` of `s3://BUCKET/PREFIX/JOB/step-NNNNNNNN`, without a daemon and
with the tier's own credentials, as `ckptd ls s3://...` (listing.py). Reads only."""

from __future__ import annotations

import errno
from typing import Mapping

from ckptd.daemon.remote.credentials import CredentialsError, resolve
from ckptd.daemon.remote.location import LocationError, RemoteLocation, parse_step_location
from ckptd.daemon.remote.store import QUICK_RETRY_TIMEOUT_S, ObjectStore, RemoteError, open_store

READER_PART_BYTES = 16 << 20  # unused by reads (no upload); open_store needs one


class BucketStepError(RuntimeError):
    """The step could not be opened: the location, the credentials, the client or the server;
    the message says which and what to do."""


class BucketReadHandle:
    """One object of the step, read by ranged GETs (base.ReadHandle)."""

    def __init__(self, store: ObjectStore, key: str, size: int) -> None:
        self._store, self._key, self.size = store, key, size

    def pread(self, nbytes: int, offset: int) -> bytes:
        end = min(self.size, offset + nbytes)
        if offset >= end:
            return b""
        return bytes(self._store.get_range(self._key, offset, end))

    def close(self) -> None:
        """Nothing is held between reads."""

    def __enter__(self) -> "BucketReadHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BucketStepReader:
    """The objects under `PREFIX/JOB/step-NNNNNNNN/` as the files of a step (base.StepReader);
    listed once, when opened. A missing object is FileNotFoundError; a RemoteError otherwise."""

    def __init__(self, store: ObjectStore, location: RemoteLocation, job: str, step: int) -> None:
        self._store, self._location, self._job, self._step = store, location, job, step
        self.where = location.url_of(job, step)
        prefix = location.step_prefix(job, step)
        self._sizes = {key[len(prefix):]: size for key, size in store.list_objects(prefix).items() if "/" not in key[len(prefix):]}

    def _size(self, name: str) -> int:
        self._location.key(self._job, self._step, name)  # ValueError for a name that is not a plain file name
        if name not in self._sizes:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.where}/{name}")
        return self._sizes[name]

    def names(self) -> list[str]:
        return sorted(self._sizes)

    def exists(self, name: str) -> bool:
        return name in self._sizes

    def read_small(self, name: str, limit: int = 1 << 30) -> bytes:
        if self._size(name) > limit:
            raise OSError(errno.EFBIG, f"{self.where}/{name} is larger than the {limit} bytes expected of it")
        data = self._store.get(self._location.key(self._job, self._step, name))
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.where}/{name}")
        return data

    def open(self, name: str) -> BucketReadHandle:
        return BucketReadHandle(self._store, self._location.key(self._job, self._step, name), self._size(name))


def open_bucket_step(url: str, environ: Mapping[str, str]) -> BucketStepReader:
    """The step at `url` (s3://BUCKET/PREFIX/JOB/step-NNNNNNNN), with the credentials of
    `environ` (credentials.resolve). Raises BucketStepError."""
    try:
        location, job, step = parse_step_location(url)
    except LocationError as exc:
        raise BucketStepError(str(exc)) from None
    try:
        return BucketStepReader(open_store(location, resolve(dict(environ)), READER_PART_BYTES, retry_s=QUICK_RETRY_TIMEOUT_S), location, job, step)
    except (CredentialsError, RemoteError, RuntimeError) as exc:  # RuntimeError: obstore is not installed
        raise BucketStepError(f"{location.url_of(job, step)}: {exc}") from None
