"""Hand-off benchmark: issue 19's CPU targets, judged in one run of interleaved rounds.

One daemon, one DCP session (PROCESS executor, one reused shared-memory DefaultStager) and, per
part, warm-up first, then `--rounds` rounds. Each round measures the floor, ckptd and DCP back to
back, in that order, on the same state; every ratio is taken within its round, and a target is
judged on the median of the per-round values (min and max shown beside). Before each round every
value of the state changes (an optimizer step, untimed), and before each timed segment the
daemon and DCP's process are let go idle (Quiet), so neither pays for the other's background
work. Parts:

- tensors: for each count in `--tensors` (default 1,000 and 4,000), a state {"model": {...}} of
  that many fp32 tensors of 256 elements. Per tensor, in µs: the floor (a Python loop of
  `copy_` into views of one reused buffer), ckptd `save` (handle.stall_s / n), ckptd `load` from
  the daemon's memory by the client that saved, into the existing tensors (wall time / n), and
  DCP `async_save` until `staging_completion` is done (/ n).
- state: a ~1 GiB transformer-like state (weights + AdamW exp_avg/exp_avg_sq, bench_save.py's
  make_state). Seconds: the memcpy floor (one flat copy of its bytes into a reused, faulted
  buffer, the better of numpy copyto and torch copy_), the write + fsync floor (the same bytes
  to one new file), ckptd stall (handle.stall_s) and durable (save() until wait_durable()
  returns), DCP staged and total (until upload_completion is done).
- busy: the state part again (without the write + fsync floor, which no busy target uses) with
  one busy process per core beside it (a tight numpy loop each, nice 0, started before the
  rounds and killed after them).

It prints every target with PASS or FAIL and a one-line summary. Exits 0 whether targets pass or
fail; 1 when a part could not run; 130 when interrupted. Everything it starts or writes (scratch
directory, arenas, daemon, DCP's process, busy processes) is removed at the end, also on an error
or Ctrl-C. See tests/bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench is not a package
import bench_save as bs  # noqa: E402

PARTS = ("tensors", "state", "busy")
ELEMENTS = 256  # fp32 elements per tensor in the tensors part
DCP_WARMUP = 2  # untimed DCP saves per state before the rounds (the first one allocates its staging memory)
MEMCPY_TRIES = 2  # per round and per library: the memcpy floor of a round is the best of 2 numpy + 2 torch copies
BUSY_SETTLE_S = 1.0  # seconds the busy processes run before the first busy round

# One busy process: a tight numpy loop on 256 KiB (stays in the core's cache: it takes CPU time,
# little memory bandwidth). It exits by itself when its parent (this benchmark) is gone.
BUSY_LOOP = """
import os, sys
import numpy as np
parent = int(sys.argv[1])
try:
    os.setpriority(os.PRIO_PROCESS, 0, 0)
except OSError:
    pass
a = np.ones(1 << 15)
try:
    while os.getppid() == parent:
        for _ in range(500):
            np.multiply(a, 1.0000001, out=a)
            np.multiply(a, 0.9999999, out=a)
except KeyboardInterrupt:
    pass
"""

State = dict[str, Any]


@dataclass
class Quiet:
    """Waits, before each timed segment, until the daemon and DCP's process are idle, so that one
    system's work in the background (the daemon's after a commit, DCP's process after an upload)
    is not charged to the next one measured. Other processes on the machine are not waited for.

    pids: returns the processes to watch. waits: seconds waited before each segment.
    """

    pids: Callable[[], list[int]] = lambda: []
    waits: list[float] = field(default_factory=list)
    capped: int = 0
    window_s: float = 0.1  # idle: at most IDLE_CPU_S of CPU time, all watched processes together, in this window
    max_s: float = 3.0  # give up waiting after this long (counted in `capped`)

    def settle(self) -> None:
        start = time.perf_counter()
        pids = [p for p in self.pids() if p]
        before = total_cpu(pids)
        while pids:
            time.sleep(self.window_s)
            now = total_cpu(pids)
            if now - before <= IDLE_CPU_S:
                break
            if time.perf_counter() - start >= self.max_s:
                self.capped += 1
                break
            before = now
        self.waits.append(time.perf_counter() - start)


IDLE_CPU_S = 0.015  # CPU seconds per Quiet.window_s below which the watched processes count as idle (clock ticks are 10 ms)
QUIET = Quiet()  # main() tells it which processes to watch


# ------------------------------------------------------------------ what one run records


@dataclass
class Run:
    """Per-round values of every measurement, and what the reader should know about them.

    series: key -> one value per round, in the unit of units[key] ("s", or "µs" per tensor).
    """

    series: dict[str, list[float]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    loadavg: dict[str, str] = field(default_factory=dict)

    def add(self, key: str, label: str, unit: str, value: float) -> None:
        """Append this round's `value` (in `unit`) to the series `key`."""
        self.labels.setdefault(key, label)
        self.units.setdefault(key, unit)
        self.series.setdefault(key, []).append(value)


@dataclass(frozen=True)
class Target:
    """PASS when the median over rounds of num (or num / den, taken within each round) <= limit.

    den None: an absolute target on num's own unit (µs per tensor). limit None: shown, not judged.
    """

    label: str
    num: str
    den: str | None
    limit: float | None

    def per_round(self, run: Run) -> list[float]:
        """The value judged, one per round in which both sides were measured."""
        num = run.series.get(self.num, [])
        if self.den is None:
            return list(num)
        den = run.series.get(self.den, [])
        return [a / b for a, b in zip(num, den) if b > 0]


def targets_for(counts: list[int], parts: list[str]) -> list[Target]:
    """Issue 19's CPU targets (and a few ratios shown for context, limit None) for the parts run."""
    out: list[Target] = []
    if "tensors" in parts:
        for n in counts:
            p = f"tensors.{n}"
            out += [
                Target(f"save, {n:,} tensors: µs per tensor (stall_s / n)", f"{p}.ckptd.stall", None, 20.0),
                Target(f"save, {n:,} tensors: ckptd stall / DCP staged", f"{p}.ckptd.stall", f"{p}.dcp.staged", 0.5),
                Target(f"load from memory, {n:,} tensors: µs per tensor", f"{p}.ckptd.load", None, 50.0),
                Target(f"save, {n:,} tensors: DCP staged, µs per tensor", f"{p}.dcp.staged", None, None),
            ]
    if "state" in parts:
        out += [
            Target("state: ckptd stall / memcpy floor", "state.ckptd.stall", "state.floor.memcpy", 1.25),
            Target("state: ckptd stall / DCP staged", "state.ckptd.stall", "state.dcp.staged", 0.9),
            Target("state: ckptd durable / DCP total", "state.ckptd.durable", "state.dcp.total", 1.0),
            Target("state: ckptd durable / write+fsync floor", "state.ckptd.durable", "state.floor.write_fsync", 1.3),
            Target("state: DCP staged / memcpy floor", "state.dcp.staged", "state.floor.memcpy", None),
        ]
    if "busy" in parts:
        out += [
            Target("busy: ckptd stall / DCP staged", "busy.ckptd.stall", "busy.dcp.staged", 1.0),
            Target("busy: ckptd stall / memcpy floor", "busy.ckptd.stall", "busy.floor.memcpy", None),
            Target("busy: ckptd durable / DCP total", "busy.ckptd.durable", "busy.dcp.total", None),
        ]
    return out


# ------------------------------------------------------------------ DCP


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at `path` (appending) for the duration: child processes started
    meanwhile keep writing there. Our own stderr goes there too until the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


class DcpSession:
    """DCP's fastest CPU set-up, shared by every state of the run: a gloo group of world size 1,
    one DefaultStager (shared memory, async staging; it keeps one staging copy per tensor storage,
    so several states can share it), and the PROCESS executor's checkpoint process (spawned by
    the first save)."""

    def __init__(self, workdir: Path) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.workdir = workdir
        self.log_path = workdir / "dcp-process.log"
        self.saves = 0
        # The PROCESS executor's child builds its own gloo group at MASTER_ADDR (else the host's FQDN).
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{bs.free_port()}", rank=0, world_size=1)
        self.stager = DefaultStager(
            StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False)
        )

    def save(self, state: State) -> tuple[float, float, float]:
        """One async_save of `state` to a new directory (removed afterwards); seconds until
        (async_save returned, staging_completion done, upload_completion done = durable)."""
        from torch.distributed.checkpoint import _async_process_executor as executor

        path = self.workdir / f"dcp-{self.saves}"
        self.saves += 1
        os.sync()
        gc.collect()
        QUIET.settle()
        try:
            if getattr(executor, "_CHECKPOINT_PROCESS", None) is None:
                with stderr_to(self.log_path):  # this save spawns DCP's process, which logs at INFO to stderr
                    return bs.dcp_save_once(state, path, self.stager)
            return bs.dcp_save_once(state, path, self.stager)
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @staticmethod
    def child_pid() -> int | None:
        """The pid of DCP's checkpoint process, None before the first save."""
        from torch.distributed.checkpoint import _async_process_executor as executor

        process = getattr(getattr(executor, "_CHECKPOINT_PROCESS", None), "_save_process", None)
        return None if process is None else process.pid

    def close(self) -> None:
        """Free the staging memory, end DCP's checkpoint process (killed if it does not go), leave the group."""
        import torch.distributed as dist
        from torch.distributed.checkpoint import _async_process_executor as executor

        try:
            self.stager.close()
            holder = getattr(executor, "_CHECKPOINT_PROCESS", None)
            child = getattr(holder, "_save_process", None)
            try:
                bs.stop_dcp_process()
            except OSError:  # the process is gone already (e.g. Ctrl-C reached it): the pipe is broken
                pass
            finally:
                if child is not None:
                    child.join(timeout=10)
                    if child.is_alive():
                        child.kill()
                        child.join(timeout=10)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()


# ------------------------------------------------------------------ ckptd


def client_for(address: str, job: str) -> Any:
    from ckptd.client import CheckpointClient

    return CheckpointClient(job=job, address=address, rank=0, world_size=1, on_error="raise")


def ckptd_save(client: Any, step: int, state: State) -> tuple[float, float, float]:
    """One save waited until durable; seconds of (handle.stall_s, wall time of save(), save()
    until wait_durable() returned). Raises RuntimeError when the save failed or was skipped."""
    os.sync()
    gc.collect()
    QUIET.settle()
    start = time.perf_counter()
    handle = client.save(step, state)
    wall = time.perf_counter() - start
    if not handle.ok:
        raise RuntimeError(f"ckptd save of step {step} failed: {handle.error}")
    handle.wait_durable()
    durable = time.perf_counter() - start
    return handle.stall_s, wall, durable


def in_memory(client: Any) -> bool:
    """Whether the daemon says it still holds the client's newest step in its arenas."""
    infos = client.list()
    return bool(infos and infos[-1].in_memory)


# ------------------------------------------------------------------ part: tensors


@dataclass
class SmallCase:
    """A state of n small tensors, saved as its own job by its own client.

    dst: views into one reused flat buffer, one per tensor (the floor's destination);
    reference: the saved values, flat, to check every load against.
    """

    n: int
    job: str
    state: State
    client: Any
    dst: list[torch.Tensor]
    reference: torch.Tensor
    step: int = 0

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self.state["model"].values())

    def train_step(self) -> None:
        """Change every value, as an optimizer step would, and remember the new values."""
        with torch.no_grad():
            for t in self.tensors:
                t.add_(1.0)
        self.reference = torch.cat([t.view(-1) for t in self.tensors])


def small_state(n: int, seed: int) -> State:
    """{"model": {"blocks.<i>.weight": 256 random fp32}} with n tensors."""
    gen = torch.Generator().manual_seed(seed)
    return {"model": {f"blocks.{i}.weight": torch.randn(ELEMENTS, generator=gen) for i in range(n)}}


def floor_loop(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> float:
    """Seconds of one Python loop of `copy_` of each tensor into its view of the flat buffer."""
    gc.collect()
    QUIET.settle()
    start = time.perf_counter()
    for d, s in zip(dsts, srcs):
        d.copy_(s)
    return time.perf_counter() - start


def timed_small_load(case: SmallCase) -> float:
    """Zero the tensors, then seconds of `load` by the saving client into them; checks every value."""
    for t in case.tensors:
        t.zero_()
    gc.collect()
    QUIET.settle()
    start = time.perf_counter()
    step = case.client.load(case.state)
    seconds = time.perf_counter() - start
    if step != case.step:
        raise RuntimeError(f"{case.job}: load returned step {step}, expected {case.step}")
    if not torch.equal(torch.cat([t.view(-1) for t in case.tensors]), case.reference):
        raise RuntimeError(f"{case.job}: the loaded values differ from the saved ones")
    return seconds


def small_warmup(case: SmallCase, dcp: DcpSession, warmup_saves: int) -> None:
    """Untimed: the floor loop once, `warmup_saves` ckptd saves, one load, DCP_WARMUP DCP saves."""
    floor_loop(case.tensors, case.dst)
    for _ in range(warmup_saves):
        case.step += 1
        ckptd_save(case.client, case.step, case.state)
    timed_small_load(case)
    for _ in range(DCP_WARMUP):
        dcp.save(case.state)


def small_round(case: SmallCase, dcp: DcpSession, run: Run, round_no: int) -> None:
    """Floor, ckptd save + load, DCP, back to back; records µs per tensor."""
    n, p = case.n, f"tensors.{case.n}"
    us = 1e6 / n
    case.train_step()
    run.add(f"{p}.floor", f"{n:,} tensors: floor, copy_ loop into one buffer", "µs/tensor", floor_loop(case.tensors, case.dst) * us)
    case.step += 1
    stall, wall, durable = ckptd_save(case.client, case.step, case.state)
    run.add(f"{p}.ckptd.stall", f"{n:,} tensors: ckptd save, stall_s", "µs/tensor", stall * us)
    run.add(f"{p}.ckptd.wall", f"{n:,} tensors: ckptd save, wall time of save()", "µs/tensor", wall * us)
    run.add(f"{p}.ckptd.durable", f"{n:,} tensors: ckptd save() to wait_durable", "µs/tensor", durable * us)
    if not in_memory(case.client):
        run.notes.append(f"{case.job}, round {round_no + 1}: the newest step was NOT in the daemon's memory at the load")
    run.add(f"{p}.ckptd.load", f"{n:,} tensors: ckptd load from memory (saving client)", "µs/tensor", timed_small_load(case) * us)
    blocked, staged, total = dcp.save(case.state)
    run.add(f"{p}.dcp.blocked", f"{n:,} tensors: DCP async_save, blocked", "µs/tensor", blocked * us)
    run.add(f"{p}.dcp.staged", f"{n:,} tensors: DCP async_save, staged", "µs/tensor", staged * us)
    run.add(f"{p}.dcp.total", f"{n:,} tensors: DCP async_save, total (durable)", "µs/tensor", total * us)


def part_tensors(counts: list[int], address: str, dcp: DcpSession, rounds: int, warmup_saves: int, run: Run,
                 stack: contextlib.ExitStack) -> None:
    """Warm-up of every count, then `rounds` rounds; each round runs every count in turn."""
    cases = []
    for i, n in enumerate(counts):
        state = small_state(n, seed=100 + i)
        tensors = list(state["model"].values())
        flat = torch.empty(n * ELEMENTS)
        job = f"handoff-n{n}"
        client = stack.enter_context(client_for(address, job))
        cases.append(SmallCase(n, job, state, client, list(flat.split(ELEMENTS)), torch.cat([t.view(-1) for t in tensors])))
    for case in cases:
        print(f"  warm-up, {case.n:,} tensors ({warmup_saves} ckptd saves, 1 load, {DCP_WARMUP} DCP saves) ...", flush=True)
        small_warmup(case, dcp, warmup_saves)
    for r in range(rounds):
        for case in cases:
            small_round(case, dcp, run, r)
        last = {c.n: {k: run.series[f"tensors.{c.n}.{k}"][-1] for k in ("ckptd.stall", "ckptd.load", "dcp.staged")} for c in cases}
        line = "  ".join(
            f"n={n}: ckptd {v['ckptd.stall']:.1f} / load {v['ckptd.load']:.1f} / DCP {v['dcp.staged']:.1f} µs" for n, v in last.items()
        )
        print(f"  round {r + 1}/{rounds}: {line}", flush=True)


# ------------------------------------------------------------------ parts: state and busy


@dataclass
class BigCase:
    """The ~1 GiB state, its client, and the floors' buffers: the state's bytes back to back (src)
    and a reused, faulted destination (dst)."""

    state: State
    client: Any
    src: torch.Tensor
    dst: torch.Tensor
    floor_file: Path
    nbytes: int
    ntensors: int
    shape: bs.Shape
    step: int = 0


def floor_memcpy(case: BigCase) -> float:
    """Seconds of one flat copy into the warm buffer: best of MEMCPY_TRIES numpy copyto (1 thread)
    and MEMCPY_TRIES torch copy_ (intra-op threads)."""
    src_np, dst_np = case.src.numpy(), case.dst.numpy()
    times = []
    gc.collect()
    QUIET.settle()
    for _ in range(MEMCPY_TRIES):
        start = time.perf_counter()
        np.copyto(dst_np, src_np)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        case.dst.copy_(case.src)
        times.append(time.perf_counter() - start)
    return min(times)


def floor_write_fsync(case: BigCase) -> float:
    """Seconds of writing the state's bytes to one new file (64 MiB os.write calls) and fsync;
    the file is deleted again, untimed."""
    case.floor_file.unlink(missing_ok=True)
    os.sync()
    QUIET.settle()
    start = time.perf_counter()
    bs.write_fsync(case.src.numpy(), case.floor_file)
    seconds = time.perf_counter() - start
    case.floor_file.unlink()
    return seconds


def big_warmup(case: BigCase, dcp: DcpSession, warmup_saves: int, run: Run) -> None:
    """Untimed (recorded for information): a memcpy, `warmup_saves` ckptd saves, DCP_WARMUP DCP saves."""
    case.dst.copy_(case.src)  # faults dst in
    for i in range(warmup_saves):
        case.step += 1
        stall, _, durable = ckptd_save(case.client, case.step, case.state)
        print(f"    ckptd warm-up save {i + 1}/{warmup_saves}: stall {stall:.3f} s, durable {durable:.3f} s", flush=True)
        run.add("warmup.ckptd.stall", "ckptd warm-up saves: stall", "s", stall)
        run.add("warmup.ckptd.durable", "ckptd warm-up saves: durable", "s", durable)
    for i in range(DCP_WARMUP):
        _, staged, total = dcp.save(case.state)
        print(f"    DCP warm-up save {i + 1}/{DCP_WARMUP}: staged {staged:.3f} s, total {total:.3f} s", flush=True)
        run.add("warmup.dcp.staged", "DCP warm-up saves: staged", "s", staged)
        run.add("warmup.dcp.total", "DCP warm-up saves: total", "s", total)


def big_round(case: BigCase, dcp: DcpSession, run: Run, prefix: str, write_floor: bool) -> None:
    """Floors, ckptd, DCP, back to back; records seconds under `prefix` ("state" or "busy").
    write_floor: also time the write + fsync floor."""
    tag = "busy: " if prefix == "busy" else ""
    with torch.no_grad():  # untimed: change every value, as an optimizer step would
        for t in bs.tensors(case.state):
            t.add_(1e-6)
    run.add(f"{prefix}.floor.memcpy", f"{tag}floor: memcpy into a warm buffer (best of numpy, torch)", "s", floor_memcpy(case))
    if write_floor:
        run.add(f"{prefix}.floor.write_fsync", f"{tag}floor: write + fsync, one new file", "s", floor_write_fsync(case))
    case.step += 1
    stall, wall, durable = ckptd_save(case.client, case.step, case.state)
    run.add(f"{prefix}.ckptd.stall", f"{tag}ckptd save: stall (handle.stall_s)", "s", stall)
    run.add(f"{prefix}.ckptd.wall", f"{tag}ckptd save: wall time of save()", "s", wall)
    run.add(f"{prefix}.ckptd.durable", f"{tag}ckptd save: durable (save() to wait_durable)", "s", durable)
    blocked, staged, total = dcp.save(case.state)
    run.add(f"{prefix}.dcp.blocked", f"{tag}DCP async_save: blocked", "s", blocked)
    run.add(f"{prefix}.dcp.staged", f"{tag}DCP async_save: staged", "s", staged)
    run.add(f"{prefix}.dcp.total", f"{tag}DCP async_save: total (durable)", "s", total)


def big_rounds(case: BigCase, dcp: DcpSession, run: Run, prefix: str, rounds: int, write_floor: bool = True) -> None:
    """`rounds` rounds of big_round, one progress line each."""
    for r in range(rounds):
        big_round(case, dcp, run, prefix, write_floor)
        keys = ("floor.memcpy", "floor.write_fsync", "ckptd.stall", "ckptd.durable", "dcp.staged", "dcp.total")
        s = {k: run.series[f"{prefix}.{k}"][-1] for k in keys if f"{prefix}.{k}" in run.series}
        write = f"  write+fsync {s['floor.write_fsync']:.3f}" if write_floor else ""
        print(
            f"  round {r + 1}/{rounds}: memcpy {s['floor.memcpy']:.3f}{write}  "
            f"ckptd stall {s['ckptd.stall']:.3f} durable {s['ckptd.durable']:.3f}  "
            f"DCP staged {s['dcp.staged']:.3f} total {s['dcp.total']:.3f} s   load {bs.load_average()}",
            flush=True,
        )


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process (all its threads) has used so far (from /proc/<pid>/stat); 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def total_cpu(pids: list[int]) -> float:
    """CPU seconds used so far by the processes `pids` together."""
    return sum(cpu_seconds(p) for p in pids)


@contextlib.contextmanager
def busy_processes(count: int, run: Run) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` processes, each a tight numpy loop at nice 0, killed (and waited for) on exit;
    notes how much CPU each got while it ran."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())]))
        time.sleep(BUSY_SETTLE_S)
        start = time.perf_counter()
        cpu0 = [cpu_seconds(p.pid) for p in procs]
        nice = sorted({os.getpriority(os.PRIO_PROCESS, p.pid) for p in procs})
        yield procs
        wall = time.perf_counter() - start
        share = [(cpu_seconds(p.pid) - c) / wall for p, c in zip(procs, cpu0)]
        got = ", ".join(f"{s:.0%}" for s in share)
        run.notes.append(f"busy: {count} processes at nice {','.join(map(str, nice))} got {got} of a core each during the busy rounds")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


# ------------------------------------------------------------------ report


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt(x: float, unit: str) -> str:
    return f"{x:.3f}" if unit == "s" else f"{x:.2f}" if unit == "" else f"{x:.1f}"


def format_table(run: Run) -> list[str]:
    lines = [f"{'measurement':<60} {'unit':>9} {'median':>8}  [min - max]"]
    for key, values in run.series.items():
        unit = run.units[key]
        med, lo, hi = spread(values)
        lines.append(f"{run.labels[key]:<60} {unit:>9} {fmt(med, unit):>8}  [{fmt(lo, unit)} - {fmt(hi, unit)}]  n={len(values)}")
    return lines


@dataclass(frozen=True)
class Verdict:
    target: Target
    values: list[float]

    @property
    def passed(self) -> bool | None:
        if not self.values or self.target.limit is None:
            return None
        return statistics.median(self.values) <= self.target.limit


def format_verdicts(verdicts: list[Verdict]) -> list[str]:
    lines = []
    for v in verdicts:
        t = v.target
        unit = "µs" if t.den is None else "x"
        limit = "(no target)" if t.limit is None else f"target <= {t.limit:g}{'' if unit == 'x' else ' µs'}"
        if not v.values:
            lines.append(f"{t.label:<52} n/a (not measured: part not run or failed)  {limit}")
            continue
        med, lo, hi = spread(v.values)
        digits = 2 if unit == "x" else 1
        rounds = " ".join(f"{x:.{digits}f}" for x in v.values)
        flag = "" if v.passed is None else ("PASS" if v.passed else "FAIL")
        lines.append(f"{t.label:<52} {med:7.{digits}f} [{lo:.{digits}f} - {hi:.{digits}f}]  {limit:<16} {flag:<4}  rounds: {rounds}")
    return lines


def wall_notes(run: Run) -> list[str]:
    """Where save() kept the caller noticeably (> 10%) longer than handle.stall_s says: stall_s
    ends before the client's CommitSnapshot call, the wall time includes it."""
    notes = []
    for key, stall in run.series.items():
        if not key.endswith(".ckptd.stall") or key.replace(".stall", ".wall") not in run.series:
            continue
        wall = statistics.median(run.series[key.replace(".stall", ".wall")])
        if wall > 1.1 * statistics.median(stall):
            unit = run.units[key]
            notes.append(
                f"{key.removesuffix('.ckptd.stall')}: save() returned after {fmt(wall, unit)} {unit} (median), "
                f"{wall / statistics.median(stall):.2f}x stall_s ({fmt(statistics.median(stall), unit)}): the targets use stall_s"
            )
    return notes


def quiet_notes() -> list[str]:
    """How long the timed segments waited for the daemon and DCP's process to be idle."""
    if not QUIET.waits:
        return []
    waits = sorted(QUIET.waits)
    text = (f"before each of {len(waits)} timed segments the daemon and DCP's process were let go idle first: "
            f"waited median {statistics.median(waits) * 1e3:.0f} ms, max {waits[-1] * 1e3:.0f} ms")
    if QUIET.capped:
        text += f"; {QUIET.capped} times they were still busy after {QUIET.max_s:.0f} s and the segment started anyway"
    return [text]


def print_results(run: Run, verdicts: list[Verdict]) -> None:
    """Print the table of every measurement, the targets, the notes, the errors and the summary line."""
    print("\n".join(format_table(run)))
    print()
    print("targets: median of the per-round ratios [min - max]:")
    print("\n".join(format_verdicts(verdicts)))
    for note in run.notes + quiet_notes():
        print(f"note: {note}")
    for part, error in run.errors.items():
        print(f"ERROR in {part}: {error}")
    print(summary_line(verdicts, run.errors))


def summary_line(verdicts: list[Verdict], errors: dict[str, str]) -> str:
    judged = [v for v in verdicts if v.target.limit is not None]
    passed = [v for v in judged if v.passed]
    failed = [v.target.label for v in judged if v.passed is False]
    missing = [v.target.label for v in judged if v.passed is None]
    text = f"summary: {len(passed)} of {len(judged)} targets PASS"
    if failed:
        text += f"; FAIL: {'; '.join(failed)}"
    if missing:
        text += f"; not measured: {'; '.join(missing)}"
    if errors:
        text += f"; errors in: {', '.join(errors)}"
    return text


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts, of {','.join(PARTS)} (default: all)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per part (default: 5; --quick: 2)")
    p.add_argument("--tensors", default=None, help="tensor counts of the tensors part (default: 1000,4000; --quick: 200,400)")
    p.add_argument("--size-gib", type=float, default=None, help="size of the state of the state and busy parts, GiB (default: 1; --quick: 1/16)")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy processes in the busy part (default: one per core, os.cpu_count())")
    p.add_argument("--warmup-saves", type=int, default=bs.WARMUP_SAVES,
                   help=f"untimed ckptd saves per state before the rounds (default: {bs.WARMUP_SAVES})")
    p.add_argument("--quick", action="store_true", help="a small smoke run: 200,400 tensors, 64 MiB, 2 rounds")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on the disk under test, not a tmpfs (default: ./bench-out)")
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for ckptd's arenas (default: /dev/shm)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (checkpoints, daemon log)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every number (per round) to FILE")
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown part(s) {', '.join(unknown)}; use some of {', '.join(PARTS)}")
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.size_gib is None:
        args.size_gib = 1 / 16 if args.quick else 1.0
    try:
        args.counts = [int(s) for s in (args.tensors or ("200,400" if args.quick else "1000,4000")).split(",") if s.strip()]
    except ValueError:
        p.error("--tensors: comma-separated integers, e.g. 1000,4000")
    if args.rounds < 1 or args.size_gib <= 0 or args.busy < 1 or args.warmup_saves < 0 or not args.counts or min(args.counts) < 1:
        p.error("--rounds, --busy, tensor counts must be >= 1, --size-gib > 0, --warmup-saves >= 0")
    return args


SIGNALLED: list[str] = []  # signals received: a part that fails after one was interrupted, not broken


def _interrupt(signum: int, frame: Any) -> None:
    SIGNALLED.append(signal.Signals(signum).name)
    raise KeyboardInterrupt(SIGNALLED[-1])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run_part(name: str, run: Run, body: Any) -> None:
    """Run one part; a failure is recorded and printed, and the other parts still run."""
    from torch.distributed.checkpoint.api import CheckpointException

    print(f"part {name} (load average {bs.load_average()}) ...", flush=True)
    run.loadavg[f"{name} start"] = bs.load_average()
    start = time.perf_counter()
    try:
        body()
    except (Exception, CheckpointException) as exc:  # CheckpointException derives from BaseException
        if SIGNALLED:  # Ctrl-C also reaches the daemon and DCP's process: what failed then is the interruption
            raise KeyboardInterrupt(SIGNALLED[-1]) from exc
        run.errors[name] = f"{type(exc).__name__}: {exc}"
        print(f"  {name} FAILED: {run.errors[name]}", flush=True)
    run.loadavg[f"{name} end"] = bs.load_average()
    print(f"  {name} took {time.perf_counter() - start:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(["bench_handoff.py", *argv])
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    made_out = not args.out.exists()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="handoff-", dir=args.out.resolve()))
    run = Run()
    started = time.perf_counter()
    machine = bs.machine_info(workdir)
    header = [
        "ckptd hand-off benchmark, issue 19 CPU targets (tests/bench/bench_handoff.py)",
        f"command: {command}",
        f"machine: {cpu_model()}, {machine['cores']} cores ({machine['usable_cores']} usable), {machine['ram_gib']} GiB RAM, {machine['kernel']}",
        f"software: Python {machine['python']}, torch {machine['torch']} ({machine['torch_threads']} threads), numpy {machine['numpy']}",
        f"scratch: {workdir} ({machine['out_fs']})   arenas in: {args.shm_dir} ({bs.fs_type(args.shm_dir)})",
        f"parts: {','.join(args.parts)}   rounds: {args.rounds}   warm-up: {args.warmup_saves} ckptd + {DCP_WARMUP} DCP saves per state",
    ]
    run.loadavg["start"] = bs.load_average()
    print("\n".join(header), flush=True)
    print(f"load average at start: {run.loadavg['start']}", flush=True)
    if machine["out_fs"] in ("tmpfs", "ramfs"):
        print("warning: --out is in memory, not on a disk: durable and write+fsync are not disk figures", flush=True)

    big_desc = ""
    interrupted = False
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(gc.collect)
            rig = bs.DaemonRig(root=workdir / "ckptd-root", logs=workdir, shm_parent=args.shm_dir)
            stack.callback(rig.close)
            rig.start()
            dcp = DcpSession(workdir)
            stack.callback(dcp.close)
            QUIET.pids = lambda: [rig.daemon.pid if rig.daemon is not None else 0, dcp.child_pid() or 0]

            if "tensors" in args.parts:
                desc = ", ".join(f"{n:,}" for n in args.counts)
                print(f"tensors part: states of {desc} fp32 tensors of {ELEMENTS} elements", flush=True)
                run_part("tensors", run,
                         lambda: part_tensors(args.counts, rig.address, dcp, args.rounds, args.warmup_saves, run, stack))

            big: BigCase | None = None
            if "state" in args.parts or "busy" in args.parts:
                shape = bs.shape_for(int(args.size_gib * bs.GIB))
                state = bs.make_state(shape)
                src = bs.flat_copy(state)
                client = stack.enter_context(client_for(rig.address, "handoff-state"))
                big = BigCase(state, client, src, torch.empty_like(src), workdir / "floor.bin", bs.state_bytes(state),
                              sum(1 for _ in bs.tensors(state)), shape)
                big_desc = (f"state: {big.ntensors} fp32 tensors, {big.nbytes:,} bytes ({big.nbytes / bs.GIB:.2f} GiB): weights + AdamW "
                            f"exp_avg, exp_avg_sq of a {shape.layers}-layer transformer, hidden {shape.hidden}, vocab {shape.vocab}")
                print(big_desc, flush=True)
                print("  warm-up ...", flush=True)
                run_part("warm-up", run, lambda: big_warmup(big, dcp, args.warmup_saves, run))
            if big is not None and "warm-up" not in run.errors:
                if "state" in args.parts:
                    run_part("state", run, lambda: big_rounds(big, dcp, run, "state", args.rounds))
                if "busy" in args.parts:
                    def busy() -> None:
                        with busy_processes(args.busy, run):
                            print(f"  {args.busy} busy processes running (load average {bs.load_average()})", flush=True)
                            big_rounds(big, dcp, run, "busy", args.rounds, write_floor=False)  # no busy target needs it
                    run_part("busy", run, busy)
            if run.errors:
                daemon_log = rig.daemon.log_text() if rig.daemon is not None else ""
                for what, log in (("daemon", daemon_log), ("DCP process", dcp.log_text())):
                    if log:
                        print(f"{what} log (last 3000 characters):\n{log[-3000:]}", flush=True)
    except Exception as exc:  # setting up: the daemon or DCP's group did not start
        if SIGNALLED:
            interrupted = True
        else:
            run.errors["setup"] = f"{type(exc).__name__}: {exc}"
            print(f"setup FAILED: {run.errors['setup']}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if args.keep:
            run.notes.append(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            if made_out:
                with contextlib.suppress(OSError):
                    args.out.rmdir()  # only if empty
    if interrupted or SIGNALLED:
        print(f"interrupted ({', '.join(SIGNALLED) or 'SIGINT'}): the daemon, DCP's process and the busy processes are stopped, "
              "the scratch directory removed", flush=True)
        return 130

    run.loadavg["end"] = bs.load_average()
    verdicts = [Verdict(t, t.per_round(run)) for t in targets_for(args.counts, args.parts)]
    print()
    print("\n".join(header))
    if big_desc:
        print(big_desc)
    print(f"load average at start: {run.loadavg['start']}   at end: {run.loadavg['end']}   (other work on the machine skews the figures)")
    print(f"run took {time.perf_counter() - started:.0f} s")
    print("units: s = seconds; µs/tensor = seconds * 1e6 / tensors; each row: median [min - max] of the rounds")
    print()
    print("\n".join(format_table(run)))
    print()
    print("targets: median of the per-round values (ratios taken within each round) [min - max]:")
    print("\n".join(format_verdicts(verdicts)))
    for note in run.notes + wall_notes(run) + quiet_notes():
        print(f"note: {note}")
    for part, error in run.errors.items():
        print(f"ERROR in {part}: {error}")
    print(summary_line(verdicts, run.errors))
    if args.json is not None:
        doc = {
            "command": command,
            "machine": machine | {"cpu": cpu_model()},
            "args": {"parts": args.parts, "rounds": args.rounds, "tensors": args.counts, "size_gib": args.size_gib,
                     "busy": args.busy, "warmup_saves": args.warmup_saves, "quick": args.quick},
            "state": big_desc,
            "loadavg": run.loadavg,
            "series": {k: {"label": run.labels[k], "unit": run.units[k], "per_round": v} for k, v in run.series.items()},
            "targets": [
                {"target": v.target.label, "num": v.target.num, "den": v.target.den, "limit": v.target.limit,
                 "per_round": v.values, "median": statistics.median(v.values) if v.values else None, "passed": v.passed}
                for v in verdicts
            ],
            "notes": run.notes + wall_notes(run) + quiet_notes(),
            "idle_waits_s": QUIET.waits,
            "errors": run.errors,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
