"""A state that can never be saved raises on the first `save`, whatever on_error says (issue 20,
finding 8); what can pass (a daemon that is down) still only warns with on_error="warn"."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from ckptd.client import CheckpointClient, CheckpointError
from ckptd.demo.process import DaemonProcess


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _training() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _first_save_raises(daemon: Any, state: Any, error: type[Exception], match: str, caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointClient("bad-state", address=daemon.address, rank=0, world_size=1, on_error="warn") as ckpt:
        with caplog.at_level(logging.WARNING, logger="ckptd.client"):
            with pytest.raises(error, match=match):
                ckpt.save(1, state)
        assert ckpt.failed_saves == 1
        assert "training goes on" not in caplog.text  # raised, not merely logged
        assert ckpt.latest() is None


def test_optimizer_without_its_model_raises_on_the_first_save(daemon: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, optimizer = _training()
    _first_save_raises(daemon, {"optimizer": optimizer}, ValueError, r"put its model in the same state under 'model'", caplog)


def test_a_value_of_an_unsupported_type_raises_type_error(daemon: Any, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = _training()
    state = {"model": model, "optimizer": optimizer, "extra": {"handle": object()}}
    _first_save_raises(daemon, state, TypeError, r"extra/handle.*convert it to a JSON-able value", caplog)


@pytest.mark.parametrize(
    ("make_state", "error", "match"),
    [
        (lambda m: {"model": m, "extra": {"a\x01b": torch.zeros(2)}}, ValueError, "control characters"),
        (lambda m: {"model": m, "extra": {"s": torch.eye(3).to_sparse()}}, TypeError, r"to_dense\(\)"),
        (lambda m: {"model": m, "extra": {"m": torch.empty(2, device="meta")}}, ValueError, "materialize it first"),
        (lambda m: {}, ValueError, "state is empty: pass what to checkpoint"),
        (lambda m: {"model": m, 3: torch.zeros(2)}, TypeError, "top-level keys must be strings"),
    ],
    ids=["bad-name", "sparse", "meta", "empty", "non-string-key"],
)
def test_other_unusable_states_raise_on_the_first_save(
    daemon: Any, caplog: pytest.LogCaptureFixture, make_state: Any, error: type[Exception], match: str
) -> None:
    _first_save_raises(daemon, make_state(_model()), error, match, caplog)


def test_metadata_the_daemon_refuses_raises_invalid_state(daemon: Any) -> None:
    """An INVALID_ARGUMENT answer to BeginSave (here: a single-node daemon told that this node
    serves 1 of 2 ranks) is a caller error too: InvalidState, a CheckpointError and a ValueError."""
    from ckptd.client import InvalidState

    model, optimizer = _training()
    with CheckpointClient("refused", address=daemon.address, rank=0, world_size=2, local_world_size=1, on_error="warn") as ckpt:
        with pytest.raises(InvalidState, match="start every node's daemon with --node-rank and --peers") as raised:
            ckpt.save(1, {"model": model, "optimizer": optimizer})
        assert raised.value.code == "INVALID_ARGUMENT"
        assert isinstance(raised.value, CheckpointError) and isinstance(raised.value, ValueError)
        assert ckpt.failed_saves == 1


def test_the_client_saves_once_the_state_is_fixed(daemon: Any) -> None:
    model, optimizer = _training()
    with CheckpointClient("fixed", address=daemon.address, rank=0, world_size=1, on_error="warn") as ckpt:
        with pytest.raises(ValueError, match="put its model"):
            ckpt.save(1, {"optimizer": optimizer})
        handle = ckpt.save(1, {"model": model, "optimizer": optimizer})
        assert handle.ok, handle.error
        handle.wait_durable(timeout=60)
        assert ckpt.latest() == 1


def test_a_daemon_that_is_down_still_only_warns(daemon: Any, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = _training()
    address = daemon.address
    daemon.stop()
    with CheckpointClient("down", address=address, rank=0, world_size=1, on_error="warn", timeout_s=5) as ckpt:
        with caplog.at_level(logging.WARNING, logger="ckptd.client"):
            handle = ckpt.save(1, {"model": model, "optimizer": optimizer})
        assert not handle.ok
        assert "no ckptd answers" in (handle.error or "")
        assert ckpt.failed_saves == 1
        assert "training goes on" in caplog.text


def test_load_raises_on_an_unusable_state(daemon: Any) -> None:
    _, optimizer = _training()
    with CheckpointClient("load-bad", address=daemon.address, rank=0, world_size=1, on_error="warn") as ckpt:
        with pytest.raises(ValueError, match="put its model"):
            ckpt.load({"optimizer": optimizer})


def test_a_new_world_size_while_the_old_worlds_save_is_open_only_fails_that_save(daemon: Any) -> None:
    """An elastic restart can meet a save of the old world still waiting for its ranks: that is
    not an error in the caller's state (FAILED_PRECONDITION, a failed handle with on_error="warn"),
    and the same client saves once the old save has timed out. Both worlds are one run here (a
    launcher-given run id kept across the restart); two runs would meet the run rule instead
    (tests/integration/test_job_identity.py)."""
    model, optimizer = _training()
    state = {"model": model, "optimizer": optimizer}
    old_world = CheckpointClient(
        "elastic", address=daemon.address, rank=0, world_size=2, local_world_size=2, on_error="warn", timeout_s=3, run_id="elastic-1"
    )
    waiting = threading.Thread(target=old_world.save, args=(1, state))  # rank 1 never comes: open until the timeout
    waiting.start()
    try:
        with CheckpointClient("elastic", address=daemon.address, rank=0, world_size=1, on_error="warn", run_id="elastic-1") as ckpt:
            deadline = time.monotonic() + 10
            while not ckpt.status().in_flight and time.monotonic() < deadline:  # the old world's save is open
                time.sleep(0.05)
            handle = ckpt.save(2, state)
            assert not handle.ok and "save in flight with world size 2" in str(handle.error)
            waiting.join(timeout=30)
            deadline = time.monotonic() + 10
            while ckpt.status().in_flight and time.monotonic() < deadline:  # timed out and gone
                time.sleep(0.05)
            handle = ckpt.save(3, state)
            assert handle.ok, handle.error
            handle.wait_durable(timeout=60)
    finally:
        waiting.join(timeout=30)
        old_world.close()


@pytest.mark.slow
def test_a_restarted_daemon_is_reached_again_within_a_second(daemons: Any) -> None:
    """Found by the chaos suite (issue 30): a rank whose daemon was down for a while kept
    failing its saves with "connection refused" for seconds after the daemon was back (gRPC's
    default reconnect backoff grows to two minutes). The client's channel retries within a second."""
    model, _ = _training()
    daemon = daemons.start()
    address = daemon.address
    daemon.kill()
    with CheckpointClient("back", address=address, rank=0, world_size=1, on_error="warn", timeout_s=5) as ckpt:
        down_since = time.monotonic()
        step = 1
        while time.monotonic() - down_since < 20:  # each failed call while it is down grows gRPC's backoff
            assert not ckpt.save(step, {"model": model}).ok
            step += 1
            time.sleep(0.05)
        daemons.start()
        back = time.monotonic()
        while not ckpt.save(step, {"model": model}).ok:
            assert time.monotonic() - back < 2, "the client did not reach the restarted daemon within 2 s"
            step += 1
            time.sleep(0.05)
