"""Retention: which committed steps of a job to delete. Pure: no I/O, no clock.

A step is kept when any rule keeps it; every other committed step is deleted. The rules:

- the newest committed step, always (`latest` points at it);
- protected steps (being read by a load, or just committed), always;
- the `keep_last` newest committed steps (0 = keep all, no step is deleted);
- steps divisible by `keep_every` (0 = off), forever;
- the `keep_best` steps with the best metric (the `metric` given to save), lower is better
  with `best_mode="min"` (a loss), higher with "max" (an accuracy); 0 = off. Steps saved
  without a metric never count as best; ties go to the newer step.

A job may ask for its own retention (`JobRetention`, sent with every save: the Trainer's
`save_total_limit`, keep-best for `load_best_model_at_end`); `merge` applies it within the
daemon's policy, which stays every job's default and its upper bound (docs/operations.md, "Retention").

"Newest" is commit order, not step number (docs/architecture.md §9): a job that rolled back (loaded step
10 after saving 30) and saved step 15 has 15 as its newest step, so `keep_last` counts the
most recently committed steps. The caller passes the steps in the order they were committed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ckptd.common.retention import BEST_MODES, JobRetention

__all__ = ["BEST_MODES", "DEFAULT_JOB_POLICY", "JobPolicy", "JobRetention", "RetentionPolicy", "merge", "policy_of_record", "policy_record"]



@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep of a job's committed steps.

    keep_last: the number of most recently committed steps to keep; 0 keeps all.
    keep_every: also keep, forever, every step divisible by this; 0 turns the rule off.
    keep_best: also keep the steps with the `keep_best` best metrics; 0 turns the rule off.
    best_mode: "min" (lower metric is better) or "max" (higher is better).
    """

    keep_last: int = 3
    keep_every: int = 0
    keep_best: int = 0
    best_mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RetentionPolicy.{name}={value!r}: expected an integer >= 0 (0 = off)")
        if self.best_mode not in BEST_MODES:
            raise ValueError(f"RetentionPolicy.best_mode={self.best_mode!r}: expected 'min' (lower is better) or 'max' (higher is better)")

    @property
    def keeps_all(self) -> bool:
        """True when the policy never deletes anything."""
        return self.keep_last == 0

    def to_delete(
        self, committed_steps: Iterable[int], protected: Iterable[int] = (), metrics: Mapping[int, float] | None = None
    ) -> list[int]:
        """The committed steps to delete, ascending.

        committed_steps: the job's committed steps in commit order, oldest first: the last one
            is the newest, whatever its number (a rolled-back job commits lower numbers later).
            A step listed twice is refused.
        protected: steps that must survive whatever the rules say (being loaded, just
            committed); steps here that are not committed are ignored.
        metrics: step -> the metric it was saved with; steps without one (or with a NaN) are
            never among the best. Entries for steps that are not committed are ignored.
        Never returns the newest committed step nor a protected one.
        """
        steps = _commit_order(committed_steps)
        if not steps or self.keeps_all:
            return []
        keep = set(protected)
        keep.update(steps[-self.keep_last :])  # includes the newest, since keep_last >= 1 here
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        keep.update(self.best(steps, metrics or {}))
        return sorted(s for s in steps if s not in keep)

    def best(self, committed_steps: Iterable[int], metrics: Mapping[int, float]) -> list[int]:
        """The steps the keep-best rule keeps, best first (empty when the rule is off).
        committed_steps in commit order, oldest first, as for to_delete."""
        if not self.keep_best:
            return []
        order = {s: i for i, s in enumerate(committed_steps)}  # a step listed twice: its last place
        scored = [(float(metrics[s]), s) for s in order if s in metrics and not math.isnan(float(metrics[s]))]
        sign = 1.0 if self.best_mode == "min" else -1.0
        scored.sort(key=lambda ms: (sign * ms[0], -order[ms[1]]))  # best metric first; ties: the newer step
        return [s for _, s in scored[: self.keep_best]]

    def reasons(self, step: int, committed_steps: Iterable[int], protected: Iterable[int] = (), metrics: Mapping[int, float] | None = None) -> list[str]:
        """Why `step` is kept (empty: it would be deleted), for `ckptd ls` and `ckptd gc`.
        committed_steps in commit order, oldest first, as for to_delete."""
        steps = _commit_order(committed_steps)
        if step not in steps:
            return []
        why = []
        if step == steps[-1]:
            why.append("newest")
        if step in set(protected):
            why.append("being loaded")
        if self.keeps_all:
            why.append("keep_last=0 keeps all")
        elif step in steps[-self.keep_last :]:
            why.append(f"last {self.keep_last}")
        if self.keep_every and step % self.keep_every == 0:
            why.append(f"every {self.keep_every}")
        if step in self.best(steps, metrics or {}):
            why.append(f"best {self.keep_best} ({self.best_mode})")
        return why


def merge(daemon: RetentionPolicy, job: JobRetention | None) -> RetentionPolicy:
    """The policy a job's steps are kept by: the daemon's, changed by what the job asks within it.

    The daemon's policy is every job's default and its upper bound, so that a job never holds
    more than the daemon's operator allows:
    - keep_last: the job's, at most the daemon's (a daemon that keeps all, keep_last 0, bounds
      nothing; a job asking to keep all gets the daemon's);
    - keep_best and best_mode: the job's, keep_best at most the resulting keep_last (unless that
      keeps all): the best steps add at most as many steps as the recent ones;
    - keep_every: the daemon's.
    """
    if job is None:
        return daemon
    keep_last = daemon.keep_last
    if job.keep_last is not None and job.keep_last > 0:
        keep_last = job.keep_last if daemon.keep_last == 0 else min(job.keep_last, daemon.keep_last)
    keep_best, best_mode = daemon.keep_best, daemon.best_mode
    if job.keep_best is not None:
        keep_best = job.keep_best if keep_last == 0 else min(job.keep_best, keep_last)
        best_mode = job.best_mode or daemon.best_mode
    elif job.best_mode is not None:
        best_mode = job.best_mode
    return RetentionPolicy(keep_last=keep_last, keep_every=daemon.keep_every, keep_best=keep_best, best_mode=best_mode)


JobPolicy = Callable[[JobRetention], RetentionPolicy]  # a job's request -> its policy (merged into the daemon's flags)


def DEFAULT_JOB_POLICY(job: JobRetention) -> RetentionPolicy:  # noqa: N802 (a constant's role: the default of a seam)
    """merge into the default RetentionPolicy (a coordinator made without the daemon's flags: tests)."""
    return merge(RetentionPolicy(), job)


def policy_record(policy: RetentionPolicy, asked: JobRetention) -> dict[str, object]:
    """A job's merged policy as the index records it ("retention"), with what the job asked."""
    return {"keep_last": policy.keep_last, "keep_every": policy.keep_every, "keep_best": policy.keep_best, "best_mode": policy.best_mode,
            "asked": {k: v for k, v in (("keep_last", asked.keep_last), ("keep_best", asked.keep_best), ("best_mode", asked.best_mode)) if v is not None}}


def policy_of_record(record: Mapping[str, object]) -> RetentionPolicy:
    """The policy an index's "retention" record holds (ValueError when it is not one)."""
    values = {k: record.get(k) for k in ("keep_last", "keep_every", "keep_best", "best_mode")}
    return RetentionPolicy(**values)  # type: ignore[arg-type]  # RetentionPolicy checks each value


def _commit_order(committed_steps: Iterable[int]) -> list[int]:
    """The steps as a list in the order given (commit order), each checked: an integer >= 0,
    listed once."""
    steps = list(committed_steps)
    for step in steps:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"committed step {step!r}: expected an integer >= 0")
    if len(set(steps)) != len(steps):
        twice = sorted({s for s in steps if steps.count(s) > 1})
        raise ValueError(f"committed steps {twice} are listed more than once: expected each committed step once, in commit order")
    return steps
