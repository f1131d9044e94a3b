"""Layouts as fragments: for each layout, every rank's fragments rebuild the global tensor exactly.

Tensor-parallel ranks are simulated: each rank's local tensor is cut from a known global tensor
the way the framework would (Megatron's split, fused sub-tensors, padded vocabulary), then the
fragments of all ranks are written into an empty tensor, which must equal the original.
DTensor arithmetic is checked against torch's own splitting; real DTensors on several processes
are in test_layout_dtensor.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ckptd.client.layout import (
    Fragment,
    Fused,
    LayoutError,
    LayoutRules,
    PaddedVocab,
    Piece,
    RankCoords,
    Replicated,
    Rule,
    Split,
    dtensor_pieces,
    fragments_of,
    layout_key,
    layout_state,
    replicated_checksum,
)
from ckptd.client.state import flatten_state
from ckptd.common.boxes import Box, coverage_problems

PAD = -1.0  # padding rows of a vocabulary are filled with this; the global tensor never holds it


def known(shape: tuple[int, ...]) -> torch.Tensor:
    """A global tensor whose every element is distinct (its flat index), so misplaced data shows."""
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)


def local_of(full: torch.Tensor, layout: object, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s tensor of global `full`, cut as the training framework does (the test's oracle)."""
    if isinstance(layout, Replicated):
        return full.clone()
    if isinstance(layout, Split):
        return full.chunk(tp, layout.dim)[rank].clone()
    if isinstance(layout, Fused):
        subs = full.split(list(layout.sizes), layout.dim)
        return torch.cat([sub.chunk(tp, layout.dim)[rank] for sub in subs], layout.dim)
    if isinstance(layout, PaddedVocab):
        rows = -(-layout.size // tp)  # padded to a multiple of tp here; tests with more padding build it by hand
        return padded_local(full, layout.dim, rows, rank)
    raise AssertionError(layout)


def padded_local(full: torch.Tensor, dim: int, rows: int, rank: int) -> torch.Tensor:
    start = rank * rows
    kept = max(0, min(rows, full.shape[dim] - start))
    shape = list(full.shape)
    shape[dim] = rows
    local = torch.full(shape, PAD, dtype=full.dtype)
    local.narrow(dim, 0, kept).copy_(full.narrow(dim, min(start, full.shape[dim]), kept))
    return local


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))


def rebuild(per_rank: list[list[Fragment]], locals_: list[torch.Tensor]) -> torch.Tensor:
    """Write every rank's fragments into one tensor; check views, shapes, replicas and exact tiling."""
    shapes = {f.global_shape for frags in per_rank for f in frags}
    assert len(shapes) == 1, f"ranks disagree on the global shape: {shapes}"
    (shape,) = shapes
    out = torch.full(shape, float("nan"), dtype=torch.float64)
    seen: dict[Box, torch.Tensor] = {}
    for frags, local in zip(per_rank, locals_):
        for f in frags:
            assert tuple(f.local.shape) == f.box.lengths
            assert f.box.fits_in(shape)
            if f.local.numel():
                assert f.local.untyped_storage().data_ptr() == local.untyped_storage().data_ptr(), "not a view"
            if f.box in seen:
                assert torch.equal(seen[f.box], f.local), f"replicas of {f.box} differ"
            seen[f.box] = f.local
            out[slices(f.box)] = f.local
    assert coverage_problems(shape, seen) == []
    return out


def fragments_all_ranks(name: str, full: torch.Tensor, rules: LayoutRules, layout: object, tp: int, cut=local_of):
    locals_ = [cut(full, layout, r, tp) for r in range(tp)]
    return [fragments_of(name, t, rules, RankCoords(r, tp)) for r, t in enumerate(locals_)], locals_


HEAD = 4
GQA = (8 * HEAD, 2 * HEAD, 2 * HEAD)  # 8 query heads, 2 key/value heads of 4 dims: QKV rows

CASES = [
    # (layout, global shape, tp sizes)
    (Split(0), (8, 3), (1, 2, 4, 8)),
    (Split(1), (3, 8), (1, 2, 4)),
    (Split(-1), (2, 3, 8), (1, 2, 4)),
    (Split(0), (8,), (1, 2, 4)),
    (Fused(0, GQA), (sum(GQA), 6), (1, 2)),  # 2 kv heads: TP up to 2 keeps whole heads
    (Fused(0, (32, 8, 8)), (48, 6), (1, 2, 4, 8)),  # the sizes only need to divide by tp
    (Fused(0, (12, 12)), (24, 5), (1, 2, 3, 4)),  # SwiGLU gate/up
    (Fused(1, (8, 8)), (5, 16), (1, 2, 4)),  # fused along columns: non-contiguous views
    (Fused(0, (6, 2, 2)), (10,), (1, 2)),  # a fused bias
    (PaddedVocab(0, 50), (50, 6), (1, 2, 4, 8)),  # 56 padded rows over tp 4: the last rank has 2 padding rows
    (PaddedVocab(0, 7), (7, 2), (4, 8)),  # tp 8: ranks 7.. hold padding only
    (PaddedVocab(1, 10), (3, 10), (1, 4)),  # a vocabulary along columns (e.g. an output layer stored transposed)
    (Replicated(), (6,), (1, 2, 4)),
    (Replicated(check_equal=False), (2, 3), (2,)),
]


@pytest.mark.parametrize(("layout", "shape", "tps"), CASES, ids=lambda v: str(v))
def test_every_layout_rebuilds_the_global_tensor_from_all_ranks(layout, shape, tps) -> None:
    full = known(shape)
    for tp in tps:
        rules = LayoutRules([Rule(r"layers\.\d+\.w", layout)])
        per_rank, locals_ = fragments_all_ranks("model/layers.3.w", full, rules, layout, tp)
        assert torch.equal(rebuild(per_rank, locals_), full), f"tp={tp}"
        assert all(f.name == "model/layers.3.w" for frags in per_rank for f in frags)


def test_fused_gives_one_fragment_per_sub_tensor_and_one_at_tp1() -> None:
    full = known((sum(GQA), 3))
    rules = LayoutRules([Rule("qkv", Fused(0, GQA))])
    per_rank, _ = fragments_all_ranks("model/qkv", full, rules, Fused(0, GQA), 2)
    assert [f.box for f in per_rank[1]] == [
        Box((16, 0), (16, 3)),  # q heads 4..7
        Box((32 + 4, 0), (4, 3)),  # k head 1
        Box((40 + 4, 0), (4, 3)),  # v head 1
    ]
    (whole,) = fragments_all_ranks("model/qkv", full, rules, Fused(0, GQA), 1)[0][0]
    assert whole.box == Box.full((48, 3))


def test_padded_vocab_keeps_padding_out_and_empty_shares_at_the_end() -> None:
    full = known((50, 2))
    rules = LayoutRules([Rule("embed", PaddedVocab(0, 50))])
    ends = {}
    for rows in (13, 14, 17):  # 50 padded to 52 (a multiple of tp), to 56 (of 2 * tp), to 68: rank 3 all padding
        per_rank, locals_ = fragments_all_ranks(
            "model/embed", full, rules, PaddedVocab(0, 50), 4, cut=lambda f, _l, r, _tp: padded_local(f, 0, rows, r)
        )
        assert torch.equal(rebuild(per_rank, locals_), full)
        ends[rows] = [f.box for f in per_rank[3]]
        kept = ends[rows][0].lengths[0]
        assert (locals_[3][kept:] == PAD).all() and not (locals_[3][:kept] == PAD).any()
    assert ends == {
        13: [Box((39, 0), (11, 2))],  # 2 padding rows left out
        14: [Box((42, 0), (8, 2))],  # 6 padding rows left out
        17: [Box((50, 0), (0, 2))],  # nothing but padding: an empty box at the end
    }


def test_split_global_shape_is_local_times_tp() -> None:
    rules = LayoutRules([Rule("w", Split(1))])
    (f,) = fragments_of("model/w", torch.zeros(3, 5), rules, RankCoords(2, 4))
    assert f.global_shape == (3, 20) and f.box == Box((0, 10), (3, 5))


# ------------------------------------------------------------------ names and rules


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("model/layers.0.attn.qkv.weight", "layers.0.attn.qkv.weight"),
        ("master/layers.0.attn.qkv.weight", "layers.0.attn.qkv.weight"),
        ("optimizer/state/layers.0.attn.qkv.weight/exp_avg", "layers.0.attn.qkv.weight"),
        ("optimizer/state/embed.weight/step", "embed.weight"),
        ("opt/state/embed.weight/exp_avg", "embed.weight"),  # an optimizer under another key
        ("optimizer/state/embed.weight/nested/field", "embed.weight"),
        ("optimizer/state//exp_avg", "optimizer/state//exp_avg"),
        ("optimizer/param_groups/0/lr", "optimizer/param_groups/0/lr"),
        ("ema/layers.0.attn.qkv.weight", "ema/layers.0.attn.qkv.weight"),
        ("scheduler/base_lrs/0", "scheduler/base_lrs/0"),
        ("model", "model"),
    ],
)
def test_layout_key_strips_the_decoration_of_parameters_and_their_state(name: str, key: str) -> None:
    assert layout_key(name) == key


def test_optimizer_state_and_master_copies_follow_their_parameter() -> None:
    layout = Fused(0, (8, 4, 4))
    full = known((16, 3))
    fqn = "layers.1.attn.qkv.weight"
    for name in (f"model/{fqn}", f"master/{fqn}", f"optimizer/state/{fqn}/exp_avg", f"optimizer/state/{fqn}/exp_avg_sq"):
        rules = LayoutRules([Rule(r"layers\.\d+\.attn\.qkv\.weight", layout)])
        per_rank, locals_ = fragments_all_ranks(name, full, rules, layout, 4)
        assert len(per_rank[0]) == 3
        assert torch.equal(rebuild(per_rank, locals_), full)


@pytest.mark.parametrize("step", [torch.tensor(7.0), torch.tensor([7.0])])
def test_scalar_optimizer_state_is_a_replica(step: torch.Tensor) -> None:
    rules = LayoutRules([Rule("w", Split(0))])
    (f,) = fragments_of("optimizer/state/w/step", step, rules, RankCoords(1, 2))
    assert f.box == Box.full(tuple(step.shape)) and f.local is step
    assert rules.unused() == []


def test_optimizer_state_of_another_shape_than_its_parameter_is_refused() -> None:
    rules = LayoutRules([Rule("w", Split(0))])
    with pytest.raises(LayoutError, match=r"'optimizer/state/w/exp_avg_sq_row' has shape \[4\] but its parameter has \[4, 6\]"):
        fragments_of("optimizer/state/w/exp_avg_sq_row", torch.zeros(4), rules, RankCoords(0, 2), param_shape=(4, 6))


def test_no_rule_and_no_rules_mean_a_full_replica() -> None:
    t = torch.zeros(3, 4)
    for rules in (None, LayoutRules([Rule("other", Split(0))])):
        (f,) = fragments_of("model/w", t, rules, None)
        assert f.box == Box.full((3, 4)) and f.global_shape == (3, 4) and f.local is t
    (f,) = fragments_of("extra/step", torch.tensor(3), None, None)
    assert f.box == Box((), ()) and f.box.numel == 1


def test_first_match_wins_and_unused_rules_are_reported() -> None:
    rules = LayoutRules([
        Rule(r".*norm\.weight", Replicated()),
        Rule(r"layers\.\d+\..*\.weight", Split(0)),
        Rule(r"layers\.\d+\.mlp\.fc1\.weight", Split(1)),  # shadowed by the rule before it
        Rule(r"layres\.\d+\.attn\.qkv\.weight", Fused(0, (4, 2, 2))),  # a typo
    ])
    assert rules.unused() == list(rules.rules)
    assert rules.match("layers.0.mlp.fc1.weight") is rules.rules[1]
    assert rules.match("layers.0.norm.weight") is rules.rules[0]
    assert rules.match("layers.0.mlp.fc1.bias") is None
    assert rules.match("xlayers.0.mlp.fc1.weight") is None  # fullmatch, not search
    assert rules.unused() == [rules.rules[2], rules.rules[3]]


def test_rules_are_checked_when_the_table_is_built() -> None:
    with pytest.raises(ValueError, match=r"rule #1 has an invalid pattern '\('"):
        LayoutRules([Rule("a", Split(0)), Rule("(", Split(0))])
    with pytest.raises(ValueError, match="Fused sizes must be positive"):
        LayoutRules([Rule("a", Fused(0, (4, 0)))])
    with pytest.raises(ValueError, match="Fused sizes must be positive"):
        LayoutRules([Rule("a", Fused(0, ()))])
    with pytest.raises(ValueError, match="PaddedVocab size must be positive"):
        LayoutRules([Rule("a", PaddedVocab(0, 0))])
    with pytest.raises(TypeError, match="use Split, Fused, PaddedVocab, Replicated, Expert or StoredAs"):
        LayoutRules([Rule("a", "split")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"write Rule\(pattern, layout\)"):
        LayoutRules([("a", Split(0))])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="need 0 <= tp_rank < tp_size"):
        RankCoords(2, 2)


@pytest.mark.parametrize(
    ("layout", "shape", "coords", "message"),
    [
        (Fused(0, (8, 4, 4)), (6, 2), RankCoords(0, 2), r"'model/qkv' has 6 rows along dim 0 at tp_size 2.*= 8"),
        (Fused(0, (8, 2, 2)), (3, 2), RankCoords(0, 4), r"every size must divide by tp_size"),
        (PaddedVocab(0, 50), (12, 2), RankCoords(0, 4), r"48 padded rows in all\), fewer than the vocabulary size 50"),
        (Split(2), (3, 4), RankCoords(0, 2), r"splits dim 2 of 'model/qkv', which has shape \[3, 4\]"),
        (Split(0), (3, 4), None, r"pass coords=RankCoords\(tp_rank, tp_size\)"),
    ],
)
def test_tensors_that_do_not_fit_their_rule_are_refused_with_the_reason(layout, shape, coords, message) -> None:
    rules = LayoutRules([Rule("qkv", layout)])
    with pytest.raises(LayoutError, match=message):
        fragments_of("model/qkv", torch.zeros(shape), rules, coords)


# ------------------------------------------------------------------ a whole state


class TinyTP(nn.Module):
    """One rank of a Megatron-style TP model: fused QKV (GQA), padded vocabulary, replicated norm."""

    def __init__(self, tp: int, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(-(-10 // tp), 4)  # vocabulary 10, padded to a multiple of tp
        self.qkv = nn.Linear(4, (8 + 4 + 4) // tp)
        self.proj = nn.Linear(8 // tp, 4)  # row-parallel: split along dim 1; its bias replicated
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, -(-10 // tp), bias=False)
        if tied:
            self.head.weight = self.embed.weight


RULES = [
    Rule(r"(embed|head)\.weight", PaddedVocab(0, 10)),
    Rule(r"qkv\.(weight|bias)", Fused(0, (8, 4, 4))),
    Rule(r"proj\.weight", Split(1)),
    Rule(r"proj\.bias|norm\.(weight|bias)", Replicated()),
]


def test_layout_state_places_weights_and_adam_state_of_a_tp_model() -> None:
    model = TinyTP(tp=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    flat = flatten_state({"model": model, "optimizer": opt}, rank=1)  # a fresh optimizer gets its state initialized
    rules = LayoutRules(RULES)
    layouts = {lay.entry.name: lay for lay in layout_state(flat, rules, RankCoords(1, 2))}
    assert rules.unused() == []
    assert layouts["model/embed.weight"].global_shape == (10, 4)
    assert [f.box for f in layouts["model/embed.weight"].fragments] == [Box((5, 0), (5, 4))]
    assert layouts["optimizer/state/qkv.weight/exp_avg"].global_shape == (16, 4)
    qkv_bias = layouts["optimizer/state/qkv.bias/exp_avg_sq"].fragments
    assert [f.box for f in qkv_bias] == [Box((4,), (4,)), Box((10,), (2,)), Box((14,), (2,))]
    assert layouts["optimizer/state/proj.weight/exp_avg"].fragments[0].box == Box((0, 4), (4, 4))
    assert layouts["optimizer/state/proj.weight/step"].fragments[0].box == Box((), ())
    checked = sorted(name for name, lay in layouts.items() if lay.check_equal)
    assert checked == [
        "model/norm.bias", "model/norm.weight", "model/proj.bias",
        "optimizer/state/norm.bias/exp_avg", "optimizer/state/norm.bias/exp_avg_sq", "optimizer/state/norm.bias/step",
        "optimizer/state/norm.weight/exp_avg", "optimizer/state/norm.weight/exp_avg_sq", "optimizer/state/norm.weight/step",
        "optimizer/state/proj.bias/exp_avg", "optimizer/state/proj.bias/exp_avg_sq", "optimizer/state/proj.bias/step",
    ]


def test_layout_state_rebuilds_a_tp_model_at_any_tp() -> None:
    torch.manual_seed(0)
    full = TinyTP(tp=1)
    for tp in (1, 2, 4):
        ranks = [TinyTP(tp) for _ in range(tp)]
        with torch.no_grad():
            for r, m in enumerate(ranks):
                coords = RankCoords(r, tp)
                m.embed.weight.copy_(padded_local(full.embed.weight, 0, m.embed.weight.shape[0], r))
                m.head.weight.copy_(padded_local(full.head.weight, 0, m.head.weight.shape[0], r))
                m.qkv.weight.copy_(local_of(full.qkv.weight, Fused(0, (8, 4, 4)), coords.tp_rank, tp))
                m.qkv.bias.copy_(local_of(full.qkv.bias, Fused(0, (8, 4, 4)), coords.tp_rank, tp))
                m.proj.weight.copy_(full.proj.weight.chunk(tp, 1)[r])
                m.proj.bias.copy_(full.proj.bias)
                m.norm.load_state_dict(full.norm.state_dict())
        rules = LayoutRules(RULES)
        states = [{lay.entry.name: lay for lay in layout_state(flatten_state({"model": m}, rank=r), rules, RankCoords(r, tp))}
                  for r, m in enumerate(ranks)]
        for fqn, value in full.state_dict().items():
            name = f"model/{fqn}"
            per_rank = [list(s[name].fragments) for s in states]
            locals_ = [s[name].entry.tensor for s in states]
            assert torch.equal(rebuild(per_rank, locals_).float(), value), f"{fqn} at tp {tp}"


def test_tied_names_must_agree_on_their_rule() -> None:
    flat = flatten_state({"model": TinyTP(tp=2, tied=True)}, rank=0)
    (embed,) = [lay for lay in layout_state(flat, LayoutRules(RULES), RankCoords(0, 2)) if lay.entry.name == "model/embed.weight"]
    assert embed.entry.aliases == ("model/head.weight",) and embed.global_shape == (10, 4)
    rules = LayoutRules([Rule(r"embed\.weight", PaddedVocab(0, 10)), Rule(r"head\.weight", Split(0))])
    with pytest.raises(LayoutError, match="'model/embed.weight' -> embed.*'model/head.weight' -> head.*make them agree"):
        layout_state(flat, rules, RankCoords(0, 2))


def test_layout_state_without_rules_makes_every_tensor_a_replica() -> None:
    flat = flatten_state({"model": TinyTP(tp=1), "extra": {"t": torch.ones(2)}}, rank=0)
    for lay in layout_state(flat):
        (f,) = lay.fragments
        assert f.box.is_full(tuple(lay.entry.tensor.shape)) and f.local is lay.entry.tensor and not lay.check_equal


class _Sampler:
    """A stateful object whose state holds a tensor (a data sampler's per-rank position)."""

    def __init__(self, position: int) -> None:
        self.position = torch.tensor(position)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


# issue 30 finding 3
def test_issue30_finding3_a_ranks_own_extras_tensors_are_named_for_it() -> None:
    state = {"model": nn.Linear(2, 2), "extra": {"t": torch.ones(3), "step": 4}, "sampler": _Sampler(7), "t": torch.zeros(1)}
    for rank in (0, 3):
        lays = {lay.entry.name: lay for lay in layout_state(flatten_state(state, rank=rank))}
        own = {name: lay.fragments[0] for name, lay in lays.items() if lay.entry.per_rank}
        assert {name: (f.name, f.per_rank) for name, f in own.items()} == {
            "extra/t": (f"extra/rank{rank}/t", True),
            "sampler/position": (f"sampler/rank{rank}/position", True),
            "t": (f"t/rank{rank}", True),
        }
        assert all(f.box.is_full(tuple(f.local.shape)) for f in own.values())
        assert [f.name for f in lays["model/weight"].fragments] == ["model/weight"]  # a module's tensors are replicas


def test_issue30_finding3_a_layout_rule_or_a_given_layout_makes_an_extras_tensor_shared() -> None:
    from ckptd.client import LocalShard

    state = {"ema": {"w": torch.ones(4, 2), "s": LocalShard(torch.ones(2, 2), (2, 0), (4, 2))}, "extra": {"t": torch.ones(2)}}
    rules = LayoutRules([Rule(r"ema/w", Split(0)), Rule(r"extra/t", Replicated(check_equal=False))])
    lays = {lay.entry.name: lay for lay in layout_state(flatten_state(state, rank=1), rules, RankCoords(1, 2))}
    assert {name: [(f.name, f.per_rank, f.box) for f in lay.fragments] for name, lay in lays.items()} == {
        "ema/w": [("ema/w", False, Box((4, 0), (4, 2)))],
        "ema/s": [("ema/s", False, Box((2, 0), (2, 2)))],
        "extra/t": [("extra/t", False, Box((0,), (2,)))],
    }


def test_issue30_finding3_a_per_rank_name_that_is_another_tensors_name_is_refused() -> None:
    state = {"extra": {"rank0": {"t": torch.ones(1)}, "t": torch.ones(1)}}
    rules = LayoutRules([Rule(r"extra/rank0/t", Replicated(check_equal=False))])
    with pytest.raises(LayoutError, match=r"'extra/t' is stored per rank as 'extra/rank0/t', which is the name of another tensor"):
        layout_state(flatten_state(state, rank=0), rules, RankCoords(0, 1))


# ------------------------------------------------------------------ DTensor arithmetic


def torch_local(full: torch.Tensor, mesh_shape, coordinate, placements) -> torch.Tensor:
    """The shard that DTensor gives a rank: torch's own split of each placement, left to right."""
    local = full
    for placement, n, i in zip(placements, mesh_shape, coordinate):
        if isinstance(placement, (Shard, _StridedShard)):
            local = placement._split_tensor(local, n, with_padding=False, contiguous=False)[0][i]
    return local


PLACEMENT_CASES = [
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((3,), [Shard(0)]),
    ((4,), [Replicate()]),
    ((2, 2), [Replicate(), Shard(0)]),  # HSDP
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 3), [Shard(1), Shard(0)]),
    ((2, 2), [Shard(0), Shard(0)]),  # nested
    ((3, 2), [Shard(1), Shard(1)]),
    ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over TP
    ((2, 3), [_StridedShard(1, split_factor=3), Shard(1)]),
    ((2, 2, 2), [Replicate(), _StridedShard(0, split_factor=2), Shard(0)]),
]


@pytest.mark.parametrize(("mesh_shape", "placements"), PLACEMENT_CASES, ids=str)
def test_dtensor_pieces_cut_every_size_exactly_as_torch_does(mesh_shape, placements) -> None:
    for rows, cols in itertools.product(range(0, 10), (1, 2, 5, 7)):
        full = known((rows, cols))
        per_rank, locals_ = [], []
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            expected = torch_local(full, mesh_shape, coordinate, placements)
            local_shape, pieces = dtensor_pieces(full.shape, mesh_shape, coordinate, placements)
            assert local_shape == tuple(expected.shape), (rows, cols, coordinate)
            if not any(isinstance(p, _StridedShard) for p in placements):
                torch_shape, torch_offset = _compute_local_shape_and_global_offset(
                    full.shape, mesh_shape, list(coordinate), placements
                )
                assert local_shape == torch_shape
                assert len(pieces) == 1 and pieces[0].box.offsets == torch_offset, (rows, cols, coordinate)
            per_rank.append([Fragment("t", tuple(full.shape), p.box, expected[slices(p.local)]) for p in pieces])
            locals_.append(expected)
        assert torch.equal(rebuild(per_rank, locals_), full), (rows, cols)


def test_a_strided_shard_can_be_several_pieces_of_the_global_tensor() -> None:
    # 6 rows cut in 3 (split_factor) then over 2 dp ranks: dp 0 holds rows {0, 2, 4}; tp 0 of those is {0, 2}.
    shape, pieces = dtensor_pieces((6, 2), (2, 2), (0, 0), [_StridedShard(0, split_factor=3), Shard(0)])
    assert shape == (2, 2)
    assert [(p.box, p.local) for p in pieces] == [
        (Box((0, 0), (1, 2)), Box((0, 0), (1, 2))),
        (Box((2, 0), (1, 2)), Box((1, 0), (1, 2))),
    ]


def test_partial_placements_are_refused() -> None:
    with pytest.raises(LayoutError, match="reduce it before saving"):
        dtensor_pieces((4,), (2,), (0,), [Partial()])


def test_dtensor_pieces_of_a_scalar_and_of_an_empty_tensor() -> None:
    assert dtensor_pieces((), (2,), (1,), [Replicate()]) == ((), [Piece(Box((), ()), Box((), ()))])
    shape, (piece,) = dtensor_pieces((0, 3), (2,), (1,), [Shard(0)])
    assert shape == (0, 3) and piece.box == Box((0, 0), (0, 3))


# ------------------------------------------------------------------ replicas


def test_replicated_checksum_tells_values_dtypes_and_shapes_apart() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert replicated_checksum(a) == replicated_checksum(a.clone())
    assert replicated_checksum(a.t()) == replicated_checksum(a.t().contiguous())  # non-contiguous: by value
    assert replicated_checksum(a) != replicated_checksum(a.reshape(3, 2))
    assert replicated_checksum(a) != replicated_checksum(a.double())
    b = a.clone()
    b[1, 2] = 5.000001
    assert replicated_checksum(a) != replicated_checksum(b)
    assert replicated_checksum(a.bfloat16()) == replicated_checksum(a.clone().bfloat16())
    assert replicated_checksum(torch.tensor(1)) != replicated_checksum(torch.tensor([1]))
    assert len(replicated_checksum(torch.empty(0))) == 32
