"""How long a step's staging files stay once no load is reading them (engine/loads.py).

A load stages what its rank cannot read itself (a replaced node's part, from a peer) into
shared memory; the files go when no load of the step is being planned or read, unless a hold
keeps them:

- a prefetch's: while a replaced node stages its own part before its ranks ask (no end), then
  PREFETCH_HOLD_S for ranks that have not come;
- the node's other ranks': after a load, until every rank this daemon serves (the ranks' local
  world) has loaded the step, or SIBLINGS_WAIT_S when some never come. The ranks of a relaunched
  job do not load at once, and one that came after the others had finished would otherwise
  stage the same bytes again, from a peer at network cost.

The last of a step's ranks ends every hold but a prefetch still staging, and so does memory
running short (engine/memory.py asks when it has nothing else to give back). Pure bookkeeping on
the event loop; `release(job, step)` is called when a hold ends by time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Coroutine

PREFETCH_HOLD_S = 600.0  # seconds a prefetched part stays staged for loads that have not come
SIBLINGS_WAIT_S = 60.0  # seconds a step's staging files stay after a load for this node's ranks that have not loaded it

Key = tuple[str, int]  # (job, step)
Spawn = Callable[[Coroutine[object, object, None]], object]


class StagingHolds:
    """The holds on steps' staging files, by (job, step)."""

    def __init__(self, spawn: Spawn, release: Callable[[str, int], None]) -> None:
        self._spawn = spawn  # runs a coroutine in the background (Engine.spawn)
        self._release = release  # removes the step's staging files if nothing else keeps them
        self._until: dict[Key, float] = {}  # monotonic s; inf: a prefetch staging
        self._served: dict[Key, set[int]] = {}  # the ranks whose load of the step is done

    def __contains__(self, key: Key) -> bool:
        return key in self._until

    def prefetching(self, key: Key) -> None:
        """A prefetch stages the step: its files stay until it ends (`prefetched` or `drop`)."""
        self._until[key] = float("inf")

    def prefetched(self, key: Key) -> None:
        """The prefetch staged the step: its files stay PREFETCH_HOLD_S for the ranks' loads."""
        self._hold(key, PREFETCH_HOLD_S)

    def drop(self, key: Key) -> None:
        """The prefetch failed: nothing of it is kept."""
        self._until.pop(key, None)

    def load_done(self, key: Key, rank: int, local_ranks: int) -> None:
        """Rank `rank` (of the `local_ranks` this daemon serves) finished a load of the step
        that staged files: the files stay for the others, or no longer once all have loaded."""
        served = self._served.setdefault(key, set())
        served.add(rank)
        until = self._until.get(key)
        if len(served) >= local_ranks:
            if until is not None and until < float("inf"):
                del self._until[key]
        elif until is None or until < time.monotonic() + SIBLINGS_WAIT_S:
            self._hold(key, SIBLINGS_WAIT_S)

    def end_waiting(self) -> list[Key]:
        """End every hold but a prefetch's still staging (memory is short); the steps they held."""
        ended = [key for key, until in self._until.items() if until < float("inf")]
        for key in ended:
            del self._until[key]
        return ended

    def forget(self, key: Key) -> None:
        """The step's staging files were removed: a later load starts afresh."""
        self._served.pop(key, None)

    def _hold(self, key: Key, seconds: float) -> None:
        until = self._until[key] = time.monotonic() + seconds
        self._spawn(self._end(key, until))

    async def _end(self, key: Key, until: float) -> None:
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        if self._until.get(key) == until:
            del self._until[key]
            self._release(*key)
