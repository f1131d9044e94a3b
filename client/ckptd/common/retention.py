"""A job's own retention request (issue 31 item 7): what a client asks the daemon to keep of its
job's committed steps, sent with every save. Shared by the client, which sends it, and the
daemon, which merges it into its own policy (the daemon's retention module: its flags stay the
default and the upper bound) and records the result in each step's index."""

from __future__ import annotations

from dataclasses import dataclass

BEST_MODES = ("min", "max")
MAX_COUNT = (1 << 31) - 1  # fits the wire's uint32


@dataclass(frozen=True)
class JobRetention:
    """The retention a job asks for; None: the daemon's setting.

    keep_last: keep the job's N newest committed steps (0: keep all). keep_best: also keep the
    N steps with the best metric (0: off), lower is better with best_mode "min", higher with
    "max" (None: the daemon's --best-mode).
    """

    keep_last: int | None = None
    keep_best: int | None = None
    best_mode: str | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT):
                raise ValueError(f"retention {name}={value!r}: expected an integer >= 0 (keep_last 0 = keep all, keep_best 0 = off), or unset")
        if self.best_mode is not None and self.best_mode not in BEST_MODES:
            raise ValueError(f"retention best_mode={self.best_mode!r}: expected 'min' (lower is better) or 'max' (higher is better), or unset")


def check_job_retention(value: object) -> JobRetention | None:
    """`value` when it is a JobRetention or None, else TypeError saying what to pass."""
    if value is not None and not isinstance(value, JobRetention):
        raise TypeError(f"retention={value!r}: pass ckptd.client.JobRetention(keep_last=..., keep_best=..., best_mode=...), or None")
    return value


def check_metric(value: object) -> float | None:
    """A save's metric (what keep_best ranks steps by) as a float: a real number, a NumPy
    scalar or a one-element tensor (the loss as it is); None stays None. TypeError or
    ValueError, naming `metric` and saying what to pass, for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__float__") or getattr(value, "is_complex", lambda: False)():  # a complex tensor has __float__
        raise TypeError(f"metric={value!r}: pass a number (a float, or a one-element tensor such as the loss), or None")
    try:
        return float(value)  # type: ignore[arg-type]
    except (OverflowError, RuntimeError, TypeError, ValueError) as exc:  # a huge int; a tensor of several elements
        raise ValueError(f"metric={value!r} is not one float ({exc}): pass a number, or a one-element tensor, or None") from None
