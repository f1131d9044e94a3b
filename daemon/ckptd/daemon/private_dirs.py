"""Directories no other local user can change: the socket's, and the one the daemon's files in
shared memory (arenas, load staging files, replicas) live in.

Whoever can write a directory can replace what the daemon puts there: swap the socket for one of
their own (the trainers then hand their tensors to them), or plant a link or a file where the
daemon is about to write a tensor's bytes (a load's staging file) and read them from it. So the
daemon serves only from directories that are

- owned by its own user (or root, who can change anything anyway), and
- writable by no one else, unless the sticky bit is set (as on /tmp and /dev/shm: there only
  an entry's owner may rename or remove it, so what the daemon made stays its own).

The socket's directory is made (0750, whatever the umask) when missing, else checked;
`SocketDirUnsafe` says what is wrong and how to fix it. Shared memory: `files_dir` is
`--shm-dir` itself when it is private as above, else, when it is a shared sticky directory such
as /dev/shm (1777), the daemon's own subdirectory `ckptd-user-<uid>` in it (made 0750, checked
when it exists); anything else is refused (`ShmDirUnsafe`). Files are created in it with
`create_file` (storage.fs.new_file: O_CREAT | O_EXCL | O_NOFOLLOW), never through a link or into
a file already there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckptd.daemon.storage.fs import ForeignEntry, make_dir, make_dirs, new_file

SHM_SUBDIR_PREFIX = "ckptd-user-"
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class SocketDirUnsafe(RuntimeError):
    """The socket's directory could let another user replace the socket."""


class ShmDirUnsafe(RuntimeError):
    """The shared-memory directory could let another user plant or redirect the daemon's files."""


def dir_problem(path: Path) -> str | None:
    """None when directory `path` is one only the daemon's user (and root) can change; else what
    is wrong with it. A link to a directory counts as that directory, if the link is the
    daemon's user's or root's."""
    try:
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as exc:
        return f"cannot be checked: {exc.strerror or exc}"
    me = os.geteuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        return f"is a symbolic link of uid {link.st_uid}, who can point it elsewhere"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (me, 0):
        return f"is owned by uid {st.st_uid}, not by this daemon's uid {me} (nor root): that user can replace what the daemon puts there"
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        who = " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user")) if st.st_mode & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}) without the sticky bit: they can replace what the daemon puts there"
    return None


def prepare_socket_dir(path: Path) -> None:
    """Make the socket's directory when missing; SocketDirUnsafe, saying how to fix it, when it
    (existing or made meanwhile by someone else) is not one only this daemon's user can change."""
    make_dirs(path)
    problem = dir_problem(path)
    if problem is not None:
        raise SocketDirUnsafe(
            f"the socket directory {path} {problem}; another user could replace the socket. Use a directory of this "
            f"daemon's user (uid {os.geteuid()}) that no one else can write: `chmod go-w {path}` if it is yours, else remove it "
            f"(its owner or root) or choose another --socket (as a user, set $XDG_RUNTIME_DIR or use a directory made with `mkdir -m 0750`)"
        )


def files_dir(shm_dir: Path) -> Path:
    """Where the daemon creates its files in shared memory: `shm_dir` when only its user can
    change it, else its subdirectory SHM_SUBDIR_PREFIX<uid> when `shm_dir` is a shared sticky
    directory (/dev/shm). ShmDirUnsafe, saying what to do, otherwise."""
    problem = dir_problem(shm_dir)
    if problem is None and not os.stat(shm_dir).st_mode & _OTHERS_WRITE:
        return shm_dir
    if problem is not None:
        raise ShmDirUnsafe(
            f"the shared-memory directory {shm_dir} {problem}; choose a --shm-dir of this daemon's user that no one else can "
            "write (a tmpfs), or a shared one with the sticky bit such as /dev/shm"
        )
    own = shm_dir / f"{SHM_SUBDIR_PREFIX}{os.geteuid()}"
    try:
        make_dir(own, exist_ok=True)  # DIR_MODE (0750): the daemon's group, the trainers, may enter
    except ForeignEntry:
        pass  # a link or a file: refused below
    try:
        st = os.lstat(own)
    except OSError as exc:
        raise ShmDirUnsafe(f"cannot check {own}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & _OTHERS_WRITE:
        what = (
            "not a directory (a link or a file)" if not stat.S_ISDIR(st.st_mode)
            else f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid()
            else f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
        )
        raise ShmDirUnsafe(
            f"{own}, this daemon's directory in the shared {shm_dir}, is {what}: someone else made or changed it and could "
            f"redirect the daemon's shared-memory files. Remove it (its owner or root), or choose another --shm-dir"
        )
    return own


def create_file(path: Path, mode: int) -> int:
    """A new file at `path` open for reading and writing, with `mode` whatever the umask: never
    through a link nor into a file already there (storage.fs.new_file: FileExistsError)."""
    return new_file(path, mode, access=os.O_RDWR)
