"""Hugging Face Trainer benchmark: the stall per save of CkptdCallback against the Trainer's own saving.

The same Trainer run twice per round, interleaved (ckptd, trainer, ckptd, trainer, ...), so that
drift in the machine's load falls on both alike:

- `ckptd`: `callbacks=[CkptdCallback(job=...)]` saving to a real daemon (`start_daemon`). stall:
  the wall time of the callback event that makes the save (the next step's `on_step_begin`):
  the trainer state as JSON, the hand-off of model, optimizer, scheduler and RNG to the daemon.
  The daemon writes and fsyncs in the background; `on_train_end` waits until the last save is
  durable (not timed), so its writing does not fall on the other way's run.
- `trainer`: the Trainer's default `save_strategy="steps"`: `Trainer._save_checkpoint`
  (model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json into
  output_dir/checkpoint-N; torch.save, no fsync). stall: the wall time of `_save_checkpoint`.

The model: a GPT-2 of `--hidden`/`--layers`/`--vocab` made from a config (default ~15 M fp32
parameters, 59 MB; with AdamW's moments ~177 MB a save), trained with batches of 2 x 64 random
tokens, a save every `--save-steps` steps, `--saves` saves a run (the run's final save is not
counted). Printed: the median stall per save of each way over all rounds (min, max), and their
ratio (trainer / ckptd), with the bytes one save leaves on disk and the median of the first save
of each run (where ckptd plans the save and maps its shared memory once).

    python tests/bench/bench_integrations_hf.py [--rounds 3 --saves 4 --save-steps 3] [--hidden 512 --layers 4 --vocab 4096]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from ckptd.client import CheckpointClient
from ckptd.demo.process import start_daemon
from ckptd.integrations.transformers import CkptdCallback

SEQ = 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, samples: int) -> None:
        self.tokens = torch.randint(0, vocab, (samples, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class TimedCkptd(CkptdCallback):
    """CkptdCallback that records how long each event that made a save blocked the training loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stalls: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        before = self.last_save
        started = time.perf_counter()
        super().on_step_begin(args, state, control, **kwargs)
        if self.last_save is not before:
            self.stalls.append(time.perf_counter() - started)


class TimedTrainer(transformers.Trainer):
    """The Trainer with its own checkpoint saving timed."""

    stalls: list[float]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        started = time.perf_counter()
        super()._save_checkpoint(model, trial)
        self.stalls.append(time.perf_counter() - started)


def make_args(output_dir: Path, save_steps: int, saves: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=save_steps * saves + 1, save_strategy="steps", save_steps=save_steps,
        per_device_train_batch_size=2, learning_rate=1e-4, logging_steps=10_000, report_to="none", use_cpu=True,
        disable_tqdm=True, save_total_limit=2, dataloader_num_workers=0,
    )


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=4, help="timed saves per run")
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None, help="where the daemon root and output dirs go (default: a new temporary directory)")
    opts = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("ckptd").setLevel(logging.WARNING)

    work = Path(tempfile.mkdtemp(prefix="bench-hf-", dir=opts.out))
    config = transformers.GPT2Config(vocab_size=opts.vocab, n_positions=SEQ, n_embd=opts.hidden, n_layer=opts.layers,
                                     n_head=max(1, opts.hidden // 64), bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    data = Tokens(opts.vocab, 64)
    daemon = start_daemon(work / "root", Path(tempfile.mkdtemp(prefix="ckptd-b-")) / "d.sock",
                          extra_args=["--shm-dir", tempfile.mkdtemp(prefix="ckptd-bench-", dir="/dev/shm"), "--keep-last", "1"],
                          log_path=work / "daemon.log")
    stalls: dict[str, list[float]] = {"ckptd": [], "trainer": []}
    firsts: dict[str, list[float]] = {"ckptd": [], "trainer": []}  # the first save of each run (ckptd: plans and maps its arenas)
    sizes: dict[str, int] = {}
    try:
        print(f"model: GPT-2 hidden {opts.hidden}, {opts.layers} layers, vocab {opts.vocab}: {params / 1e6:.1f} M parameters, "
              f"{params * 4 / 2**20:.0f} MiB fp32 (+ AdamW moments)")
        for round_ in range(opts.rounds):
            # on_train_end waits until the last save is durable (wait_at_end_s), outside the timed events
            ours = TimedCkptd(job=f"bench-{round_}", address=daemon.address, on_error="raise")
            trainer = transformers.Trainer(model=model, args=make_args(work / "ours", opts.save_steps, opts.saves),
                                           train_dataset=data, callbacks=[ours])
            trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
            trainer.train(resume_from_checkpoint=ours.resume_from(trainer))
            with CheckpointClient(f"bench-{round_}", address=daemon.address) as client:
                newest = client.list()[-1]
            sizes["ckptd"] = tree_bytes(Path(newest.path))
            stalls["ckptd"] += ours.stalls[: opts.saves]
            firsts["ckptd"] += ours.stalls[:1]

            theirs = TimedTrainer(model=model, args=make_args(work / "theirs", opts.save_steps, opts.saves), train_dataset=data)
            theirs.stalls = []
            theirs.remove_callback(transformers.trainer_callback.PrinterCallback)
            theirs.train()
            checkpoints = sorted((work / "theirs").glob("checkpoint-*"))
            if checkpoints:
                sizes["trainer"] = tree_bytes(checkpoints[-1])
            shutil.rmtree(work / "theirs", ignore_errors=True)
            stalls["trainer"] += theirs.stalls[: opts.saves]
            firsts["trainer"] += theirs.stalls[:1]
            print(f"round {round_ + 1}: ckptd {[f'{s * 1e3:.0f}' for s in ours.stalls[: opts.saves]]} ms, "
                  f"trainer {[f'{s * 1e3:.0f}' for s in theirs.stalls[: opts.saves]]} ms")
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    ours_median, theirs_median = statistics.median(stalls["ckptd"]), statistics.median(stalls["trainer"])
    for way, values in stalls.items():
        print(f"{way:8s} median stall per save {statistics.median(values) * 1e3:8.1f} ms "
              f"(min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f}, n={len(values)}), "
              f"{sizes.get(way, 0) / 2**20:.0f} MiB on disk per save; first save of a run: median {statistics.median(firsts[way]) * 1e3:.1f} ms")
    print(f"ratio trainer / ckptd: {theirs_median / ours_median:.1f}x")


if __name__ == "__main__":
    main()
