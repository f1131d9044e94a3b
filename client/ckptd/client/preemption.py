"""Preemption: on SIGTERM, save at the next step boundary, wait until durable within a grace
period, exit.

Schedulers stop a job with a signal and kill it a while later: Kubernetes sends SIGTERM, then
SIGKILL after the pod's `terminationGracePeriodSeconds` (30 s by default); Slurm sends SIGTERM
(or the signal of `--signal`) and SIGKILL after the partition's `GraceTime`/`KillWait`;
torchrun forwards the SIGTERM it gets to its workers and kills them after `--shutdown-timeout`
(30 s by default). The pattern, on every rank:

    with Preemption(ckpt, grace_s=25) as preemption:
        for step in range(start + 1, total_steps + 1):
            train_step()
            if preemption.requested():                 # collective: every rank, same boundary
                preemption.save_and_exit(step, state)  # save, wait durable, exit

The signal handler only records the signal (one attribute assignment: no lock, no call into the
daemon); the loop acts on it at a step boundary, where the state is consistent. `requested()`
makes the ranks agree (one all-reduce of one integer when torch.distributed is initialized), so
every rank saves the same step even when the signal reaches them at different steps. Nothing
here runs at import.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Mapping, NoReturn, Sequence

import torch

from ckptd.client.collectives import collective_device
from ckptd.client.errors import CheckpointError
from ckptd.client._rpc import DurableInfo

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient

log = logging.getLogger("ckptd.client")

NOT_DURABLE_EXIT = 1  # save_and_exit's exit status when the step is not durable in time


@dataclass(frozen=True)
class PreemptionSave:
    """What `Preemption.save` achieved. durable: where the step is (None: not durable within
    the grace period); reason: why not ("" when durable); elapsed_s: seconds the save and the
    wait took; finished: False when the grace period ran out while the save was still talking to
    the daemon (its thread is left behind: exit)."""

    step: int
    durable: DurableInfo | None
    reason: str
    elapsed_s: float
    finished: bool = True

    @property
    def ok(self) -> bool:
        """The step is durable."""
        return self.durable is not None


class Preemption:
    """Saves a checkpoint when the job is told to stop (SIGTERM), within the grace period.

    client: the rank's CheckpointClient. grace_s: seconds from the signal's arrival until the
    step must be durable; keep it below what the platform allows (Kubernetes'
    terminationGracePeriodSeconds, Slurm's GraceTime or the lead time of `--signal`, torchrun's
    `--shutdown-timeout`) minus the time a step of training takes. signals: the signals that
    request the save (None: SIGTERM). group: the process group the ranks agree over (default:
    torch.distributed's default group, when initialized). With NCCL, a gloo group
    (`dist.new_group(backend="gloo")`) keeps `requested()` off the GPU: on an NCCL group its
    all-reduce and `.item()` wait for the GPU's queued work.

    Use it as a context manager (or `install()`/`uninstall()`) in the main thread: Python runs
    signal handlers only there. The handlers it replaces are restored on exit.
    """

    def __init__(
        self,
        client: "CheckpointClient",
        *,
        grace_s: float = 25.0,
        signals: Sequence[int] | None = None,
        group: Any = None,
    ) -> None:
        if not isinstance(grace_s, (int, float)) or isinstance(grace_s, bool) or not grace_s > 0:
            raise ValueError(f"grace_s={grace_s!r}: give the seconds the platform allows after its signal (a number > 0)")
        if signals is None:
            signals = (signal.SIGTERM,)
        if not signals:
            raise ValueError("signals is empty: name the signals that request a save, e.g. (signal.SIGTERM,)")
        self.client = client
        self.grace_s = float(grace_s)
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.group = group
        self._previous: dict[signal.Signals, Any] = {}
        # (signal number, time.monotonic() at arrival): set once by the handler, in one assignment
        self._received: tuple[int, float] | None = None
        self._agreed = False

    # ------------------------------------------------------------ the signal

    def install(self) -> None:
        """Install the handlers (the main thread only: Python runs signal handlers there)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Preemption must be installed in the main thread: Python delivers signals to its handlers only there")
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Restore the handlers that `install` replaced."""
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, handler)

    def __enter__(self) -> "Preemption":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._received is None:  # the first signal starts the grace period
            self._received = (signum, time.monotonic())

    @property
    def received(self) -> int | None:
        """The signal this process received (None: none yet). Local: no collective."""
        received = self._received
        return received[0] if received is not None else None

    def requested(self) -> bool:
        """Whether any rank received a signal: True on every rank at once, so all save the same step.

        Collective when torch.distributed is initialized with more than one rank (one all-reduce
        of one integer): call it on every rank at the same step boundary (each step, or each
        N-th step when a step is short against the grace period). Once True it stays True.
        """
        if self._agreed:
            return True
        agreed = self._received is not None
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            flag = torch.tensor([int(agreed)], dtype=torch.int32, device=collective_device(self.group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            agreed = bool(flag.item())
        if agreed:
            self._agreed = True
            received = self.received
            told = signal.Signals(received).name if received is not None else "another rank's signal"
            log.warning("ckptd: preemption requested (%s): saving now, %.0f s grace period", told, self.grace_s)
        return agreed

    # ------------------------------------------------------------ the save

    def deadline(self) -> float:
        """time.monotonic() by which the save must be durable: grace_s after the signal (after
        now when this process received none)."""
        received = self._received
        return (received[1] if received is not None else time.monotonic()) + self.grace_s

    def save(self, step: int, state: Mapping[str, Any], **save_kwargs: Any) -> PreemptionSave:
        """Save `state` as `step` now and wait until it is durable, at most until `deadline()`.

        save_kwargs go to `CheckpointClient.save` (rng=True, metric=...). Never waits past the
        deadline, even when the daemon does not answer: the save runs in a helper thread, and
        when the time is up this returns with `finished` False (the thread is left behind;
        exit). Never raises for a failed save: the reason is in the result.
        """
        started = time.monotonic()
        deadline = self.deadline()
        worker = _SaveWorker(self.client, step, state, deadline, save_kwargs)
        thread = threading.Thread(target=worker.run, name="ckptd-preemption", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        elapsed = time.monotonic() - started
        if thread.is_alive():
            reason = (
                f"not durable within the {self.grace_s:g} s grace period: the save was still {worker.phase} "
                f"(is the daemon at {self.client.address} overloaded or stopped?)"
            )
            return PreemptionSave(step, None, reason, elapsed, finished=False)
        return PreemptionSave(step, worker.durable, worker.reason, elapsed)

    def save_and_exit(self, step: int, state: Mapping[str, Any], **save_kwargs: Any) -> NoReturn:
        """`save`, log the outcome, exit: SystemExit(128 + the signal's number, 143 for SIGTERM,
        as if the signal had ended the process) once `step` is durable; exit status 1
        (NOT_DURABLE_EXIT) when it is not (the log says why). When the daemon did not answer in time the process ends at once
        (os._exit after flushing the logs: the save's thread is stuck, and exit handlers could
        wait on it past the platform's SIGKILL)."""
        outcome = self.save(step, state, **save_kwargs)
        signum = self.received or signal.SIGTERM
        name = signal.Signals(signum).name
        durable = outcome.durable
        if durable is not None:
            log.warning("ckptd: preempted (%s): step %d is durable in %s (%.1f s); exiting", name, step, durable.step_dir, outcome.elapsed_s)
            self.client.close()
            self.uninstall()
            raise SystemExit(128 + signum)
        log.error("ckptd: preempted (%s): step %d is NOT durable: %s; exiting", name, step, outcome.reason)
        if not outcome.finished:
            _exit_now(NOT_DURABLE_EXIT)
        self.uninstall()
        raise SystemExit(NOT_DURABLE_EXIT)


class _SaveWorker:
    """The save and the wait of `Preemption.save`, run in a helper thread. `phase`, `durable`
    and `reason` are written by that thread and read after it ended (or, for a message, while
    it is stuck: one attribute assignment each)."""

    def __init__(self, client: "CheckpointClient", step: int, state: Mapping[str, Any], deadline: float, save_kwargs: dict[str, Any]) -> None:
        self.client = client
        self.step = step
        self.state = state
        self.deadline = deadline
        self.save_kwargs = save_kwargs
        self.stream = _current_cuda_stream()  # the caller's: the device copies wait on it
        self.phase = "being handed over to the daemon"
        self.durable: DurableInfo | None = None
        self.reason = ""

    def run(self) -> None:
        try:
            with torch.cuda.stream(self.stream):  # None: a no-op
                self._run()
        except Exception as exc:  # a broken state raises in save(): reported, the caller exits
            self.reason = f"the save raised {type(exc).__name__}: {exc}"

    def _run(self) -> None:
        if self._saved_already():
            return
        handle = self.client.save(self.step, self.state, **self.save_kwargs)
        handle.wait_snapshot(host=True)
        if not handle.ok:
            self.reason = f"the save failed: {handle.error}"
            return
        self.phase = "being written by the daemon"
        try:
            self.durable = self.client._wait_durable(self.step, max(0.1, self.deadline - time.monotonic()))
        except CheckpointError as exc:
            self.reason = str(exc)


    def _saved_already(self) -> bool:
        """Whether this client saved the step already (a periodic save at this same boundary):
        then this waits for it (durable set, or the reason), as a second save would be refused.
        Only this client's own save counts: another rank's save of the step may be waiting for
        this one to join."""
        if self.client._last_step != self.step:
            return False
        try:
            self.durable = self.client._wait_durable(self.step, max(0.1, self.deadline - time.monotonic()))
        except CheckpointError as exc:
            if exc.code == "DEADLINE_EXCEEDED":  # still being written when the grace period ran out
                self.reason = str(exc)
                return True
            log.info("ckptd: step %d was saved before and is not durable (%s): saving it again", self.step, exc)
            return False
        return True


def _current_cuda_stream() -> Any:
    """The calling thread's current CUDA stream, when CUDA is in use (else None)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return torch.cuda.current_stream()
    return None


def _exit_now(status: int) -> NoReturn:
    """End the process at once, the logs flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
