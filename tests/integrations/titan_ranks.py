"""One rank of a gloo job that trains the way torchtitan's Trainer does, with torchtitan's own
components (OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader, and the
checkpoint manager built from its Config) and checkpoints through CkptdCheckpointManager:
`python titan_ranks.py SPEC_JSON`.

torchtitan 0.3's Trainer itself does not run on a CPU (docs/integrations/torchtitan.md), so this
loop is Trainer.train's: load(step=load_step), then per step train, maybe_wait_for_staging before
the optimizer step, save(step, last_step=...). The model is FSDP2-sharded (fully_shard) over all
ranks, so its and the optimizer's state are DTensors.

Spec: address, job, async_mode, steps, interval; load_step (default -1); load_only;
exclude (exclude_from_loading); initial_load_path (loaded whole when the job has no step); kill_at (SIGKILL every rank after that step's training, before
its save); dump_at (write the state after that step's save); out (prefix of this rank's files:
OUT-<rank>-<what>.safetensors / .json, what = "loaded" after the load, the dump_at step, "final").
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gloo_rank import run_rank  # noqa: E402

BATCH = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


class Samples(IterableDataset, Stateful):  # type: ignore[type-arg]
    """This data-parallel rank's endless samples; its position is its state."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.position = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(self.dp_rank * 100_000 + self.position)
            self.position += 1
            yield torch.randn(8, generator=g), torch.randn(4, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = state_dict["position"]


class TrainState(Stateful):
    """The Trainer's own entry of the checkpoint ("train_state"): step and tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def dump(out: str, what: str, model: nn.Module, optimizers: Any, lr_schedulers: Any, dataloader: Any, train: TrainState) -> None:
    """Every rank writes the whole state it sees: tensors (gathered) and the rest as JSON."""
    tensors = {f"model.{k}": _full(v).detach().clone() for k, v in model.state_dict().items()}
    other: dict[str, Any] = {}
    for key, value in optimizers.state_dict().items():
        if isinstance(value, torch.Tensor):
            tensors[f"optimizer.{key}"] = _full(value).detach().clone()
        else:
            other[f"optimizer.{key}"] = value
    other["lr_scheduler"] = lr_schedulers.state_dict()
    other["lrs"] = [group["lr"] for opt in optimizers for group in opt.param_groups]
    other["train_state"] = train.state_dict()
    other["dataloader"] = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in dataloader.state_dict().items()}
    rank = dist.get_rank()
    save_file(tensors, f"{out}-{rank}-{what}.safetensors")
    Path(f"{out}-{rank}-{what}.json").write_text(json.dumps(other, default=repr))


def body(spec: dict[str, Any]) -> None:
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from ckptd.integrations.torchtitan import CkptdCheckpointManager

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Net()
    for layer in (model.inp, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=spec["steps"])
    dataloader = ParallelAwareDataloader(Samples(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    train = TrainState()
    checkpointer = CkptdCheckpointManager.Config(
        enable=True,
        job=spec["job"],
        address=spec["address"],
        async_mode=spec["async_mode"],
        interval=spec["interval"],
        load_only=spec.get("load_only", False),
        exclude_from_loading=spec.get("exclude", []),
        initial_load_path=spec.get("initial_load_path"),
        initial_load_model_only=False,
        last_save_model_only=False,
    ).build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train},
        sd_adapter=None,
    )
    out = spec["out"]
    losses: dict[int, float] = {}
    try:
        checkpointer.load(step=spec.get("load_step", -1))
        dump(out, "loaded", model, optimizers, lr_schedulers, dataloader, train)
        batches = iter(dataloader)
        while train.step < spec["steps"]:
            train.step += 1
            x, y = next(batches)
            optimizers.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            checkpointer.maybe_wait_for_staging()
            optimizers.step()
            lr_schedulers.step()
            train.ntokens_seen += x.numel()
            losses[train.step] = loss.item()
            Path(f"{out}-{rank}-losses.json").write_text(json.dumps(losses))
            if train.step == spec.get("kill_at"):
                dist.barrier()  # every rank has handed its last save over: the kill lands between saves
                os.kill(os.getpid(), signal.SIGKILL)
            checkpointer.save(train.step, last_step=train.step == spec["steps"])
            if train.step == spec.get("dump_at"):
                dump(out, str(train.step), model, optimizers, lr_schedulers, dataloader, train)
        checkpointer.maybe_wait_for_saving()
        dump(out, "final", model, optimizers, lr_schedulers, dataloader, train)
    finally:
        checkpointer.close()


if __name__ == "__main__":
    run_rank(body)
