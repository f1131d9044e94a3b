"""Looking at and reading files without following a link or waiting on a FIFO: the rule every
reader of a storage root keeps, the daemon's storage package and the offline
reader (ckptd.offline) alike. lstat-based checks, and opens with O_NOFOLLOW | O_NONBLOCK.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def real_dir_at(path: Path) -> bool:
    """Whether `path` is a directory itself (lstat: a link to one is not)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def real_file_at(path: Path) -> bool:
    """Whether `path` is a regular file itself (lstat: a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_regular(path: Path, limit: int) -> bytes:
    """Up to `limit` bytes of the regular file at `path`, never through a link (OSError ELOOP
    naming it) nor waiting on a FIFO (OSError EINVAL for anything but a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link, which is never followed", str(path)) from None
        raise
    with open(fd, "rb", closefd=True) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file", str(path))
        os.set_blocking(fd, True)
        return f.read(limit)
