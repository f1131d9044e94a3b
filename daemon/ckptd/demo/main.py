"""`ckptd demo`: a daemon plus a small multi-rank training job on CPU: save, crash, resume.

The parent process starts a daemon in a temporary directory and launches `--ranks` worker
processes (`python -m ckptd.demo.main _worker CONFIG_JSON`), which train a small byte-level
transformer (ckptd.demo.charlm) on the standard library's sources with DDP over gloo and hand
a checkpoint to the daemon every `--save-every` steps. At `--crash-at` the last rank SIGKILLs
itself; the parent then tears down the rest of the job as a launcher would, restarts it, and the
new ranks resume from the newest committed checkpoint. Rank 0 writes what happened to a JSON
lines event log in the work directory; the parent reads it to print the summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

if TYPE_CHECKING:  # torch is imported where it is used, so `ckptd serve` does not pay for it
    import torch
    from torch import nn
    from torch.optim.lr_scheduler import LRScheduler

    from ckptd.client import CheckpointClient

DEMO_JOB = "demo"
SOCKET_DIR_PARENT = "/tmp"  # short on purpose: a Unix socket path must fit in ~107 bytes


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs; passed to it as JSON on its command line."""

    address: str  # the daemon, "unix:///..."
    job: str
    rank: int
    world_size: int
    port: int  # the gloo rendezvous port on 127.0.0.1
    attempt: int  # 1: the run that crashes, 2: the restarted run
    steps: int  # train until this step (inclusive)
    save_every: int
    crash_at: int  # in attempt 1, the last rank kills itself at the start of this step; 0: never
    batch_size: int  # global batch (sequences), split evenly over the ranks
    lr: float
    seed: int
    corpus_bytes: int
    events_path: str  # rank 0's JSON lines event log
    timeout_s: float  # how long a collective (gloo or a checkpoint) may wait for a missing rank


@dataclass(frozen=True)
class JobResult:
    """How the ranks of one launch ended. exit_codes: Popen return codes (negative: killed by that signal)."""

    exit_codes: tuple[int, ...]
    crashed_rank: int | None  # the rank whose failure ended the launch (one killed by a signal first)
    seconds: float  # from the launch until every rank had exited

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes)


# ------------------------------------------------------------------ the parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `ckptd demo`; every one has a default, so it runs with no configuration."""
    parser.add_argument("--ranks", type=int, default=2, help="training processes (gloo, CPU) (default: 2)")
    parser.add_argument("--resume-ranks", type=int, default=None, help="ranks of the restarted job (default: --ranks)")
    parser.add_argument("--steps", type=int, default=40, help="train until this step (default: 40)")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps (default: 5)")
    parser.add_argument("--crash-at", type=int, default=23, help="kill the last rank at this step; 0: no crash (default: 23)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch in sequences of 64 bytes (default: 16)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of AdamW (default: 2e-3)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order (default: 0)")
    parser.add_argument("--corpus-bytes", type=int, default=2 * 2**20, help="bytes of stdlib source to train on (default: 2 MiB)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="new or empty directory for the files, kept (default: a temporary one)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory with the checkpoints")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds each launch of the job may take (default: 180)")


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    resume_ranks = args.resume_ranks or args.ranks
    if args.ranks < 1 or resume_ranks < 1:
        return "--ranks and --resume-ranks must be >= 1"
    if args.steps < 1 or args.save_every < 1:
        return "--steps and --save-every must be >= 1"
    if not 0 <= args.crash_at <= args.steps:
        return f"--crash-at must be between 0 (no crash) and --steps ({args.steps}), got {args.crash_at}"
    if args.crash_at and args.ranks < 2:
        return "--crash-at needs --ranks >= 2 (one rank is killed, the others notice); or pass --crash-at 0"
    for ranks in {args.ranks, resume_ranks}:
        if args.batch_size % ranks:
            return f"--batch-size {args.batch_size} is not divisible by {ranks} ranks"
    if args.workdir is not None and args.workdir.exists() and not args.workdir.is_dir():
        return f"--workdir {args.workdir} is not a directory"
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        return f"--workdir {args.workdir} is not empty; give a new or empty directory"
    return None


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code (0: crashed and resumed as expected)."""
    from ckptd.client import CheckpointError
    from ckptd.demo.process import DaemonStartError, start_daemon

    problem = _check_args(args)
    if problem:
        print(f"ckptd demo: {problem}", file=sys.stderr)
        return 2
    made_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ckptd-demo-")) if made_workdir else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    socket_dir = Path(tempfile.mkdtemp(prefix="ckptd-", dir=SOCKET_DIR_PARENT if os.path.isdir(SOCKET_DIR_PARENT) else None))
    result = 1
    try:
        print(f"==> starting ckptd: root {workdir / 'root'}, socket {socket_dir / 'ckptd.sock'}", flush=True)
        try:
            daemon = start_daemon(root=workdir / "root", socket=socket_dir / "ckptd.sock", log_path=workdir / "daemon.log")
        except DaemonStartError as exc:
            print(f"ckptd demo: the daemon did not start: {exc}", file=sys.stderr)
            return result
        try:
            result = _run_with_daemon(args, daemon.address, workdir)
        except CheckpointError as exc:
            print(f"ckptd demo: the daemon did not answer as expected: {exc}; its log: {workdir / 'daemon.log'}", file=sys.stderr)
        finally:
            code = daemon.stop()
            if code != 0:
                print(f"ckptd demo: the daemon exited with code {code}; its log: {workdir / 'daemon.log'}", file=sys.stderr)
                result = 1
        return result
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
        if not made_workdir or args.keep:
            print(f"==> the checkpoints and logs are in {workdir}")
        elif result != 0:
            print(f"==> kept {workdir} to look into: the demo failed")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"==> removed {workdir}; pass --keep to keep the checkpoints")


def _run_with_daemon(args: argparse.Namespace, address: str, workdir: Path) -> int:
    from ckptd.client import CheckpointClient

    resume_ranks = args.resume_ranks or args.ranks
    base = dict(
        address=address, job=DEMO_JOB, steps=args.steps, save_every=args.save_every, crash_at=args.crash_at,
        batch_size=args.batch_size, lr=args.lr, seed=args.seed, corpus_bytes=args.corpus_bytes, timeout_s=20.0,
    )
    crash = f", rank {args.ranks - 1} will be killed at step {args.crash_at}" if args.crash_at else ""
    plan = f"to step {args.steps}, saving every {args.save_every} steps{crash}"
    print(f"==> training on {args.ranks} ranks (DDP, gloo) {plan}", flush=True)
    first = _launch(args.ranks, base, attempt=1, workdir=workdir, timeout_s=args.timeout)
    with CheckpointClient(DEMO_JOB, address=address, rank=0, world_size=1, on_error="raise") as ckpt:
        _wait_for_writes(ckpt, timeout_s=60.0)
        at_crash = ckpt.list()
    committed_at_crash = [c.step for c in at_crash]
    second: JobResult | None = None
    if not first.ok:
        in_memory = f"; step {at_crash[-1].step} is still in the daemon's memory" if at_crash and at_crash[-1].in_memory else ""
        print(f"==> committed checkpoints after the crash: steps {committed_at_crash or 'none'}{in_memory}", flush=True)
        print(f"==> restarting the job on {resume_ranks} ranks", flush=True)
        second = _launch(resume_ranks, base, attempt=2, workdir=workdir, timeout_s=args.timeout)
    with CheckpointClient(DEMO_JOB, address=address, rank=0, world_size=1, on_error="raise") as ckpt:
        committed = ckpt.list()
    events = _read_events(workdir / "events-1.jsonl") + _read_events(workdir / "events-2.jsonl")
    _print_summary(args, workdir, first, second, events, committed_at_crash, committed)
    return _verdict(args, first, second, events)


def _wait_for_writes(ckpt: CheckpointClient, timeout_s: float) -> None:
    """Wait until the daemon has written every save of the job that was fully handed over.

    A real launcher would not wait; the demo does so that which step it resumes from does not
    depend on how fast the disk is. Saves that a killed rank never handed over are not waited for.
    """
    deadline = time.monotonic() + timeout_s
    announced: set[int] = set()
    while time.monotonic() < deadline:
        writing = sorted(f.step for f in ckpt.status().in_flight if f.job == DEMO_JOB and f.state == "writing")
        if not writing:
            return
        for step in set(writing) - announced:
            print(f"==> waiting for the daemon to finish writing step {step}", flush=True)
        announced.update(writing)
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are local; don't depend on the host name resolving
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _last_line(path: Path, limit: int = 160) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    last = lines[-1].strip() if lines else "(nothing on stderr)"
    return last if len(last) <= limit else last[: limit - 3] + "..."


def _launch(world_size: int, base: dict[str, Any], attempt: int, workdir: Path, timeout_s: float) -> JobResult:
    """Run one launch of the job and wait for it; when a rank fails, kill the others at once (as torchrun does).

    Rank 0's stdout (the progress lines) goes to ours; every rank's stderr to workdir/logs/.
    """
    port = _free_port()
    log_dir = workdir / "logs"
    log_dir.mkdir(exist_ok=True)
    logs = [log_dir / f"attempt{attempt}-rank{rank}.log" for rank in range(world_size)]
    procs = []
    for rank in range(world_size):
        config = WorkerConfig(
            rank=rank, world_size=world_size, port=port, attempt=attempt,
            events_path=str(workdir / f"events-{attempt}.jsonl"), **base,
        )
        cmd = [sys.executable, "-m", "ckptd.demo.main", "_worker", json.dumps(asdict(config))]
        with open(logs[rank], "ab") as stderr:
            procs.append(subprocess.Popen(cmd, env=_worker_env(), stderr=stderr))
    started = time.monotonic()
    crashed: int | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c is not None and c != 0]
            if failed:
                # The rank that was killed is the cause; the others fail because it is gone.
                crashed = min(failed, key=lambda r: (codes[r] > 0, r))
                print(f"==> rank {crashed} {_describe_exit(procs[crashed].returncode)}; stopping the other ranks", flush=True)
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - started > timeout_s:
                print(f"==> the job did not finish within {timeout_s:.0f} s; stopping it", flush=True)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    codes = tuple(p.returncode for p in procs)
    for rank, code in enumerate(codes):
        if code != 0:
            said = f": {_last_line(logs[rank])}" if code > 0 else ""
            print(f"    rank {rank}: {_describe_exit(code)}{said}", flush=True)
    return JobResult(exit_codes=codes, crashed_rank=crashed, seconds=time.monotonic() - started)


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _print_summary(
    args: argparse.Namespace,
    workdir: Path,
    first: JobResult,
    second: JobResult | None,
    events: list[dict[str, Any]],
    committed_at_crash: list[int],
    committed: list[Any],
) -> None:
    saves = [e for e in events if e["event"] == "save"]
    stalls = [e["stall_s"] for e in saves if e["ok"]]
    losses = {(e["attempt"], e["step"]): e["loss"] for e in events if e["event"] == "step"}
    held_out = {(e["attempt"], e["step"]): e["held_out"] for e in events if e["event"] == "eval"}
    resume = next((e for e in events if e["event"] == "resumed"), None)
    resumed = resume["step"] if resume is not None else None
    durable = next((e for e in events if e["event"] == "durable"), None)

    print("\n==> summary")
    failed = [e["step"] for e in saves if not e["ok"]]
    if stalls:
        print(f"  saves (rank 0)   : {len(saves)}; stall per save median {_ms(statistics.median(stalls))}, max {_ms(max(stalls))}"
              + (f"; failed at steps {failed}" if failed else ""))
    else:
        print(f"  saves (rank 0)   : {len(saves)}, none succeeded")
    ranks = {1: args.ranks, 2: args.resume_ranks or args.ranks}
    copied: dict[int, list[int]] = {}
    for e in saves:
        copied.setdefault(ranks[e["attempt"]], []).append(e["bytes_copied"])
    if copied:
        per_run = ", ".join(f"{_mib(statistics.median(c))} ({n} ranks)" for n, c in sorted(copied.items(), reverse=True))
        print(f"  handed off       : rank 0 copied {per_run} per save into the daemon's shared memory")
    if durable is not None:
        print(f"  last save        : step {durable['step']} committed within {_ms(durable['seconds'])} of save() returning")
    if committed:
        newest = committed[-1]
        print(f"  per checkpoint   : {_mib(newest.size_bytes)} on disk in {newest.file_count} files (step {newest.step})")
        at_crash = f" (at the crash: {committed_at_crash})" if first.crashed_rank is not None else ""
        print(f"  committed steps  : {[c.step for c in committed]}{at_crash}")
        step_dir = Path(newest.path)
        if step_dir.is_dir():
            print(f"  newest step dir  : {step_dir}")
            for f in sorted(step_dir.iterdir()):
                print(f"      {f.stat().st_size:>10}  {f.name}")
    else:
        print("  committed steps  : none")
    if first.crashed_rank is not None:
        crash_step = max((s for (a, s) in losses if a == 1), default=0) + 1
        how = _describe_exit(first.exit_codes[first.crashed_rank])
        print(f"  crash            : rank {first.crashed_rank} {how} at step {crash_step}")
        before = max((s for (a, s) in losses if a == 1), default=None)
        if before is not None:
            print(f"  loss before crash: {losses[(1, before)]:.4f} at step {before}")
    if second is not None:
        if resume is not None and resumed is not None:
            print(f"  resumed from     : step {resumed}, restored in {_ms(resume['seconds'])}")
        else:
            print("  resumed from     : nothing (no checkpoint), started over")
        after = sorted(s for (a, s) in losses if a == 2)
        if after:
            first_after, last_after = after[0], after[-1]
            print(f"  loss after resume: {losses[(2, first_after)]:.4f} at step {first_after}, "
                  f"{losses[(2, last_after)]:.4f} at step {last_after}")
        replayed = [s for s in after if (1, s) in losses]
        if replayed:
            worst = max(abs(losses[(1, s)] - losses[(2, s)]) for s in replayed)
            if worst == 0.0:
                verdict = "losses identical to the run before the crash"
            else:
                verdict = f"losses differ from the run before the crash by up to {worst:.1e}"
                if (args.resume_ranks or args.ranks) != args.ranks:
                    verdict += " (another number of ranks sums the gradients in another order)"
            print(f"  replayed steps   : {replayed[0]}..{replayed[-1]}, {verdict}")
    if held_out:
        (a0, s0), (a1, s1) = min(held_out), max(held_out)
        print(f"  held-out loss    : {held_out[(a0, s0)]:.4f} at step {s0} -> {held_out[(a1, s1)]:.4f} at step {s1}")
    runs = f"first run {first.seconds:.1f} s" + (f", restarted run {second.seconds:.1f} s" if second is not None else "")
    print(f"  wall time        : {runs} (each includes starting the ranks)")
    print(f"  work directory   : {workdir} (storage root: root/, daemon log: daemon.log, rank logs: logs/)", flush=True)


def _verdict(args: argparse.Namespace, first: JobResult, second: JobResult | None, events: list[dict[str, Any]]) -> int:
    """0 when the job crashed where asked, resumed from a checkpoint and finished; else 1 with the reason."""
    problems = []
    if args.crash_at:
        if first.crashed_rank is None:
            problems.append(f"the first run did not crash at step {args.crash_at}")
        elif first.exit_codes[args.ranks - 1] != -signal.SIGKILL:
            how = _describe_exit(first.exit_codes[first.crashed_rank])
            problems.append(f"rank {first.crashed_rank} failed before the planned crash ({how})")
    finished = second if second is not None else first
    if not finished.ok:
        problems.append("the restarted job did not finish" if second is not None else "the job did not finish")
    resumed = next((e["step"] for e in events if e["event"] == "resumed"), None)
    if second is not None and args.crash_at > args.save_every and resumed is None:
        problems.append("the restarted job found no checkpoint to resume from")
    for problem in problems:
        print(f"ckptd demo: FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


# ------------------------------------------------------------------ a worker (one training rank)


class _EventLog:
    """Rank 0's JSON lines log, flushed per line so it survives the rank being killed."""

    def __init__(self, path: str | None) -> None:
        self._file: TextIO | None = open(path, "a", encoding="utf-8") if path else None

    def write(self, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps(fields) + "\n")
            self._file.flush()

    def __enter__(self) -> "_EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()


def _warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """LR multiplier for scheduler step i: linear warm-up, then cosine decay to 10%."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


def _train_step(ddp: nn.Module, opt: torch.optim.Optimizer, sched: LRScheduler, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer and scheduler step; returns the loss averaged over the ranks."""
    import torch.distributed as dist

    from ckptd.demo.charlm import lm_loss

    loss = lm_loss(ddp, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _worker(config: WorkerConfig) -> int:
    """One training rank: resume if there is a checkpoint, train, save every few steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ckptd.client import CheckpointClient
    from ckptd.demo.charlm import CharLM, CharLMConfig, batch_at, evaluate, load_corpus, split_corpus

    torch.set_num_threads(1)
    rank, world = config.rank, config.world_size
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{config.port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=config.timeout_s),
    )

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    events = _EventLog(config.events_path if rank == 0 else None)
    train, held_out = split_corpus(load_corpus(config.corpus_bytes))
    model_config = CharLMConfig()
    model = CharLM(model_config, seed=config.seed)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=config.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(max(1, config.steps // 8), config.steps))
    with events, CheckpointClient(config.job, address=config.address, timeout_s=config.timeout_s) as ckpt:
        load_started = time.perf_counter()
        loaded = ckpt.load({"model": model, "optimizer": opt, "scheduler": sched}, rng=True)
        load_s = time.perf_counter() - load_started
        if config.attempt > 1:
            say("    no checkpoint yet: starting from step 0" if loaded is None
                else f"    resumed from step {loaded} (load took {_ms(load_s)})")
            events.write(event="resumed", step=loaded, seconds=load_s)
        handle, saved_at = None, 0.0
        for step in range(1 + (loaded or 0), config.steps + 1):
            if config.attempt == 1 and step == config.crash_at and rank == world - 1:
                print(f"    rank {rank}: crashing at step {step} (SIGKILL to itself)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch_at(train, config.batch_size // world, model_config.context, config.seed, step, rank, world)
            loss = _train_step(ddp, opt, sched, x, y)
            events.write(event="step", attempt=config.attempt, step=step, loss=loss)
            line = f"    step {step:4d}  loss {loss:.4f}  lr {sched.get_last_lr()[0]:.2e}"
            if step % config.save_every == 0 or step == config.steps:
                state = {"model": model, "optimizer": opt, "scheduler": sched, "extra": {"step": step}}
                handle = ckpt.save(step, state, rng=True)  # collective: every rank hands its state over
                saved_at = time.perf_counter()
                events.write(event="save", attempt=config.attempt, step=step, ok=handle.ok, error=handle.error,
                             stall_s=handle.stall_s, bytes_copied=handle.bytes_copied)
                line += (f"  | save: stall {_ms(handle.stall_s)}, {_mib(handle.bytes_copied)}" if handle.ok
                         else f"  | save FAILED: {handle.error}")
                if rank == 0:
                    held_out_loss = evaluate(model, held_out, model_config.context)
                    events.write(event="eval", attempt=config.attempt, step=step, held_out=held_out_loss)
                    line += f"  | held-out {held_out_loss:.4f}"
            say(line)
        if handle is not None and rank == 0:
            info = handle.wait_durable(timeout=60.0)
            if info is not None:
                events.write(event="durable", step=info.step, seconds=time.perf_counter() - saved_at,
                             bytes_written=info.bytes_written, step_dir=info.step_dir)
        dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ckptd.demo.main [options]` runs the demo (same as `ckptd demo`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        if len(argv) != 2:
            print("usage: python -m ckptd.demo.main _worker CONFIG_JSON (started by the demo itself)", file=sys.stderr)
            return 2
        return _worker(WorkerConfig(**json.loads(argv[1])))
    parser = argparse.ArgumentParser(prog="python -m ckptd.demo.main", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
