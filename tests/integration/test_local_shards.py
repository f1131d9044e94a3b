"""LocalShard: ranks that know their pieces as offsets save them as one logical tensor, and any
layout loads it back (the path ckptd.integrations.dcp takes)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ckptd.client import CheckpointClient, LocalShard


def _collective(address: str, job: str, world: int, work) -> list:
    """Run work(client, rank) on `world` clients at once (one per thread), as the ranks of a job."""
    clients = [CheckpointClient(job, address=address, rank=r, world_size=world, on_error="raise") for r in range(world)]
    try:
        with ThreadPoolExecutor(world) as pool:
            return list(pool.map(lambda r: work(clients[r], r), range(world)))
    finally:
        for c in clients:
            c.close()


def test_row_shards_saved_by_two_ranks_load_whole_and_as_column_shards(daemon) -> None:
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    bias = torch.arange(6, dtype=torch.bfloat16)
    rows = [(0, 3), (3, 8)]  # uneven, as DCP chunks may be

    def save(client: CheckpointClient, rank: int) -> None:
        lo, hi = rows[rank]
        state = {"model": {"w": LocalShard(full[lo:hi].clone(), (lo, 0), (8, 6)), "b": bias.clone()}}
        client.save(5, state).wait_durable(timeout=60)

    _collective(daemon.address, "shards", 2, save)

    with CheckpointClient("shards", address=daemon.address, on_error="raise") as client:
        whole = {"model": {"w": torch.zeros(8, 6), "b": torch.zeros(6, dtype=torch.bfloat16)}}
        assert client.load(whole) == 5
        assert torch.equal(whole["model"]["w"], full) and torch.equal(whole["model"]["b"], bias)

    cols = [(0, 4), (4, 6)]

    def load(client: CheckpointClient, rank: int) -> torch.Tensor:
        lo, hi = cols[rank]
        target = torch.zeros(8, hi - lo)
        client.load({"model": {"w": LocalShard(target, (0, lo), (8, 6)), "b": torch.zeros(6, dtype=torch.bfloat16)}})
        return target

    left, right = _collective(daemon.address, "shards", 2, load)
    assert torch.equal(left, full[:, :4]) and torch.equal(right, full[:, 4:])


def test_shards_that_leave_a_gap_are_refused_naming_the_tensor(daemon) -> None:
    def save(client: CheckpointClient, rank: int) -> None:
        lo, hi = [(0, 3), (4, 8)][rank]
        client.save(1, {"model": {"w": LocalShard(torch.ones(hi - lo, 2), (lo, 0), (8, 2))}})

    with pytest.raises(Exception, match="model/w"):
        _collective(daemon.address, "gap", 2, save)


@pytest.mark.parametrize(
    ("offsets", "global_shape", "message"),
    [((0,), (4, 4), "one entry per dimension"), ((2, 0), (4, 4), r"covers \[2, 5\)"), ((-1, 0), (4, 4), "outside")],
)
def test_a_shard_outside_its_global_shape_is_refused(offsets, global_shape, message) -> None:
    with pytest.raises(ValueError, match=message):
        LocalShard(torch.ones(3, 4), offsets, global_shape)


def test_a_dtensor_is_not_wrapped() -> None:
    from torch.distributed.tensor import DTensor

    class Fake(DTensor):  # isinstance is all LocalShard looks at
        def __new__(cls):  # noqa: D102
            return torch.Tensor._make_subclass(cls, torch.ones(1))

    with pytest.raises(TypeError, match="DTensor"):
        LocalShard(Fake(), (0,), (1,))
