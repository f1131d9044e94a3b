"""Stall per save of Lightning checkpoint plugins: CkptdCheckpointIO against Lightning's own.

`python tests/bench/bench_integrations_lightning.py [--params-m 8] [--rounds 7] [--out DIR] [--sharded]`

The checkpoint is a real one: a LightningModule (an MLP of `--params-m` million fp32
parameters), trained two steps with Adam under a Trainer with ModelCheckpoint, then
`trainer.save_checkpoint` through a plugin that keeps the dict Lightning built (weights, Adam's
exp_avg and exp_avg_sq: about 3 x 4 bytes per parameter, plus loops, callbacks, hyper-parameters).

Each round saves that dict once with each plugin, in an order that rotates from round to round:

- torch: Lightning's default TorchCheckpointIO (torch's serialization to a temporary file,
  renamed): the save is the whole write into the page cache;
- async: AsyncCheckpointIO(TorchCheckpointIO()): clones every tensor on the caller's thread,
  then writes in a helper thread;
- ckptd: CkptdCheckpointIO against a real daemon (started here in a temporary root): the
  hand-off of the tensors into the daemon's shared memory; the daemon writes in the background.

`--sharded`: the same model under ModelParallelStrategy (FSDP2's fully_shard in configure_model,
one rank of a one-rank device mesh in this process, gloo), its checkpoint dict (DTensors) saved
each round by Lightning's own sharded path (ModelParallelStrategy.save_checkpoint: a
torch.distributed.checkpoint directory written synchronously, plus the metadata file) and by
CkptdModelParallelStrategy.save_checkpoint (the rank's shards handed to the daemon), interleaved
in rotating order; after each, untimed, DCP's directory is synced and removed, ckptd's step
waited for until durable.

Stall = the time `save_checkpoint` blocks the caller (the training loop). Before each round the
ModelCheckpoint state in the dict gets this round's file names (as ModelCheckpoint renames its
top-k files at every save; for ckptd this changes the tensor names of the scores, so the
structure is planned again, the realistic case), and global_step the round's number. After each
save, untimed: async's writes are waited for (teardown), ckptd's save until durable
(wait_durable), then the page cache is flushed (os.sync), so no plugin pays for another's
background writes. The first `--warmup` rounds are not counted. It prints the median stall of
each plugin (min and max beside), the ratios of ckptd's stall to the others' (median of the
per-round ratios), ckptd's time until durable, the machine and its load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptd.demo.process import start_daemon
from lightning.pytorch.strategies import ModelParallelStrategy

from ckptd.integrations.lightning import CkptdCheckpointIO, CkptdModelParallelStrategy

WIDTH = 1024


class Big(L.LightningModule):
    """An MLP of `layers` square layers of WIDTH (WIDTH^2 + WIDTH parameters each)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Keep(CheckpointIO):
    """Keeps the dict of the last save (it is what every plugin is given)."""

    def __init__(self) -> None:
        self.checkpoint: dict[str, Any] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.checkpoint = checkpoint

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def remove_checkpoint(self, path: Any) -> None:
        """Nothing was written."""


def lightning_checkpoint(params_m: float, scratch: Path) -> dict[str, Any]:
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    keep = Keep()
    trainer = L.Trainer(
        max_steps=2, plugins=[keep], logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=scratch / "mc", monitor="train_loss", save_top_k=2, every_n_train_steps=1000)],
    )
    data = DataLoader(TensorDataset(torch.randn(16, WIDTH)), batch_size=8)
    trainer.fit(Big(layers), data)
    trainer.save_checkpoint(scratch / "captured.ckpt")
    assert keep.checkpoint is not None
    return keep.checkpoint


def rename_top_k(checkpoint: dict[str, Any], dirpath: Path, round_no: int) -> None:
    """ModelCheckpoint's state as after a top-k save in round `round_no`: new file names."""
    for state in checkpoint["callbacks"].values():
        if isinstance(state, dict) and "best_k_models" in state:
            files = [str(dirpath / f"epoch=0-step={s}.ckpt") for s in (round_no, round_no - 1)]
            state["best_k_models"] = {f: torch.tensor(0.5 + i) for i, f in enumerate(files)}
            state["best_model_path"], state["kth_best_model_path"] = files[0], files[1]
    checkpoint["global_step"] = round_no


def tensor_bytes(checkpoint: Any) -> int:
    if isinstance(checkpoint, torch.Tensor):
        return checkpoint.numel() * checkpoint.element_size()
    if isinstance(checkpoint, dict):
        return sum(tensor_bytes(v) for v in checkpoint.values())
    if isinstance(checkpoint, (list, tuple)):
        return sum(tensor_bytes(v) for v in checkpoint)
    return 0


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, lightning {L.__version__}"


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-m", type=float, default=8.0, help="millions of model parameters (default 8: 32 MB of weights)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="scratch directory on the disk under test (default: a new temporary one)")
    parser.add_argument("--sharded", action="store_true", help="Lightning's FSDP2 (ModelParallelStrategy) checkpointing against CkptdModelParallelStrategy")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-lightning-", dir=args.out))
    shm = Path(tempfile.mkdtemp(prefix="bench-lightning-", dir="/dev/shm"))
    daemon = start_daemon(root=scratch / "root", socket=scratch / "d.sock", extra_args=["--shm-dir", str(shm), "--keep-last", "2"], log_path=scratch / "daemon.log")
    try:
        (run_sharded if args.sharded else run)(args, scratch, daemon.address)
    finally:
        daemon.kill()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def run(args: argparse.Namespace, scratch: Path, address: str) -> None:
    print(f"machine: {machine()}")
    print(f"load average at start: {load_average()}", flush=True)
    checkpoint = lightning_checkpoint(args.params_m, scratch)
    print(f"checkpoint: {tensor_bytes(checkpoint) / 1e6:.1f} MB of tensors ({sum(p.numel() for p in checkpoint['state_dict'].values()) / 1e6:.2f} M parameters + Adam state)")
    dirpath = scratch / "ckpts"
    ckptd = CkptdCheckpointIO(job="bench", address=address, on_error="raise")
    async_io = AsyncCheckpointIO(TorchCheckpointIO())

    def async_written() -> None:
        async_io.teardown()  # waits for its helper thread's write
        os.sync()

    plugins: dict[str, tuple[CheckpointIO, Callable[[], None]]] = {
        "torch": (TorchCheckpointIO(), os.sync),
        "async": (async_io, async_written),
        "ckptd": (ckptd, ckptd.wait_durable),
    }
    names = list(plugins)
    stalls: dict[str, list[float]] = {n: [] for n in names}
    durable: list[float] = []
    for round_no in range(1, args.warmup + args.rounds + 1):
        rename_top_k(checkpoint, dirpath, round_no)
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            plugin, settle = plugins[name]
            path = dirpath / f"{name}-epoch=0-step={round_no}.ckpt"
            started = time.perf_counter()
            plugin.save_checkpoint(checkpoint, path)
            stall = time.perf_counter() - started
            settle()
            if name == "ckptd":
                durable.append(time.perf_counter() - started)
            if round_no > args.warmup:
                stalls[name].append(stall)
            plugin.remove_checkpoint(path)
        if round_no == args.warmup:
            durable.clear()
    ckptd.teardown()

    print(f"\nstall per save, {args.rounds} rounds after {args.warmup} warm-up rounds (ms: median [min - max])")
    for name in names:
        values = [s * 1e3 for s in stalls[name]]
        print(f"  {name:6} {statistics.median(values):8.1f}  [{min(values):.1f} - {max(values):.1f}]")
    print(f"  ckptd until durable (pointer written): {statistics.median(durable) * 1e3:.1f} ms median")
    print("ratios (median of the per-round ratios):")
    for other in ("torch", "async"):
        ratios = [c / o for c, o in zip(stalls["ckptd"], stalls[other])]
        print(f"  ckptd / {other:5} {statistics.median(ratios):6.3f}  [{min(ratios):.3f} - {max(ratios):.3f}]")
    print(f"load average at end: {load_average()}")


class ShardedBig(Big):
    """Big, with FSDP2 applied over the strategy's data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def run_sharded(args: argparse.Namespace, scratch: Path, address: str) -> None:
    print(f"machine: {machine()}")
    print(f"load average at start: {load_average()}", flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    io = CkptdCheckpointIO(job="bench-sharded", address=address, on_error="raise")
    trainer = L.Trainer(
        max_steps=2, plugins=[io], strategy=CkptdModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), accelerator="cpu",
        devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    layers = max(1, round(args.params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    trainer.fit(ShardedBig(layers), DataLoader(TensorDataset(torch.randn(16, WIDTH)), batch_size=8))
    strategy = trainer.strategy
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(False)
    print(f"checkpoint: {tensor_bytes(checkpoint) / 1e6:.1f} MB of tensors (DTensors of a one-rank mesh: weights + Adam state)")
    dirpath = scratch / "ckpts"

    def lightning_save(path: Path) -> None:
        ModelParallelStrategy.save_checkpoint(strategy, dict(checkpoint), path)  # pops state_dict/optimizer_states: a copy

    def lightning_settle(path: Path) -> None:
        os.sync()
        shutil.rmtree(path)

    def ckptd_settle(path: Path) -> None:
        io.wait_durable()
        io.remove_checkpoint(path)

    savers: dict[str, tuple[Callable[[Path], None], Callable[[Path], None]]] = {
        "lightning-dcp": (lightning_save, lightning_settle),
        "ckptd": (lambda path: strategy.save_checkpoint(dict(checkpoint), path), ckptd_settle),
    }
    names = list(savers)
    stalls: dict[str, list[float]] = {n: [] for n in names}
    for round_no in range(1, args.warmup + args.rounds + 1):
        checkpoint["global_step"] = 100 + round_no
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            save, settle = savers[name]
            path = dirpath / f"{name}-step={round_no}.ckpt"
            started = time.perf_counter()
            save(path)
            stall = time.perf_counter() - started
            settle(path)
            if round_no > args.warmup:
                stalls[name].append(stall)
    io.teardown()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print(f"\nstall per save, {args.rounds} rounds after {args.warmup} warm-up rounds (ms: median [min - max])")
    for name in names:
        values = [s * 1e3 for s in stalls[name]]
        print(f"  {name:13} {statistics.median(values):8.1f}  [{min(values):.1f} - {max(values):.1f}]")
    ratios = [c / o for c, o in zip(stalls["ckptd"], stalls["lightning-dcp"])]
    print(f"ratio ckptd / lightning-dcp (median of the per-round ratios): {statistics.median(ratios):.3f}  [{min(ratios):.3f} - {max(ratios):.3f}]")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    sys.exit(main())
