"""POSIX files of a step: a data file being written (PosixPartWriter), one linked from an earlier
step (link_committed_file: incremental saves) and a step read by the operator tools
(PosixStepReader). The descriptor work the writer used to do itself."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Sequence

from ckptd.common.files import real_dir_at
from ckptd.format.index import is_plain_file_name
from ckptd.daemon.storage.fs import (
    ForeignEntry,
    create_file,
    link_own_file,
    lkind,
    open_for_reading,
    open_recycled,
    pwrite_all,
    pwritev_all,
    read_file,
    start_writeback,
    tmp_name,
    unlink_own,
)
from ckptd.daemon.storage.posix_tree import PosixTree


class PosixPartWriter:
    """A data file written under a temporary name in its step directory (mode 0640, never
    through a link), made from a recycled file when one is given and still the daemon's own
    (fs.open_recycled: its blocks are overwritten in place, no new allocation; any excess is cut
    off at open). `publish` renames it to its final name; the step directory's fsync
    (PosixWriting.sync_step) makes the name durable. See base.PartWriter."""

    def __init__(self, path: Path, size: int, recycled: Path | None) -> None:
        self.name = path.name
        self.path = path
        self.size = size
        fd = open_recycled(recycled, tmp_name(path)) if recycled is not None else None
        if fd is None:
            fd = create_file(tmp_name(path))
        elif os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
        self._fd: int | None = fd

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        return self._fd

    def pwrite(self, offset: int, view: memoryview) -> None:
        if offset < 0:
            raise ValueError(f"a write of {self.name} at offset {offset}")
        pwrite_all(self.fd, view, offset)

    def pwritev(self, offset: int, views: Sequence[memoryview]) -> None:
        if offset < 0:
            raise ValueError(f"a write of {self.name} at offset {offset}")
        pwritev_all(self.fd, views, offset)

    def start_writeback(self, offset: int, nbytes: int) -> bool:
        return start_writeback(self.fd, offset, nbytes)

    def sync(self, size: int | None = None) -> None:
        if size is not None:
            os.ftruncate(self.fd, size)
        os.fsync(self.fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def publish(self) -> None:
        if self._fd is not None:
            raise ValueError(f"{self.name} is still open: sync and close it before it is published")
        os.replace(tmp_name(self.path), self.path)


class PosixReadHandle:
    """A regular file of a step open for reading (fs.open_for_reading)."""

    def __init__(self, path: Path) -> None:
        self._fd = open_for_reading(path)
        self.size = os.fstat(self._fd).st_size

    def pread(self, nbytes: int, offset: int) -> bytes:
        return os.pread(self._fd, nbytes, offset)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> "PosixReadHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PosixStepReader:
    """A step directory read by the operator tools (base.StepReader): any directory, also one
    copied out of a root. A file name is a plain name; no file is read through a link or waited
    on as a FIFO, and neither the step directory nor the job directory holding it may be a link
    (ForeignEntry names it: the tools read a step where the daemon would, or not at all)."""

    def __init__(self, step_dir: Path) -> None:
        self.step_dir = step_dir
        self.where = str(step_dir)
        self._checked = False

    def _check_dirs(self) -> None:
        """ForeignEntry when the step directory or its job directory is a link or no directory."""
        if self._checked:
            return
        for where, what in ((self.step_dir.parent, "job"), (self.step_dir, "step")):
            if os.path.lexists(where) and not real_dir_at(where):
                raise ForeignEntry(
                    f"{where} is {lkind(where)}, not a {what} directory: no link under a storage root is followed; "
                    f"give the directory itself ({os.path.realpath(where)}), or move it back in place of the link"
                )
        self._checked = True

    def _path(self, name: str) -> Path:
        if not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not a file name of a step directory")
        self._check_dirs()
        return self.step_dir / name

    def names(self) -> list[str]:
        self._check_dirs()
        if not real_dir_at(self.step_dir):
            raise FileNotFoundError(errno.ENOENT, "no such step directory", str(self.step_dir))
        return sorted(p.name for p in self.step_dir.iterdir())

    def exists(self, name: str) -> bool:
        return os.path.lexists(self._path(name))

    def read_small(self, name: str, limit: int = 1 << 30) -> bytes:
        return read_file(self._path(name), limit)

    def open(self, name: str) -> PosixReadHandle:
        return PosixReadHandle(self._path(name))


def step_at(step_dir: Path) -> PosixStepReader:
    """The step in directory `step_dir` (a committed step of a root, or a copy of one)."""
    return PosixStepReader(step_dir)


def link_committed_file(tree: PosixTree, job: str, from_step: int, name: str, to_step: int, to_name: str, size: int) -> bool:
    """PosixWriting.link_file (see StepWriting.link_file): a hard link, made only while `from_step`
    is committed and `name` still names the linked file (re-checked by path after the link: a
    step being deleted is renamed away first, so its files are never linked on their way to the
    recycle bin, and the bin never reuses a file with a second link)."""
    for n in (name, to_name):
        if not n or "/" in n or n.startswith("."):
            raise ValueError(f"{n!r} is not a data file name of a step")
    src = tree.step_dir(job, from_step)
    if not tree.is_committed(job, from_step):
        return False
    st = link_own_file(src, name, tree.step_dir(job, to_step), to_name, size)
    if st is None:
        return False
    try:
        now = os.lstat(src / name)
        still = tree.is_committed(job, from_step) and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
    except FileNotFoundError:
        still = False
    if not still:
        unlink_own(tree.step_dir(job, to_step) / to_name)
    return still
