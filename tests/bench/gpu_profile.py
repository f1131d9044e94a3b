"""What a save in flight costs one training step, and where: the profile of tests/bench/gpu_stall.py.

One step without a save and one per profiled mode with a save in flight, each under
torch.profiler (CPU and CUDA activities) in a range of its own, plus, around each range, the
CPU time of every thread of the trainer and of the daemon (/proc/<pid>/task/*/schedstat) and
the page faults of both processes. `analyze` turns the trace into findings (pure: tested on
fabricated traces in tests/test_gpu_bench.py); `table` prints them, one column per range:

- compute-stream kernel time, and the idle time between the first and the last kernel of the
  step on that stream (the time its kernels waited: for a fence, a launch, a copy);
- the step's own transfers (copies on the compute stream) and the save's copies (copies on
  other streams), and how long they overlapped (copy-engine contention);
- host CPU time: the trainer's main thread, ckptd's client threads (names "ckptd-*"), the
  trainer's other threads, and the daemon's threads;
- cudaHostRegister / cudaHostAlloc calls in the range (pinned memory made on the save path),
  and page faults (minor / major) of the trainer and of the daemon.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REGISTER_CALLS = ("cudaHostRegister", "cudaHostAlloc", "cudaMallocHost", "cuMemHostRegister", "cuMemHostAlloc")
CLIENT_THREAD_PREFIX = "ckptd-"


# ------------------------------------------------------------------ host side (any machine)


def thread_cpu_ns(pid: int) -> dict[int, tuple[str, int]]:
    """Per thread of process `pid`: tid -> (name, nanoseconds on a CPU so far). Names: the
    kernel's (comm), except in this process, where a Python thread's own name is used (Python
    does not pass its thread names to the kernel)."""
    out: dict[int, tuple[str, int]] = {}
    names = {t.native_id: t.name for t in threading.enumerate()} if pid == os.getpid() else {}
    tick_ns = 1e9 / os.sysconf("SC_CLK_TCK")
    base = Path(f"/proc/{pid}/task")
    try:
        tids = [int(t) for t in os.listdir(base)]
    except OSError:
        return out
    for tid in tids:
        try:
            name = (base / str(tid) / "comm").read_text().strip()
            try:
                ns = int((base / str(tid) / "schedstat").read_text().split()[0])
            except (OSError, IndexError, ValueError):  # no schedstat: the kernel's ticks
                fields = (base / str(tid) / "stat").read_text().rsplit(")", 1)[1].split()
                ns = int((int(fields[11]) + int(fields[12])) * tick_ns)
        except OSError:
            continue  # the thread ended
        out[tid] = (names.get(tid, name), ns)
    return out


def process_faults(pid: int) -> tuple[int, int]:
    """(minor, major) page faults of process `pid` so far (all its threads)."""
    if pid == os.getpid():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_minflt, usage.ru_majflt
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0, 0
    return int(fields[7]), int(fields[9])


@dataclass
class HostSample:
    """Per-thread CPU time and page faults of the trainer and the daemon at one moment."""

    trainer: dict[int, tuple[str, int]]
    daemon: dict[int, tuple[str, int]]
    trainer_faults: tuple[int, int]
    daemon_faults: tuple[int, int]
    trainer_total_ns: int = 0  # the whole trainer process, threads that ended since included

    @staticmethod
    def take(daemon_pid: int | None) -> "HostSample":
        me = os.getpid()
        return HostSample(thread_cpu_ns(me), thread_cpu_ns(daemon_pid) if daemon_pid else {},
                          process_faults(me), process_faults(daemon_pid) if daemon_pid else (0, 0), time.process_time_ns())


def _cpu_delta(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[int, tuple[str, int]]:
    return {tid: (name, ns - before.get(tid, (name, 0))[1]) for tid, (name, ns) in after.items()}


@dataclass
class HostCost:
    """CPU milliseconds and page faults between two HostSamples."""

    trainer_main_ms: float = 0.0
    client_threads_ms: float = 0.0
    trainer_other_ms: float = 0.0  # the rest of the trainer process (torch's threads, threads that ended)
    daemon_ms: float = 0.0
    daemon_top: list[tuple[str, float]] = field(default_factory=list)  # its busiest threads (kernel name/tid), ms
    trainer_faults: tuple[int, int] = (0, 0)
    daemon_faults: tuple[int, int] = (0, 0)


def host_cost(before: HostSample, after: HostSample, main_tid: int) -> HostCost:
    """What each side spent between `before` and `after`; `main_tid`: the trainer's Python thread."""
    cost = HostCost()
    for tid, (name, ns) in _cpu_delta(before.trainer, after.trainer).items():
        ms = ns / 1e6
        if tid == main_tid:
            cost.trainer_main_ms += ms
        elif name.startswith(CLIENT_THREAD_PREFIX):
            cost.client_threads_ms += ms
    total_ms = (after.trainer_total_ns - before.trainer_total_ns) / 1e6
    cost.trainer_other_ms = max(0.0, total_ms - cost.trainer_main_ms - cost.client_threads_ms)
    by_thread = [(f"{name}/{tid}", ns / 1e6) for tid, (name, ns) in _cpu_delta(before.daemon, after.daemon).items()]
    cost.daemon_ms = sum(ms for _, ms in by_thread)
    cost.daemon_top = sorted(by_thread, key=lambda kv: -kv[1])[:3]
    cost.trainer_faults = (after.trainer_faults[0] - before.trainer_faults[0], after.trainer_faults[1] - before.trainer_faults[1])
    cost.daemon_faults = (after.daemon_faults[0] - before.daemon_faults[0], after.daemon_faults[1] - before.daemon_faults[1])
    return cost


# ------------------------------------------------------------------ the trace (pure)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def _intersection(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of intervals (each sorted and disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class StepProfile:
    """One range of the trace (one training step, with or without a save): milliseconds."""

    label: str
    wall_ms: float = 0.0
    kernel_ms: float = 0.0  # busy time of the compute stream's kernels
    idle_ms: float = 0.0  # compute stream idle between its first and last kernel of the range
    step_copy_ms: float = 0.0  # the step's own transfers (copies on the compute stream)
    step_copies: int = 0
    save_copy_ms: float = 0.0  # copies on other streams (the save's)
    save_copy_bytes: int = 0
    overlap_ms: float = 0.0  # save copies running while the step's own transfers ran
    register_calls: dict[str, int] = field(default_factory=dict)
    host: HostCost | None = None


def _is_copy(ev: dict[str, Any]) -> bool:
    return ev.get("cat", "").lower() == "gpu_memcpy" or str(ev.get("name", "")).startswith("Memcpy")


def analyze(events: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[StepProfile]:
    """The findings of each range named in `labels` (user annotations of the trace, e.g. from
    torch.profiler.record_function): GPU work is attributed to the range its start falls in
    (each range ends with a synchronize, so its GPU work is inside it). The compute stream is
    the stream with the most kernel time in the first range."""
    spans: dict[str, tuple[float, float]] = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat", "").lower() == "user_annotation" and ev.get("name") in labels:
            spans.setdefault(ev["name"], (float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))))
    gpu = [ev for ev in events if ev.get("ph") == "X" and (ev.get("cat", "").lower() == "kernel" or _is_copy(ev))]
    compute: Any = None
    if labels and labels[0] in spans:
        lo, hi = spans[labels[0]]
        busy: dict[Any, float] = {}
        for ev in gpu:
            if ev.get("cat", "").lower() == "kernel" and lo <= float(ev["ts"]) <= hi:
                stream = ev.get("args", {}).get("stream")
                busy[stream] = busy.get(stream, 0.0) + float(ev.get("dur", 0))
        compute = max(busy, key=lambda s: busy[s]) if busy else None
    out = []
    for label in labels:
        prof = StepProfile(label)
        out.append(prof)
        if label not in spans:
            continue
        lo, hi = spans[label]
        prof.wall_ms = (hi - lo) / 1e3
        inside = [ev for ev in gpu if lo <= float(ev["ts"]) <= hi]
        kernels = _union((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in inside
                         if e.get("cat", "").lower() == "kernel" and e.get("args", {}).get("stream") == compute)
        prof.kernel_ms = _length(kernels) / 1e3
        if kernels:
            prof.idle_ms = (kernels[-1][1] - kernels[0][0]) / 1e3 - prof.kernel_ms
        own = [e for e in inside if _is_copy(e) and e.get("args", {}).get("stream") == compute]
        save = [e for e in inside if _is_copy(e) and e.get("args", {}).get("stream") != compute]
        own_u = _union((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in own)
        save_u = _union((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in save)
        prof.step_copy_ms, prof.step_copies = _length(own_u) / 1e3, len(own)
        prof.save_copy_ms = _length(save_u) / 1e3
        prof.save_copy_bytes = sum(int(e.get("args", {}).get("bytes", 0) or 0) for e in save)
        prof.overlap_ms = _intersection(own_u, save_u) / 1e3
        for ev in events:
            if ev.get("ph") == "X" and ev.get("name") in REGISTER_CALLS and lo <= float(ev.get("ts", -1)) <= hi:
                prof.register_calls[ev["name"]] = prof.register_calls.get(ev["name"], 0) + 1
    return out


def table(profiles: Sequence[StepProfile], title: str) -> list[str]:
    """The findings as a short table, one column per range, then what the save cost each step."""
    col = 16
    rows: list[tuple[str, Callable[[StepProfile], str]]] = [
        ("step wall time (ms)", lambda p: f"{p.wall_ms:.2f}"),
        ("compute-stream kernel time (ms)", lambda p: f"{p.kernel_ms:.2f}"),
        ("compute stream idle inside the step: kernels waited (ms)", lambda p: f"{p.idle_ms:.2f}"),
        ("the step's own transfers (ms, count)", lambda p: f"{p.step_copy_ms:.2f}, {p.step_copies}"),
        ("save copies on other streams (ms, GB)", lambda p: f"{p.save_copy_ms:.2f}, {p.save_copy_bytes / 1e9:.2f}"),
        ("save copies overlapping the step's transfers (ms)", lambda p: f"{p.overlap_ms:.2f}"),
        ("CPU: trainer's main thread (ms)", lambda p: f"{p.host.trainer_main_ms:.1f}" if p.host else "-"),
        ("CPU: ckptd client threads (ms)", lambda p: f"{p.host.client_threads_ms:.1f}" if p.host else "-"),
        ("CPU: trainer's other threads (ms)", lambda p: f"{p.host.trainer_other_ms:.1f}" if p.host else "-"),
        ("CPU: daemon, all threads (ms)", lambda p: f"{p.host.daemon_ms:.1f}" if p.host else "-"),
        ("cudaHostRegister/Alloc calls", lambda p: str(sum(p.register_calls.values()))),
        ("page faults trainer (minor/major)", lambda p: f"{p.host.trainer_faults[0]}/{p.host.trainer_faults[1]}" if p.host else "-"),
        ("page faults daemon (minor/major)", lambda p: f"{p.host.daemon_faults[0]}/{p.host.daemon_faults[1]}" if p.host else "-"),
    ]
    lines = [title, f"{'':<58}" + "".join(f"{p.label:>{col}}" for p in profiles)]
    lines += [f"{name:<58}" + "".join(f"{fn(p):>{col}}" for p in profiles) for name, fn in rows]
    base = profiles[0] if profiles else None
    for p in profiles[1:]:
        if base is None or not base.wall_ms:
            break
        top = ", ".join(f"{n} {ms:.0f}" for n, ms in (p.host.daemon_top if p.host else []))
        lines.append(
            f"{p.label}: the step took {p.wall_ms - base.wall_ms:+.2f} ms; kernels {p.kernel_ms - base.kernel_ms:+.2f} ms "
            f"(slower kernels), waits {p.idle_ms - base.idle_ms:+.2f} ms (idle compute stream), own transfers "
            f"{p.step_copy_ms - base.step_copy_ms:+.2f} ms ({p.overlap_ms:.2f} ms beside save copies); "
            f"{sum(p.register_calls.values())} page-locking calls; daemon's busiest threads (ms): {top or '-'}"
        )
    return lines


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a chrome trace written by torch.profiler's export_chrome_trace."""
    data = json.loads(path.read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


# ------------------------------------------------------------------ capture (GPU)


def capture(parts: Sequence[tuple[str, Callable[[], None]]], daemon_pid: int | None, trace_path: Path,
            cuda: bool = True) -> list[StepProfile]:
    """Run each (label, fn) once under one torch.profiler session with CPU and CUDA activities,
    each in a record_function range of its label ending with a synchronize, sampling the host
    around each; the trace is written to `trace_path`. Returns the findings, in order.
    cuda=False: CPU activities only and no synchronize (the host side, on a machine without a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    main_tid = threading.get_native_id()
    costs: dict[str, HostCost] = {}
    sync()
    with profile(activities=activities) as prof:
        for label, fn in parts:
            before = HostSample.take(daemon_pid)
            with record_function(label):
                fn()
                sync()
            costs[label] = host_cost(before, HostSample.take(daemon_pid), main_tid)
    prof.export_chrome_trace(str(trace_path))
    found = analyze(load_trace(trace_path), [label for label, _ in parts])
    for p in found:
        p.host = costs.get(p.label)
    return found
