"""The service's in-process parts (its RPC behaviour is tested through real daemons in tests/integration)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from ckptd.format.index import CheckpointIndex, TensorRecord
from ckptd.daemon.engine.context import IndexCache


def _index(step: int, tensors: int = 1) -> CheckpointIndex:
    return CheckpointIndex("j", step, 0.0, 1, tuple(TensorRecord(f"model/w{i}", "model", "F32", (1,), ()) for i in range(tensors)), ())


def test_the_daemon_keeps_a_bounded_number_of_parsed_indexes_most_recently_used_last() -> None:
    cache = IndexCache(2)
    one, two, three = _index(1), _index(2), _index(3)
    cache.put(("j", 1), one)
    cache.put(("j", 2), two)
    assert cache.get(("j", 1)) is one  # now the most recent
    cache.put(("j", 3), three)
    assert cache.get(("j", 2)) is None and cache.get(("j", 1)) is one and cache.get(("j", 3)) is three
    assert cache.pop(("j", 3)) is three and cache.get(("j", 3)) is None


# issue 30 finding 5: also bounded by tensor records (16 indexes of 1,000 tensors took 20 MiB);
# the newest stays whatever its size
def test_the_parsed_indexes_kept_are_bounded_by_their_tensors_too() -> None:
    cache = IndexCache(16, tensors=1000)
    for step in (1, 2, 3):
        cache.put(("j", step), _index(step, 400))
    assert [cache.get(("j", s)) is not None for s in (1, 2, 3)] == [False, True, True]
    cache.put(("j", 4), _index(4, 5000))
    assert cache.get(("j", 4)) is not None and cache.get(("j", 3)) is None and cache.get(("j", 2)) is None
    cache.put(("j", 4), _index(4, 10))  # replaced: counted once
    cache.put(("j", 5), _index(5, 900))
    assert cache.get(("j", 4)) is not None and cache.get(("j", 5)) is not None


def test_a_steps_summary_outlives_its_parsed_index_and_goes_when_the_step_is_popped() -> None:
    from ckptd.daemon.records import StepSummary

    cache = IndexCache(16, tensors=1000)
    big = replace(_index(1, 4000), metric=0.5, created_at=7.0)
    cache.put(("j", 1), big)
    cache.put(("j", 2), _index(2, 4000))  # the first index is dropped: over the tensor bound
    assert cache.get(("j", 1)) is None
    assert cache.summary(("j", 1)) == StepSummary(1, 7.0, big.size_bytes, 1, 0.5)  # what a listing needs, kept
    cache.pop(("j", 1))  # retention removed the step
    assert cache.summary(("j", 1)) is None and cache.summary(("j", 2)) is not None


def test_an_index_is_read_once_for_all_who_ask_while_it_is_read_then_served_from_the_cache() -> None:
    async def main() -> None:
        cache = IndexCache(4)
        reads = 0

        async def read() -> CheckpointIndex:
            nonlocal reads
            reads += 1
            await asyncio.sleep(0.01)
            return _index(7)

        got = await asyncio.gather(*(cache.read(("j", 7), read) for _ in range(4)))
        assert reads == 1 and all(g is got[0] for g in got)
        assert await cache.read(("j", 7), read) is got[0] and reads == 1
        assert cache.get(("j", 7)) is got[0]

    asyncio.run(main())


def test_a_read_from_the_peers_does_not_take_the_failure_of_a_read_of_this_root_at_the_same_time() -> None:
    """Found by a flaky multi-node test: a member whose root had not recorded node 0's commit
    read node 0's index from a peer for its ranks' loads, while a peer's Fetch of its prepared
    part read its own root for the same step; the loads got the root's FileNotFoundError
    ("internal error in PlanLoad")."""

    async def main() -> None:
        cache = IndexCache(4)

        async def from_root() -> CheckpointIndex:
            await asyncio.sleep(0.01)
            raise FileNotFoundError("root/j/step-00000007/ckptd.index.json")

        async def from_peers() -> CheckpointIndex:
            await asyncio.sleep(0.02)
            return _index(7)

        root, peers = await asyncio.gather(cache.read(("j", 7), from_root), cache.read(("j", 7), from_peers, source="peers"), return_exceptions=True)
        assert isinstance(root, FileNotFoundError) and isinstance(peers, CheckpointIndex)
        assert cache.get(("j", 7)) is peers  # one cache: the root's readers find it next
        assert await cache.read(("j", 7), from_root) is peers

    asyncio.run(main())
