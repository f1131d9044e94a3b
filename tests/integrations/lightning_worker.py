"""A small PyTorch Lightning training run that checkpoints through CkptdCheckpointIO:
`python lightning_worker.py SPEC_JSON` (tests/integrations/test_lightning.py runs it).

An MLP with dropout on a shuffled DataLoader, Adam with a StepLR schedule, ModelCheckpoint
keeping the 2 best by train_loss plus last.ckpt every `every` steps. The random generators are
restored on a resume (by CkptdCheckpointIO, or by the module's own hooks), so a resumed run
draws the same dropout masks and shuffles as an uninterrupted one.

Spec: address, job, dirpath, out (one JSON line per step: {"step", "loss"}), max_steps, every,
ckpt_path (null: fresh, "last", or a path), pause_at (0: never; else, at the start of the
batch after global step `pause_at`, wait until last.ckpt names that step, print
"DURABLE <step>" and sleep until killed); optional: batch (default 8), devices (default 1),
committed_at (at the start of the batch after global step N, wait until the daemon holds step N
committed, print "COMMITTED <N>" and sleep until killed) with stall_pointers_from (pointers of
that step and later are never written: a kill within the moment between a step's commit and its
pointer, issue 30 finding 7, made certain).

hooks (default true): the module saves and restores the torch RNG state itself (TinyMLP); false:
MLP, without hooks (CkptdCheckpointIO restores the generators; rng false turns that off). tp: the
run uses CkptdModelParallelStrategy over `devices` ranks, tensor parallel over `tp` of them
and FSDP2 over the rest (ShardedMLP, no hooks). moe (true): CkptdModelParallelStrategy with
expert parallelism over all `devices` ranks (ExpertParallelMoE, no hooks). dump: a path, where DumpState writes the whole
state at the end of fit. fsdp1: CkptdFSDPStrategy (MLP, no hooks), with accelerator (default
"cpu", where torch refuses FSDP1: give "gpu"). spawn: strategy="ddp_spawn" over `devices` processes that Lightning
starts from this one (which is then the main process); handback: a path, where the main
process writes the weights the workers handed back (safetensors). deepspeed: a ZeRO stage (1, 2,
3): CkptdDeepSpeedStrategy on DeepSpeed's CPU accelerator (CpuDeepSpeedStrategy; MLP, no hooks);
dump then writes DeepSpeed's whole fp32 master weights and Adam moments. pause_after: with
pause_at, the pause comes at the start of the batch after this later step (the steps between
are trained, after the save at pause_at).

devices > 1: one process of Lightning's DDP on CPU (gloo), started by the caller with the
variables Lightning reads when processes are created outside it (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, NODE_RANK, LOCAL_RANK), seeded with seed_everything(0) so every rank starts with
the same generators (DistributedSampler shuffles from that seed and the epoch). Each rank trains
on its share of the data; global rank 0 writes the losses, of its own batches.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptd.client import CheckpointClient
from ckptd.integrations import _lightning_pointer
from ckptd.integrations.lightning import (
    CkptdCheckpointIO,
    CkptdDeepSpeedStrategy,
    CkptdFSDPStrategy,
    CkptdLoadFromCheckpoint,
    CkptdModelParallelStrategy,
)

SAMPLES, BATCH = 40, 8  # 5 batches per epoch


class MLP(CkptdLoadFromCheckpoint, L.LightningModule):
    """An MLP with dropout, Adam and a StepLR schedule stepped every step; load_from_checkpoint
    reads ckptd pointers too."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=self.trainer.world_size > 1)  # one top-k choice on every rank
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.02)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5), "interval": "step"}}


class TinyMLP(MLP):
    """MLP with the RNG hooks a user writes for Lightning's own checkpoints."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng"] = {"torch": torch.get_rng_state()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        torch.set_rng_state(checkpoint["rng"]["torch"])


class ShardedMLP(MLP):
    """MLP parallelized in configure_model over the strategy's device mesh: tensor parallel
    (column-, then row-wise) over "tensor_parallel" when it has several ranks, then FSDP2
    (fully_shard) over "data_parallel". No RNG hooks: CkptdCheckpointIO restores each rank's
    generators itself."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            parallelize_module(self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "3": RowwiseParallel()})
        fully_shard(self.net, mesh=mesh["data_parallel"])


class MoE(nn.Module):
    """A tiny mixture of experts, top-1 routed: a router (Linear 6 -> `experts`) and `experts`
    two-layer experts (6 -> hidden -> 1, ReLU, dropout) whose weights are stacked on a first,
    expert, dimension (w_in [E, 6, H], b_in [E, H], w_out [E, H, 1]). `parallelize(mesh)` makes
    them DTensors sharded on that dimension (Shard(0)) over `mesh`, the expert-parallel group, and
    the router replicated over it. Every rank of the group gets the same tokens, runs its own
    experts on the tokens routed to them, and the partial outputs are summed over the group
    (DTensor Partial -> Replicate, which autograd follows); the router's gradients are summed
    over the group by reduce_router_grads."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(6, experts)
        self.w_in = nn.Parameter(torch.randn(experts, 6, hidden) * 0.4)
        self.b_in = nn.Parameter(torch.zeros(experts, hidden))
        self.w_out = nn.Parameter(torch.randn(experts, hidden, 1) * 0.25)
        self.dropout = nn.Dropout(0.3)
        self.mesh: Any = None

    def parallelize(self, mesh: Any) -> None:
        """Shard the experts over `mesh` (1-D; its size must divide the number of experts)."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        experts = self.w_in.shape[0]
        if experts % mesh.size():
            raise ValueError(f"{experts} experts do not split evenly over an expert-parallel group of {mesh.size()} ranks")
        for module, name, placement in ((self.router, "weight", Replicate()), (self.router, "bias", Replicate()),
                                        (self, "w_in", Shard(0)), (self, "b_in", Shard(0)), (self, "w_out", Shard(0))):
            setattr(module, name, nn.Parameter(distribute_tensor(getattr(module, name).detach(), mesh, [placement])))
        self.mesh = mesh

    def reduce_router_grads(self) -> None:
        """Sum the router's gradients over the group: each rank's holds only what flowed back
        through its own experts' gates (call after backward, before the optimizer step)."""
        with torch.no_grad():
            for p in self.router.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad.to_local(), group=self.mesh.get_group())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        probs = torch.softmax(nn.functional.linear(x, self.router.weight.to_local(), self.router.bias.to_local()), dim=-1)
        top = probs.argmax(dim=-1)
        w_in, b_in, w_out = self.w_in.to_local(), self.b_in.to_local(), self.w_out.to_local()
        first = self.mesh.get_local_rank() * w_in.shape[0]  # the global index of this rank's first expert
        out = torch.zeros(x.shape[0], 1)
        for i in range(w_in.shape[0]):
            gate = (probs[:, first + i] * (top == first + i)).unsqueeze(-1)
            out = out + gate * (self.dropout(torch.relu(x @ w_in[i] + b_in[i])) @ w_out[i])
        return DTensor.from_local(out, self.mesh, [Partial()]).redistribute(self.mesh, [Replicate()]).to_local()


class ExpertParallelMoE(MLP):
    """MLP's training with a MoE (4 experts) for its net, the experts sharded in configure_model
    over the strategy's "tensor_parallel" mesh dimension, used as the expert-parallel group
    (Lightning's mesh has no dimension of its own for it; data_parallel_size is 1, so every rank
    gets the same batches). No RNG hooks."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__(hidden)
        self.net = MoE(hidden, experts=4)

    def configure_model(self) -> None:
        self.net.parallelize(self.device_mesh["tensor_parallel"])

    def on_after_backward(self) -> None:
        self.net.reduce_router_grads()


def data(batch: int = BATCH) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)


class Losses(Callback):
    """Appends {"step", "loss"} to `out` after every training step, flushed (a killed run's lines
    stay); on global rank 0 only."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        with self.out.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")


class PauseWhenDurable(Callback):
    """At the start of the batch after global step `at` (default `step`; ModelCheckpoint has
    saved `step`), wait until last.ckpt names `step`, i.e. ckptd has made it durable, say so and sleep."""

    def __init__(self, step: int, last: Path, at: int | None = None) -> None:
        self.step = step
        self.last = last
        self.at = step if at is None else at

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.at:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.last.exists() and json.loads(self.last.read_text())["step"] == self.step:
                print(f"DURABLE {self.step}", flush=True)
                time.sleep(600)  # the test kills this process
            time.sleep(0.01)
        raise TimeoutError(f"{self.last} did not name step {self.step} within 60 s")


class PauseWhenCommitted(Callback):
    """At the start of the batch after global step `step`, wait until the daemon holds that step
    committed (whatever the pointer files say), say so and sleep."""

    def __init__(self, step: int, address: str, job: str) -> None:
        self.step = step
        self.address = address
        self.job = job

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step:
            return
        with CheckpointClient(self.job, address=self.address, rank=0, world_size=1) as client:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if self.step in {info.step for info in client.list()}:
                    print(f"COMMITTED {self.step}", flush=True)
                    time.sleep(600)  # the test kills this process
                time.sleep(0.01)
        raise TimeoutError(f"step {self.step} was not committed within 60 s")


class DumpState(Callback):
    """At the end of fit, the whole training state as one full copy, written by global rank 0:
    `<path>.safetensors` (the model's and the optimizer's tensors, gathered from every rank)
    and `<path>.json` (the optimizer's param_groups, the scheduler's state, global_step)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from safetensors.torch import save_file

        if isinstance(trainer.strategy, CkptdDeepSpeedStrategy):
            self._deepspeed(trainer)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = trainer.strategy.model
        optimizer = trainer.optimizers[0]
        weights = get_model_state_dict(model, options=options)
        optim = get_optimizer_state_dict(model, optimizer, options=options)
        if not trainer.is_global_zero:
            return
        tensors = {f"model/{k}": v.contiguous() for k, v in weights.items()}
        tensors.update({f"optimizer/{p}/{f}": v.reshape(v.shape).contiguous() for p, s in optim["state"].items() for f, v in s.items()})
        save_file(tensors, str(self.path) + ".safetensors")
        rest = {"param_groups": optim["param_groups"], "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(), "global_step": trainer.global_step}
        Path(str(self.path) + ".json").write_text(json.dumps(rest, sort_keys=True, default=str))


    def _deepspeed(self, trainer: L.Trainer) -> None:
        """The engine's whole fp32 master weights and Adam moments, as DeepSpeed gathers them
        (collective: every rank), the inner optimizer's param_groups and the scheduler."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
        from safetensors.torch import save_file

        engine = trainer.strategy.model
        tensors = {}
        for name, p in engine.module.named_parameters():
            tensors[f"master/{name}"] = safe_get_full_fp32_param(p).cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"optimizer/{name}/{key}"] = safe_get_full_optimizer_state(p, key).cpu().clone()
        if not trainer.is_global_zero:
            return
        save_file(tensors, str(self.path) + ".safetensors")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.optimizer.param_groups]
        rest = {"param_groups": groups, "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(), "global_step": trainer.global_step,
                "counters": [engine.global_steps, engine.global_samples, engine.micro_steps]}
        Path(str(self.path) + ".json").write_text(json.dumps(rest, sort_keys=True, default=str))


class CpuDeepSpeedStrategy(CkptdDeepSpeedStrategy):
    """CkptdDeepSpeedStrategy on CPU. Lightning refuses DeepSpeed on anything but CUDA devices:
    DeepSpeedStrategy.setup_environment raises (lightning/pytorch/strategies/deepspeed.py:342-346,
    "The DeepSpeed strategy is only supported on CUDA GPUs"), and where it goes on it needs device
    indices, which Lightning's CPU devices lack (None): setup_distributed checks they are the local
    ranks (lightning/fabric/strategies/deepspeed.py:877-885) and deepspeed.initialize gets
    device_rank=root_device.index (lightning/pytorch/strategies/deepspeed.py:447-448; DeepSpeed
    compares it with 0). DeepSpeed itself runs on its CPU accelerator over gloo. This gives the
    CPU devices their indices ("cpu:<local rank>", the same device to torch) and skips the CUDA
    check; on GPUs the worker uses CkptdDeepSpeedStrategy itself."""

    def setup_environment(self) -> None:
        from lightning.pytorch.strategies import DDPStrategy

        assert self.parallel_devices is not None
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        DDPStrategy.setup_environment(self)  # what DeepSpeedStrategy's calls after its check


def stall_pointers_from(step: int) -> None:
    """Pointer files of `step` and later are never written (their writer blocks)."""
    write = _lightning_pointer.write_pointer

    def stalled(path: str, pointer: _lightning_pointer.Pointer, publish: Any) -> bool:
        if pointer.step >= step:
            time.sleep(3600)
        return write(path, pointer, publish)

    _lightning_pointer.write_pointer = stalled  # PointerWriter looks the function up at each write


def start_ranks(spec: dict[str, Any], world_size: int = 2) -> list[subprocess.Popen[str]]:
    """The processes of one multi-process run of this script (DDP, or the model-parallel
    strategy when spec has "tp"), started with the variables Lightning reads when processes are
    created outside it; global rank 0's stdout is piped."""
    from daemon_rig import free_port  # the test process has tests/ on sys.path

    port = str(free_port())
    procs: list[subprocess.Popen[str]] = []
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    for rank in range(world_size):
        env = {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world_size), "NODE_RANK": "0", "LOCAL_RANK": str(rank)}
        stdout = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps({**spec, "devices": world_size})], env=env, stdout=stdout, text=True))
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float = 240) -> None:
    """Wait for every process of a run; fails unless each exits 0 (the others are killed)."""
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        kill(procs)
    assert codes == [0] * len(procs), f"a process of the run failed: exit codes {codes}"


def kill(procs: list[subprocess.Popen[str]]) -> None:
    """SIGKILL every process of a run still alive, and reap them all."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


def train(spec: dict[str, Any]) -> None:
    """One run as `spec` says (see the module docstring). Losses match across runs only with the
    same torch thread count: the script runs with one, as the tests do in process."""
    devices = spec.get("devices", 1)
    if devices > 1 or spec.get("spawn"):  # always a process of its own: seed_everything also sets PL_GLOBAL_SEED in os.environ
        L.seed_everything(0, verbose=False)
    else:
        torch.manual_seed(0)
    dirpath = Path(spec["dirpath"])
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=dirpath, monitor="train_loss", mode="min", save_top_k=2, save_last=True, every_n_train_steps=spec["every"]),
        Losses(Path(spec["out"])),
    ]
    if spec.get("pause_at"):
        callbacks.append(PauseWhenDurable(spec["pause_at"], dirpath / "last.ckpt", spec.get("pause_after")))
    if spec.get("committed_at"):
        callbacks.append(PauseWhenCommitted(spec["committed_at"], spec["address"], spec["job"]))
    if spec.get("stall_pointers_from"):
        stall_pointers_from(spec["stall_pointers_from"])
    strategy: Any = ("ddp_spawn" if spec.get("spawn") else "ddp") if devices > 1 else "auto"
    model: MLP = TinyMLP() if spec.get("hooks", True) else MLP()
    if "tp" in spec:  # FSDP2 (+ TP) through CkptdModelParallelStrategy: devices = dp * tp
        strategy = CkptdModelParallelStrategy(data_parallel_size=devices // spec["tp"], tensor_parallel_size=spec["tp"])
        model = ShardedMLP()
    if spec.get("moe"):  # expert parallelism over every rank through CkptdModelParallelStrategy
        strategy = CkptdModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=devices)
        model = ExpertParallelMoE()
    if spec.get("fsdp1"):  # FSDP1 through CkptdFSDPStrategy: needs an accelerator (tests/gpu/lightning_fsdp1.py)
        strategy = CkptdFSDPStrategy()
        model = MLP()
    if spec.get("deepspeed"):  # ZeRO through CkptdDeepSpeedStrategy (on CPU: CpuDeepSpeedStrategy)
        on_gpus = spec.get("accelerator", "cpu") != "cpu"
        strategy = (CkptdDeepSpeedStrategy if on_gpus else CpuDeepSpeedStrategy)(stage=spec["deepspeed"])
        model = MLP()
    if spec.get("dump"):
        callbacks.append(DumpState(Path(spec["dump"])))
    trainer = L.Trainer(
        max_steps=spec["max_steps"], callbacks=callbacks, plugins=[CkptdCheckpointIO(job=spec["job"], address=spec["address"], on_error="raise", rng=spec.get("rng", True))],
        logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator=spec.get("accelerator", "cpu"), devices=devices, strategy=strategy,
    )
    trainer.fit(model, data(spec.get("batch", BATCH)), ckpt_path=spec.get("ckpt_path"))
    if spec.get("handback"):  # ddp_spawn: the weights the workers handed back to this (main) process
        from safetensors.torch import save_file

        save_file(model.state_dict(), spec["handback"])


if __name__ == "__main__":
    torch.set_num_threads(1)
    run = json.loads(sys.argv[1])
    if run.get("deepspeed"):  # DeepSpeed reads it when first imported (by the strategy)
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if run.get("accelerator", "cpu") == "cpu" else "cuda")
        from deepspeed_cpu import without_shm_kernel

        without_shm_kernel()
    train(run)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # gloo's threads end before the interpreter does: one CI run saw a rank abort at exit
        # ("terminate called without an active exception") after its fit had finished
        torch.distributed.destroy_process_group()
