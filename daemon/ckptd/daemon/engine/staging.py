"""A load's staging files: copies of byte ranges of a step's data files in the daemon's own
shared-memory directory (private_dirs.files_dir), for ranks that cannot read the files
themselves (peers' files, replicas, a root they cannot see). One file per (job, step, data
file), shared by every local rank and filled range by range, removed once no load needs it.

A staging file is created once, by its first range, with O_EXCL | O_NOFOLLOW (never through a
link, never into a file someone planted at the name), and reopened for its other ranges only
if it is still that very file (device and inode). Anything else at the path fails the load
(Precondition) and nothing is written into it: the ranks read the file by its path. Each range
gets an open file of its own, not an os.dup of the first (which would share one file position:
Storage.copy_range seeks and sendfiles into it while other ranges are staged at once).

A range that a tier staged checked (a replica: every byte checked against the step's
checksums as it arrived, before it was written) is marked, and its pieces are handed to the
ranks as CHECKED_SOURCE, which they copy without hashing again (`checked_pieces`). A range is
unmarked before it is staged again and when its file is removed, so a mark never outlives the
bytes it vouches for; anything unmarked the rank checks. A file a prefetch staged whole and
checked (engine/loads.py) is marked whole: every range of it is checked.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path
from typing import Sequence

from ckptd.daemon.errors import Precondition
from ckptd.daemon.handoff.arena import ARENA_PREFIX
from ckptd.daemon.private_dirs import create_file
from ckptd.format.file_plan import CHECKED_SOURCE, FILE_SOURCE, PieceInfo

log = logging.getLogger(__name__)

STAGING_MODE = 0o640  # the daemon's group (the trainers) reads them


class StagingFiles:
    """The staging files of this daemon's loads in `shm_dir`. `open` is called from threads."""

    def __init__(self, shm_dir: Path) -> None:
        self.shm_dir = shm_dir
        self._made: dict[str, tuple[int, int]] = {}  # path -> (device, inode) of the files created here
        self._checked: dict[str, set[int]] = {}  # path -> offsets of the ranges staged checked there
        self._whole: set[str] = set()  # paths of the files staged whole, every byte checked
        self._detached = 0  # files detached so far (their new names)
        self._detached_files: dict[Path, tuple[int, int]] = {}  # detached, not yet unlinked: new name -> (device, inode)
        self._lock = threading.Lock()

    def path(self, job: str, step: int, file: str) -> Path:
        """Where the staging copy of `file` of a step goes (the name starts with the daemon's
        pid: remove_stale_arenas removes those of a daemon that died)."""
        return self.shm_dir / f"{ARENA_PREFIX}{os.getpid()}-fetch-{job}-{step}-{file}"

    def open(self, path: str) -> int:
        """(thread) The staging file at `path` open for writing one of its ranges; Precondition
        naming the path when something this daemon did not create is there."""
        with self._lock:
            made = self._made.get(path)
            if made is None:
                try:
                    fd = create_file(Path(path), STAGING_MODE)
                except (FileExistsError, IsADirectoryError) as exc:
                    raise Precondition(_planted(path, exc)) from None
                st = os.fstat(fd)
                self._made[path] = (st.st_dev, st.st_ino)
                return fd
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: ENXIO, not a wait
        except OSError as exc:
            raise Precondition(_planted(path, exc)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != made:
            os.close(fd)
            raise Precondition(_planted(path, None))
        os.set_blocking(fd, True)
        return fd

    def written_bytes(self) -> int:
        """Bytes this daemon's staging files take in their directory now (their allocated blocks)."""
        with self._lock:
            paths = list(self._made)
        total = 0
        for path in paths:
            try:
                total += os.stat(path, follow_symlinks=False).st_blocks * 512
            except OSError:
                continue  # removed meanwhile: it takes nothing
        return total

    def mark_checked(self, path: str, offset: int) -> None:
        """The range at `offset` of the staging file `path` was staged whole, each byte checked
        against the step's checksums before it was written (StagingTarget.checked)."""
        with self._lock:
            if path in self._made:
                self._checked.setdefault(path, set()).add(offset)

    def mark_whole(self, path: str) -> None:
        """The staging file `path` was staged whole, every byte checked as mark_checked says."""
        with self._lock:
            if path in self._made:
                self._whole.add(path)

    def unmark(self, path: str, offset: int) -> None:
        """The range at `offset` is about to be staged (again): not checked until a tier says
        so, nor is the file whole any more."""
        with self._lock:
            self._checked.get(path, set()).discard(offset)
            self._whole.discard(path)

    def checked_pieces(self, pieces: Sequence[PieceInfo]) -> tuple[PieceInfo, ...]:
        """`pieces` with each file piece whose staged range is marked checked as CHECKED_SOURCE
        (the rank copies it unchecked). A decoded piece keeps its kind (its scales and base are
        pieces of their own)."""
        with self._lock:
            checked = {path: set(offsets) for path, offsets in self._checked.items() if offsets}
            whole = set(self._whole)
        if not checked and not whole:
            return tuple(pieces)
        none: set[int] = set()
        return tuple(
            PieceInfo(p.name, CHECKED_SOURCE, *p[2:])  # a tuple made in C (_replace costs ~10x more, per piece of a load)
            if p.source == FILE_SOURCE and p.decode is None and (p.path in whole or p.offset in checked.get(p.path, none)) else p
            for p in pieces
        )

    def detach(self, path: Path) -> Path | None:
        """Take the staging file this daemon created at `path` out of use at once: renamed to a
        name of its own (still under this daemon's pid: remove_stale_arenas removes it after a
        crash), so a next load can create `path` again. Returns the new name for `free`,
        which may run off the event loop: unlinking frees the file's pages,
        ~14 ms per 128 MiB on the project's VM (timed by hand). None when nothing of this daemon's is at `path` (anything else
        there stays)."""
        with self._lock:
            made = self._made.pop(str(path), None)
            self._checked.pop(str(path), None)
            self._whole.discard(str(path))
            self._detached += 1
            name = self.shm_dir / f"{ARENA_PREFIX}{os.getpid()}-removed-{self._detached}"
        if made is None or not _is_file(path, made):
            return None
        try:
            os.rename(path, name)
        except OSError as exc:
            log.warning("could not remove the staging file %s: %s", path, exc.strerror or exc)
            return None
        with self._lock:
            self._detached_files[name] = made
        return name

    def free(self, detached: Path) -> None:
        """(thread) Unlink a file `detach` renamed, if it is still that file."""
        with self._lock:
            made = self._detached_files.pop(detached, None)
        if made is not None:
            _unlink_if(detached, made)

    def close(self) -> None:
        """Remove every staging file of this daemon (shutdown)."""
        with self._lock:
            made, self._made = self._made, {}
            detached, self._detached_files = self._detached_files, {}
            self._checked.clear()
            self._whole.clear()
        for path, identity in made.items():
            _unlink_if(Path(path), identity)
        for name, identity in detached.items():
            _unlink_if(name, identity)


def _is_file(path: Path, identity: tuple[int, int]) -> bool:
    """Whether `path` is (not through a link) the regular file of (device, inode) `identity`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == identity:
        return True
    log.warning("leaving %s alone: it is not the staging file this daemon created there", path)
    return False


def _unlink_if(path: Path, identity: tuple[int, int]) -> None:
    """Unlink `path` if it is still the regular file of (device, inode) `identity`."""
    if _is_file(path, identity):
        path.unlink(missing_ok=True)


def _planted(path: str, exc: OSError | None) -> str:
    why = exc.strerror if exc is not None and exc.strerror else "another file"
    log.error("a load's staging file %s is not the one this daemon created (%s); nothing was written into it", path, why)
    return (
        f"the staging file {path} in shared memory is not the one this daemon created ({why}); nothing was written into it. "
        "Remove it, check who can write the shared-memory directory (docs/operations.md: Local users), and load again"
    )
