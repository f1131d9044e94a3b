"""One rank of a gloo job that writes a torch.distributed.checkpoint (DCP) directory for the
`ckptd import` tests: `python import_dcp_rank.py SPEC_JSON`.

A small model whose parameters are DTensors sharded with Shard(0) over all ranks takes one
AdamW step, then `dcp.save({"model": ..., "optimizer": ..., "train": {...}})` writes its state
(get_state_dict: optimizer state keyed by parameter name) with a FileSystemWriter into
spec["out"]. Rank 0 also writes the whole tensors, under the names ckptd gives them, to
spec["reference"] (a safetensors file) for the test to compare with. Spec: rank, world_size,
port, out, reference.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gloo_rank import run_rank  # beside this script


def sharded_model(mesh) -> nn.Module:
    torch.manual_seed(0)  # the same whole values on every rank
    model = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 5))
    for name, param in list(model.named_parameters()):
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
    return model


def whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def run(spec: dict) -> None:
    mesh = init_device_mesh("cpu", (spec["world_size"],))
    model = sharded_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = distribute_tensor(torch.randn(param.shape, generator=g), mesh, [Shard(0)])
    opt.step()
    model_state, optimizer_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optimizer": optimizer_state, "train": {"epoch": 4}}, checkpoint_id=spec["out"])
    reference = {f"model/{k}": whole(v) for k, v in model_state.items()}
    for fqn, fields in optimizer_state["state"].items():
        reference |= {f"optimizer/state/{fqn}/{field}": whole(v) for field, v in fields.items()}
    if spec["rank"] == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in reference.items()}, spec["reference"])


if __name__ == "__main__":
    run_rank(run)
