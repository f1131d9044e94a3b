"""Host cost per tensor of `save()` in every hand-off mode (issue 33, item 2), against a real daemon.

For each tensor count (default 1,000 and 4,000 fp32 tensors of 256 elements) and each mode, one
client saves a state of that many tensors, round after round, the modes and counts interleaved
within each round (so load on the machine falls on all of them alike):

- shm: CPU tensors, the shared-memory copy;
- copy, overlap, ipc: "CUDA" tensors under the strict CUDA stand-in (tests/fakecuda.py,
  installed for the run with pytest.MonkeyPatch.context()). Each tensor is its own storage, as
  the caching allocator gives them. For ipc the daemon is started with the stand-in's shared
  device memory (tests/fake_gpu_daemon.py), so it opens the staging buffer and drains it
  as on a GPU, instead of refusing it (a refusal would fall back to overlap).

Before each save the daemon is let go idle (its commit of the previous save done). Per save, in
µs per tensor (/ n):

- stand-in: every call into the stand-in on the saving thread (copies, foreach copies, stream
  and event operations) is timed, wall and thread CPU time. Its costs are not CUDA's: on a GPU
  each is one launch of a few µs, never one per tensor (a foreach pack is one multi-tensor
  launch), so `ops/save` (those calls per save) is shown instead, and their time is taken out;
- host CPU (the figure judged): the saving thread's CPU time in save() minus the stand-in's
  CPU time on it: ckptd's own host work, which does not move with the machine's load;
- host wall: (handle.stall_s - the stand-in's wall time): what the trainer waited for ckptd,
  daemon round trips and waiting for a core included (on a busy 2-core machine, inflated);
- stall (handle.stall_s) and process CPU (all threads, the stand-in's included), shown;
- registrations (cudaHostRegister calls during the timed saves) and the KiB of the daemon's
  arenas that this process has mapped but not yet faulted in, before each save (from
  /proc/self/smaps): both 0 once every arena of the daemon's set was used once (the warm-up),
  so no save page-faults an arena; and the saving thread's minor page faults outside the
  stand-in (shown: Python's heap, e.g. the extras' JSON text).

Targets (median over rounds): host CPU <= 10 µs per tensor in every mode at every count; no
registration and no page fault on the save path; ipc stall / overlap stall <= 1 (within each
round). Prints every figure with its target and PASS/FAIL and exits 0 either way (1 when the run
itself failed).

    python tests/bench/bench_save_modes.py [--tensors 1000,4000] [--rounds 7] [--modes shm,copy,overlap,ipc]
    python tests/bench/bench_save_modes.py --profile overlap --tensors 4000   # cProfile of the timed saves of one mode
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: fakecuda
sys.path.insert(0, str(HERE))  # tests/bench: bench_handoff
import fakecuda  # noqa: E402
import fake_gpu_daemon  # noqa: E402
from bench_handoff import Quiet  # noqa: E402

MODES = ("shm", "copy", "overlap", "ipc")
ELEMENTS = 256
HOST_TARGET_US = 10.0
IPC_OVER_OVERLAP = 1.0


class StandInClock:
    """Time spent inside the stand-in's calls, on the thread that is measured (the saving one):
    wall seconds and that thread's CPU seconds."""

    def __init__(self) -> None:
        self.thread: int | None = None
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.faults = 0
        self.calls = 0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start, cpu, faults = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.cpu_seconds += time.thread_time() - cpu
                self.faults += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
                self.calls += 1
                self._depth -= 1

        return timed

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        self.thread, self.seconds, self.cpu_seconds, self.faults, self.calls = threading.get_ident(), 0.0, 0.0, 0, 0
        try:
            yield
        finally:
            self.thread = None


def install(mp: pytest.MonkeyPatch, cuda: fakecuda.FakeCuda, clock: StandInClock) -> None:
    """The stand-in in place of torch.cuda, with its entry points timed by `clock`."""
    for name in ("copy", "foreach_copy", "new_stream", "new_event", "current_stream", "synchronize", "as_tensor"):
        setattr(cuda, name, clock.wrap(getattr(cuda, name)))
    cuda.install(mp)
    for cls, names in ((fakecuda.FakeStream, ("wait_event", "wait_stream", "synchronize", "query")),
                       (fakecuda.FakeEvent, ("record", "synchronize", "query", "wait"))):
        for name in names:
            mp.setattr(cls, name, clock.wrap(getattr(cls, name)))
    use_stream = cuda.use_stream

    @contextlib.contextmanager
    def timed_use(stream: Any) -> Iterator[None]:
        enter = clock.wrap(lambda: None)
        enter()
        with use_stream(stream):
            yield

    mp.setattr(torch.cuda, "stream", timed_use)


@dataclass
class Case:
    """One client of one mode saving a state of n tensors as its own job."""

    mode: str
    n: int
    client: Any
    state: dict[str, Any]
    step: int = 0
    series: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.series.setdefault(key, []).append(value)


def cpu_state(n: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {f"blocks.{i}.weight": torch.randn(ELEMENTS, generator=gen) for i in range(n)}}


def device_state(cuda: fakecuda.FakeCuda, n: int, seed: int, keep: list[Any]) -> dict[str, Any]:
    """n tensors of "device" memory, each its own storage (as the caching allocator hands out
    blocks of one segment): views made by frombuffer of one marked buffer."""
    block = ELEMENTS * 4
    memory = np.random.default_rng(seed).standard_normal(n * ELEMENTS).astype(np.float32).view(np.uint8)
    keep.append(memory)
    cuda.to_device(torch.from_numpy(memory))
    return {"model": {f"blocks.{i}.weight": torch.frombuffer(memory[i * block : (i + 1) * block], dtype=torch.float32) for i in range(n)}}


def train_step(case: Case) -> None:
    with torch.no_grad():
        for t in case.state["model"].values():
            t.add_(1.0)


def unmapped_arena_kib(shm_dir: Path) -> int:
    """KiB of this process's mappings of files under `shm_dir` (the daemon's arenas) that are not
    in its page tables: what a copy into them would fault in (from /proc/self/smaps)."""
    missing, inside = 0, False
    prefix = str(shm_dir)
    size = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[5].startswith(prefix)
        elif inside and fields[0] == "Size:":
            size = int(fields[1])
        elif inside and fields[0] == "Rss:":
            missing += size - int(fields[1])
    return missing


def timed_save(case: Case, clock: StandInClock, cuda: fakecuda.FakeCuda, profile: cProfile.Profile | None, quiet: Quiet, shm_dir: Path) -> None:
    train_step(case)
    gc.collect()
    quiet.settle()
    case.add("unmapped_kib", unmapped_arena_kib(shm_dir))
    case.step += 1
    registered = len(cuda.lib.register_calls)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    cpu, thread_cpu = time.process_time(), time.thread_time()
    with clock.measuring():
        if profile is not None:
            profile.enable()
        handle = case.client.save(case.step, case.state)
        if profile is not None:
            profile.disable()
    cpu, thread_cpu = time.process_time() - cpu, time.thread_time() - thread_cpu
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
    if not handle.ok:
        raise RuntimeError(f"{case.mode}, {case.n} tensors: save {case.step} failed: {handle.error}")
    expected = "cpu" if case.mode == "shm" else case.mode
    if handle.mode != expected:
        raise RuntimeError(f"{case.mode}: the save ran in mode {handle.mode!r} ({case.client.mode_reason})")
    us = 1e6 / case.n
    case.add("stall", handle.stall_s * us)
    case.add("host", (handle.stall_s - clock.seconds) * us)
    case.add("cpu", cpu * us)
    case.add("thread_cpu", (thread_cpu - clock.cpu_seconds) * us)
    case.add("standin", clock.seconds * us)
    case.add("ops", clock.calls)
    case.add("thread_faults", faults - clock.faults)
    case.add("standin_faults", clock.faults)
    handle.wait_durable(timeout=120)
    case.add("registrations", len(cuda.lib.register_calls) - registered)


def check_restore(case: Case, address: str) -> None:
    """The last save restores bit-exact (read back by a CPU client into CPU tensors)."""
    from ckptd.client import CheckpointClient

    target = {"model": {k: torch.zeros_like(v) for k, v in case.state["model"].items()}}
    with CheckpointClient(f"modes-{case.mode}-{case.n}", address=address, rank=0, world_size=1, on_error="raise") as reader:
        reader.load(target, step=case.step)
    for k, v in case.state["model"].items():
        if not torch.equal(target["model"][k], v.clone()):
            raise RuntimeError(f"{case.mode}, {case.n} tensors: {k} restored with other values")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(cases: list[Case], counts: list[int], loads: list[str]) -> int:
    """Print the table and the verdicts; returns how many targets failed."""
    failed = 0
    print(f"\n{'mode':<8} {'tensors':>7} {'host CPU':>9} {'host wall':>10} {'stall':>8} {'stand-in':>9} {'process CPU':>12} "
          f"{'ops/save':>9} {'heap faults':>12} {'registrations':>14}   (µs per tensor, medians)")
    for case in cases:
        s = case.series
        print(f"{case.mode:<8} {case.n:>7,} {median(s['thread_cpu']):>9.2f} {median(s['host']):>10.2f} {median(s['stall']):>8.2f} "
              f"{median(s['standin']):>9.2f} {median(s['cpu']):>12.2f} {median(s['ops']):>9.0f} {median(s['thread_faults']):>12.0f} "
              f"{int(sum(s['registrations'])):>14}")
    print()
    for case in cases:
        s = case.series
        for key, what in (("thread_cpu", "host CPU"), ("host", "host wall")):
            value = median(s[key])
            ok = value <= HOST_TARGET_US
            judged = key == "thread_cpu"
            failed += judged and not ok
            verdict = ("PASS" if ok else "FAIL") if judged else ("(shown)" if ok else "(shown, over)")
            print(f"{case.mode} save, {case.n:,} tensors, {what} µs per tensor: {value:.2f}  target <= {HOST_TARGET_US:g} {verdict}   "
                  f"rounds: {' '.join(f'{x:.1f}' for x in s[key])}")
        clean = not sum(s["registrations"]) and not max(s["unmapped_kib"])
        failed += not clean
        print(f"{case.mode} save, {case.n:,} tensors: cudaHostRegister calls {int(sum(s['registrations']))}, arena KiB not yet mapped "
              f"before a save {max(s['unmapped_kib'])}  target 0 {'PASS' if clean else 'FAIL'}")
    by = {(c.mode, c.n): c for c in cases}
    for n in counts:
        ipc, overlap = by.get(("ipc", n)), by.get(("overlap", n))
        if ipc is None or overlap is None:
            continue
        ratios = [a / b for a, b in zip(ipc.series["stall"], overlap.series["stall"]) if b > 0]
        ok = median(ratios) <= IPC_OVER_OVERLAP
        failed += not ok
        print(f"ipc stall / overlap stall, {n:,} tensors (within each round): {median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}]  "
              f"target <= {IPC_OVER_OVERLAP:g} {'PASS' if ok else 'FAIL'}")
    print(f"load average (start | end): {' | '.join(loads)}")
    print(f"summary: {'every target PASS' if not failed else f'{failed} target(s) FAIL'}")
    return failed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="1000,4000", help="comma-separated tensor counts (default 1000,4000)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup-saves", type=int, default=3, help="untimed saves per client first (every arena of the set mapped and registered)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="also write every series, per round, to FILE (tests/bench/pair_commits.py reads it)")
    p.add_argument("--profile", default=None, metavar="MODE", help="cProfile the timed saves of MODE and print the top functions")
    args = p.parse_args(argv)
    args.counts = [int(x) for x in args.tensors.split(",") if x.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.modes) - set(MODES) or not args.counts or args.rounds < 1:
        p.error(f"--modes: some of {','.join(MODES)}; --tensors and --rounds positive")
    return args


def start_daemon(workdir: Path, device_dir: Path) -> Any:
    """A real daemon whose CUDA runtime is the stand-in's shared device memory (for mode ipc)."""
    return fake_gpu_daemon.start(workdir / "root", workdir / "d.sock", workdir / "shm", device_dir, workdir / "daemon.log")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ckptd.client import CheckpointClient

    workdir = Path(tempfile.mkdtemp(prefix="bench-modes-", dir="/dev/shm"))
    device_dir = workdir / "device"
    device_dir.mkdir()
    loads = [" ".join(f"{x:.2f}" for x in os.getloadavg())]
    print(f"bench_save_modes: modes {','.join(args.modes)}, tensors {','.join(map(str, args.counts))}, {args.rounds} rounds, "
          f"{os.cpu_count()} cores, load average {loads[0]}", flush=True)
    clock = StandInClock()
    cuda = fakecuda.FakeCuda(lib=fakecuda.SharedDeviceLib(str(device_dir)))
    keep: list[Any] = []
    profile = cProfile.Profile() if args.profile else None
    daemon = None
    try:
        daemon = start_daemon(workdir, device_dir)
        quiet = Quiet(pids=lambda: [daemon.popen.pid])  # each save starts with the daemon idle (its commit of the last one done)
        with pytest.MonkeyPatch.context() as mp, contextlib.ExitStack() as stack:
            install(mp, cuda, clock)
            cases = []
            for n in args.counts:
                for mode in args.modes:
                    state = cpu_state(n, n) if mode == "shm" else device_state(cuda, n, n, keep)
                    client = stack.enter_context(CheckpointClient(
                        f"modes-{mode}-{n}", address=daemon.address, rank=0, world_size=1, on_error="raise",
                        mode="overlap" if mode == "shm" else mode,
                    ))
                    cases.append(Case(mode, n, client, state))
            for case in cases:
                for _ in range(args.warmup_saves):
                    timed_save(case, clock, cuda, None, quiet, workdir / 'shm')
                case.series.clear()
            for r in range(args.rounds):
                for case in cases:
                    timed_save(case, clock, cuda, profile if case.mode == args.profile else None, quiet, workdir / 'shm')
                line = "  ".join(f"{c.mode}/{c.n}: {c.series['host'][-1]:.1f}" for c in cases)
                print(f"  round {r + 1}/{args.rounds} (host µs per tensor): {line}", flush=True)
            for case in cases:
                check_restore(case, daemon.address)
        loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
        report(cases, args.counts, loads)
        if args.json is not None:
            series = {f"{c.mode}.{c.n}.{key}": {"unit": "µs/tensor", "per_round": values}
                      for c in cases for key, values in c.series.items() if key in ("thread_cpu", "host", "stall")}
            args.json.write_text(json.dumps({"series": series, "loadavg": loads}, indent=1))
        print("every mode's last save restored bit-exact")
        if profile is not None:
            print(f"\ncProfile of the timed saves of mode {args.profile} (cumulative):")
            pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
            pstats.Stats(profile).sort_stats("cumulative").print_stats("ckptd/(client|common|wire)", 45)
        return 0
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
