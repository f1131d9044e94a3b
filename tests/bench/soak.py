"""Soak benchmark (issue 20): many saves with retention and rollbacks, two ranks, one daemon;
the daemon's resources must stay flat.

    python tests/bench/soak.py [--saves 500] [--tensors 200] [--every 25]

Two trainer ranks (separate processes, world size 2 on one node) save a state of `--tensors`
tensors (a model both ranks hold, each rank's own optimizer shard and extras) `--saves` times,
each waited until durable. Every ROLLBACK_EVERY saves both ranks load the step committed two
saves earlier and continue from it with step numbers below the highest saved (the rollback
workflow of docs/architecture.md §9), so retention (`--keep-last 3 --keep-every 50`) deletes out of step
order. Every `--every` saves the parent samples the daemon: resident memory (VmRSS), open file
descriptors, threads, arenas and bytes in its shared-memory directory, step directories and
other files under the root (recycle bin, `latest`, temporaries).

Judged: after WARMUP saves, each series' last sample minus its first; memory may wander by
RSS_SLACK_MIB, counts must come back to their first value (fds, threads, arenas may be busy at
a sample: the maximum of the last quarter is compared with the maximum of the first; threads
with THREAD_SLACK, for pool threads started late); step
directories grow by policy (keep_every) and are only shown. Prints
the samples, the verdict per series, and exits 1 when a series grew. Not part of CI (it takes
minutes); run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROLLBACK_EVERY = 40  # saves between rollbacks
WARMUP = 50  # saves before the first judged sample (arenas, caches and pools grow to their size)
RSS_SLACK_MIB = 4.0  # an index kept per retained step grew it by 11 MiB over 450 saves (fixed): this catches that
# Threads the daemon's pools may still start after the warm-up: asyncio's default executor starts
# a thread only when calls overlap, up to min(32, cores + 4), and one more came late in some runs
# (12 -> 13). A leak grows with the saves (hundreds over a soak), far past this.
THREAD_SLACK = 2
KEEP = ["--keep-last", "3", "--keep-every", "50"]


def schedule(saves: int) -> list[tuple[str, int]]:
    """The same plan for both ranks: ("save", step) and ("load", step) actions.

    Steps go up by 10; every ROLLBACK_EVERY saves, the ranks load the step saved two saves
    before (still kept by keep_last 3) and save the next unused numbers above it, which are
    below the highest step on disk, until the normal sequence resumes above the highest."""
    actions: list[tuple[str, int]] = []
    history: list[int] = []
    used: set[int] = set()
    highest = 0
    for i in range(saves):
        if i and i % ROLLBACK_EVERY == 0 and len(history) >= 3:
            back = history[-3]
            actions.append(("load", back))
            history.append(back)  # loading makes it the timeline's tip; saves continue from it
        if history and history[-1] < highest:  # after a rollback: fill numbers above the tip
            step = history[-1] + 1
            while step in used:
                step += 1
            if step >= highest or step % 10 == 0:
                step = highest + 10
        else:
            step = highest + 10
        actions.append(("save", step))
        used.add(step)
        history.append(step)
        highest = max(highest, step)
    return actions


def rank_main(address: str, job: str, rank: int, saves: int, tensors: int) -> None:
    """One trainer rank: follows schedule(), prints one JSON line per save to stdout."""
    import torch

    from ckptd.client import CheckpointClient

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(4096, generator=gen) for i in range(tensors // 2)}
    shard = {f"layers.{i}.exp_avg.rank{rank}": torch.randn(2048, generator=gen) for i in range(tensors - tensors // 2)}
    state = {"model": model, "shard": shard, "extra": {"rank": rank, "epoch": 0}}
    done = 0
    with CheckpointClient(job, address=address, rank=rank, world_size=2, local_world_size=2, on_error="raise", timeout_s=120) as ckpt:
        for action, step in schedule(saves):
            if action == "load":
                got = ckpt.load(state, step=step, strict=False)  # the other rank's shard is in the step too
                if got != step:
                    raise SystemExit(f"rank {rank}: load of step {step} returned {got}")
                continue
            with torch.no_grad():
                for t in model.values():
                    t.add_(1e-3)
            state["extra"]["epoch"] = step
            start = time.perf_counter()
            handle = ckpt.save(step, state)
            stall = handle.stall_s
            handle.wait_durable(timeout=120)
            done += 1
            print(json.dumps({"rank": rank, "saves": done, "step": step, "stall_s": stall, "durable_s": time.perf_counter() - start}), flush=True)


@dataclass
class Sample:
    saves: int
    rss_mib: float
    fds: int
    threads: int
    arenas: int
    shm_mib: float
    steps: int  # step directories on disk (grows by policy: keep_every)
    other_files: int  # files outside step directories: recycle bin, latest, temporaries


@dataclass
class Series:
    samples: list[Sample] = field(default_factory=list)


def sample(pid: int, shm_dir: Path, root: Path, saves: int) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = {line.split(":")[0]: line.split(":")[1].strip() for line in status if ":" in line}
    rss_kib = int(fields["VmRSS"].split()[0])
    arenas = [p for p in shm_dir.iterdir() if p.is_file()]
    steps = other = 0
    for _where, dirs, names in os.walk(root):
        steps += sum(1 for d in dirs if d.startswith("step-"))
        dirs[:] = [d for d in dirs if not d.startswith("step-")]
        other += len(names)
    return Sample(
        saves=saves,
        rss_mib=rss_kib / 1024,
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
        arenas=len(arenas),
        shm_mib=sum(p.stat().st_blocks * 512 for p in arenas) / 2**20,
        steps=steps,
        other_files=other,
    )


def verdicts(samples: list[Sample]) -> list[tuple[str, str, bool]]:
    """(series, text, ok) for every resource, judged on the samples after WARMUP saves."""
    judged = [s for s in samples if s.saves >= WARMUP] or samples
    quarter = max(1, len(judged) // 4)
    first, last = judged[:quarter], judged[-quarter:]
    out: list[tuple[str, str, bool]] = []
    rss_growth = judged[-1].rss_mib - judged[0].rss_mib
    out.append(("rss", f"{judged[0].rss_mib:.1f} -> {judged[-1].rss_mib:.1f} MiB ({rss_growth:+.1f}, slack {RSS_SLACK_MIB:g})", rss_growth <= RSS_SLACK_MIB))
    for name in ("fds", "threads", "arenas", "shm_mib", "other_files"):
        before = max(getattr(s, name) for s in first)
        after = max(getattr(s, name) for s in last)
        slack = THREAD_SLACK if name == "threads" else 0
        out.append((name, f"max of first quarter {before:g}, of last quarter {after:g}" + (f" (slack {slack})" if slack else ""), after <= before + slack))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=500)
    parser.add_argument("--tensors", type=int, default=200, help="tensors per rank")
    parser.add_argument("--every", type=int, default=25, help="sample the daemon every this many saves")
    parser.add_argument("--keep", default=" ".join(KEEP), help="the daemon's retention options (default: %(default)s)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # internal: run as a trainer rank
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--job", default="soak", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.address, args.job, args.rank, args.saves, args.tensors)
        return 0

    from ckptd.demo.process import start_daemon

    work = Path(tempfile.mkdtemp(prefix="ckptd-soak-", dir="/var/tmp"))
    sock_dir = Path(tempfile.mkdtemp(prefix="ckptd-soak-", dir="/tmp"))
    shm_dir = Path(tempfile.mkdtemp(prefix="ckptd-soak-", dir="/dev/shm"))
    daemon = start_daemon(root=work / "root", socket=sock_dir / "d.sock", extra_args=["--shm-dir", str(shm_dir), *args.keep.split()],
                          log_path=work / "daemon.log")
    print(f"soak: {args.saves} saves, 2 ranks, {args.tensors} tensors per rank, rollback every {ROLLBACK_EVERY}, "
          f"daemon {args.keep}, load {os.getloadavg()[0]:.2f}", flush=True)
    started = time.perf_counter()
    samples: list[Sample] = [sample(daemon.pid, shm_dir, daemon.root, 0)]
    stalls: list[float] = []
    ranks = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--address", str(daemon.address), "--job", args.job,
                          "--saves", str(args.saves), "--tensors", str(args.tensors)], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    try:
        assert ranks[0].stdout is not None
        for line in ranks[0].stdout:
            record = json.loads(line)
            stalls.append(record["stall_s"])
            if record["saves"] % args.every == 0:
                s = sample(daemon.pid, shm_dir, daemon.root, record["saves"])
                samples.append(s)
                print(f"  {s.saves:4d} saves: rss {s.rss_mib:7.1f} MiB  fds {s.fds:3d}  threads {s.threads:3d}  "
                      f"arenas {s.arenas}  shm {s.shm_mib:6.1f} MiB  steps on disk {s.steps:3d}  other files {s.other_files}", flush=True)
        codes = [r.wait(timeout=600) for r in ranks]
        if any(codes):
            print(f"soak: a rank failed (exit codes {codes}); daemon log: {work / 'daemon.log'}")
            return 1
        seconds = time.perf_counter() - started
        ok = True
        print(f"soak: {args.saves} saves in {seconds:.0f} s; median stall {sorted(stalls)[len(stalls) // 2] * 1e3:.1f} ms; "
              f"load {os.getloadavg()[0]:.2f}")
        for name, text, passed in verdicts(samples):
            ok &= passed
            print(f"  {name:10s} {text}: {'FLAT' if passed else 'GREW'}")
        print(f"soak: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
        daemon.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
