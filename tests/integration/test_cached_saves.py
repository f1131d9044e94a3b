"""The cached save and load path (ckptd.client.structure, slots, arena_copy) against a real
daemon: saves of an unchanged state reuse what they derived, every change of the state's
structure or memory is noticed, and every save restores bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from ckptd.client import CheckpointClient
from ckptd.client.layout import LayoutRules, PaddedVocab, RankCoords, Rule
from ckptd.demo.process import DaemonProcess
from ckptd.wire.v1 import checkpoint_pb2 as pb


@pytest.fixture
def daemon(module_daemons: Any) -> DaemonProcess:
    """The module's tests share one daemon (each saves under its own job), started again after a
    test that left it stopped or dead."""
    return module_daemons.running("--keep-last", "10")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 8))


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16, dtype=next(model.parameters()).dtype)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of everything a load must bring back."""
    out = {"model": copy.deepcopy(state["model"].state_dict())}
    if "optimizer" in state:
        out["optimizer"] = copy.deepcopy(state["optimizer"].state_dict())
    if "extra" in state:
        out["extra"] = copy.deepcopy(state["extra"])
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _assert_restores(ckpt: CheckpointClient, step: int, state: dict[str, Any], expected: dict[str, Any]) -> None:
    with torch.no_grad():
        for p in state["model"].parameters():
            p.zero_()
    assert ckpt.load(state, step=step) == step
    assert _same(_snapshot(state), expected)


def _counting_slots(ckpt: CheckpointClient) -> list[int]:
    """Wrap the client's BeginSave to record how many slots each answer carried."""
    counts: list[int] = []
    begin = ckpt._rpc.stub.BeginSave

    def counted(request: pb.BeginSaveRequest, **kw: Any) -> pb.BeginSaveResponse:
        reply = begin(request, **kw)
        counts.append(len(reply.slots))
        return reply

    ckpt._rpc.stub.BeginSave = counted  # type: ignore[method-assign]
    return counts


def test_saves_of_an_unchanged_state_reuse_the_layout_and_restore_exactly(daemon: DaemonProcess) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt, "extra": {"epoch": 0}}
    with CheckpointClient("cached", address=daemon.address, on_error="raise") as ckpt:
        slots = _counting_slots(ckpt)
        expected = {}
        for step in range(1, 6):
            _train(model, opt)
            state["extra"]["epoch"] = step
            ckpt.save(step, state).wait_durable(timeout=60)
            expected[step] = _snapshot(state)
        # the first save of the fresh state and the first after optimizer state appeared need
        # the slots; saves of the same layout get none (the daemon leaves them out)
        assert slots[0] > 0 and slots[-1] == 0 and slots.count(0) >= 3
        assert ckpt._save_structures.builds == 1
        for step in (5, 3, 1):
            _assert_restores(ckpt, step, state, expected[step])


def test_a_structural_change_between_saves_is_saved_as_it_is_now(daemon: DaemonProcess) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state: dict[str, Any] = {"model": model, "optimizer": opt}
    with CheckpointClient("changes", address=daemon.address, on_error="raise") as ckpt:
        _train(model, opt)
        ckpt.save(1, state).wait_durable(timeout=60)
        # a new parameter (and its optimizer state after a step)
        model.append(nn.Linear(8, 8))
        opt.add_param_group({"params": model[3].parameters()})
        _train(model, opt)
        ckpt.save(2, state).wait_durable(timeout=60)
        expected2 = _snapshot(state)
        # a resized tensor and a dtype change
        model[3] = nn.Linear(8, 4)
        model.to(torch.float64)
        state["optimizer"] = opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        _train(model, opt)
        ckpt.save(3, state).wait_durable(timeout=60)
        expected3 = _snapshot(state)
        assert ckpt._save_structures.builds == 3
        _assert_restores(ckpt, 3, state, expected3)
    with CheckpointClient("changes", address=daemon.address, on_error="raise") as fresh:
        old = _model()
        old.append(nn.Linear(8, 8))
        old_opt = torch.optim.AdamW(old[:3].parameters(), lr=0.01)
        old_opt.add_param_group({"params": old[3].parameters()})
        _train(old, old_opt)
        back = {"model": old, "optimizer": old_opt}
        _assert_restores(fresh, 2, back, expected2)


def test_a_parameter_replaced_in_place_is_saved_from_its_new_memory(daemon: DaemonProcess) -> None:
    model = _model()
    state = {"model": model}
    with CheckpointClient("moved", address=daemon.address, on_error="raise") as ckpt:
        slots = _counting_slots(ckpt)
        ckpt.save(1, state).wait_durable(timeout=60)
        ckpt.save(2, state).wait_durable(timeout=60)
        model[0].weight = nn.Parameter(torch.full((16, 16), 7.0))  # same structure, other memory
        ckpt.save(3, state).wait_durable(timeout=60)
        expected = _snapshot(state)
        assert slots[2] == 0  # the layout is the same: only the views were taken again
        assert (ckpt._save_structures.builds, ckpt._save_structures.rebinds) == (1, 1)
        _assert_restores(ckpt, 3, state, expected)
        assert torch.equal(model[0].weight, torch.full((16, 16), 7.0))


def test_rng_state_is_saved_fresh_on_every_save(daemon: DaemonProcess) -> None:
    state = {"model": _model()}
    with CheckpointClient("rng", address=daemon.address, on_error="raise") as ckpt:
        states = {}
        for step in (1, 2, 3):
            torch.rand(10)
            states[step] = torch.get_rng_state()
            ckpt.save(step, state, rng=True).wait_durable(timeout=60)
        for step in (3, 1, 2):
            torch.rand(100)
            ckpt.load(state, step=step, rng=True)
            assert torch.equal(torch.get_rng_state(), states[step])


def test_a_new_layout_between_saves_is_a_new_plan(daemon: DaemonProcess) -> None:
    """A restarted job with other layout rules: its saves get a plan of their own (the logical
    tensor now has 3 rows, padding dropped), and each step loads as it was saved."""
    w = torch.arange(24.0).reshape(4, 6)
    with CheckpointClient("layouts", address=daemon.address, on_error="raise") as whole:
        whole.save(1, {"model": {"w": w}}).wait_durable(timeout=60)
    rules = LayoutRules([Rule(r"w", PaddedVocab(dim=0, size=3))])
    with CheckpointClient("layouts", address=daemon.address, on_error="raise", layout=rules, coords=RankCoords(0, 1)) as ruled:
        ruled.save(2, {"model": {"w": w}}).wait_durable(timeout=60)
        out = {"model": {"w": torch.full((4, 6), -1.0)}}
        ruled.load(out, step=2)
        assert torch.equal(out["model"]["w"][:3], w[:3]) and torch.equal(out["model"]["w"][3], torch.full((6,), -1.0))
    with CheckpointClient("layouts", address=daemon.address, on_error="raise") as plain:
        three = {"model": {"w": torch.zeros(3, 6)}}
        plain.load(three, step=2)  # stored as a 3-row tensor: the ruled save was planned anew
        assert torch.equal(three["model"]["w"], w[:3])
        four = {"model": {"w": torch.zeros(4, 6)}}
        plain.load(four, step=1)
        assert torch.equal(four["model"]["w"], w)


def test_a_restarted_daemon_gets_the_metadata_and_slots_again(daemons: Any) -> None:
    first = daemons.start("--keep-last", "10")
    model = _model()
    state = {"model": model}
    with CheckpointClient("restart", address=first.address, on_error="raise") as ckpt:
        slots = _counting_slots(ckpt)
        ckpt.save(1, state).wait_durable(timeout=60)
        ckpt.load(state)
        first.stop()
        second = daemons.start("--keep-last", "10")
        assert second.address == first.address
        with torch.no_grad():
            model[0].weight.fill_(3.0)
        ckpt.save(2, state).wait_durable(timeout=60)  # the new daemon asks for the tensors again
        # its plan is the same, so is its layout id (a digest of the slots): no slots needed
        assert slots == [slots[0], 0]
        expected = _snapshot(state)
        _assert_restores(ckpt, 2, state, expected)  # and the load's metadata too


def test_a_plan_load_with_an_unknown_fingerprint_and_no_tensors_is_refused(daemon: DaemonProcess) -> None:
    with CheckpointClient("fp", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": _model()}).wait_durable(timeout=60)
        request = pb.PlanLoadRequest(who=ckpt._rpc.who, latest=True, fingerprint="f" * 64, decodes=True, decodes_frames=True)
        with pytest.raises(Exception, match="unknown fingerprint"):
            ckpt._rpc.call(ckpt._rpc.stub.PlanLoad, request)
        request.fingerprint = "f" * 300
        with pytest.raises(Exception, match="at most 256"):
            ckpt._rpc.call(ckpt._rpc.stub.PlanLoad, request)
