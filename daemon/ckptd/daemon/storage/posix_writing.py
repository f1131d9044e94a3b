"""Writing the steps of a POSIX storage root (base.StepWriting): step directories, data files
(posix_parts.PosixPartWriter, from the recycle bin when it holds one), hard links of unchanged
files, small files, `latest`, and the space left. The order that commits a step is
step_commit.StepCommit's."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ckptd.daemon.storage.base import FreeSpace, RecycledFile
from ckptd.daemon.storage.fs import (
    TMP_MARK,
    ForeignEntry,
    foreign_reason,
    fsync_dir,
    lkind,
    make_dir,
    make_dirs,
    open_dir,
    remove_own_tree,
    write_small_file,
    write_synced,
)
from ckptd.daemon.storage.posix_parts import PosixPartWriter, link_committed_file
from ckptd.common.files import real_dir_at
from ckptd.daemon.storage.posix_tree import PosixTree
from ckptd.format.index import INDEX_NAME, LATEST, step_dir_name

log = logging.getLogger(__name__)


class PosixWriting:
    """Steps of the root being written (see base.StepWriting)."""

    def __init__(self, tree: PosixTree) -> None:
        self.tree = tree

    def prepare_step(self, job: str, step: int, fresh: bool = True) -> None:
        """The directory for a new step. `fresh`: empty, leftovers of an earlier failed attempt
        removed; else (several nodes writing into one shared root) created if missing."""
        path = self.tree.step_dir(job, step)
        if os.path.lexists(path) and not real_dir_at(path):
            raise ForeignEntry(f"{path} is {lkind(path)}, not a step directory the daemon made: remove it or move it away")
        if os.path.lexists(path / INDEX_NAME):
            raise FileExistsError(f"{path} is already committed")
        if fresh and os.path.lexists(path):
            left = remove_own_tree(path)  # an earlier failed attempt's files; never what the daemon did not write
            if left:
                shown = ", ".join(f"{p} ({what})" for p, what in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
                raise ForeignEntry(f"{path} holds what the daemon did not write: {shown}; remove or move it away, then save again")
        self.ensure_step(job, step)
        fsync_dir(path.parent)

    def ensure_step(self, job: str, step: int) -> None:
        """The step's directory, created with DIR_MODE when missing (the job's too); ForeignEntry
        when either is a link or not a directory. The root's own mode is the operator's."""
        path = self.tree.step_dir(job, step)
        if not self.tree.root.is_dir():
            make_dirs(self.tree.root)
        make_dir(path.parent, exist_ok=True)
        make_dir(path, exist_ok=True)

    def take_recycled(self, job: str) -> list[RecycledFile]:
        """The recycle bin's files with their sizes, largest first (open_part takes them, checking
        each again). Only the daemon's own files count; anything else there stays, with a warning."""
        return [RecycledFile(str(path), size) for path, size in recycled_files(self.tree.recycle_dir(job), self.tree.root)]

    def open_part(self, job: str, step: int, name: str, size: int, recycled: RecycledFile | None = None) -> PosixPartWriter:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a data file name of a step")
        return PosixPartWriter(self.tree.step_dir(job, step) / name, size, Path(recycled.key) if recycled is not None else None)

    def link_file(self, job: str, from_step: int, name: str, to_step: int, to_name: str, size: int) -> bool:
        return link_committed_file(self.tree, job, from_step, name, to_step, to_name, size)

    def sync_step(self, job: str, step: int) -> None:
        fsync_dir(self.tree.step_dir(job, step))

    def write_small(self, job: str, step: int, name: str, data: bytes, atomic: bool = True) -> None:
        """fs.write_small_file (temporary, fsync, rename, directory fsync) when `atomic`; else
        created in place and fsynced (fs.write_synced)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a file name of a step")
        (write_small_file if atomic else write_synced)(self.tree.step_dir(job, step) / name, data)

    def write_latest(self, job: str, step: int) -> None:
        write_small_file(self.tree.job_dir(job) / LATEST, (step_dir_name(step) + "\n").encode())

    def free_bytes(self, job: str) -> FreeSpace | None:
        """The space free on the file system that holds the job's steps: measured at its
        directory, else the root (statvfs: f_bavail * f_frsize, the space an unprivileged writer
        can take; blocks reserved for root do not count). None when the file system reports no
        size at all (some network and FUSE file systems), so nothing can be checked."""
        where = self.tree.job_dir(job)
        if not where.is_dir():
            where = self.tree.root
        st = os.statvfs(where)
        if st.f_blocks == 0:
            return None
        return FreeSpace(st.f_bavail * st.f_frsize, str(where))

    def allocated_in_step(self, job: str, step: int) -> dict[str, int]:
        """Bytes allocated on disk (st_blocks) by each file already in a step directory, under
        its final name (a temporary name counts for its file); {} when there is none. Several
        nodes writing into one root: what the other nodes have written of the step so far."""
        path = self.tree.step_dir(job, step)
        found: dict[str, int] = {}
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return found
        for entry in entries:
            name = entry.name
            if name.startswith(TMP_MARK):
                name = name[len(TMP_MARK) :].rsplit(".", 1)[0]
            try:
                found[name] = found.get(name, 0) + entry.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                continue
        return found


def recycled_files(bin_dir: Path, root: Path) -> list[tuple[Path, int]]:
    """The recycle bin's files with their sizes, largest first (the caller takes them with
    open_recycled, which checks each again). Only the daemon's own files count (lstat, never
    stat: a regular file of its uid with one link, on the root's file system); anything else
    there (a link, a FIFO, a hard link, a file of another user) is left where it is, with a
    warning naming it, and so is a bin that is itself a link."""
    try:
        bin_fd = open_dir(bin_dir)
    except FileNotFoundError:
        return []
    except ForeignEntry as exc:
        log.warning("not recycling: %s", exc)
        return []
    files = []
    try:
        dev = os.stat(root).st_dev
        for name in os.listdir(bin_fd):
            try:
                st = os.stat(name, dir_fd=bin_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            why = foreign_reason(st, dev)
            if why is None:
                files.append((bin_dir / name, st.st_size))
            else:
                log.warning("leaving %s in the recycle bin alone: it is %s, which the daemon did not make", bin_dir / name, why)
    finally:
        os.close(bin_fd)
    return sorted(files, key=lambda f: -f[1])
