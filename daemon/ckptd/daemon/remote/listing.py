"""`ckptd ls s3://BUCKET/PREFIX`: what a bucket holds, read without a daemon, with the tier's own
credentials (the standard AWS environment and files, as `ckptd serve --remote`), store and
catalog. A step is committed in the bucket when its index object is there (written last by the
upload); objects of a step without one are an upload under way or interrupted, or a deletion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ckptd.format.index import INDEX_NAME, CheckpointIndex
from ckptd.daemon.remote.catalog import BucketCatalog
from ckptd.daemon.remote.credentials import CredentialsError, resolve
from ckptd.daemon.remote.location import LocationError, RemoteLocation, parse_location
from ckptd.daemon.remote.store import QUICK_RETRY_TIMEOUT_S, RemoteError, open_store

LISTING_PART_BYTES = 16 << 20  # unused by a listing (no upload); open_store needs one


class ListingError(RuntimeError):
    """The bucket could not be listed: the location, the credentials, the client or the server;
    the message says which and what to do."""


@dataclass(frozen=True)
class BucketSteps:
    """A job's steps in the bucket: the committed ones in commit order (oldest first), and the
    step numbers with objects but no index."""

    job: str
    committed: tuple[CheckpointIndex, ...]
    uncommitted: tuple[int, ...]


def list_bucket(url: str, job: str | None, environ: Mapping[str, str]) -> tuple[RemoteLocation, list[BucketSteps]]:
    """The location and, per job (only `job` when given, else every job under the prefix, by
    name), its steps in the bucket. Raises ListingError."""
    try:
        location = parse_location(url)
    except LocationError as exc:
        raise ListingError(str(exc)) from None
    try:
        store = open_store(location, resolve(dict(environ)), LISTING_PART_BYTES, retry_s=QUICK_RETRY_TIMEOUT_S)
        catalog = BucketCatalog(store)
        by_job: dict[str, dict[int, set[str]]] = {}  # job -> step -> file names: one listing in all
        if job is None:
            for parsed in map(location.parse_key, store.list_objects(location.root_prefix)):
                if parsed is not None:
                    by_job.setdefault(parsed[0], {}).setdefault(parsed[1], set()).add(parsed[2])
        else:
            by_job[job] = catalog.objects(job)
        out = []
        for name, objects in sorted(by_job.items()):
            committed = tuple(catalog.committed(name, objects=objects))
            uncommitted = tuple(sorted(step for step, files in objects.items() if INDEX_NAME not in files))
            out.append(BucketSteps(name, committed, uncommitted))
    except ValueError as exc:  # a job id that is not one (location.job_prefix)
        raise ListingError(str(exc)) from None
    except (CredentialsError, RemoteError, RuntimeError) as exc:  # RuntimeError: obstore is not installed
        raise ListingError(f"{location.url}: {exc}") from None
    return location, out
