"""A replaced node's parts staged before its ranks ask (--replica-prefetch; docs/architecture.md
§9, "Prefetch on a replaced node").

A daemon that starts on a root without its node's part of a job's newest step (its
machine was replaced: an empty disk, empty shared memory) asks node 0 where that part is held
(one call: node 0 tracks where each node's part of the jobs' newest steps is held) and stages it from there at once,
through Loads.prefetch: the same tiers, checks and fallbacks as a load's reads, into the
staging files a load of the step uses. A relaunched job's ranks come seconds after their daemon
(relaunching 9 processes that import torch took 10.5 s in tests/bench/bench_recovery.py); their
load then finds the bytes staged and checked, and only plans and copies.

Best effort throughout: a part that cannot be staged now (node 0 down, the holders gone) is
logged, and a load stages what it needs as before.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Sequence

from ckptd.common.sizes import human_bytes
from ckptd.daemon.errors import NotFound, Precondition, Unavailable

log = logging.getLogger(__name__)

HeldParts = Callable[[], Awaitable["Sequence[tuple[str, int, tuple[int, ...]]] | str"]]  # node 0's answer: (job, step, holders), or why none
Prefetch = Callable[[str, int], Awaitable[int]]  # Loads.prefetch: stage this node's part of (job, step); the bytes staged


async def prefetch_parts(held_parts: HeldParts, prefetch: Prefetch) -> int:
    """Stage this node's part of each job's newest step that this root lacks (see the
    module docstring); returns the bytes staged. Never raises for a part it could not stage."""
    answer = await held_parts()
    if isinstance(answer, str):
        log.info("could not ask node 0 where this node's parts are held (%s); a load stages what it needs when it comes", answer)
        return 0
    total = 0
    for job, step, holders in answer:
        started = time.monotonic()
        try:
            nbytes = await prefetch(job, step)
        except (NotFound, Precondition, Unavailable, OSError) as exc:
            log.warning("step %s of job %s: this node's part was not staged ahead of its ranks' load (%s); the load stages it", step, job, exc,
                        extra={"job": job, "step": step})
            continue
        if nbytes:
            log.info("step %s of job %s: staged this node's part (%s, held by nodes %s) for its ranks' load in %.3f s, before they asked",
                     step, job, human_bytes(nbytes), list(holders), time.monotonic() - started, extra={"job": job, "step": step})
        total += nbytes
    if answer:
        log.info("node 0 says other nodes hold this node's part of %d job(s)' newest step; %s of it staged ahead of the ranks (what was not is in this root, or a load stages it)",
                 len(answer), human_bytes(total))
    return total
