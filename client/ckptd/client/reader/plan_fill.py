"""A load's fill from the daemon's plan, and what it made of a plan kept for the next load of it.

A plan from the daemon's memory has an id (its pieces name arena paths and offsets, not steps):
when the rank names it as known, the daemon leaves its pieces out and the fills, or the one
batch of copies (ckptd.client.reader.fill.MemoryCopies), made from the earlier answer are run
again. They are kept in the cache of the state's Structure, whose identity guarantees that
every target still has the dtype, shape, strides and address it had (ckptd.client.structure).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.client._handoff.select import Handoff
from ckptd.client._rpc import LoadPlan
from ckptd.client.arenas import ArenaMaps
from ckptd.client.errors import CheckpointError
from ckptd.client.reader.fill import Fill, MemoryCopies, column_fills, fill_all, fill_onto_devices
from ckptd.client.reader.pieces import ArenaColumns
from ckptd.client.structure import Structure

KNOWN_PLANS = 4  # load plans kept per structure: the daemon alternates between its arena sets


@dataclass
class KnownPlan:
    """What a load made of a plan from the daemon's memory, kept for its next load of the same
    plan: the fills (made from the pieces, or from the columns when first needed) and the
    memcpys (None when some target needs more than a memcpy)."""

    fills: list[Fill] | None
    columns: ArenaColumns | None
    moves: MemoryCopies | None

    def fills_of(self, structure: Structure) -> list[Fill]:
        if self.fills is None:
            assert self.columns is not None  # made with one or the other
            self.fills = column_fills([(f.name, f.box, f.local) for _, f in structure.fragments], self.columns)
        return self.fills


def check_writable(structure: Structure) -> None:
    """CheckpointError, before anything is written, naming the first target whose elements share
    memory (an expanded view, a stride 0): a load cannot give them their different values. Once
    per structure (its strides are part of its identity); contiguous targets cost one C check."""
    if structure.cache.get("writable") or all(map(torch.Tensor.is_contiguous, structure.targets)):
        structure.cache["writable"] = True
        return
    for index, target in enumerate(structure.targets):
        if not target.is_contiguous() and torch._debug_has_internal_overlap(target) == 1:
            entry, _ = structure.fragments[index]
            raise CheckpointError(
                f"cannot load into {entry.name!r}: its elements share memory (strides {list(target.stride())} of shape "
                f"{list(target.shape)}: an expanded view), so they cannot take the step's different values; nothing was "
                "loaded. Load into a tensor of its own (e.g. tensor.clone() or torch.empty of its shape) and expand that"
            )
    structure.cache["writable"] = True


def fill_plan(plan: LoadPlan, structure: Structure, maps: ArenaMaps, pool: ThreadPoolExecutor, threads: int, handoff: Handoff) -> None:
    """Fill the structure's tensors from the plan's pieces or columns (GPU targets through the
    handoff's backend), reusing what was made of a known plan; `threads` copy a restore from
    the daemon's memory (MemoryCopies.run)."""
    check_writable(structure)
    known: dict[str, KnownPlan] = structure.cache.setdefault("load_plans", {})  # plan id -> ..., newest last
    reused = known.get(plan.plan_id) if plan.plan_id and not plan.pieces and plan.columns is None else None
    owns = handoff.owns
    if reused is not None:
        made = reused
    elif plan.columns is not None:
        targets = structure.targets
        on_device = any(map(owns, targets))  # they go through pinned host memory
        made = KnownPlan(None, plan.columns, None if on_device else MemoryCopies.of_columns(maps, targets, plan.columns))
    else:
        sources: dict[str, list[Any]] = {}
        for source in plan.pieces:
            sources.setdefault(source.name, []).append(source)
        fills = [Fill(f.local, f.box, sources[f.name]) for _, f in structure.fragments if f.name in sources]
        on_device = any(owns(fill.target) for fill in fills)
        made = KnownPlan(fills, None, MemoryCopies.prepare(maps, fills) if plan.plan_id and not on_device else None)
    if plan.plan_id:
        known.pop(plan.plan_id, None)
        known[plan.plan_id] = made
        while len(known) > KNOWN_PLANS:
            del known[next(iter(known))]
    if made.moves is not None and made.moves.run(maps, threads):
        return
    fills = made.fills_of(structure)
    with torch.no_grad():
        if any(owns(fill.target) for fill in fills):
            fill_onto_devices(pool, maps, fills, handoff.backend, owns)
        else:
            fill_all(pool, maps, fills)
