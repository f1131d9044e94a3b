"""StructureCache: what a save derives from a state's structure is reused exactly while the
structure stays the same, and derived again on every change that invalidates it."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from ckptd.client.layout import LayoutRules, RankCoords, Rule, Split
from ckptd.client.state import flatten_state
from ckptd.client.structure import StructureCache, fingerprint_of, fragments_of_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def _flat(state: dict[str, Any], rng: bool = False):
    return flatten_state(state, rank=0, rng=rng, for_save=True, validate=False)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_an_unchanged_state_reuses_the_same_structure_object() -> None:
    model = _model()
    cache = StructureCache()
    first = cache.for_state(_flat({"model": model}), None, None)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # values change, structure does not
    second = cache.for_state(_flat({"model": model}), None, None)
    assert second is first
    assert (cache.builds, cache.rebinds) == (1, 0)


def test_the_cached_structure_equals_one_derived_from_scratch() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    state = {"model": model, "optimizer": opt}
    cache = StructureCache()
    cache.for_state(_flat(state), None, None)
    _step(model, opt)
    cached = cache.for_state(_flat(state), None, None)
    flat = _flat(state)
    fresh = fragments_of_state(flat)
    assert cached.fingerprint == fingerprint_of(flat, fresh)
    assert [(e.name, f.box) for e, f in cached.fragments] == [(e.name, f.box) for e, f in fresh]
    for (_, a), (_, b) in zip(cached.fragments, fresh):
        assert a.local.data_ptr() == b.local.data_ptr() and a.local.shape == b.local.shape


def _add_parameter(state: dict[str, Any]) -> None:
    state["model"].extra = nn.Linear(4, 4)


def _resize(state: dict[str, Any]) -> None:
    state["model"][2] = nn.Linear(8, 5)


def _to_bf16(state: dict[str, Any]) -> None:
    state["model"].to(torch.bfloat16)


def _new_key(state: dict[str, Any]) -> None:
    state["extra"] = {"ema": torch.zeros(3)}


def _transpose_buffer(state: dict[str, Any]) -> None:
    state["extra"] = {"w": torch.zeros(4, 3).t()}  # same shape as before, other strides


@pytest.mark.parametrize(
    "change",
    [_add_parameter, _resize, _to_bf16, _new_key],
    ids=["new parameter", "resized tensor", "dtype change", "new state key"],
)
def test_every_structural_change_derives_the_structure_again(change: Callable[[dict[str, Any]], None]) -> None:
    state: dict[str, Any] = {"model": _model()}
    cache = StructureCache()
    before = cache.for_state(_flat(state), None, None)
    change(state)
    after = cache.for_state(_flat(state), None, None)
    assert after is not before and cache.builds == 2
    assert after.fingerprint != before.fingerprint
    assert after.fingerprint == fingerprint_of(_flat(state), fragments_of_state(_flat(state)))


def test_other_strides_of_the_same_shape_are_a_new_structure() -> None:
    state: dict[str, Any] = {"extra": {"w": torch.zeros(3, 4)}}
    cache = StructureCache()
    before = cache.for_state(_flat(state), None, None)
    _transpose_buffer(state)
    assert cache.for_state(_flat(state), None, None) is not before and cache.builds == 2


def test_optimizer_state_appearing_after_the_first_step_is_taken_from_the_live_optimizer() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optimizer": opt}
    cache = StructureCache()
    fresh = cache.for_state(_flat(state), None, None)  # a fresh optimizer: zero moments made for the save
    _step(model, opt)
    stepped = cache.for_state(_flat(state), None, None)
    assert stepped is not fresh and stepped.fingerprint == fresh.fingerprint  # same names and shapes
    views = {e.name: f.local for e, f in stepped.fragments}
    live = opt.state[model[0].weight]["exp_avg"]
    assert views["optimizer/state/0.weight/exp_avg"].data_ptr() == live.data_ptr()
    assert torch.equal(views["optimizer/state/0.weight/exp_avg"], live) and live.abs().sum() > 0


def test_an_optimizer_whose_state_changes_fields_is_a_new_structure() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state
    state = {"model": model, "optimizer": opt}
    cache = StructureCache()
    before = cache.for_state(_flat(state), None, None)
    state["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, state["optimizer"])  # momentum buffers appear
    after = cache.for_state(_flat(state), None, None)
    assert cache.builds == 2 and after.fingerprint != before.fingerprint
    assert any(e.name.endswith("/momentum_buffer") for e, _ in after.fragments)


def test_a_new_layout_is_a_new_structure() -> None:
    state = {"model": {"w": torch.zeros(4, 6)}}
    rules = LayoutRules([Rule(r"w", Split(dim=1))])
    cache = StructureCache()
    whole = cache.for_state(_flat(state), None, None)
    split = cache.for_state(_flat(state), rules, RankCoords(1, 2))
    other_rank = cache.for_state(_flat(state), rules, RankCoords(0, 2))
    assert len({whole.fingerprint, split.fingerprint, other_rank.fingerprint}) == 3
    assert split.fragments[0][1].box.offsets == (0, 6) and other_rank.fragments[0][1].box.offsets == (0, 0)
    assert cache.builds == 3


def test_a_replaced_parameter_is_rebound_and_keeps_the_fingerprint() -> None:
    model = _model()
    state = {"model": model}
    cache = StructureCache()
    before = cache.for_state(_flat(state), None, None)
    model[0].weight = nn.Parameter(torch.ones(8, 8))  # same structure, new memory
    after = cache.for_state(_flat(state), None, None)
    assert after is not before and (cache.builds, cache.rebinds) == (1, 1)
    assert after.fingerprint == before.fingerprint
    views = {e.name: f.local for e, f in after.fragments}
    assert views["model/0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert torch.equal(views["model/0.weight"], torch.ones(8, 8))
    kept = {e.name: f.local for e, f in before.fragments}
    assert views["model/2.bias"] is kept["model/2.bias"]  # entries that did not move keep their views


def test_rng_state_made_anew_each_save_is_rebound_not_rebuilt() -> None:
    state = {"model": _model()}
    cache = StructureCache()
    first = cache.for_state(_flat(state, rng=True), None, None)
    for _ in range(3):
        torch.rand(5)  # moves the generator
        latest = cache.for_state(_flat(state, rng=True), None, None)
    assert cache.builds == 1 and latest.fingerprint == first.fingerprint
    rng = next(f.local for e, f in latest.fragments if e.name.startswith("rng/"))
    assert torch.equal(rng, torch.get_rng_state())


def test_an_invalid_state_is_refused_when_its_structure_is_derived() -> None:
    cache = StructureCache()
    with pytest.raises(ValueError, match="control characters"):
        cache.for_state(_flat({"extra": {"a\x01b": torch.zeros(2)}}), None, None)
    with pytest.raises(ValueError, match="meta device"):
        cache.for_state(_flat({"extra": {"w": torch.empty(2, device="meta")}}), None, None)
    with pytest.raises(TypeError, match="to_dense"):
        cache.for_state(_flat({"extra": {"w": torch.zeros(3, 3).to_sparse()}}), None, None)


class _Position:
    """A stateful object whose state_dict makes a new tensor at each call (as torch's RNG state)."""

    def __init__(self) -> None:
        self.at = 0

    def state_dict(self) -> dict[str, Any]:
        return {"at": torch.tensor([self.at])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = int(state["at"])


# issue 30 finding 3
def test_issue30_finding3_a_ranks_own_tensor_made_anew_each_save_keeps_its_per_rank_name() -> None:
    position = _Position()
    cache = StructureCache()
    names = []
    for at in (1, 2):
        position.at = at
        structure = cache.for_state(flatten_state({"sampler": position}, rank=3, for_save=True, validate=False), None, None)
        names.append([(f.name, f.per_rank, int(f.local)) for _, f in structure.fragments])
    assert names == [[("sampler/rank3/at", True, 1)], [("sampler/rank3/at", True, 2)]]
    assert (cache.builds, cache.rebinds) == (1, 1)
    other_rank = StructureCache().for_state(flatten_state({"sampler": position}, rank=0, for_save=True, validate=False), None, None)
    assert other_rank.fingerprint != structure.fingerprint  # the rank's names are in the plan the daemon caches


def _shards_state() -> dict[str, Any]:
    """A rank's state of row blocks (LocalShards) beside whole tensors and its own extras tensor."""
    from ckptd.client.shards import LocalShard

    return {
        "model": {f"w{i}": LocalShard(torch.zeros(2, 3), (2 * (i % 3), 0), (6, 3)) for i in range(5)} | {"bias": torch.zeros(3)},
        "optimizer": {"exp_avg": LocalShard(torch.zeros(4), (4,), (8,)), "step": torch.tensor(3.0)},
        "extra": {"noise": torch.zeros(2)},
    }


def test_a_state_of_local_shards_is_built_as_layout_state_describes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-pass build (plain tensors, LocalShards' boxes) equals the general path's."""
    from ckptd.client import structure

    flat = flatten_state(_shards_state(), rank=1, validate=False)
    with monkeypatch.context() as patched:
        patched.setattr(structure, "fragments_of_state", lambda *a: pytest.fail("the general path was taken"))
        built = StructureCache().for_state(flat, None, None)
    general = fragments_of_state(flat)
    assert [(e.name, f.name, f.global_shape, f.box, f.local.data_ptr()) for e, f in built.fragments] == [
        (e.name, f.name, f.global_shape, f.box, f.local.data_ptr()) for e, f in general
    ]
    assert built.fingerprint == fingerprint_of(flat, general)
    assert {f.name for _, f in built.fragments} >= {"extra/rank1/noise", "model/w4"}


# a restarted trainer's load names its tensors by the fingerprint: a plain state's fragments are
# made only when asked for (a save's slots, metadata resent), and are those of the general path
def test_a_plain_states_fragments_are_made_when_first_asked_for_and_its_targets_are_theirs() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    flat = _flat({"model": model, "optimizer": opt})
    structure = StructureCache().for_state(flat, None, None)
    assert "fragments" not in vars(structure)  # not made yet
    fresh = fragments_of_state(flat)
    assert structure.fingerprint == fingerprint_of(flat, fresh)
    assert [t.data_ptr() for t in structure.targets] == [f.local.data_ptr() for _, f in fresh]
    assert [(e.name, f.box, f.global_shape) for e, f in structure.fragments] == [(e.name, f.box, f.global_shape) for e, f in fresh]
    assert structure.fragments is structure.fragments  # made once


def test_fingerprint_first_is_the_fingerprint_the_first_build_gives_and_that_build_reuses_its_digest() -> None:
    state = {"model": {"a": torch.zeros(3, 2), "b": torch.ones(4)}}
    flat = _flat(state)
    cache = StructureCache()
    first = cache.fingerprint_first(flat, None, None)
    built = cache.for_state(flat, None, None)
    assert first == built.fingerprint == StructureCache().for_state(flat, None, None).fingerprint == fingerprint_of(flat, fragments_of_state(flat))
    assert cache.builds == 1
    assert cache.fingerprint_first(_flat(state), None, None) is None  # a structure is known: for_state alone tells


@pytest.mark.parametrize("case", ["rules", "per_rank", "another_flat", "fails_checks"])
def test_fingerprint_first_says_nothing_or_is_not_trusted_when_the_build_may_differ(case: str) -> None:
    state: dict[str, Any] = {"model": {"w": torch.zeros(4, 6)}}
    cache = StructureCache()
    if case == "rules":
        assert cache.fingerprint_first(_flat(state), LayoutRules([Rule(r"w", Split(dim=1))]), RankCoords(0, 2)) is None
    elif case == "per_rank":
        flat = flatten_state({"extra": {"ema": torch.zeros(2)}}, rank=1, validate=False)  # a tensor under "extra": the rank's own
        assert cache.fingerprint_first(flat, None, None) is None  # the per-rank names are the fragments'
    elif case == "another_flat":
        first = cache.fingerprint_first(_flat(state), None, None)
        state["model"]["w"] = torch.zeros(4, 7)
        built = cache.for_state(_flat(state), None, None)  # not the flat state fingerprint_first saw: built from scratch
        assert built.fingerprint != first and built.fingerprint == StructureCache().for_state(_flat(state), None, None).fingerprint
    else:
        state["model"]["bad name\n"] = torch.zeros(1)
        flat = _flat(state)
        assert cache.fingerprint_first(flat, None, None) is not None
        with pytest.raises(ValueError, match="bad name"):
            cache.for_state(flat, None, None)  # the checks still run, and raise
