"""What compressed checkpoints cost in training quality, measured (issue 4).

A byte-level transformer (ckptd.demo.charlm: the Python standard library's sources) is
trained for K steps, checkpointed through a real daemon and the real client with each variant,
then resumed from each checkpoint in a fresh model and optimizer for K more steps, on the same
batches. The held-out loss (fixed windows of the corpus's tail) after the resumed steps is
compared with the lossless resume of the same seed (paired deltas), for several seeds.

Settings:
- fp32: fp32 weights + AdamW; variants lossless, O1, O2;
- mixed: bf16 model weights + fp32 master weights + Adam (the master weights are what Adam
  steps; forward/backward use the bf16-rounded weights); variants lossless, O2 + drop,
  O2 + residual.
Noise control: "lossless, other batches" resumes the lossless checkpoint but draws the resumed
steps' batches from another seed: how much the final loss moves for reasons that have nothing
to do with compression, at this scale.

    python tests/bench/quant_accuracy.py --steps 300 --seeds 0 1 2 --plot docs/quant_accuracy.png --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptd.client import CheckpointClient
from ckptd.demo.charlm import CharLM, CharLMConfig, batch_at, evaluate, lm_loss, load_corpus, split_corpus
from ckptd.demo.process import start_daemon

CONFIG = CharLMConfig(d_model=128, n_heads=4, n_layers=2, context=64)
BATCH = 16
LR = 3e-3


@dataclass(frozen=True)
class Variant:
    name: str
    quantize: str | None  # "none" | "O1" | "O2"
    master: str = "keep"
    batch_seed_offset: int = 0  # noise control: other batches after the resume


FP32_VARIANTS = [
    Variant("lossless", "none"),
    Variant("O1", "O1"),
    Variant("O2", "O2"),
    Variant("lossless, other batches", "none", batch_seed_offset=1000),
]
MIXED_VARIANTS = [
    Variant("lossless", "none"),
    Variant("O2 + residual", "O2", "residual"),
    Variant("O2 + drop", "O2", "drop"),
    Variant("lossless, other batches", "none", batch_seed_offset=1000),
]


class Fp32Run:
    """fp32 weights, AdamW."""

    def __init__(self, seed: int) -> None:
        self.model = CharLM(CONFIG, seed=seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.01)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(self.model, x, y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt}

    def eval_model(self) -> torch.nn.Module:
        return self.model


class MixedRun:
    """bf16 model weights, fp32 master weights stepped by Adam, optimizer state keyed by name.

    The compute model is fp32 holding the bf16-rounded master weights (CPU bf16 matmuls are slow);
    the saved state is what a mixed-precision trainer holds: the bf16 model, the fp32 masters,
    Adam's moments."""

    def __init__(self, seed: int) -> None:
        self.compute = CharLM(CONFIG, seed=seed)
        self.names = [n for n, _ in self.compute.named_parameters()]
        self.master = {n: p.detach().clone() for n, p in self.compute.named_parameters()}
        self.model = CharLM(CONFIG, seed=seed).to(torch.bfloat16)
        self.opt = torch.optim.Adam(list(self.master.values()), lr=LR, betas=(0.9, 0.999))
        for p in self.master.values():  # state exists from the start, so a load has tensors to fill
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        self._sync()

    @torch.no_grad()
    def _sync(self) -> None:
        params = dict(self.model.named_parameters())
        for n, p in self.compute.named_parameters():
            rounded = self.master[n].to(torch.bfloat16)
            params[n].copy_(rounded)
            p.copy_(rounded.float())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(self.compute, x, y)
        self.compute.zero_grad()
        loss.backward()
        for n, p in self.compute.named_parameters():
            self.master[n].grad = p.grad
        self.opt.step()
        self._sync()
        return loss.item()

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "master": self.master,
            "optimizer": {"state": {n: self.opt.state[self.master[n]] for n in self.names}},
        }

    def after_load(self) -> None:
        with torch.no_grad():
            for n, p in self.compute.named_parameters():
                p.copy_(self.master[n].to(torch.bfloat16).float())

    def eval_model(self) -> torch.nn.Module:
        return self.compute


def make_run(setting: str, seed: int) -> Fp32Run | MixedRun:
    return Fp32Run(seed) if setting == "fp32" else MixedRun(seed)


def experiment(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    train, held_out = split_corpus(load_corpus(args.corpus_bytes))
    k, every = args.steps, args.eval_every
    results: dict[str, Any] = {"steps": k, "seeds": args.seeds, "batch": BATCH, "lr": LR, "config": CONFIG.__dict__, "settings": {}}
    with tempfile.TemporaryDirectory(prefix="ckptd-qacc-") as tmp:
        daemon = start_daemon(Path(tmp) / "root", Path(tmp) / "d.sock", ["--shm-dir", tmp, "--keep-last", "0", "--quant-max-generations", "0"])
        try:
            for setting in args.settings:
                variants = FP32_VARIANTS if setting == "fp32" else MIXED_VARIANTS
                per_seed: dict[str, dict[int, list[tuple[int, float]]]] = {v.name: {} for v in variants}
                base_curves: dict[int, list[tuple[int, float]]] = {}
                for seed in args.seeds:
                    started = time.perf_counter()
                    run = make_run(setting, seed)
                    curve = [(0, evaluate(run.eval_model(), held_out, CONFIG.context))]
                    for step in range(1, k + 1):
                        run.step(*batch_at(train, BATCH, CONFIG.context, seed, step))
                        if step % every == 0:
                            curve.append((step, evaluate(run.eval_model(), held_out, CONFIG.context)))
                    base_curves[seed] = curve
                    with CheckpointClient(f"{setting}-{seed}", address=daemon.address, on_error="raise") as ckpt:
                        for i, v in enumerate(variants):  # one step number per variant: each is its own checkpoint
                            ckpt.save(k * 100 + i, run.state(), quantize=v.quantize, master_weights=v.master).wait_durable(timeout=600)
                        for i, v in enumerate(variants):
                            resumed = make_run(setting, seed + 7919)  # other initial weights: everything must come from the checkpoint
                            ckpt.load(resumed.state(), step=k * 100 + i)
                            if isinstance(resumed, MixedRun):
                                resumed.after_load()
                            curve = [(k, evaluate(resumed.eval_model(), held_out, CONFIG.context))]
                            for step in range(k + 1, 2 * k + 1):
                                resumed.step(*batch_at(train, BATCH, CONFIG.context, seed + v.batch_seed_offset, step))
                                if step % every == 0:
                                    curve.append((step, evaluate(resumed.eval_model(), held_out, CONFIG.context)))
                            per_seed[v.name][seed] = curve
                    final = {v.name: per_seed[v.name][seed][-1][1] for v in variants}
                    print(f"{setting} seed {seed}: {time.perf_counter() - started:.0f} s; final held-out loss "
                          + ", ".join(f"{n} {x:.4f}" for n, x in final.items()), flush=True)
                results["settings"][setting] = {"base": base_curves, "resumed": per_seed, "summary": summarize(per_seed, args.seeds)}
        finally:
            daemon.stop()
    return results


def summarize(per_seed: dict[str, dict[int, list[tuple[int, float]]]], seeds: list[int]) -> dict[str, Any]:
    """Per variant: final loss mean/min/max over seeds, and the paired relative delta to the
    lossless resume of the same seed (mean, min, max, in percent)."""
    out = {}
    for name, by_seed in per_seed.items():
        finals = [by_seed[s][-1][1] for s in seeds]
        deltas = [100.0 * (by_seed[s][-1][1] / per_seed["lossless"][s][-1][1] - 1.0) for s in seeds]
        # the same, averaged over the evaluations of the last quarter of the resumed steps: less
        # of the noise of one evaluation point
        tails = []
        for s in seeds:
            points = by_seed[s][1:]
            last = points[-max(1, len(points) // 4) :]
            ref = per_seed["lossless"][s][1:][-len(last) :]
            tails.append(statistics.fmean(100.0 * (a[1] / b[1] - 1.0) for a, b in zip(last, ref)))
        out[name] = {
            "tail_delta_pct_mean": statistics.fmean(tails), "tail_delta_pct": tails,
            "final_mean": statistics.fmean(finals), "final_min": min(finals), "final_max": max(finals),
            "delta_pct_mean": statistics.fmean(deltas), "delta_pct_min": min(deltas), "delta_pct_max": max(deltas),
            "delta_pct": deltas,
        }
    return out


def report(results: dict[str, Any]) -> str:
    lines = []
    for setting, data in results["settings"].items():
        lines.append(f"setting {setting}: {results['steps']} steps, then {results['steps']} resumed steps; seeds {results['seeds']}")
        lines.append(f"{'variant':<26} {'final held-out loss':>22} {'delta vs lossless (same seed), %':>40}   last quarter, %")
        for name, s in data["summary"].items():
            per = " ".join(f"{d:+.2f}" for d in s["delta_pct"])
            tail = " ".join(f"{d:+.2f}" for d in s["tail_delta_pct"])
            lines.append(
                f"{name:<26} {s['final_mean']:.4f} [{s['final_min']:.4f}-{s['final_max']:.4f}] "
                f"{s['delta_pct_mean']:+7.2f} [{s['delta_pct_min']:+.2f} .. {s['delta_pct_max']:+.2f}]  per seed: {per}"
                f"   {s['tail_delta_pct_mean']:+.2f} ({tail})"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Per setting: the held-out loss curves (mean over seeds), and below them each variant's
    relative difference to the lossless resume of the same seed (mean line, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(results["settings"])
    seeds = results["seeds"]
    fig, axes = plt.subplots(2, len(settings), figsize=(6.5 * len(settings), 8), squeeze=False)
    for col, setting in enumerate(settings):
        data = results["settings"][setting]
        top, bottom = axes[0][col], axes[1][col]
        base_steps = [p[0] for p in data["base"][seeds[0]]]
        base = [statistics.fmean(data["base"][s][i][1] for s in seeds) for i in range(len(base_steps))]
        top.plot(base_steps, base, color="black", label="training, before the checkpoint")
        lossless = data["resumed"]["lossless"]
        for name, by_seed in data["resumed"].items():
            steps = [p[0] for p in by_seed[seeds[0]]]
            mean = [statistics.fmean(by_seed[s][i][1] for s in seeds) for i in range(len(steps))]
            style = ":" if "other batches" in name else "-"
            label = f"resumed: {name} ({data['summary'][name]['delta_pct_mean']:+.2f}% at the end)"
            line = top.plot(steps, mean, style, label=label)[0]
            if name == "lossless":
                continue
            rel = [[100 * (by_seed[s][i][1] / lossless[s][i][1] - 1) for s in seeds] for i in range(len(steps))]
            bottom.plot(steps, [statistics.fmean(r) for r in rel], style, color=line.get_color(), label=name)
            bottom.fill_between(steps, [min(r) for r in rel], [max(r) for r in rel], color=line.get_color(), alpha=0.15)
        k = results["steps"]
        top.axvline(k, color="grey", lw=0.5)
        top.set_ylim(min(min(p[1] for p in lossless[s]) for s in seeds) - 0.05, base[min(len(base) - 1, max(1, len(base) // 4))])
        top.set_title(f"{setting}: held-out loss (mean of {len(seeds)} seeds)")
        top.set_xlabel("step")
        top.set_ylabel("loss (nats/byte)")
        top.legend(fontsize=7)
        bottom.axhline(0, color="black", lw=0.5)
        bottom.set_title(f"{setting}: vs the lossless resume of the same seed (band: min-max)")
        bottom.set_xlabel("step")
        bottom.set_ylabel("held-out loss vs lossless resume (%)")
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="K: steps before the checkpoint, and resumed steps after it")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=["fp32", "mixed"], choices=["fp32", "mixed"])
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--corpus-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: on a shared 2-core machine two threads were 4x slower)")
    parser.add_argument("--json", type=Path, help="write the curves and the summary here")
    parser.add_argument("--plot", type=Path, help="write a PNG of the curves here")
    parser.add_argument("--from-json", type=Path, help="do not train: report and plot the results in this file")
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        for data in results["settings"].values():  # JSON object keys are strings
            data["base"] = {int(k): v for k, v in data["base"].items()}
            data["resumed"] = {n: {int(k): v for k, v in by.items()} for n, by in data["resumed"].items()}
        results["seeds"] = [int(x) for x in results["seeds"]]
        for data in results["settings"].values():
            data["summary"] = summarize(data["resumed"], results["seeds"])
    else:
        results = experiment(args)
    print(report(results))
    if args.json and not args.from_json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
