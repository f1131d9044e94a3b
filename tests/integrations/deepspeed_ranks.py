"""One rank of a DeepSpeed ZeRO job (CPU accelerator, gloo) that trains, saves and resumes through
ckptd.integrations.deepspeed: `python deepspeed_ranks.py SPEC_JSON` (test_deepspeed.py).

Spec: address, job, stage (1, 2, 3), bf16 (optional: bf16 weights, fp32 master), steps (train up to this step), out (a directory: rank r
writes r.json and r-<name>.safetensors), rank, world_size, port, and
- save_at: save at this step (wait until durable) and dump the whole fp32 master weights and
  optimizer moments as DeepSpeed's own API gathers them (`saved`), then train on to `steps`;
  kill: SIGKILL every rank once `steps` is reached (nothing after the save is saved);
- resume: load the newest step first, dump what DeepSpeed then holds (`loaded`), train on.
The data of a step is a function of the step and the data-parallel rank (the global batch is
the same whatever the size), so a run resumed in the same size repeats the same losses.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from gloo_rank import run_rank  # noqa: E402

GLOBAL_BATCH = 6  # divides by 1, 2 and 3 ranks


class Net(nn.Module):
    """Parameters whose sizes no data-parallel size divides evenly, a buffer, tied nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 3)
        self.register_buffer("scale", torch.tensor([1.0, 0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x)))) * self.scale


class Position:
    """A stateful object of the rank's own (a data sampler's position), saved through `extra`."""

    def __init__(self, seen: int) -> None:
        self.seen = torch.tensor([seen])

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"].clone()


def config(stage: int, world: int, bf16: bool, fp16: bool = False, scheduler: bool = True) -> dict[str, Any]:
    made: dict[str, Any] = {
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16, "initial_scale_power": 16},
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
    }
    if not scheduler:
        del made["scheduler"]
    return made


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def gathered(engine: Any) -> dict[str, torch.Tensor]:
    """The whole fp32 master weights and Adam moments, through DeepSpeed's own API (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue  # frozen: no master weight, no optimizer state
        out[f"master.{name}"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}.{name}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


def facts(engine: Any) -> dict[str, Any]:
    inner = engine.optimizer.optimizer
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    return {
        "counters": [engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps],
        "lr": [g["lr"] for g in inner.param_groups],
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "adam_steps": steps,
    }


def body(spec: dict[str, Any]) -> None:
    import deepspeed  # type: ignore[import-untyped]

    from ckptd.client import CheckpointClient
    from ckptd.integrations.deepspeed import load, save
    from deepspeed_cpu import without_shm_kernel

    rank, world = spec["rank"], spec["world_size"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    without_shm_kernel()
    deepspeed.init_distributed(dist_backend="gloo")  # joins the group run_rank made
    torch.manual_seed(0 if spec.get("resume") is None else 7)  # a resumed run starts from other weights
    model = Net()
    if spec.get("frozen"):
        model.inp.weight.requires_grad_(False)  # trained with a frozen layer: saved as a model tensor, not a master weight
    out = Path(spec["out"])
    if spec.get("no_optimizer"):  # an engine for evaluation: deepspeed.initialize without an optimizer
        bare = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "zero_optimization": {"stage": spec["stage"]}}
        engine, *_ = deepspeed.initialize(model=model, config=bare)
        with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60) as ckpt:
            try:
                save(engine, ckpt, 1)
                refused = ""
            except (TypeError, ValueError) as exc:
                refused = f"{type(exc).__name__}: {exc}"
        (out / f"{rank}.json").write_text(json.dumps({"refused": refused}))
        return
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(spec["stage"], world, spec.get("bf16", False), spec.get("fp16", False), spec.get("scheduler", True)),
    )
    dtype = torch.bfloat16 if spec.get("bf16") else torch.float16 if spec.get("fp16") else torch.float32
    report: dict[str, Any] = {"losses": {}}
    extra: dict[str, Any] = {"epoch": -1, "position": Position(-1)}
    start = 0
    with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60) as ckpt:
        if spec.get("resume"):
            try:
                loaded = load(engine, ckpt, extra=extra)
            except ValueError as exc:
                (out / f"{rank}.json").write_text(json.dumps({"refused": str(exc), "after": facts(engine)}))
                return
            report["loaded_step"] = loaded
            report["extra"] = {"epoch": extra["epoch"], "position": int(extra["position"].seen)}
            report["loaded"] = facts(engine)
            scaler = getattr(engine.optimizer, "loss_scaler", None)
            report["loss_scaler"] = {"scale": float(getattr(scaler, "cur_scale", 0.0)), "dynamic": bool(getattr(scaler, "dynamic", False))}
            if loaded is not None:  # a fresh engine has no optimizer state to gather yet
                save_file(gathered(engine), str(out / f"{rank}-loaded.safetensors"))
            start = loaded or 0
        for step in range(start + 1, spec["steps"] + 1):
            x, y = batch(step, rank, world)
            loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            report["losses"][step] = loss.item()
            if step == spec.get("save_at"):
                handle = save(engine, ckpt, step, extra={"epoch": step // 2, "position": Position(10 * rank + step)})
                handle.wait_durable(timeout=60)
                report["saved"] = facts(engine)
                save_file(gathered(engine), str(out / f"{rank}-saved.safetensors"))
    report["final"] = facts(engine)
    (out / f"{rank}.json").write_text(json.dumps(report))
    if spec.get("kill"):
        dist.barrier()  # every rank past its last collective before any dies
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    run_rank(body)
