"""One daemon per node of a storage root: a lock file per node rank, held while the daemon runs.

`<root>/.ckptd-node-<N>.lock` carries an open-file-description record lock (Linux `F_OFD_SETLK`,
a write lock over the whole file) for as long as the daemon that serves node N of the root
runs. The lock belongs to the daemon's open file: the kernel, or the file server for a network
file system, drops it when the process ends however it ends (SIGKILL and power loss of the
client included), so a restarted daemon takes it over with nothing to clean up and no guess
from a pid. Several nodes may share one root (a shared file system) under distinct node ranks:
each holds its own lock.

The holder writes its host, pid, socket and node into the file; that record is only read for
the message of a second daemon that is refused, never to decide anything.

What the lock relies on: POSIX record locks that the file system honours across every host
that mounts the root. Local file systems do; NFS does through its lock manager (NLM for v3, the
protocol itself for v4); Lustre only when mounted with `-o flock` (with `-o localflock` the
lock is seen on one host only); CephFS and GPFS do. A file system that refuses locks (ENOLCK,
ENOSYS, EOPNOTSUPP, EINVAL) gets a best-effort guard instead: the start is refused only when
the record names a live ckptd process on this host, and a WARNING says that two daemons on
different hosts serving the same node of the root are not detected there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from ckptd.daemon.storage.fs import make_dirs

log = logging.getLogger(__name__)

LOCK_PREFIX = ".ckptd-node-"
LOCK_SUFFIX = ".lock"
RECORD_LIMIT = 4096  # bytes of the owner record read back
# struct flock on Linux (64-bit off_t): l_type, l_whence, l_start, l_len, l_pid, padding
_FLOCK = struct.Struct("hhqqi4x")
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
_HELD = (errno.EAGAIN, errno.EACCES)
FILE_MODE = 0o640


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
            doc = json.loads(data.decode("utf-8", "replace") or "null")
            return cls(str(doc["host"]), int(doc["pid"]), str(doc["socket"]), int(doc["node"]), float(doc.get("since", 0.0)))
        except (ValueError, KeyError, TypeError):
            return None


def lock_path(root: Path, node: int) -> Path:
    return root / f"{LOCK_PREFIX}{node}{LOCK_SUFFIX}"


def _flock(kind: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0)


def _open_lock_file(path: Path) -> int:
    """The lock file open for reading and writing, made (FILE_MODE) when missing. A link, a
    FIFO, a directory, another user's file or one with other hard links is refused as it is:
    the record written into it must never land in a file the daemon does not own."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RootInUse(f"{path} is a symbolic link, not the daemon's lock file: remove it, then start the daemon again") from None
        raise RootInUse(f"cannot open the lock file {path}: {exc.strerror or exc}; the daemon needs to write its storage root") from None
    st = os.fstat(fd)
    problem = (
        "not a regular file" if not stat.S_ISREG(st.st_mode)
        else f"a file of uid {st.st_uid}, not the daemon's {os.geteuid()}" if st.st_uid != os.geteuid()
        else f"a file with {st.st_nlink} hard links" if st.st_nlink != 1
        else None
    )
    if problem is not None:
        os.close(fd)
        raise RootInUse(f"{path} is {problem}, not the daemon's lock file: remove it or move it away, then start the daemon again")
    os.set_blocking(fd, True)
    return fd


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


class RootLock:
    """This daemon's lock on node `node` of `root`: taken by `acquire`, held until `release`
    (or the process ends)."""

    def __init__(self, root: Path, node: int, fd: int, locked: bool) -> None:
        self.root = root
        self.node = node
        self._fd: int | None = fd
        self.locked = locked  # False: the file system refused locks (the best-effort guard)

    @classmethod
    def acquire(cls, root: Path, owner: LockOwner) -> "RootLock":
        """Take node `owner.node`'s lock of `root` (an existing directory) and record `owner`
        in it; RootInUse naming the daemon that holds it, and what to do, when another does."""
        path = lock_path(root, owner.node)
        fd = _open_lock_file(path)
        try:
            locked = True
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK))
            except OSError as exc:
                if exc.errno in _HELD:
                    raise RootInUse(_in_use_message(root, owner.node, _read_owner(fd))) from None
                if exc.errno not in _NO_LOCKS:
                    raise RootInUse(f"cannot lock {path}: {exc.strerror or exc}") from None
                locked = False
                previous = _read_owner(fd)
                if previous is not None and _is_live_ckptd(previous):
                    raise RootInUse(_in_use_message(root, owner.node, previous)) from None
                log.warning(
                    "the file system of %s does not support record locks (%s): this daemon cannot tell whether another daemon "
                    "on another host serves node %s of this root; make sure only one does (docs/operations.md: One daemon per node of a root)",
                    root, exc.strerror or exc, owner.node,
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, owner.to_json(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(root, owner.node, fd, locked)

    def others(self) -> list[str]:
        """The other nodes' daemons that hold their lock of this root now (a root shared by
        several nodes), described; [] on a root of one node or where locks do not work. The
        locks are tested (F_OFD_GETLK), never taken, so a daemon starting meanwhile is not
        refused because of this."""
        if not self.locked:
            return []
        found = []
        for entry in sorted(os.listdir(self.root)):
            number = entry[len(LOCK_PREFIX):-len(LOCK_SUFFIX)] if entry.startswith(LOCK_PREFIX) and entry.endswith(LOCK_SUFFIX) else ""
            if not number.isdigit() or int(number) == self.node:
                continue
            try:
                fd = os.open(self.root / entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # gone, a link, unreadable: not a daemon's lock file
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK))
                if _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK:
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
