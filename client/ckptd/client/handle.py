"""What `save` returns: how long the trainer was stalled, and a way to wait until durable."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptd.client.errors import CheckpointError

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient

log = logging.getLogger("ckptd.client")


@dataclass(frozen=True)
class DurableInfo:
    """A committed checkpoint: on disk, fsynced, visible to loads."""

    step: int
    step_dir: str
    bytes_written: int


class SaveHandle:
    """The result of one `save`. `ok` is False when the hand-off failed or was skipped."""

    def __init__(
        self,
        client: "CheckpointClient",
        step: int,
        stall_s: float,
        *,
        bytes_copied: int = 0,
        skipped: bool = False,
        error: str | None = None,
    ) -> None:
        self._client = client
        self.step = step
        self.stall_s = stall_s  # seconds save() blocked the caller
        self.bytes_copied = bytes_copied  # bytes this rank copied into shared memory
        self.skipped = skipped
        self.error = error

    @property
    def ok(self) -> bool:
        return self.error is None

    def wait_snapshot(self) -> None:
        """Return once the state may be modified. CPU hand-offs are complete when save() returns."""

    def wait_durable(self, timeout: float | None = None) -> DurableInfo | None:
        """Block until the step is committed (fsynced, index written) and return where it is.

        A failed or skipped save raises CheckpointError with on_error="raise"; with "warn" it is
        logged and None is returned, so training goes on.
        """
        try:
            if self.error is not None:
                raise CheckpointError(f"step {self.step} was not handed over: {self.error}")
            return self._client._wait_durable(self.step, timeout)
        except CheckpointError as exc:
            if self._client.on_error == "raise":
                raise
            log.warning("checkpoint of step %s is not durable: %s", self.step, exc)
            return None

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "failed" if self.error else "handed over"
        return f"SaveHandle(step={self.step}, {state}, stall={self.stall_s * 1e3:.1f} ms)"
