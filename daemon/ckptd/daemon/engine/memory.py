"""Shared memory for snapshots: one budget over every job's arena sets, who holds what, and
giving memory back (docs/operations.md, "Memory").

Between saves a job keeps one arena set: its newest committed snapshot, held for restores from
memory, whose arenas its next save reuses (the step is durable by then). With
`hold_while_saving` the held snapshot stays while the next save fills a second set, when the
budget has room for it without taking anyone's memory. A second set is also made when a save
finds no idle one (the previous save is still being written, or read by a load), up to
`max_inflight`; once idle again, the job's spare set is given back.

Memory is given back (the arenas' pages freed, the files unmapped and deleted) when a save needs more than the
budget (`shm_budget`) or the shared-memory directory has: idle sets of any job, free ones
first, then held snapshots, the job idle longest first; after `idle_release_s` without a save
or load of a job; and by `ckptd gc`. Never a set in flight (being filled, or being written: the
only copy of a step not yet durable) nor one a load is reading.

Saves that wait for room are served oldest first across jobs: while a save of another job has
waited longer, a job takes no set (not even its own idle one, which the waiting save may take
instead), so a job saving back to back cannot keep reusing memory another job waits for.

A load's staging files (engine/staging.py: a step's bytes fetched from peers, replicas or a root
the ranks cannot read) live in the same directory and count against the same budget: room is
made for them as for a snapshot before they are staged (`stage_room`; a prefetch takes only
what is free), and they count as in use until the load's files are removed.

Runs on the event loop; arenas are made and closed in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Callable, Coroutine

from ckptd.common.sizes import human_bytes
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.engine.sessions import JobState
from ckptd.daemon.errors import Exhausted
from ckptd.daemon.handoff.arena import ARENA_PREFIX, ArenaPool, ArenaSet, Reservation, SetState
from ckptd.daemon.handoff.shm_dir import free_bytes, host_memory_bytes, total_bytes
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.records import ArenaHolder

log = logging.getLogger(__name__)


def _close_all(sets: list[ArenaSet]) -> None:
    for arena_set in sets:
        arena_set.close()


class ArenaMemory:
    """The arena sets of every job on this daemon against one budget.

    settings: the daemon's current configuration (it may change on SIGHUP); jobs: the engine's
    jobs by name (each with its `ArenaPool`); spawn: runs a coroutine in the background."""

    def __init__(
        self, settings: Callable[[], DaemonConfig], jobs: dict[str, JobState], metrics: Metrics,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self._settings = settings
        self._jobs = jobs
        self._metrics = metrics
        self._spawn = spawn
        self._host_memory = host_memory_bytes()
        self._pending = 0  # bytes allowed for sets being allocated now (not yet in any pool's nbytes)
        self._staged: dict[tuple[str, int], int] = {}  # (job, step) -> bytes counted for its loads' staging files
        self._freed = asyncio.Event()  # set (and replaced) whenever memory goes back or sets become idle
        self._waiting: dict[object, tuple[str, float]] = {}  # a save waiting for room (its waiter token) -> (its job, since: monotonic s)
        self._staging_written: Callable[[], int] = lambda: 0  # bytes the staging files take in the directory now
        self._drop_kept_staging: Callable[[], bool] = lambda: False  # remove staging files only holds keep; whether any went

    def _pools(self) -> dict[str, ArenaPool]:
        return {job: state.pool for job, state in self._jobs.items()}

    @property
    def budget(self) -> int | None:
        """The budget in bytes; None: only the shared-memory directory's size bounds the arenas."""
        return self._settings().shm_budget.resolve(self._host_memory)

    def free(self) -> int:
        """Bytes free in the shared-memory directory (0 when it cannot be checked)."""
        try:
            return free_bytes(self._settings().shm_dir)
        except OSError:
            return 0

    def in_use(self) -> int:
        """Bytes of every job's arena sets, of those being allocated and of loads' staging files."""
        return sum(pool.nbytes for pool in self._pools().values()) + self._pending + self.staging_bytes()

    def staging_bytes(self) -> int:
        """Bytes counted for the staging files of loads (until they are removed)."""
        return sum(self._staged.values())

    # ------------------------------------------------------------------ taking memory

    async def acquire(self, state: JobState, sizes: tuple[int, ...], waiter: object | None = None) -> ArenaSet | None:
        """A set of the job's with room for `sizes` (bytes per rank), FILLING; None when every
        set it may have is busy or the memory is not there now (wait, or skip).

        Preference: a free set that fits; with hold_while_saving a new set, if there is room
        without taking anyone's memory; an idle held snapshot that fits (its arenas are
        reused); an idle set reallocated; a new set. The last two may take other jobs' idle
        sets (`_room`). Raises Exhausted when the shared-memory directory refuses the memory.

        waiter: a token of the save asking, the same at each of its tries (None: no turn kept).
        A save that got None for want of room keeps its turn until it gets a set or
        `stop_waiting(waiter)`; saves of other jobs that came later get None meanwhile."""
        pool = state.pool
        pool.mark_used()
        self._check_possible(pool, sizes)
        if waiter is not None and self.waiting_before(waiter, pool.job):
            self._waiting.setdefault(waiter, (pool.job, time.monotonic()))
            return None
        own_limit = not pool.idle_sets() and not pool.can_grow  # its own saves hold every set it may have: not a wait for room
        taken = await self._take(pool, sizes)
        if waiter is not None:
            if taken is None and not own_limit:
                self._waiting.setdefault(waiter, (pool.job, time.monotonic()))
            elif self._waiting.pop(waiter, None) is not None and self._waiting:
                await self._notify()  # the next in line may try now
        return taken

    def stop_waiting(self, waiter: object) -> None:
        """The save of `waiter` no longer waits (it got a set, failed or timed out): the saves
        behind it may go (they are woken)."""
        if self._waiting.pop(waiter, None) is not None:
            self._spawn(self._notify())

    def waiting_before(self, waiter: object, job: str) -> list[str]:
        """The other jobs whose saves wait for room longer than `waiter` (for messages)."""
        mine = self._waiting.get(waiter, (job, float("inf")))[1]
        return sorted({other for other, since in self._waiting.values() if other != job and since < mine})

    async def _take(self, pool: ArenaPool, sizes: tuple[int, ...]) -> ArenaSet | None:
        """acquire's choice of a set, without the turns."""
        free = pool.fitting(sizes, SetState.FREE)
        if free is not None:
            return pool.reserve(free).arena_set
        if self._settings().hold_while_saving and pool.can_grow:
            made = await self._make(pool, pool.reserve_new(), sizes, evict=False)
            if made is not None:
                return made
        held = pool.fitting(sizes, SetState.HELD)
        if held is not None:
            return pool.reserve(held).arena_set
        idle = pool.idle_sets()
        if idle:
            return await self._make(pool, pool.reserve(idle[0]), sizes, evict=True)
        if pool.can_grow:
            return await self._make(pool, pool.reserve_new(), sizes, evict=True)
        return None

    def _check_possible(self, pool: ArenaPool, sizes: tuple[int, ...]) -> None:
        """Raise Exhausted at once when `sizes` can never fit: more than the whole budget or the
        whole shared-memory file system, however much is given back (waiting would only hold the
        save until its timeout)."""
        self._check_fits(sum(sizes), f"a snapshot of job {pool.job!r}", "or save a smaller state per node")

    def _check_fits(self, need: int, what_for: str, remedy: str) -> None:
        """Exhausted when `need` bytes exceed the whole budget or the whole shared-memory directory."""
        settings = self._settings()
        budget = self.budget
        try:
            total = total_bytes(settings.shm_dir)
        except OSError:
            total = None
        limits = [(b, f"all of --shm-budget ({human_bytes(b)})") for b in (budget,) if b is not None]
        limits += [(t, f"all of {settings.shm_dir} ({human_bytes(t)})") for t in (total,) if t is not None]
        for limit, what in limits:
            if need > limit:
                raise Exhausted(
                    f"cannot reserve {human_bytes(need)} of shared memory for {what_for}: more than {what}; "
                    f"give the daemon more shared memory or a larger --shm-budget, {remedy}"
                )

    # ------------------------------------------------------------------ loads' staging files

    async def stage_room(self, job: str, step: int, nbytes: int, wait_s: float, evict: bool = True) -> None:
        """Count `nbytes` of staging files for a load of `step` of `job`, once the budget and the
        directory have room for them: idle sets of any job are given back first (free ones; with
        `evict` held snapshots too, the job idle longest first, as for a save), then sets in
        flight are waited for, up to `wait_s` seconds (a prefetch: evict False, wait 0). Exhausted,
        naming what holds the memory, when they never fit or did not within `wait_s`; nothing is
        counted then."""
        what_for = f"staging {human_bytes(nbytes)} of step {step} of job {job!r} for its ranks"
        self._check_fits(nbytes, what_for, "or let the ranks read the checkpoint files themselves (they then stage nothing)")
        deadline = time.monotonic() + wait_s
        while not await self._room(nbytes, None, evict):
            left = deadline - time.monotonic()
            if left <= 0:
                raise Exhausted(self._staging_shortage(what_for))
            freed = self._freed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(freed.wait(), left)
        self._staged[(job, step)] = self._staged.get((job, step), 0) + nbytes

    def track_staging_files(self, written: Callable[[], int], drop_kept: Callable[[], bool]) -> None:
        """`written()`: the bytes the staging files take in the directory now (engine/staging.py),
        so that the directory's check counts only the staged bytes not yet written. `drop_kept()`:
        remove the staging files that no load reads, only a hold keeps for ranks not come yet
        (engine/staging_holds.py), when nothing else can be given back; whether any went."""
        self._staging_written = written
        self._drop_kept_staging = drop_kept

    def staging_removed(self, job: str, step: int) -> None:
        """The staging files of `step` of `job` were removed: their bytes are free again (saves waiting are woken)."""
        if self._staged.pop((job, step), None):
            self._spawn(self._notify())

    def _staging_shortage(self, what_for: str) -> str:
        return (
            f"no room for {what_for}: {human_bytes(self.in_use())} of shared memory in use (arenas: {self._holdings()}; staging "
            f"{human_bytes(self.staging_bytes())}), none of it idle to give back. Retry once the saves in flight are written, "
            "raise --shm-budget, or let the ranks read the checkpoint files themselves"
        )

    async def prewarm(self, state: JobState, sizes: tuple[int, ...]) -> None:
        """With hold_while_saving: make the job's next set now, while this snapshot is copied
        and written, if the budget has room without taking anyone's memory."""
        pool = state.pool
        if not self._settings().hold_while_saving or not pool.can_grow or pool.fitting(sizes, SetState.FREE) is not None or self._waiting:
            return
        made = await self._make(pool, pool.reserve_new(), sizes, evict=False)
        if made is not None:
            pool.release(made)
            await self._notify()

    async def _make(self, pool: ArenaPool, taken: Reservation, sizes: tuple[int, ...], evict: bool) -> ArenaSet | None:
        """Allocate the reserved set's arenas for `sizes` once there is room; None (reservation
        undone) when there is not. evict: other jobs' held snapshots may be given back."""
        arena_set = taken.arena_set
        grow = max(0, sum(sizes) - arena_set.nbytes)
        if not await self._room(grow, arena_set, evict):
            pool.undo(taken)
            return None
        self._pending += grow
        try:
            try:
                await asyncio.to_thread(pool.allocate, arena_set, sizes)
            except Exhausted:
                # Full although the check said there was room (other files in the directory grew
                # meanwhile): give back what may be given, then try once more.
                if not evict or not await self._room(grow, arena_set, evict, everything=True):
                    raise
                await asyncio.to_thread(pool.allocate, arena_set, sizes)
        except Exhausted:
            pool.undo(taken)
            if not evict:
                return None
            raise
        except BaseException:
            pool.undo(taken)
            raise
        finally:
            self._pending -= grow
        return arena_set

    async def _room(self, need: int, exclude: ArenaSet | None, evict: bool, everything: bool = False) -> bool:
        """Whether `need` more bytes fit in the budget and the directory, after giving back idle
        sets as needed (free ones; with `evict` held snapshots too, the job idle longest first).
        everything: give back until `need` bytes went back, whatever the checks say."""
        released = 0
        while True:
            short = need - released if everything else max(self._over_budget(need), self._over_directory(need))
            if short <= 0:
                return True
            victim = self._victim(exclude, evict)
            if victim is None:
                if self._drop_kept_staging():  # a late rank would stage it again: memory comes first
                    continue
                return False
            pool, arena_set = victim
            released += arena_set.nbytes
            free_before = self.free()
            await self._give_back(pool, [arena_set], "pressure")
            if not everything and self._over_budget(need) <= 0 and self.free() <= free_before:
                return False  # the directory did not get the pages back (no hole punching there): taking more would not help

    def _over_budget(self, need: int) -> int:
        """Bytes by which `need` more would exceed the budget (<= 0: within it)."""
        budget = self.budget
        return self.in_use() + need - budget if budget is not None else 0

    def _over_directory(self, need: int) -> int:
        """Bytes by which `need` more would exceed the directory's free space (<= 0: they fit), the
        staging counted but not written yet included (two loads counted at once must both fit)."""
        unwritten = max(0, self.staging_bytes() - self._staging_written()) if self._staged else 0
        try:
            return need + self._pending + unwritten - free_bytes(self._settings().shm_dir)
        except OSError as exc:  # allocation will say what is wrong with the directory
            log.warning("cannot check the free space of %s: %s", self._settings().shm_dir, exc)
            return 0

    def _victim(self, exclude: ArenaSet | None, evict: bool) -> tuple[ArenaPool, ArenaSet] | None:
        """The idle set to give back first: free sets before held snapshots, the pool idle longest first."""
        candidates = [
            (arena_set.state is SetState.HELD, pool.last_used, pool, arena_set)
            for pool in self._pools().values() for arena_set in pool.idle_sets()
            if arena_set is not exclude and (evict or arena_set.state is SetState.FREE)
        ]
        if not candidates:
            return None
        _, _, pool, arena_set = min(candidates, key=lambda c: (c[0], c[1]))
        return pool, arena_set

    # ------------------------------------------------------------------ giving memory back

    def settle(self, state: JobState) -> None:
        """A set of the job's became idle: unless hold_while_saving, it keeps one idle set (its
        newest held snapshot) and gives the others back; waiting saves (of any job) are woken."""
        pool = state.pool
        if not self._settings().hold_while_saving:
            spare = pool.surplus()
            if spare:
                self._spawn(self._close(pool.job, spare, "spare"))
                return
        self._spawn(self._notify())

    async def _give_back(self, pool: ArenaPool, sets: list[ArenaSet], reason: str) -> None:
        """Take idle sets out of the job's pool and close them."""
        for arena_set in sets:
            pool.detach(arena_set)
        await self._close(pool.job, sets, reason, time.monotonic() - pool.last_used)

    async def _close(self, job: str, sets: list[ArenaSet], reason: str, idle_s: float = 0.0) -> None:
        nbytes = sum(s.nbytes for s in sets)
        steps = [s.step for s in sets if s.step is not None]
        what = f"its snapshot of step {', '.join(map(str, steps))}" if steps else "a free arena set"
        level = logging.DEBUG if reason == "spare" else logging.INFO
        log.log(level, "gave back %s of shared memory of job %r (%s, idle %.0f s): %s", human_bytes(nbytes), job, what, idle_s, reason,
                extra={"job": job})
        await asyncio.to_thread(_close_all, sets)
        self._metrics.arena_released.labels(reason).inc(nbytes)
        await self._notify()

    async def _notify(self) -> None:
        """Wake the saves of every job that wait for an arena set (JobState.arena_freed), and the
        loads that wait for room to stage."""
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()
        for state in list(self._jobs.values()):
            async with state.arena_freed:
                state.arena_freed.notify_all()

    async def release_idle(self, now: float | None = None) -> int:
        """Give back the sets of every job idle for idle_release_s (none in flight or read, no
        save open); returns the bytes given back."""
        idle_s = self._settings().idle_release_s
        if not idle_s:
            return 0
        now = time.monotonic() if now is None else now
        total = 0
        for job, pool in list(self._pools().items()):
            if pool.sets and not self._jobs[job].sessions and all(s.idle for s in pool.sets) and now - pool.last_used >= idle_s:
                total += pool.nbytes
                await self._give_back(pool, list(pool.sets), "idle")
        return total

    async def release_idle_forever(self) -> None:
        """Run release_idle every quarter of idle_release_s (at most every minute, at least every second)."""
        while True:
            idle_s = self._settings().idle_release_s
            await asyncio.sleep(min(60.0, max(1.0, idle_s / 4)) if idle_s else 60.0)
            await self.release_idle()

    async def collect(self, job: str | None, dry_run: bool) -> list[tuple[str, int, str, int]]:
        """`ckptd gc`: give back every idle set (of `job`, or of all jobs); returns (job, step or
        -1, arena files, bytes) of each."""
        out = []
        for name, pool in list(self._pools().items()):
            if job and name != job:
                continue
            for arena_set in pool.idle_sets():
                out.append((name, arena_set.step if arena_set.step is not None else -1, self._files(pool, arena_set), arena_set.nbytes))
                if not dry_run:
                    await self._give_back(pool, [arena_set], "gc")
        return out

    def _files(self, pool: ArenaPool, arena_set: ArenaSet) -> str:
        """The set's arena files, for reports: one path, or a glob of several."""
        paths = [str(a.path) for a in arena_set.arenas if a is not None]
        if len(paths) == 1:
            return paths[0]
        return str(Path(pool.shm_dir) / f"{ARENA_PREFIX}*-{pool.job}-s{arena_set.index}-*")

    # ------------------------------------------------------------------ reports

    def holders(self) -> list[ArenaHolder]:
        """Who holds what (`ckptd status`, metrics): each job with arena sets."""
        now = time.monotonic()
        out = []
        for job, pool in sorted(self._pools().items()):
            if not pool.sets:
                continue
            active = bool(self._jobs[job].sessions) or not all(s.idle for s in pool.sets)
            out.append(ArenaHolder(
                job=job, bytes=pool.nbytes, sets=len(pool.sets),
                held_steps=tuple(sorted(s.step for s in pool.sets if s.state is SetState.HELD and s.step is not None)),
                in_flight=sum(1 for s in pool.sets if s.state in (SetState.FILLING, SetState.PERSISTING)),
                readers=sum(s.readers for s in pool.sets),
                idle_s=0.0 if active else now - pool.last_used,
            ))
        return out

    def shortage(self, pool: ArenaPool, sizes: tuple[int, ...], waiter: object | None = None) -> str:
        """Why a save of the job with `sizes` (and `waiter`, see acquire) gets no arena set now,
        and what would help."""
        settings = self._settings()
        before = self.waiting_before(waiter, pool.job) if waiter is not None else []
        if before:
            named = ", ".join(repr(job) for job in before)
            return (
                f"job {pool.job!r} needs {human_bytes(sum(sizes))} of shared memory for a snapshot and saves of job {named} have waited "
                f"for room longer: they go first ({human_bytes(self.in_use())} in use; arenas: {self._holdings()}). "
                f"Raise --shm-budget, give {settings.shm_dir} more memory, or save these jobs less often"
            )
        if not pool.idle_sets() and not pool.can_grow:
            busy = ", ".join(s.describe() for s in pool.sets)
            return (
                f"every arena set of job {pool.job!r} is still being written or read ({busy}; --max-inflight {pool.max_inflight})"
            )
        budget = self.budget
        try:
            room = f"{human_bytes(free_bytes(settings.shm_dir))} free in {settings.shm_dir}"
        except OSError as exc:
            room = f"{settings.shm_dir} unreadable ({exc.strerror or exc})"
        where = f"{room}, budget {human_bytes(budget)} (--shm-budget {settings.shm_budget})" if budget is not None else room
        return (
            f"job {pool.job!r} needs {human_bytes(sum(sizes))} of shared memory for a snapshot and there is no room "
            f"({human_bytes(self.in_use())} in use by arenas and loads' staging files, {where}); arenas: {self._holdings()}; none of them is idle to give back. "
            f"Raise --shm-budget, give {settings.shm_dir} more memory, or lower --max-inflight"
        )

    def _holdings(self) -> str:
        """Every job's arena sets, for the messages of a shortage."""
        return "; ".join(
            f"job {name!r} {human_bytes(p.nbytes)}: {', '.join(s.describe() for s in p.sets)}" for name, p in self._pools().items() if p.sets
        ) or "none"
