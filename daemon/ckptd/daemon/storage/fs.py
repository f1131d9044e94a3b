"""POSIX building blocks of the storage root: safe creation, reading and removal of the daemon's
own files and directories (never through a link, never another user's file: ForeignEntry),
atomic small files, the write-back hint, and tree sizes.

Only the storage package calls these (tests/test_hygiene.py checks it); the rest of the daemon
goes through Storage (posix.py), the POSIX StorageBackend.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
DELETING_PREFIX = ".deleting-"
RECYCLE_DIR = ".recycle"
FILE_MODE = 0o640  # every file the daemon writes under the root, whatever its umask
DIR_MODE = 0o750  # every directory it makes there


class ForeignEntry(OSError):
    """Something the daemon did not make sits where it creates, writes or removes: a symbolic
    link, a FIFO, a directory where a file belongs, a file of another user or with other hard
    links. It is never followed, opened, truncated, renamed or deleted: it stays as it is."""


def kind_of(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "a device"


def foreign_reason(st: os.stat_result, dev: int | None = None) -> str | None:
    """None when `st` (from lstat or fstat, never stat) is one of the daemon's own files: a regular
    file of its uid with one link (on device `dev` when given); else what it is instead."""
    if not stat.S_ISREG(st.st_mode):
        return kind_of(st)
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
        raise ForeignEntry(f"{path} is {lkind(path)}, not a directory the daemon made: remove it or move it away") from None


def lkind(path: Path | str, dir_fd: int | None = None) -> str:
    try:
        return kind_of(os.stat(path, dir_fd=dir_fd, follow_symlinks=False))
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
            raise ForeignEntry(f"{path} is {kind_of(st)}, not a directory the daemon made: remove it or move it away") from None
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) == DIR_MODE:
            return
    fd = open_dir(path)
    try:
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """Directory `path` and whatever of its parents is missing, each made with DIR_MODE whatever
    the umask (make_dir); directories that exist keep their owner and mode (a root the operator
    made is the operator's). ForeignEntry when `path` is something other than a directory."""
    missing = []
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):
        make_dir(p, exist_ok=True)
    if not missing and not os.path.isdir(path):
        raise ForeignEntry(f"{path} is {lkind(path)}, not a directory: give a directory as the storage root")


def new_file(path: Path | str, mode: int, dir_fd: int | None = None, access: int = os.O_WRONLY) -> int:
    """A new file at `path` (relative to `dir_fd` when given), open with `access` (os.O_WRONLY or
    os.O_RDWR), with `mode` whatever the umask: never through a link nor into anything already
    there (O_CREAT | O_EXCL | O_NOFOLLOW: FileExistsError, and what is there stays as it is)."""
    fd = os.open(path, access | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_file(path: Path | str, dir_fd: int | None = None) -> int:
    """A new empty file at `path` (relative to `dir_fd` when given) open for writing, mode
    FILE_MODE (new_file). One of the daemon's own files already there (foreign_reason: a
    temporary file of an attempt that failed) is replaced; anything else raises ForeignEntry and
    is left as it is."""
    try:
        return new_file(path, FILE_MODE, dir_fd)
    except FileExistsError:
        why = foreign_reason(os.stat(path, dir_fd=dir_fd, follow_symlinks=False))
        if why is not None:
            log.warning("leaving %s alone: it is %s, which the daemon did not make", path, why)
            raise ForeignEntry(f"{path} is {why}, which the daemon did not make: remove it or move it away") from None
        os.unlink(path, dir_fd=dir_fd)
        return new_file(path, FILE_MODE, dir_fd)


def open_for_reading(path: Path | str, dir_fd: int | None = None, write: bool = False) -> int:
    """A descriptor to read (with `write`, to read and write: O_RDWR) the regular file at
    `path` (relative to `dir_fd` when given) under the root. Never follows a link and never
    blocks on a FIFO (opened O_NONBLOCK, checked on the descriptor, then set blocking): a link, a FIFO, a directory, a socket or a device there
    raises ForeignEntry naming the path and saying what to do, and is left as it is. A file with
    other hard links is read (a backup made with `cp -al` is harmless; checksums check content).
    OSError (FileNotFoundError, PermissionError...) as os.open raises it otherwise."""
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ForeignEntry(f"{path} is a symbolic link, not a file the daemon wrote: it is not followed; remove it or move it away") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ForeignEntry(f"{path} is {kind_of(st)}, not a file the daemon wrote: it is not read; remove it or move it away")
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
        why = kind_of(st)
    elif st.st_uid != os.geteuid():
        why = f"a file of uid {st.st_uid}, not the daemon's {os.geteuid()}"
    else:
        return
    shown = name if shown is None else shown
    log.warning("leaving %s alone: it is %s, which the daemon did not make", shown, why)
    raise ForeignEntry(f"{shown} is {why}, which the daemon did not make: it is not replaced; remove it or move it away")


def own_entry(st: os.stat_result) -> bool:
    """Whether an entry (lstat) may be deleted by the daemon: a real directory, or a regular
    file of its uid (any number of hard links: unlinking one name leaves the others' bytes)."""
    if stat.S_ISDIR(st.st_mode):
        return True
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def foreign_entries(path: Path) -> list[tuple[Path, str]]:
    """(entry, what it is) for everything under directory `path` the daemon would not delete
    (own_entry: a link, a FIFO, a socket, a device, another user's file). Links are not
    followed; a `path` that is not a real directory is itself the one entry."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [] if own_entry(st) else [(path, describe(st))]
    return [(entry, describe(st)) for entry, st in _entries_under(path, topdown=True) if not own_entry(st)]


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


def describe(st: os.stat_result) -> str:
    if stat.S_ISREG(st.st_mode) and st.st_uid != os.geteuid():
        return f"a file of uid {st.st_uid}, not the daemon's {os.geteuid()}"
    return kind_of(st)


def remove_own_tree(path: Path) -> list[tuple[Path, str]]:
    """Delete `path` (a directory or a file) and what is under it, except what the daemon did
    not write (see foreign_entries): those entries stay, each logged as a warning, with the
    directories that hold them; returns them. Links are removed never, followed never."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        if own_entry(st):
            os.unlink(path)
            return []
        log.warning("leaving %s alone: it is %s, which the daemon did not make", path, describe(st))
        return [(path, describe(st))]
    left: list[tuple[Path, str]] = []
    for entry, st in _entries_under(path, topdown=False):
        if stat.S_ISDIR(st.st_mode):
            if not any(entry == p or p.is_relative_to(entry) for p, _ in left):
                os.rmdir(entry)
        elif own_entry(st):
            os.unlink(entry)
        else:
            log.warning("leaving %s alone: it is %s, which the daemon did not make", entry, describe(st))
            left.append((entry, describe(st)))
    if not left:
        os.rmdir(path)
    return left


def unlink_own(path: Path) -> None:
    """Unlink file `path` when it is the daemon's (a regular file of its uid); anything else there
    stays, with a warning. Nothing there is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        path.unlink(missing_ok=True)
    else:
        log.warning("leaving %s alone: it is %s, which the daemon did not make", path, describe(st))


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
                if st.st_nlink == 0:  # unlinked since it was opened (the daemon trims its bin): gone, as FileNotFoundError above
                    os.close(fd)
                    return None
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
                    raise ForeignEntry(f"{recycled} was replaced by {kind_of(moved)} while it was being recycled: {dest} is not the daemon's file")
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


def link_own_file(src_dir: Path, name: str, dest_dir: Path, dest_name: str, size: int) -> os.stat_result | None:
    """Give the daemon's own file `src_dir/name` (regular, its uid, `size` bytes, on dest's file
    system; any number of links) the second name `dest_dir/dest_name`: a hard link, never
    through a symbolic link. Returns the source's fstat (the caller checks the name still
    names it); None, with nothing left behind, when the source is gone or is not such a file,
    or the file system refuses hard links (EXDEV, EPERM, EMLINK, ENOTSUP). A file of ours
    already at the destination (a failed attempt's) is replaced."""
    try:
        src_fd = open_dir(src_dir)
    except (FileNotFoundError, ForeignEntry):
        return None
    try:
        dest_fd = open_dir(dest_dir)
        try:
            try:
                fd = open_for_reading(name, dir_fd=src_fd)
            except (FileNotFoundError, ForeignEntry):
                return None
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if not own_entry(st) or st.st_size != size or st.st_dev != os.fstat(dest_fd).st_dev:
                return None
            for attempt in (1, 2):
                try:
                    os.link(name, dest_name, src_dir_fd=src_fd, dst_dir_fd=dest_fd, follow_symlinks=False)
                    break
                except FileExistsError:
                    if attempt == 2 or not own_entry(os.stat(dest_name, dir_fd=dest_fd, follow_symlinks=False)):
                        raise ForeignEntry(f"{dest_dir / dest_name} exists and is not the daemon's: remove it or move it away") from None
                    os.unlink(dest_name, dir_fd=dest_fd)
                except FileNotFoundError:
                    return None
                except OSError as exc:
                    if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                        log.info("%s cannot be linked as %s (%s): it is written instead", src_dir / name, dest_dir / dest_name, exc.strerror)
                        return None
                    raise
            linked = os.stat(dest_name, dir_fd=dest_fd, follow_symlinks=False)
            if (linked.st_dev, linked.st_ino) != (st.st_dev, st.st_ino):  # the name was replaced between the check and the link
                os.unlink(dest_name, dir_fd=dest_fd)
                return None
            return st
        finally:
            os.close(dest_fd)
    finally:
        os.close(src_fd)


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
        # unique among concurrent writers of one file: two commits of a job write `latest` at once
        tmp = f"{tmp_name(path).name}-{threading.get_ident()}"
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


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of `view` at `offset` of `fd` (os.pwrite may write less than asked)."""
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Write all of `views`, back to back, from `offset` of `fd` (os.pwritev may write less than
    asked: what is left is written again)."""
    left, first = list(views), 0
    while first < len(left):
        n = os.pwritev(fd, left[first:], offset)
        offset += n
        while first < len(left) and n >= len(left[first]):
            n -= len(left[first])
            first += 1
        if n:
            left[first] = left[first][n:]


def write_synced(path: Path, data: bytes) -> None:
    """Write a small file of a (not yet committed) step directory in place and fsync it (mode
    0640, never through a link: create_file). Not atomic: only the index commits the step."""
    with os.fdopen(create_file(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
