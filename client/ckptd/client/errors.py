"""Errors the client raises. The message always says what went wrong and what to do."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A save or load failed. `code` is the gRPC status name when the daemon answered."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class CheckpointNotFound(CheckpointError):
    """The requested step (or any committed step) does not exist."""


class DaemonUnavailable(CheckpointError):
    """No daemon answers at the address (not running, wrong CKPTD_ADDRESS, or shutting down)."""
