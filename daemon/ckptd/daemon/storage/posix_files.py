"""Reading the steps of a POSIX storage root (base.StepFiles): indexes, small files, ranges,
the kernel copy into shared-memory staging, and the paths ranks read directly. No file is
read through a link or waited on as a FIFO (PosixTree.open_step_file)."""

from __future__ import annotations

import errno
import os
import stat

from ckptd.common.files import real_dir_at
from ckptd.daemon.storage.fs import TMP_MARK, ForeignEntry, lkind, read_file
from ckptd.daemon.storage.posix_parts import PosixStepReader
from ckptd.daemon.storage.posix_tree import PosixTree
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FormatError


class PosixFiles:
    """The files of the root's steps, read (see base.StepFiles)."""

    def __init__(self, tree: PosixTree) -> None:
        self.tree = tree

    def read_index(self, job: str, step: int) -> CheckpointIndex:
        """The step's parsed index; never through a link, never blocking on a FIFO (ForeignEntry)."""
        job_dir = self.tree.job_dir(job)
        path = self.tree.step_dir(job, step) / INDEX_NAME
        if not real_dir_at(job_dir) or (os.path.lexists(path.parent) and not real_dir_at(path.parent)):
            where = path.parent if real_dir_at(job_dir) else job_dir
            raise ForeignEntry(f"{where} is {lkind(where)}, not a directory the daemon made: it is not followed; remove it or move it away")
        return CheckpointIndex.of_step(read_file(path), None, step, where=str(path))

    def read_small(self, job: str, step: int, name: str, limit: int = 1 << 30) -> bytes:
        """A whole file of a step (open_step_file: no link followed); OSError EFBIG over `limit`."""
        with open(self.tree.open_step_file(job, step, name), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{self.tree.step_dir(job, step) / name} is larger than the {limit} bytes expected of it")
        return data

    def read_range(self, job: str, step: int, name: str, offset: int, nbytes: int) -> bytes:
        if offset < 0 or nbytes < 0:
            raise ValueError(f"bytes [{offset}, +{nbytes}) of {name}")
        with open(self.tree.open_step_file(job, step, name), "rb", buffering=0) as f:
            data = os.pread(f.fileno(), nbytes, offset)
            while len(data) < nbytes:
                more = os.pread(f.fileno(), nbytes - len(data), offset + len(data))
                if not more:
                    path = self.tree.step_dir(job, step) / name
                    raise FormatError(f"{path} ends at byte {offset + len(data)}, before the {nbytes} bytes its index gives from {offset}")
                data += more
        return data

    def copy_range(self, job: str, step: int, name: str, out_fd: int, offset: int, nbytes: int) -> None:
        """Copy bytes [offset, offset + nbytes) of a step's file to the same offset of out_fd (a
        staging file in shared memory, for ranks that cannot read the root; an fd of its own:
        its file position is moved). The kernel copies (sendfile), the bytes never pass through
        this process. Raises FormatError when the file ends early."""
        source = self.tree.step_dir(job, step) / name
        with open(self.tree.open_step_file(job, step, name), "rb", buffering=0) as f:
            os.lseek(out_fd, offset, os.SEEK_SET)
            done = 0
            while done < nbytes:
                sent = os.sendfile(out_fd, f.fileno(), offset + done, nbytes - done)
                if not sent:
                    raise FormatError(f"{source} ends at byte {offset + done}, before the {nbytes} bytes its index gives from {offset}")
                done += sent

    def step_file_sizes(self, job: str, step: int) -> dict[str, int]:
        """The step's regular files (lstat: a link is none) but temporaries, with their sizes."""
        path = self.tree.step_dir(job, step)
        if not real_dir_at(path.parent) or not real_dir_at(path):
            return {}
        sizes = {}
        for entry in os.scandir(path):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and not entry.name.startswith(TMP_MARK):
                sizes[entry.name] = st.st_size
        return sizes

    def local_path(self, job: str, step: int, name: str) -> str | None:
        """The file's path: ranks read it directly."""
        return str(self.tree.step_file(job, step, name))

    def step_reader(self, job: str, step: int) -> PosixStepReader:
        return PosixStepReader(self.tree.step_dir(job, step))
