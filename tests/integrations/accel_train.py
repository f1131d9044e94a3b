"""A plain Accelerate training loop that saves and resumes through ckptd.integrations.accelerate
(tests/integrations/test_accelerate.py runs it as a subprocess and imports its helpers).

`python accel_train.py SPEC_JSON` trains. Spec keys:
  address, job   the daemon and the job (no address: no checkpoints at all)
  steps          batches (= optimizer steps) to train in all; 10 batches an epoch
  save_every     save after every step that is a multiple of it (without waiting)
  kill_at        0, or a step: at its end the process waits until the last save is durable,
                 writes that step to `marker` and kills itself with SIGKILL
  kill_handed_over  with kill_at: wait only until the last save is handed over (its commit may
                 still be under way in the daemon) before the kill
  resume_step    the step to resume from (default: the newest committed)
  out            where {"resumed_from": step or None, "losses": {step: loss}, "tracker": {...}}
                 goes as JSON (rewritten after every step), with "samples": {step: [sample ids]}
                 and "epochs": {epoch: [sample ids in the order trained]};
                 "{rank}" in it is the process index
  rank, world_size, port   run as one process of a gloo group (run_ranks sets them); else one process
  resized        resumed in another world size than the checkpoint's: skip by batches_to_skip
  stateful       Accelerate's use_stateful_dataloader (torchdata's StatefulDataLoader): the loader's
                 state comes back with load_state, so the loop skips nothing itself
  fsdp           with ranks: Accelerate's FSDP2 plugin (sharded state dict; tests/integrations/fsdp_cpu.py)
  replicas       with fsdp: HSDP, Accelerate's ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=rest)
  parallel, model_dir  "tp" or "ep": instead of the small MLP, hf_train.save_parallel_model's causal LM
                 from model_dir, tensor (and "ep": expert) parallel over all the ranks as transformers'
                 DistributedConfig loads it, under Accelerate's ParallelismConfig(tp_size=ranks) (on CPU
                 through fsdp_cpu.fsdp_on_cpu("MULTI_GPU")); one process loads it plain
  deepspeed      with ranks: a ZeRO stage (1, 2, 3): Accelerate's DeepSpeedPlugin on DeepSpeed's CPU
                 accelerator over gloo (deepspeed_accelerator below)
  dump           a path ("{rank}" allowed): after the load (or the fresh start) and after the last
                 step, each process writes the full model and optimizer tensors (safetensors,
                 keys prefixed "loaded/" and "end/") and the scheduler's state (JSON, .json beside)
The model has dropout, the DataLoader shuffles (seedable sampler, its own generator), an LR
scheduler steps every step and a registered object with state_dict/load_state_dict keeps a
running mean that scales the loss: what a resume must reproduce exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

SEED = 11
SAMPLES = 40
BATCH = 4  # 10 batches an epoch


class RunningMean:
    """A user object registered for checkpointing: the mean of the losses seen so far."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0

    def update(self, value: float) -> None:
        self.count += 1
        self.mean += (value - self.mean) / self.count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])


def parts(parallel: str = "", model_dir: str = "") -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.utils.data.DataLoader]:
    """The model (with dropout), optimizer, LR scheduler and shuffling DataLoader (batches of
    inputs, targets and sample ids), seeded. `parallel` ("tp", "ep"): the causal LM in
    `model_dir` over all the ranks instead (inputs token ids, targets unused)."""
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(99)
    if parallel:
        import hf_train

        model: nn.Module = hf_train.parallel_model(parallel, model_dir, int(os.environ.get("WORLD_SIZE", "1")))
        inputs = torch.randint(0, hf_train.VOCAB, (SAMPLES, hf_train.SEQ), generator=g)
    else:
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        inputs = torch.randn(SAMPLES, 8, generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    data = torch.utils.data.TensorDataset(inputs, torch.randn(SAMPLES, 1, generator=g), torch.arange(SAMPLES))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5))
    return model, optimizer, scheduler, loader


def deepspeed_accelerator(stage: int, **kwargs: Any) -> Any:
    """An Accelerator with Accelerate's DeepSpeedPlugin at ZeRO `stage` over gloo.

    Accelerate picks DeepSpeed only without cpu=True (accelerate/state.py:974, "and not cpu"),
    and without a GPU it then finds no backend and sets the world to one process
    (state.py:287-290, while DeepSpeed's engine sees them all): InitProcessGroupKwargs(backend="gloo"),
    Accelerate's own setting, gives it the gloo group DeepSpeed's CPU accelerator uses. On GPUs
    (CKPTD_TEST_DEVICE=cuda) Accelerate's own NCCL choice is kept."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
    from fsdp_cpu import on_gpus

    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1, gradient_clipping=1.0)
    handlers = [] if on_gpus() else [InitProcessGroupKwargs(backend="gloo")]
    acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=handlers, **kwargs)
    if acc.num_processes != int(os.environ["WORLD_SIZE"]):
        raise RuntimeError(f"the Accelerator sees {acc.num_processes} processes of {os.environ['WORLD_SIZE']}")
    return acc


def accelerator(fsdp: bool = False, stateful: bool = False, replicas: int = 0, deepspeed: int = 0, parallel: str = "") -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=stateful)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel and world > 1:  # every rank one tensor (and expert) parallel group: no data parallel
        from accelerate.parallelism_config import ParallelismConfig
        from fsdp_cpu import fsdp_on_cpu, on_gpus

        with fsdp_on_cpu("MULTI_GPU"):
            return Accelerator(cpu=not on_gpus(), dataloader_config=config, parallelism_config=ParallelismConfig(tp_size=world))
    if deepspeed:
        return deepspeed_accelerator(deepspeed, dataloader_config=config)
    if fsdp:
        from fsdp_cpu import fsdp2_accelerator

        if replicas:  # HSDP: `replicas` groups, each sharding the model over the rest of the processes
            from accelerate.parallelism_config import ParallelismConfig

            hsdp = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=world // replicas)
            return fsdp2_accelerator(dataloader_config=config, parallelism_config=hsdp)
        return fsdp2_accelerator(dataloader_config=config)
    return Accelerator(cpu=True, dataloader_config=config)


def _dump(tag: str, model: nn.Module, optimizer: Any, scheduler: Any, into: dict[str, Any]) -> None:
    """Collect the full state under `tag` (a collective under FSDP: every process calls it)."""
    from fsdp_cpu import full_state

    if hasattr(model, "zero_optimization_stage"):  # a DeepSpeed engine: its fp32 master weights and moments, gathered by DeepSpeed
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for name, p in model.module.named_parameters():
            into[f"{tag}/master/{name}"] = safe_get_full_fp32_param(p).cpu().clone()
            for key in ("exp_avg", "exp_avg_sq") if model.global_steps else ():  # a fresh engine has no moments yet
                into[f"{tag}/optimizer/{name}/{key}"] = safe_get_full_optimizer_state(p, key).cpu().clone()
    else:
        plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model  # names without DDP's "module."
        into.update({f"{tag}/{k}": v for k, v in full_state(plain, optimizer.optimizer).items()})
    into[f"{tag}/scheduler"] = scheduler.scheduler.state_dict()


def dump_differences(saved: str, loaded: str) -> list[str]:
    """Compare two dumps (`dump` paths): the state at the end of the run that wrote `saved`
    ("end/") against the state right after the load of the run that wrote `loaded` ("loaded/").
    Returns what differs: names present in one only, tensors not equal bit for bit (or of
    another dtype), the scheduler state; empty when none. Needs some optimizer state in `saved`."""
    import safetensors.torch

    expected = {k.removeprefix("end/"): v for k, v in safetensors.torch.load_file(saved).items() if k.startswith("end/")}
    got = {k.removeprefix("loaded/"): v for k, v in safetensors.torch.load_file(loaded).items() if k.startswith("loaded/")}
    if not any(k.endswith("/exp_avg_sq") for k in expected):
        return [f"{saved} holds no optimizer state"]
    differ = sorted(set(expected) ^ set(got))
    differ += [k for k in sorted(set(expected) & set(got)) if not (got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]))]
    saved_meta, loaded_meta = (json.loads(Path(f"{path}.json").read_text()) for path in (saved, loaded))
    if loaded_meta["loaded/scheduler"] != saved_meta["end/scheduler"]:
        differ.append("scheduler")
    return differ


def _write_dump(path: str, dumped: dict[str, Any]) -> None:
    import safetensors.torch

    tensors = {k: v.contiguous() for k, v in dumped.items() if isinstance(v, torch.Tensor)}
    safetensors.torch.save_file(tensors, path)
    Path(path + ".json").write_text(json.dumps({k: v for k, v in dumped.items() if not isinstance(v, torch.Tensor)}))


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """Train as the spec says; returns what `out` receives."""
    from ckptd.client import CheckpointClient
    from ckptd.integrations.accelerate import batches_to_skip, load_state, save_state

    acc = accelerator(spec.get("fsdp", False), spec.get("stateful", False), spec.get("replicas", 0), spec.get("deepspeed", 0), spec.get("parallel", ""))
    model, optimizer, scheduler, loader = parts(spec.get("parallel", ""), spec.get("model_dir", ""))
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    tracker = RunningMean()
    acc.register_for_checkpointing(tracker)
    ckpt = CheckpointClient(spec["job"], address=spec["address"], on_error="raise") if "address" in spec else None
    start = (load_state(acc, ckpt, spec.get("resume_step")) if ckpt is not None else None) or 0
    result: dict[str, Any] = {"resumed_from": start or None, "losses": {}, "samples": {}, "epochs": {}, "tracker": {}, "collectives_in_save": []}
    out = spec["out"].format(rank=acc.process_index) if "out" in spec else None
    dumped: dict[str, Any] = {}
    if "dump" in spec:
        _dump("loaded", model, optimizer, scheduler, dumped)
    handle = None
    per_epoch = len(loader)
    # in another world size than the checkpoint's, the batches to skip come from batches_to_skip
    first_epoch, first_skip = batches_to_skip(acc, ckpt, start, start) if spec.get("resized") and ckpt and start else divmod(start, per_epoch)
    step = start
    for epoch in range(first_epoch, (spec["steps"] + per_epoch - 1) // per_epoch):
        loader.set_epoch(epoch)
        skip = first_skip if epoch == first_epoch else 0
        # a StatefulDataLoader resumes where its restored state_dict stood (same world size); else skip
        batches = acc.skip_first_batches(loader, skip) if skip and (spec.get("resized") or not spec.get("stateful")) else loader
        for x, y, ids in batches:
            step += 1
            if step > spec["steps"]:
                break
            result["epochs"].setdefault(epoch, []).extend(ids.tolist())
            optimizer.zero_grad()
            fit = model(input_ids=x, labels=x).loss if spec.get("parallel") else nn.functional.mse_loss(model(x), y)
            loss = fit * (1.0 + tracker.mean)
            acc.backward(loss)
            optimizer.step()
            scheduler.step()
            tracker.update(loss.item())
            result["losses"][step] = loss.item()
            result["samples"][step] = ids.tolist()
            result["tracker"] = tracker.state_dict()
            if out is not None:
                Path(out).write_text(json.dumps(result))
            if ckpt is not None and spec.get("save_every") and step % spec["save_every"] == 0:
                if acc.num_processes > 1:  # a rank process (tests/integrations on sys.path)
                    from fsdp_cpu import collectives_during

                    handle, seen = collectives_during(save_state, acc, ckpt, step)
                    result["collectives_in_save"] += seen
                else:
                    handle = save_state(acc, ckpt, step)
            if step == spec.get("kill_at", 0):
                if spec.get("kill_handed_over") and handle is not None:
                    handle.wait_snapshot(host=True)  # handed over: the daemon writes and commits it after the kill
                    done = handle.step
                else:
                    info = handle.wait_durable(timeout=60) if handle is not None else None
                    done = info.step if info is not None else None
                if acc.is_main_process:
                    Path(spec["marker"]).write_text(json.dumps(done))
                os.kill(os.getpid(), signal.SIGKILL)
    if "dump" in spec:
        _dump("end", model, optimizer, scheduler, dumped)
        _write_dump(spec["dump"].format(rank=acc.process_index), dumped)
    if ckpt is not None:
        ckpt.close()
    if acc.num_processes > 1:
        acc.wait_for_everyone()
        acc.end_training()
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)  # the tests train their baselines in-process with one thread too
    job = json.loads(sys.argv[1])
    if job.get("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if os.environ.get("CKPTD_TEST_DEVICE") == "cuda" else "cpu")
        from deepspeed_cpu import without_shm_kernel

        without_shm_kernel()
    if "rank" in job:  # what torchrun (or `accelerate launch`) sets for each process
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), RANK=str(job["rank"]), LOCAL_RANK=str(job["rank"]),
            WORLD_SIZE=str(job["world_size"]), LOCAL_WORLD_SIZE=str(job["world_size"]),
        )
    train(job)
