"""ckptd.integrations.accelerate with the real Accelerate on CPU and real daemons: a plain loop
killed with SIGKILL and resumed (mid-epoch and at an epoch boundary) trains exactly what an
uninterrupted one does, registered objects and data-loader epochs included; a checkpoint holds
no pickle; several models and optimizers round-trip; mismatches and misuse are refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from worker_process import load_worker, run_worker  # tests/worker_process.py
import torch
from torch import nn

from ckptd.client import CheckpointClient

accelerate = pytest.importorskip("accelerate")

from ckptd.demo.process import DaemonProcess  # noqa: E402
from ckptd.integrations.accelerate import load_state, save_state  # noqa: E402

WORKER = Path(__file__).with_name("accel_train.py")


loop = load_worker(WORKER)


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


def _run(spec: dict[str, Any], killed: bool = False) -> dict[str, Any]:
    return run_worker(WORKER, spec, killed)


def _prepared() -> tuple[Any, nn.Module, torch.optim.Optimizer, Any, Any, Any]:
    acc = loop.accelerator()
    model, optimizer, scheduler, loader = loop.parts()
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    tracker = loop.RunningMean()
    acc.register_for_checkpointing(tracker)
    return acc, model, optimizer, scheduler, loader, tracker


def _train_steps(acc: Any, model: nn.Module, optimizer: Any, scheduler: Any, loader: Any, steps: int) -> None:
    for _, (x, y, _ids) in zip(range(steps), loader):
        optimizer.zero_grad()
        acc.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()


@pytest.mark.slow
def test_killed_and_resumed_twice_trains_what_an_uninterrupted_run_does(daemon, tmp_path: Path, one_thread: None) -> None:
    baseline = json.loads(json.dumps(loop.train({"steps": 25})))  # keys as the workers write them
    spec = {"address": daemon.address, "job": "accel-run", "steps": 25, "save_every": 4,
            "marker": str(tmp_path / "marker"), "out": str(tmp_path / "run.json")}

    first = _run({**spec, "kill_at": 13}, killed=True)  # killed at step 13, after step 12 is durable
    assert json.loads(Path(spec["marker"]).read_text()) == 12
    assert (daemon.root / "accel-run" / "step-00000012" / "ckptd.index.json").is_file()
    assert first["losses"] == {str(k): baseline["losses"][str(k)] for k in range(1, 14)}

    second = _run({**spec, "kill_at": 21}, killed=True)  # resumed mid-epoch (batch 3 of 10), killed after step 20
    assert second["resumed_from"] == 12 and json.loads(Path(spec["marker"]).read_text()) == 20
    assert second["losses"] == {str(k): baseline["losses"][str(k)] for k in range(13, 22)}

    third = _run(spec)  # resumed at an epoch boundary, to the end
    assert third["resumed_from"] == 20
    assert third["losses"] == {str(k): baseline["losses"][str(k)] for k in range(21, 26)}
    assert third["tracker"] == baseline["tracker"]  # the registered object came back each time


# issue 30 finding 7
@pytest.mark.slow
def test_a_resume_never_redoes_a_held_step_and_a_redone_ones_save_is_kept(daemons, tmp_path: Path, one_thread: None) -> None:
    """Killed right after step 12 is handed over (before it is durable): load_state() resumes
    from 12, which the daemon committed after the kill. A run resumed from an earlier step (8)
    redoes 9..12: its save of the held step 12 is kept as committed (the step is not written
    again, the handle is ok) and the run trains as an uninterrupted one."""
    daemon = daemons.start("--keep-last", "0")  # every step stays
    baseline = json.loads(json.dumps(loop.train({"steps": 20})))["losses"]
    spec = {"address": daemon.address, "job": "accel-window", "steps": 20, "save_every": 4,
            "marker": str(tmp_path / "marker"), "out": str(tmp_path / "run.json")}
    _run({**spec, "kill_at": 12, "kill_handed_over": True}, killed=True)
    assert json.loads(Path(spec["marker"]).read_text()) == 12
    second = _run(spec)  # load_state() waits for the step being written: 12, nothing redone
    assert second["resumed_from"] == 12
    assert second["losses"] == {str(k): baseline[str(k)] for k in range(13, 21)}

    held = {step: (daemon.root / "accel-window" / f"step-{step:08d}" / "ckptd.index.json").read_bytes() for step in (12, 16, 20)}
    third = _run({**spec, "resume_step": 8, "out": str(tmp_path / "again.json")})  # redoes 9..20: saves 12, 16, 20 again
    assert third["resumed_from"] == 8
    assert third["losses"] == {str(k): baseline[str(k)] for k in range(9, 21)}
    assert {step: (daemon.root / "accel-window" / f"step-{step:08d}" / "ckptd.index.json").read_bytes() for step in held} == held


def test_a_checkpoint_holds_no_pickle_and_loads_in_place(daemon, tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # Accelerate's own save_state would write here: nothing may appear
    acc, model, optimizer, scheduler, loader, tracker = _prepared()
    _train_steps(acc, model, optimizer, scheduler, loader, 3)
    tracker.update(2.5)
    acc.step = 1
    loader.set_epoch(2)
    with CheckpointClient("accel-files", address=daemon.address, on_error="raise") as ckpt:
        info = save_state(acc, ckpt, 3).wait_durable(timeout=60)
        assert info is not None
        files = sorted(p.name for p in Path(info.step_dir).iterdir())
        assert files and all(name.endswith((".safetensors", ".json")) for name in files), files
        assert sorted(p.name for p in cwd.iterdir()) == []

        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_lr = scheduler.get_last_lr()
        epoch = loader.iteration
        again, model2, optimizer2, scheduler2, loader2, tracker2 = _prepared()
        assert loader2.iteration == 0 and tracker2.count == 0
        assert load_state(again, ckpt) == 3
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in expected.items())
    assert scheduler2.get_last_lr() == expected_lr
    assert optimizer2.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert (tracker2.count, tracker2.mean) == (1, 2.5)
    assert (again.step, loader2.iteration) == (1, epoch)


def test_several_models_and_optimizers_round_trip(daemon) -> None:
    def build() -> tuple[Any, list[nn.Module], list[Any]]:
        acc = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        models = [nn.Linear(4, 3), nn.Linear(3, 2)]
        optimizers = [torch.optim.Adam(m.parameters(), lr=0.1) for m in models]
        prepared = acc.prepare(*models, *optimizers)
        return acc, list(prepared[:2]), list(prepared[2:])

    acc, models, optimizers = build()
    for model, optimizer in zip(models, optimizers):
        model(torch.randn(2, model.in_features)).sum().backward()
        optimizer.step()
    with CheckpointClient("accel-two", address=daemon.address, on_error="raise") as ckpt:
        save_state(acc, ckpt, 1).wait_durable(timeout=60)
        acc2, models2, optimizers2 = build()
        assert load_state(acc2, ckpt) == 1
    for a, b in zip(models, models2):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    for a, b in zip(optimizers, optimizers2):
        assert all(torch.equal(a.state[p]["exp_avg"], b.state[q]["exp_avg"]) for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]))


def test_a_checkpoint_of_other_objects_is_refused_before_anything_is_loaded(daemon, one_thread: None) -> None:
    acc, model, optimizer, scheduler, loader, tracker = _prepared()
    with CheckpointClient("accel-other", address=daemon.address, on_error="raise") as ckpt:
        assert load_state(acc, ckpt) is None  # no checkpoint yet: nothing changes
        _train_steps(acc, model, optimizer, scheduler, loader, 1)
        save_state(acc, ckpt, 5).wait_durable(timeout=60)
        other, model2, *_ = _prepared()
        other.register_for_checkpointing(loop.RunningMean())  # one object more than was saved
        before = {k: v.clone() for k, v in model2.state_dict().items()}
        with pytest.raises(ValueError, match="custom_objects: 1 saved, 2 now"):
            load_state(other, ckpt)
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in before.items())


def test_a_daemon_that_is_down_does_not_stop_training(tmp_path: Path, one_thread: None) -> None:
    acc, model, optimizer, scheduler, loader, tracker = _prepared()
    with CheckpointClient("accel-down", address=f"unix://{tmp_path}/nobody.sock") as ckpt:
        handle = save_state(acc, ckpt, 1)
        assert not handle.ok and handle.wait_durable(timeout=1) is None
    _train_steps(acc, model, optimizer, scheduler, loader, 1)


def test_misuse_is_refused(daemon) -> None:
    acc = accelerate.Accelerator(cpu=True)
    with CheckpointClient("accel-bad", address=daemon.address) as ckpt:
        with pytest.raises(TypeError, match="expected an accelerate.Accelerator"):
            save_state(object(), ckpt, 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="expected a ckptd.client.CheckpointClient"):
            load_state(acc, "unix:///x.sock")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="holds nothing to checkpoint"):
            save_state(acc, ckpt, 1)
    acc.prepare(nn.Linear(2, 2))
    with CheckpointClient("accel-bad", address=daemon.address, rank=1, world_size=2) as other_ranks:
        with pytest.raises(ValueError, match="rank 1 of 2, the Accelerator process 0 of 1"):
            save_state(acc, other_ranks, 1)


def test_a_save_in_the_middle_of_a_gradient_accumulation_is_warned(daemon, caplog: pytest.LogCaptureFixture) -> None:
    """A probe: save_state between two micro-batches of one optimizer step resumed without their
    gradients, silently (the DeepSpeed path refuses it): the plain path warns, and saves."""
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
    linear = nn.Linear(2, 2)
    model, optimizer = acc.prepare(linear, torch.optim.SGD(linear.parameters(), lr=0.1))
    with CheckpointClient("accel-accumulating", address=daemon.address, on_error="raise") as ckpt:
        with acc.accumulate(model):
            acc.backward(model(torch.ones(1, 2)).sum())
        assert not acc.sync_gradients
        with caplog.at_level(logging.WARNING, logger="ckptd.integrations.accelerate"):
            save_state(acc, ckpt, 1).wait_durable(timeout=60)
        assert "in the middle of a gradient accumulation (3 micro-batches" in caplog.text
        caplog.clear()
        for _ in range(2):
            with acc.accumulate(model):
                acc.backward(model(torch.ones(1, 2)).sum())
        assert acc.sync_gradients
        with caplog.at_level(logging.WARNING, logger="ckptd.integrations.accelerate"):
            save_state(acc, ckpt, 2).wait_durable(timeout=60)
        assert "gradient accumulation" not in caplog.text

