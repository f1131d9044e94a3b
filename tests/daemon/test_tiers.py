"""engine/tiers.py: which tier a load's step comes from (`locate`), the protocol's defaults, and
`Tiers` by name. Fake tiers only: what each real tier answers is tested with its daemon."""

from __future__ import annotations

import asyncio

import pytest

from ckptd.daemon.engine.tiers import Located, Tier, Tiers, locate
from ckptd.daemon.metrics import LiveState
from ckptd.daemon.plan.load_plan import TierName


class Fake(Tier):
    """A tier holding `steps`; `newest_step`: what it offers for the newest (None: nothing);
    `only_first`: it offers the newest only when no tier before found one (the root, the peers),
    `not_after_copy`: not over a step read from another copy (the bucket)."""

    def __init__(self, name: TierName, steps: set[int], newest_step: int | None = None, only_first: bool = False, copy: bool = False,
                 not_after_copy: bool = False) -> None:
        self.name, self.steps, self.newest_step = name, steps, newest_step
        self.only_first, self.copy, self.not_after_copy = only_first, copy, not_after_copy
        self.asked: list[int | None] = []

    def _found(self, step: int) -> Located:
        return Located(step, self if self.copy else None)  # type: ignore[arg-type]

    async def newest(self, job: str, found: Located | None) -> Located | None:
        self.asked.append(None)
        if (self.only_first and found is not None) or (self.not_after_copy and found is not None and found.copy is not None):
            return None
        return None if self.newest_step is None else self._found(self.newest_step)

    async def locate(self, job: str, step: int) -> Located | None:
        self.asked.append(step)
        return self._found(step) if step in self.steps else None


def _tiers(root: set[int], peers: set[int], bucket: set[int], newest: tuple[int | None, int | None, int | None]) -> list[Fake]:
    return [
        Fake(TierName.ROOT, root, newest[0], only_first=True),
        Fake(TierName.PEER_DISK, peers, newest[1], only_first=True, copy=True),
        Fake(TierName.BUCKET, bucket, newest[2], not_after_copy=True),
    ]


@pytest.mark.parametrize(
    ("root", "peers", "bucket", "step", "found_in", "asked"),
    [
        ({5}, {5}, {5}, 5, TierName.ROOT, 1),  # the root has it: nobody else is asked
        (set(), {5}, {5}, 5, TierName.PEER_DISK, 2),  # a replaced node: the peers' root
        (set(), set(), {5}, 5, TierName.BUCKET, 3),  # last: the bucket restores it
        (set(), set(), set(), 5, None, 3),
    ],
)
def test_a_step_comes_from_the_first_tier_that_holds_it(root: set[int], peers: set[int], bucket: set[int], step: int,
                                                        found_in: TierName | None, asked: int) -> None:
    tiers = _tiers(root, peers, bucket, (None, None, None))
    found = asyncio.run(locate(tiers, "j", step))
    assert (found is None) == (found_in is None)
    if found is not None:
        assert found.step == step
        assert (found.copy is not None) == (found_in is TierName.PEER_DISK)
    assert sum(len(t.asked) for t in tiers) == asked


@pytest.mark.parametrize(
    ("newest", "want", "from_peers"),
    [
        ((7, 9, None), 7, False),  # the root's newest; the peers are not asked for theirs
        ((7, None, 8), 8, False),  # the bucket's newer step (restored into the root)
        ((None, 9, 11), 9, True),  # an empty root: the peers' newest, and never the bucket over it
        ((None, None, 4), 4, False),  # an empty root, no peer: the bucket's
        ((None, None, None), None, False),
    ],
)
def test_the_newest_step_each_tier_may_improve_on(newest: tuple[int | None, int | None, int | None], want: int | None, from_peers: bool) -> None:
    found = asyncio.run(locate(_tiers(set(), set(), set(), newest), "j", None))
    assert (found.step if found is not None else None) == want
    assert found is None or (found.copy is not None) == from_peers


def test_the_defaults_take_no_part() -> None:
    tier = Fake(TierName.HELD, set())
    state = LiveState(queue_depth={}, open_saves={}, arena_bytes=0, arenas=0, loads_active=0, draining=False, job_arena_bytes={}, job_idle_s={})
    assert tier.snapshot("j", 1) is None and tier.protected("j") == set() and tier.status_fields() == {}
    assert tier.live(state) is state
    assert asyncio.run(Tier.files(tier, None, {})) == {}  # type: ignore[arg-type]
    assert asyncio.run(Tier.listing(tier, "j", [])) == []
    with pytest.raises(NotImplementedError, match="held"):
        asyncio.run(Tier.stage(tier, None, [], None))  # type: ignore[arg-type]


def test_tiers_by_name_in_order_and_one_per_name() -> None:
    root, bucket = Fake(TierName.ROOT, set()), Fake(TierName.BUCKET, set())
    tiers = Tiers([root, bucket])
    assert list(tiers) == [root, bucket] and tiers[TierName.BUCKET] is bucket
    with pytest.raises(AssertionError):
        Tiers([root, Fake(TierName.ROOT, set())])
