"""What `save` returns: how long the trainer was stalled, and a way to wait until durable."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from ckptd.client._handoff.modes import CPU
from ckptd.client._rpc import DurableInfo
from ckptd.client.errors import ABORTED, CheckpointError

if TYPE_CHECKING:
    from ckptd.client._handoff.base import Pending

WaitDurable = Callable[[int, "float | None"], DurableInfo]  # (step, timeout s) -> where the committed step is; raises CheckpointError

log = logging.getLogger("ckptd.client")


class SaveHandle:
    """The result of one `save`. `ok` is False when the hand-off failed or was skipped, and,
    once `wait_durable()` has heard it from the daemon, when the step failed after the hand-off
    (a full disk, an I/O error, a rank that never came); `error` then says why.

    `kept` (a message, else None): the step was committed already and this run resumed from it
    or from a step before it (it redid that interval); the daemon keeps the committed step, the
    save is ok and `wait_durable()` returns it.

    In modes "overlap" and "ipc" (CUDA tensors) the device copies may still be running when
    `save` returns: `snapshot_done` says whether the snapshot is handed over (copied and
    committed to the daemon); `wait_snapshot()` fences; `wait_durable()` waits for both. In the
    CPU path and in mode "copy" the bytes are copied when `save` returns and only the commit
    may still be on its way (a helper thread sends it: the caller never waits for the daemon).

    wait_durable: the client's wait for a committed step (ckptd.client._rpc.DaemonRpc.wait_durable);
    on_error: the client's ("warn" or "raise"), for `wait_durable()`.
    """

    def __init__(
        self,
        wait_durable: WaitDurable,
        on_error: str,
        step: int,
        stall_s: float,
        *,
        bytes_copied: int = 0,
        skipped: bool = False,
        error: str | None = None,
        pending: "Pending | None" = None,
        mode: str = CPU,
        copy_s: float | None = None,
        kept: str | None = None,
    ) -> None:
        self._wait_durable = wait_durable
        self._on_error = on_error
        self.step = step
        self.stall_s = stall_s  # seconds save() blocked the caller
        self.bytes_copied = bytes_copied  # bytes this rank copied into shared memory
        self.skipped = skipped
        self._error = error
        self._pending = pending
        self.mode = mode  # "cpu" (no CUDA tensors), "copy", "overlap" or "ipc"
        self.copy_s = copy_s  # mode "copy": seconds from queueing the device copies until they were done
        self.kept = kept  # the step was committed already and a resumed run redid it: why (the save is ok), else None
        self.durable: DurableInfo | None = None  # set once wait_durable() heard the step committed

    @property
    def error(self) -> str | None:
        """Why the save failed: at the hand-off, or (overlap, ipc) later, while copying or committing."""
        if self._error is None and self._pending is not None and self._pending.future.done():
            exc = self._pending.future.exception()
            if exc is not None:
                self._error = f"{type(exc).__name__}: {exc}"
        return self._error

    @property
    def ok(self) -> bool:
        """No failure is known (the step may still fail, or its outcome be unknown: a wait that
        timed out, a daemon that went away); `durable` says whether it is committed."""
        return self.error is None

    @property
    def snapshot_done(self) -> bool:
        """The snapshot is copied and committed to the daemon (in the CPU path and mode "copy",
        whose bytes are copied when save() returns, once the helper thread's commit is through)."""
        return self._pending is None or self._pending.future.done()

    def wait_snapshot(self, host: bool = False) -> None:
        """Fence: later changes of the saved state wait for this save's device copies.

        GPU-side by default (the current CUDA stream waits on the copy-done event; the host goes
        on); host=True blocks until the snapshot is copied and committed. Call it before the
        state changes other than by an optimizer of the state (those fence themselves). The
        fence is a no-op for CPU hand-offs, whose bytes are copied when save() returns.
        """
        pending = self._pending
        if pending is None or pending.future.done():
            return
        if host:
            pending.future.exception()  # waits; an error shows in `error`
            return
        for copy in pending.copies:
            copy.fence()

    def wait_durable(self, timeout: float | None = None) -> DurableInfo | None:
        """Block until the step is committed (fsynced, index written) and return where it is.

        A failed or skipped save raises CheckpointError with on_error="raise"; with "warn" it is
        logged and None is returned, so training goes on. The answer is kept in `durable`: None
        until the daemon said the step is committed (a wait that timed out or lost the daemon
        leaves `ok` True, the outcome unknown, and `durable` None).
        """
        try:
            if self._pending is not None:
                self._pending.future.exception()  # the hand-off first
            if self.error is not None:
                raise CheckpointError(f"step {self.step} was not handed over: {self.error}")
            self.durable = self._wait_durable(self.step, timeout)
            return self.durable
        except CheckpointError as exc:
            if exc.code == ABORTED and self._error is None:  # the daemon failed the step: not a wait that timed out, nor a daemon away
                self._error = str(exc)
            if self._on_error == "raise":
                raise
            log.warning("checkpoint of step %s is not durable: %s", self.step, exc)
            return None

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "failed" if self.error else "kept" if self.kept else "handed over" if self.snapshot_done else "copying"
        return f"SaveHandle(step={self.step}, {state}, stall={self.stall_s * 1e3:.1f} ms)"
