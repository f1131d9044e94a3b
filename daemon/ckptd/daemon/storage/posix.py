"""The POSIX StorageBackend: a directory tree `<root>/<job>/step-XXXXXXXX/...` with
`<root>/<job>/latest` and `<root>/<job>/.recycle/`.

Every path is built here from a validated job id and an integer step, so no request can name a
path outside the root. Nothing is followed through a link or written over what the daemon did
not make (fs.ForeignEntry). Write order for a step (the writer drives it): data files under
temporary names → fsync → rename → directory fsync → small files → directory fsync →
ckptd.index.json atomically (temporary, fsync, rename, directory fsync) → `latest`.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Sequence

from ckptd.common.names import check_job_id
from ckptd.format.index import INDEX_HEAD_BYTES, INDEX_NAME, LATEST, PREPARED_NAME, CheckpointIndex, FormatError, parse_step_dir_name, step_dir_name
from ckptd.daemon.storage import posix_clean
from ckptd.daemon.storage.fs import (
    DELETING_PREFIX,
    FILE_MODE,
    RECYCLE_DIR,
    TMP_MARK,
    ForeignEntry,
    foreign_entries,
    fsync_dir,
    lkind,
    make_dir,
    make_dirs,
    open_for_reading,
    read_file,
    real_dir_at,
    real_file_at,
    remove_own_tree,
    tmp_name,
    tree_bytes,
    unlink_own,
    write_small_file,
    write_synced,
)
from ckptd.daemon.storage.posix_clean import UncommittedStep
from ckptd.daemon.storage.posix_parts import PosixPartWriter, PosixStepReader, link_committed_file
from ckptd.daemon.storage.root_lock import NodeClaim

log = logging.getLogger(__name__)

ROOT_ID_FILE = ".ckptd-root-id"


class Storage:
    """The root directory: `<root>/<job>/step-XXXXXXXX/...` and `<root>/<job>/latest`."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        # (job, step) -> (the index file's (inode, size, mtime), its created_at): commit_order()
        # parses each index once, not at every commit
        self._commit_times: dict[tuple[str, int], tuple[tuple[int, int, int], float]] = {}
        self._claim = NodeClaim(self.root)  # this daemon's node lock of the root (root_lock.py)

    def job_dir(self, job: str) -> Path:
        return self.root / check_job_id(job)

    @property
    def location(self) -> str:
        return str(self.root)

    def step_location(self, job: str, step: int) -> str:
        return str(self.step_dir(job, step))

    def step_dir(self, job: str, step: int) -> Path:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return self.job_dir(job) / step_dir_name(step)

    def jobs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))

    def is_committed(self, job: str, step: int) -> bool:
        """Whether the step's directory holds its index. The job directory, the step directory
        and the index must each be what they seem, not links (planted `step-N -> /elsewhere`
        is not a step of the job: never listed, loaded, or deleted through)."""
        return real_dir_at(self.job_dir(job)) and self._committed_at(self.step_dir(job, step))

    @staticmethod
    def _committed_at(path: Path) -> bool:
        return real_dir_at(path) and real_file_at(path / INDEX_NAME)

    def committed_steps(self, job: str) -> list[int]:
        """Steps whose directory holds ckptd.index.json, ascending (is_committed: links are
        not followed; a job directory that is a link has none)."""
        job_dir = self.job_dir(job)
        if not real_dir_at(job_dir):
            return []
        steps = []
        for p in job_dir.iterdir():
            step = parse_step_dir_name(p.name)
            if step is not None and self._committed_at(p):
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
        path = self.step_dir(job, step) / INDEX_NAME
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

    def latest_named(self, job: str) -> int | None:
        """The step the job's `latest` file names, or None (no file, or not a step name). Not
        followed when it is a link."""
        try:
            fd = open_for_reading(self.job_dir(job) / LATEST)
        except OSError:
            return None
        try:
            return parse_step_dir_name(os.read(fd, 64).decode("ascii", "replace").strip())
        finally:
            os.close(fd)

    def free_bytes(self, job: str) -> tuple[int, Path] | None:
        """(bytes free, where measured) on the file system that holds the job's steps: its
        directory, else the root (statvfs: f_bavail * f_frsize, the space an unprivileged writer
        can take; blocks reserved for root do not count). None when the file system reports no
        size at all (some network and FUSE file systems), so nothing can be checked."""
        where = self.job_dir(job)
        if not where.is_dir():
            where = self.root
        st = os.statvfs(where)
        if st.f_blocks == 0:
            return None
        return st.f_bavail * st.f_frsize, where

    def allocated_in_step(self, job: str, step: int) -> dict[str, int]:
        """Bytes allocated on disk (st_blocks) by each file already in a step directory, under
        its final name (a temporary name counts for its file); {} when there is none. Several
        nodes writing into one root: what the other nodes have written of the step so far."""
        path = self.step_dir(job, step)
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

    def copy_range(self, job: str, step: int, file: str, out_fd: int, offset: int, nbytes: int) -> None:
        """Copy bytes [offset, offset + nbytes) of a step's file to the same offset of out_fd (a
        staging file in shared memory, for ranks that cannot read the root; an fd of its own:
        its file position is moved). The kernel copies (sendfile), the bytes never pass through
        this process. Raises FormatError when the file ends early."""
        source = self.step_dir(job, step) / file
        with open(self.open_step_file(job, step, file), "rb", buffering=0) as f:
            os.lseek(out_fd, offset, os.SEEK_SET)
            done = 0
            while done < nbytes:
                sent = os.sendfile(out_fd, f.fileno(), offset + done, nbytes - done)
                if not sent:
                    raise FormatError(f"{source} ends at byte {offset + done}, before the {nbytes} bytes its index gives from {offset}")
                done += sent

    def read_index(self, job: str, step: int) -> CheckpointIndex:
        """The step's parsed index; never through a link, never blocking on a FIFO (ForeignEntry)."""
        path = self.step_dir(job, step) / INDEX_NAME
        if not real_dir_at(self.job_dir(job)) or (os.path.lexists(path.parent) and not real_dir_at(path.parent)):
            where = path.parent if real_dir_at(self.job_dir(job)) else self.job_dir(job)
            raise ForeignEntry(f"{where} is {lkind(where)}, not a directory the daemon made: it is not followed; remove it or move it away")
        return CheckpointIndex.from_json_bytes(read_file(path), where=str(path))

    def open_step_file(self, job: str, step: int, name: str) -> int:
        """A descriptor to read file `name` of a step (a plain name, no '/'), never through a
        link nor blocking on a FIFO (open_for_reading), nor inside a step or job directory that
        is a link (ForeignEntry naming it)."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a file name of a step directory")
        step_dir = self.step_dir(job, step)
        for d in (self.job_dir(job), step_dir):
            if os.path.lexists(d) and not real_dir_at(d):
                raise ForeignEntry(f"{d} is {lkind(d)}, not a directory the daemon made: it is not followed; remove it or move it away")
        return open_for_reading(step_dir / name)

    def write_latest(self, job: str, step: int) -> None:
        write_small_file(self.job_dir(job) / LATEST, (step_dir_name(step) + "\n").encode())

    def prepare_step_dir(self, job: str, step: int, fresh: bool = True) -> Path:
        """The directory for a new step. `fresh`: empty, leftovers of an earlier failed attempt
        removed; else (several nodes writing into one shared root) created if missing."""
        path = self.step_dir(job, step)
        if os.path.lexists(path) and not self._real_dir(path):
            raise ForeignEntry(f"{path} is {lkind(path)}, not a step directory the daemon made: remove it or move it away")
        if os.path.lexists(path / INDEX_NAME):
            raise FileExistsError(f"{path} is already committed")
        if fresh and os.path.lexists(path):
            left = remove_own_tree(path)  # an earlier failed attempt's files; never what the daemon did not write
            if left:
                shown = ", ".join(f"{p} ({what})" for p, what in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
                raise ForeignEntry(f"{path} holds what the daemon did not write: {shown}; remove or move it away, then save again")
        self.ensure_step_dir(job, step)
        fsync_dir(path.parent)
        return path

    def ensure_step_dir(self, job: str, step: int) -> Path:
        """The step's directory, created with DIR_MODE when missing (the job's too); ForeignEntry
        when either is a link or not a directory. The root's own mode is the operator's."""
        path = self.step_dir(job, step)
        if not self.root.is_dir():
            make_dirs(self.root)
        make_dir(path.parent, exist_ok=True)
        make_dir(path, exist_ok=True)
        return path

    @staticmethod
    def _real_dir(path: Path) -> bool:
        """Whether `path` is a directory itself (lstat: a link to one is not)."""
        try:
            return stat.S_ISDIR(os.lstat(path).st_mode)
        except FileNotFoundError:
            return False

    def remove_step(self, job: str, step: int, recycle: bool = False) -> None:
        """Delete a step: rename it away first (one atomic step), then remove the files.

        recycle: keep its data files in the job's recycle bin (replacing what was there), so the
        next save overwrites their blocks instead of allocating new ones (see take_recycled).

        Never deletes what the daemon did not write (foreign_entries: links, FIFOs, other users'
        files; a link is never followed). A committed step holding any of that is left whole and
        ForeignEntry names them (retention logs it and retries at its next pass); of an
        uncommitted step (a failed attempt) the daemon's own files go and the rest stays, logged.
        A step or job directory that is itself a link is left alone, with a warning.
        """
        path = self.step_dir(job, step)
        if not os.path.lexists(path):
            return
        if not real_dir_at(path.parent) or not self._real_dir(path):
            where = path if real_dir_at(path.parent) else path.parent
            log.warning("leaving %s alone: it is %s, not a directory the daemon made", where, lkind(where))
            return
        foreign = foreign_entries(path)
        if foreign and not os.path.lexists(path / INDEX_NAME):
            remove_own_tree(path)  # an attempt that failed: its own files go, the rest stays (logged)
            return
        if foreign:
            shown = ", ".join(f"{p} ({what})" for p, what in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ForeignEntry(f"step directory {path} is not deleted: it holds what the daemon did not write: {shown}; move that away and it is deleted at the next retention pass or `ckptd gc`")
        doomed = path.with_name(f"{DELETING_PREFIX}{path.name}")
        if os.path.lexists(doomed) and remove_own_tree(doomed):
            doomed = path.with_name(f"{DELETING_PREFIX}{path.name}.{os.getpid()}.{time.monotonic_ns()}")
        try:
            os.replace(path, doomed)
        except FileNotFoundError:  # removed meanwhile (the coordinator's abort and this node's own discard race)
            return
        fsync_dir(path.parent)
        if recycle:
            posix_clean.recycle_files(self.recycle_dir(job), doomed)
        remove_own_tree(doomed)

    def mark_prepared(self, job: str, step: int, save_id: str, node: int) -> None:
        """Record that this node's part of the step is written and fsynced (see PREPARED_NAME)."""
        doc = {"save_id": save_id, "node": node, "step": step}
        write_small_file(self.step_dir(job, step) / PREPARED_NAME, (json.dumps(doc) + "\n").encode())

    def unmark_prepared(self, job: str, step: int) -> None:
        """The step is committed on this node: its prepared marker and any temporary file of an
        earlier, interrupted write of the commit go (only the daemon's own files; a link is left)."""
        path = self.step_dir(job, step)
        if self._real_dir(path):
            posix_clean.tidy_committed(path)

    def prepared_steps(self) -> list[tuple[str, int]]:
        """(job, step) of step directories that hold a node's prepared part but no index."""
        return posix_clean.prepared_steps(self)

    def discard_part(self, job: str, step: int, names: Sequence[str], shared: bool) -> None:
        """Remove what this node wrote of an aborted step: the whole step directory of a
        node-local root; in a root shared with other nodes, only `names` and temporary files
        (the coordinator removes the rest), and the directory once it is empty."""
        if not shared:
            self.remove_step(job, step)
            return
        path = self.step_dir(job, step)
        if not self._real_dir(path) or os.path.lexists(path / INDEX_NAME):
            return  # committed after all (a newer attempt), or a link: nothing of it is ours to remove
        for name in names:
            unlink_own(path / name)
            unlink_own(tmp_name(path / name))
        try:
            path.rmdir()
        except OSError:
            pass  # not empty (other nodes' files, removed by the coordinator) or already gone

    def recycle_dir(self, job: str) -> Path:
        """Data files of deleted steps, kept to be overwritten by the next save.

        Overwriting allocated blocks in place is several times faster than writing new ones on
        thin-provisioned and cloud disks (here: 0.3 s against 3.3 s per GiB), and saves the
        file system's block allocation. Nothing in it is ever read.
        """
        return self.job_dir(job) / RECYCLE_DIR

    def take_recycled(self, job: str) -> list[tuple[Path, int]]:
        """The recycle bin's files with their sizes, largest first (open_part takes them, checking
        each again). Only the daemon's own files count; anything else there stays, with a warning."""
        return posix_clean.recycled_files(self.recycle_dir(job), self.root)

    def leftovers(self, job: str, busy: set[int], min_age_s: float = 0.0, dry_run: bool = False) -> list[tuple[Path, int, str, int]]:
        """Remove (unless `dry_run`) what a crash or a failed save left in a job's directory while
        the daemon runs (posix_clean.leftovers). Returns (path, step or -1, reason, bytes) of each."""
        return posix_clean.leftovers(self, job, busy, min_age_s, dry_run)

    def claim(self, node: int, socket: str) -> None:
        self._claim.take(node, socket)

    def release(self) -> None:
        self._claim.release()

    def clean_uncommitted(self, min_age_s: float = 0.0) -> list[Path]:
        """Start-up recovery: posix_clean.clean_uncommitted (`min_age_s`: on a root others serve)."""
        return posix_clean.clean_uncommitted(self, self._claim.others(), min_age_s)

    # ------------------------------------------------------------ the rest of StorageBackend

    def root_id(self) -> str:
        """The root's id (ROOT_ID_FILE), made on first use (O_EXCL | O_NOFOLLOW, FILE_MODE):
        daemons that share the root read the same one."""
        path = self.root / ROOT_ID_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
            os.fchmod(fd, FILE_MODE)
        except FileExistsError:
            return read_file(path, 4096).decode("ascii", "replace").strip()
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex + "\n")
            f.flush()
            os.fsync(f.fileno())
        return read_file(path, 4096).decode("ascii", "replace").strip()

    def read_small(self, job: str, step: int, name: str, limit: int = 1 << 30) -> bytes:
        """A whole file of a step (open_step_file: no link followed); OSError EFBIG over `limit`."""
        with open(self.open_step_file(job, step, name), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{self.step_dir(job, step) / name} is larger than the {limit} bytes expected of it")
        return data

    def read_range(self, job: str, step: int, name: str, offset: int, nbytes: int) -> bytes:
        if offset < 0 or nbytes < 0:
            raise ValueError(f"bytes [{offset}, +{nbytes}) of {name}")
        with open(self.open_step_file(job, step, name), "rb", buffering=0) as f:
            data = os.pread(f.fileno(), nbytes, offset)
            while len(data) < nbytes:
                more = os.pread(f.fileno(), nbytes - len(data), offset + len(data))
                if not more:
                    path = self.step_dir(job, step) / name
                    raise FormatError(f"{path} ends at byte {offset + len(data)}, before the {nbytes} bytes its index gives from {offset}")
                data += more
        return data

    def step_file_sizes(self, job: str, step: int) -> dict[str, int]:
        """The step's regular files (lstat: a link is none) but temporaries, with their sizes."""
        path = self.step_dir(job, step)
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

    def local_path(self, job: str, step: int, name: str) -> Path | None:
        """The file's path: ranks read it directly."""
        return self.step_dir(job, step) / name

    def step_reader(self, job: str, step: int) -> PosixStepReader:
        return PosixStepReader(self.step_dir(job, step))

    def step_bytes(self, job: str, step: int) -> int:
        return tree_bytes(self.step_dir(job, step))

    def prepare_step(self, job: str, step: int, fresh: bool = True) -> None:
        self.prepare_step_dir(job, step, fresh)

    def ensure_step(self, job: str, step: int) -> None:
        self.ensure_step_dir(job, step)

    def open_part(self, job: str, step: int, name: str, size: int, recycled: Path | None = None) -> PosixPartWriter:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a data file name of a step")
        return PosixPartWriter(self.step_dir(job, step) / name, size, recycled)

    def link_file(self, job: str, from_step: int, name: str, to_step: int, to_name: str, size: int) -> bool:
        return link_committed_file(self, job, from_step, name, to_step, to_name, size)

    def sync_step(self, job: str, step: int) -> None:
        fsync_dir(self.step_dir(job, step))

    def write_small(self, job: str, step: int, name: str, data: bytes, atomic: bool = True) -> None:
        """fs.write_small_file (temporary, fsync, rename, directory fsync) when `atomic`; else
        created in place and fsynced (fs.write_synced)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a file name of a step")
        (write_small_file if atomic else write_synced)(self.step_dir(job, step) / name, data)

    def uncommitted_steps(self, job: str) -> list[UncommittedStep]:
        """Step directories of `job` without an index (links not followed), for `ckptd ls --all`."""
        return posix_clean.uncommitted_steps(self, job)


def _created_at(path: Path) -> float:
    """An index's `created_at`: from its head when this version wrote it, else the whole file."""
    fd = open_for_reading(path)
    try:
        head = os.read(fd, INDEX_HEAD_BYTES)
    finally:
        os.close(fd)
    created = CheckpointIndex.created_at_of(head)
    return created if created is not None else float(json.loads(read_file(path))["created_at"])
