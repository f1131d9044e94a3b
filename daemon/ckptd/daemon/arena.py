"""Shared-memory arenas: daemon-owned files in a tmpfs that trainer ranks map and copy into.

The daemon creates, sizes, pre-faults and deletes arenas; a trainer only maps them. So an
arena survives a trainer crash, never leaks when the trainer dies, and its pages are charged
to the daemon. Space is reserved with posix_fallocate: on a full tmpfs `ftruncate` succeeds
and the first write later dies with SIGBUS; fallocate fails up front with ENOSPC instead.

An `ArenaSet` is one snapshot's worth of arenas: one per rank of a job. A job has at most
`max_inflight` sets; a set is reused from save to save (a reused tmpfs page costs a fraction
of a fresh one), and grows only when the plan needs more.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ckptd.common.sizes import human_bytes
from ckptd.daemon.errors import Exhausted
from ckptd.daemon.private_dirs import create_file

log = logging.getLogger(__name__)

ARENA_PREFIX = "ckptd-"
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not in Python's mmap module before 3.13


class Arena:
    """One shared-memory file of `size` bytes, mapped read-write by the daemon."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.path_text = str(path)  # what load plans and replies carry (made once: loads name it per tensor)
        self.size = size
        self.on_close: list[Callable[[], None]] = []  # run before unmapping (e.g. unlock pinned pages)
        fd = create_file(path, 0o660)  # never through a link nor into a file planted there (private_dirs.py)
        try:
            try:
                os.posix_fallocate(fd, 0, max(size, 1))
            except OSError as exc:
                os.unlink(path)
                raise Exhausted(
                    f"cannot reserve {human_bytes(size)} of shared memory in {path.parent}: {exc.strerror}. "
                    "Make the shared-memory directory larger (docker run --shm-size, a Kubernetes emptyDir "
                    "with medium: Memory and a sizeLimit) or save less per rank"
                ) from None
            self._mmap = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._prefault()

    def _prefault(self) -> None:
        """Touch every page once, so the trainer's first copy finds them allocated and mapped."""
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE)
            return
        except OSError:
            pass  # kernel older than 5.14: touch the pages by hand below
        view = memoryview(self._mmap)
        for offset in range(0, self.size, mmap.PAGESIZE):
            view[offset] = 0
        view.release()

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A zero-copy view of `nbytes` bytes at `offset`."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range {offset}+{nbytes} outside arena {self.path} of {self.size} bytes")
        return memoryview(self._mmap)[offset : offset + nbytes]

    def address(self) -> int:
        """The address of the daemon's mapping (for CUDA copies into it)."""
        window = (ctypes.c_char * max(self.size, 1)).from_buffer(self._mmap)
        try:
            return ctypes.addressof(window)
        finally:
            del window  # releases the buffer export, so close() can unmap

    def close(self) -> None:
        """Unmap and delete the file. Views still held elsewhere keep the mapping alive until released."""
        for callback in self.on_close:
            try:
                callback()
            except Exception:
                log.exception("cleanup before unmapping arena %s failed", self.path)
        self.on_close = []
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still exported (e.g. a read in progress); the mapping dies with it
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SetState(enum.Enum):
    FREE = "free"  # nothing of value inside
    FILLING = "filling"  # ranks are copying a snapshot in
    PERSISTING = "persisting"  # a complete snapshot is being written to disk
    HELD = "held"  # a committed snapshot kept in memory for fast restore (tier 0)


@dataclass
class ArenaSet:
    """One snapshot's arenas, one per rank (None where the rank copies nothing)."""

    index: int
    arenas: list[Arena | None] = field(default_factory=list)
    state: SetState = SetState.FREE
    step: int | None = None
    readers: int = 0  # loads currently reading this snapshot
    plan: Any = None  # the SavePlan of the snapshot inside (where each fragment is)
    extras: dict[int, Any] | None = None  # the ranks' extras of that snapshot

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.arenas if a is not None)

    def fits(self, sizes: tuple[int, ...]) -> bool:
        if len(sizes) != len(self.arenas):
            return False
        return all(need == 0 or (a is not None and a.size >= need) for a, need in zip(self.arenas, sizes))

    def close(self) -> None:
        for arena in self.arenas:
            if arena is not None:
                arena.close()
        self.arenas = []


def remove_stale_arenas(shm_dir: Path, live_pid: int) -> list[Path]:
    """Delete arena files left by daemons that no longer run (their pid is part of the name)."""
    removed = []
    for path in shm_dir.glob(f"{ARENA_PREFIX}*"):
        pid_text = path.name[len(ARENA_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == live_pid:
            continue
        if pid_alive(int(pid_text)) and _is_ckptd(int(pid_text)):
            continue
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_ckptd(pid: int) -> bool:
    try:
        return b"ckptd" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class ArenaPool:
    """The arena sets of one job: at most `max_inflight`, created on demand and reused."""

    def __init__(self, shm_dir: Path, job: str, max_inflight: int) -> None:
        self.shm_dir = shm_dir
        self.job = job
        self.max_inflight = max_inflight
        self.sets: list[ArenaSet] = []
        self._generation = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sets)

    @property
    def count(self) -> int:
        return sum(1 for s in self.sets for a in s.arenas if a is not None)

    def acquire(self, sizes: tuple[int, ...]) -> ArenaSet | None:
        """A set with room for `sizes` (bytes per rank), marked FILLING; None if all are busy.

        Preference: a free set; then a new set (up to `max_inflight`); then a held snapshot
        that no load is reading, oldest first (its data is on disk already). A set that is
        reused but too small is reallocated.
        """
        free = [s for s in self.sets if s.state is SetState.FREE]
        fitting = [s for s in free if s.fits(sizes)]
        if fitting or not free and len(self.sets) < self.max_inflight:
            candidates = fitting
        else:
            candidates = free + sorted(
                (s for s in self.sets if s.state is SetState.HELD and s.readers == 0), key=lambda s: s.step or 0
            )
        fitting = [s for s in candidates if s.fits(sizes)]
        if fitting:
            chosen = fitting[0]
        elif candidates:
            chosen = candidates[0]
            self._allocate(chosen, sizes)
        elif len(self.sets) < self.max_inflight:
            chosen = ArenaSet(index=len(self.sets))
            self.sets.append(chosen)
            self._allocate(chosen, sizes)
        else:
            return None
        chosen.state = SetState.FILLING
        chosen.step = None
        return chosen

    def prewarm(self, sizes: tuple[int, ...]) -> bool:
        """Create one more FREE set of `sizes` if the pool has room, so that the next save does
        not pay for fresh pages while the trainer waits. Returns whether it created one."""
        if len(self.sets) >= self.max_inflight or any(s.state is SetState.FREE and s.fits(sizes) for s in self.sets):
            return False
        arena_set = ArenaSet(index=len(self.sets))
        self._allocate(arena_set, sizes)
        self.sets.append(arena_set)
        return True

    def _allocate(self, arena_set: ArenaSet, sizes: tuple[int, ...]) -> None:
        arena_set.close()
        self._generation += 1
        arenas: list[Arena | None] = []
        try:
            for rank, size in enumerate(sizes):
                if size == 0:
                    arenas.append(None)
                    continue
                name = f"{ARENA_PREFIX}{os.getpid()}-{self.job}-s{arena_set.index}-g{self._generation}-r{rank}"
                arenas.append(Arena(self.shm_dir / name, size))
        except BaseException:
            for arena in arenas:
                if arena is not None:
                    arena.close()
            raise
        arena_set.arenas = arenas

    def release(self, arena_set: ArenaSet) -> None:
        """The set's content is no longer needed."""
        arena_set.state = SetState.FREE
        arena_set.step = None
        arena_set.plan = None
        arena_set.extras = None

    def hold(self, arena_set: ArenaSet, step: int, plan: Any, extras: dict[int, Any]) -> None:
        """Keep a committed snapshot (laid out by `plan`) for tier-0 restores; older held snapshots become free."""
        arena_set.state = SetState.HELD
        arena_set.step = step
        arena_set.plan = plan
        arena_set.extras = extras
        for other in self.sets:
            if other is not arena_set and other.state is SetState.HELD and other.readers == 0:
                self.release(other)

    def held(self, step: int) -> ArenaSet | None:
        for s in self.sets:
            if s.state is SetState.HELD and s.step == step:
                return s
        return None

    def close(self) -> None:
        for s in self.sets:
            s.close()
        self.sets = []
