"""ckptd.client.preemption (issue 31 item 6): the signal only sets a flag, the save at the step
boundary becomes durable within the grace period (real daemon), and the grace period is kept
when the daemon does not answer (stopped with SIGSTOP). The same with real SIGTERMs to torchrun
ranks: tests/integration/test_preemption.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from ckptd.client import CheckpointClient
from ckptd.client.preemption import NOT_DURABLE_EXIT, Preemption


def make_state() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, fields in enumerate(state["optimizer"].state.values()):
        out.update({f"optimizer/{i}/{k}": torch.as_tensor(v).clone() for k, v in fields.items()})
    return out


# issue 31 item 6
def test_the_signal_only_sets_a_flag_and_the_handlers_are_restored(tmp_path) -> None:
    client = CheckpointClient("job", address=str(tmp_path / "none.sock"), rank=0, world_size=1)
    original = signal.getsignal(signal.SIGTERM)
    with Preemption(client, grace_s=5, signals=(signal.SIGTERM, signal.SIGUSR2)) as preemption:
        assert preemption.received is None and not preemption.requested()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert preemption.received == signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not move the grace period
        assert preemption.received == signal.SIGUSR2
        assert preemption.requested() and preemption.requested()  # stays requested
        assert preemption.deadline() - time.monotonic() < 5
    assert signal.getsignal(signal.SIGTERM) is original
    client.close()


# issue 31 item 6
def test_bad_arguments_and_other_threads_are_refused(tmp_path) -> None:
    client = CheckpointClient("job", address=str(tmp_path / "none.sock"), rank=0, world_size=1)
    for grace in (0, -1, True, "30"):
        with pytest.raises(ValueError, match="grace_s"):
            Preemption(client, grace_s=grace)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="signals is empty"):
        Preemption(client, signals=())
    errors: list[BaseException] = []

    def install() -> None:
        try:
            Preemption(client).install()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
    client.close()


# issue 31 item 6
def test_save_and_exit_makes_the_step_durable_then_exits_143(daemon) -> None:
    state = make_state()
    expected = tensors(state)
    ckpt = CheckpointClient("preempted", address=daemon.address, rank=0, world_size=1)
    with Preemption(ckpt, grace_s=30) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested()
        with pytest.raises(SystemExit) as exited:
            preemption.save_and_exit(7, state)
    assert exited.value.code == 128 + signal.SIGTERM
    fresh = {"model": nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))}
    fresh["optimizer"] = torch.optim.AdamW(fresh["model"].parameters(), lr=0.1)
    with CheckpointClient("preempted", address=daemon.address, rank=0, world_size=1, on_error="raise") as reader:
        assert reader.load(fresh) == 7
    got = tensors(fresh)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


# issue 31 item 6
def test_a_daemon_that_does_not_answer_costs_the_grace_period_and_no_more(daemon) -> None:
    state = make_state()
    ckpt = CheckpointClient("stalled", address=daemon.address, rank=0, world_size=1, timeout_s=60)
    assert ckpt.load(state) is None  # attached: the daemon knows the client
    preemption = Preemption(ckpt, grace_s=1.5)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        outcome = preemption.save(3, state)  # no signal received: the grace period starts now
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert not outcome.ok and not outcome.finished
    assert 1.4 < outcome.elapsed_s < 3.0, outcome.elapsed_s
    assert "not durable within the 1.5 s grace period" in outcome.reason and "being handed over" in outcome.reason, outcome.reason
    assert daemon.address in outcome.reason
    ckpt.close()  # the save left behind finishes once the daemon runs again


# issue 31 item 6
def test_a_failed_save_is_reported_and_exits_1(tmp_path) -> None:
    client = CheckpointClient("job", address=str(tmp_path / "none.sock"), rank=0, world_size=1, timeout_s=5)
    preemption = Preemption(client, grace_s=20)
    outcome = preemption.save(1, make_state())
    assert not outcome.ok and outcome.finished and "the save failed" in outcome.reason, outcome.reason
    with pytest.raises(SystemExit) as exited:
        preemption.save_and_exit(1, make_state())
    assert exited.value.code == NOT_DURABLE_EXIT
    client.close()


# issue 31 item 6
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["copy", "overlap", "ipc"])
def test_a_preemption_save_of_cuda_tensors_is_durable_and_exact(daemon, mode: str) -> None:
    """The save runs in a helper thread on the caller's CUDA stream: what the stream computed
    last is what the step holds (one command on a GPU machine: pytest -m gpu tests/client/test_preemption.py)."""
    state = make_state()
    state["model"].cuda()
    state["optimizer"] = torch.optim.AdamW(state["model"].parameters(), lr=0.1)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the training's own stream, not the default one
        state["model"](torch.randn(4, 8, device="cuda")).square().sum().backward()
        state["optimizer"].step()
        with torch.no_grad():
            for p in state["model"].parameters():
                p.mul_(1.5)  # the last change before the save, still queued on the stream
        ckpt = CheckpointClient(f"gpu-{mode}", address=daemon.address, rank=0, world_size=1, mode=mode)
        outcome = Preemption(ckpt, grace_s=60).save(1, state)
    torch.cuda.synchronize()
    assert outcome.ok, outcome.reason
    expected = {k: v.cpu() for k, v in tensors(state).items()}
    fresh = {"model": nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))}
    fresh["optimizer"] = torch.optim.AdamW(fresh["model"].parameters(), lr=0.1)
    with CheckpointClient(f"gpu-{mode}", address=daemon.address, rank=0, world_size=1, on_error="raise") as reader:
        assert reader.load(fresh) == 1
    got = tensors(fresh)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    ckpt.close()


# issue 31 item 6
def test_a_step_saved_at_the_same_boundary_is_waited_for_not_saved_again(daemon) -> None:
    """A periodic save of the step just before the preemption check: the daemon would refuse a
    second save of it (ALREADY_EXISTS); the helper waits until that one is durable."""
    state = make_state()
    ckpt = CheckpointClient("periodic", address=daemon.address, rank=0, world_size=1, on_error="raise")
    ckpt.save(10, state)
    outcome = Preemption(ckpt, grace_s=30).save(10, state)
    assert outcome.ok and outcome.durable is not None and outcome.durable.step == 10, outcome.reason
    assert [info.step for info in ckpt.list()] == [10] and ckpt.failed_saves == 0
    ckpt.close()
