"""GPU hand-off benchmark: what the trainer waits per save, by mode, against the pinned-copy floor and DCP.

    python tests/bench/gpu_stall.py                       # 1, 4 and 16 GiB states, 5 reps each
    python tests/bench/gpu_stall.py --sizes 1 --reps 3    # a quick look

Needs one CUDA GPU (an H100 or H200 for the figures the README asks for) and exits at once,
with status 2 and a message, where torch sees none. For each state size, in one run:

- floor: a plain `copy_` of the state's bytes (one flat device tensor) into pinned host memory
  (torch's pinned allocator): the device-to-host bandwidth to compare with;
- baseline: the training step without saving. The "state" is a model of fp32 parameters with
  AdamW (fused) state; every parameter has a gradient, so each optimizer step changes all of
  it. The forward and backward are the matmuls of a transformer block (bf16, hidden 8192),
  repeated so that they take `--step-margin` times the floor's copy time (the copy fits inside
  the step, the case the targets are about);
- ckptd "copy", "overlap" and "ipc": a real daemon; per measured step: `save()` (its
  `handle.stall_s` is the trainer-visible stall), forward and backward, `optimizer.step()` (its
  pre-hook fences), then `torch.cuda.synchronize()` (as `loss.item()` would) — the step's wall
  time includes any time the GPU waited for the copy. Between measured steps the script waits,
  untimed, until the checkpoint is durable: persisting 16 GB takes seconds on any disk, so a
  save every step would measure the disk, not the hand-off (bench_save.py measures the disk);
- DCP: `torch.distributed.checkpoint.async_save` with a reused DefaultStager (pinned, shared
  memory, async staging, non-blocking copies) on the same state; its trainer-visible stall is
  async_save's blocking time plus the wait for `staging_completion` before the optimizer step
  (what the DCP tutorial prescribes).

Targets (printed with PASS/FAIL): copy-mode bandwidth (the device copies of a save, from queued
to done: `handle.copy_s`) >= 0.8 x the floor; overlap and ipc
stall <= 5 ms + 20 us per tensor, at every size; overlap and ipc step time <= 1.05 x the
baseline. Exit status 0 whether targets pass or fail, 1 if a part could not run, 2 without CUDA.
See tests/bench/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

GIB = 2**30
MODES = ("copy", "overlap", "ipc")
PARTS = ("floor", "copy", "overlap", "ipc", "dcp")
HIDDEN = 8192
TOKENS = 4096
STALL_BASE_S = 0.005
STALL_PER_TENSOR_S = 20e-6
WARMUP_SAVES = 3  # both arena sets mapped and page-locked, the plan cached


# ------------------------------------------------------------------ results


@dataclass
class Series:
    """Repeated measurements of one quantity (seconds), and the bytes it moved."""

    values: list[float] = field(default_factory=list)
    nbytes: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def worst(self) -> float:
        return max(self.values) if self.values else math.nan

    @property
    def best(self) -> float:
        return min(self.values) if self.values else math.nan


@dataclass
class SizeResults:
    size_gib: float
    nbytes: int = 0
    tensors: int = 0
    layers: int = 0  # transformer-block repetitions per forward/backward
    series: dict[str, Series] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    def add(self, key: str, value: float, nbytes: int = 0) -> None:
        s = self.series.setdefault(key, Series(nbytes=nbytes))
        s.values.append(value)


ROWS = {
    "floor.d2h": "floor: copy_ device -> pinned host, one flat tensor",
    "fwd_bwd": "forward + backward alone",
    "baseline.step": "training step, no save",
    "copy.d2h": "ckptd copy: device copies, queued to done",
    "copy.stall": "ckptd copy: stall per save",
    "copy.step": "ckptd copy: step with a save",
    "overlap.stall": "ckptd overlap: stall per save",
    "overlap.step": "ckptd overlap: step with a save",
    "ipc.stall": "ckptd ipc: stall per save",
    "ipc.step": "ckptd ipc: step with a save",
    "dcp.blocked": "DCP async_save: blocked in async_save",
    "dcp.stall": "DCP async_save: blocked + staging wait",
    "dcp.step": "DCP async_save: step with a save",
}


# ------------------------------------------------------------------ workload


class StateModel(nn.Module):
    """fp32 parameters totalling about `param_bytes`: 4096 x 4096 matrices plus 4096-vectors
    (realistic tensor counts: a few large and many small)."""

    def __init__(self, param_bytes: int, device: torch.device) -> None:
        super().__init__()
        matrix = 4096 * 4096 * 4
        count = max(1, round(param_bytes / matrix))
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(4096, 4096, device=device) * 0.01) for _ in range(count)])
        self.biases = nn.ParameterList([nn.Parameter(torch.zeros(4096, device=device)) for _ in range(count)])


def make_state(size_gib: float, device: torch.device) -> tuple[StateModel, torch.optim.Optimizer]:
    """Parameters plus AdamW's two moments = about `size_gib` GiB; every parameter has a gradient."""
    model = StateModel(int(size_gib * GIB / 3), device)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    opt.step()  # the moments exist
    return model, opt


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    tensors = [p for p in model.parameters()] + [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors), len(tensors)


class Block(nn.Module):
    """The matmuls of one transformer block (bf16): qkv, out, MLP up (4h) and down."""

    def __init__(self, hidden: int, device: torch.device) -> None:
        super().__init__()
        kw = {"device": device, "dtype": torch.bfloat16}
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **kw)
        self.out = nn.Linear(hidden, hidden, bias=False, **kw)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False, **kw)
        self.down = nn.Linear(4 * hidden, hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, _, _ = self.qkv(x).chunk(3, dim=-1)
        x = x + self.out(q)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def fwd_bwd(block: Block, x: torch.Tensor, layers: int) -> None:
    h = x
    for _ in range(layers):
        h = block(h)
    h.float().square().mean().backward()


def timed(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ------------------------------------------------------------------ parts


def bench_floor(r: SizeResults, reps: int, device: torch.device) -> float:
    """Pinned-copy bandwidth in bytes/s (best rep), measured on a flat tensor of the state's size."""
    src = torch.empty(r.nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty(r.nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # warm-up
    for _ in range(reps):
        r.add("floor.d2h", timed(lambda: dst.copy_(src, non_blocking=True)), r.nbytes)
    del src, dst
    gc.collect()
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()  # give the pinned buffer back to the OS: the arenas need the RAM
    return r.nbytes / r.series["floor.d2h"].best


def calibrate(block: Block, x: torch.Tensor, target_s: float) -> int:
    """Layers so that forward + backward take at least `target_s`."""
    fwd_bwd(block, x, 1)
    one = min(timed(lambda: fwd_bwd(block, x, 1)) for _ in range(3))
    return max(1, math.ceil(target_s / one))


def train_step(block: Block, x: torch.Tensor, layers: int, opt: torch.optim.Optimizer) -> None:
    block.zero_grad(set_to_none=True)
    fwd_bwd(block, x, layers)
    opt.step()  # changes the whole saved state (its pre-hook fences in overlap and ipc)


def bench_baseline(r: SizeResults, reps: int, block: Block, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    train_step(block, x, r.layers, opt)
    for _ in range(reps):
        r.add("fwd_bwd", timed(lambda: fwd_bwd(block, x, r.layers)))
        r.add("baseline.step", timed(lambda: train_step(block, x, r.layers, opt)))


def bench_ckptd(
    r: SizeResults, reps: int, mode: str, address: str, model: nn.Module, opt: torch.optim.Optimizer, block: Block, x: torch.Tensor
) -> None:
    from ckptd.client import CheckpointClient

    state = {"model": model, "optimizer": opt}
    with CheckpointClient(f"gpu-{mode}-{r.size_gib:g}", address=address, rank=0, world_size=1, mode=mode, on_error="raise") as ckpt:
        step = 0
        for _ in range(WARMUP_SAVES):
            step += 1
            handle = ckpt.save(step, state)
            train_step(block, x, r.layers, opt)
            handle.wait_durable(timeout=3600)
        if ckpt.mode_in_use != mode:
            r.notes.append(f"{mode}: fell back to {ckpt.mode_in_use!r}: {ckpt.mode_reason}")
        for _ in range(reps):
            step += 1
            torch.cuda.synchronize()
            start = time.perf_counter()
            handle = ckpt.save(step, state)
            train_step(block, x, r.layers, opt)
            torch.cuda.synchronize()
            r.add(f"{mode}.step", time.perf_counter() - start)
            r.add(f"{mode}.stall", handle.stall_s, r.nbytes)
            if handle.copy_s is not None:
                r.add(f"{mode}.d2h", handle.copy_s, r.nbytes)
            if handle.wait_durable(timeout=3600) is None:
                raise RuntimeError(f"step {step} was not committed: {handle.error}")


def bench_dcp(r: SizeResults, reps: int, workdir: Path, model: nn.Module, opt: torch.optim.Optimizer, block: Block, x: torch.Tensor) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=True))
    try:
        for i in range(WARMUP_SAVES + reps):
            path = workdir / f"dcp-{r.size_gib:g}-{i}"
            torch.cuda.synchronize()
            start = time.perf_counter()
            model_sd, optim_sd = get_state_dict(model, opt)
            response = dcp.async_save(
                {"model": model_sd, "optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(path),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager,
            )
            blocked = time.perf_counter() - start
            block.zero_grad(set_to_none=True)
            fwd_bwd(block, x, r.layers)
            waited = time.perf_counter()
            response.staging_completion.result()  # before the optimizer changes the state
            stall = blocked + time.perf_counter() - waited
            opt.step()
            torch.cuda.synchronize()
            step_s = time.perf_counter() - start
            response.upload_completion.result()
            shutil.rmtree(path, ignore_errors=True)
            if i >= WARMUP_SAVES:
                r.add("dcp.blocked", blocked, r.nbytes)
                r.add("dcp.stall", stall, r.nbytes)
                r.add("dcp.step", step_s)
    finally:
        stager.close()


# ------------------------------------------------------------------ report


def fmt_row(label: str, s: Series) -> str:
    gbps = f"{s.nbytes / s.median / 1e9:8.2f}" if s.nbytes and s.median > 0 else "       -"
    return f"{label:<48} {s.median * 1e3:10.2f}  [{s.best * 1e3:9.2f} - {s.worst * 1e3:9.2f}] {gbps}  {len(s.values)}"


@dataclass(frozen=True)
class Verdict:
    label: str
    value: float
    limit: float
    text: str
    at_least: bool = False  # PASS when value >= limit (else value <= limit)

    @property
    def passed(self) -> bool:
        return self.value >= self.limit if self.at_least else self.value <= self.limit


def verdicts(r: SizeResults) -> list[Verdict]:
    out = []
    s = r.series
    if "floor.d2h" in s and "copy.d2h" in s:
        floor_bw = r.nbytes / s["floor.d2h"].best
        got = r.nbytes / s["copy.d2h"].median
        out.append(Verdict("copy-mode bandwidth / pinned floor (>= 0.8)", got / floor_bw, 0.8,
                           f"{got / 1e9:.2f} / {floor_bw / 1e9:.2f} GB/s = {got / floor_bw:.2f}", at_least=True))
    budget = STALL_BASE_S + STALL_PER_TENSOR_S * r.tensors
    for mode in ("overlap", "ipc"):
        if f"{mode}.stall" in s:
            stall = s[f"{mode}.stall"].median
            out.append(Verdict(f"{mode} stall <= 5 ms + 20 us x {r.tensors} tensors", stall, budget, f"{stall * 1e3:.2f} ms vs {budget * 1e3:.2f} ms"))
        if f"{mode}.step" in s and "baseline.step" in s:
            ratio = s[f"{mode}.step"].median / s["baseline.step"].median
            out.append(Verdict(f"{mode} step / baseline step (<= 1.05)", ratio, 1.05, f"{ratio:.3f}"))
    return out


def report(results: list[SizeResults], header: list[str]) -> list[str]:
    lines = list(header)
    for r in results:
        lines += ["", f"state {r.size_gib:g} GiB: {r.nbytes:,} bytes in {r.tensors} tensors; forward+backward = {r.layers} transformer blocks (hidden {HIDDEN}, {TOKENS} tokens, bf16)"]
        lines.append(f"{'measurement':<48} {'ms':>10}  [{'min':>9} - {'max':>9}] {'GB/s':>8}  n")
        for key, label in ROWS.items():
            if key in r.series:
                lines.append(fmt_row(label, r.series[key]))
        for v in verdicts(r):
            lines.append(f"target: {v.label:<52} {v.text:<34} {'PASS' if v.passed else 'FAIL'}")
        if "fwd_bwd" in r.series and "floor.d2h" in r.series:
            fits = r.series["floor.d2h"].best < r.series["fwd_bwd"].median
            lines.append(f"note: the copy {'fits' if fits else 'does NOT fit'} inside forward + backward "
                         f"({r.series['floor.d2h'].best * 1e3:.1f} ms floor copy vs {r.series['fwd_bwd'].median * 1e3:.1f} ms)")
        if "dcp.stall" in r.series and "overlap.stall" in r.series:
            lines.append(f"note: overlap stall / DCP stall = {r.series['overlap.stall'].median / r.series['dcp.stall'].median:.3f} (no target)")
        lines += [f"note: {n}" for n in r.notes]
        lines += [f"ERROR in {part}: {e}" for part, e in r.errors.items()]
    return lines


def machine_header(device: torch.device, args: argparse.Namespace) -> list[str]:
    props = torch.cuda.get_device_properties(device)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return [
        "ckptd GPU hand-off benchmark (tests/bench/gpu_stall.py)",
        f"GPU: {props.name}, {props.total_memory / GIB:.0f} GiB, {props.multi_processor_count} SMs; torch {torch.__version__}, CUDA {torch.version.cuda}",
        f"host: {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.platform()}; python {platform.python_version()}",
        f"sizes: {args.sizes} GiB; reps: {args.reps}; parts: {','.join(args.only)}; step margin: {args.step_margin}",
        "times in ms: median [min - max] of the reps; GB/s = 1e9 bytes/s of the state",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,4,16", help="state sizes in GiB, comma-separated (default 1,4,16)")
    p.add_argument("--reps", type=int, default=5, help="measured saves per mode and size (default 5)")
    p.add_argument("--only", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on a real disk (default ./bench-out)")
    p.add_argument("--step-margin", type=float, default=1.5, help="forward+backward time / the floor's copy time (default 1.5)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep checkpoints and daemon logs")
    p.add_argument("--json", action="store_true", help="also print every measurement as JSON")
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes.split(",") if s]
    args.only = [s for s in args.only.split(",") if s]
    unknown = set(args.only) - set(PARTS)
    if unknown or args.reps < 1 or not args.sizes:
        p.error(f"--only takes {','.join(PARTS)} (got {sorted(unknown)}); --reps >= 1; at least one size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_stall.py needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). Run it on a GPU machine with a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    from ckptd.daemon.process import start_daemon

    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-stall-", dir=args.out))
    shm = Path(tempfile.mkdtemp(prefix="ckptd-gpu-bench-", dir="/dev/shm"))
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-gb-"))  # short: Unix socket paths are limited
    header = machine_header(device, args)
    print("\n".join(header), flush=True)
    results: list[SizeResults] = []
    failed = False
    try:
        for size in args.sizes:
            r = SizeResults(size)
            results.append(r)
            model, opt = make_state(size, device)
            r.nbytes, r.tensors = state_bytes(model, opt)
            floor_bw = bench_floor(r, args.reps, device) if "floor" in args.only else 50e9
            block = Block(HIDDEN, device)
            x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
            r.layers = calibrate(block, x, args.step_margin * r.nbytes / floor_bw)
            bench_baseline(r, args.reps, block, x, opt)
            print(f"[{size:g} GiB] floor and baseline done", flush=True)
            daemon = None
            try:
                modes = [m for m in MODES if m in args.only]
                if modes:
                    daemon = start_daemon(
                        root=workdir / f"root-{size:g}", socket=sock_dir / "d.sock",
                        extra_args=["--shm-dir", str(shm), "--keep-last", "1", "--max-inflight", "2"],
                        log_path=workdir / f"daemon-{size:g}.log",
                    )
                for mode in modes:
                    try:
                        bench_ckptd(r, args.reps, mode, daemon.address, model, opt, block, x)
                    except Exception as exc:  # reported, and the other parts still run
                        r.errors[mode] = f"{type(exc).__name__}: {exc}"
                        traceback.print_exc()
                    print(f"[{size:g} GiB] ckptd {mode} done", flush=True)
            finally:
                if daemon is not None:
                    daemon.stop()
            if "dcp" in args.only:
                try:
                    bench_dcp(r, args.reps, workdir, model, opt, block, x)
                except Exception as exc:
                    r.errors["dcp"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                print(f"[{size:g} GiB] DCP done", flush=True)
            failed = failed or bool(r.errors)
            del model, opt, block, x
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
        if not args.keep and not failed:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(report(results, [""])))
    if args.json:
        print(json.dumps([{"size_gib": r.size_gib, "bytes": r.nbytes, "tensors": r.tensors, "layers": r.layers, "notes": r.notes,
                           "errors": r.errors, "series": {k: v.values for k, v in r.series.items()}} for r in results], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
