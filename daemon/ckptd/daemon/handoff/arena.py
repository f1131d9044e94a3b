"""Shared-memory arenas: daemon-owned files in a tmpfs that trainer ranks map and copy into.

The daemon creates, sizes, pre-faults and deletes arenas; a trainer only maps them. So an
arena survives a trainer crash, never leaks when the trainer dies, and its pages are charged
to the daemon. Space is reserved with posix_fallocate: on a full tmpfs `ftruncate` succeeds
and the first write later dies with SIGBUS; fallocate fails up front with ENOSPC instead.

An `ArenaSet` is one snapshot's worth of arenas: one per rank of a job. A job has at most
`max_inflight` sets; a set is reused from save to save (a reused tmpfs page costs a fraction
of a fresh one), and grows only when the plan needs more. How many a job keeps between saves,
and when their memory goes back, is engine/memory.py's.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ckptd.common.names import decimal
from ckptd.common.sizes import human_bytes
from ckptd.daemon.errors import Exhausted
from ckptd.daemon.private_dirs import create_file
from ckptd.daemon.storage.fs import foreign_reason

log = logging.getLogger(__name__)

ARENA_PREFIX = "ckptd-"
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not in Python's mmap module before 3.13
ALLOCATE_THREADS = 8  # arenas of one set made at once (ArenaPool.allocate)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02  # linux/falloc.h; os has no fallocate()


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
        """Give the pages back, unmap and delete the file. Views still held elsewhere keep the
        mapping alive until released, but not its pages (see _punch)."""
        self._punch()
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

    def _punch(self) -> None:
        """Free the file's pages now. A trainer keeps the arenas it used mapped (ckptd.client's
        ArenaMaps) until it maps others or closes: without this, the memory of an idle job that
        is still running would go back only then, not when the daemon gives it back. A trainer
        never touches an arena the daemon gave back (it copies only into the one BeginSave
        names); if it did, it would read zeros, not fault."""
        fallocate = _fallocate()
        if fallocate is None:
            return  # no fallocate in this C library: the pages go with the last mapping
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # gone already: its pages go with the last mapping
        try:
            if fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, max(self.size, 1)) != 0:
                log.debug("cannot free the pages of %s early: %s", self.path, os.strerror(ctypes.get_errno()))
        finally:
            os.close(fd)


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's fallocate(fd, mode, offset, len), or None where libc has none (loaded once)."""
    call = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
    if call is None:
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    call.restype = ctypes.c_int
    return call


class SetState(enum.Enum):
    FREE = "free"  # nothing of value inside
    FILLING = "filling"  # ranks are copying a snapshot in
    PERSISTING = "persisting"  # a complete snapshot is being written to disk
    HELD = "held"  # a committed snapshot kept in memory for fast restore (the HELD tier)


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
    held_order: int = 0  # when it was held (the pool's count of holds): the newest held is the highest

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.arenas if a is not None)

    @property
    def idle(self) -> bool:
        """Nothing in flight and no load reading: its memory may be reused or given back. A
        snapshot being filled or written (the only copy of a step not yet durable) never is."""
        return self.state in (SetState.FREE, SetState.HELD) and self.readers == 0

    def fits(self, sizes: tuple[int, ...]) -> bool:
        if len(sizes) != len(self.arenas):
            return False
        return all(need == 0 or (a is not None and a.size >= need) for a, need in zip(self.arenas, sizes))

    def describe(self) -> str:
        """For messages: 'step 7 (held)', 'step 8 (being written)', 'a snapshot (being copied)', 'nothing (free)'."""
        if self.state is SetState.FREE:
            return "nothing (free)"
        what = {SetState.FILLING: "being copied", SetState.PERSISTING: "being written", SetState.HELD: "held"}[self.state]
        read = f", read by {self.readers} load(s)" if self.readers else ""
        return f"step {self.step} ({what}{read})" if self.step is not None else f"a snapshot ({what}{read})"

    def close(self) -> None:
        for arena in self.arenas:
            if arena is not None:
                arena.close()
        self.arenas = []


@dataclass(frozen=True)
class HeldPart:
    """A rank's part of a held snapshot: `nbytes` from the start of the arena file `path`."""

    step: int
    path: str
    nbytes: int


@dataclass(frozen=True)
class Reservation:
    """An arena set taken for a snapshot (FILLING) before its memory is known to be there:
    `ArenaPool.undo` puts it back as it was (a new set is removed)."""

    arena_set: ArenaSet
    new: bool
    state: SetState
    step: int | None
    plan: Any
    extras: dict[int, Any] | None


def remove_stale_arenas(shm_dir: Path, live_pid: int) -> list[Path]:
    """Delete the files (arenas, staging, replicas) that daemons which no longer run left in
    `shm_dir`; called at this daemon's start, before it makes any. Their names begin with the
    pid of the daemon that made them: another pid's are live while a ckptd process has that pid;
    this daemon's own pid's cannot be its own yet, so they are an earlier daemon's that had the
    same pid: a container restarted (ckptd is pid 1 again), whose earlier run's arenas would
    otherwise hold the node's memory for good and take the names of this run's first arenas
    (that job's first save failed: "File exists"). Only the daemon's own files are removed
    (storage.fs.foreign_reason): anything else under such a name (a directory, a link, another
    user's file) is left where it is, with a warning, and the daemon starts."""
    removed = []
    for path in shm_dir.glob(f"{ARENA_PREFIX}*"):
        pid = decimal(path.name[len(ARENA_PREFIX) :].split("-", 1)[0])
        if pid is None:
            continue
        if pid != live_pid and pid_alive(pid) and _is_ckptd(pid):
            continue
        try:
            why = foreign_reason(path.lstat())
            if why is not None:
                log.warning("leaving %s alone: it is named like an arena but is not a file the daemon made (it is %s)", path, why)
                continue
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not remove %s, left by an earlier daemon: %s", path, exc)
    return removed


PID_MAX_LIMIT = 1 << 22  # Linux's highest possible pid_max (include/linux/threads.h)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts as alive); a number no Linux pid
    can be (0, or above PID_MAX_LIMIT, as a planted file name may say) is no process."""
    if not 0 < pid <= PID_MAX_LIMIT:
        return False
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
    """The arena sets of one job: at most `max_inflight`, created on demand and reused.

    Choosing a set for a snapshot (`reserve`, `reserve_new`) is bookkeeping on the event loop;
    making its memory (`allocate`) runs in a thread. The daemon-wide budget and which sets are
    given back are engine/memory.py's."""

    def __init__(self, shm_dir: Path, job: str, max_inflight: int) -> None:
        self.shm_dir = shm_dir
        self.job = job
        self.max_inflight = max_inflight
        self.sets: list[ArenaSet] = []
        self.last_used = time.monotonic()  # the job's last save or load through these arenas
        self._generation = 0
        self._holds = 0
        self._next_index = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sets)

    @property
    def count(self) -> int:
        return sum(1 for s in self.sets for a in s.arenas if a is not None)

    @property
    def can_grow(self) -> bool:
        return len(self.sets) < self.max_inflight

    def mark_used(self) -> None:
        self.last_used = time.monotonic()

    def idle_sets(self) -> list[ArenaSet]:
        """The sets whose memory may be reused or given back: free ones, then held ones, oldest first."""
        idle = [s for s in self.sets if s.idle]
        return sorted(idle, key=lambda s: (s.state is SetState.HELD, s.held_order))

    def fitting(self, sizes: tuple[int, ...], state: SetState) -> ArenaSet | None:
        """An idle set in `state` with room for `sizes` (bytes per rank); held ones oldest first."""
        return next((s for s in self.idle_sets() if s.state is state and s.fits(sizes)), None)

    def reserve(self, arena_set: ArenaSet) -> Reservation:
        """Take an idle set for a snapshot (FILLING); a held snapshot inside is dropped."""
        assert arena_set.idle and arena_set in self.sets
        taken = Reservation(arena_set, False, arena_set.state, arena_set.step, arena_set.plan, arena_set.extras)
        arena_set.state = SetState.FILLING
        arena_set.step = arena_set.plan = arena_set.extras = None
        return taken

    def reserve_new(self) -> Reservation:
        """A new, still empty set for a snapshot (FILLING); the caller allocates it."""
        assert self.can_grow
        arena_set = ArenaSet(index=self._next_index, state=SetState.FILLING)
        self._next_index += 1
        self.sets.append(arena_set)
        return Reservation(arena_set, True, SetState.FREE, None, None, None)

    def undo(self, taken: Reservation) -> None:
        """Put back a reservation whose memory could not be had: a new or emptied set goes."""
        arena_set = taken.arena_set
        if taken.new or not arena_set.arenas:
            arena_set.close()
            if arena_set in self.sets:
                self.sets.remove(arena_set)
            return
        arena_set.state, arena_set.step, arena_set.plan, arena_set.extras = taken.state, taken.step, taken.plan, taken.extras

    def allocate(self, arena_set: ArenaSet, sizes: tuple[int, ...]) -> None:
        """Replace the set's arenas by new ones of `sizes` (blocking: run in a thread), several
        ranks' at once: the kernel zeroes a tmpfs file's pages under that file's lock, so one
        arena per thread (4 of 128 MiB: 240 -> 190 ms on this project's 2-core VM, timed by
        hand; not measured on more cores). If one cannot be made, none is kept."""
        arena_set.close()
        self._generation += 1
        names = {rank: f"{ARENA_PREFIX}{os.getpid()}-{self.job}-s{arena_set.index}-g{self._generation}-r{rank}" for rank, size in enumerate(sizes) if size}
        made: dict[int, Arena] = {}

        def make(rank: int) -> None:
            made[rank] = Arena(self.shm_dir / names[rank], sizes[rank])

        workers = min(ALLOCATE_THREADS, len(names), os.cpu_count() or 1)
        try:
            if workers <= 1:
                for rank in names:
                    make(rank)
            else:
                with ThreadPoolExecutor(workers, thread_name_prefix="ckptd-arena") as pool:
                    futures = [pool.submit(make, rank) for rank in names]
                for future in futures:  # every thread has finished: the first failure, if any
                    future.result()
        except BaseException:
            for arena in made.values():
                arena.close()
            raise
        arena_set.arenas = [made.get(rank) for rank in range(len(sizes))]

    def release(self, arena_set: ArenaSet) -> None:
        """The set's content is no longer needed."""
        arena_set.state = SetState.FREE
        arena_set.step = None
        arena_set.plan = None
        arena_set.extras = None

    def hold(self, arena_set: ArenaSet, step: int, plan: Any, extras: dict[int, Any]) -> None:
        """Keep a committed snapshot (laid out by `plan`) for tier-0 restores; older held snapshots become free."""
        self._holds += 1
        arena_set.state = SetState.HELD
        arena_set.step = step
        arena_set.plan = plan
        arena_set.extras = extras
        arena_set.held_order = self._holds
        self.mark_used()
        for other in self.sets:
            if other is not arena_set and other.state is SetState.HELD and other.readers == 0:
                self.release(other)

    def surplus(self) -> list[ArenaSet]:
        """Take out every idle set but one (the newest held snapshot, else the largest free set):
        what a job keeps between saves when the held snapshot's arenas are reused. Returns them
        for the caller to close (off the event loop)."""
        idle = self.idle_sets()
        if len(idle) <= 1:
            return []
        held = [s for s in idle if s.state is SetState.HELD]
        keep = held[-1] if held else max(idle, key=lambda s: s.nbytes)
        return [self.detach(s) for s in idle if s is not keep]

    def detach(self, arena_set: ArenaSet) -> ArenaSet:
        """Take an idle set out of the pool (its held snapshot, if any, is no longer served);
        the caller closes it."""
        assert arena_set.idle
        self.sets.remove(arena_set)
        self.release(arena_set)
        return arena_set

    def held(self, step: int) -> ArenaSet | None:
        for s in self.sets:
            if s.state is SetState.HELD and s.step == step:
                return s
        return None

    def held_part(self, rank: int) -> HeldPart | None:
        """Where `rank`'s part of the newest held snapshot lies, or None (nothing held, or the
        rank copied nothing into it)."""
        newest = max((s for s in self.sets if s.state is SetState.HELD), key=lambda s: s.held_order, default=None)
        if newest is None or newest.step is None or not 0 <= rank < len(newest.arenas):
            return None
        arena, nbytes = newest.arenas[rank], newest.plan.arena_bytes[rank]  # one of each per rank (allocate)
        return HeldPart(newest.step, arena.path_text, nbytes) if arena is not None and nbytes > 0 else None

    def close(self) -> None:
        for s in self.sets:
            s.close()
        self.sets = []
