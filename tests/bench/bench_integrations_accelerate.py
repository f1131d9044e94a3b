"""Accelerate benchmark: stall per save of ckptd's save_state against `Accelerator.save_state`.

One Accelerator (CPU) with a prepared GPT-2 made from a config (default ~15 M fp32 parameters),
AdamW with its moments filled, a LambdaLR scheduler and a registered object. Per round, after an
untimed optimizer step that changes every value, back to back:

- accelerate: `accelerator.save_state(dir)` (model.safetensors, optimizer.bin, scheduler.bin,
  random_states_0.pkl, custom_checkpoint_0.pkl; torch.save, no fsync); stall = its wall time;
- ckptd: `ckptd.integrations.accelerate.save_state(accelerator, client, step)`; stall = its
  wall time (the hand-off to the daemon's shared memory); the daemon writes and fsyncs in the
  background and is waited for, untimed, before the next segment.

Printed: the median stall of each (min, max) and the median of the per-round ratios.

    python tests/bench/bench_integrations_accelerate.py [--rounds 7] [--hidden 512 --layers 4 --vocab 4096]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator

from ckptd.client import CheckpointClient
from ckptd.demo.process import start_daemon
from ckptd.integrations.accelerate import save_state


class Counter:
    """A registered object, as users register their own."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    args = p.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="ckptd-bench-acc-"))
    shm = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"))
    daemon = start_daemon(root=scratch / "root", socket=scratch / "d.sock", extra_args=["--shm-dir", str(shm)], log_path=scratch / "daemon.log")
    try:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=8, vocab_size=args.vocab, n_positions=64)
        accelerator = Accelerator(cpu=True)
        model = transformers.GPT2LMHeadModel(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        accelerator.register_for_checkpointing(Counter())
        tokens = torch.randint(0, args.vocab, (2, 64))
        n_params = sum(t.numel() for t in model.parameters())

        def train_step() -> None:
            loss = model(tokens, labels=tokens).loss
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()

        client = CheckpointClient("bench-accelerate", address=daemon.address, on_error="raise")
        times: dict[str, list[float]] = {"accelerate": [], "ckptd": []}
        step = 0
        for warm in range(2):
            train_step()
            step += 1
            save_state(accelerator, client, step).wait_durable(timeout=600)
            accelerator.save_state(str(scratch / f"warm-{warm}"))
        for r in range(args.rounds):
            train_step()
            target = scratch / f"acc-{r}"
            started = time.perf_counter()
            accelerator.save_state(str(target))
            times["accelerate"].append(time.perf_counter() - started)
            shutil.rmtree(target)

            train_step()
            step += 1
            started = time.perf_counter()
            handle = save_state(accelerator, client, step)
            times["ckptd"].append(time.perf_counter() - started)
            handle.wait_durable(timeout=600)
        client.close()
        ratios = [a / c for a, c in zip(times["accelerate"], times["ckptd"])]
        print(f"model: GPT-2 {n_params / 1e6:.1f} M fp32 parameters + AdamW ({n_params * 12 / 2**20:.0f} MiB a save), {args.rounds} rounds")
        for name, values in times.items():
            print(f"{name:>10}: stall median {statistics.median(values) * 1e3:7.1f} ms (min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})")
        print(f"accelerate / ckptd stall: median {statistics.median(ratios):.1f}x (min {min(ratios):.1f}, max {max(ratios):.1f})")
    finally:
        daemon.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
