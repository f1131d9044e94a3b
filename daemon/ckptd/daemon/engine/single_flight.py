"""One read for many askers: callers that ask for the same key while it is being read wait for
that read instead of starting their own (the local ranks of a restarted daemon plan their loads
together, and each would otherwise fetch and parse the same index and extras). Runs on the
event loop."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """The reads under way, by key."""

    def __init__(self) -> None:
        self._reading: dict[K, asyncio.Task[V]] = {}

    async def run(self, key: K, read: Callable[[], Coroutine[Any, Any, V]], keep: Callable[[V], None] | None = None) -> V:
        """What `read()` returns, read once for every caller that asks for `key` while it runs;
        `keep` gets the value once, when the read succeeds. The read is a task of its own: the
        callers get its value or its error, and one caller cancelled (its client gone) does not
        cancel it for the others. Nothing is remembered after it ends: the next caller reads again."""
        task = self._reading.get(key)
        if task is None:
            task = self._reading[key] = asyncio.get_running_loop().create_task(read())
            task.add_done_callback(lambda done: self._done(key, done, keep))
        return await asyncio.shield(task)

    def _done(self, key: K, task: asyncio.Task[V], keep: Callable[[V], None] | None) -> None:
        if self._reading.get(key) is task:
            del self._reading[key]
        if not task.cancelled() and task.exception() is None and keep is not None:  # an error is each caller's to raise
            keep(task.result())
