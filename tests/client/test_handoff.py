"""GPU hand-off bookkeeping without a daemon or a GPU (ckptd.client.handoff)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ckptd.client.handoff import GpuHandoff, lazy_placements, resolve_mode


def handoff(mode: str = "auto") -> GpuHandoff:
    def no_backend():  # noqa: ANN202
        raise AssertionError("a CPU-only state must never create the device backend")

    return GpuHandoff(mode, no_backend, lambda t: t.is_cuda)


def test_only_optimizer_steps_change_parameters_and_optimizer_state() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    sd = model.state_dict()
    tensors = [sd["0.weight"], sd["1.running_mean"], sd["1.num_batches_tracked"], torch.zeros(3), torch.zeros(2)]
    kinds = ["model", "model", "model", "optimizer", "extra"]
    assert lazy_placements({"model": model}, kinds, tensors) == {0, 3}  # buffers and extras are fenced in save


def test_hooks_are_installed_once_per_optimizer_and_removed() -> None:
    p = nn.Parameter(torch.zeros(2))
    opt_a, opt_b = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1)
    gpu = handoff()
    assert gpu.install_hooks({"optimizer": opt_a, "other": opt_b, "extra": {"x": 1}}) == 2
    assert gpu.install_hooks({"optimizer": opt_a, "other": opt_b}) == 0
    p.grad = torch.ones(2)
    opt_a.step()  # the hook runs: nothing pending, nothing happens
    with gpu.fence(host=True):
        pass
    gpu.remove_hooks()
    assert len(opt_a._optimizer_step_pre_hooks) == 0 and len(opt_b._optimizer_step_pre_hooks) == 0


def test_fall_back_logs_once_and_keeps_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    gpu = handoff("ipc")
    assert gpu.mode.in_use == "ipc" and gpu.mode.reason is None
    with caplog.at_level(logging.WARNING, logger="ckptd.client"):
        gpu.fall_back("the daemon does not see the trainer's GPU")
        gpu.fall_back("another reason")
    assert gpu.mode.in_use == "overlap" and gpu.mode.reason == "the daemon does not see the trainer's GPU"
    assert len(caplog.records) == 1


def test_settle_without_a_pending_snapshot_and_resolve_mode() -> None:
    assert handoff().settle() is None
    assert [resolve_mode(m) for m in ("auto", "copy", "overlap", "ipc")] == ["overlap", "copy", "overlap", "ipc"]
    with pytest.raises(ValueError, match="use one of"):
        resolve_mode("pinned")
