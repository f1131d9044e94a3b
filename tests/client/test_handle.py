"""ckptd.client.handle.SaveHandle: what `ok`, `error` and `durable` say after each outcome of wait_durable."""

from __future__ import annotations

import pytest

from ckptd.client._rpc import DurableInfo
from ckptd.client.errors import ABORTED, CheckpointError, DaemonUnavailable
from ckptd.client.handle import SaveHandle


def _handle(outcome: DurableInfo | CheckpointError, on_error: str = "warn") -> SaveHandle:
    def wait(step: int, timeout: float | None) -> DurableInfo:
        if isinstance(outcome, CheckpointError):
            raise outcome
        return outcome

    return SaveHandle(wait, on_error, 7, 0.001)


def test_a_committed_step_is_durable() -> None:
    info = DurableInfo(step=7, step_dir="/root/job/step-00000007", bytes_written=10, bytes_linked=0)
    handle = _handle(info)
    assert handle.durable is None and handle.ok
    assert handle.wait_durable() == info and handle.durable == info and handle.ok


def test_a_step_the_daemon_failed_is_not_ok() -> None:
    handle = _handle(CheckpointError("step 7 was not committed: disk full", ABORTED))
    assert handle.wait_durable() is None
    assert not handle.ok and "disk full" in (handle.error or "") and handle.durable is None


@pytest.mark.parametrize("on_error", ["warn", "raise"])
def test_a_daemon_lost_during_the_wait_leaves_the_outcome_unknown(on_error: str) -> None:
    """Found by a probe: code that checked only `ok` took the step for durable; `durable` says it is not known."""
    handle = _handle(DaemonUnavailable("no ckptd answers at unix:///x.sock"), on_error)
    if on_error == "raise":
        with pytest.raises(DaemonUnavailable):
            handle.wait_durable()
    else:
        assert handle.wait_durable() is None
    assert handle.ok and handle.durable is None
