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
from ckptd.daemon.errors import RunRefused
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
        the job's newest committed step is a rollback, logged with the steps it passes over; a
        run that loaded no step may not begin one while another run owns the job (RunRefused): a
        new run under a used job name would otherwise push the job's steps out by retention. The
        owner is this daemon's to know: after it restarted, the first run to save owns the job."""
        newest, above = await self._passed_over(job, step)
        owner = self.runs.owner(job)  # "" after this daemon restarted: then any run may roll back, as before
        if above and claim.run and not claim.resumed and owner and owner != claim.run:
            raise RunRefused(
                f"job {job!r} holds steps {_shown(above)} above step {step} (newest: {newest}) and this run loaded none of them before "
                "saving below them (a new run under a used job name?): nothing was saved, so that retention does not push the job's "
                "steps out. Give this run a new job name, load the job's newest step first (load() without a step) to resume "
                "it, or load an older step to roll back to it deliberately (a step loaded another way, such as DCP's "
                "reader: client.mark_resumed(step) before the first save)"
            )
        displaced = ""
        if claim.run:
            owner_live = bool(owner) and owner != claim.run and await self.live(job, owner)
            displaced = self.runs.claim(job, claim.run, claim.resumed, owner_live)
        if above:
            log.warning(
                "job %s saves step %s below its newest committed step %s: a rollback. It passes over steps %s, which stay on disk "
                "but are no longer the newest (`ckptd ls` marks the rollback)", job, step, newest, _shown(above),
            )
        return displaced

    async def _passed_over(self, job: str, step: int) -> tuple[int | None, list[int]]:
        """The job's newest committed step and the committed steps above `step` that a save of
        it passes over (rollback.passed_over: none when it is not below the newest).
        The job's `latest` (one small read) rules out the usual case, a save above it, without
        listing every committed step on each save; only a save below it lists them."""
        hint = await asyncio.to_thread(self._storage.catalog.latest_named, job)
        if hint is not None and step >= hint:
            return hint, []
        order = await asyncio.to_thread(self._storage.catalog.commit_order, job)
        return (order[-1] if order else None), passed_over(order, step)


def _shown(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:16])) + (", ..." if len(steps) > 16 else "")
