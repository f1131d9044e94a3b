"""Node 0's decisions about runs (engine/runs.py has the rules): whether a save's run may save
into the job, whether another run's save of the same step may be ended for it, and the rollback
note. Liveness spans the nodes: a run is live while a client of it is attached to this daemon or
to another node's (asked over the Peer service's Inventory, only when an owner would change).
"""

from __future__ import annotations

import asyncio
import logging

from ckptd.daemon.engine.peers import PeerProbe
from ckptd.daemon.engine.runs import RunClaim, Runs
from ckptd.daemon.plan.rollback import passed_over
from ckptd.daemon.storage import StorageBackend

log = logging.getLogger(__name__)


class Admission:
    """Node 0's run decisions for every node (the coordinator calls them)."""

    def __init__(self, runs: Runs, peers: PeerProbe, storage: StorageBackend) -> None:
        self.runs = runs
        self._peers = peers
        self._storage = storage

    async def live(self, job: str, run: str) -> bool:
        """Whether a client of `run` is attached to this daemon or to another node's."""
        if self.runs.live(job, run):
            return True
        others = range(1, self._peers.nodes)
        return any(await asyncio.gather(*(self._peers.run_attached(n, job, run) for n in others)))

    async def replace(self, job: str, step: int, other: RunClaim, claim: RunClaim) -> str:
        """Run `claim` joins step `step`, which run `other` began and not all of whose ranks
        joined: RunRefused while `other` is live and `claim` did not resume; else the reason to
        abort `other`'s save (it ended, or `claim` takes the job over)."""
        other_live = not claim.resumed and await self.live(job, other.run)  # asked of the nodes only when it decides
        return f"{self.runs.end_reason(job, other.run, claim.run, claim.resumed, other_live)} (step {step})"

    async def admit(self, job: str, step: int, claim: RunClaim) -> str:
        """Every rank of a save has joined: `claim`'s run may save into the job (RunRefused if
        not: engine/runs.py); returns the run it took the job over from ("" none). A save below
        the job's newest committed step is logged as a rollback, with the steps it passes over."""
        displaced = ""
        if claim.run:
            owner = self.runs.owner(job)
            owner_live = bool(owner) and owner != claim.run and await self.live(job, owner)
            displaced = self.runs.claim(job, claim.run, claim.resumed, owner_live)
        await self._note_rollback(job, step)
        return displaced

    async def _note_rollback(self, job: str, step: int) -> None:
        """Log a save below the job's newest committed step, with the steps it passes over. The
        job's `latest` (one small read) rules out the usual case, a save above it, without
        listing every committed step on each save; only a save below it lists them."""
        hint = await asyncio.to_thread(self._storage.catalog.latest_named, job)
        if hint is not None and step >= hint:
            return
        order = await asyncio.to_thread(self._storage.catalog.commit_order, job)
        above = passed_over(order, step)
        if above:
            shown = ", ".join(map(str, above[:16])) + (", ..." if len(above) > 16 else "")
            log.warning(
                "job %s saves step %s below its newest committed step %s: a rollback. It passes over steps %s, which stay on disk "
                "but are no longer the newest (`ckptd ls` marks the rollback)", job, step, order[-1], shown,
            )
