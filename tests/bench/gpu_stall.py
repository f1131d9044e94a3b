"""GPU hand-off benchmark: what the trainer waits per save, by mode, against the pinned-copy floor and DCP.

    python tests/bench/gpu_stall.py --check               # the GPU check: `pytest -m gpu`, then 1, 4, 16 GiB, < 10 min
    python tests/bench/gpu_stall.py                       # the benchmark alone: 1, 4 and 16 GiB
    python tests/bench/gpu_stall.py --sizes 1 --reps 3    # a quick look

Needs one CUDA GPU (an H100 or H200 for the figures issue 19 asks for) and exits at once, with
status 2 and a message, where torch sees none. `--check` first runs `python -m pytest -q -m gpu
tests` (the CUDA tests), then the benchmark within what is left of 10 minutes, and ends with one
table: the GPU's name, the tests' outcome and every target with PASS/FAIL per state size.

Per state size, one daemon (`--keep-last 1 --max-inflight 1`) and one job that the three clients
(`copy`, `overlap`, `ipc`) share: each save waits until durable before the next, so one arena set
is enough, and at most one step (plus the one being written) is on disk; the daemon's root is
deleted when the size is done. The state is fp32 parameters (4096 x 4096 matrices and
4096-vectors) with fused AdamW state, 40 tensors at 1 GiB and 680 at 16 GiB; every parameter has
a gradient, so each optimizer step changes the whole state. Forward and backward are the matmuls
of a bf16 transformer block, repeated so they take `--step-margin` x the floor's copy time.

A warm-up round (every part once, untimed: arenas allocated, mapped and page-locked, the staging
buffer opened, DCP's pinned copies made) is followed by `--reps` timed rounds. Each round runs,
back to back: the floor (one flat `copy_` of the state's bytes, device->pinned host and back), a
training step without a save, then each of copy / overlap / ipc / DCP (their order rotates from
round to round). A ckptd part is: checksums of the state (GPU), `save()` (its wall time is the
stall), the training step (`optimizer.step()` fences), `torch.cuda.synchronize()` (the step's time
includes any wait for the copy), `wait_durable()` (untimed: the next save never waits for an
arena), then `load()` of that step (timed: the restore, host->device) and the checksums again
(bit-exact or not). The DCP part: `get_state_dict` + `dcp.async_save` with a reused DefaultStager
(pinned, shared memory, async staging) if it works on this torch, else plain torch staging (a
pinned CPU copy made once, `copy_(non_blocking=True)` on a side stream, an event, then
`async_save` of the CPU copy); its stall is what the trainer waits until the state may change
(`async_save`'s blocking time plus the wait for staging before `optimizer.step()`). The
targets are judged on the median of per-round ratios. See tests/bench/README.md.

Exit status: 0 when every target (and, with --check, the GPU tests) passed; 1 when one failed,
was not measured, or a part could not run; 2 without CUDA.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

GIB = 2**30
REPO = Path(__file__).resolve().parents[2]
MODES = ("copy", "overlap", "ipc")
SAVERS = ("copy", "overlap", "ipc", "dcp")  # the parts that save, in the warm-up's order
HIDDEN = 8192
TOKENS = 4096
LAYERS_PER_BACKWARD = 4  # forward + backward in chunks of this many blocks: bounded activation memory
JOB = "gpu-bench"
DURABLE_TIMEOUT_S = 900.0
CHECK_BUDGET_S = 480.0  # --check: the whole command, tests included (issue 33: under ~8 minutes on an H100)
CHECK_MARGIN_S = 25.0  # kept free at the end of --check (final table, process exit)
TESTS_TIMEOUT_S = 150.0
STAGING_TIMEOUT_S = 120.0  # DCP's staging: a stager that hangs fails the part instead of the budget
PROFILED_MODES = ("overlap", "ipc")
DEFAULT_BASELINE = "DefaultStager (pinned, shared memory, async staging, non-blocking copies), reused; thread executor"
PLAIN_BASELINE = ("plain pinned staging (a pinned CPU copy made once, copy_(non_blocking=True) on a side stream + event, "
                  "then async_save of the CPU copy; thread executor)")

# targets (issue 33)
D2H_MIN = 0.95  # copy-mode device->host bandwidth / pinned floor
H2D_MIN = 0.9  # restore host->device bandwidth / pinned floor (host->device)
STALL_MAX_S = 0.005  # overlap and ipc stall, at every size
STEP_MAX = 1.01  # step with a save in flight / step without
IPC_OVER_OVERLAP_MAX = 1.0
STALL_OVER_DCP_MAX = 0.05


# ------------------------------------------------------------------ results (pure: no GPU needed)


@dataclass
class SizeResults:
    """Everything measured for one state size.

    rounds: one dict per timed round, key -> seconds (keys: floor.d2h, floor.h2d, baseline.step,
    MODE.stall, MODE.step, MODE.restore, copy.d2h, dcp.blocked, dcp.stall, dcp.step).
    restores: per mode, one bool per restore (warm-up included): the checksums matched.
    saves: per saving part, the saves that completed (warm-up included).
    modes_in_use: per mode, the mode its client used at the end ("ipc" may fall back to "overlap").
    floor_bytes: bytes of the floor's flat copy (the state's, unless GPU memory was short).
    """

    size_gib: float
    nbytes: int = 0
    tensors: int = 0
    layers: int = 0
    floor_bytes: int = 0
    fwd_bwd_s: float = math.nan
    rounds: list[dict[str, float]] = field(default_factory=list)
    restores: dict[str, list[bool]] = field(default_factory=dict)
    saves: dict[str, int] = field(default_factory=dict)
    modes_in_use: dict[str, str] = field(default_factory=dict)
    in_memory: dict[str, bool] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None  # why the size was not run
    wall_s: float = 0.0
    profile: list[str] = field(default_factory=list)  # the profile's table (tests/bench/gpu_profile.py)

    def values(self, key: str) -> list[float]:
        return [r[key] for r in self.rounds if key in r]

    def median(self, key: str) -> float:
        v = self.values(key)
        return statistics.median(v) if v else math.nan

    def per_round(self, fn: Callable[[dict[str, float]], float | None]) -> list[float]:
        """fn applied to every round; rounds where it gives None (a missing key) are left out."""
        out = []
        for r in self.rounds:
            try:
                v = fn(r)
            except (KeyError, ZeroDivisionError):
                v = None
            if v is not None and math.isfinite(v):
                out.append(v)
        return out


def median_or_nan(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def stall_limit_s(tensors: int) -> float:
    """The stall target of overlap and ipc in seconds: 5 ms at every size (issue 33: a stall that
    does not grow with tensors)."""
    return STALL_MAX_S


@dataclass(frozen=True)
class Verdict:
    """One target at one size. passed: True, False, or None when it was not measured (counts as not passing)."""

    key: str  # the summary table's row
    text: str  # the measured value, short
    passed: bool | None
    detail: str = ""

    @property
    def word(self) -> str:
        return "PASS" if self.passed else "FAIL" if self.passed is False else "MISSING"


TARGET_ROWS = {
    "ok.copy": "copy: every save ok, restores bit-exact",
    "ok.overlap": "overlap: every save ok, restores bit-exact",
    "ok.ipc": "ipc: every save ok (no fallback), restores bit-exact",
    "d2h": f"device->host (copy mode) / pinned floor >= {D2H_MIN}",
    "h2d": f"restore host->device / pinned floor >= {H2D_MIN}",
    "stall.overlap": f"overlap stall <= {STALL_MAX_S * 1e3:g} ms",
    "stall.ipc": f"ipc stall <= {STALL_MAX_S * 1e3:g} ms",
    "ipc_vs_overlap": f"ipc stall / overlap stall <= {IPC_OVER_OVERLAP_MAX:g}",
    "step.overlap": f"overlap step / step without save <= {STEP_MAX}",
    "step.ipc": f"ipc step / step without save <= {STEP_MAX}",
    "dcp.overlap": f"overlap stall / DCP stall <= {STALL_OVER_DCP_MAX}",
    "dcp.ipc": f"ipc stall / DCP stall <= {STALL_OVER_DCP_MAX}",
}


def _ratio_verdict(key: str, ratios: list[float], limit: float, at_least: bool = False, fmt: str = "{:.3f}") -> Verdict:
    if not ratios:
        return Verdict(key, "-", None, "not measured")
    m = statistics.median(ratios)
    passed = m >= limit if at_least else m <= limit
    return Verdict(key, fmt.format(m), passed, f"median of {len(ratios)} per-round ratios, [{min(ratios):.3f} - {max(ratios):.3f}]")


def judge(r: SizeResults, modes: Sequence[str] = MODES, dcp: bool = True) -> list[Verdict]:
    """The targets of one size, judged on the medians of per-round ratios (absolute stalls: the
    median of the rounds). A part that was not run or failed gives MISSING or FAIL, never PASS."""
    out: list[Verdict] = []
    for mode in MODES:
        key = f"ok.{mode}"
        if mode not in modes:
            out.append(Verdict(key, "not run", None))
            continue
        checks = r.restores.get(mode, [])
        in_use = r.modes_in_use.get(mode, mode)
        if mode in r.errors:
            out.append(Verdict(key, "error", False, r.errors[mode]))
        elif in_use != mode:
            reason = next((n for n in r.notes if n.startswith(f"{mode}: fell back")), "")
            out.append(Verdict(key, f"fell back to {in_use}", False, reason))
        elif not checks:
            out.append(Verdict(key, "-", None, "no save completed"))
        else:
            good = sum(checks)
            out.append(Verdict(key, f"{r.saves.get(mode, 0)} saves, {good}/{len(checks)} exact", good == len(checks)))
    out.append(_ratio_verdict("d2h", r.per_round(lambda x: (r.nbytes / x["copy.d2h"]) / (r.floor_bytes / x["floor.d2h"])), D2H_MIN, at_least=True))
    h2d = [v for m in modes for v in r.per_round(lambda x, m=m: (r.nbytes / x[f"{m}.restore"]) / (r.floor_bytes / x["floor.h2d"]))]
    out.append(_ratio_verdict("h2d", h2d, H2D_MIN, at_least=True))
    limit = stall_limit_s(r.tensors)
    for mode in ("overlap", "ipc"):
        stalls = r.values(f"{mode}.stall")
        if stalls:
            m = statistics.median(stalls)
            out.append(Verdict(f"stall.{mode}", f"{m * 1e3:.2f} ms", m <= limit, f"limit {limit * 1e3:.2f} ms at {r.tensors} tensors"))
        else:
            out.append(Verdict(f"stall.{mode}", "-", None, "not measured"))
    out.append(_ratio_verdict("ipc_vs_overlap", r.per_round(lambda x: x["ipc.stall"] / x["overlap.stall"]), IPC_OVER_OVERLAP_MAX))
    for mode in ("overlap", "ipc"):
        out.append(_ratio_verdict(f"step.{mode}", r.per_round(lambda x, m=mode: x[f"{m}.step"] / x["baseline.step"]), STEP_MAX))
    for mode in ("overlap", "ipc"):
        ratios = r.per_round(lambda x, m=mode: x[f"{m}.stall"] / x["dcp.stall"]) if dcp else []
        out.append(_ratio_verdict(f"dcp.{mode}", ratios, STALL_OVER_DCP_MAX))
    return out


def info_lines(r: SizeResults) -> list[str]:
    """Figures without a target, for context."""
    lines = []
    copy_dcp = r.per_round(lambda x: x["copy.stall"] / x["dcp.stall"])
    if copy_dcp:
        lines.append(f"copy stall / DCP stall = {statistics.median(copy_dcp):.3f} (no target: copy waits for the copy by design)")
    copy_step = r.per_round(lambda x: x["copy.step"] / x["baseline.step"])
    if copy_step:
        lines.append(f"copy step / step without save = {statistics.median(copy_step):.3f} (no target)")
    dcp_step = r.per_round(lambda x: x["dcp.step"] / x["baseline.step"])
    if dcp_step:
        lines.append(f"DCP step / step without save = {statistics.median(dcp_step):.3f} (no target)")
    from_disk = sorted(m for m, held in r.in_memory.items() if not held)
    if from_disk:
        lines.append(f"the last restore of {', '.join(from_disk)} was not from the daemon's memory (read from the files)")
    floor = r.median("floor.d2h")
    if math.isfinite(floor) and math.isfinite(r.fwd_bwd_s):
        copy_s = floor * r.nbytes / max(r.floor_bytes, 1)
        fits = copy_s < r.fwd_bwd_s
        lines.append(f"the state's copy ({copy_s * 1e3:.1f} ms at the floor) {'fits' if fits else 'does NOT fit'} inside "
                     f"forward + backward ({r.fwd_bwd_s * 1e3:.1f} ms, {r.layers} blocks)")
    return lines


ROWS = {
    "floor.d2h": "floor: copy_ device -> pinned host, one flat tensor",
    "floor.h2d": "floor: copy_ pinned host -> device, one flat tensor",
    "baseline.step": "training step, no save",
    "copy.d2h": "ckptd copy: device copies, queued to done",
    "copy.stall": "ckptd copy: stall (save() wall time)",
    "copy.step": "ckptd copy: step with a save",
    "copy.restore": "ckptd copy: restore (load() wall time)",
    "overlap.stall": "ckptd overlap: stall (save() wall time)",
    "overlap.step": "ckptd overlap: step with a save",
    "overlap.restore": "ckptd overlap: restore (load() wall time)",
    "ipc.stall": "ckptd ipc: stall (save() wall time)",
    "ipc.step": "ckptd ipc: step with a save",
    "ipc.restore": "ckptd ipc: restore (load() wall time)",
    "dcp.blocked": "DCP async_save: blocked in the call",
    "dcp.stall": "DCP async_save: stall (blocked + staging wait)",
    "dcp.step": "DCP async_save: step with a save",
}
BYTES_ROWS = {"floor.d2h", "floor.h2d", "copy.d2h", "copy.stall", "copy.restore", "overlap.restore", "ipc.restore", "dcp.stall"}


def size_report(r: SizeResults, modes: Sequence[str] = MODES, dcp: bool = True) -> list[str]:
    """The detailed table of one size: every measurement (median [min - max] of the rounds), then the targets."""
    head = f"state {r.size_gib:g} GiB"
    if r.skipped:
        return ["", f"{head}: NOT RUN: {r.skipped}"]
    lines = ["", f"{head}: {r.nbytes:,} bytes in {r.tensors} tensors; {len(r.rounds)} timed rounds; "
                 f"forward+backward = {r.layers} blocks (hidden {HIDDEN}, {TOKENS} tokens, bf16); took {r.wall_s:.0f} s"]
    lines.append(f"{'measurement':<50} {'ms':>10}  [{'min':>9} - {'max':>9}] {'GB/s':>7}  n")
    for key, label in ROWS.items():
        v = r.values(key)
        if not v:
            continue
        med = statistics.median(v)
        nbytes = r.floor_bytes if key.startswith("floor.") else r.nbytes
        gbps = f"{nbytes / med / 1e9:7.2f}" if key in BYTES_ROWS and med > 0 else "      -"
        lines.append(f"{label:<50} {med * 1e3:10.2f}  [{min(v) * 1e3:9.2f} - {max(v) * 1e3:9.2f}] {gbps}  {len(v)}")
    for v in judge(r, modes, dcp):
        detail = f"  ({v.detail})" if v.detail else ""
        lines.append(f"target: {TARGET_ROWS[v.key]:<53} {v.text:>22}  {v.word}{detail}")
    lines += [f"note: {n}" for n in info_lines(r) + r.notes]
    lines += [f"ERROR in {part}: {e}" for part, e in r.errors.items()]
    return lines + r.profile


def summary_table(results: Sequence[SizeResults], gpu: str, dcp_baseline: str, tests: tuple[str, bool | None] | None,
                  modes: Sequence[str] = MODES, dcp: bool = True) -> tuple[list[str], bool]:
    """The final table: targets x sizes, each cell the value and PASS/FAIL, then each size's
    profile. Returns (lines, all passed). tests: (the gpu tests' summary, passed; None: skipped,
    which fails nothing)."""
    col = 26
    lines = ["", "=" * 100, f"ckptd GPU check on {gpu}", f"DCP baseline: {dcp_baseline}"]
    all_passed = True
    if tests is not None:
        summary, ok = tests
        all_passed = ok is not False
        word = "SKIPPED" if ok is None else "PASS" if ok else "FAIL"
        lines.append(f"{'gpu tests (python -m pytest -q -m gpu tests)':<54} {summary}  {word}")
    heads = [f"{r.size_gib:g} GiB ({r.tensors} tensors)" if not r.skipped else f"{r.size_gib:g} GiB" for r in results]
    lines.append(f"{'target':<54}" + "".join(f"{h:>{col}}" for h in heads))
    verdicts = [{v.key: v for v in judge(r, modes, dcp)} if not r.skipped else {} for r in results]
    counts = {"PASS": 0, "FAIL": 0, "MISSING": 0, "NOT RUN": 0}
    for key, label in TARGET_ROWS.items():
        cells = []
        for r, vs in zip(results, verdicts):
            if r.skipped:
                cell = "NOT RUN"
                counts["NOT RUN"] += 1
                all_passed = False
            else:
                v = vs[key]
                cell = f"{v.text} {v.word}"
                counts[v.word] += 1
                all_passed = all_passed and v.passed is True
            cells.append(f"{cell:>{col}}")
        lines.append(f"{label:<54}" + "".join(cells))
    for r in results:
        if r.skipped:
            lines.append(f"{r.size_gib:g} GiB not run: {r.skipped}")
    lines.append(f"targets: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['MISSING']} MISSING, {counts['NOT RUN']} NOT RUN"
                 f" -> {'ALL PASS' if all_passed else 'NOT ALL PASS'}")
    for r in results:
        if r.profile:
            lines += [""] + r.profile
    return lines, all_passed


# ------------------------------------------------------------------ budget and space (pure)


@dataclass(frozen=True)
class SizeCost:
    """Seconds one size took, to predict the next: setup (state, floor, daemon, warm-up round) and one timed round."""

    size_gib: float
    setup_s: float
    round_s: float


def predict_size_s(prev: SizeCost | None, size_gib: float, rounds: int) -> float | None:
    """Seconds a size should take for `rounds` rounds, scaled by bytes from the previous size
    (writing the checkpoints dominates, and it grows with the bytes); None without a previous size."""
    if prev is None or prev.size_gib <= 0:
        return None
    scale = size_gib / prev.size_gib
    return (prev.setup_s + rounds * prev.round_s) * scale


def another_round_fits(left_s: float, round_s: float, reserve_s: float) -> bool:
    """Whether a round of `round_s` seconds fits in `left_s` seconds, keeping `reserve_s` for teardown."""
    return left_s - reserve_s >= round_s


def space_shortfalls(nbytes: int, disk_free: int, shm_free: int, ram_available: int, gpu_free: int, shm_dcp: bool) -> list[str]:
    """What is missing to run a state of `nbytes` bytes (empty: enough of everything).

    disk: the job's kept step and the next one being written (or DCP's save beside the kept step),
    2x the state plus 2 GiB. /dev/shm: one arena set (the state), plus DCP's shared-memory staging
    when the DefaultStager runs, plus 1 GiB. RAM: the floor's pinned buffer, DCP's staging and
    the arena, 3x the state plus 4 GiB. GPU: the state with its gradients (4/3 x), the ipc staging
    buffer (1 x), at least 1 GiB for the floor and 10 GiB for the training step.
    """
    needs = [
        ("disk", disk_free, 2 * nbytes + 2 * GIB),
        ("/dev/shm", shm_free, nbytes * (2 if shm_dcp else 1) + GIB),
        ("RAM", ram_available, 3 * nbytes + 4 * GIB),
        ("GPU memory", gpu_free, nbytes * 7 // 3 + 11 * GIB),
    ]
    return [f"{what}: {need / GIB:.1f} GiB needed, {free / GIB:.1f} GiB free" for what, free, need in needs if free < need]


def floor_size(nbytes: int, gpu_free: int) -> int:
    """Bytes of the floor's flat copy: the state's, unless the GPU lacks room for it beside the
    state, gradients, staging buffer and training step (then what fits, at least 1 GiB)."""
    room = gpu_free - nbytes * 7 // 3 - 10 * GIB
    return int(min(nbytes, max(GIB, room // GIB * GIB)))


def checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor, computed where the tensors are (on the GPU for CUDA tensors): the sum
    of the tensor's words (its bytes read as integers of its element size) times (position mod
    65521 + 1), modulo 2**64. Equal checksums = equal bits (a changed, swapped or shifted word
    changes the sum, barring a collision)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out = []
    for t in tensors:
        words = t.detach().contiguous().reshape(-1).view(ints[t.element_size()]).to(torch.int64)
        weights = torch.arange(words.numel(), device=t.device, dtype=torch.int64).remainder_(65521).add_(1)
        out.append((words * weights).sum())
        del words, weights
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def parse_pytest_summary(output: str) -> str:
    """The last line of `pytest -q` output that reports counts (e.g. '9 passed, 1 skipped in 40.1s')."""
    for line in reversed(output.strip().splitlines()):
        text = line.strip().strip("=").strip()
        if any(w in text for w in ("passed", "failed", "error", "skipped", "no tests ran", "deselected")):
            return text
    return "no summary line"


# ------------------------------------------------------------------ workload (GPU)


class StateModel(nn.Module):
    """fp32 parameters totalling about `param_bytes`: `side` x `side` matrices plus `side`-vectors."""

    def __init__(self, param_bytes: int, device: torch.device, side: int = 4096) -> None:
        super().__init__()
        count = max(1, round(param_bytes / (side * side * 4)))
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(side, side, device=device) * 0.01) for _ in range(count)])
        self.biases = nn.ParameterList([nn.Parameter(torch.zeros(side, device=device)) for _ in range(count)])


def make_state(size_gib: float, device: torch.device, side: int = 4096) -> tuple[StateModel, torch.optim.Optimizer]:
    """Parameters plus AdamW's two moments = about `size_gib` GiB; every parameter has a gradient."""
    model = StateModel(int(size_gib * GIB / 3), device, side)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    opt.step()  # the moments exist
    return model, opt


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The saved tensors: parameters, then every tensor of the optimizer state (a load may replace
    the optimizer's tensors: call again after one)."""
    return [p for p in model.parameters()] + [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]


class Block(nn.Module):
    """The matmuls of one transformer block (bf16): qkv, out, MLP up (4h) and down."""

    def __init__(self, hidden: int, device: torch.device) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": torch.bfloat16}
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **kw)
        self.out = nn.Linear(hidden, hidden, bias=False, **kw)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False, **kw)
        self.down = nn.Linear(4 * hidden, hidden, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, _, _ = self.qkv(x).chunk(3, dim=-1)
        x = x + self.out(q)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@dataclass
class Workload:
    """The saved state (model + optimizer) and the compute of one training step."""

    model: StateModel
    opt: torch.optim.Optimizer
    block: Block
    x: torch.Tensor
    layers: int = 1
    batch: torch.Tensor | None = None  # pinned host copy of the input: each step uploads it (its own transfer)

    @property
    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt}

    def fwd_bwd(self, layers: int | None = None) -> None:
        """`layers` blocks forward and backward, in chunks of LAYERS_PER_BACKWARD (same work, bounded memory)."""
        left = self.layers if layers is None else layers
        while left > 0:
            n = min(left, LAYERS_PER_BACKWARD)
            h = self.x
            for _ in range(n):
                h = self.block(h)
            h.float().square().mean().backward()
            left -= n

    def train_step(self) -> None:
        """Forward, backward and `optimizer.step()`, which changes the whole saved state (its
        pre-hook fences in overlap and ipc). No synchronize: the caller times. The step first
        uploads its input batch from pinned memory, as a data loader does (`batch`)."""
        if self.batch is not None:
            self.x.copy_(self.batch, non_blocking=True)
        self.block.zero_grad(set_to_none=True)
        self.fwd_bwd()
        self.opt.step()


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn` takes, GPU work included (synchronized before and after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def calibrate(w: Workload, target_s: float) -> tuple[int, float]:
    """Blocks so that forward + backward take at least `target_s`; returns (blocks, seconds they take)."""
    w.fwd_bwd(1)
    one = min(timed(lambda: w.fwd_bwd(1)) for _ in range(3))
    w.layers = max(1, math.ceil(target_s / one))
    w.fwd_bwd()
    return w.layers, min(timed(w.fwd_bwd) for _ in range(2))


# ------------------------------------------------------------------ DCP (GPU)


class PlainPinnedStaging:
    """DCP staging with plain torch, for a torch whose DefaultStager fails: a pinned CPU copy of
    every CUDA tensor of the state dict, made once (by path) and refilled by each save with
    `copy_(non_blocking=True)` on a side stream, which waits for the compute stream first; the
    host then waits for the copies' event. Returns a state dict of CPU tensors (other values as
    they are)."""

    def __init__(self) -> None:
        self._host: dict[str, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            out = self._walk(state_dict, "")
        done = torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()
        return out

    def _walk(self, x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            if not x.is_cuda:
                return x
            host = self._host.get(path)
            if host is None or host.shape != x.shape or host.dtype != x.dtype:
                host = self._host[path] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
            return host
        if isinstance(x, dict):
            return {k: self._walk(v, f"{path}/{k}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self._walk(v, f"{path}/{i}") for i, v in enumerate(x))
        return x

    def close(self) -> None:
        self._host.clear()


def _pass_through_stager() -> Any:
    """An AsyncStager that hands DCP the state dict as it is (already staged by PlainPinnedStaging)."""
    from torch.distributed.checkpoint.staging import AsyncStager

    class PassThrough(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict: Any) -> Any:
            return state_dict

        def synchronize_staging(self) -> None:
            return None

        def close(self) -> None:
            return None

    return PassThrough()


def _default_stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=True))


def _init_gloo() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def probe_default_stager(device: torch.device) -> str | None:
    """Stage a small state of the benchmark's structure (fp32 parameters, fused AdamW, via
    get_state_dict) twice with one DefaultStager; None if that works, else why not (the exception)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    stager = None
    try:
        model, opt = make_state(3 * 64 * 64 * 4 * 2 / GIB, device, side=64)
        model_sd, optim_sd = get_state_dict(model, opt)
        stager = _default_stager()
        for _ in range(2):  # reused, as the benchmark does: torch 2.11's failed from the second stage on
            staged = stager.stage({"model": model_sd, "optimizer": optim_sd})
            if hasattr(staged, "result"):
                staged = staged.result(timeout=120)
            torch.cuda.synchronize()
        return None
    except Exception as exc:  # any failure means: use the plain staging (and say why)
        return f"{type(exc).__name__}: {exc}"
    finally:
        if stager is not None:
            try:
                stager.close()
            except Exception as exc:  # closing a broken stager must not stop the run
                print(f"note: closing the probe DefaultStager failed: {exc}", flush=True)


class DcpPart:
    """DCP's async_save on the benchmark's state, with the DefaultStager or plain pinned staging."""

    def __init__(self, workdir: Path, size_gib: float, use_default: bool) -> None:
        self.workdir = workdir
        self.size_gib = size_gib
        self.use_default = use_default
        self.stager: Any = _default_stager() if use_default else _pass_through_stager()
        self.plain = None if use_default else PlainPinnedStaging()
        self.count = 0

    def save_round(self, w: Workload, rec: dict[str, float] | None) -> None:
        """One save with a training step; `rec`: where to put the timings (None: warm-up)."""
        self.count += 1
        path = self.workdir / f"dcp-{self.size_gib:g}-{self.count}"
        try:
            self._save(w, rec, path)
        finally:
            shutil.rmtree(path, ignore_errors=True)  # each save's files go at once: disk space

    def _save(self, w: Workload, rec: dict[str, float] | None, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        torch.cuda.synchronize()
        start = time.perf_counter()
        model_sd, optim_sd = get_state_dict(w.model, w.opt)
        state_dict: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        if self.plain is not None:
            state_dict = self.plain.stage(state_dict)  # the trainer waits for the copy here
        response = dcp.async_save(
            state_dict, storage_writer=dcp.FileSystemWriter(str(path), thread_count=4),
            async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=self.stager,
        )
        blocked = time.perf_counter() - start
        staging = getattr(response, "staging_completion", None)
        upload = getattr(response, "upload_completion", response)
        w.block.zero_grad(set_to_none=True)
        w.fwd_bwd()
        waited = time.perf_counter()
        if staging is not None:
            staging.result(timeout=STAGING_TIMEOUT_S)  # before the optimizer changes the state
        stall = blocked + time.perf_counter() - waited
        w.opt.step()
        torch.cuda.synchronize()
        step_s = time.perf_counter() - start
        upload.result(timeout=DURABLE_TIMEOUT_S)  # untimed: the next save starts from a quiet disk
        if rec is not None:
            rec["dcp.blocked"] = blocked
            rec["dcp.stall"] = stall
            rec["dcp.step"] = step_s

    def close(self) -> None:
        try:
            self.stager.close()
        finally:
            if self.plain is not None:
                self.plain.close()


# ------------------------------------------------------------------ ckptd (GPU)


class CkptdPart:
    """One client (one mode) of the shared job: save + step, wait durable, load + compare checksums."""

    def __init__(self, mode: str, address: str, r: SizeResults, steps: list[int], chunk_mib: int = 0) -> None:
        from ckptd.client import CheckpointClient

        self.mode = mode
        self.r = r
        self.steps = steps  # [last step saved by any client of the job], shared
        self.client = CheckpointClient(JOB, address=address, rank=0, world_size=1, mode=mode, on_error="raise")
        if chunk_mib:
            split_copies(self.client, chunk_mib * 2**20)

    def registrations(self) -> int:
        """cudaHostRegister calls the client's pinned arenas made so far (0 before its first save)."""
        backend = getattr(self.client._handoff, "_backend", None)
        return int(getattr(getattr(backend, "pinned", None), "registrations", 0))

    def profiled_save(self, w: Workload) -> Callable[[], None]:
        """Save and run a training step (no synchronize: the profile does); returns what waits
        for the save to be durable, to run outside the profiled range."""
        self.steps[0] += 1
        step = self.steps[0]
        handle = self.client.save(step, w.state)
        w.train_step()

        def settle() -> None:
            if handle.wait_durable(timeout=DURABLE_TIMEOUT_S) is None:
                raise RuntimeError(f"profiled step {step} was not committed: {handle.error}")

        return settle

    def save_round(self, w: Workload, rec: dict[str, float] | None) -> None:
        ckpt, mode, r = self.client, self.mode, self.r
        self.steps[0] += 1
        step = self.steps[0]
        expected = checksums(state_tensors(w.model, w.opt))
        torch.cuda.synchronize()
        start = time.perf_counter()
        handle = ckpt.save(step, w.state)
        returned = time.perf_counter()
        w.train_step()
        torch.cuda.synchronize()
        stepped = time.perf_counter()
        if handle.wait_durable(timeout=DURABLE_TIMEOUT_S) is None:
            raise RuntimeError(f"step {step} was not committed: {handle.error}")
        r.saves[mode] = r.saves.get(mode, 0) + 1
        r.modes_in_use[mode] = ckpt.mode_in_use
        if ckpt.mode_in_use != mode and not any(n.startswith(f"{mode}: fell back") for n in r.notes):
            r.notes.append(f"{mode}: fell back to {ckpt.mode_in_use!r}: {ckpt.mode_reason}")
        held = {c.step: c.in_memory for c in ckpt.list()}
        r.in_memory[mode] = bool(held.get(step))
        torch.cuda.synchronize()
        load_start = time.perf_counter()
        loaded = ckpt.load(w.state, step=step)
        torch.cuda.synchronize()
        restore_s = time.perf_counter() - load_start
        exact = loaded == step and torch.equal(checksums(state_tensors(w.model, w.opt)), expected)
        r.restores.setdefault(mode, []).append(bool(exact))
        if not exact and not any(n.startswith(f"{mode}: restore") for n in r.notes):
            r.notes.append(f"{mode}: restore of step {step} is NOT bit-exact (checksums differ; load returned {loaded})")
        if rec is not None:
            rec[f"{mode}.stall"] = returned - start
            rec[f"{mode}.step"] = stepped - start
            rec[f"{mode}.restore"] = restore_s
            if handle.copy_s is not None:
                rec[f"{mode}.d2h"] = handle.copy_s

    def close(self) -> None:
        self.client.close()


def split_copies(client: Any, chunk_bytes: int) -> None:
    """The lever of issue 33 item 1, for measuring: the client's device->host copies of a save cut
    at every `chunk_bytes` of the arena (ckptd.client.cuda_copier.CudaCopier.copy's boundaries),
    so the step's own transfers can interleave with the save's instead of queueing behind one
    large copy. Replaces the CUDA backend's `copy` on this client only."""
    backend = client._handoff.backend
    cuts: dict[int, tuple[int, ...]] = {}

    def copy(placements: Any, dst: torch.Tensor, only: set[int]) -> Any:
        n = dst.numel()
        if n not in cuts:
            cuts[n] = tuple(range(chunk_bytes, n, chunk_bytes))
        return backend.copier.copy(placements, dst, only, cuts[n])

    backend.copy = copy


def profile_size(run: "Run", r: SizeResults, w: Workload, savers: dict[str, Any], daemon: Any) -> list[str]:
    """The profile of one step without a save and one with each mode's save in flight
    (tests/bench/gpu_profile.py); returns its table. The trace is kept beside the daemon logs."""
    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench is not a package
    import gpu_profile

    modes = [m for m in PROFILED_MODES if m in savers and m not in r.errors]
    settle: list[Callable[[], None]] = []
    parts: list[tuple[str, Callable[[], None]]] = [("no save", w.train_step)]
    for mode in modes:
        parts.append((mode, lambda m=mode: settle.append(savers[m].profiled_save(w))))
    registered = {m: savers[m].registrations() for m in modes}
    found = []
    for label, fn in parts:  # one profiler session per part: each save is durable before the next part
        trace = run.workdir / f"profile-{r.size_gib:g}-{label.replace(' ', '-')}.json"
        found += gpu_profile.capture([(label, fn)], daemon.pid if daemon is not None else None, trace)
        while settle:
            settle.pop()()
    restore = None
    if modes:  # the restore of the last profiled save, from the daemon's memory: copies against host time
        last = savers[modes[-1]]
        trace = run.workdir / f"profile-{r.size_gib:g}-restore.json"
        restore = gpu_profile.capture([("restore", lambda: last.client.load(w.state, step=last.steps[0]))],
                                      daemon.pid if daemon is not None else None, trace)[0]
    extra = {m: savers[m].registrations() - registered[m] for m in modes}
    title = (f"profile at {r.size_gib:g} GiB ({r.tensors} tensors): one training step without a save, and with a save in "
             f"flight per mode" + (f"; save copies cut every {run.args.chunk_mib} MiB" if run.args.chunk_mib else ""))
    lines = gpu_profile.table(found, title)
    if restore is not None:
        gbps = r.nbytes / (restore.save_copy_ms / 1e3) / 1e9 if restore.save_copy_ms else math.nan
        lines.append(f"restore ({modes[-1]}, from the daemon's memory): load() {restore.wall_ms:.2f} ms, its host->device copies "
                     f"{restore.save_copy_ms:.2f} ms ({gbps:.1f} GB/s), the rest (host work, RPCs) "
                     f"{restore.wall_ms - restore.save_copy_ms:.2f} ms; {sum(restore.register_calls.values())} page-locking calls")
    lines.append("arena registrations by the clients during the profiled saves: "
                 + ", ".join(f"{m} {n}" for m, n in extra.items()) + f"; traces: profile-{r.size_gib:g}-*.json (kept with --keep)")
    return lines


# ------------------------------------------------------------------ one size


def free_space(path: Path, device: torch.device) -> dict[str, int]:
    """Free bytes: disk under `path`, /dev/shm, RAM (MemAvailable), GPU."""
    ram = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                ram = int(line.split()[1]) * 1024
    shm = os.statvfs("/dev/shm")
    return {
        "disk_free": shutil.disk_usage(path).free,
        "shm_free": shm.f_bavail * shm.f_frsize,
        "ram_available": ram,
        "gpu_free": torch.cuda.mem_get_info(device)[0],
    }


def release_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()  # pinned buffers back to the OS: the next size's arenas need the RAM


@dataclass
class Run:
    """What the whole run shares: paths, options, the deadline."""

    args: argparse.Namespace
    device: torch.device
    workdir: Path
    shm: Path
    sock_dir: Path
    parts: list[str]
    dcp_default: bool  # the DefaultStager works here
    dcp_baseline: str  # which DCP baseline runs, in words
    deadline: float | None  # time.monotonic() by which everything must be done


def run_size(run: Run, size: float, reps: int, prev: SizeCost | None) -> tuple[SizeResults, SizeCost | None]:
    """Measure one state size (see the module docstring); never raises for a part that fails."""
    from ckptd.demo.process import start_daemon

    r = SizeResults(size)
    began = time.monotonic()
    nbytes_est = int(size * GIB)
    free = free_space(run.workdir, run.device)
    short = space_shortfalls(nbytes_est, shm_dcp="dcp" in run.parts and run.dcp_default, **free)
    if short:
        r.skipped = "not enough space: " + "; ".join(short)
        return r, prev
    if run.deadline is not None:
        predicted = predict_size_s(prev, size, 1)
        left = run.deadline - began
        if left <= 0:
            r.skipped = f"the time budget is spent; run it alone: python tests/bench/gpu_stall.py --sizes {size:g}"
            return r, prev
        if predicted is not None and predicted > left:
            r.skipped = (f"about {predicted:.0f} s needed for the warm-up and one round, {left:.0f} s of the budget left; "
                         f"run it alone: python tests/bench/gpu_stall.py --sizes {size:g}")
            return r, prev
    print(f"[{size:g} GiB] free: " + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in free.items()), flush=True)
    model, opt = make_state(size, run.device)
    r.tensors = len(state_tensors(model, opt))
    r.nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, opt))
    r.floor_bytes = floor_size(r.nbytes, free["gpu_free"])  # measured before the state was made
    if r.floor_bytes < r.nbytes:
        r.notes.append(f"the floor copies {r.floor_bytes / GIB:.0f} GiB, not the whole state: GPU memory is short")
    floor_dev = torch.empty(r.floor_bytes, dtype=torch.uint8, device=run.device).random_(0, 255)
    floor_host = torch.empty(r.floor_bytes, dtype=torch.uint8, pin_memory=True)
    floor_bw = r.floor_bytes / min(timed(lambda: floor_host.copy_(floor_dev, non_blocking=True)) for _ in range(2))
    w = Workload(model, opt, Block(HIDDEN, run.device), torch.randn(TOKENS, HIDDEN, device=run.device, dtype=torch.bfloat16))
    w.batch = w.x.cpu().pin_memory()
    r.layers, r.fwd_bwd_s = calibrate(w, run.args.step_margin * r.nbytes / floor_bw)
    w.train_step()
    print(f"[{size:g} GiB] {r.nbytes / GIB:.2f} GiB in {r.tensors} tensors; floor {floor_bw / 1e9:.1f} GB/s; "
          f"forward+backward {r.fwd_bwd_s * 1e3:.0f} ms ({r.layers} blocks)", flush=True)

    root = run.workdir / f"root-{size:g}"
    daemon = None
    savers: dict[str, Any] = {}
    cost = prev
    try:
        modes = [m for m in MODES if m in run.parts]
        if modes:
            daemon = start_daemon(
                root=root, socket=run.sock_dir / "d.sock",
                extra_args=["--shm-dir", str(run.shm), "--keep-last", "1", "--max-inflight", "1"],
                log_path=run.workdir / f"daemon-{size:g}.log",
            )
        steps = [0]

        def to_plain_staging(exc: BaseException) -> None:
            """The DefaultStager failed after passing the probe (made, staging, writing: anywhere
            in a save; on torch 2.11 a reused one failed from its second save on): plain staging
            from here on, for this size and the next; this size's earlier DCP timings are
            dropped, so every DCP figure of the table comes from one baseline."""
            why = f"{type(exc).__name__}: {exc}"
            r.notes.append(f"the DefaultStager failed on the state ({why}); DCP uses plain pinned staging from here on")
            run.dcp_default = False
            run.dcp_baseline = f"{PLAIN_BASELINE}, because the DefaultStager failed on the {size:g} GiB state: {why}"
            for earlier in r.rounds:
                for key in [k for k in earlier if k.startswith("dcp.")]:
                    del earlier[key]
            failed = savers.pop("dcp", None)
            if failed is not None:
                try:
                    failed.close()
                except Exception as close_exc:  # a broken stager may not close; the plain one is new
                    print(f"note: closing the failed DefaultStager failed: {close_exc}", flush=True)
            savers["dcp"] = DcpPart(run.workdir, size, False)

        for part in SAVERS:
            if part not in run.parts:
                continue
            try:
                if part == "dcp":
                    _init_gloo()
                    try:
                        savers[part] = DcpPart(run.workdir, size, run.dcp_default)
                    except Exception as exc:
                        if not run.dcp_default:
                            raise
                        traceback.print_exc()
                        to_plain_staging(exc)
                else:
                    savers[part] = CkptdPart(part, daemon.address, r, steps, run.args.chunk_mib)
            except Exception as exc:
                r.errors[part] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()

        def one(part: str, rec: dict[str, float] | None) -> None:
            if part in r.errors or part not in savers:
                return
            try:
                if part == "ipc" and rec is None:
                    torch.cuda.empty_cache()  # room for the staging buffer, allocated outside torch's cache
                savers[part].save_round(w, rec)
            except Exception as exc:  # reported; the other parts go on
                traceback.print_exc()
                if part == "dcp" and run.dcp_default:
                    try:
                        to_plain_staging(exc)
                    except Exception as plain_exc:
                        r.errors[part] = f"plain staging: {type(plain_exc).__name__}: {plain_exc} (after the DefaultStager's {exc!r})"
                        return
                    one(part, None)  # the plain staging's warm-up: its pinned copies are made here
                    one(part, rec)
                else:
                    r.errors[part] = f"{type(exc).__name__}: {exc}"

        warm = time.monotonic()
        for part in SAVERS:  # warm-up round: arenas allocated, mapped, page-locked; staging opened; pinned copies made
            one(part, None)
        print(f"[{size:g} GiB] warm-up round done in {time.monotonic() - warm:.0f} s", flush=True)
        setup_s = time.monotonic() - began
        round_est = time.monotonic() - warm
        reserve = 5.0 + 0.5 * size
        round_times: list[float] = []
        for i in range(reps):
            if run.deadline is not None and not another_round_fits(run.deadline - time.monotonic(), round_est, reserve):
                r.notes.append(f"stopped after {i} of {reps} timed rounds: the time budget ran out")
                break
            t0 = time.monotonic()
            rec: dict[str, float] = {}
            rec["floor.d2h"] = timed(lambda: floor_host.copy_(floor_dev, non_blocking=True))
            rec["floor.h2d"] = timed(lambda: floor_dev.copy_(floor_host, non_blocking=True))
            rec["baseline.step"] = timed(w.train_step)
            order = [p for p in SAVERS if p in savers]
            order = order[i % len(order):] + order[: i % len(order)] if order else []
            for part in order:
                one(part, rec)
            r.rounds.append(rec)
            round_times.append(time.monotonic() - t0)
            round_est = max(round_times)
            print(f"[{size:g} GiB] round {i + 1}/{reps} done in {round_times[-1]:.0f} s ({', '.join(order)})", flush=True)
        if round_times:
            cost = SizeCost(size, setup_s, statistics.median(round_times))
        wanted = run.args.profile == "all" or (run.args.profile == "first" and size == run.args.sizes[0])
        if wanted and run.deadline is not None and run.deadline - time.monotonic() < reserve + 2 * round_est:
            r.profile = [f"profile at {size:g} GiB not run: the time budget ran out (run it alone: --sizes {size:g} --reps 1)"]
        elif wanted:
            try:
                r.profile = profile_size(run, r, w, savers, daemon)
            except Exception as exc:  # the profile informs; it decides no target
                traceback.print_exc()
                r.profile = [f"profile at {size:g} GiB failed: {type(exc).__name__}: {exc}"]
    finally:
        for part, saver in savers.items():
            try:
                saver.close()
            except Exception as exc:
                r.errors.setdefault(part, f"close: {type(exc).__name__}: {exc}")
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)  # this size's checkpoints: a 16 GiB run would fill the disk
        for left in run.shm.glob("*"):
            left.unlink(missing_ok=True)
        savers.clear()  # the state, floor buffers and pinned copies go when this returns (then release_memory())
    r.wall_s = time.monotonic() - began
    return r, cost


# ------------------------------------------------------------------ main


def pytest_problem() -> str | None:
    """Why the gpu tests cannot run here (no pytest), or None."""
    if importlib.util.find_spec("pytest") is None:
        return f"skipped: pytest is not installed for {sys.executable} (pip install pytest, then rerun --check for them)"
    return None


def run_gpu_tests(timeout_s: float) -> tuple[str, bool | None]:
    """`python -m pytest -q -m gpu tests` from the repository root, its output shown as it comes;
    killed after `timeout_s` seconds. Returns (its summary line, passed), or (why, None) where
    pytest is missing: the benchmark runs without them and that fails no target."""
    problem = pytest_problem()
    if problem is not None:
        print(f"gpu tests {problem}", flush=True)
        return problem, None
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider"]
    print(f"$ python {' '.join(cmd[1:])}   (in {REPO}, timeout {timeout_s:.0f} s)", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def echo() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
        return f"killed after {timeout_s:.0f} s: {parse_pytest_summary(''.join(lines))}", False
    reader.join(timeout=5)
    return f"{parse_pytest_summary(''.join(lines))} (exit {rc})", rc == 0


def gpu_name(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    driver = ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index or 0}"],
                             capture_output=True, text=True, timeout=15)
        if out.returncode == 0 and out.stdout.strip():
            driver = f", driver {out.stdout.strip()}"
    except (OSError, subprocess.TimeoutExpired):
        pass  # no nvidia-smi: the driver version is left out
    return f"{props.name} ({props.total_memory / GIB:.0f} GiB, {props.multi_processor_count} SMs{driver}; torch {torch.__version__}, CUDA {torch.version.cuda})"


def ckptd_problem() -> str | None:
    """Why ckptd cannot be imported here, or None."""
    try:
        missing = [m for m in ("ckptd.client", "ckptd.demo.process") if importlib.util.find_spec(m) is None]
    except ImportError as exc:
        return str(exc)
    return f"{', '.join(missing)} not found" if missing else None


def default_reps(size_gib: float) -> int:
    """Timed rounds per size when --reps is not given: each round writes 4 checkpoints of the state."""
    return 5 if size_gib <= 1 else 3 if size_gib <= 4 else 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Targets and what each part times: tests/bench/README.md (gpu_stall.py).")
    p.add_argument("--check", action="store_true",
                   help="the GPU check: python -m pytest -q -m gpu tests, then the benchmark in what is left of "
                        f"{CHECK_BUDGET_S:.0f} s, and one table with PASS/FAIL")
    p.add_argument("--sizes", default="1,4,16", help="state sizes in GiB, comma-separated (default 1,4,16)")
    p.add_argument("--reps", default=None,
                   help="timed rounds per size: one number, or one per size (default: 5 at 1 GiB, 3 at 4 GiB, 2 above)")
    p.add_argument("--only", default=",".join(SAVERS), help=f"saving parts, a subset of {','.join(SAVERS)} (floor and "
                                                            "the step without save always run)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on a real disk (default ./bench-out)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting rounds and sizes that would end later than this many seconds from now "
                        f"(default: none; with --check, {CHECK_BUDGET_S:.0f} s minus the tests' time and a margin)")
    p.add_argument("--step-margin", type=float, default=1.5, help="forward+backward time / the floor's copy time (default 1.5)")
    p.add_argument("--profile", choices=("first", "all", "off"), default="first",
                   help="profile one step without a save and one with each of overlap/ipc in flight (torch.profiler, "
                        "CUDA activities; about a second per size) at the first size (default), every size, or none")
    p.add_argument("--chunk-mib", type=int, default=0,
                   help="cut the save's device->host copies (copy, overlap) every N MiB of the arena: a lever of issue 33 "
                        "(default 0: as the client does)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the daemon logs (checkpoints are always removed)")
    p.add_argument("--json", type=Path, default=None, help="also write every measurement to this JSON file")
    args = p.parse_args(argv)
    try:
        args.sizes = [float(s) for s in args.sizes.split(",") if s]
        reps = [int(s) for s in args.reps.split(",") if s] if args.reps else [default_reps(s) for s in args.sizes]
    except ValueError as exc:
        p.error(f"--sizes and --reps take comma-separated numbers: {exc}")
    if len(reps) == 1:
        reps = reps * len(args.sizes)
    args.reps = reps
    args.only = [s for s in args.only.split(",") if s]
    unknown = set(args.only) - set(SAVERS)
    if unknown or not args.sizes or len(args.reps) != len(args.sizes) or min(args.reps) < 1 or min(args.sizes) <= 0:
        p.error(f"--only takes {','.join(SAVERS)} (got {sorted(unknown)}); at least one size > 0; --reps >= 1, one or one per size")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if not torch.cuda.is_available():
        print(
            "gpu_stall.py needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). Run it on a GPU machine with a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    problem = ckptd_problem()
    if problem is not None:
        print(f"gpu_stall.py needs ckptd: {problem}: pip install -e . in the checkout, or PYTHONPATH=client:daemon", file=sys.stderr)
        return 1
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    name = gpu_name(device)
    print(f"GPU: {name}", flush=True)
    tests = None
    budget = args.budget_s
    if args.check:
        tests = run_gpu_tests(min(TESTS_TIMEOUT_S, CHECK_BUDGET_S / 2))
        left = CHECK_BUDGET_S - CHECK_MARGIN_S - (time.monotonic() - started)
        budget = left if budget is None else min(budget, left)
    deadline = None if budget is None else time.monotonic() + budget

    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-stall-", dir=args.out))
    shm = Path(tempfile.mkdtemp(prefix="ckptd-gpu-bench-", dir="/dev/shm"))
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-gb-"))  # short: Unix socket paths are limited
    dcp_default = False
    dcp_baseline = "not run"
    if "dcp" in args.only:
        problem = probe_default_stager(device)
        dcp_default = problem is None
        dcp_baseline = DEFAULT_BASELINE if dcp_default else f"{PLAIN_BASELINE}, because the DefaultStager failed: {problem}"
    header = [
        "ckptd GPU hand-off benchmark (tests/bench/gpu_stall.py" + (" --check)" if args.check else ")"),
        f"GPU: {name}",
        f"host: {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB RAM, "
        f"{platform.platform()}; python {platform.python_version()}",
        f"sizes: {', '.join(f'{s:g}' for s in args.sizes)} GiB; timed rounds: {', '.join(map(str, args.reps))}; parts: "
        f"{','.join(args.only)}; step margin {args.step_margin}; budget: {'none' if budget is None else f'{budget:.0f} s'}; "
        f"profile: {args.profile}; save copies cut every: {f'{args.chunk_mib} MiB' if args.chunk_mib else 'no cut'}",
        f"DCP baseline: {dcp_baseline}",
        "times in ms: median [min - max] of the rounds; GB/s = 1e9 bytes/s of the state (floor: of its flat copy)",
    ]
    print("\n".join(header), flush=True)
    run = Run(args, device, workdir, shm, sock_dir, args.only, dcp_default, dcp_baseline, deadline)
    results: list[SizeResults] = []
    cost: SizeCost | None = None
    try:
        for size, reps in zip(args.sizes, args.reps):
            try:
                r, cost = run_size(run, size, reps, cost)
            except Exception as exc:  # a size that cannot even start (out of memory, ...): reported, the next one runs
                traceback.print_exc()
                r = SizeResults(size)
                r.skipped = f"failed: {type(exc).__name__}: {exc}"
            release_memory()  # after run_size returned: its tensors are gone
            results.append(r)
            print("\n".join(size_report(r, [m for m in MODES if m in args.only], "dcp" in args.only)), flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
        failed = any(r.errors or r.skipped for r in results)
        if not args.keep and not failed:
            shutil.rmtree(workdir, ignore_errors=True)
        elif workdir.exists():
            print(f"daemon logs kept in {workdir}", flush=True)
    lines, passed = summary_table(results, name, run.dcp_baseline, tests, [m for m in MODES if m in args.only], "dcp" in args.only)
    lines.append(f"total time {time.monotonic() - started:.0f} s")
    print("\n".join(lines), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"gpu": name, "dcp_baseline": run.dcp_baseline, "tests": tests,
                                         "sizes": [asdict(r) for r in results]}, indent=1, default=str))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
