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

    python tests/bench/bench_integrations_deepspeed.py [--rounds 7] [--stage 2] [--world 2] [--hidden 1024 --layers 8]
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
    import deepspeed  # type: ignore[import-untyped]
    import torch
    import torch.distributed as dist
    from torch import nn

    from ckptd.client import CheckpointClient
    from ckptd.integrations.deepspeed import save

    rank, world = spec["rank"], spec["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    h = spec["hidden"]
    model = nn.Sequential(*[nn.Linear(h, h) for _ in range(spec["layers"])])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": spec["stage"]},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, h)

    def train_step() -> None:
        engine.backward(engine(x).square().mean())
        engine.step()

    scratch = Path(spec["scratch"])
    times: dict[str, list[float]] = {"deepspeed": [], "ckptd": []}
    with CheckpointClient("bench-deepspeed", address=spec["address"], on_error="raise") as client:
        step = 0
        for warm in range(2):
            train_step()
            step += 1
            save(engine, client, step).wait_durable(timeout=600)
            engine.save_checkpoint(str(scratch / "warm"), tag=f"w{warm}")
        for r in range(spec["rounds"]):
            train_step()
            dist.barrier()
            started = time.perf_counter()
            engine.save_checkpoint(str(scratch / "ds"), tag=f"r{r}")
            times["deepspeed"].append(time.perf_counter() - started)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(scratch / "ds" / f"r{r}")

            train_step()
            step += 1
            dist.barrier()
            started = time.perf_counter()
            handle = save(engine, client, step)
            times["ckptd"].append(time.perf_counter() - started)
            handle.wait_durable(timeout=600)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    (Path(spec["out"]) / f"{rank}.json").write_text(json.dumps({"times": times, "params": n_params}))
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
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
              f"({n * 12 / 2**20:.0f} MiB a save), ZeRO-{args.stage}, {args.world} ranks, {args.rounds} rounds")
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
