"""The shared-memory hand-off: a save's CPU tensors copied into the daemon's arena.

Every save's CPU tensors take this copy, whatever the mode (modes apply to CUDA tensors only);
a state without CUDA tensors takes nothing else. The copy runs on the client's copy pool with a
plan made once per (placement layout, arena mapping) (ckptd.client.arena_copy), so a save of an
unchanged state costs a few Python calls per copy group, whatever the number of tensors. When
`start` returns every byte is in the arena: the commit may go from the helper thread at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Mapping

from ckptd.client.arenas import ArenaMaps
from ckptd.client._handoff.base import Started
from ckptd.client._handoff.modes import CPU
from ckptd.client.arena_copy import CopyPlan
from ckptd.client.errors import CheckpointError
from ckptd.client.slots import Placed

if TYPE_CHECKING:
    from ckptd.client._rpc import SaveGrant

MAX_PLANS = 4  # arenas of earlier layouts or a restarted daemon


class ShmTransport:
    """HandoffTransport of CPU tensors: copies into the arena mapping, nothing in flight after."""

    mode = CPU

    def __init__(self, maps: ArenaMaps, pool: ThreadPoolExecutor, workers: int) -> None:
        self._maps = maps
        self._pool = pool
        self._workers = workers  # groups of a copy: one per core (the calling thread takes one)
        self._plans: dict[str, tuple[Placed, Any, CopyPlan]] = {}  # arena path -> (placed, mapping, plan)
        self._done = Started((), CPU)

    def start(self, state: Mapping[str, Any], placed: Placed, grant: "SaveGrant") -> Started:
        if placed.host:
            self.copy_host(placed, grant.arena_path, grant.arena_size)
        return self._done

    def copy_host(self, placed: Placed, arena_path: str, arena_size: int) -> None:
        """Copy the placement's CPU tensors into the arena with a copy plan made once per
        (placement layout, arena mapping) (ckptd.client.arena_copy)."""
        arena = self._maps.get(arena_path, arena_size)
        cached = self._plans.get(arena_path)
        if cached is None or cached[1] is not arena or cached[0].layout_id != placed.layout_id or cached[0].structure.signature is not placed.structure.signature:
            plan = CopyPlan(arena, placed.host_sources, [placed.placements[i][1] for i in placed.host], self._workers)
            self._plans.pop(arena_path, None)
            self._plans[arena_path] = cached = (placed, arena, plan)
            while len(self._plans) > MAX_PLANS:
                del self._plans[next(iter(self._plans))]
        cached[2].run(self._pool, placed.host_sources, cold=self._maps.is_cold(arena_path))
        self._maps.mark_warm(arena_path)

    def on_commit_error(self, exc: CheckpointError) -> None:
        return None

    def close(self) -> None:
        self._plans.clear()
