"""The HELD tier: the newest committed snapshot of each job, still in this daemon's arenas
(handoff/arena.py `ArenaPool.hold`), read in place by the ranks. Only lossless tensors whose
overlapping fragments all sit in this node's arenas are served from it (plan/load_plan.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ckptd.common.boxes import intersect
from ckptd.daemon.engine.context import Engine
from ckptd.daemon.engine.tiers import Tier
from ckptd.format.index import TensorRecord
from ckptd.daemon.handoff.arena import ArenaSet, SetState
from ckptd.daemon.plan.load_plan import TierName
from ckptd.format.file_plan import SHM_SOURCE, PieceInfo
from ckptd.daemon.plan.save_plan import TensorSpec


@dataclass(frozen=True, eq=False)
class HeldArenas:
    """A held arena set as the planner reads it (load_plan.HeldSnapshot) and a load leases it
    (engine/tiers.Snapshot)."""

    engine: Engine
    job: str
    arenas: ArenaSet

    @property
    def key(self) -> int:
        return id(self.arenas)

    @property
    def layout(self) -> object:
        return self.arenas.plan

    @property
    def extras(self) -> Mapping[int, Any] | None:
        return self.arenas.extras

    def current(self, step: int) -> bool:
        return self.arenas.state is SetState.HELD and self.arenas.step == step

    def pieces(self, spec: TensorSpec, record: TensorRecord) -> list[PieceInfo] | None:
        out = []
        for slot in self.arenas.plan.slots_named(record.name):
            if intersect(slot.box, spec.box) is None:
                continue
            arena = self.arenas.arenas[slot.rank]
            if arena is None:
                return None
            out.append(PieceInfo(spec.name, SHM_SOURCE, arena.path_text, slot.offset, slot.nbytes, slot.box, record.dtype, ""))
        return out

    def lease(self) -> None:
        self.arenas.readers += 1

    def release(self) -> None:
        """The arena set may be idle now: reusable, or given back (engine/memory.py)."""
        self.arenas.readers = max(0, self.arenas.readers - 1)
        state = self.engine.jobs.get(self.job)
        if state is not None:
            state.pool.mark_used()
            self.engine.memory.settle(state)


class HeldSnapshots(Tier):
    """The jobs' held snapshots (one per job at most: the newest committed step)."""

    name = TierName.HELD

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def snapshot(self, job: str, step: int) -> HeldArenas | None:
        state = self.engine.jobs.get(job)
        held = state.pool.held(step) if state is not None else None
        return HeldArenas(self.engine, job, held) if held is not None else None
