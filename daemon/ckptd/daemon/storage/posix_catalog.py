"""The catalog of a POSIX storage root (base.StepCatalog): its jobs, their committed steps and
the order they were committed in, `latest`, the root's id."""

from __future__ import annotations

import errno
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ckptd.common import json_read
from ckptd.common.files import real_dir_at
from ckptd.daemon.storage.fs import FILE_MODE, TMP_MARK, fsync_dir, lkind, open_for_reading, read_file, tree_bytes
from ckptd.daemon.storage.posix_tree import ROOT_ID_FILE, PosixTree, committed_at
from ckptd.format.index import INDEX_HEAD_BYTES, INDEX_NAME, LATEST, CheckpointIndex, parse_step_dir_name

ROOT_ID_WAIT_S = 2.0  # how long an empty root id is read again (PosixCatalog.root_id)


@dataclass(frozen=True)
class UncommittedStep:
    """A step directory without an index (an interrupted or in-flight save), for `ckptd ls --all`."""

    step: int
    path: Path
    mtime: float
    nbytes: int
    files: int


class PosixCatalog:
    """Listing of a root (see base.StepCatalog); links are never taken for a job or a step."""

    def __init__(self, tree: PosixTree) -> None:
        self.tree = tree
        # (job, step) -> (the index file's (inode, size, mtime), its created_at): commit_order()
        # parses each index once, not at every commit
        self._commit_times: dict[tuple[str, int], tuple[tuple[int, int, int], float]] = {}

    def step_location(self, job: str, step: int) -> str:
        return str(self.tree.step_dir(job, step))

    def jobs(self) -> list[str]:
        root = self.tree.root
        if not root.is_dir():
            return []
        return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))

    def root_id(self) -> str:
        """The root's id (ROOT_ID_FILE, FILE_MODE, never followed as a link), made on first use:
        daemons that share the root read the same one. It is written whole under a temporary
        name and linked into place (link(2) refuses a name that exists), so a daemon starting at
        the same moment reads it complete: one that read it while another was still writing it
        in place got "" and took the shared root for a root of its own (the nodes then emptied
        each other's step directory). An empty file (an older daemon writing it now) is read
        again for up to ROOT_ID_WAIT_S."""
        path = self.tree.root / ROOT_ID_FILE
        if not os.path.lexists(path):
            _link_new_id(path)
        deadline = time.monotonic() + ROOT_ID_WAIT_S
        while True:
            found = read_file(path, 4096).decode("ascii", "replace").strip()
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not found:
            raise OSError(errno.EINVAL, f"{path} is empty: with no daemon running on this root, remove it and start again", str(path))
        return found

    def is_committed(self, job: str, step: int) -> bool:
        return self.tree.is_committed(job, step)

    def committed_steps(self, job: str) -> list[int]:
        """Steps whose directory holds ckptd.index.json, ascending (is_committed: links are
        not followed; a job directory that is a link has none)."""
        job_dir = self.tree.job_dir(job)
        if not real_dir_at(job_dir):
            return []
        steps = []
        for p in job_dir.iterdir():
            step = parse_step_dir_name(p.name)
            if step is not None and committed_at(p):
                steps.append(step)
        return sorted(steps)

    def commit_order(self, job: str) -> list[int]:
        """The committed steps in the order they were committed, oldest first: by the commit time
        (`created_at`) their index records, ties by step number. A job that rolled back commits a
        lower step after higher ones (docs/architecture.md §9): the last of this list is the newest step,
        whatever its number. The time is the committing node's clock, written once into the
        index, so every node holding the step orders it alike; an index that cannot be read
        counts at its file's modification time."""
        steps = self.committed_steps(job)
        times = {step: self._commit_time(job, step) for step in steps}
        for key in [k for k in list(self._commit_times) if k[0] == job and k[1] not in times]:
            self._commit_times.pop(key, None)  # deleted steps
        return sorted(steps, key=lambda step: (times[step], step))

    def _commit_time(self, job: str, step: int) -> float:
        path = self.tree.step_dir(job, step) / INDEX_NAME
        try:
            st = os.lstat(path)
        except OSError:
            return float("-inf")  # removed meanwhile: the oldest
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._commit_times.get((job, step))
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            created = _created_at(path)
        except (OSError, ValueError, KeyError, TypeError):
            created = float("nan")
        if not math.isfinite(created):
            created = st.st_mtime
        self._commit_times[(job, step)] = (stamp, created)
        return created

    def latest_step(self, job: str) -> int | None:
        """The newest committed step: the most recently committed (commit_order), not the highest
        number. `latest` is a hint for other tools; the index files decide."""
        order = self.commit_order(job)
        return order[-1] if order else None

    def not_followed(self, job: str, step: int | None = None) -> list[str]:
        job_dir = self.tree.job_dir(job)
        if not os.path.lexists(job_dir):
            return []
        fix = "ckptd follows no link under its root: move the directory itself back in place of the link"
        if not real_dir_at(job_dir):
            return [f"{job_dir} is {lkind(job_dir)}, not a job directory ({fix})"]
        found = []
        for p in sorted(job_dir.iterdir()) if step is None else [self.tree.step_dir(job, step)]:
            if parse_step_dir_name(p.name) is not None and os.path.lexists(p) and not real_dir_at(p):
                found.append(f"{p} is {lkind(p)}, not a step directory ({fix}, or remove it)")
        return found

    def newest_commit_time(self, job: str) -> float | None:
        order = self.commit_order(job)
        return self._commit_time(job, order[-1]) if order else None

    def latest_named(self, job: str) -> int | None:
        """The step the job's `latest` file names, or None (no file, or not a step name). Not
        followed when it is a link."""
        try:
            fd = open_for_reading(self.tree.job_dir(job) / LATEST)
        except OSError:
            return None
        try:
            return parse_step_dir_name(os.read(fd, 64).decode("ascii", "replace").strip())
        finally:
            os.close(fd)

    def step_bytes(self, job: str, step: int) -> int:
        return tree_bytes(self.tree.step_dir(job, step))

    def uncommitted_steps(self, job: str) -> list[UncommittedStep]:
        """Step directories of `job` without an index (links not followed), for `ckptd ls --all`."""
        job_dir = self.tree.job_dir(job)
        found = []
        for p in sorted(job_dir.iterdir()) if real_dir_at(job_dir) else []:
            step = parse_step_dir_name(p.name)
            if step is None or not real_dir_at(p) or self.is_committed(job, step):
                continue
            found.append(UncommittedStep(step, p, p.stat().st_mtime, tree_bytes(p), sum(1 for _ in p.iterdir())))
        return found


def _created_at(path: Path) -> float:
    """An index's `created_at`: from its head when this version wrote it, else the whole file."""
    fd = open_for_reading(path)
    try:
        head = os.read(fd, INDEX_HEAD_BYTES)
    finally:
        os.close(fd)
    created = CheckpointIndex.created_at_of(head)
    return created if created is not None else float(json_read.loads(read_file(path))["created_at"])


def _link_new_id(path: Path) -> None:
    """Put a new id at `path` unless something is there already (then leave it)."""
    temporary = path.with_name(f"{TMP_MARK}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        try:
            os.fchmod(fd, FILE_MODE)
            os.write(fd, (uuid.uuid4().hex + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, path, follow_symlinks=False)
        except FileExistsError:
            return  # another daemon's id is there: it is the root's
        fsync_dir(path.parent)
    finally:
        os.unlink(temporary)
