"""Save planning as tables: dedup of replicas, balance, slots, validation. No I/O."""

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.plan.save_plan import PAGE, PAGE_ALIGN_FROM, PlanError, TensorSpec, make_save_plan, spec_digest


def full(name: str, shape: tuple[int, ...], dtype: str = "F32", kind: str = "model", aliases: tuple[str, ...] = ()) -> TensorSpec:
    return TensorSpec(name, kind, dtype, shape, Box.full(shape), aliases)


def part(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, "model", "F32", shape, Box(offsets, lengths))


def test_replicas_are_copied_once_and_spread_by_bytes() -> None:
    tensors = [full(f"model/w{i}", (1024 * (i + 1),)) for i in range(8)]
    plan = make_save_plan([tensors] * 4)  # 4 DDP replicas
    assert len(plan.slots) == 8
    assert sorted(s.name for s in plan.slots) == sorted(t.name for t in tensors)
    per_rank = [sum(s.nbytes for s in plan.slots_of(r)) for r in range(4)]
    assert sum(per_rank) == sum(t.nbytes for t in tensors)
    assert max(per_rank) - min(per_rank) <= 4096 * 2  # greedy: within the largest fragment


def test_sharded_fragments_stay_with_their_holder() -> None:
    shape = (4, 8)
    plan = make_save_plan([[part("model/w", shape, (0, 0), (2, 8))], [part("model/w", shape, (2, 0), (2, 8))]])
    assert [(s.rank, s.box) for s in plan.slots] == [(0, Box((0, 0), (2, 8))), (1, Box((2, 0), (2, 8)))]


def test_slots_are_aligned_and_inside_the_arena() -> None:
    plan = make_save_plan([[full("model/a", (3,)), full("model/b", (5000,)), full("model/c", (7,)), full("model/d", (300_000,))]])
    for slot in plan.slots:
        assert slot.offset % (PAGE if slot.nbytes >= PAGE_ALIGN_FROM else 64) == 0
        assert slot.offset + slot.nbytes <= plan.arena_bytes[slot.rank]
    ends = sorted((s.offset, s.offset + s.nbytes) for s in plan.slots)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))


# issue 30 finding 5: padding between slots is under 64 bytes per slot of less than 1 MiB, and
# under a page (0.4%) per larger one
def test_the_padding_between_slots_is_small() -> None:
    for elements, most in ((1025, 64), (65_537, 64), (262_145, PAGE)):  # a little over 4 KiB, 256 KiB, 1 MiB each
        plan = make_save_plan([[full(f"model/w{i}", (elements,)) for i in range(100)]])
        assert plan.arena_bytes[0] - plan.total_bytes < 100 * most + PAGE


def test_a_rank_may_hold_several_fragments_of_one_tensor() -> None:
    fused = [part("model/qkv", (6, 2), (0, 0), (1, 2)), part("model/qkv", (6, 2), (2, 0), (1, 2)), part("model/qkv", (6, 2), (4, 0), (1, 2))]
    other = [part("model/qkv", (6, 2), (1, 0), (1, 2)), part("model/qkv", (6, 2), (3, 0), (1, 2)), part("model/qkv", (6, 2), (5, 0), (1, 2))]
    plan = make_save_plan([fused, other])
    assert [len(plan.slots_of(r)) for r in (0, 1)] == [3, 3]


def test_zero_dim_and_empty_tensors() -> None:
    plan = make_save_plan([[full("optimizer/state/w/step", ()), full("model/empty", (0, 3))]])
    assert {s.name: s.nbytes for s in plan.slots} == {"optimizer/state/w/step": 4, "model/empty": 0}


@pytest.mark.parametrize(
    "ranks, message",
    [
        ([[full("model/w", (4,))], [full("model/w", (5,))]], "ranks disagree"),
        ([[full("model/w", (4,), "F32")], [full("model/w", (4,), "BF16")]], "ranks disagree"),
        ([[full("model/w", (4,)), full("model/w", (4,))]], "twice"),
        ([[part("model/w", (4,), (0,), (2,)), part("model/w", (4,), (1,), (2,))]], "overlap"),
        ([[part("model/w", (4,), (0,), (2,))]], "do not tile"),
        ([[part("model/w", (4,), (0,), (3,))], [part("model/w", (4,), (2,), (2,))]], "overlap"),
        ([[TensorSpec("model/w", "weights", "F32", (4,), Box.full((4,)))]], "kind"),
        ([[TensorSpec("model/w", "model", "F31", (4,), Box.full((4,)))]], "unknown dtype"),
        ([[full("model/a", (4,), aliases=("model/b",)), full("model/b", (4,))]], "both a tensor and an alias"),
        ([], "at least one rank"),
    ],
)
def test_bad_metadata_is_refused_with_the_tensor_named(ranks: list[list[TensorSpec]], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make_save_plan(ranks)


# ------------------------------------------------------------------ several nodes


def test_replicas_on_two_nodes_are_written_whole_and_spread_evenly_over_nodes() -> None:
    tensors = [full(f"model/w{i}", (1000 + 37 * i,)) for i in range(40)]
    plan = make_save_plan([tensors] * 4, node_of_rank=[0, 0, 1, 1])  # DDP over 2 nodes x 2 ranks
    assert all(p.whole for p in plan.parts) and len(plan.parts) == 40
    per_node = [plan.node_bytes(n) for n in (0, 1)]
    assert sum(per_node) == sum(t.nbytes for t in tensors)
    assert abs(per_node[0] - per_node[1]) <= 0.1 * sum(per_node) / 2
    for slot in plan.slots:  # a node's ranks copy exactly what that node writes
        node = plan.node(slot.rank)
        assert any(p.name == slot.name and p.node == node for p in plan.parts)
    per_rank = [sum(s.nbytes for s in plan.slots_of(r)) for r in range(4)]
    assert min(per_rank) > 0


@pytest.mark.parametrize(
    ("node_of_rank", "whole"),
    [
        ([0, 0, 0, 0], True),  # one node holds every shard: written whole
        ([0, 0, 1, 1], False),  # shards on both nodes: each node writes its own fragments
        ([0, 1, 0, 1], False),
    ],
)
def test_a_tensor_sharded_across_nodes_is_written_as_fragments_by_their_holders(node_of_rank: list[int], whole: bool) -> None:
    shape = (8, 4)
    ranks = [[part("model/w", shape, (2 * r, 0), (2, 4))] for r in range(4)]
    plan = make_save_plan(ranks, node_of_rank=node_of_rank)
    assert {p.whole for p in plan.parts} == {whole}
    for p in plan.parts:
        holder = next(r for r in range(4) if ranks[r][0].box == p.box)
        assert p.node == node_of_rank[holder]
    assert sorted(p.box for p in plan.parts) == sorted(r[0].box for r in ranks)


def test_tensor_parallel_inside_nodes_and_data_parallel_across_them_writes_whole_tensors() -> None:
    shape = (4, 6)
    tp = [part("model/w", shape, (0, 0), (2, 6)), part("model/w", shape, (2, 0), (2, 6))]
    ranks = [[tp[0]], [tp[1]], [tp[0]], [tp[1]]]  # TP=2 in each node, DP=2 over the nodes
    plan = make_save_plan(ranks, node_of_rank=[0, 0, 1, 1])
    nodes = {p.node for p in plan.parts}
    assert len(nodes) == 1 and all(p.whole for p in plan.parts)
    node = nodes.pop()
    assert {s.rank for s in plan.slots} == {r for r in range(4) if plan.node(r) == node}
    assert plan.arena_bytes_of(1 - node) == (0, 0, 0, 0)


def test_node_of_rank_must_name_a_node_per_rank() -> None:
    with pytest.raises(PlanError, match="node_of_rank"):
        make_save_plan([[full("model/w", (4,))]] * 2, node_of_rank=[0])


def test_ranks_that_disagree_whether_a_tensor_is_frozen_store_it_as_trained() -> None:
    def spec(frozen: str) -> TensorSpec:
        return TensorSpec("model/w", "model", "F32", (4,), Box.full((4,)), frozen=frozen)

    assert make_save_plan([[spec("param")], [spec("param")]]).tensor("model/w").frozen == "param"
    assert make_save_plan([[spec("param")], [spec("")]]).tensor("model/w").frozen == ""
    with pytest.raises(PlanError, match="ranks disagree"):
        make_save_plan([[spec("param")], [TensorSpec("model/w", "model", "F16", (4,), Box.full((4,)), frozen="param")]])


# issue 30 finding 1: the daemon keys cached metadata and plans by its own digest of the
# metadata, and a rank reuses an earlier answer's slots only under an equal layout id.
@pytest.mark.parametrize(
    "changed",
    [
        TensorSpec("model/v", "model", "BF16", (4, 2), Box((0, 0), (4, 2))),
        TensorSpec("model/w", "master", "BF16", (4, 2), Box((0, 0), (4, 2))),
        TensorSpec("model/w", "model", "F16", (4, 2), Box((0, 0), (4, 2))),
        TensorSpec("model/w", "model", "BF16", (8, 2), Box((0, 0), (4, 2))),
        TensorSpec("model/w", "model", "BF16", (4, 2), Box((0, 0), (2, 2))),
        TensorSpec("model/w", "model", "BF16", (4, 2), Box((1, 0), (3, 2))),
        TensorSpec("model/w", "model", "BF16", (4, 2), Box((0, 0), (4, 2)), ("model/tied",)),
        TensorSpec("model/w", "model", "BF16", (4, 2), Box((0, 0), (4, 2)), (), "param"),
        TensorSpec("model/w", "model", "BF16", (4, 2), Box((0, 0), (4, 2)), per_rank=True),
    ],
    ids=["name", "kind", "dtype", "shape", "box-lengths", "box-offsets", "aliases", "frozen", "per-rank"],
)
def test_the_spec_digest_covers_every_field(changed: TensorSpec) -> None:
    base = TensorSpec("model/w", "model", "BF16", (4, 2), Box((0, 0), (4, 2)))
    assert spec_digest([base]) == spec_digest((TensorSpec("model/w", "model", "BF16", (4, 2), Box((0, 0), (4, 2))),))
    assert spec_digest([base]) != spec_digest([changed])
    assert spec_digest([base, full("model/x", (3,))]) != spec_digest([full("model/x", (3,)), base])  # order counts


def test_the_spec_digest_covers_every_field_of_tensor_spec() -> None:
    """A field added to TensorSpec later changes the digest without touching spec_digest."""
    from dataclasses import fields, replace

    base = TensorSpec("model/w", "model", "BF16", (4, 2), Box((0, 0), (4, 2)))
    others = {"name": "model/v", "kind": "master", "dtype": "F16", "shape": (8, 2), "box": Box((0, 0), (2, 2)),
              "aliases": ("model/tied",), "frozen": "param", "per_rank": True}
    assert {f.name for f in fields(TensorSpec)} == set(others)  # a new field: add it here
    for name, value in others.items():
        assert spec_digest([base]) != spec_digest([replace(base, **{name: value})]), name


@pytest.mark.parametrize("dtype, shape, kind, aliases", [("F16", (8, 8), "model", ()), ("BF16", (64,), "model", ()), ("BF16", (8, 8), "extra", ()),
                                                         ("BF16", (8, 8), "model", ("model/tied",))])
def test_the_layout_id_changes_with_the_slots_tensor(dtype: str, shape: tuple[int, ...], kind: str, aliases: tuple[str, ...]) -> None:
    """Equal names, boxes, offsets and sizes but another tensor: the rank must get the slots
    again (and check them), not copy as in the earlier answer."""
    base = make_save_plan([[full("model/w", (8, 8), "BF16")]])
    other = make_save_plan([[TensorSpec("model/w", kind, dtype, shape, Box.full(shape), aliases)]])
    assert [(s.name, s.offset, s.nbytes) for s in base.slots] == [(s.name, s.offset, s.nbytes) for s in other.slots]
    assert base.layout_id(0) != other.layout_id(0)
    assert base.layout_id(0) == make_save_plan([[full("model/w", (8, 8), "BF16")]]).layout_id(0)


# issue 30 finding 3: every rank's own extras tensor is stored, never taken for a replica
def own(rank: int, name: str = "t", shape: tuple[int, ...] = (4,)) -> TensorSpec:
    return TensorSpec(f"extra/rank{rank}/{name}", "extra", "F32", shape, Box.full(shape), per_rank=True)


def test_issue30_finding3_each_ranks_own_extras_tensor_gets_its_own_slot() -> None:
    shared = full("extra/step", (1,), kind="extra")  # a replica (a layout rule said so): copied once
    plan = make_save_plan([[own(0), shared], [own(1), shared], [own(2), shared]], node_of_rank=[0, 0, 1])
    assert sorted((s.name, s.rank) for s in plan.slots if s.name != "extra/step") == [(f"extra/rank{r}/t", r) for r in range(3)]
    assert len(plan.slots_named("extra/step")) == 1
    assert {t.name: t.rank for t in plan.tensors} == {"extra/rank0/t": 0, "extra/rank1/t": 1, "extra/rank2/t": 2, "extra/step": None}
    assert {p.name: p.node for p in plan.parts if p.name.endswith("/t")} == {"extra/rank0/t": 0, "extra/rank1/t": 0, "extra/rank2/t": 1}


def test_issue30_finding3_a_ranks_own_tensor_must_carry_its_rank() -> None:
    with pytest.raises(PlanError, match=r"rank 1 sends 'extra/rank0/t' as its own tensor.*rank1"):
        make_save_plan([[own(0)], [own(0)]])
    plain = TensorSpec("extra/rank1/t", "extra", "F32", (4,), Box.full((4,)))  # a user's key "rank1", not rank 1's own
    with pytest.raises(PlanError, match=r"ranks disagree on tensor 'extra/rank1/t'.*rank 1's own"):
        make_save_plan([[plain], [own(1)]])
