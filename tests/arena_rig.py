"""Arena sets for tests that need one without an engine: the pool's primitives, chosen as
engine/memory.py chooses them when no budget limits them."""

from __future__ import annotations

from ckptd.daemon.handoff.arena import ArenaPool, ArenaSet, SetState


def take_arenas(pool: ArenaPool, sizes: tuple[int, ...]) -> ArenaSet | None:
    """A set for `sizes` from the pool's primitives, as engine/memory.py takes one without a
    budget: a free or held set that fits, else an idle one reallocated, else a new one while the
    pool may grow; None when every set is busy."""
    chosen = pool.fitting(sizes, SetState.FREE) or pool.fitting(sizes, SetState.HELD)
    if chosen is not None:
        return pool.reserve(chosen).arena_set
    idle = pool.idle_sets()
    if not idle and not pool.can_grow:
        return None
    taken = pool.reserve(idle[0]) if idle else pool.reserve_new()
    pool.allocate(taken.arena_set, sizes)
    return taken.arena_set
