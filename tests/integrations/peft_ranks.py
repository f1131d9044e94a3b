"""One rank of a gloo job that fine-tunes peft_train.py's LoRA Llama data-parallel and saves
adapter-only checkpoints (ckptd.integrations.peft.adapter_state) through a real daemon:
`python peft_ranks.py SPEC_JSON` (issue 31: PEFT under DDP, FSDP2, HSDP and TP).

Layouts (spec["layout"]):
- "ddp": the PeftModel wrapped in DistributedDataParallel; the adapter is whole on every rank;
- "fsdp2": `fully_shard` on each decoder layer and on the PeftModel, over all ranks: every
  parameter, the LoRA matrices too, is a DTensor `Shard(0)`, and so is its optimizer state;
- "hsdp": the same over a 2-D mesh (replicate 2, shard world/2): `[Replicate, Shard(0)]`;
- "tp": tensor parallel over all ranks (tensor_parallel): lora_B a DTensor `Shard(0)`, lora_A
  whole on every rank; every rank trains on the whole batch.

Rank r trains on rows r::world of peft_train.batch(step) (tp: every rank on all of it); the loss
logged is the mean over the ranks (every rank's batch has the same size: the global batch's).

Spec (JSON): layout, address, job, steps, save_every, out (a directory), mode, plus rank,
world_size, port.
- mode "train": load the job's newest step (rng=True) if any, train to `steps`, save (rng=True)
  after each multiple of save_every, the last save waited for until durable. Rank 0 writes
  {"start", "losses"} to out/losses.json. `kill_at`: rank 0 waits until that step's save is
  durable, trains one more step and SIGKILLs itself. At the end rank 0 writes the adapter and
  its optimizer state, whole, by PEFT key (model/KEY, optimizer/state/KEY/FIELD) to
  out/held.safetensors, the scheduler's learning rate to out/lr.json, and each adapter
  parameter's DTensor placements (null: a plain tensor) to out/placements.json.
- mode "load" (any world size, no wrapper): a fresh LoRA model loads step `steps` and rank 0
  writes the same two files.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gloo_rank import run_rank  # noqa: E402
from worker_process import load_worker  # noqa: E402

train = load_worker(Path(__file__).with_name("peft_train.py"))


def wrapped(model: nn.Module, layout: str, world: int) -> nn.Module:
    """`model` in `layout` over all `world` ranks ("none": as it is)."""
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if layout in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape = (world,) if layout == "fsdp2" else (2, world // 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("shard",) if layout == "fsdp2" else ("replicate", "shard"))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if layout == "tp":
        return tensor_parallel(model, world)
    if layout == "none":
        return model
    raise ValueError(f"unknown layout {layout!r}")


def tensor_parallel(model: nn.Module, world: int) -> nn.Module:
    """Megatron's plan for each decoder layer over all `world` ranks (q/k/v and gate/up
    column-parallel, o and down row-parallel), LoRA's matrices with their base layer: lora_B
    split on its output like the base layer's, lora_A a plain tensor on every rank (its gradient
    summed over the ranks by the backward of lora_B's Replicate input). Embedding, norms and
    lm_head stay plain; the base weights stay frozen."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    column = ["self_attn.q_proj.base_layer", "self_attn.q_proj.lora_B.default", "self_attn.k_proj", "self_attn.v_proj.base_layer",
              "self_attn.v_proj.lora_B.default", "mlp.gate_proj", "mlp.up_proj"]
    plan = {**{name: ColwiseParallel() for name in column}, "self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.base_model.model.model.layers:
        parallelize_module(layer, mesh, plan)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)  # parallelize_module makes new Parameters, trainable
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int, rank: int, world: int) -> float:
    """One optimizer step on this rank's rows of step `step`'s batch (all of it when `world` is
    1: tensor parallel); the global batch's loss."""
    tokens = train.batch(step)[rank::world]
    loss = model(tokens, labels=tokens).loss
    loss.backward()  # DDP and FSDP2 average the gradients over the ranks
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total.item() / dist.get_world_size())


def write_held(state: dict[str, Any], out: Path, rank: int) -> None:
    """Rank 0: the adapter and its optimizer state, whole (DTensors gathered: a collective every
    rank joins), by PEFT key, and the learning rate; for the test's comparison only. Fails if a
    plain adapter tensor differs between the ranks (replicas that drifted apart)."""
    from torch.distributed.tensor import DTensor

    def whole(t: Any) -> torch.Tensor:
        t = torch.as_tensor(t)
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().contiguous()

    held: dict[str, torch.Tensor] = {}
    for key, p in state["model"].named_parameters():
        if not isinstance(p, DTensor):  # a replica on every rank (DDP, TP's lora_A): the same everywhere
            first = p.detach().clone()
            dist.broadcast(first, 0)
            assert torch.equal(first, p), f"rank {rank}'s {key} differs from rank 0's"
        held[f"model/{key}"] = whole(p)
        for field, value in state["optimizer"].state[p].items():
            held[f"optimizer/state/{key}/{field}"] = whole(value)
    if rank == 0:
        placements = {key: [str(x) for x in p.placements] if isinstance(p, DTensor) else None for key, p in state["model"].named_parameters()}
        (out / "placements.json").write_text(json.dumps(placements))
        save_file(held, str(out / "held.safetensors"))
        (out / "lr.json").write_text(json.dumps(state["scheduler"].get_last_lr()))


def body(spec: dict[str, Any]) -> None:
    from ckptd.client import CheckpointClient
    from ckptd.integrations.peft import adapter_state

    rank, world, out, steps = spec["rank"], spec["world_size"], Path(spec["out"]), spec["steps"]
    peft_model = train.lora_model()
    peft_model.train()
    model = wrapped(peft_model, spec["layout"] if spec["mode"] == "train" else "none", world)
    optimizer, scheduler = train.optimizer_and_scheduler(peft_model, 10)
    state = adapter_state(model, optimizer, scheduler)
    with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60) as ckpt:
        if spec["mode"] == "load":
            assert ckpt.load(state, step=steps) == steps
        else:
            start = ckpt.load(state, rng=True) or 0
            losses: dict[int, float] = {}
            kill_at = spec.get("kill_at")
            for step in range(start + 1, steps + 1):
                losses[step] = train_step(model, optimizer, scheduler, step, *((0, 1) if spec["layout"] == "tp" else (rank, world)))
                if kill_at is not None and rank == 0 and step == kill_at + 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-run: a step trained after the last save
                if step % spec["save_every"] == 0:
                    handle = ckpt.save(step, state, rng=True)
                    if step in (kill_at, steps):
                        assert handle.wait_durable(timeout=60) is not None
            if rank == 0:
                (out / "losses.json").write_text(json.dumps({"start": start, "losses": losses}))
    write_held(state, out, rank)


if __name__ == "__main__":
    run_rank(body)
