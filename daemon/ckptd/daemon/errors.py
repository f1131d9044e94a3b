"""Domain errors of the daemon. Each maps to one gRPC status code, in one place (rpc/errors.py)."""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import Sequence

from ckptd.wire import RUN_REFUSED, UNKNOWN_FINGERPRINT

MESSAGE_BYTES = 4096  # an error message's most bytes on the wire (abort_with): gRPC refuses metadata over 8 KiB at random, over 16 KiB always


def listed(values: Sequence[int], limit: int = 16) -> str:
    """Numbers (ranks, nodes) as a message shows them: the first `limit`, and how many in all,
    so that a job of 10,000 ranks gets a message, not a transport error."""
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}, ... {len(values)} in all]" if len(values) > limit else f"[{shown}]"


def bounded(message: str, limit: int = MESSAGE_BYTES) -> str:
    """`message` cut, saying so, to take at most `limit` bytes on the wire: gRPC sends it
    percent-encoded, 3 bytes for each byte of its UTF-8 outside printable ASCII. Whole
    characters only."""
    raw = message.encode()
    wire = list(accumulate(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in raw))
    if not wire or wire[-1] <= limit:
        return message
    kept = raw[: bisect_right(wire, limit - 64)].decode(errors="ignore")  # 64: room for the note
    return f"{kept} ... ({len(raw) - len(kept.encode())} more bytes cut)"


class CkptdError(Exception):
    """Base of the errors a request can meet; the message says what was wrong and how to fix it."""


class InvalidRequest(CkptdError):
    """Bad names, shapes, dtypes, boxes or values (INVALID_ARGUMENT)."""


class NotFound(CkptdError):
    """Unknown job, step or save (NOT_FOUND)."""


class AlreadyExists(CkptdError):
    """The step is already committed (ALREADY_EXISTS)."""


class Precondition(CkptdError):
    """The request does not fit the current state, e.g. an unknown fingerprint (FAILED_PRECONDITION)."""


class UnknownFingerprint(Precondition):
    """A request named its tensors by a fingerprint this daemon does not know (it restarted, or
    forgot it): the caller resends the request with the tensor metadata. Carries `reason`, which
    the wire sends beside the status (rpc_errors.REASON_KEY), so callers act on it, not on the text."""

    reason = UNKNOWN_FINGERPRINT

    def __init__(self, message: str = "unknown fingerprint: send the tensor metadata with this request") -> None:
        super().__init__(message)


class RunRefused(Precondition):
    """A run may not save into the job now (engine/runs.py): another live run owns it, or this
    run was superseded. Carries `reason` (rpc_errors.REASON_KEY), so that node 0's refusal reaches
    the ranks of every node as this error, not as an aborted save."""

    reason = RUN_REFUSED


class Exhausted(CkptdError):
    """Out of arena memory or disk (RESOURCE_EXHAUSTED)."""


class NoSpace(Exhausted):
    """A step's files would not fit in the storage root's free space (less the disk reserve);
    raised before any file of the step is created (RESOURCE_EXHAUSTED)."""


class Aborted(CkptdError):
    """The save was aborted (a rank failed, timed out or moved on) (ABORTED)."""


class Unavailable(CkptdError):
    """The daemon is draining or a peer is down (UNAVAILABLE)."""


class Timeout(CkptdError):
    """A wait ran past its limit (DEADLINE_EXCEEDED)."""


class Unauthenticated(CkptdError):
    """A daemon-to-daemon call without the right peer token (UNAUTHENTICATED)."""
