"""Host cost per tensor of `save()` in every hand-off mode (issue 33, item 2), against a real daemon.

For each tensor count (default 1,000 and 4,000 fp32 tensors of 256 elements) and each mode, one
client saves a state of that many tensors, round after round, the modes and counts interleaved
within each round (so load on the machine falls on all of them alike):

- shm: CPU tensors, the shared-memory copy;
- copy, overlap, ipc: "CUDA" tensors under the strict CUDA stand-in (tests/fakecuda.py,
  installed for the run with pytest.MonkeyPatch.context()). Each tensor is its own storage, as
  the caching allocator gives them. For ipc the daemon is started with the stand-in's shared
  device memory (tests/bench/fake_gpu_daemon.py), so it opens the staging buffer and drains it
  as on a GPU, instead of refusing it (a refusal would fall back to overlap).

Per save it records: stall_s / n (what `save` blocked the caller), the process CPU time of the
save call / n (all threads), and the stand-in's own time: every call into it on the saving
thread (copies, foreach copies, stream and event operations) is timed, and `host` = (stall -
stand-in time) / n is ckptd's host work, the figure the target judges. On a GPU those calls are
CUDA's (a launch each, a few µs, never per tensor: a foreach pack is one multi-tensor launch),
so `standin ops` (calls per save) is shown too. Also counted over the timed saves: host-memory
registrations (cudaHostRegister; 0 after the first save of each arena) and the saving
process's minor page faults per save.

Targets (median over rounds): host µs per tensor <= 10 in every mode at every count; ipc stall /
overlap stall <= 1 (within each round). Prints every figure with its target and PASS/FAIL and
exits 0 either way (1 when the run itself failed).

    python tests/bench/bench_save_modes.py [--tensors 1000,4000] [--rounds 7] [--modes shm,copy,overlap,ipc]
    python tests/bench/bench_save_modes.py --profile overlap --tensors 4000   # cProfile of the timed saves of one mode
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
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
sys.path.insert(0, str(HERE))  # tests/bench: fake_gpu_daemon
import fakecuda  # noqa: E402
import fake_gpu_daemon  # noqa: E402

MODES = ("shm", "copy", "overlap", "ipc")
ELEMENTS = 256
HOST_TARGET_US = 10.0
IPC_OVER_OVERLAP = 1.0


class StandInClock:
    """Time spent inside the stand-in's calls, on the thread that is measured (the saving one)."""

    def __init__(self) -> None:
        self.thread: int | None = None
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
                self._depth -= 1

        return timed

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        self.thread, self.seconds, self.calls = threading.get_ident(), 0.0, 0
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


def timed_save(case: Case, clock: StandInClock, cuda: fakecuda.FakeCuda, profile: cProfile.Profile | None) -> None:
    train_step(case)
    gc.collect()
    case.step += 1
    registered = len(cuda.lib.register_calls)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu = time.process_time()
    with clock.measuring():
        if profile is not None:
            profile.enable()
        handle = case.client.save(case.step, case.state)
        if profile is not None:
            profile.disable()
    cpu = time.process_time() - cpu
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    if not handle.ok:
        raise RuntimeError(f"{case.mode}, {case.n} tensors: save {case.step} failed: {handle.error}")
    expected = "cpu" if case.mode == "shm" else case.mode
    if handle.mode != expected:
        raise RuntimeError(f"{case.mode}: the save ran in mode {handle.mode!r} ({case.client.mode_reason})")
    us = 1e6 / case.n
    case.add("stall", handle.stall_s * us)
    case.add("host", (handle.stall_s - clock.seconds) * us)
    case.add("cpu", cpu * us)
    case.add("standin", clock.seconds * us)
    case.add("ops", clock.calls)
    case.add("faults", faults)
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
    failed = 0
    print(f"\n{'mode':<8} {'tensors':>7} {'host µs/t':>10} {'stall µs/t':>11} {'cpu µs/t':>9} {'stand-in µs/t':>14} {'ops/save':>9} "
          f"{'faults/save':>12} {'registrations':>14}  target")
    for case in cases:
        s = case.series
        host = median(s["host"])
        ok = host <= HOST_TARGET_US
        failed += not ok
        print(f"{case.mode:<8} {case.n:>7,} {host:>10.2f} {median(s['stall']):>11.2f} {median(s['cpu']):>9.2f} {median(s['standin']):>14.2f} "
              f"{median(s['ops']):>9.0f} {median(s['faults']):>12.0f} {int(sum(s['registrations'])):>14}  "
              f"host <= {HOST_TARGET_US:g} µs/t {'PASS' if ok else 'FAIL'}   rounds: {' '.join(f'{x:.1f}' for x in s['host'])}")
    by = {(c.mode, c.n): c for c in cases}
    for n in counts:
        ipc, overlap = by.get(("ipc", n)), by.get(("overlap", n))
        if ipc is None or overlap is None:
            continue
        ratios = [a / b for a, b in zip(ipc.series["stall"], overlap.series["stall"]) if b > 0]
        ok = median(ratios) <= IPC_OVER_OVERLAP
        failed += not ok
        print(f"ipc stall / overlap stall, {n:,} tensors: {median(ratios):.2f} [{min(ratios):.2f} - {max(ratios):.2f}]  "
              f"target <= {IPC_OVER_OVERLAP:g} {'PASS' if ok else 'FAIL'}")
    print(f"load average: {' | '.join(loads)}")
    print(f"summary: {'all targets PASS' if not failed else f'{failed} target(s) FAIL'}")
    return failed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="1000,4000", help="comma-separated tensor counts (default 1000,4000)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup-saves", type=int, default=3, help="untimed saves per client first (every arena of the set mapped and registered)")
    p.add_argument("--profile", default=None, metavar="MODE", help="cProfile the timed saves of MODE and print the top functions")
    args = p.parse_args(argv)
    args.counts = [int(x) for x in args.tensors.split(",") if x.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.modes) - set(MODES) or not args.counts or args.rounds < 1:
        p.error(f"--modes: some of {','.join(MODES)}; --tensors and --rounds positive")
    return args


def start_daemon(workdir: Path, device_dir: Path) -> Any:
    """A real daemon whose CUDA runtime is the stand-in's shared device memory (for mode ipc)."""
    import subprocess

    from ckptd.demo.process import DaemonProcess, DaemonStartError, wait_healthy

    socket = Path(tempfile.mkdtemp(prefix="ckptd-m-")) / "d.sock"
    log_path = workdir / "daemon.log"
    cmd = [sys.executable, str(HERE / "fake_gpu_daemon.py"), str(device_dir), "serve", "--root", str(workdir / "root"),
           "--socket", str(socket), "--shm-dir", str(workdir / "shm")]
    log_file = open(log_path, "ab")
    popen = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    daemon = DaemonProcess(popen=popen, socket=socket, root=workdir / "root", log_path=log_path, _log_file=log_file)
    try:
        wait_healthy(daemon.address, 60, popen)
    except DaemonStartError as exc:
        daemon.kill()
        raise DaemonStartError(f"{exc}\n{daemon.log_text()[-4000:]}") from None
    return daemon


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
                    timed_save(case, clock, cuda, None)
                case.series.clear()
            for r in range(args.rounds):
                for case in cases:
                    timed_save(case, clock, cuda, profile if case.mode == args.profile else None)
                line = "  ".join(f"{c.mode}/{c.n}: {c.series['host'][-1]:.1f}" for c in cases)
                print(f"  round {r + 1}/{args.rounds} (host µs per tensor): {line}", flush=True)
            for case in cases:
                check_restore(case, daemon.address)
        loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
        failed = report(cases, args.counts, loads)
        print("every mode's last save restored bit-exact")
        if profile is not None:
            print(f"\ncProfile of the timed saves of mode {args.profile} (cumulative):")
            pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return 0
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
