"""PEFT benchmark: an adapter-only save through ckptd (ckptd.integrations.peft) against PEFT's
default way of saving a fine-tune, and against ckptd saving the whole PeftModel.

The state: a Llama of `--hidden`/`--layers`/`--vocab` (default ~22 M fp32 parameters, 88 MB)
made from a config, with LoRA of rank `--rank` on q/k/v/o_proj, AdamW over the adapter and a
linear LR schedule, trained a few steps so the optimizer has its moments. Three ways to save it:

- `ckptd adapter`: `ckpt.save(step, adapter_state(model, optimizer, scheduler))` to a real
  daemon (`start_daemon`). stall: the wall time of the save() call, what the training loop waits;
  durable: from the call until wait_durable() returns (written and fsynced, committed).
- `peft default`: what the Hugging Face Trainer does for a PeftModel: `model.save_pretrained(dir)`
  (adapter_model.safetensors + adapter_config.json) and `torch.save(optimizer.state_dict())`
  (optimizer.pt), plus `torch.save(scheduler.state_dict())` (scheduler.pt). stall: all of it,
  synchronous; durable: stall plus an fsync of each file and of the directory (the Trainer does
  not fsync; this is what it would take).
- `ckptd whole`: `ckpt.save(step, {"model": model, "optimizer": optimizer, "scheduler": scheduler})`,
  what a user of ckptd did before this integration: the frozen base goes with every save.

bytes: the sizes of the files the save left (a step directory, the PEFT directory; files that
are hard links of one another counted once). After `--warmup` untimed rounds (the first saves plan
and map the arenas), `--rounds` rounds: each takes one training step (untimed), then runs the
three saves in an order rotated by one each round, each after the daemon has finished the last
one, so that drift in the machine's load falls on all of them alike. Printed: the median, min
and max of each figure, and of the ratios taken within each round. Everything is written under
`--out` (default: a new directory in ./bench-out, which must be on the disk under test), removed
at the end unless `--keep`.

    python tests/bench/bench_integrations_peft.py [--rounds 9] [--hidden 512 --layers 4 --vocab 8192 --rank 16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ckptd.client import CheckpointClient
from ckptd.demo.process import start_daemon
from ckptd.integrations.peft import adapter_state

WAYS = ("ckptd adapter", "peft default", "ckptd whole")


@dataclass
class Figures:
    stall_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    copy_bytes: list[int] = field(default_factory=list)  # of which a second file of the same data


def make_training(args: argparse.Namespace) -> tuple[Any, torch.optim.Optimizer, Any]:
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64), max_position_embeddings=256,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(
            transformers.LlamaForCausalLM(config),
            LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=1000)
    return model, optimizer, scheduler


def train_step(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (2, 64))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def files_bytes(directory: Path) -> int:
    """The bytes of the files under `directory`, each inode once."""
    seen: dict[tuple[int, int], int] = {}
    for path in directory.rglob("*"):
        if path.is_file():
            st = path.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def copy_bytes(step_dir: Path) -> int:
    """The size of the step's adapter_model.safetensors when it is a file of its own, not a hard
    link of the model data file (the daemon publishes the adapter under PEFT's file name)."""
    adapter = step_dir / "adapter_model.safetensors"
    if not adapter.is_file():
        return 0
    data = {(p.stat().st_dev, p.stat().st_ino) for p in step_dir.glob("model-*.safetensors")}
    st = adapter.stat()
    return 0 if (st.st_dev, st.st_ino) in data else st.st_size


def fsync_tree(directory: Path) -> None:
    for path in [*sorted(p for p in directory.rglob("*") if p.is_file()), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def peft_default_save(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, directory: Path) -> tuple[float, float]:
    """PEFT's and the HF Trainer's way: (stall, durable) seconds."""
    started = time.perf_counter()
    model.save_pretrained(directory)
    # The baseline being measured pickles, as the Trainer does (optimizer.pt, scheduler.pt);
    # ckptd itself never does.
    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    torch.save(scheduler.state_dict(), directory / "scheduler.pt")
    stall = time.perf_counter() - started
    fsync_tree(directory)
    return stall, time.perf_counter() - started


def ckptd_save(ckpt: CheckpointClient, step: int, state: dict[str, Any]) -> tuple[float, float, Path]:
    started = time.perf_counter()
    handle = ckpt.save(step, state)
    stall = time.perf_counter() - started
    info = handle.wait_durable(timeout=300)
    durable = time.perf_counter() - started
    if info is None:
        raise RuntimeError(f"the save of step {step} did not become durable: {handle.error}")
    return stall, durable, Path(info.step_dir)


def run(args: argparse.Namespace, out: Path) -> dict[str, Figures]:
    model, optimizer, scheduler = make_training(args)
    for _ in range(3):
        train_step(model, optimizer, scheduler, args.vocab)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    print(f"model: {base_bytes / 1e6:.1f} MB frozen base, {adapter_bytes / 1e6:.2f} MB adapter (fp32); "
          f"{args.rounds} rounds after {args.warmup} warm-up rounds")
    adapter = adapter_state(model, optimizer, scheduler)
    whole = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    figures = {way: Figures() for way in WAYS}
    sock_dir = Path(tempfile.mkdtemp(prefix="ckb-"))  # short: Unix socket paths are limited
    shm_dir = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"))
    daemon = start_daemon(root=out / "root", socket=sock_dir / "d.sock", extra_args=["--shm-dir", str(shm_dir)], log_path=out / "daemon.log")
    try:
        with CheckpointClient("peft-adapter", address=daemon.address, on_error="raise") as ckpt_adapter, \
                CheckpointClient("peft-whole", address=daemon.address, on_error="raise") as ckpt_whole:
            def save_adapter(step: int) -> tuple[float, float, int]:
                stall, durable, step_dir = ckptd_save(ckpt_adapter, step, adapter)
                if step > args.warmup:
                    figures["ckptd adapter"].copy_bytes.append(copy_bytes(step_dir))
                return stall, durable, files_bytes(step_dir)

            def save_whole(step: int) -> tuple[float, float, int]:
                stall, durable, step_dir = ckptd_save(ckpt_whole, step, whole)
                return stall, durable, files_bytes(step_dir)

            def save_peft(step: int) -> tuple[float, float, int]:
                directory = out / "peft" / f"checkpoint-{step}"
                stall, durable = peft_default_save(model, optimizer, scheduler, directory)
                size = files_bytes(directory)
                shutil.rmtree(directory.parent / f"checkpoint-{step - 1}", ignore_errors=True)
                return stall, durable, size

            ways: dict[str, Callable[[int], tuple[float, float, int]]] = {
                "ckptd adapter": save_adapter, "peft default": save_peft, "ckptd whole": save_whole,
            }
            for step in range(1, args.warmup + args.rounds + 1):
                train_step(model, optimizer, scheduler, args.vocab)
                order = list(WAYS[step % 3:] + WAYS[: step % 3])
                for way in order:
                    stall, durable, size = ways[way](step)
                    if step > args.warmup:
                        figures[way].stall_s.append(stall)
                        figures[way].durable_s.append(durable)
                        figures[way].bytes.append(size)
    finally:
        daemon.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return figures


def spread(values: list[float], scale: float, unit: str) -> str:
    return f"{statistics.median(values) * scale:9.2f} {unit} ({min(values) * scale:.2f}-{max(values) * scale:.2f})"


def report(figures: dict[str, Figures]) -> None:
    print(f"\n{'':15}{'stall per save':>32}{'until durable':>32}{'bytes written':>18}")
    for way in WAYS:
        f = figures[way]
        print(f"{way:15}{spread(f.stall_s, 1e3, 'ms'):>32}{spread(f.durable_s, 1e3, 'ms'):>32}"
              f"{statistics.median(f.bytes) / 1e6:15.2f} MB")
    copies = figures["ckptd adapter"].copy_bytes
    if copies and statistics.median(copies):
        print(f"{'':15}ckptd adapter bytes include {statistics.median(copies) / 1e6:.2f} MB of adapter_model.safetensors, "
              "a copy of the model data file")

    def ratios(a: str, b: str, what: str) -> str:
        """The ratio a/b within each round (the two saves ran seconds apart), median (min-max)."""
        per_round = [x / y for x, y in zip(getattr(figures[a], what), getattr(figures[b], what))]
        return f"{statistics.median(per_round):.3f} ({min(per_round):.3f}-{max(per_round):.3f})"

    print("\nratios within each round, median (min-max):")
    for other in ("peft default", "ckptd whole"):
        print(f"ckptd adapter / {other:13}: stall {ratios('ckptd adapter', other, 'stall_s')}, "
              f"durable {ratios('ckptd adapter', other, 'durable_s')}, bytes {ratios('ckptd adapter', other, 'bytes')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and the daemon's log")
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    args.out.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="peft-", dir=args.out))
    try:
        report(run(args, out))
    finally:
        if args.keep:
            print(f"kept: {out}")
        else:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
