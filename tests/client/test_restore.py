"""restore_state (ckptd.client.restore) when the state being loaded holds other tensors than the
rank's tree of the checkpoint: a tensor without a place is refused when strict, left out (and
the state's own items kept) otherwise, as load(strict=False) and load(strict="missing") promise;
tensors the tree does not name (other ranks saved them) stay in the state's dicts."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ckptd.client.restore import restore_state
from ckptd.client.state import FlatState, flatten_state


def _transfer(saved: FlatState, targets: FlatState) -> dict[str, Any]:
    """The transport: each target filled from the saved tensor of its name; extras as JSON."""
    by_name = {e.name: e.tensor for e in saved.tensors}
    with torch.no_grad():
        for entry in targets.tensors:
            if entry.name in by_name:
                entry.tensor.copy_(by_name[entry.name])
    return json.loads(json.dumps(saved.extras))


SAVED = {"model": {"a": torch.arange(6.0), "b": torch.ones(2)}, "extra": {"epoch": 3, "scale": torch.tensor(2.0)}}


@pytest.mark.parametrize("strict", [False, "missing"])
def test_a_tensor_the_state_has_no_place_for_is_left_out_when_not_strict(strict: bool | str, caplog: pytest.LogCaptureFixture) -> None:
    state = {"model": {"a": torch.zeros(6)}, "extra": {"epoch": 0}}
    targets = flatten_state(state, rank=0)
    restore_state(state, targets, _transfer(flatten_state(SAVED, rank=0), targets), strict=strict)  # type: ignore[arg-type]
    assert list(state["model"]) == ["a"] and torch.equal(state["model"]["a"], torch.arange(6.0))
    assert state["extra"]["epoch"] == 3 and "scale" not in state["extra"]
    assert "'model/b' has no place in the state being loaded: left out" in caplog.text


def test_a_dict_keeps_its_own_tensors_the_checkpoint_lacks_when_not_strict() -> None:
    own = torch.full((3,), 7.0)
    state = {"model": {"a": torch.zeros(6), "c": own}}
    targets = flatten_state(state, rank=0)
    restore_state(state, targets, _transfer(flatten_state(SAVED, rank=0), targets), strict=False)
    assert list(state["model"]) == ["a", "c"] and state["model"]["c"] is own and torch.equal(own, torch.full((3,), 7.0))


def test_a_tensor_the_state_has_no_place_for_is_refused_when_strict() -> None:
    state = {"model": {"a": torch.zeros(6)}}
    targets = flatten_state(state, rank=0)
    with pytest.raises(ValueError, match="holds a tensor 'model/b' that the state being loaded has no place for.*strict=False"):
        restore_state(state, targets, _transfer(flatten_state(SAVED, rank=0), targets))


def test_a_list_with_a_tensor_the_state_has_no_place_for_is_refused_even_when_not_strict() -> None:
    """Leaving out an item of a list would move the ones after it."""
    saved = flatten_state({"extra": {"items": [torch.ones(1), torch.zeros(2)]}}, rank=0)
    state: dict[str, Any] = {"extra": {"items": [torch.ones(1)]}}
    targets = flatten_state(state, rank=0)
    with pytest.raises(ValueError, match="holds a list with a tensor the state being loaded has no place for"):
        restore_state(state, targets, _transfer(saved, targets), strict=False)


def test_a_dict_keeps_its_tensors_the_ranks_own_tree_does_not_name_when_strict() -> None:
    """Saved by two pipeline ranks, each its own layers; loaded by one rank holding both: the
    fill put both layers' values in, and rank 0's tree names only layer 0 (nested dicts too)."""
    saved = flatten_state({"model": {"layer0": {"w": torch.ones(2)}, "head": torch.ones(1)}, "extra": {"stale": 1}}, rank=0)
    layer1 = torch.full((2,), 2.0)  # filled from rank 1's fragment by the transport
    state: dict[str, Any] = {"model": {"layer0": {"w": torch.zeros(2)}, "layer1": {"w": layer1}, "head": torch.zeros(1)}, "extra": {"stale": 0, "mine": 5}}
    targets = flatten_state(state, rank=0)
    restore_state(state, targets, _transfer(saved, targets))
    assert list(state["model"]) == ["layer0", "layer1", "head"] and state["model"]["layer1"]["w"] is layer1
    assert torch.equal(state["model"]["layer0"]["w"], torch.ones(2)) and torch.equal(state["model"]["head"], torch.ones(1))
    assert state["extra"] == {"stale": 1}  # strict: a plain value the checkpoint lacks goes, as before


def test_a_flat_template_of_a_nested_tree_comes_back_as_the_checkpoint_nests_it() -> None:
    """A template {"0/state/w": t} flattens to the names the saved {"0": {"state": {"w": ...}}}
    does (the Lightning integration loads into one): its items are the tree's tensors under
    another structure, so the dict comes back nested, with no flat key left over."""
    saved = flatten_state({"opt": {"0": {"state": {"w": torch.ones(2)}, "lr": 0.5}}}, rank=0)
    template = {"0/state/w": torch.empty(2)}
    state: dict[str, Any] = {"opt": template}
    targets = flatten_state(state, rank=0)
    restore_state(state, targets, _transfer(saved, targets))
    assert list(state["opt"]) == ["0"] and state["opt"]["0"]["lr"] == 0.5
    assert torch.equal(state["opt"]["0"]["state"]["w"], torch.ones(2))
