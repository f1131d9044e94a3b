"""The daemon process's heap: freed pages given back (`trim_heap`), and when Python's cyclic
garbage collector makes its full collections.

A full collection scans every object the collector tracks. With a job of 4,000 tensors the
daemon holds ~120,000 of them (plans, layouts, held snapshots' structures) and a full collection
takes ~30 ms; Python started one about every third save, inside whatever was allocating most
at that moment, the commit's index (`step_files` timed in the daemon: 17 ms, or 49 ms). It found
nothing to free nearly every time. So the daemon process (`app/server.run`, not a process that
merely imports the daemon) freezes what it holds once started, makes automatic full
collections ten times rarer (`quiet_collector`), and after each commit, off the path to durable,
makes the full collection that Python's default schedule would have made by then
(`collect_if_due`)."""

from __future__ import annotations

import ctypes
import gc

FULL_EVERY = 100  # gen-1 collections between two automatic full collections in the daemon (Python's default: 10)
DUE_AFTER = 10  # gen-1 collections after which a commit makes the full collection itself (Python's default schedule)


def quiet_collector() -> None:
    """At the daemon's start, once its modules are loaded: those objects frozen (never scanned
    again), automatic full collections every FULL_EVERY gen-1 collections. Process-wide."""
    gc.collect()
    gc.freeze()
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, FULL_EVERY)


def collect_if_due() -> None:
    """A full collection when DUE_AFTER gen-1 collections passed since the last: Python's own
    schedule, at a moment the caller chose. Blocking (it holds the GIL ~1 ms per 4,000 objects)."""
    if gc.get_count()[2] >= DUE_AFTER:
        gc.collect()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).

    Planning, writing and committing a step allocate and free a few KiB per tensor; glibc keeps
    freed pages for later, so after the first save of a job of 1,000 tensors the daemon held
    about 3 MiB more than it uses between saves. Blocking (it walks the heap): run in a thread."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the allocator keeps what it keeps


def after_commit() -> None:
    """What a commit leaves to the heap once it is durable: the full collection when due, then
    the free pages back. Blocking: run in a thread."""
    collect_if_due()
    trim_heap()
