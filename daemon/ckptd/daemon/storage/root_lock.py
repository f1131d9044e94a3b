"""One daemon per node of a storage root: a lock file per node rank, held while the daemon runs.

`<root>/.ckptd-node-<N>.lock` carries an exclusive `flock` for as long as the daemon that serves
node N of the root runs. The lock belongs to the daemon's open file: the kernel, or the file
server for a network file system, drops it when the process ends however it ends (SIGKILL and a
crash of the client included), so a restarted daemon takes it over with nothing to clean up and
no guess from a pid. Several nodes may share one root (a shared file system) under distinct node
ranks: each holds its own lock, and `RootLock.others` tells whether the others' daemons run.

The lock is held on a descriptor open for reading only, so the daemon keeps no file of the root
open for writing (an operator can still remount it read-only); where the file system needs a
writable descriptor for it (NFS emulates flock with POSIX locks), one is used. The holder writes
its host, pid, socket and node into the file; that record is only read for the message of a
second daemon that is refused, never to decide anything.

What the lock relies on: flock honoured by the file system across every host that mounts the
root. Local file systems do; NFS does, as POSIX locks, through its lock manager (NLM for v3, the
protocol itself for v4; a `nolock` mount keeps locks on one host); Lustre only when mounted with
`-o flock` (`-o localflock`: one host only); CephFS and GPFS do. A file system that refuses
locks (ENOLCK, ENOSYS, EOPNOTSUPP, EINVAL) gets a best-effort guard instead: the start is refused
only when the record names a live ckptd process on this host, and a WARNING says that two
daemons on different hosts serving the same node of the root are not detected there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ckptd.common import json_read
from ckptd.common.names import decimal
from ckptd.daemon.storage.fs import FILE_MODE, ForeignEntry, foreign_reason, make_dirs, new_file, open_for_reading

log = logging.getLogger(__name__)

LOCK_PREFIX = ".ckptd-node-"
LOCK_SUFFIX = ".lock"
RECORD_LIMIT = 4096  # bytes of the owner record read back
BUSY_RETRY_S = 1.0  # a lock found taken is tried again this long: another node's daemon may be testing it (others())
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # the root cannot be written
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # no link followed, no FIFO waited on


class RootInUse(RuntimeError):
    """Another daemon serves this node of the storage root (or the lock file cannot be used)."""


@dataclass(frozen=True)
class LockOwner:
    """Who holds a node's lock: what a refused daemon's message names."""

    host: str
    pid: int
    socket: str
    node: int
    since: float = 0.0  # Unix time the daemon took the lock

    @classmethod
    def this_process(cls, node: int, socket_path: str) -> "LockOwner":
        return cls(socket.gethostname(), os.getpid(), socket_path, node, time.time())

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since)) if self.since else "an unknown time"
        return f"pid {self.pid} on host {self.host}, socket {self.socket or '(unknown)'}, started {started}"

    def to_json(self) -> bytes:
        return (json.dumps({"host": self.host, "pid": self.pid, "socket": self.socket, "node": self.node, "since": self.since}) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> "LockOwner | None":
        try:
            doc = json_read.loads(data.decode("utf-8", "replace") or "null")
            return cls(str(doc["host"]), int(doc["pid"]), str(doc["socket"]), int(doc["node"]), float(doc.get("since", 0.0)))
        except (ValueError, KeyError, TypeError):
            return None


def lock_path(root: Path, node: int) -> Path:
    return root / f"{LOCK_PREFIX}{node}{LOCK_SUFFIX}"


def _open(path: Path, write: bool) -> int | None:
    """The lock file open for reading (or reading and writing), made (FILE_MODE) when missing;
    None when it is missing and the root cannot be written. A link, a FIFO, a directory,
    another user's file or one with other hard links is refused and left as it is: the record
    must never land in a file the daemon does not own."""
    try:
        fd = open_for_reading(path, write=write)
    except FileNotFoundError:
        try:
            os.close(new_file(path, FILE_MODE))
        except FileExistsError:  # made meanwhile by another daemon starting
            pass
        except OSError as exc:
            if exc.errno in _READ_ONLY:
                return None
            raise RootInUse(f"cannot create the lock file {path}: {exc.strerror or exc}") from None
        return _open(path, write)
    except ForeignEntry as exc:
        raise RootInUse(f"{exc}, then start the daemon again") from None
    except OSError as exc:
        raise RootInUse(f"cannot open the lock file {path}: {exc.strerror or exc}") from None
    problem = foreign_reason(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise RootInUse(f"{path} is {problem}, not the daemon's lock file: remove it or move it away, then start the daemon again")
    return fd


def _write_record(path: Path, fd: int, owner: LockOwner) -> None:
    """Record `owner` in the lock file (the same file as `fd`); skipped, with a note, where the
    root cannot be written."""
    try:
        out = os.open(path, os.O_WRONLY | _OPEN)
    except OSError as exc:
        log.info("the lock file %s keeps its old record: %s", path, exc.strerror or exc)
        return
    try:
        here, there = os.fstat(out), os.fstat(fd)
        if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
            os.ftruncate(out, 0)
            os.pwrite(out, owner.to_json(), 0)
            os.fsync(out)
    finally:
        os.close(out)


def _read_owner(fd: int) -> LockOwner | None:
    return LockOwner.from_json(os.pread(fd, RECORD_LIMIT, 0))


def _is_live_ckptd(owner: LockOwner) -> bool:
    """Whether `owner` names a ckptd process that runs on this host now (best effort)."""
    if owner.host != socket.gethostname() or owner.pid == os.getpid():
        return False
    try:
        return b"ckptd" in Path(f"/proc/{owner.pid}/cmdline").read_bytes()
    except OSError:
        return False


def _take(fd: int) -> None:
    """flock(LOCK_EX) on fd, tried for BUSY_RETRY_S; OSError as flock raises it."""
    deadline = time.monotonic() + BUSY_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


class RootLock:
    """This daemon's lock on node `node` of `root`: taken by `acquire`, held until `release`
    (or the process ends)."""

    def __init__(self, root: Path, node: int, fd: int | None, locked: bool) -> None:
        self.root = root
        self.node = node
        self._fd = fd
        self.locked = locked  # False: the file system refused locks, or the root is not writable

    @classmethod
    def acquire(cls, root: Path, owner: LockOwner) -> "RootLock":
        """Take node `owner.node`'s lock of `root` (an existing directory) and record `owner`
        in it; RootInUse naming the daemon that holds it, and what to do, when another does."""
        path = lock_path(root, owner.node)
        fd = _open(path, write=False)
        if fd is None:
            log.warning("cannot create the lock file %s (the root is not writable): serving without the node lock until "
                        "restarted; another daemon for this node of the root would not be refused meanwhile", path)
            return cls(root, owner.node, None, False)
        try:
            locked = True
            try:
                try:
                    _take(fd)
                except OSError as exc:
                    if exc.errno != errno.EBADF:
                        raise
                    writable = _open(path, write=True)  # NFS: flock is a POSIX lock there, which needs a writable descriptor
                    os.close(fd)
                    assert writable is not None
                    fd = writable
                    _take(fd)
            except BlockingIOError:
                raise RootInUse(_in_use_message(root, owner.node, _read_owner(fd))) from None
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise RootInUse(f"cannot lock {path}: {exc.strerror or exc}") from None
                locked = False
                previous = _read_owner(fd)
                if previous is not None and _is_live_ckptd(previous):
                    raise RootInUse(_in_use_message(root, owner.node, previous)) from None
                log.warning(
                    "the file system of %s does not support file locks (%s): this daemon cannot tell whether another daemon "
                    "on another host serves node %s of this root; make sure only one does (docs/operations.md: One daemon per node of a root)",
                    root, exc.strerror or exc, owner.node,
                )
            _write_record(path, fd, owner)
        except BaseException:
            os.close(fd)
            raise
        return cls(root, owner.node, fd, locked)

    def others(self) -> list[str]:
        """The other nodes' daemons that hold their lock of this root now (a root shared by
        several nodes), described; [] on a root of one node or where locks do not work. Each is
        tested with a shared lock taken and dropped at once (a daemon starting meanwhile retries
        for BUSY_RETRY_S, so it is not refused because of the test)."""
        if not self.locked:
            return []
        found = []
        for entry in sorted(os.listdir(self.root)):
            number = entry[len(LOCK_PREFIX):-len(LOCK_SUFFIX)] if entry.startswith(LOCK_PREFIX) and entry.endswith(LOCK_SUFFIX) else ""
            node = decimal(number)
            if node is None or str(node) != number or node == self.node:  # a lock file's name exactly as a daemon writes it
                continue
            try:
                fd = open_for_reading(self.root / entry)
            except OSError:
                continue  # gone, a link, a FIFO, unreadable: not a daemon's lock file
            try:
                if foreign_reason(os.fstat(fd)) is not None:
                    continue
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                owner = _read_owner(fd)
                found.append(f"node {number} ({owner.describe() if owner is not None else 'owner not recorded'})")
            except OSError as exc:
                log.info("cannot test the lock %s: %s", self.root / entry, exc)
            finally:
                os.close(fd)
        return found

    def release(self) -> None:
        """Drop the lock (idempotent). The file and its record stay: the next daemon overwrites them."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _in_use_message(root: Path, node: int, owner: LockOwner | None) -> str:
    who = owner.describe() if owner is not None else "a daemon that has not recorded itself yet"
    return (
        f"another ckptd serves node {node} of the storage root {root}: {who}. Nothing was changed. "
        f"Stop that daemon first (or use it: CKPTD_ADDRESS=unix://{owner.socket if owner is not None and owner.socket else 'ITS_SOCKET'}), "
        "or give this one another --root, or another --node-rank if several nodes share this root"
    )


class NodeClaim:
    """The node lock of one root that a Storage takes for its daemon (StorageBackend.claim)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock: RootLock | None = None

    def take(self, node: int, socket_path: str) -> None:
        """Take node `node`'s lock (the root is made, DIR_MODE, when missing); RootInUse naming
        the daemon that holds it. Taking it again is a no-op."""
        if self._lock is None:
            make_dirs(self.root)
            self._lock = RootLock.acquire(self.root, LockOwner.this_process(node, socket_path))

    def others(self) -> list[str]:
        """RootLock.others; [] before `take`."""
        return self._lock.others() if self._lock is not None else []

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
