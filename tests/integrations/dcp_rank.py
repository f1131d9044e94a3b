"""One rank of a gloo job that saves or loads a DTensor-sharded model with torch.distributed.checkpoint
through ckptd: `python dcp_rank.py SPEC_JSON`.

Spec: mode "save" (CkptdStorageWriter to the daemon at `address`, job, step) | "load" (from
`step_dir` with CkptdStorageReader, or from a plain DCP directory `dcp_dir`), and `out`: each
rank writes the full tensors it sees after the load (gathered) to out-<rank>.safetensors.
Parameters are sharded Shard(0) over all ranks, so 2 ranks and 3 ranks hold different boxes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gloo_rank import run_rank  # noqa: E402

SHAPES = {"embed.weight": (10, 6), "proj.weight": (7, 6), "proj.bias": (7,)}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def body(spec: dict) -> None:
    from ckptd.integrations.dcp import CkptdStorageReader, CkptdStorageWriter

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    values = reference() if spec["mode"] == "save" else {n: torch.zeros(s) for n, s in SHAPES.items()}
    model = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in values.items()}
    state = {"model": model, "step_count": torch.tensor([spec.get("step", 0)]), "note": {"epoch": 3}}
    if spec["mode"] == "save":
        writer = CkptdStorageWriter(spec["job"], address=spec["address"], durable=True)
        dcp.save(state, storage_writer=writer, checkpoint_id=spec["step"])
        writer.close()
        return
    if "dcp_dir" in spec:
        dcp.load(state, storage_reader=dcp.FileSystemReader(spec["dcp_dir"]))
    else:
        dcp.load(state, storage_reader=CkptdStorageReader(spec["step_dir"]))
    full = {f"model.{n}": t.full_tensor() for n, t in model.items()}
    full["step_count"] = state["step_count"]
    save_file(full, f"{spec['out']}-{dist.get_rank()}.safetensors")
    assert state["note"] == {"epoch": 3}, state["note"]


if __name__ == "__main__":
    run_rank(body)
