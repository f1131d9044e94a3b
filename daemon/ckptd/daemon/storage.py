"""The storage root on the file system: where jobs and steps live, atomic writes, listing, cleanup.

Every path is built here from a validated job id and an integer step, so no request can
name a path outside the root. Write order for a step (pipeline.py drives it): data files
under temporary names → fsync → rename → directory fsync → small JSON files the same way →
ckptd.index.json last → `latest`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import json
import math
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ckptd.common.names import check_job_id
from ckptd.daemon.config import human_size
from ckptd.daemon.format import INDEX_NAME, LATEST, PREPARED_NAME, CheckpointIndex, FormatError, parse_step_dir_name, step_dir_name

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
DELETING_PREFIX = ".deleting-"
RECYCLE_DIR = ".recycle"
FILE_MODE = 0o640  # every file the daemon writes under the root, whatever its umask
DIR_MODE = 0o750  # every directory it makes there

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class ForeignEntry(OSError):
    """Something the daemon did not make sits where it creates, writes or removes: a symbolic
    link, a FIFO, a directory where a file belongs, a file of another user or with other hard
    links. It is never followed, opened, truncated, renamed or deleted: it stays as it is."""


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "a device"


def foreign_reason(st: os.stat_result, dev: int | None = None) -> str | None:
    """None when `st` (from lstat or fstat, never stat) is one of the daemon's own files: a regular
    file of its uid with one link (on device `dev` when given); else what it is instead."""
    if not stat.S_ISREG(st.st_mode):
        return _kind(st)
    if st.st_uid != os.geteuid():
        return f"a file of uid {st.st_uid}, not the daemon's {os.geteuid()}"
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} hard links"
    if dev is not None and st.st_dev != dev:
        return "a file on another file system"
    return None


def open_dir(path: Path) -> int:
    """A descriptor of directory `path`, not followed when it is a link (ForeignEntry)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        raise ForeignEntry(f"{path} is {_lkind(path)}, not a directory the daemon made: remove it or move it away") from None


def _lkind(path: Path | str, dir_fd: int | None = None) -> str:
    try:
        return _kind(os.stat(path, dir_fd=dir_fd, follow_symlinks=False))
    except OSError:
        return "gone"


def make_dir(path: Path, exist_ok: bool = False) -> None:
    """Create directory `path` (its parent exists) with DIR_MODE, whatever the umask. With
    `exist_ok` an existing directory is fine (one of the daemon's uid gets DIR_MODE too: an
    older version made them under the umask); a link or anything else there raises ForeignEntry."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not exist_ok:
            raise
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise ForeignEntry(f"{path} is {_kind(st)}, not a directory the daemon made: remove it or move it away") from None
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) == DIR_MODE:
            return
    fd = open_dir(path)
    try:
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def create_file(path: Path | str, dir_fd: int | None = None) -> int:
    """A new empty file at `path` (relative to `dir_fd` when given) open for writing, mode
    FILE_MODE whatever the umask, never through a link (O_EXCL | O_NOFOLLOW). One of the daemon's
    own files already there (foreign_reason: a temporary file of an attempt that failed) is
    replaced; anything else raises ForeignEntry and is left as it is."""
    try:
        fd = os.open(path, _NEW_FILE, FILE_MODE, dir_fd=dir_fd)
    except FileExistsError:
        why = foreign_reason(os.stat(path, dir_fd=dir_fd, follow_symlinks=False))
        if why is not None:
            log.warning("leaving %s alone: it is %s, which the daemon did not make", path, why)
            raise ForeignEntry(f"{path} is {why}, which the daemon did not make: remove it or move it away") from None
        os.unlink(path, dir_fd=dir_fd)
        fd = os.open(path, _NEW_FILE, FILE_MODE, dir_fd=dir_fd)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_for_reading(path: Path | str, dir_fd: int | None = None) -> int:
    """A descriptor to read the regular file at `path` (relative to `dir_fd` when given) under
    the root. Never follows a link and never blocks on a FIFO (opened O_NONBLOCK, checked on the
    descriptor, then set blocking): a link, a FIFO, a directory, a socket or a device there
    raises ForeignEntry naming the path and saying what to do, and is left as it is. A file with
    other hard links is read (a backup made with `cp -al` is harmless; checksums check content).
    OSError (FileNotFoundError, PermissionError...) as os.open raises it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ForeignEntry(f"{path} is a symbolic link, not a file the daemon wrote: it is not followed; remove it or move it away") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ForeignEntry(f"{path} is {_kind(st)}, not a file the daemon wrote: it is not read; remove it or move it away")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd



def read_file(path: Path | str, limit: int = 1 << 30) -> bytes:
    """The bytes of the regular file `path` under the root, read without following a link or
    blocking on a FIFO (open_for_reading: ForeignEntry otherwise); at most `limit` bytes (a
    larger file raises OSError EFBIG naming it)."""
    with open(open_for_reading(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"{path} is larger than the {limit} bytes expected of it", str(path))
    return data


def check_replaceable(name: Path | str, dir_fd: int | None = None, shown: Path | str | None = None) -> None:
    """Raise ForeignEntry unless what is at `name` (relative to `dir_fd`) may be replaced by a
    rename: nothing, or a regular file of the daemon's uid (its other hard links, if any, keep
    their bytes: a rename only drops this name). A link, a FIFO, a directory or another user's
    file is never replaced: it stays, and the write that wanted its place fails. `shown`: the
    path named in the message (default `name`)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        why = _kind(st)
    elif st.st_uid != os.geteuid():
        why = f"a file of uid {st.st_uid}, not the daemon's {os.geteuid()}"
    else:
        return
    shown = name if shown is None else shown
    log.warning("leaving %s alone: it is %s, which the daemon did not make", shown, why)
    raise ForeignEntry(f"{shown} is {why}, which the daemon did not make: it is not replaced; remove it or move it away")


def _own_entry(st: os.stat_result) -> bool:
    """Whether an entry (lstat) may be deleted by the daemon: a real directory, or a regular
    file of its uid (any number of hard links: unlinking one name leaves the others' bytes)."""
    if stat.S_ISDIR(st.st_mode):
        return True
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def foreign_entries(path: Path) -> list[tuple[Path, str]]:
    """(entry, what it is) for everything under directory `path` the daemon would not delete
    (_own_entry: a link, a FIFO, a socket, a device, another user's file). Links are not
    followed; a `path` that is not a real directory is itself the one entry."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [] if _own_entry(st) else [(path, _describe(st))]
    return [(entry, _describe(st)) for entry, st in _entries_under(path, topdown=True) if not _own_entry(st)]


def _entries_under(path: Path, topdown: bool) -> Iterator[tuple[Path, os.stat_result]]:
    """(entry, lstat) of everything under directory `path`, links not followed; bottom-up (a
    directory after what it holds) unless `topdown`. Entries gone meanwhile are skipped."""
    for dirpath, dirnames, filenames in os.walk(path, topdown=topdown, followlinks=False):
        for name in dirnames + filenames:
            entry = Path(dirpath) / name
            try:
                yield entry, os.lstat(entry)
            except FileNotFoundError:
                continue


def _describe(st: os.stat_result) -> str:
    if stat.S_ISREG(st.st_mode) and st.st_uid != os.geteuid():
        return f"a file of uid {st.st_uid}, not the daemon's {os.geteuid()}"
    return _kind(st)


def remove_own_tree(path: Path) -> list[tuple[Path, str]]:
    """Delete `path` (a directory or a file) and what is under it, except what the daemon did
    not write (see foreign_entries): those entries stay, each logged as a warning, with the
    directories that hold them; returns them. Links are removed never, followed never."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        if _own_entry(st):
            os.unlink(path)
            return []
        log.warning("leaving %s alone: it is %s, which the daemon did not make", path, _describe(st))
        return [(path, _describe(st))]
    left: list[tuple[Path, str]] = []
    for entry, st in _entries_under(path, topdown=False):
        if stat.S_ISDIR(st.st_mode):
            if not any(entry == p or p.is_relative_to(entry) for p, _ in left):
                os.rmdir(entry)
        elif _own_entry(st):
            os.unlink(entry)
        else:
            log.warning("leaving %s alone: it is %s, which the daemon did not make", entry, _describe(st))
            left.append((entry, _describe(st)))
    if not left:
        os.rmdir(path)
    return left


def _unlink_own(path: Path) -> None:
    """Unlink file `path` when it is the daemon's (a regular file of its uid); anything else there
    stays, with a warning. Nothing there is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        path.unlink(missing_ok=True)
    else:
        log.warning("leaving %s alone: it is %s, which the daemon did not make", path, _describe(st))


def _tidy_committed(step_dir: Path) -> list[Path]:
    """Remove from a committed step directory what only an unfinished write leaves there: the
    daemon's temporary files and a node's prepared marker (a member that died between writing
    node 0's index and removing its marker). Only regular files of the daemon's uid; returns them."""
    removed = []
    for q in step_dir.iterdir():
        if q.name.startswith(TMP_MARK) or q.name == PREPARED_NAME:
            st = q.lstat()
            if stat.S_ISREG(st.st_mode) and _own_entry(st):
                q.unlink()
                removed.append(q)
    return removed


def _real_dir_at(path: Path) -> bool:
    """Whether `path` is a directory itself (lstat: a link to one is not)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _real_file_at(path: Path) -> bool:
    """Whether `path` is a regular file itself (lstat: a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def open_recycled(recycled: Path, dest: Path) -> int | None:
    """Take recycled file `recycled` (from Storage.take_recycled) as the new file `dest`: opened
    for writing in place (not truncated, never through a link, relative to its directory's
    descriptor), checked on the descriptor (foreign_reason, on dest's file system), renamed to
    `dest` and set to FILE_MODE. None when it is gone (another node sharing the root took it)
    or is not the daemon's own (then it stays where it is, with a warning)."""
    try:
        bin_fd = open_dir(recycled.parent)
    except FileNotFoundError:
        return None
    except ForeignEntry as exc:
        log.warning("not recycling %s: %s", recycled, exc)
        return None
    try:
        dest_fd = open_dir(dest.parent)
        try:
            dev = os.fstat(dest_fd).st_dev
            try:
                why = foreign_reason(os.stat(recycled.name, dir_fd=bin_fd, follow_symlinks=False), dev)
                if why is not None:
                    log.warning("leaving %s in the recycle bin alone: it is %s, which the daemon did not make", recycled, why)
                    return None
                # O_NONBLOCK: a FIFO put there meanwhile does not block the open; fstat tells
                fd = os.open(recycled.name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=bin_fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                log.warning("leaving %s in the recycle bin alone: %s", recycled, exc)
                return None
            try:
                st = os.fstat(fd)
                why = foreign_reason(st, dev)
                if why is not None:
                    log.warning("leaving %s in the recycle bin alone: it is %s, which the daemon did not make", recycled, why)
                    os.close(fd)
                    return None
                os.set_blocking(fd, True)
                try:
                    os.replace(recycled.name, dest.name, src_dir_fd=bin_fd, dst_dir_fd=dest_fd)
                except FileNotFoundError:  # another node sharing the root took it first
                    os.close(fd)
                    return None
                moved = os.stat(dest.name, dir_fd=dest_fd, follow_symlinks=False)
                if (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino):
                    raise ForeignEntry(f"{recycled} was replaced by {_kind(moved)} while it was being recycled: {dest} is not the daemon's file")
                os.fchmod(fd, FILE_MODE)
                return fd
            except BaseException:
                try:
                    os.close(fd)
                except OSError:
                    pass
                raise
        finally:
            os.close(dest_fd)
    finally:
        os.close(bin_fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing `nbytes` at `offset` of `fd` to disk now (Linux
    sync_file_range with SYNC_FILE_RANGE_WRITE), so the disk works while the rest of the file
    is still being written instead of only once fsync is called. Returns at once and guarantees
    nothing: durability still comes from the fsync that follows. A hint only: returns whether
    the kernel took it; where the call is missing (not Linux) it does nothing, and a refusal is
    logged at debug level."""
    call = _sync_file_range()
    if call is None:
        return False
    if call(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) != 0:
        log.debug("sync_file_range(%d, %d, %d) failed (%s): this file's writeback starts at its fsync", fd, offset, nbytes, os.strerror(ctypes.get_errno()))
        return False
    return True


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range, or None where libc has none."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "sync_file_range", None)
    if call is None:
        log.info("no sync_file_range on this system: data files are written back at their fsync")
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def tmp_name(final: Path) -> Path:
    return final.with_name(f"{TMP_MARK}{final.name}.{os.getpid()}")


def write_small_file(path: Path, data: bytes) -> None:
    """Write a small file atomically: temporary name, fsync, rename, directory fsync. Mode
    FILE_MODE; relative to its directory's descriptor, and neither that directory nor the
    temporary file is followed when it is a link (ForeignEntry). What it replaces must be one
    of the daemon's files (check_replaceable): a link, FIFO, directory or another user's file
    at `path` stays, and ForeignEntry names it."""
    dir_fd = open_dir(path.parent)
    try:
        tmp = tmp_name(path).name
        check_replaceable(path.name, dir_fd, path)
        fd = create_file(tmp, dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (a file or a directory; a link is not followed); 0 when it is gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def reused_bytes(sizes: Sequence[int], recycled: Sequence[int]) -> int:
    """Bytes of new files that overwrite recycled files in place instead of taking free space.

    sizes: the files to write, in the order the pipeline opens them; recycled: the recycle
    bin's file sizes, largest first. The pipeline gives the k-th file the k-th recycled one
    (pipeline._open_for_writing): it overwrites min(size, recycled size) bytes already
    allocated, and cuts off any excess only once written. Pure."""
    return sum(min(size, old) for size, old in zip(sizes, recycled))


def space_problem(write_bytes: int, reused: int, reserve: int, free: int, where: Path | str) -> str | None:
    """None when a step's files fit on the file system at `where`, else why not and what to do.

    write_bytes: the most bytes the step's files can take; reused: of those, bytes that
    overwrite recycled files (reused_bytes), which take no free space; reserve: bytes that must
    stay free (--disk-reserve); free: the file system's free bytes (Storage.free_bytes).
    The files fit when (write_bytes - reused) + reserve <= free. Pure."""
    data = max(0, write_bytes - reused)
    needed = data + reserve
    if needed <= free:
        return None
    recycled = f"; another {human_size(min(reused, write_bytes))} reuse recycled files" if reused else ""
    if data > free:
        fix = "free space there (delete old checkpoints, keep fewer with --keep-last) or use a larger storage root"
    else:
        fix = "free space or lower --disk-reserve"
    return (
        f"not enough disk space: needs {human_size(needed)} ({human_size(data)} of data + "
        f"{human_size(reserve)} reserve{recycled}), {human_size(free)} free on {where}: {fix}"
    )


@dataclass(frozen=True)
class Committed:
    """A committed step as found on disk."""

    step: int
    path: Path
    index: CheckpointIndex


class Storage:
    """The root directory: `<root>/<job>/step-XXXXXXXX/...` and `<root>/<job>/latest`."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        # (job, step) -> (the index file's (inode, size, mtime), its created_at): commit_order()
        # parses each index once, not at every commit
        self._commit_times: dict[tuple[str, int], tuple[tuple[int, int, int], float]] = {}

    def job_dir(self, job: str) -> Path:
        return self.root / check_job_id(job)

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
        return _real_dir_at(self.job_dir(job)) and self._committed_at(self.step_dir(job, step))

    @staticmethod
    def _committed_at(path: Path) -> bool:
        return _real_dir_at(path) and _real_file_at(path / INDEX_NAME)

    def committed_steps(self, job: str) -> list[int]:
        """Steps whose directory holds ckptd.index.json, ascending (is_committed: links are
        not followed; a job directory that is a link has none)."""
        job_dir = self.job_dir(job)
        if not _real_dir_at(job_dir):
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
            created = float(json.loads(read_file(path))["created_at"])
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
        if not _real_dir_at(self.job_dir(job)) or (os.path.lexists(path.parent) and not _real_dir_at(path.parent)):
            where = path.parent if _real_dir_at(self.job_dir(job)) else self.job_dir(job)
            raise ForeignEntry(f"{where} is {_lkind(where)}, not a directory the daemon made: it is not followed; remove it or move it away")
        return CheckpointIndex.from_json_bytes(read_file(path), where=str(path))

    def open_step_file(self, job: str, step: int, name: str) -> int:
        """A descriptor to read file `name` of a step (a plain name, no '/'), never through a
        link nor blocking on a FIFO (open_for_reading), nor inside a step or job directory that
        is a link (ForeignEntry naming it)."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a file name of a step directory")
        step_dir = self.step_dir(job, step)
        for d in (self.job_dir(job), step_dir):
            if os.path.lexists(d) and not _real_dir_at(d):
                raise ForeignEntry(f"{d} is {_lkind(d)}, not a directory the daemon made: it is not followed; remove it or move it away")
        return open_for_reading(step_dir / name)

    def write_latest(self, job: str, step: int) -> None:
        write_small_file(self.job_dir(job) / LATEST, (step_dir_name(step) + "\n").encode())

    def prepare_step_dir(self, job: str, step: int, fresh: bool = True) -> Path:
        """The directory for a new step. `fresh`: empty, leftovers of an earlier failed attempt
        removed; else (several nodes writing into one shared root) created if missing."""
        path = self.step_dir(job, step)
        if os.path.lexists(path) and not self._real_dir(path):
            raise ForeignEntry(f"{path} is {_lkind(path)}, not a step directory the daemon made: remove it or move it away")
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
            self.root.mkdir(parents=True, exist_ok=True)
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
        if not _real_dir_at(path.parent) or not self._real_dir(path):
            where = path if _real_dir_at(path.parent) else path.parent
            log.warning("leaving %s alone: it is %s, not a directory the daemon made", where, _lkind(where))
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
        os.replace(path, doomed)
        fsync_dir(path.parent)
        if recycle:
            self._recycle(job, doomed)
        remove_own_tree(doomed)

    def _recycle(self, job: str, doomed: Path) -> None:
        """Move the data files of `doomed` (a step directory renamed away) into the job's recycle
        bin, in place of the daemon's own files there. Whatever else is in the bin (foreign_reason)
        stays, with a warning; a bin that is not a directory is not used."""
        bin_dir = self.recycle_dir(job)
        try:
            make_dir(bin_dir, exist_ok=True)
            bin_fd = open_dir(bin_dir)
        except ForeignEntry as exc:
            log.warning("not recycling the files of %s: %s", doomed, exc)
            return
        try:
            dev = os.fstat(bin_fd).st_dev
            taken = set()
            for name in os.listdir(bin_fd):
                try:
                    why = foreign_reason(os.stat(name, dir_fd=bin_fd, follow_symlinks=False), dev)
                    if why is None:
                        os.unlink(name, dir_fd=bin_fd)
                        continue
                except FileNotFoundError:
                    continue
                log.warning("leaving %s in the recycle bin alone: it is %s, which the daemon did not make", bin_dir / name, why)
                taken.add(name)
            free = (name for name in (f"{i:05d}" for i in range(1 << 30)) if name not in taken)
            for f in sorted(doomed.glob("*.safetensors")):
                if foreign_reason(os.lstat(f), dev) is None:
                    os.replace(f, next(free), dst_dir_fd=bin_fd)
        finally:
            os.close(bin_fd)

    def mark_prepared(self, job: str, step: int, save_id: str, node: int) -> None:
        """Record that this node's part of the step is written and fsynced (see PREPARED_NAME)."""
        doc = {"save_id": save_id, "node": node, "step": step}
        write_small_file(self.step_dir(job, step) / PREPARED_NAME, (json.dumps(doc) + "\n").encode())

    def unmark_prepared(self, job: str, step: int) -> None:
        """The step is committed on this node: its prepared marker and any temporary file of an
        earlier, interrupted write of the commit go (only the daemon's own files; a link is left)."""
        path = self.step_dir(job, step)
        if self._real_dir(path):
            _tidy_committed(path)

    def prepared_steps(self) -> list[tuple[str, int]]:
        """(job, step) of step directories that hold a node's prepared part but no index."""
        found = []
        for job in self.jobs():
            for p in self.job_dir(job).iterdir():
                step = parse_step_dir_name(p.name)
                if step is not None and _real_dir_at(p) and _real_file_at(p / PREPARED_NAME) and not os.path.lexists(p / INDEX_NAME):
                    found.append((job, step))
        return sorted(found)

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
            _unlink_own(path / name)
            _unlink_own(tmp_name(path / name))
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
        """The recycle bin's files with their sizes, largest first (the caller takes them with
        open_recycled, which checks each again). Only the daemon's own files count (lstat, never
        stat: a regular file of its uid with one link, on the root's file system); anything else
        there (a link, a FIFO, a hard link, a file of another user) is left where it is, with a
        warning naming it, and so is a bin that is itself a link."""
        bin_dir = self.recycle_dir(job)
        try:
            bin_fd = open_dir(bin_dir)
        except FileNotFoundError:
            return []
        except ForeignEntry as exc:
            log.warning("not recycling: %s", exc)
            return []
        files = []
        try:
            dev = os.stat(self.root).st_dev
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

    def leftovers(self, job: str, busy: set[int], min_age_s: float = 0.0, dry_run: bool = False) -> list[tuple[Path, int, str, int]]:
        """Remove (unless `dry_run`) what a crash or a failed save left in a job's directory while
        the daemon runs: step directories without an index (not in `busy`, the steps being saved,
        nor a node's prepared part), temporary files and half-deleted steps, unchanged for at
        least `min_age_s` seconds. Returns (path, step or -1, reason, bytes) of each."""
        job_dir = self.job_dir(job)
        if not _real_dir_at(job_dir):
            if os.path.lexists(job_dir):
                log.warning("gc leaves %s alone: it is %s, not a job directory the daemon made", job_dir, _lkind(job_dir))
            return []
        found = []
        now = time.time()
        for p in sorted(job_dir.iterdir()):
            step = parse_step_dir_name(p.name)
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                log.warning("gc leaves %s alone: a symbolic link, which the daemon did not make", p)
                continue
            age = now - st.st_mtime
            if age < min_age_s:
                continue
            if p.name.startswith(DELETING_PREFIX) or p.name.startswith(TMP_MARK):
                found.append((p, -1, "temporary"))
            elif step is not None and stat.S_ISDIR(st.st_mode):
                if _real_file_at(p / INDEX_NAME):
                    found += [(q, step, "temporary") for q in sorted(p.iterdir()) if q.name.startswith(TMP_MARK) and _own_entry(q.lstat())]
                elif step not in busy and not os.path.lexists(p / PREPARED_NAME) and not os.path.lexists(p / INDEX_NAME):
                    found.append((p, step, "uncommitted"))
        out = []
        for path, step, reason in found:
            size = tree_bytes(path)
            if not dry_run:
                left = remove_own_tree(path)
                if left:
                    log.warning("gc left %s in place: it holds %d entries the daemon did not write (logged above)", path, len(left))
                    continue
                log.info("gc removed %s leftover %s", reason, path)
            elif foreign_entries(path):
                continue
            out.append((path, step, reason, size))
        return out

    def clean_uncommitted(self) -> list[Path]:
        """Remove what a crash left: step directories without an index, temporary files and
        half-deleted steps (only what the daemon wrote: remove_own_tree). Then rewrite each
        job's `latest` from the committed steps where it does not name the newest. What cannot
        be changed (a read-only root, a foreign `latest`) is logged, not raised: the daemon
        starts and serves loads; saves fail naming the cause."""
        removed = []
        for job in self.jobs():
            job_dir = self.job_dir(job)
            for p in job_dir.iterdir():
                if p.is_symlink():  # not followed, not removed
                    if p.name != LATEST:
                        log.warning("leaving %s alone: a symbolic link, which the daemon did not make", p)
                    continue
                stale = p.name.startswith(DELETING_PREFIX) or p.name.startswith(TMP_MARK)
                step = parse_step_dir_name(p.name)
                is_dir = _real_dir_at(p)
                if step is not None and is_dir and not os.path.lexists(p / INDEX_NAME):
                    stale = not os.path.lexists(p / PREPARED_NAME)  # prepared: resolved with the coordinator
                try:
                    if step is not None and is_dir and _real_file_at(p / INDEX_NAME):
                        removed += _tidy_committed(p)
                    if stale and not remove_own_tree(p):
                        removed.append(p)
                except OSError as exc:  # a read-only root: the daemon still starts and serves loads
                    log.error("cannot remove the leftover %s: %s", p, exc)
            latest = self.latest_step(job)
            try:
                if latest is not None and self.latest_named(job) != latest:
                    self.write_latest(job, latest)
                elif latest is None and os.path.lexists(job_dir / LATEST):
                    _unlink_own(job_dir / LATEST)
            except OSError as exc:  # ForeignEntry, or a read-only root: saves will fail, naming it; loads work
                log.error("cannot update the `latest` of job %s: %s", job, exc)
        for p in removed:
            log.info("removed uncommitted leftover %s", p)
        return removed
