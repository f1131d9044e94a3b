"""One rank of a gloo job that trains a small model with sharded (DTensor Shard(0)) parameters
and AdamW, saving or resuming through ckptd: `python train_worker.py SPEC_JSON`.

Every rank computes the same loss on the same global batch from the gathered parameters, so the
training is the same computation whatever the number of ranks; only the sharding of parameters
and Adam moments changes. Spec: address, job, rank, world_size, port, start (0: fresh), stop,
save_at (0: never), out (rank 0 writes the losses as JSON there). Several nodes: `addresses`
(each rank's daemon) and `local_world_size` (per rank: the ranks on its node) replace `address`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from gloo_rank import run_rank  # beside this script

SHAPES = {"w1": (13, 8), "w2": (5, 13), "b1": (13,)}


class ShardedMLP(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            value = torch.randn(shape, generator=g) * 0.3
            self.register_parameter(name, nn.Parameter(distribute_tensor(value, mesh, [Shard(0)])))

    def loss_and_grads(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The loss on the whole parameters; each shard's gradient is its part of the whole one.

        Every rank computes the same whole gradient, so the result does not depend on the number
        of ranks (DTensor's own backward would scale it by the reduce-scatter's op)."""
        full = {n: getattr(self, n).full_tensor().detach().requires_grad_() for n in SHAPES}
        out = torch.tanh(x @ full["w1"].T + full["b1"]) @ full["w2"].T
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        for n, whole in full.items():
            param = getattr(self, n)
            param.grad = distribute_tensor(whole.grad, param.device_mesh, param.placements)
        return loss.item()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 5, generator=g)


def train(spec: dict) -> None:
    from ckptd.client import CheckpointClient

    mesh = init_device_mesh("cpu", (spec["world_size"],))
    model = ShardedMLP(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    losses = {}
    rank = spec["rank"]
    address = spec["addresses"][rank] if "addresses" in spec else spec["address"]
    local = spec.get("local_world_size")
    local_world_size = local[rank] if isinstance(local, list) else None
    with CheckpointClient(spec["job"], address=address, on_error="raise", timeout_s=60, local_world_size=local_world_size) as ckpt:
        start = spec["start"]
        if start:
            assert ckpt.load({"model": model, "optimizer": opt}, step=start) == start
        for step in range(start + 1, spec["stop"] + 1):
            opt.zero_grad()
            losses[step] = model.loss_and_grads(*batch(step))
            opt.step()
            if step == spec["save_at"]:
                ckpt.save(step, {"model": model, "optimizer": opt}).wait_durable(timeout=60)
    if spec["rank"] == 0:
        Path(spec["out"]).write_text(json.dumps(losses))


if __name__ == "__main__":
    run_rank(train)
