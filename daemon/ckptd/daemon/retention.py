"""Retention: which committed steps of a job to delete. Pure: no I/O, no clock.

A step is kept when any rule keeps it; every other committed step is deleted. The rules:

- the newest committed step, always (`latest` points at it);
- protected steps (being read by a load), always;
- the `keep_last` newest committed steps (0 = keep all, no step is deleted);
- steps divisible by `keep_every` (0 = off), forever.

Keep-best-by-metric will be one more rule that adds steps to the kept set; it needs each
step's metric, so it will take a mapping step -> metric next to `committed_steps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep of a job's committed steps.

    keep_last: the number of newest committed steps to keep; 0 keeps all.
    keep_every: also keep, forever, every step divisible by this; 0 turns the rule off.
    """

    keep_last: int = 3
    keep_every: int = 0

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RetentionPolicy.{name}={value!r}: expected an integer >= 0 (0 = off)")

    @property
    def keeps_all(self) -> bool:
        """True when the policy never deletes anything."""
        return self.keep_last == 0

    def to_delete(self, committed_steps: Iterable[int], protected: Iterable[int] = ()) -> list[int]:
        """The committed steps to delete, ascending.

        committed_steps: the job's committed steps, in any order (duplicates are ignored).
        protected: steps that must survive whatever the rules say (e.g. being loaded);
            steps here that are not committed are ignored.
        Never returns the newest committed step nor a protected one.
        """
        unique = set(committed_steps)
        for step in unique:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"committed step {step!r}: expected an integer >= 0")
        steps = sorted(unique)
        if not steps or self.keeps_all:
            return []
        keep = set(protected)
        keep.update(steps[-self.keep_last :])  # includes the newest, since keep_last >= 1 here
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        return [s for s in steps if s not in keep]
