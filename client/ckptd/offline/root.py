"""A storage root's committed steps, read without a daemon and without writing anything.

`<root>/<job>/step-NNNNNNNN/` is a committed step when it holds ckptd.index.json
(docs/architecture.md §7); steps are ordered by the commit time their index records. The
daemon's storage rules for reading hold here too: no link is followed (a job or step directory,
an index or a small file that is a link is none of the job's), and only regular files are read
(opened O_NONBLOCK, so a FIFO planted in a step never blocks a read).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ckptd.common.names import check_job_id
from ckptd.format.index import INDEX_HEAD_BYTES, INDEX_NAME, CheckpointIndex, parse_step_dir_name, step_dir_name


@dataclass(frozen=True)
class StepRoot:
    """The committed steps under `root` (an absolute, resolved path), read-only."""

    root: Path

    def job_dir(self, job: str) -> Path:
        return self.root / check_job_id(job)

    def step_dir(self, job: str, step: int) -> Path:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return self.job_dir(job) / step_dir_name(step)

    def is_committed(self, job: str, step: int) -> bool:
        """Whether the step's directory holds its index, neither of them nor the job directory a link."""
        return _is_dir(self.job_dir(job)) and _committed_at(self.step_dir(job, step))

    def commit_order(self, job: str) -> list[int]:
        """The committed steps, oldest commit first: by the `created_at` their index records (the
        file's modification time when it cannot be read), ties by step number. The last is the
        newest step, whatever its number (a rolled-back job commits a lower step after higher ones)."""
        job_dir = self.job_dir(job)
        if not _is_dir(job_dir):
            return []
        times = {}
        for entry in os.scandir(job_dir):
            step = parse_step_dir_name(entry.name)
            if step is not None and _committed_at(Path(entry.path)):
                times[step] = _commit_time(Path(entry.path) / INDEX_NAME)
        return sorted(times, key=lambda step: (times[step], step))

    def read_index(self, job: str, step: int) -> CheckpointIndex:
        """The step's parsed index. Raises OSError (a link or no file in its place) or FormatError."""
        path = self.step_dir(job, step) / INDEX_NAME
        return CheckpointIndex.from_json_bytes(self.read_small(job, step, INDEX_NAME), where=str(path))

    def read_small(self, job: str, step: int, name: str, limit: int = 1 << 30) -> bytes:
        """The whole file `name` of a step; OSError when it or a directory above it up to the job's
        is a link or not what it should be, or (EFBIG) when it is larger than `limit` bytes."""
        path = self.file_path(job, step, name)
        for directory in (path.parent.parent, path.parent):
            if not _is_dir(directory):
                raise OSError(errno.ENOTDIR, f"{directory} is not a directory (a link or other entry is never followed)", str(directory))
        data = _read_regular(path, limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{path} is larger than the {limit} bytes expected of it", str(path))
        return data

    def file_path(self, job: str, step: int, name: str) -> Path:
        """The path of file `name` (a plain name) of a step, which the client's reader opens itself."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a file name of a step directory")
        return self.step_dir(job, step) / name


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _committed_at(step_dir: Path) -> bool:
    try:
        return _is_dir(step_dir) and stat.S_ISREG(os.lstat(step_dir / INDEX_NAME).st_mode)
    except OSError:
        return False


def _read_regular(path: Path, limit: int) -> bytes:
    """Up to `limit` bytes of the regular file at `path`, never through a link nor waiting on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link, which is never followed", str(path)) from None
        raise
    with open(fd, "rb", closefd=True) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file", str(path))
        os.set_blocking(fd, True)
        return f.read(limit)


def _commit_time(index: Path) -> float:
    """The index's `created_at`: from its head when this version wrote it, else from the whole
    file; its modification time when neither gives a finite one; -inf when it is gone."""
    try:
        mtime = os.lstat(index).st_mtime
    except OSError:
        return float("-inf")
    try:
        created = CheckpointIndex.created_at_of(_read_regular(index, INDEX_HEAD_BYTES))
        if created is None:
            created = float(json.loads(_read_regular(index, 1 << 30))["created_at"])
    except (OSError, ValueError, KeyError, TypeError):
        created = float("nan")
    return created if math.isfinite(created) else mtime
