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

--fsdp N (issue 31 item 1): N gloo processes with Accelerate's FSDP2 plugin (sharded state dict;
on CPU through tests/integrations/fsdp_cpu.py). Accelerate's own save_state then writes the
model and optimizer shards with torch.distributed.checkpoint (each process its own, plus the
pickled generators and objects); ckptd's hands each process's shards to the daemon. A round's
stall is the slowest process's (the next collective waits for it).
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
from typing import Any, NamedTuple

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
    p.add_argument("--fsdp", type=int, default=0, help="processes of an FSDP2 run (gloo); 0: one process, no FSDP")
    p.add_argument("--rank-of", help=argparse.SUPPRESS)  # JSON: a process of the --fsdp run (rank, port, address, scratch)
    args = p.parse_args(argv)
    if args.rank_of:
        return _rank(args, json.loads(args.rank_of))

    scratch = Path(tempfile.mkdtemp(prefix="ckptd-bench-acc-"))
    shm = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"))
    daemon = start_daemon(root=scratch / "root", socket=scratch / "d.sock", extra_args=["--shm-dir", str(shm)], log_path=scratch / "daemon.log")
    try:
        if args.fsdp:
            times, n_params = _fsdp_run(args, daemon.address, scratch)
            label = f"FSDP2 over {args.fsdp} gloo processes, "
        else:
            accelerator = Accelerator(cpu=True)
            parts, n_params = _prepared(accelerator, args)
            with CheckpointClient("bench-accelerate", address=daemon.address, on_error="raise") as client:
                times = _rounds(accelerator, parts, client, scratch, args.rounds)
            label = ""
        ratios = [a / c for a, c in zip(times["accelerate"], times["ckptd"])]
        print(f"model: GPT-2 {n_params / 1e6:.1f} M fp32 parameters + AdamW ({n_params * 12 / 2**20:.0f} MiB a save), {label}{args.rounds} rounds")
        for name, values in times.items():
            print(f"{name:>10}: stall median {statistics.median(values) * 1e3:7.1f} ms (min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})")
        print(f"accelerate / ckptd stall: median {statistics.median(ratios):.1f}x (min {min(ratios):.1f}, max {max(ratios):.1f})")
    finally:
        daemon.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


class Parts(NamedTuple):
    """What a benchmark process trains: prepared model, optimizer and scheduler, a batch of tokens."""

    model: Any
    opt: Any
    sched: Any
    tokens: torch.Tensor


def _prepared(accelerator: Any, args: argparse.Namespace) -> tuple[Parts, int]:
    """The GPT-2, AdamW, LambdaLR and a registered Counter, prepared; and the parameter count."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=8, vocab_size=args.vocab, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    n_params = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)  # together: FSDP2 swaps the optimizer's parameters
    accelerator.register_for_checkpointing(Counter())
    return Parts(model, opt, sched, torch.randint(0, args.vocab, (2, 64))), n_params


def _rounds(accelerator: Any, parts: Parts, client: CheckpointClient, scratch: Path, rounds: int) -> dict[str, list[float]]:
    """Warm both ways up, then `rounds` rounds of an Accelerate save and a ckptd save, each after
    an untimed training step; returns this process's stalls (seconds) of each."""
    model, opt, sched, tokens = parts

    def train_step() -> None:
        loss = model(tokens, labels=tokens).loss
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()

    def drop(target: Path) -> None:  # untimed: every process has written its part before it goes
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(target)
        accelerator.wait_for_everyone()

    times: dict[str, list[float]] = {"accelerate": [], "ckptd": []}
    step = 0
    for warm in range(2):
        train_step()
        step += 1
        save_state(accelerator, client, step).wait_durable(timeout=600)
        accelerator.save_state(str(scratch / f"warm-{warm}"))
        drop(scratch / f"warm-{warm}")
    for r in range(rounds):
        train_step()
        target = scratch / f"acc-{r}"
        started = time.perf_counter()
        accelerator.save_state(str(target))
        times["accelerate"].append(time.perf_counter() - started)
        drop(target)

        train_step()
        step += 1
        started = time.perf_counter()
        handle = save_state(accelerator, client, step)
        times["ckptd"].append(time.perf_counter() - started)
        handle.wait_durable(timeout=600)
        accelerator.wait_for_everyone()
    return times


def _fsdp_run(args: argparse.Namespace, address: str, scratch: Path) -> tuple[dict[str, list[float]], int]:
    """Run the --fsdp processes; a round's stall of each way is the slowest process's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = sys.argv[1:]
    procs = [
        subprocess.Popen([sys.executable, __file__, *argv, "--rank-of", json.dumps({"rank": r, "port": port, "address": address, "scratch": str(scratch)})])
        for r in range(args.fsdp)
    ]
    codes = [proc.wait() for proc in procs]
    if codes != [0] * args.fsdp:
        raise SystemExit(f"FSDP processes exited with {codes}")
    per_rank = [json.loads((scratch / f"times-{r}.json").read_text()) for r in range(args.fsdp)]
    times = {name: [max(rank[name][i] for rank in per_rank) for i in range(args.rounds)] for name in ("accelerate", "ckptd")}
    return times, per_rank[0]["n_params"]


def _rank(args: argparse.Namespace, me: dict[str, Any]) -> int:
    """One process of the --fsdp run: writes its stalls to scratch/times-<rank>.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(me["port"]), RANK=str(me["rank"]), LOCAL_RANK=str(me["rank"]),
                      WORLD_SIZE=str(args.fsdp), LOCAL_WORLD_SIZE=str(args.fsdp))
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
    from fsdp_cpu import fsdp2_accelerator  # tests/integrations/fsdp_cpu.py

    accelerator = fsdp2_accelerator()
    parts, n_params = _prepared(accelerator, args)
    scratch = Path(me["scratch"])
    with CheckpointClient("bench-accelerate-fsdp", address=me["address"], on_error="raise") as client:
        times = _rounds(accelerator, parts, client, scratch, args.rounds)
    (scratch / f"times-{me['rank']}.json").write_text(json.dumps({**times, "n_params": n_params}))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
