"""The thin object-store wrapper of the tier: obstore's synchronous API (called from the tier's
worker threads; it releases the GIL and runs on obstore's own runtime), with every failure
turned into one of a few `RemoteError`s that say what to fix.

Uploads carry a CRC64-NVME checksum the server checks (`checksum_algorithm`), so a body damaged
on the way is refused (BadDigest) instead of stored; the payload itself is not signed
(`unsigned_payload`: SHA-256 over every byte would cost about 1 CPU s/GB on the trainer's node,
docs/design-notes.md). obstore retries each request (and each part of a multipart upload) with
exponential backoff; the uploader retries a whole step on top of that (upload.py). Unfinished
multipart uploads are listed and aborted through boto3 (obstore has no call for them).

obstore (and boto3) are imported inside `open_store` only: the daemon imports and runs without
them unless `--remote` is given.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator, Protocol, TypeVar

from ckptd.daemon.remote.credentials import FIX_CREDENTIALS, StoreSettings
from ckptd.daemon.remote.location import RemoteLocation

log = logging.getLogger(__name__)
T = TypeVar("T")

INSTALL_HINT = "pip install 'ckptd[s3]'"
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_DENIED_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken", "AllAccessDisabled", "InvalidClientTokenId")

Hook = Callable[[str, str], None]  # (request kind, key) before each request: faults.RequestFaults


class RemoteError(RuntimeError):
    """An object-store request failed; `transient`: worth retrying as it is (the server is down
    or overloaded), else it needs a fix (credentials, bucket) or is about one object."""

    transient = False


class RemoteUnavailable(RemoteError):
    """The server did not answer, or failed (5xx), after obstore's own retries."""

    transient = True


class RemoteAccessDenied(RemoteError):
    """The credentials were refused (or lack a right): fix them."""


class RemoteBucketMissing(RemoteError):
    """The bucket does not exist: create it or fix the location."""


class RemoteNotFound(RemoteError):
    """The object does not exist."""


class RemoteExists(RemoteError):
    """A conditional write found the object there already."""


class Stopped(Exception):
    """The daemon is shutting down: a transfer stops where it is (resumed at the next start)."""


class Body(Protocol):
    """A file body obstore reads in parts (a binary file object): read, seek, tell."""

    def read(self, size: int = -1) -> bytes: ...

    def seek(self, offset: int, whence: int = 0) -> int: ...

    def tell(self) -> int: ...


class ObjectStore:
    """Blocking calls on one bucket (keys are whole keys: location.py builds them). Thread-safe.

    part_bytes: the part size of multipart uploads (files larger than it are uploaded in parts,
    `streams` parts in flight at most per file unless a call says fewer)."""

    def __init__(self, location: RemoteLocation, settings: StoreSettings, obstore: Any, store: Any, quick: Any,
                 part_bytes: int, hook: Hook | None = None) -> None:
        self.location = location
        self.settings = settings
        self.part_bytes = part_bytes
        self._obs = obstore
        self._store = store
        self._quick = quick  # the same store with short retries: start-up checks answer in seconds
        self._hook = hook
        self._lock = threading.Lock()
        self._boto: Any = None

    # ------------------------------------------------------------ errors

    def error(self, exc: BaseException, what: str) -> RemoteError:
        """`exc` from obstore or boto3 during `what` -> the RemoteError that says what to fix."""
        text = str(exc)
        match = _CODE.search(text)
        code = match.group(1) if match else ""
        if not code and hasattr(exc, "response"):  # botocore's ClientError
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        where = f"{self.location.url} at {self.settings.shown_endpoint}"
        first_line = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
        if code == "NoSuchBucket":
            return RemoteBucketMissing(
                f"{what}: the bucket {self.location.bucket!r} does not exist at {self.settings.shown_endpoint}: create it "
                f"(e.g. `aws s3 mb s3://{self.location.bucket}`) or fix --remote / CKPTD_REMOTE; check AWS_ENDPOINT_URL and AWS_REGION"
            )
        errors = self._obs.exceptions
        if code in _DENIED_CODES or isinstance(exc, (errors.PermissionDeniedError, errors.UnauthenticatedError)):
            return RemoteAccessDenied(
                f"{what}: the object store refused the credentials for bucket {self.location.bucket!r} ({code or type(exc).__name__}; "
                f"credentials from {self.settings.source}): {FIX_CREDENTIALS}, with read, write, list and delete rights on {where}"
            )
        if isinstance(exc, errors.NotFoundError) or code in ("NoSuchKey", "NoSuchUpload"):
            return RemoteNotFound(f"{what}: not found in {where}")
        if isinstance(exc, (errors.AlreadyExistsError, errors.PreconditionError)):
            return RemoteExists(f"{what}: already exists in {where}")
        return RemoteUnavailable(f"{what}: the object store at {self.settings.shown_endpoint} did not answer or failed: {first_line}")

    def _call(self, kind: str, key: str, fn: Callable[[], Any]) -> Any:
        if self._hook is not None:
            self._hook(kind, key)
        try:
            return fn()
        except (RemoteError, Stopped):
            raise
        except Exception as exc:  # obstore raises its own types and OSErrors: classified here
            raise self.error(exc, f"{kind} {key}") from None

    # ------------------------------------------------------------ requests

    def check(self) -> None:
        """One list request at the prefix, with short retries: raises RemoteAccessDenied,
        RemoteBucketMissing or RemoteUnavailable; returns when the tier can read the bucket."""
        prefix = self.location.root_prefix or None
        self._call("list", prefix or "", lambda: self._obs.list_with_delimiter(self._quick, prefix))

    def put_bytes(self, key: str, data: bytes, create: bool = False) -> None:
        """Write a small object in one request; `create`: only if `key` does not exist (RemoteExists)."""
        self._call("put", key, lambda: self._obs.put(self._store, key, data, mode="create" if create else "overwrite", use_multipart=False))

    def put_body(self, key: str, body: Body, size: int, streams: int) -> None:
        """Upload a file's `size` bytes from `body`: multipart above `part_bytes`, `streams` parts
        in flight; the object appears whole or not at all."""
        part = max(self.part_bytes, -(-size // 9_000))  # S3 allows 10,000 parts
        self._call("put-file", key, lambda: self._obs.put(
            self._store, key, _Counted(body, self._hook, key) if self._hook else body,
            chunk_size=part, max_concurrency=max(1, streams), use_multipart=size > part,
        ))

    def copy(self, source: str, key: str) -> None:
        """Copy `source` to `key` inside the bucket (no bytes through this node); RemoteNotFound
        when `source` is gone."""
        self._call("copy", key, lambda: self._obs.copy(self._store, source, key, overwrite=True))

    def get(self, key: str) -> bytes | None:
        """The whole object, or None when there is none."""
        try:
            result = self._call("get", key, lambda: self._obs.get(self._store, key).bytes())
        except RemoteNotFound:
            return None
        return bytes(result)

    def get_range(self, key: str, start: int, end: int) -> memoryview:
        """Bytes [start, end) of an object (RemoteNotFound when it is gone)."""
        data = self._call("get-range", key, lambda: self._obs.get_range(self._store, key, start=start, end=end))
        return memoryview(data)

    def list_objects(self, prefix: str) -> dict[str, int]:
        """Every object under `prefix`: key -> size."""
        def collect() -> dict[str, int]:
            found: dict[str, int] = {}
            for batch in self._obs.list(self._store, prefix, chunk_size=1000):
                for meta in batch:
                    found[str(meta["path"])] = int(meta["size"])
            return found
        return dict(self._call("list", prefix, collect))

    def delete(self, keys: list[str]) -> None:
        """Delete objects (absent ones are no error), in batches of 1,000."""
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            self._call("delete", batch[0], lambda: self._obs.delete(self._store, batch))

    def unfinished_uploads(self, prefix: str) -> Iterator[tuple[str, str, datetime]]:
        """(key, upload id, initiated) of multipart uploads under `prefix` never completed or
        aborted (invisible in listings, but stored and billed). Nothing without boto3 (logged)."""
        client = self._boto_client()
        if client is None:
            return
        marker: dict[str, str] = {}
        while True:
            page = self._call("list-uploads", prefix, lambda: client.list_multipart_uploads(Bucket=self.location.bucket, Prefix=prefix, **marker))
            for upload in page.get("Uploads", []):
                initiated = upload.get("Initiated") or datetime.now(timezone.utc)
                yield str(upload["Key"]), str(upload["UploadId"]), initiated
            if not page.get("IsTruncated"):
                return
            marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    def abort_uploads_of(self, key: str) -> int:
        """Abort every unfinished multipart upload of exactly `key` (the caller's own: it is not
        uploading `key` now); returns how many. Nothing without boto3 (logged)."""
        found = [upload_id for where, upload_id, _ in self.unfinished_uploads(key) if where == key]
        for upload_id in found:
            self.abort_upload(key, upload_id)
        return len(found)

    def abort_upload(self, key: str, upload_id: str) -> None:
        client = self._boto_client()
        if client is not None:
            try:
                self._call("abort-upload", key, lambda: client.abort_multipart_upload(Bucket=self.location.bucket, Key=key, UploadId=upload_id))
            except RemoteNotFound:
                pass  # completed or aborted meanwhile

    def _boto_client(self) -> Any:
        from ckptd.daemon.remote.credentials import boto3_client

        with self._lock:
            if self._boto is None:
                self._boto = boto3_client(self.settings) or False
                if self._boto is False:
                    log.warning("boto3 is not installed: unfinished multipart uploads under %s are not swept (%s)", self.location.url, INSTALL_HINT)
        return self._boto or None


def gather(futures: list[Future[T]]) -> list[T]:
    """The results of `futures` in order. When one fails, those not started are cancelled and the
    running ones waited for (no transfer of an attempt outlives it), then the first error is raised."""
    wait(futures, return_when=FIRST_EXCEPTION)
    errors = [error for f in futures if f.done() and not f.cancelled() and (error := f.exception()) is not None]
    if errors:
        for future in futures:
            future.cancel()
        wait(futures)
        raise errors[0]
    return [f.result() for f in futures]



class _Counted:
    """A body whose reads (one per part) count as requests for the fault hook (tests only)."""

    def __init__(self, body: Body, hook: Hook, key: str) -> None:
        self._body, self._hook, self._key = body, hook, key

    def read(self, size: int = -1) -> bytes:
        self._hook("put-part", self._key)
        return self._body.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._body.seek(offset, whence)

    def tell(self) -> int:
        return self._body.tell()


# Per-request retries of the tier's store (obstore's own backoff: 100 ms doubling with jitter up
# to 15 s); a longer outage fails the request and the uploader retries the whole step later.
RETRY_TIMEOUT_S = 60.0
QUICK_RETRY_TIMEOUT_S = 5.0


def require_client() -> Any:
    """The obstore module; RuntimeError saying how to install it when it is missing."""
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as exc:
        raise RuntimeError(f"the object-store tier needs the client library obstore ({exc}): {INSTALL_HINT}") from None
    return obstore


def open_store(location: RemoteLocation, settings: StoreSettings, part_bytes: int, hook: Hook | None = None,
               retry_s: float = RETRY_TIMEOUT_S) -> ObjectStore:
    """The store for `location` (no request made); `retry_s`: how long one request is retried.
    Raises RuntimeError saying how to install obstore when it is missing."""
    obstore = require_client()
    S3Store = obstore.store.S3Store
    config: dict[str, Any] = {}
    if settings.endpoint:
        config["endpoint"] = settings.endpoint
    if settings.region:
        config["region"] = settings.region
    if not os.environ.get("AWS_CHECKSUM_ALGORITHM"):
        config["checksum_algorithm"] = "CRC64NVME"
    if not os.environ.get("AWS_UNSIGNED_PAYLOAD"):
        config["unsigned_payload"] = True

    def build(retry_s: float, retries: int) -> Any:
        retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=retry_s),
                 "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2}}
        return S3Store(location.bucket, config=config, client_options={"allow_http": settings.allow_http},
                       retry_config=retry, credential_provider=settings.provider)

    return ObjectStore(location, settings, obstore, build(retry_s, 10), build(min(retry_s, QUICK_RETRY_TIMEOUT_S), 3), part_bytes, hook)
