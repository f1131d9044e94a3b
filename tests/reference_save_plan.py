"""The save planner as it was before issue 34 (every rank's specs walked, a min over every holding
node per tensor): the oracle that tests/daemon/test_save_plan_layouts.py checks the planner over
distinct layouts against. Test code only. What issue 34 did not change (a spec's description,
the checks, the arena layout) it calls in the planner; only the walk and the choices are the old ones."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from ckptd.common import dtypes
from ckptd.common.boxes import Box
from ckptd.daemon.plan import save_plan
from ckptd.daemon.plan.save_plan import LogicalTensor, PlanError, SavePlan, StoredPart, TensorSpec


def reference_plan(specs_by_rank: Sequence[Sequence[TensorSpec]], node_of_rank: Sequence[int] | None = None) -> SavePlan:
    """Plan a save of the fragments every rank holds (index = rank). Raises PlanError.

    `node_of_rank[r]`: the node of rank r (default: every rank on node 0).
    """
    world_size = len(specs_by_rank)
    if world_size == 0:
        raise PlanError("a save needs at least one rank")
    nodes = tuple(node_of_rank) if node_of_rank is not None else (0,) * world_size
    if len(nodes) != world_size or any(n < 0 for n in nodes):
        raise PlanError(f"node_of_rank {list(nodes)} does not give a node >= 0 for each of the {world_size} ranks")
    logical: dict[str, LogicalTensor] = {}
    holders: dict[tuple[str, Box], list[int]] = defaultdict(list)
    for rank, specs in enumerate(specs_by_rank):
        seen: set[tuple[str, Box]] = set()
        for spec in specs:
            save_plan.validate_spec(spec)
            if (spec.name, spec.box) in seen:
                raise PlanError(f"rank {rank} sends fragment {spec.box} of tensor {spec.name!r} twice")
            seen.add((spec.name, spec.box))
            save_plan._describe_spec(logical, spec, rank)  # unchanged by issue 34: shared, not copied
            holders[(spec.name, spec.box)].append(rank)
    save_plan._check_aliases(logical)
    save_plan._check_file_keys(logical)
    save_plan._check_coverage(logical, holders)
    return _reference_assign(logical, holders, nodes)



def _reference_assign(logical: dict[str, LogicalTensor], holders: dict[tuple[str, Box], list[int]], nodes: tuple[int, ...]) -> SavePlan:
    """Greedy balance, largest first: tensors (or fragments) to the least loaded node that holds
    them, then each fragment to the least loaded of that node's ranks that hold it."""
    itemsizes = {name: dtypes.itemsize(t.dtype) for name, t in logical.items()}
    boxes: dict[str, list[Box]] = defaultdict(list)
    for name, box in holders:
        boxes[name].append(box)

    def nodes_holding(name: str, box: Box) -> set[int]:
        return {nodes[r] for r in holders[(name, box)]}

    node_load: dict[int, int] = defaultdict(int)
    parts: list[StoredPart] = []
    for name in sorted(logical, key=lambda n: (-logical[n].nbytes, n)):
        tensor_boxes = sorted(boxes[name])
        everywhere = set.intersection(*(nodes_holding(name, b) for b in tensor_boxes))
        if everywhere:
            node = min(everywhere, key=lambda n: (node_load[n], n))
            parts += [StoredPart(name, b, node, True) for b in tensor_boxes]
            node_load[node] += logical[name].nbytes
            continue
        for box in sorted(tensor_boxes, key=lambda b: (-b.numel, b)):
            node = min(nodes_holding(name, box), key=lambda n: (node_load[n], n))
            parts.append(StoredPart(name, box, node, False))
            node_load[node] += box.numel * itemsizes[name]

    rank_load = [0] * len(nodes)
    chosen: dict[tuple[str, Box], int] = {}
    for part in sorted(parts, key=lambda p: (-p.box.numel * itemsizes[p.name], p.name, p.box)):
        candidates = [r for r in holders[(part.name, part.box)] if nodes[r] == part.node]
        rank = min(candidates, key=lambda r: (rank_load[r], r))
        chosen[(part.name, part.box)] = rank
        rank_load[rank] += part.box.numel * itemsizes[part.name]
    return save_plan._laid_out(logical, parts, chosen, itemsizes, nodes)  # the arena layout: unchanged, shared
