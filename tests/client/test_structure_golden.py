"""A new client's first walk and structure build (issue 33, item 5).

The fingerprint of a structure is a contract: the daemon keys a rank's metadata by it, and old
daemons and plans rely on it, so it must never drift. The digests below were computed before the
first structure build got its fast paths (at 94a97ec); any change to how a fingerprint is
encoded shows up here. The fast paths (plain tensors added a dict at a time, a plain state's
checks, fragments and fingerprint from whole lists) must give what the general paths give:
the same entries, extras, fragments and fingerprint, and the same error for a bad state."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import pytest
import torch
from torch import nn

from ckptd.client import state as state_module
from ckptd.client import structure as structure_module
from ckptd.client import tree
from ckptd.client.layout import Fragment, Fused, LayoutRules, PaddedVocab, RankCoords, Replicated, Rule, Split, layout_state
from ckptd.client.shards import LocalShard, LocalShards
from ckptd.client.state import Entries, FlatState, TensorEntry, _check_tensor, flatten_state, flatten_value
from ckptd.client.structure import StructureCache, fingerprint_of
from ckptd.client.walk import StateWalk
from ckptd.common.names import InvalidNameError, check_tensor_name, kind_of, tensor_names_valid


def plain_state() -> dict[str, Any]:
    """Plain tensors and parameters of several dtypes and shapes (0-dim, empty, transposed),
    optimizer-like state and an extras key (per-rank tensors)."""
    return {
        "model": {
            "w": nn.Parameter(torch.zeros(3, 4)),
            "b": torch.zeros(4),
            "scalar": torch.tensor(1.0),
            "empty": torch.zeros(0, 5),
            "half": torch.zeros(2, 2, dtype=torch.float16),
            "bf": torch.zeros(7, dtype=torch.bfloat16),
            "ids": torch.arange(3),
            "mask": torch.zeros(2, 3, dtype=torch.bool),
            "fp8": torch.zeros(4, dtype=torch.float8_e4m3fn),
            "t": torch.zeros(4, 3).t(),
            "deep": torch.zeros(1, 2, 3, 4, 5),
        },
        "optimizer": {"state": {"w": {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "extra": {"ema": [torch.zeros(2)], "n": 3},
    }


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.qkv = nn.Linear(4, 12, bias=False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)
        self.norm.weight.requires_grad_(False)
        self.register_buffer("pos", torch.zeros(6))


def mixed_state() -> dict[str, Any]:
    """A module with a tied weight, a frozen parameter and a buffer, LocalShard(s) and per-rank extras."""
    return {
        "model": _Tied(),
        "sharded": {"a": LocalShard(torch.zeros(2, 3), (2, 0), (8, 3)), "many": LocalShards([LocalShard(torch.zeros(1, 3), (0, 0), (4, 3)),
                                                                                             LocalShard(torch.zeros(1, 3), (3, 0), (4, 3))])},
        "extra": {"t": torch.zeros(2)},
    }


RULES = [
    Rule(r"qkv\.weight", Fused(0, (8, 8, 8))),
    Rule(r"(embed|head)\.weight", PaddedVocab(0, 9)),
    Rule(r"norm\..*", Replicated()),
    Rule(r"pos", Split(0)),
]

GOLDEN = {
    ("plain", 0): "7aff81da4975c32e22f85fc25bfe3fbf3d4315f8c0a693e3ebe8a163b6ac50e5",
    ("plain", 1): "bcd84853489a2903e6efa6c96d175b5f00ee32c98b105bb8801ff63144f9b34d",
    ("mixed", 0): "a0c95886df01baaf8feb0a6fded72abd04b2df7bf38d3a8699ca5379db075efa",
    ("mixed", 1): "b859dbfc6470acbbef5c29ec2c76d129c53c065c2b3582191c6f129b81a57c8f",
    ("mixed-rules", 0): "da08ad620746f145bc3af820000f612b6b541aca79162aa58e99bac45161c76d",
    ("mixed-rules", 1): "d5c7eeade44687be3ca7b2acd7cb8e8c70d0390106dbd45662e6582be71ebfd6",
}


@pytest.mark.parametrize("case", sorted(GOLDEN))
@pytest.mark.parametrize("walk", [False, True], ids=["flatten_state", "StateWalk"])
def test_the_fingerprint_of_a_fixed_state_never_drifts(case: tuple[str, int], walk: bool) -> None:
    kind, rank = case
    state = plain_state() if kind == "plain" else mixed_state()
    rules, coords = (LayoutRules(RULES), RankCoords(rank, 2)) if kind == "mixed-rules" else (None, None)
    flat = StateWalk().flatten(state, rank=rank) if walk else flatten_state(state, rank=rank, validate=False)
    assert StructureCache().for_state(flat, rules, coords).fingerprint == GOLDEN[case]


# ------------------------------------------------------------------ the fast paths equal the general ones


def _reference(flat: FlatState, rules: LayoutRules | None, coords: RankCoords | None) -> tuple[tuple[tuple[TensorEntry, Fragment], ...], str]:
    """What a first build derived before its fast paths: every name checked one by one, the
    fragments from layout_state, the fingerprint as first written (one f-string per fragment)."""
    for entry in flat.tensors:
        for name in (entry.name, *entry.aliases):
            _check_tensor(name, entry.tensor)
    fragments = tuple((layout.entry, f) for layout in layout_state(flat, rules, coords) for f in layout.fragments)
    meta = [[e.name, e.kind, str(e.tensor.dtype), list(e.tensor.shape), list(e.aliases), e.frozen, e.per_rank] for e in flat.tensors]
    digest = hashlib.sha256(json.dumps(meta, separators=(",", ":")).encode()).hexdigest()
    if [f.name for _, f in fragments] == [e.name for e in flat.tensors] and all(
        f.global_shape == f.box.lengths == tuple(e.tensor.shape) and not any(f.box.offsets) for e, (_, f) in zip(flat.tensors, fragments)
    ):  # each tensor whole under its name: the lines would say nothing the digest does not
        return fragments, hashlib.sha256(f"whole:{digest}".encode()).hexdigest()
    h = hashlib.sha256(digest.encode())
    for _, f in fragments:
        h.update(f"{f.name}|{f.global_shape}|{f.box.offsets}|{f.box.lengths}\n".encode())
    return fragments, h.hexdigest()


def _one_by_one(state: dict[str, Any], rank: int) -> FlatState:
    """flatten_state(validate=False) as it was: every tensor handed to the adder one by one."""
    entries = Entries(validate=False)
    extras = {}
    for key in sorted(state):
        value = state[key]
        if isinstance(value, dict):
            extras[key] = tree.encode(value, key, entries.adder(kind_of(key), per_rank=kind_of(key) == "extra"))
        else:
            extras[key] = flatten_value(state, key, entries, False, [])
    return FlatState(tuple(entries.entries), {k: v for k, v in extras.items() if v is not None}, (), rank)


def _entry_fields(e: TensorEntry) -> tuple[Any, ...]:
    t = e.tensor  # a module's state_dict() gives new tensor objects of the same memory on each call
    return (type(e), e.name, e.kind, type(t), t.data_ptr(), t.shape, t.stride(), e.aliases, e.placement, e.frozen, e.per_rank)


def _fragment_fields(pair: tuple[TensorEntry, Fragment]) -> tuple[Any, ...]:
    entry, f = pair
    return (_entry_fields(entry), f.name, f.global_shape, type(f.global_shape), f.box, f.local.data_ptr(), f.local.shape, f.local.stride(), f.per_rank)


def _odd_state() -> dict[str, Any]:
    """Dicts the batched paths must leave to the general one, or treat exactly like it."""
    t = torch.zeros
    return {
        "model": {"w": nn.Parameter(t(2, 3)), "tagged": {"__tensor__": t(1)}, "mixed": {"a": t(2), "n": 1}, "empty": {}},
        "optimizer": {
            "state": {"w": {"exp_avg": t(2, 3), "step": t(())}, "v": {}, "tag": {"__tuple__": t(3)}},
            "by_id": {0: {"exp_avg": t(2)}},
            "nested": {"a": {"b": {"c": t(1)}}},
            "list": [t(2), {"x": t(1)}],
        },
        "extra": {"ema": {"w": t(4)}, "scalars": {"a": t(())}},
    }


STATES = {
    "plain": plain_state,
    "mixed": mixed_state,
    "odd": _odd_state,
    "counts": lambda: bench_counts_state(60),
}


def bench_counts_state(n: int) -> dict[str, Any]:
    """bench_counts.counts_state's layout (weights and AdamW moments of spread sizes), small."""
    model = {f"layer{i}.weight": torch.zeros(i % 7 + 1) for i in range(n // 3)}
    optim = {name: {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)} for name, w in model.items()}
    return {"model": model, "optimizer": {"state": optim}}


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", sorted(STATES))
def test_the_batched_walk_flattens_as_one_tensor_at_a_time(kind: str, rank: int) -> None:
    state = STATES[kind]()
    reference = _one_by_one(state, rank)
    for flat in (StateWalk().flatten(state, rank=rank), flatten_state(state, rank=rank, validate=False)):
        assert [_entry_fields(e) for e in flat.tensors] == [_entry_fields(e) for e in reference.tensors]
        assert flat.extras == reference.extras
        assert flat.extras_json == json.dumps(reference.extras, allow_nan=False)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", sorted(STATES))
def test_the_first_build_of_a_plain_state_is_the_general_one(kind: str, rank: int) -> None:
    state = STATES[kind]()
    rules, coords = (LayoutRules(RULES), RankCoords(rank, 2)) if kind == "mixed" else (None, None)
    flat = StateWalk().flatten(state, rank=rank)
    for r, c in ((None, None), (rules, coords)):
        fragments, fingerprint = _reference(flat, r, c)
        built = StructureCache().for_state(flat, r, c)
        assert built.fingerprint == fingerprint == fingerprint_of(flat, fragments)
        assert [_fragment_fields(p) for p in built.fragments] == [_fragment_fields(p) for p in fragments]
        assert built.pointers == [e.tensor.data_ptr() for e in flat.tensors]


def _bad(name: str) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        t = torch.zeros
        return {
            "control": {"model": {"a": t(1), "b\x01": t(1)}},
            "reserved": {"model": {"a": t(1), "__metadata__": t(1)}},
            "reserved-key": {"__metadata__": t(1)},
            "long": {"model": {"a": t(1), "x" * 2000: t(1)}},
            "dtype": {"model": {"a": t(1), "c": t(2, dtype=torch.complex64)}},
            "meta": {"model": {"a": t(1), "m": torch.empty(3, device="meta")}},
            "sparse": {"model": {"a": t(1), "s": t(3, 3).to_sparse()}},
            "nested": {"model": {"a": t(1), "n": torch.nested.nested_tensor([t(2), t(3)])}},  # strided layout: passed the fast path, then failed inside torch
            "per-rank-taken": {"extra": {"t": t(1), "rank0": {"t": t(1)}}},
            "duplicate": {"optimizer": {"state": {"w": {"x/y": t(1)}, "w/x": {"y": t(1)}}}},
            "duplicate-across": {"model": {"x": {"y": t(1)}, "x/y": t(2)}},
        }[name]

    return make


@pytest.mark.parametrize("case", ["control", "reserved", "reserved-key", "long", "dtype", "meta", "sparse", "nested", "per-rank-taken", "duplicate", "duplicate-across"])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_the_fast_paths_refuse_what_the_general_one_refuses_with_its_error(case: str) -> None:
    state = _bad(case)()
    with pytest.raises(Exception) as expected:
        _reference(_one_by_one(state, 0), None, None)
    with pytest.raises(type(expected.value)) as got:
        StructureCache().for_state(StateWalk().flatten(state, rank=0), None, None)
    assert str(got.value) == str(expected.value)


def test_names_that_only_look_reserved_together_are_checked_one_by_one_and_pass() -> None:
    assert not tensor_names_valid(["model/__meta", "data__"])  # the concatenation holds the reserved key
    flat = StateWalk().flatten({"model": {"__meta": torch.zeros(1), "data__": torch.zeros(1)}}, rank=0)
    assert StructureCache().for_state(flat, None, None).fingerprint == _reference(flat, None, None)[1]


@pytest.mark.parametrize("names", [[], ["model/a"], ["model/a", "model/b\x1f"], ["x" * 1025], ["model/__metadata__"], [""], ["__metadata__"]])
def test_tensor_names_valid_is_never_true_for_a_name_check_tensor_name_refuses(names: list[str]) -> None:
    refused = False
    for name in names:
        try:
            check_tensor_name(name)
        except InvalidNameError:
            refused = True
    assert not (refused and tensor_names_valid(names))
    assert tensor_names_valid(names) or refused or not names


@pytest.mark.parametrize("kind", ["plain", "counts"])
def test_a_plain_state_takes_the_fast_paths(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its structure is built without the per-tensor checks or layout_state, and the tensors of
    its dicts are added a dict at a time (a list's, as plain's extras, one by one)."""
    state = STATES[kind]()
    reference = StructureCache().for_state(StateWalk().flatten(state, rank=0), None, None)

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("the general path was taken")

    if kind == "counts":
        monkeypatch.setattr(Entries, "add", refuse)
    monkeypatch.setattr(state_module, "_check_tensor", refuse)
    monkeypatch.setattr(structure_module, "layout_state", refuse)
    assert StructureCache().for_state(StateWalk().flatten(state, rank=0), None, None).fingerprint == reference.fingerprint


class _TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_optimizers_tensors_are_added_as_one_at_a_time(tied: bool) -> None:
    """A module and its optimizer (torch's state_dict APIs): the batch adds, and the tied model's
    aliases, give the entries the one-by-one adds (flatten_state(validate=True)) give."""
    torch.manual_seed(0)
    model: nn.Module = _TiedHead() if tied else nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, dtype=torch.long) if tied else torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model, "optimizer": opt}
    reference = flatten_state(state, rank=0, validate=True)
    assert any(e.aliases for e in reference.tensors) == tied
    for flat in (StateWalk().flatten(state, rank=0), flatten_state(state, rank=0, validate=False)):
        assert [_entry_fields(e) for e in flat.tensors] == [_entry_fields(e) for e in reference.tensors]
        assert flat.extras_json == reference.extras_json
        fragments, fingerprint = _reference(flat, None, None)
        assert StructureCache().for_state(flat, None, None).fingerprint == fingerprint
