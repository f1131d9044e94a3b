"""restore_state (ckptd.client.restore) when the state being loaded holds fewer tensors than the
checkpoint's tree: refused when strict, left out (and the state's own items kept) otherwise, as
load(strict=False) and load(strict="missing") promise."""

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
