"""DeepSpeed benchmark: stall per save of ckptd.integrations.deepspeed.save against
`engine.save_checkpoint`, ZeRO-1/2/3 on DeepSpeed's CPU accelerator with gloo ranks.

`--world` rank processes (default 2) train one ZeRO engine (a stack of Linear layers, default
~8.4 M fp32 parameters, torch Adam with its moments filled, WarmupLR). Per round, after an
untimed engine step that changes every value, back to back:

- deepspeed: `engine.save_checkpoint(dir)` (each rank's zero_pp_rank_*_optim_states.pt, rank 0's
  mp_rank_00_model_states.pt; torch.save, no fsync); stall = its wall time;
- ckptd: `ckptd.integrations.deepspeed.save(engine, client, step)`; stall = its wall time (the
  hand-off to the daemon's shared memory); the daemon writes and fsyncs in the background and is
  waited for, untimed, before the next segment.

A round's stall is the slowest rank's (the next step waits for it). Printed: the median stall of
each (min, max) and the median of the per-round ratios.

`--via` drives the same engine through another integration, each against that tool's own save:

- accelerate: an Accelerator with a DeepSpeedPlugin prepares the model and optimizer;
  `accelerator.save_state(dir)` (the engine's save_checkpoint plus Accelerate's random states)
  against `ckptd.integrations.accelerate.save_state(accelerator, client, step)`;
- lightning: a Lightning Trainer fits with CkptdDeepSpeedStrategy (on CPU: the tests' subclass
  that skips Lightning's CUDA check, tests/integrations/lightning_worker.py); a callback after
  each step dumps Lightning's checkpoint dict and saves it with DeepSpeedStrategy.save_checkpoint
  (the engine's save_checkpoint, Lightning's own) and with CkptdDeepSpeedStrategy.save_checkpoint
  (through CkptdCheckpointIO), alternately, timing the dump and the save.

    python tests/bench/bench_integrations_deepspeed.py [--rounds 7] [--stage 2] [--world 2] [--hidden 1024 --layers 8] [--via engine|accelerate|lightning]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def rank_main(spec: dict[str, Any]) -> None:
    """One rank: train, save both ways per round, write its stalls to spec["out"]/<rank>.json."""
    rank, world = spec["rank"], spec["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if spec["via"] == "accelerate":
        _accelerate_rank(spec)
    elif spec["via"] == "lightning":
        _lightning_rank(spec)
    else:
        _engine_rank(spec)


def _config(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": spec["stage"]},
    }


def _client_optimizer_config(spec: dict[str, Any]) -> dict[str, Any]:
    """_config without DeepSpeed's optimizer and scheduler: the tool hands it a torch Adam."""
    config = {k: v for k, v in _config(spec).items() if k not in ("optimizer", "scheduler")}
    return {**config, "zero_allow_untested_optimizer": True}


def _model(spec: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(spec["hidden"], spec["hidden"]) for _ in range(spec["layers"])])


def _report(spec: dict[str, Any], times: dict[str, list[float]], engine: Any) -> None:
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    (Path(spec["out"]) / f"{spec['rank']}.json").write_text(json.dumps({"times": times, "params": n_params}))


def _timed(times: list[float], save: Any) -> Any:
    """Every rank at the start line, then save(); its wall time appended to `times`."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    result = save()
    times.append(time.perf_counter() - started)
    return result


def _interleave(spec: dict[str, Any], train_step: Any, theirs: Any, ours: Any, engine: Any) -> None:
    """The rounds of --via engine and accelerate: after two untimed saves each way, per round a
    train step, the tool's own save `theirs(directory)` (timed, then removed), a train step and
    ckptd's `ours(client, step)` (timed; waited for until durable, untimed)."""
    import torch.distributed as dist

    from ckptd.client import CheckpointClient

    scratch = Path(spec["scratch"])
    times: dict[str, list[float]] = {"deepspeed": [], "ckptd": []}
    with CheckpointClient("bench-deepspeed", address=spec["address"], on_error="raise") as client:
        step = 0
        for warm in range(2):
            train_step()
            step += 1
            ours(client, step).wait_durable(timeout=600)
            theirs(str(scratch / "warm" / f"w{warm}"))
        for r in range(spec["rounds"]):
            train_step()
            _timed(times["deepspeed"], lambda: theirs(str(scratch / "ds" / f"r{r}")))
            dist.barrier()
            if spec["rank"] == 0:
                shutil.rmtree(scratch / "ds" / f"r{r}")
            train_step()
            step += 1
            _timed(times["ckptd"], lambda: ours(client, step)).wait_durable(timeout=600)
    _report(spec, times, engine)
    dist.barrier()


def _accelerate_rank(spec: dict[str, Any]) -> None:
    """--via accelerate: Accelerator.save_state(dir) against ckptd's save_state."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from ckptd.integrations.accelerate import save_state

    torch.set_num_threads(1)
    plugin = DeepSpeedPlugin(hf_ds_config=_client_optimizer_config(spec))
    # without a GPU Accelerate needs the gloo backend named (tests/integrations/accel_train.py, deepspeed_accelerator)
    acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = _model(spec)
    engine, optimizer = acc.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    x = torch.randn(2, spec["hidden"])

    def train_step() -> None:
        acc.backward(engine(x).square().mean())  # the engine's backward and step
        optimizer.step()

    _interleave(spec, train_step, acc.save_state, lambda client, step: save_state(acc, client, step), engine)


def _lightning_rank(spec: dict[str, Any]) -> None:
    """--via lightning: DeepSpeedStrategy.save_checkpoint against CkptdDeepSpeedStrategy's."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
    from lightning_worker import CpuDeepSpeedStrategy  # Lightning's DeepSpeedStrategy refuses CPU: its docstring says where

    from ckptd.integrations.lightning import CkptdCheckpointIO

    torch.set_num_threads(1)
    scratch = Path(spec["scratch"])
    times: dict[str, list[float]] = {"deepspeed": [], "ckptd": []}
    rounds, warm = spec["rounds"], 2
    total = 2 * (warm + rounds)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(spec)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Saves(L.Callback):
        """After each step, alternately: Lightning's own DeepSpeed save, then ckptd's (waited for, untimed)."""

        def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step, strategy = trainer.global_step, trainer.strategy
            timed = step > 2 * warm
            if step % 2:
                path = scratch / "ds" / f"s{step}"
                spent: list[float] = []
                _timed(spent, lambda: DeepSpeedStrategy.save_checkpoint(strategy, trainer._checkpoint_connector.dump_checkpoint(), str(path)))
                strategy.barrier()
                if trainer.is_global_zero:
                    shutil.rmtree(path)
                if timed:
                    times["deepspeed"] += spent
            else:
                spent = []
                _timed(spent, lambda: strategy.save_checkpoint(trainer._checkpoint_connector.dump_checkpoint(), str(scratch / "pointers" / f"s{step}.ckpt")))
                strategy.checkpoint_io.wait_durable()
                if timed:
                    times["ckptd"] += spent

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(2 * total * spec["world"], spec["hidden"])), batch_size=2)
    (scratch / "pointers").mkdir(exist_ok=True)
    lightning_config = {k: v for k, v in _client_optimizer_config(spec).items() if k != "gradient_accumulation_steps"}  # the Trainer's to set
    trainer = L.Trainer(
        accelerator="cpu", devices=spec["world"], strategy=CpuDeepSpeedStrategy(config=lightning_config), max_steps=total,
        callbacks=[Saves()],
        plugins=[CkptdCheckpointIO(job="bench-deepspeed", address=spec["address"], on_error="raise")],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Module(), data)
    _report(spec, times, trainer.strategy.model)


def _engine_rank(spec: dict[str, Any]) -> None:
    """--via engine (default): engine.save_checkpoint against ckptd.integrations.deepspeed.save."""
    import deepspeed  # type: ignore[import-untyped]
    import torch

    from ckptd.integrations.deepspeed import save

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(spec)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(spec))
    x = torch.randn(2, spec["hidden"])

    def train_step() -> None:
        engine.backward(engine(x).square().mean())
        engine.step()

    _interleave(spec, train_step, engine.save_checkpoint, lambda client, step: save(engine, client, step), engine)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--via", default="engine", choices=("engine", "accelerate", "lightning"),
                   help="the integration the engine is driven through, each against that tool's own DeepSpeed save")
    args = p.parse_args(argv)

    from ckptd.demo.process import start_daemon

    scratch = Path(tempfile.mkdtemp(prefix="ckptd-bench-ds-"))
    shm = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"))
    daemon = start_daemon(root=scratch / "root", socket=scratch / "d.sock", extra_args=["--shm-dir", str(shm)], log_path=scratch / "daemon.log")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        (scratch / "out").mkdir()
        spec = {**vars(args), "address": daemon.address, "scratch": str(scratch), "out": str(scratch / "out"), "port": port}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-spec", json.dumps({**spec, "rank": r})]) for r in range(args.world)]
        codes = [proc.wait() for proc in procs]
        if codes != [0] * args.world:
            print(f"a rank failed: exit codes {codes}", file=sys.stderr)
            return 1
        reports = [json.loads((scratch / "out" / f"{r}.json").read_text()) for r in range(args.world)]
        times = {name: [max(rep["times"][name][i] for rep in reports) for i in range(args.rounds)] for name in ("deepspeed", "ckptd")}
        ratios = [d / c for d, c in zip(times["deepspeed"], times["ckptd"])]
        n = reports[0]["params"]
        print(f"model: {args.layers} x Linear({args.hidden}, {args.hidden}), {n / 1e6:.1f} M fp32 parameters + Adam "
              f"({n * 12 / 2**20:.0f} MiB a save), ZeRO-{args.stage}, {args.world} ranks, {args.rounds} rounds, via {args.via}")
        for name, values in times.items():
            print(f"{name:>10}: stall median {statistics.median(values) * 1e3:7.1f} ms (min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})")
        print(f"deepspeed / ckptd stall: median {statistics.median(ratios):.1f}x (min {min(ratios):.1f}, max {max(ratios):.1f})")
    finally:
        daemon.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-spec":
        rank_main(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
