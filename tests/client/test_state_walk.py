"""StateWalk and TreeIdentity: a state walked again unchanged is taken over whole (the same
FlatState), and every change gives exactly what a fresh flatten_state gives; StructureCache on
top of it derives the structure again, rebinds or reuses it exactly as for a fresh flatten."""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

from ckptd.client.restore import restore_state
from ckptd.client.state import flatten_state
from ckptd.client.structure import StructureCache, fingerprint_of, fragments_of_state
from ckptd.client.tree import TreeIdentity
from ckptd.client.walk import StateWalk

State = dict[str, Any]


def _state() -> State:
    g = torch.Generator().manual_seed(0)
    model = {f"t{i}": torch.randn(3, 3 if i % 2 else 4, generator=g) for i in range(6)}
    optim = {"state": {f"t{i}": {"exp_avg": torch.randn(3, generator=g), "exp_avg_sq": torch.rand(3, generator=g)} for i in range(3)}}
    extra = {"epoch": 3, "one": 1.0, "tags": ["a", ("b", 2)], "t": [torch.zeros(2), None], "by_id": {1: "x"}}
    return {"model": model, "optimizer": optim, "extra": extra, "step": torch.tensor(7)}


def _same_flat(a: Any, b: Any) -> None:
    assert [(e.name, e.kind, e.aliases, e.placement, e.frozen, e.per_rank) for e in a.tensors] == [
        (e.name, e.kind, e.aliases, e.placement, e.frozen, e.per_rank) for e in b.tensors
    ]
    assert all(x.tensor is y.tensor for x, y in zip(a.tensors, b.tensors))
    assert a.extras_json == json.dumps(b.extras, allow_nan=False) and a.fresh == b.fresh and a.rank == b.rank


def _t(state: State, name: str = "t1") -> torch.Tensor:
    return state["model"][name]


def _set_data(state: State) -> None:
    _t(state).data = torch.ones(3, 3)


def _set_(state: State) -> None:
    _t(state).set_(torch.ones(3, 3))


def _resize(state: State) -> None:
    _t(state).resize_(2, 3)


def _dtype(state: State) -> None:
    _t(state).data = _t(state).data.double()


def _transpose(state: State) -> None:
    _t(state).t_()  # square: the same shape, other strides


# Changes that keep every container and tensor object: only the structure's check sees them.
IN_PLACE: dict[str, Callable[[State], None]] = {
    "storage swapped (.data)": _set_data,
    "storage swapped (set_)": _set_,
    "resized": _resize,
    "dtype changed (.data)": _dtype,
    "strides changed (t_)": _transpose,
}

# Changes of the containers or their values: the walk sees them.
OF_THE_TREE: dict[str, Callable[[State], None]] = {
    "tensor replaced": lambda s: s["model"].__setitem__("t1", torch.ones(3, 3)),
    "key added": lambda s: s["model"].__setitem__("t9", torch.ones(2)),
    "key removed": lambda s: s["model"].pop("t2"),
    "key renamed": lambda s: s["model"].__setitem__("u", s["model"].pop("t2")),
    "keys reordered": lambda s: s["model"].__setitem__("t0", s["model"].pop("t0")),
    "inner dict replaced": lambda s: s["optimizer"]["state"].__setitem__("t0", {"exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}),
    "inner field added": lambda s: s["optimizer"]["state"]["t1"].__setitem__("step", torch.tensor(1.0)),
    "state dict replaced": lambda s: s["optimizer"].__setitem__("state", {"t0": {"exp_avg": torch.ones(3)}}),
    "list item replaced": lambda s: s["extra"]["t"].__setitem__(0, torch.ones(2)),
    "list appended": lambda s: s["extra"]["tags"].append("c"),
    "scalar changed": lambda s: s["extra"].__setitem__("epoch", 4),
    "float to an equal int": lambda s: s["extra"].__setitem__("one", 1),
    "int key to an equal bool, in place": lambda s: (s["extra"]["by_id"].pop(1), s["extra"]["by_id"].__setitem__(True, "x")),
    "top tensor replaced": lambda s: s.__setitem__("step", torch.tensor(8)),
    "top key added": lambda s: s.__setitem__("ema", {"w": torch.ones(2)}),
    "top key removed": lambda s: s.pop("extra"),
    "same keys, one value moved between dicts": lambda s: s["optimizer"]["state"]["t1"].__setitem__(
        "exp_avg", s["optimizer"]["state"]["t0"].pop("exp_avg")
    ),
}


def test_an_unchanged_state_is_the_same_flat_state_and_structure() -> None:
    state = _state()
    walk, cache = StateWalk(), StructureCache()
    first = walk.flatten(state, rank=0, for_save=True)
    structure = cache.for_state(first, None, None)
    _same_flat(first, flatten_state(state, rank=0, validate=False))
    for _ in range(3):
        for e in first.tensors:
            e.tensor.add_(1)  # values change, nothing else
        again = walk.flatten(state, rank=0)
        assert again is first
        assert cache.for_state(again, None, None) is structure
    assert (cache.builds, cache.rebinds) == (1, 0)


@pytest.mark.parametrize("change", list(OF_THE_TREE.values()), ids=list(OF_THE_TREE))
def test_every_change_of_the_tree_flattens_as_a_fresh_walk(change: Callable[[State], None]) -> None:
    state = _state()
    walk, cache = StateWalk(), StructureCache()
    before = walk.flatten(state, rank=0)
    cache.for_state(before, None, None)
    change(state)
    after = walk.flatten(state, rank=0)
    assert after is not before
    fresh = flatten_state(state, rank=0, validate=False)
    _same_flat(after, fresh)
    _structure_is_fresh(cache, after)


@pytest.mark.parametrize("change", list(IN_PLACE.values()), ids=list(IN_PLACE))
def test_every_change_of_a_tensor_in_place_is_seen_by_the_structure(change: Callable[[State], None]) -> None:
    state = _state()
    walk, cache = StateWalk(), StructureCache()
    before = cache.for_state(walk.flatten(state, rank=0), None, None)
    change(state)
    flat = walk.flatten(state, rank=0)
    _same_flat(flat, flatten_state(state, rank=0, validate=False))
    after = cache.for_state(flat, None, None)
    assert after is not before
    _structure_is_fresh(cache, flat)


def _structure_is_fresh(cache: StructureCache, flat: Any) -> None:
    structure = cache.for_state(flat, None, None)
    fragments = fragments_of_state(flat)
    assert structure.fingerprint == fingerprint_of(flat, fragments)
    assert [(e.name, f.box) for e, f in structure.fragments] == [(e.name, f.box) for e, f in fragments]
    for (_, a), (_, b) in zip(structure.fragments, fragments):
        assert (a.local.data_ptr(), a.local.dtype, a.local.shape, a.local.stride()) == (b.local.data_ptr(), b.local.dtype, b.local.shape, b.local.stride())


def test_values_that_can_change_unseen_are_walked_every_time() -> None:
    array = np.zeros(3)
    state: State = {"extra": {"a": array, "t": torch.zeros(2)}, "other": {"t": torch.zeros(1)}}
    walk = StateWalk()
    first = walk.flatten(state, rank=0)
    array[0] = 5.0  # in place: the same object
    second = walk.flatten(state, rank=0)
    assert second is not first and second.extras_json == json.dumps(flatten_state(state, rank=0).extras)
    assert walk.reused == 1  # "other" only


def test_modules_optimizers_and_rng_are_asked_every_time_and_plain_keys_taken_over() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    state: State = {"model": model, "optimizer": opt, "extra": {"w": torch.zeros(2)}}
    walk = StateWalk()
    last = None
    for rng in (False, True, True):
        flat = walk.flatten(state, rank=2, rng=rng, for_save=True)
        fresh = flatten_state(state, rank=2, rng=rng, for_save=True, validate=False)
        assert flat is not last and [e.name for e in flat.tensors] == [e.name for e in fresh.tensors]
        assert flat.extras.keys() == fresh.extras.keys() and flat.extras["optimizer"] == fresh.extras["optimizer"]
        assert any(e.name.startswith("rng/rank2/") for e in flat.tensors) == rng
        last = flat
    assert walk.reused == 2  # "extra", in the second and third walk


class _Sub(torch.Tensor):
    pass


def _set_c(tree: Any) -> None:
    tree["b"]["c"] = 0


def _append(tree: Any) -> None:
    tree[1].append(3)


def _replace_tensor(tree: Any) -> None:
    tree[0] = torch.zeros(1)


@pytest.mark.parametrize(
    ("tree", "change"),
    [
        ({"a": [1, (2.0, "x")], "b": {"c": None, 1: b"y"}}, _set_c),
        ((1, [2]), _append),
        ([torch.zeros(1), np.float32(1.0), True], _replace_tensor),
    ],
)
def test_a_tree_identity_holds_for_the_same_unchanged_tree_only(tree: Any, change: Callable[[Any], None]) -> None:
    identity = TreeIdentity.of(tree)
    assert identity is not None and identity.holds(tree)
    assert not identity.holds(tuple([*tree]) if isinstance(tree, tuple) else copy.copy(tree))  # equal, not the same
    change(tree)
    assert not identity.holds(tree)


@pytest.mark.parametrize("tree", [{"a": np.zeros(2)}, [{"a": 1}.keys()], {"a": nn.Linear(1, 1)}, [torch.zeros(1).as_subclass(_Sub)], OrderedDict(a=1)])
def test_a_tree_with_what_can_change_unseen_has_no_identity(tree: Any) -> None:
    assert TreeIdentity.of(tree) is None


def test_a_restore_of_the_checkpoints_own_extras_puts_nothing_back() -> None:
    state = _state()
    walk = StateWalk()
    flat = walk.flatten(state, rank=0)
    inner = state["optimizer"]["state"]
    restore_state(state, flat, flat.extras)  # the client passes targets.extras when the JSON is theirs
    assert state["optimizer"]["state"] is inner and walk.flatten(state, rank=0) is flat
    parsed = json.loads(flat.extras_json)  # equal, but not the targets' own: put back as always
    restore_state(state, flat, parsed)
    assert state["optimizer"]["state"] is not inner and state["optimizer"]["state"] == inner
