"""Hand-off bookkeeping without a daemon or a GPU (ckptd.client._handoff): modes, fences, hooks."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ckptd.client._handoff.base import SnapshotCommitter, lazy_placements
from ckptd.client._handoff.modes import ModeState, resolve_mode


def test_only_optimizer_steps_change_parameters_and_optimizer_state() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    sd = model.state_dict()
    tensors = [sd["0.weight"], sd["1.running_mean"], sd["1.num_batches_tracked"], torch.zeros(3), torch.zeros(2)]
    kinds = ["model", "model", "model", "optimizer", "extra"]
    assert lazy_placements({"model": model}, kinds, tensors) == {0, 3}  # buffers and extras are fenced in save


def test_hooks_are_installed_once_per_optimizer_and_removed() -> None:
    p = nn.Parameter(torch.zeros(2))
    opt_a, opt_b = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1)
    gpu = SnapshotCommitter()
    assert gpu.install_hooks({"optimizer": opt_a, "other": opt_b, "extra": {"x": 1}}) == 2
    assert gpu.install_hooks({"optimizer": opt_a, "other": opt_b}) == 0
    p.grad = torch.ones(2)
    opt_a.step()  # the hook runs: nothing pending, nothing happens
    with gpu.fence(host=True):
        pass
    gpu.remove_hooks()
    assert len(opt_a._optimizer_step_pre_hooks) == 0 and len(opt_b._optimizer_step_pre_hooks) == 0


def test_fall_back_logs_once_and_keeps_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    mode = ModeState("ipc", resolve_mode("ipc"))
    assert mode.in_use == "ipc" and mode.reason is None
    with caplog.at_level(logging.WARNING, logger="ckptd.client"):
        mode.fall_back("the daemon does not see the trainer's GPU")
        mode.fall_back("another reason")
    assert mode.in_use == "overlap" and mode.reason == "the daemon does not see the trainer's GPU"
    assert len(caplog.records) == 1


def test_settle_without_a_pending_snapshot_and_resolve_mode() -> None:
    assert SnapshotCommitter().settle() is None
    assert [resolve_mode(m) for m in ("auto", "copy", "overlap", "ipc")] == ["overlap", "copy", "overlap", "ipc"]
    with pytest.raises(ValueError, match="use one of"):
        resolve_mode("pinned")


def test_each_cuda_mode_has_one_transport_and_cpu_states_take_the_shared_memory_copy() -> None:
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from ckptd.client.arenas import ArenaMaps
    from ckptd.client._handoff.modes import AUTO, CPU, FALLBACK, MODES
    from ckptd.client._handoff.select import TRANSPORTS, Handoff

    assert set(TRANSPORTS) == {resolve_mode(m) for m in MODES} and FALLBACK in TRANSPORTS

    def no_backend():  # noqa: ANN202
        raise AssertionError("choosing a transport must not create the device backend")

    with ThreadPoolExecutor(1) as pool:
        for mode in MODES:
            handoff = Handoff(mode, no_backend, lambda t: False, rpc=SimpleNamespace(), maps=ArenaMaps(), pool=pool, copy_workers=1)  # type: ignore[arg-type]
            cpu_only, with_device = SimpleNamespace(device=frozenset()), SimpleNamespace(device=frozenset({0}))
            assert handoff.transport_for(cpu_only) is handoff.shm  # type: ignore[arg-type]
            chosen = handoff.transport_for(with_device)  # type: ignore[arg-type]
            assert chosen is handoff.transport(resolve_mode(mode)) and chosen.mode == resolve_mode(mode)
            assert handoff.shm.start({}, SimpleNamespace(host=()), None).mode == CPU  # type: ignore[arg-type]
            handoff.close()
    assert resolve_mode(AUTO) == FALLBACK
