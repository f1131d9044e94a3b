"""Where the object-store tier keeps checkpoints: `s3://BUCKET/PREFIX`, and the object keys of
the on-disk layout under it (`PREFIX/JOB/step-NNNNNNNN/<file>`, docs/architecture.md §7). Pure.

Keys are built only from a parsed location, a validated job id, an integer step and a plain
file name, and parsed back only when they have exactly that shape: nothing else in the bucket
is ever taken for a step of a job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptd.common.names import JOB_ID_PATTERN, check_job_id
from ckptd.format.index import is_plain_file_name, parse_step_dir_name, step_dir_name

SCHEME = "s3://"
# S3's rules for bucket names: 3-63 characters of lowercase letters, digits, '.' and '-',
# starting and ending with a letter or digit, no "..", not shaped like an IP address.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP_LIKE = re.compile(r"\d+\.\d+\.\d+\.\d+")
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
EXAMPLE = "s3://my-bucket/checkpoints"


class LocationError(ValueError):
    """A `--remote` value that is not a valid `s3://BUCKET/PREFIX`; the message says why and how to fix it."""


@dataclass(frozen=True)
class RemoteLocation:
    """A bucket and a key prefix in it ("" or segments joined by '/', no leading or trailing '/')."""

    bucket: str
    prefix: str = ""

    @property
    def url(self) -> str:
        """`s3://BUCKET/PREFIX` as given (normalized), for messages and listings."""
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"

    @property
    def root_prefix(self) -> str:
        """The key prefix of everything the tier writes: "PREFIX/" (or "" at the bucket's top)."""
        return f"{self.prefix}/" if self.prefix else ""

    def job_prefix(self, job: str) -> str:
        return f"{self.root_prefix}{check_job_id(job)}/"

    def step_prefix(self, job: str, step: int) -> str:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return f"{self.job_prefix(job)}{step_dir_name(step)}/"

    def key(self, job: str, step: int, name: str) -> str:
        """The object key of file `name` of a step (a plain file name, as in a step directory)."""
        if not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not a file name of a step directory")
        return self.step_prefix(job, step) + name

    def url_of(self, job: str, step: int) -> str:
        """The step as shown to people: s3://BUCKET/PREFIX/JOB/step-NNNNNNNN."""
        return f"{SCHEME}{self.bucket}/{self.step_prefix(job, step).rstrip('/')}"

    def parse_key(self, key: str) -> tuple[str, int, str] | None:
        """(job, step, file name) of a key under this location laid out as `key` makes them, else None."""
        if not key.startswith(self.root_prefix):
            return None
        parts = key[len(self.root_prefix):].split("/")
        if len(parts) != 3 or not JOB_ID_PATTERN.fullmatch(parts[0]) or not parts[2] or parts[2] in (".", ".."):
            return None
        step = parse_step_dir_name(parts[1])
        return None if step is None else (parts[0], step, parts[2])


def parse_location(text: str) -> RemoteLocation:
    """`s3://BUCKET` or `s3://BUCKET/PREFIX` -> RemoteLocation; LocationError says what is wrong.

    The prefix is segments of letters, digits, '.', '_' and '-' (no empty, '.' or '..'
    segment); a trailing '/' is dropped."""
    if not isinstance(text, str) or not text.strip():
        raise LocationError(f"the object store location is empty; give s3://BUCKET/PREFIX, e.g. {EXAMPLE}")
    text = text.strip()
    if not text.startswith(SCHEME):
        scheme = text.split("://", 1)[0] + "://" if "://" in text else ""
        what = f"the scheme {scheme!r} is not supported" if scheme else "it has no scheme"
        raise LocationError(f"{text!r} is not an object store location ({what}): give s3://BUCKET/PREFIX, e.g. {EXAMPLE}")
    bucket, _, prefix = text[len(SCHEME):].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IP_LIKE.fullmatch(bucket):
        raise LocationError(
            f"{bucket!r} in {text!r} is not a valid S3 bucket name: use 3-63 lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit (e.g. s3://my-bucket/checkpoints)"
        )
    prefix = prefix.rstrip("/")
    if prefix:
        for segment in prefix.split("/"):
            if segment in (".", "..") or not _SEGMENT.fullmatch(segment):
                raise LocationError(
                    f"the prefix {prefix!r} in {text!r} has the segment {segment!r}: use segments of letters, digits, "
                    "'.', '_' and '-' separated by single '/' (no empty, '.' or '..' segment)"
                )
    return RemoteLocation(bucket, prefix)


def parse_step_location(text: str) -> tuple[RemoteLocation, str, int]:
    """`s3://BUCKET/PREFIX/JOB/step-NNNNNNNN` (what `ckptd ls s3://BUCKET/PREFIX` shows) ->
    (the location s3://BUCKET/PREFIX, JOB, the step); LocationError says what is wrong."""
    head, _, step_name = text.strip().rstrip("/").rpartition("/")
    head, _, job = head.rpartition("/")
    step = parse_step_dir_name(step_name)
    if step is None or not job or not head.startswith(SCHEME):
        raise LocationError(f"{text!r} is not a step in an object store: give s3://BUCKET/PREFIX/JOB/step-NNNNNNNN (`ckptd ls s3://BUCKET/PREFIX` lists them)")
    try:
        check_job_id(job)
    except ValueError as exc:
        raise LocationError(f"{text!r}: {exc}") from None
    return parse_location(head), job, step


def location_setting(raw: object) -> str:
    """The `remote` setting (config.py): "" (no tier) or the normalized s3://BUCKET/PREFIX; LocationError otherwise."""
    if isinstance(raw, str) and not raw.strip():
        return ""
    if not isinstance(raw, str):
        raise LocationError(f"{raw!r} is not a text: give s3://BUCKET/PREFIX, e.g. {EXAMPLE}")
    return parse_location(raw).url
