"""CkptdSavePlanner (ckptd.integrations._dcp_plan): its one-walk flattening gives DCP's own
result or steps aside, and its kept local plan is dropped whenever what a plan depends on
changes (shapes, dtypes, keys, DTensor placements), never when only values change."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ckptd.integrations._dcp_plan import CkptdSavePlanner, _flat_mappings


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo group of one rank in this process (DTensors need a mesh), gone after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# issue 31 item 7: the planner's flattening is DCP's, in the same order
def test_a_state_of_nested_mappings_flattens_exactly_as_dcp_flattens_it() -> None:
    state: dict[Any, Any] = {
        "model": OrderedDict((f"layers.{i}.weight", torch.randn(2)) for i in range(3)),
        "optimizer": {"state": {"w": {"exp_avg": torch.ones(2), "step": 3}}, "groups": ({"lr": 0.1},)},
        7: "seven",
        "empty": {},
        "scalar": 1.5,
    }
    flat = _flat_mappings(state)
    assert flat is not None
    theirs = flatten_state_dict(state)
    assert list(flat[0].items()) == list(theirs[0].items())
    assert list(flat[1].items()) == list(theirs[1].items())


# issue 31 item 7: what DCP's flattening rewrites is left to it
@pytest.mark.parametrize(
    "state",
    [
        {"model": {"w": torch.ones(2)}, "lists": [torch.ones(1), {"a": torch.zeros(1)}]},  # DCP walks into lists of tensors
        {"model": {"w": torch.ones(2)}, "names": ["a", "b"]},
        {"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)},  # two paths to one key: DCP raises its own error
    ],
)
def test_states_the_one_walk_does_not_cover_go_to_dcps_flattening(state: dict[str, Any]) -> None:
    assert _flat_mappings(state) is None
    planner = CkptdSavePlanner()
    if "a.b" in state:
        with pytest.raises(ValueError, match="duplicated flatten key"):
            planner.set_up_planner(state, None, True)
        return
    planner.set_up_planner(state, None, True)
    assert planner.mappings == flatten_state_dict(state)[1]


def _plan(planner: CkptdSavePlanner, state: dict[str, Any]) -> SavePlan:
    planner.set_up_planner(state, None, True)
    planner.create_local_plan()
    return planner.plan


def _sizes(plan: SavePlan) -> dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]]:
    out = {}
    for item in plan.items:
        assert item.tensor_data is not None
        out[item.index.fqn] = (tuple(item.tensor_data.size), item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
    return out


# issue 31 item 7: the kept local plan follows the state's structure
def test_the_kept_plan_is_made_again_when_shapes_dtypes_keys_or_placements_change(one_rank: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    state: dict[str, Any] = {"model": {"w": torch.randn(4, 4), "d": distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])}}
    planner = CkptdSavePlanner()
    try:
        first = _plan(planner, state)
        state["model"]["w"].add_(1.0)
        state["model"]["d"] = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])  # new values, same layout
        assert _plan(planner, state) is first and planner.local_plans_built == 1

        changes = [
            ("w", torch.randn(2, 8), ((2, 8), torch.float32, (2, 8))),  # shape
            ("w", torch.randn(2, 8, dtype=torch.float64), ((2, 8), torch.float64, (2, 8))),  # dtype
            ("d", distribute_tensor(torch.randn(4, 6), mesh, [Replicate()]), ((4, 6), torch.float32, (4, 6))),  # placements
            ("d", distribute_tensor(torch.randn(6, 6), mesh, [Replicate()]), ((6, 6), torch.float32, (6, 6))),  # global shape
        ]
        for built, (key, value, expected) in enumerate(changes, start=2):
            state["model"][key] = value
            plan = _plan(planner, state)
            assert planner.local_plans_built == built, key
            assert _sizes(plan)[f"model.{key}"] == expected
            assert _plan(planner, state) is plan and planner.local_plans_built == built  # kept again

        state["model"]["new"] = {"nested": torch.zeros(3)}  # a key more, one level deeper
        plan = _plan(planner, state)
        assert planner.local_plans_built == len(changes) + 2
        assert _sizes(plan)["model.new.nested"] == ((3,), torch.float32, (3,))
        assert plan.planner_data == flatten_state_dict(state)[1]  # DCP's mappings, for its load
    finally:
        planner.forget()
