"""A storage root's committed steps, read without a daemon and without writing anything.

`<root>/<job>/step-NNNNNNNN/` is a committed step when it holds ckptd.index.json
(docs/architecture.md §7); steps are ordered by the commit time their index records. The
daemon's storage rules for reading hold here too: no link is followed (a job or step directory,
an index or a small file that is a link is none of the job's), and only regular files are read
(opened O_NONBLOCK, so a FIFO planted in a step never blocks a read).
"""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ckptd.common import json_read
from ckptd.common.files import read_regular, real_dir_at, real_file_at
from ckptd.common.names import check_job_id, check_step
from ckptd.format.index import INDEX_HEAD_BYTES, INDEX_NAME, CheckpointIndex, is_plain_file_name, parse_step_dir_name, step_dir_name


@dataclass(frozen=True)
class StepRoot:
    """The committed steps under `root` (an absolute, resolved path), read-only."""

    root: Path

    def job_dir(self, job: str) -> Path:
        return self.root / check_job_id(job)

    def step_dir(self, job: str, step: int) -> Path:
        return self.job_dir(job) / step_dir_name(check_step(step))

    def is_committed(self, job: str, step: int) -> bool:
        """Whether the step's directory holds its index, neither of them nor the job directory a link."""
        return real_dir_at(self.job_dir(job)) and _committed(self.step_dir(job, step))

    def commit_order(self, job: str) -> list[int]:
        """The committed steps, oldest commit first: by the `created_at` their index records (the
        file's modification time when it cannot be read), ties by step number. The last is the
        newest step, whatever its number (a rolled-back job commits a lower step after higher ones)."""
        job_dir = self.job_dir(job)
        if not real_dir_at(job_dir):
            return []
        times = {}
        for entry in os.scandir(job_dir):
            step = parse_step_dir_name(entry.name)
            if step is not None and _committed(Path(entry.path)):
                times[step] = _commit_time(Path(entry.path) / INDEX_NAME)
        return sorted(times, key=lambda step: (times[step], step))

    def read_index(self, job: str, step: int) -> CheckpointIndex:
        """The step's parsed index. Raises OSError (a link or no file in its place) or FormatError."""
        path = self.step_dir(job, step) / INDEX_NAME
        return CheckpointIndex.of_step(self.read_small(job, step, INDEX_NAME), None, step, where=str(path))

    def read_small(self, job: str, step: int, name: str, limit: int = 1 << 30) -> bytes:
        """The whole file `name` of a step; OSError when it or a directory above it up to the job's
        is a link or not what it should be, or (EFBIG) when it is larger than `limit` bytes."""
        path = self.file_path(job, step, name)
        for directory in (path.parent.parent, path.parent):
            if not real_dir_at(directory):
                raise OSError(errno.ENOTDIR, f"{directory} is not a directory (a link or other entry is never followed)", str(directory))
        data = read_regular(path, limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{path} is larger than the {limit} bytes expected of it", str(path))
        return data

    def file_path(self, job: str, step: int, name: str) -> Path:
        """The path of file `name` (a plain name) of a step, which the client's reader opens itself."""
        if not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not a file name of a step directory")
        return self.step_dir(job, step) / name


def _committed(step_dir: Path) -> bool:
    return real_dir_at(step_dir) and real_file_at(step_dir / INDEX_NAME)


def _commit_time(index: Path) -> float:
    """The index's `created_at`: from its head when this version wrote it, else from the whole
    file; its modification time when neither gives a finite one; -inf when it is gone."""
    try:
        mtime = os.lstat(index).st_mtime
    except OSError:
        return float("-inf")
    try:
        created = CheckpointIndex.created_at_of(read_regular(index, INDEX_HEAD_BYTES))
        if created is None:
            created = float(json_read.loads(read_regular(index, 1 << 30))["created_at"])
    except (OSError, ValueError, KeyError, TypeError):
        created = float("nan")
    return created if math.isfinite(created) else mtime
