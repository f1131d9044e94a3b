"""Every change of a state between saves and loads of one client is seen (issue 33 item 5: a state
walked again unchanged is taken over whole, ckptd.client.walk.StateWalk, and checked by
vectorised comparisons, ckptd.client.structure): against a real daemon, a save after each change
and a load into the zeroed state restore every tensor bit for bit and every other value exactly,
and so does a load after a change made since the save."""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.demo.process import DaemonProcess

State = dict[str, Any]


@pytest.fixture
def daemon(module_daemons: Any) -> DaemonProcess:
    return module_daemons.running("--keep-last", "4")


@pytest.fixture
def client(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[CheckpointClient]:
    job = "".join(c if c.isalnum() else "-" for c in request.node.name)[:120]
    with CheckpointClient(job=job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as c:
        yield c


def _state(seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    model = {f"t{i}": torch.randn(4, 4 if i % 2 else 3, generator=g) for i in range(8)}
    optim = {"state": {f"t{i}": {"exp_avg": torch.randn(5, generator=g), "exp_avg_sq": torch.rand(5, generator=g)} for i in range(4)}}
    extra = {"epoch": 3, "one": 1.0, "tags": ["a", ("b", 2)], "t": [torch.randn(2, generator=g), None], "arr": np.arange(3.0)}
    return {"model": model, "optimizer": optim, "extra": extra, "step": torch.tensor(7)}


def _tensors(value: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {path: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {k: t for key, v in items for k, t in _tensors(v, f"{path}/{key}").items()}


def _snapshot(state: State) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor cloned (dtype, shape and strides kept) and the other values as text."""
    clones = {k: t.clone() for k, t in _tensors(state).items()}
    text = json.dumps(state, sort_keys=True, default=lambda v: v.tolist() if isinstance(v, np.ndarray) else "<tensor>")
    return clones, text


def _zeroed_and_scrambled(state: State) -> None:
    for t in _tensors(state).values():
        t.zero_()
    if "extra" in state:
        state["extra"]["epoch"] = -1
        if "arr" in state["extra"]:
            state["extra"]["arr"][:] = -1.0


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _assert_restored(state: State, expected: tuple[dict[str, torch.Tensor], str], strides: bool = True) -> None:
    clones, text = expected
    live = _tensors(state)
    assert live.keys() == clones.keys()
    for name, want in clones.items():
        got = live[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert not strides or got.stride() == want.stride(), name
        assert torch.equal(_bytes(got), _bytes(want)), name
    assert _snapshot(state)[1] == text


def _t(state: State, name: str = "t1") -> torch.Tensor:
    return state["model"][name]


CHANGES: dict[str, Callable[[State], None]] = {
    "nothing but values": lambda s: [t.add_(1) for t in _tensors(s).values()],
    "tensor replaced": lambda s: s["model"].__setitem__("t1", torch.randn(4, 4)),
    "storage swapped (.data)": lambda s: setattr(_t(s), "data", torch.randn(4, 4)),
    "storage swapped (set_)": lambda s: _t(s).set_(torch.randn(4, 4)),
    "resized": lambda s: _t(s).resize_(2, 4).normal_(),
    "dtype changed (.data)": lambda s: setattr(_t(s), "data", _t(s).data.double()),
    "strides changed (t_)": lambda s: _t(s).t_(),
    "key added": lambda s: s["model"].__setitem__("t9", torch.randn(2)),
    "key removed": lambda s: s["model"].pop("t2"),
    "key renamed": lambda s: s["model"].__setitem__("u", s["model"].pop("t2")),
    "optimizer state replaced": lambda s: s["optimizer"].__setitem__("state", {"t0": {"exp_avg": torch.randn(5), "step": torch.tensor(2.0)}}),
    "optimizer field added": lambda s: s["optimizer"]["state"]["t1"].__setitem__("step", torch.tensor(1.0)),
    "list item replaced": lambda s: s["extra"]["t"].__setitem__(0, torch.randn(2)),
    "scalar changed": lambda s: s["extra"].__setitem__("epoch", 4),
    "float to an equal int": lambda s: s["extra"].__setitem__("one", 1),
    "array changed in place": lambda s: s["extra"]["arr"].__setitem__(0, 9.0),
    "top tensor replaced": lambda s: s.__setitem__("step", torch.tensor(8)),
    "top key added": lambda s: s.__setitem__("ema", {"w": torch.randn(3)}),
    "top key removed": lambda s: s.pop("extra"),
}


@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_a_save_after_a_change_restores_exactly(client: CheckpointClient, change: Callable[[State], None]) -> None:
    state = _state(1)
    client.save(1, state).wait_durable()
    _zeroed_and_scrambled(state)
    client.load(state)  # walked, checked and planned: the change below meets warm caches
    change(state)
    expected = _snapshot(state)
    client.save(2, state).wait_durable()
    for _ in range(2):  # the second load takes the first's walk over
        _zeroed_and_scrambled(state)
        assert client.load(state) == 2
        _assert_restored(state, expected)


@pytest.mark.parametrize("change", [c for c in CHANGES if c not in ("key added", "key removed", "key renamed", "top key added", "top key removed", "resized", "dtype changed (.data)", "optimizer state replaced", "optimizer field added", "float to an equal int")])
def test_a_load_after_a_change_since_the_save_fills_the_changed_state(client: CheckpointClient, change: str) -> None:
    state = _state(2)
    expected = _snapshot(state)
    client.save(1, state).wait_durable()
    client.load(state)
    CHANGES[change](state)
    _zeroed_and_scrambled(state)
    assert client.load(state) == 1
    _assert_restored(state, expected, strides=False)


def test_a_load_into_a_resized_or_retyped_tensor_converts_or_refuses(client: CheckpointClient) -> None:
    state = _state(3)
    original = _t(state).clone()
    client.save(1, state).wait_durable()
    client.load(state)
    _t(state).data = _t(state).data.double()
    _t(state).zero_()
    client.load(state)
    assert _t(state).dtype == torch.float64 and torch.equal(_t(state), original.double())
    _t(state).resize_(2, 4)
    with pytest.raises(Exception, match="t1"):
        client.load(state)


def test_repeated_saves_and_loads_of_an_unchanged_state_walk_it_once(client: CheckpointClient) -> None:
    state = _state(4)
    del state["extra"]["arr"]  # an array is walked every time: none here
    inner = state["optimizer"]["state"]
    for step in range(1, 4):
        for t in _tensors(state).values():
            t.add_(1)
        expected = _snapshot(state)
        client.save(step, state).wait_durable()
        _zeroed_and_scrambled(state)
        state["extra"]["epoch"] = 3  # not scrambled: the checkpoint's extras are the state's own
        assert client.load(state) == step
        _assert_restored(state, expected)
    assert state["optimizer"]["state"] is inner  # nothing put back: the containers are the same objects
    assert client._save_structures.builds == 1 and client._load_structures.builds == 1
    assert client._walk.reused == 5 * 4  # every key of every walk after the first


def test_a_new_client_restores_exactly_into_a_state_of_other_values(client: CheckpointClient, daemon: DaemonProcess) -> None:
    state = _state(5)
    expected = _snapshot(state)
    client.save(1, state).wait_durable()
    other = copy.deepcopy(state)
    _zeroed_and_scrambled(other)
    with CheckpointClient(job=client.job, address=str(daemon.address), rank=0, world_size=1, on_error="raise") as fresh:
        for _ in range(2):
            assert fresh.load(other) == 1
            _assert_restored(other, expected)
            _zeroed_and_scrambled(other)
