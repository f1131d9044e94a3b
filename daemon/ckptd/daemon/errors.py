"""Domain errors of the daemon. Each maps to one gRPC status code, in one place (rpc/errors.py)."""

from __future__ import annotations

from ckptd.wire import RUN_REFUSED, UNKNOWN_FINGERPRINT


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
