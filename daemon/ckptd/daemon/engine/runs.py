"""Which run may save into a job: runs, their liveness on this daemon, and the job's owner.

A run is one start of a training program; its ranks agree on a run id (client/ckptd/client/
run_id.py) and send it with every request. Each client attaches to its daemon while it lives
(`Attach`, a call that stays open: the daemon sees it end at once when the process exits, and
`Detach` ends it when the client closes). A run is *live* on a daemon while one of its clients is
attached there.

The daemon records each job's *owner*: the run whose save it accepted last. Node 0 decides for
every node (`claim`, from cluster.Coordinator when it plans a save); the other daemons only
refuse early what node 0 would refuse (`check`). The rules:

- the owner saves;
- a run that *resumed* (it loaded a step of the job before its first save) takes the job over
  at its first save: crash-and-resume is never refused, however late the daemon learns that the
  crashed run is gone. The former owner is *superseded*: its later saves are refused while the
  job's owner is live; once the owner has ended, a superseded run id that resumed is a new start
  under the same id (a launcher that derives it again: torchrun's restart count starts at 0 in a
  new pod with the same --rdzv-id and master address) and takes the job over;
- any other run is refused while the owner is live on some node, with a message that names the
  job and what to do (a new job name, or load first to resume);
- once the owner has ended (no client attached on any node), the next run that saves becomes
  the owner.

A run id "" (a client older than run ids) is not told apart: no rule applies to it. Runs on the
event loop; the Attach and Detach RPCs call `attach`/`detach`. Pure apart from asyncio events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ckptd.daemon.errors import RunRefused

log = logging.getLogger(__name__)

SUPERSEDED_KEPT = 64  # superseded runs remembered per job (each is refused if it saves again)


@dataclass(frozen=True)
class RunClaim:
    """The run of a save's ranks, as node 0 weighs it: its id ("" not told apart) and whether it
    resumed (loaded a step of the job before its first save)."""

    run: str = ""
    resumed: bool = False


NO_CLAIM = RunClaim()


@dataclass(frozen=True)
class Client:
    """One attached client: a rank of a run, in a process of a host."""

    run: str
    rank: int
    pid: int
    host: str
    since: float  # unix seconds
    ended: asyncio.Event = field(default_factory=asyncio.Event, compare=False)  # set by detach: the Attach call returns


@dataclass
class JobRuns:
    """A job's runs on this daemon."""

    owner: str = ""  # the run whose save was accepted last ("" none yet)
    superseded: dict[str, str] = field(default_factory=dict)  # run -> the run that took the job over from it
    clients: dict[str, Client] = field(default_factory=dict)  # client id -> attached client


def short(run: str) -> str:
    """A run id as messages show it (a random id's first 12 characters)."""
    return run if len(run) <= 16 else run[:12]


class Runs:
    """The runs of every job on this daemon: attached clients, owners, superseded runs."""

    def __init__(self) -> None:
        self._jobs: dict[str, JobRuns] = {}

    def _job(self, job: str) -> JobRuns:
        runs = self._jobs.get(job)
        if runs is None:
            runs = self._jobs[job] = JobRuns()
        return runs

    # ------------------------------------------------------------ liveness

    def attach(self, job: str, client_id: str, client: Client) -> asyncio.Event:
        """Record an attached client; returns the event that `detach` sets (the Attach call
        waits on it). A client attaching again under its id replaces its earlier attachment."""
        runs = self._job(job)
        earlier = runs.clients.pop(client_id, None)
        if earlier is not None:
            earlier.ended.set()
        runs.clients[client_id] = client
        return client.ended

    def detach(self, job: str, client_id: str, only: Client | None = None) -> Client | None:
        """Forget an attached client (Detach, or its Attach call ended; `only`: just that
        attachment, not a later one under the same id); returns it (None: it was not attached)."""
        runs = self._jobs.get(job)
        client = runs.clients.get(client_id) if runs is not None else None
        if runs is None or client is None or (only is not None and client is not only):
            return None
        del runs.clients[client_id]
        client.ended.set()
        return client

    def end_all(self) -> None:
        """The daemon is shutting down: every Attach call returns."""
        for runs in self._jobs.values():
            for client in runs.clients.values():
                client.ended.set()

    def live(self, job: str, run: str) -> bool:
        """Whether a client of `run` is attached to this daemon."""
        runs = self._jobs.get(job)
        return runs is not None and any(c.run == run for c in runs.clients.values())

    def owner(self, job: str) -> str:
        runs = self._jobs.get(job)
        return runs.owner if runs is not None else ""

    # ------------------------------------------------------------ the rules

    def check(self, job: str, run: str, resumed: bool) -> None:
        """Refuse (RunRefused) a save of `run` that node 0 would refuse, from what this daemon
        knows: `run` was superseded and did not resume or the owner is live here, or another run
        owns the job, is live here, and `run` did not resume."""
        runs = self._jobs.get(job)
        if not run or runs is None:
            return
        owner = runs.owner
        if run in runs.superseded and (not resumed or (bool(owner) and self.live(job, owner))):
            raise RunRefused(superseded_message(job, run, runs.superseded[run]))
        if owner and owner != run and not resumed and self.live(job, owner):
            raise RunRefused(live_owner_message(job, run, owner, self.describe(job, owner)))

    def end_reason(self, job: str, other: str, run: str, resumed: bool, other_live: bool) -> str:
        """`run` starts a save of `job` while `other`'s save of it is still open: the reason to
        end that save (`run` resumed and takes the job over, or `other` is no longer live).
        Raises RunRefused while `other` is live and `run` started afresh. other_live: whether a
        client of `other` is attached (here, or on any node for node 0's decision)."""
        if not resumed and other_live:
            raise RunRefused(live_owner_message(job, run, other, self.describe(job, other)))
        why = "resumed the job" if resumed else f"began it after run {short(other)} ended"
        return f"run {short(run)} {why}"

    def claim(self, job: str, run: str, resumed: bool, owner_live: bool) -> str:
        """Node 0: `run` saves into `job` (the rules above). owner_live: whether the current owner
        (another run) has a client attached on some node. Returns
        the former owner when `run` took the job over from it ("" otherwise); raises RunRefused."""
        if not run:
            return ""
        runs = self._job(job)
        owner = runs.owner
        if run in runs.superseded:
            if not resumed or owner_live:
                raise RunRefused(superseded_message(job, run, runs.superseded[run]))
            del runs.superseded[run]  # a new start under the same id, after the owner ended: a resume like any other
        if owner == run:
            return ""
        if owner and not resumed and owner_live:
            raise RunRefused(live_owner_message(job, run, owner, self.describe(job, owner)))
        runs.owner = run
        if not owner:
            return ""
        runs.superseded[owner] = run
        while len(runs.superseded) > SUPERSEDED_KEPT:
            del runs.superseded[next(iter(runs.superseded))]
        if resumed and owner_live:
            log.warning("job %s: run %s resumed the job and takes it over from run %s, which is still live: that run's saves are "
                        "refused from now on", job, short(run), short(owner))
        else:
            log.info("job %s: run %s takes the job over from run %s (%s)", job, short(run), short(owner), "resumed" if resumed else "ended")
        return owner

    def accepted(self, job: str, run: str) -> None:
        """A member: node 0 accepted a save of `run` (it owns the job now)."""
        if run:
            runs = self._job(job)
            runs.owner = run
            runs.superseded.pop(run, None)

    # ------------------------------------------------------------ reports

    def describe(self, job: str, run: str) -> str:
        """Where `run`'s clients are attached on this daemon, for messages ("" when none)."""
        runs = self._jobs.get(job)
        clients = [c for c in runs.clients.values() if c.run == run] if runs is not None else []
        if not clients:
            return ""
        ranks = sorted({c.rank for c in clients})
        first = min(clients, key=lambda c: c.since)
        shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
        return f"rank{'s' if len(ranks) > 1 else ''} {shown} attached to this daemon, pid {first.pid} on {first.host or '?'}, for {_age(first.since)}"


def live_owner_message(job: str, run: str, owner: str, where: str) -> str:
    place = f" ({where})" if where else " (attached to another node's daemon)"
    return (
        f"job {job!r} belongs to another run that is still live: run {short(owner)}{place}; this run ({short(run)}) "
        "may not save into it, so that the job's steps stay one run's. Give this run a new job name "
        "(CheckpointClient(job=...)), or load the job's newest step before the first save to resume it "
        "(a resumed run takes the job over), or stop the other run"
    )


def superseded_message(job: str, run: str, by: str) -> str:
    return (
        f"run {short(run)} no longer owns job {job!r}: run {short(by)} took the job over (it resumed the job, or this run "
        "had ended), and this run's saves are refused so that the job's steps stay one run's; stop this run, or start it "
        "again and load the newest step to resume"
    )


def _age(since: float) -> str:
    seconds = max(0.0, time.time() - since)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
