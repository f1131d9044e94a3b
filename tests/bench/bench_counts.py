"""Durability and restore from memory at hundreds to thousands of tensors (issue 33, item 5).

The same bytes (`--size-mib`, default 256) split into `--tensors` tensors (default 100, 1,000
and 4,000), laid out like an fp32 model trained with AdamW: a third weights, two thirds the
optimizer's exp_avg / exp_avg_sq of the same shapes, sizes spread over two decades (as a real
model's embeddings, projections, norms and biases are). Per count, after warm-up saves, each
round measures back to back, on the same state, every value changed first (an optimizer step):

- floor: write + fsync of the state's bytes to one new file (64 MiB `os.write` calls, one
  stream), and memcpy of them into a warm buffer (best of numpy and torch `copy_`); shown
  beside them, what a new process pays at least to get bytes another process holds in shared
  memory (a tmpfs file in `--shm-dir`) into the warm buffer: the best of three preads of it
  (32 MiB calls on two threads) and three copies through a fresh mapping of it (its page
  faults; the unmapping untimed);
- peer: `torch.save` of the state to one new file, then fsync (what a trainer that saves
  with torch alone waits for);
- ckptd: `save()` until `wait_durable()` returns (time to durable), then `load` from the
  daemon's memory into the existing tensors by the client that saved, and by a new client (a
  restarted trainer; its first load of the job plans the copies).

Targets (median of per-round ratios): durable <= 1.0x write+fsync; each restore from memory
<= 1.2x memcpy. Everything it starts or writes is removed at the end, also on an error or
Ctrl-C. Exit 0 whether targets pass or fail, 1 when a count could not run, 130 interrupted.
See tests/bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import mmap
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench is not a package
import bench_handoff as bh  # noqa: E402
import bench_save as bs  # noqa: E402

MIB = 1 << 20
SIZE_SPREAD = 100.0  # largest / smallest tensor of a state

State = dict[str, Any]


def counts_state(n: int, nbytes: int, seed: int) -> State:
    """About `nbytes` of fp32 in `n` tensors (n rounded down to a multiple of 3, at least 3):
    n/3 weights with exp_avg and exp_avg_sq of the same shape, sizes log-spaced over
    SIZE_SPREAD, shuffled, scaled to the total. Same layout as bench_save.make_state."""
    weights = max(1, n // 3)
    gen = torch.Generator().manual_seed(seed)
    rel = torch.logspace(0, float(torch.log10(torch.tensor(SIZE_SPREAD))), weights)[torch.randperm(weights, generator=gen)]
    elements = (rel / rel.sum() * (nbytes // 12)).long().clamp(min=1).tolist()  # 12 bytes per element: weight + 2 moments
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for i, numel in enumerate(elements):
        name = f"layer{i}.weight"
        model[name] = torch.randn(numel, generator=gen) * 0.02
        optim[name] = {"exp_avg": torch.randn(numel, generator=gen) * 1e-3, "exp_avg_sq": torch.rand(numel, generator=gen) * 1e-6}
    return {"model": model, "optimizer": {"state": optim}}


@dataclass
class CountCase:
    n: int
    state: State
    client: Any
    src: torch.Tensor  # the state's bytes back to back (the floors' source)
    dst: torch.Tensor  # a warm buffer of the same size
    job: str
    shm_copy: Path  # the state's bytes in a tmpfs file (floor.fresh)
    step: int = 0


def torch_save_fsync(state: State, path: Path) -> float:
    """Seconds of torch.save of `state` to a new file plus its fsync; the file is removed, untimed."""
    path.unlink(missing_ok=True)
    os.sync()
    bh.QUIET.settle()
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def write_fsync(case: CountCase, path: Path) -> float:
    path.unlink(missing_ok=True)
    os.sync()
    bh.QUIET.settle()
    start = time.perf_counter()
    bs.write_fsync(case.src.numpy(), path)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def timed_load(client: Any, case: CountCase) -> float:
    """Seconds of one load from the daemon's memory into the zeroed tensors; checked afterwards."""
    expected = bs.sample_sums(case.state)
    bs.zero_state(case.state)
    gc.collect()
    bh.QUIET.settle()
    start = time.perf_counter()
    step = client.load(case.state)
    seconds = time.perf_counter() - start
    if step != case.step or bs.sample_sums(case.state) != expected:
        raise RuntimeError(f"{case.n} tensors: the load returned step {step} (saved {case.step}) or other values than were saved")
    return seconds


PREAD_CALL = 32 * MIB


def floor_fresh(case: CountCase, threads: int = 2) -> float:
    """Seconds of the cheaper way a new process gets case.shm_copy into the warm buffer: pread
    (PREAD_CALL bytes a call, dealt round robin to `threads` threads) or a copy through a fresh
    mapping (torch's copy_, intra-op threads; unmapped untimed); best of three each."""
    dst = memoryview(case.dst.numpy()).cast("B")
    fd = os.open(case.shm_copy, os.O_RDONLY)

    def read(first: int) -> None:
        for at in range(first * PREAD_CALL, len(dst), threads * PREAD_CALL):
            view = dst[at : at + PREAD_CALL]
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], at + got)
                if n <= 0:
                    raise RuntimeError(f"{case.shm_copy} ended early")
                got += n

    def pread_all() -> float:
        bh.QUIET.settle()
        start = time.perf_counter()
        workers = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    def fresh_mapping() -> float:
        with mmap.mmap(fd, len(dst), prot=mmap.PROT_READ) as mapped:
            source = torch.frombuffer(memoryview(mapped), dtype=torch.uint8)  # read only: never written
            bh.QUIET.settle()
            start = time.perf_counter()
            case.dst.view(torch.uint8).copy_(source)
            seconds = time.perf_counter() - start
            del source
        return seconds

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch.frombuffer of a read-only buffer
            return min([pread_all() for _ in range(3)] + [fresh_mapping() for _ in range(3)])
    finally:
        os.close(fd)


def one_round(case: CountCase, address: str, run: bh.Run, scratch: Path) -> None:
    p, n = f"n{case.n}", f"{case.n:,} tensors"
    with torch.no_grad():  # untimed: change every value, as an optimizer step would
        for t in bs.tensors(case.state):
            t.add_(1e-6)
    case.src.copy_(bs.flat_copy(case.state))
    run.add(f"{p}.floor.write_fsync", f"{n}: floor, write + fsync one file", "s", write_fsync(case, scratch / "floor.bin"))
    bh.QUIET.settle()
    run.add(f"{p}.floor.memcpy", f"{n}: floor, memcpy into a warm buffer", "s", bh.floor_memcpy(case))  # type: ignore[arg-type]
    run.add(f"{p}.floor.fresh", f"{n}: floor of a new process, pread or a fresh mapping of tmpfs", "s", floor_fresh(case))
    run.add(f"{p}.peer.torch_save", f"{n}: torch.save + fsync", "s", torch_save_fsync(case.state, scratch / "torch.pt"))
    case.step += 1
    stall, _, durable = bh.ckptd_save(case.client, case.step, case.state)
    run.add(f"{p}.ckptd.stall", f"{n}: ckptd save, stall", "s", stall)
    run.add(f"{p}.ckptd.durable", f"{n}: ckptd save() to wait_durable", "s", durable)
    if not bh.in_memory(case.client):
        run.notes.append(f"{n}: the newest step was NOT in the daemon's memory at the load")
    run.add(f"{p}.ckptd.load", f"{n}: ckptd load from memory, saving client", "s", timed_load(case.client, case))
    with bh.client_for(address, case.job) as fresh:
        run.add(f"{p}.ckptd.load_new", f"{n}: ckptd load from memory, new client", "s", timed_load(fresh, case))


def targets_for(counts: list[int]) -> list[bh.Target]:
    out = []
    for c in counts:
        p, n = f"n{c}", f"{c:,} tensors"
        out += [
            bh.Target(f"{n}: ckptd durable / write+fsync", f"{p}.ckptd.durable", f"{p}.floor.write_fsync", 1.0),
            bh.Target(f"{n}: restore from memory (saving client) / memcpy", f"{p}.ckptd.load", f"{p}.floor.memcpy", 1.2),
            bh.Target(f"{n}: restore from memory (new client) / memcpy", f"{p}.ckptd.load_new", f"{p}.floor.memcpy", 1.2),
            bh.Target(f"{n}: restore from memory (new client) / a new process's floor", f"{p}.ckptd.load_new", f"{p}.floor.fresh", None),
            bh.Target(f"{n}: ckptd durable / torch.save+fsync", f"{p}.ckptd.durable", f"{p}.peer.torch_save", None),
        ]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default=None, help="comma-separated tensor counts (default: 100,1000,4000; --quick: 30,300)")
    p.add_argument("--size-mib", type=int, default=None, help="bytes of each state, MiB (default: 256; --quick: 32)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per count (default: 5; --quick: 2)")
    p.add_argument("--warmup-saves", type=int, default=bs.WARMUP_SAVES, help=f"untimed saves per count first (default: {bs.WARMUP_SAVES})")
    p.add_argument("--quick", action="store_true", help="a smoke run: 30,300 tensors of 32 MiB, 2 rounds")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on the disk under test (default: ./bench-out)")
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for ckptd's arenas (default: /dev/shm)")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.size_mib = args.size_mib or (32 if args.quick else 256)
    try:
        args.counts = [int(s) for s in (args.tensors or ("30,300" if args.quick else "100,1000,4000")).split(",") if s.strip()]
    except ValueError:
        p.error("--tensors: comma-separated integers, e.g. 100,1000,4000")
    if args.rounds < 1 or args.size_mib < 1 or not args.counts or min(args.counts) < 3 or args.warmup_saves < 0:
        p.error("--rounds and --size-mib must be >= 1, every tensor count >= 3, --warmup-saves >= 0")
    return args


@contextlib.contextmanager
def scratch_dir(out: Path) -> Iterator[Path]:
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="counts-", dir=out.resolve()))
    try:
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([Path(sys.executable).name, *(sys.argv if argv is None else ["bench_counts.py", *argv])])
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, bh._interrupt)
    run = bh.Run()
    started = time.perf_counter()
    header = [
        "ckptd at many tensors: durable and restore from memory against the floors (tests/bench/bench_counts.py)",
        f"command: {command}",
        f"machine: {bh.cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__} ({torch.get_num_threads()} threads)",
        f"states: {args.size_mib} MiB of fp32 (weights + AdamW moments) in {', '.join(f'{n:,}' for n in args.counts)} tensors; "
        f"{args.rounds} rounds, {args.warmup_saves} warm-up saves each",
    ]
    run.loadavg["start"] = bs.load_average()
    print("\n".join(header), f"load average at start: {run.loadavg['start']}", sep="\n", flush=True)
    try:
        with scratch_dir(args.out) as workdir, contextlib.ExitStack() as stack:
            rig = bs.DaemonRig(root=workdir / "ckptd-root", logs=workdir, shm_parent=args.shm_dir)
            stack.callback(rig.close)
            rig.start()
            bh.QUIET.pids = lambda: [rig.daemon.pid if rig.daemon is not None else 0]
            for i, n in enumerate(args.counts):
                def count(n: int = n, i: int = i) -> None:
                    state = counts_state(n, args.size_mib * MIB, seed=i)
                    src = bs.flat_copy(state)
                    job = f"counts-{n}"
                    handle, name = tempfile.mkstemp(prefix="ckptd-counts-floor-", dir=args.shm_dir)  # beside the daemon's, not in its directory
                    os.close(handle)
                    shm_copy = Path(name)
                    shm_copy.write_bytes(memoryview(src.numpy()).cast("B"))
                    stack.callback(shm_copy.unlink, missing_ok=True)
                    with bh.client_for(rig.address, job) as client:
                        case = CountCase(n, state, client, src, torch.empty_like(src), job, shm_copy)
                        case.dst.copy_(case.src)  # faulted in
                        for _ in range(args.warmup_saves):
                            case.step += 1
                            bh.ckptd_save(client, case.step, state)
                        timed_load(client, case)
                        for r in range(args.rounds):
                            one_round(case, rig.address, run, workdir)
                            last = {k: run.series[f"n{n}.{k}"][-1] for k in
                                    ("floor.write_fsync", "ckptd.durable", "floor.memcpy", "floor.fresh", "ckptd.load", "ckptd.load_new", "peer.torch_save")}
                            print(f"  {n:,} tensors, round {r + 1}/{args.rounds}: write+fsync {last['floor.write_fsync']:.3f} "
                                  f"durable {last['ckptd.durable']:.3f} torch.save {last['peer.torch_save']:.3f} | memcpy "
                                  f"{last['floor.memcpy']:.4f} new process {last['floor.fresh']:.4f} load {last['ckptd.load']:.4f} new client {last['ckptd.load_new']:.4f} s"
                                  f"   load {bs.load_average()}", flush=True)
                bh.run_part(f"{n:,} tensors", run, count)
            if run.errors and rig.daemon is not None:
                print(f"daemon log (last 3000 characters):\n{rig.daemon.log_text()[-3000:]}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: the daemon is stopped, the scratch directory removed", flush=True)
        return 130
    run.loadavg["end"] = bs.load_average()
    verdicts = [bh.Verdict(t, t.per_round(run)) for t in targets_for(args.counts)]
    print()
    print("\n".join(header))
    print(f"load average at start: {run.loadavg['start']}   at end: {run.loadavg['end']}   run took {time.perf_counter() - started:.0f} s")
    print()
    bh.print_results(run, verdicts)
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
