"""Errors the client raises. The message always says what went wrong and what to do."""

from __future__ import annotations


ABORTED = "ABORTED"  # CheckpointError.code of a save the daemon failed or skipped after the hand-off


class CheckpointError(RuntimeError):
    """A save or load failed. `code` is the gRPC status name when the daemon answered."""

    def __init__(self, message: str, code: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason  # the daemon's machine-readable reason, e.g. "unknown-fingerprint" ("" for none)


class CheckpointNotFound(CheckpointError):
    """The requested step (or any committed step) does not exist."""


class DaemonUnavailable(CheckpointError):
    """No daemon answers at the address (not running, wrong CKPTD_ADDRESS, or shutting down)."""


class InvalidState(CheckpointError, ValueError):
    """The daemon refused what the caller passed to `save` (INVALID_ARGUMENT: bad tensor names,
    shapes that do not tile, options the ranks disagree on), or a strict `load` found keys of
    the state that the step has no value for (before anything was loaded). Like the
    ValueError/TypeError that `save` raises before asking the daemon, a caller error: retrying
    cannot help, so `save` raises it whatever `on_error` says; the message says how to fix the state."""


class LayoutError(ValueError):
    """A tensor whose layout cannot be described or does not fit its rule; says which and how to fix it."""
