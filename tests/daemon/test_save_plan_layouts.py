"""The planner over distinct layouts (issue 34 item 5) gives the plan the rank-by-rank planner
gave (tests/reference_save_plan.py, the code before it), field for field, or the same
PlanError: as a table of small layouts and as seeded random ones. Ranks that share metadata are
given one sequence object, as the coordinator gives them; the same layouts with a separate,
equal sequence per rank plan the same."""

from __future__ import annotations

import random
from typing import Callable, Sequence

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.plan.save_plan import PlanError, SavePlan, TensorSpec, make_save_plan
from reference_save_plan import reference_plan


def full(name: str, shape: tuple[int, ...], dtype: str = "F32", kind: str = "model", frozen: str = "") -> TensorSpec:
    return TensorSpec(name, kind, dtype, shape, Box.full(shape), frozen=frozen)


def rows(name: str, shape: tuple[int, ...], index: int, count: int, dtype: str = "F32", kind: str = "model") -> TensorSpec:
    """Part `index` of `count` equal row blocks (dimension 0) of tensor `name`."""
    size = shape[0] // count
    return TensorSpec(name, kind, dtype, shape, Box((index * size,) + (0,) * (len(shape) - 1), (size,) + shape[1:]))


def own(rank: int, name: str = "t") -> TensorSpec:
    return TensorSpec(f"extra/rank{rank}/{name}", "extra", "F32", (3,), Box.full((3,)), per_rank=True)


def tp_pp_dp(tp: int, pp: int, dp: int, layers: int = 4) -> tuple[list[tuple[TensorSpec, ...]], list[int]]:
    """The bench's layout in small: TP ranks per node, node = dp + DP * stage; one shared
    sequence per (stage, tp)."""
    per = layers // pp
    shared: dict[tuple[int, int], tuple[TensorSpec, ...]] = {}
    for stage in range(pp):
        for t in range(tp):
            specs = []
            for layer in range(stage * per, (stage + 1) * per):
                specs += [rows(f"model/l{layer}.w", (8 * tp, 4), t, tp, "BF16"), rows(f"optimizer/state/l{layer}.w/exp_avg", (8 * tp, 4), t, tp, kind="optimizer"),
                          full(f"model/l{layer}.norm", (4,))]
            shared[(stage, t)] = tuple(specs)
    specs_by_rank, nodes = [], []
    for node in range(pp * dp):
        for t in range(tp):
            specs_by_rank.append(shared[(node // dp, t)])
            nodes.append(node)
    return specs_by_rank, nodes


def zero(dp: int) -> list[tuple[TensorSpec, ...]]:
    """ZeRO-1: the weights replicated (one shared sequence), the optimizer state sharded over
    the DP ranks, so every rank's metadata differs."""
    weights = (full("model/a", (4 * dp, 2)), full("model/b", (2 * dp,), "BF16"))
    return [weights + (rows("optimizer/state/a/exp_avg", (4 * dp, 2), r, dp, kind="optimizer"),
                       rows("optimizer/state/b/exp_avg", (2 * dp,), r, dp, kind="optimizer")) for r in range(dp)]


def replicas(ranks: int, specs: Sequence[TensorSpec]) -> list[tuple[TensorSpec, ...]]:
    one = tuple(specs)
    return [one] * ranks


TENSORS = [full(f"model/w{i}", (64 * (i % 5 + 1), 3)) for i in range(9)] + [full("optimizer/state/w0/step", (), kind="optimizer")]
TP_PP_DP, TP_PP_DP_NODES = tp_pp_dp(2, 2, 3)

CASES: list[tuple[str, list[tuple[TensorSpec, ...]], list[int] | None]] = [
    ("one rank", replicas(1, TENSORS), None),
    ("DDP on one node", replicas(4, TENSORS), None),
    ("DDP over two nodes", replicas(4, TENSORS), [0, 0, 1, 1]),
    ("uneven DP", replicas(5, TENSORS), [0, 0, 0, 1, 2]),
    ("nodes with gaps, ranks not in node order", replicas(4, TENSORS), [5, 2, 5, 9]),
    ("TP x PP x DP", TP_PP_DP, TP_PP_DP_NODES),
    ("TP x PP x DP, one node", TP_PP_DP, None),
    ("sharded across nodes", [(rows("model/w", (8, 2), r, 4),) for r in range(4)], [0, 1, 2, 3]),
    ("sharded, two replicas of each half", [(rows("model/w", (8, 2), r % 2, 2),) for r in range(4)], [0, 1, 1, 0]),
    ("ZeRO-1 over nodes", zero(4), [0, 0, 1, 1]),
    ("ZeRO-1, uneven", zero(3), [0, 1, 1]),
    ("per-rank extras", [(own(r), full("extra/step", (1,), kind="extra")) for r in range(3)], [0, 0, 1]),
    ("frozen disagreement", [(full("model/w", (4,), frozen="param"),)] * 2 + [(full("model/w", (4,)),)], [0, 1, 1]),
    # refused, with the same message
    ("ranks disagree", [(full("model/w", (4,)),)] * 2 + [(full("model/w", (5,)),)], [0, 0, 1]),
    ("a later replica group disagrees", replicas(2, [full("model/w", (4,))]) + replicas(2, [full("model/w", (4,), "BF16")]), [0, 0, 1, 1]),
    ("a shared own tensor", replicas(2, [own(0)]), [0, 1]),
    ("own tensor named for another rank", [(own(0),), (own(0),)], [0, 1]),
    ("fragment twice", replicas(3, [full("model/w", (4,)), full("model/w", (4,))]), [0, 1, 2]),
    ("not tiled", replicas(2, [rows("model/w", (4,), 0, 2)]), [0, 1]),
    ("bad kind", replicas(2, [TensorSpec("model/w", "weights", "F32", (4,), Box.full((4,)))]), None),
    ("key clash", replicas(2, [full("model/w", (4,)), full("ema/w", (4,))]), [0, 1]),
    ("node_of_rank too short", replicas(3, TENSORS), [0, 1]),
]


def outcome(plan: Callable[[], SavePlan]) -> SavePlan | str:
    try:
        return plan()
    except PlanError as exc:
        return f"PlanError: {exc}"


def separate(specs_by_rank: Sequence[tuple[TensorSpec, ...]]) -> list[tuple[TensorSpec, ...]]:
    """Every rank's metadata as a sequence of its own (equal, not the same object)."""
    return [tuple(s for s in specs) for specs in specs_by_rank]


@pytest.mark.parametrize("label, specs_by_rank, nodes", CASES, ids=[c[0] for c in CASES])
def test_the_plan_over_layouts_is_the_rank_by_rank_plan(label: str, specs_by_rank: list[tuple[TensorSpec, ...]], nodes: list[int] | None) -> None:
    expected = outcome(lambda: reference_plan(specs_by_rank, nodes))
    assert outcome(lambda: make_save_plan(specs_by_rank, nodes)) == expected
    assert outcome(lambda: make_save_plan(separate(specs_by_rank), nodes)) == expected


def random_layout(rng: random.Random) -> tuple[list[tuple[TensorSpec, ...]], list[int]]:
    """Tensors split into 1-4 row blocks; each block held by a few random ranks (some whole
    tensors by all); ranks with equal holdings share one sequence; random nodes."""
    world = rng.randint(1, 12)
    holdings: list[list[TensorSpec]] = [[] for _ in range(world)]
    for t in range(rng.randint(1, 10)):
        count = rng.choice([1, 1, 2, 4])
        shape = (4 * rng.randint(1, 64), rng.randint(1, 3))
        dtype = rng.choice(["F32", "BF16"])
        for i in range(count):
            spec = rows(f"model/t{t}", shape, i, count, dtype)
            for r in rng.sample(range(world), rng.randint(1, world)) if rng.random() < 0.7 else range(world):
                holdings[r].append(spec)
    interned: dict[tuple[TensorSpec, ...], tuple[TensorSpec, ...]] = {}
    specs_by_rank = [interned.setdefault(tuple(h), tuple(h)) for h in holdings]
    nodes = [rng.randint(0, max(0, world // 2)) for _ in range(world)]
    return specs_by_rank, nodes


@pytest.mark.parametrize("seed", range(200))
def test_random_layouts_plan_as_rank_by_rank(seed: int) -> None:
    specs_by_rank, nodes = random_layout(random.Random(seed))
    assert outcome(lambda: make_save_plan(specs_by_rank, nodes)) == outcome(lambda: reference_plan(specs_by_rank, nodes))


def test_replicas_are_described_once_not_once_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work of a plan grows with the distinct layouts, not with the DP replicas: 2 layouts
    held by 500 ranks each on 500 nodes are checked spec by spec twice, not 1,000 times."""
    from ckptd.daemon.plan import save_plan

    checked: list[TensorSpec] = []
    real = save_plan.validate_spec

    def counted(spec: TensorSpec) -> None:
        checked.append(spec)
        real(spec)

    monkeypatch.setattr(save_plan, "validate_spec", counted)
    specs_by_rank, nodes = tp_pp_dp(2, 1, 500)
    plan = make_save_plan(specs_by_rank, nodes)
    assert len(checked) == sum(len(specs) for specs in set(specs_by_rank)) == 2 * 3 * 4
    assert {p.node for p in plan.parts} <= set(nodes) and len(plan.slots) == len(plan.parts)
    assert plan == reference_plan(specs_by_rank, nodes)
