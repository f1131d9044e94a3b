"""The paths of a POSIX storage root, `<root>/<job>/step-XXXXXXXX/...` with `<root>/<job>/latest`
and `<root>/<job>/.recycle/`, shared by the role classes of posix.Storage.

Every path is built here from a validated job id and an integer step, so no request can name a
path outside the root; nothing is followed through a link (fs.ForeignEntry)."""

from __future__ import annotations

import os
from pathlib import Path

from ckptd.common.files import real_dir_at, real_file_at
from ckptd.common.names import check_job_id
from ckptd.daemon.storage.fs import RECYCLE_DIR, ForeignEntry, lkind, open_for_reading
from ckptd.format.index import INDEX_NAME, LATEST, is_plain_file_name, parse_step_dir_name, step_dir_name

ROOT_ID_FILE = ".ckptd-root-id"  # the root's id (PosixCatalog.root_id): a directory holding one is a storage root


class PosixTree:
    """Paths under one root directory (resolved once)."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def job_dir(self, job: str) -> Path:
        return self.root / check_job_id(job)

    def step_dir(self, job: str, step: int) -> Path:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return self.job_dir(job) / step_dir_name(step)

    def recycle_dir(self, job: str) -> Path:
        """Data files of deleted steps, kept to be overwritten by the next save.

        Overwriting allocated blocks in place is several times faster than writing new ones on
        thin-provisioned and cloud disks (here: 0.3 s against 3.3 s per GiB), and saves the
        file system's block allocation. Nothing in it is ever read.
        """
        return self.job_dir(job) / RECYCLE_DIR

    def is_committed(self, job: str, step: int) -> bool:
        """Whether the step's directory holds its index. The job directory, the step directory
        and the index must each be what they seem, not links (planted `step-N -> /elsewhere`
        is not a step of the job: never listed, loaded, or deleted through)."""
        return real_dir_at(self.job_dir(job)) and committed_at(self.step_dir(job, step))

    def step_file(self, job: str, step: int, name: str) -> Path:
        """The path of file `name` of a step; ValueError unless `name` is a plain name (no '/',
        not '.' or '..'): no name leads out of the step directory."""
        if not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not a file name of a step directory")
        return self.step_dir(job, step) / name

    def open_step_file(self, job: str, step: int, name: str) -> int:
        """A descriptor to read file `name` of a step (a plain name, no '/'), never through a
        link nor blocking on a FIFO (open_for_reading), nor inside a step or job directory that
        is a link (ForeignEntry naming it)."""
        path = self.step_file(job, step, name)
        for d in (self.job_dir(job), path.parent):
            if os.path.lexists(d) and not real_dir_at(d):
                raise ForeignEntry(f"{d} is {lkind(d)}, not a directory the daemon made: it is not followed; remove it or move it away")
        return open_for_reading(path)


def committed_at(path: Path) -> bool:
    """Whether `path` is a real step directory holding a real index file."""
    return real_dir_at(path) and real_file_at(path / INDEX_NAME)


def is_job_dir(path: Path) -> bool:
    """The one rule of what a job directory is: a real directory (not a link), not hidden, not
    itself a step (no step directory name, no index), holding a `latest` or a step directory."""
    if path.name.startswith(".") or parse_step_dir_name(path.name) is not None or not real_dir_at(path):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return INDEX_NAME not in names and any(name == LATEST or parse_step_dir_name(name) is not None for name in names)


def is_storage_root(path: Path) -> bool:
    """Whether directory `path` is a storage root: it holds the root's id or a job directory."""
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    return ROOT_ID_FILE in entries or any(is_job_dir(path / name) for name in entries)
