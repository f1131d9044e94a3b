"""One rank of a gloo job whose tensors have several chunks per rank (a ShardedTensor with two
local shards on each rank, rows interleaved as a row-wise sharded embedding table holds them),
saved by dcp.save through CkptdStorageWriter and loaded, in another world size, as DTensors:
`python dcp_chunks_rank.py SPEC_JSON`.

Spec: mode "save" (address, job, step) | "load" (step_dir). A loading rank checks its shard of
every tensor against the reference itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalPiece, init_from_local_shards
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gloo_rank import run_rank  # noqa: E402

ROWS, COLS = 12, 5
CHUNKS_PER_RANK = 2


def reference(name: str) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (1 + len(name))


def sharded(name: str) -> object:
    """Rank r of w holds row blocks r and r + w of 2w blocks (two chunks of the same tensor)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    block = ROWS // (CHUNKS_PER_RANK * world)
    full = reference(name)
    pieces = []
    for i in (rank, rank + world):
        meta = ShardMetadata(shard_offsets=[i * block, 0], shard_sizes=[block, COLS], placement=f"rank:{rank}/cpu")
        pieces.append(LocalPiece(full[i * block : (i + 1) * block].clone(), meta))
    return init_from_local_shards(pieces, ROWS, COLS)


def body(spec: dict) -> None:
    from ckptd.integrations.dcp import CkptdStorageReader, CkptdStorageWriter

    names = ("embed.weight", "table.weight")
    if spec["mode"] == "save":
        state = {"model": {n: sharded(n) for n in names}}
        writer = CkptdStorageWriter(spec["job"], address=spec["address"], durable=True)
        dcp.save(state, storage_writer=writer, checkpoint_id=spec["step"])
        writer.close()
        return
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"model": {n: distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]) for n in names}}
    dcp.load(state, storage_reader=CkptdStorageReader(spec["step_dir"]))
    for n, t in state["model"].items():
        rows = reference(n).chunk(dist.get_world_size())[dist.get_rank()]
        assert torch.equal(t.to_local(), rows), n


if __name__ == "__main__":
    run_rank(body)
