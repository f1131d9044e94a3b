"""One torchrun worker of the restart and preemption tests: `torchrun ... restart_rank.py SPEC_JSON`.

A DDP-trained MLP (gloo, CPU), saved through ckptd after every step and resumed from the newest
step at start (the daemon at $CKPTD_ADDRESS; rank, world size and run id from torchrun's
environment). Each rank appends one JSON line per trained step to OUT/rank<R>.jsonl: attempt
($TORCHELASTIC_RESTART_COUNT), step, loss (its own batch's, before the update), resumed_from.

Spec (JSON): job, steps, out (a directory), and optionally
- kill: {"rank": R, "step": K, "hide": DIR}: on the first attempt that gets past start-up (none
  has written OUT/killed yet), rank R waits until step K is
  durable, moves the step's data files into DIR (so a load that read them would fail), and
  writes OUT/killed and SIGKILLs itself in the middle of step K+1 (after the forward pass);
- preempt: {"grace_s": G, "step_sleep": S}: train inside `ckptd.client.preemption.Preemption`,
  saving only when preempted (each step sleeps S seconds so a signal lands mid-training); before
  the save each rank writes its state to OUT/state<R>.safetensors (what the step must restore).
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ckptd.client import CheckpointClient
from ckptd.client.preemption import Preemption


def make_model() -> nn.Module:
    torch.manual_seed(0)  # identical on every rank, as DDP requires
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def flat_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's tensors and the optimizer's per-parameter state, by name (for a bit-exact check)."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, fields in optimizer.state.items():
        for field, value in fields.items():
            out[f"optimizer/{names[id(p)]}/{field}"] = torch.as_tensor(value).detach().clone()
    return out


def main(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a native abort (gloo, gRPC) prints every thread's stack
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    out = Path(spec["out"])
    model = make_model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    state = {"model": model, "optimizer": optimizer}
    ckpt = CheckpointClient(spec["job"], on_error="raise", timeout_s=60)
    start = ckpt.load(state) or 0
    # the kill happens once, in the first attempt that gets this far: an attempt may die before
    # (rank 0's store port, picked free by torchrun, taken by another process before it binds)
    killed = out / "killed"
    kill = spec.get("kill") if not killed.exists() else None
    preempt = spec.get("preempt")
    preemption = Preemption(ckpt, grace_s=preempt["grace_s"]) if preempt else None
    if preemption is not None:
        preemption.install()
    log = open(out / f"rank{rank}.jsonl", "a")
    for step in range(start + 1, spec["steps"] + 1):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if kill is not None and kill["rank"] == rank and step == kill["step"] + 1:
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: after the forward, before the gradients' all-reduce
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log.write(json.dumps({"attempt": attempt, "step": step, "loss": loss.item(), "resumed_from": start}) + "\n")
        log.flush()
        if preemption is not None:
            time.sleep(preempt["step_sleep"])
            if preemption.requested():
                save_file(flat_state(model, optimizer), str(out / f"state{rank}.safetensors"))
                preemption.save_and_exit(step, state)
            continue
        handle = ckpt.save(step, state)
        if kill is not None and kill["rank"] == rank and step == kill["step"]:
            info = handle.wait_durable(timeout=60)
            assert info is not None
            hide = Path(kill["hide"])
            hide.mkdir(parents=True, exist_ok=True)
            for data in Path(info.step_dir).glob("*.safetensors"):
                shutil.move(str(data), str(hide / data.name))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
