"""Incremental saves benchmark (issue 23, item 3): a LoRA-style fine-tune whose frozen base is
`--frozen` (default 95%) of a full save's bytes, saved by a daemon that links unchanged files of
frozen tensors (the default) and by one that writes every file (`--no-link-unchanged`).

The state: `--layers` frozen base weights (requires_grad=False, fp32, `--mib` MiB in all) with a
trained low-rank adapter pair per layer and Adam over the adapters (its moments and step
counters). Tensor counts are swept with `--tensors` (about 9 tensors per layer: base, two
adapters, two moments and a step per adapter); the adapter rank is chosen so the frozen share of
the bytes is `--frozen`.

Each round takes one optimizer step (untimed; random gradients: nothing here depends on the
values), then saves to both daemons in an order rotated each round:

- bytes: the data bytes the save wrote (files of the new step that do not share their inode
  with the previous step), against the full save's bytes (the other daemon's step);
- stall: the save() call (the hand-off: every tensor, frozen ones too, is copied to the daemon);
- durable: from save() until wait_durable() returns (written, fsynced, committed); its
  background part (durable - stall) is what linking shrinks;
- floor: writing and fsyncing just the bytes that changed (the adapters and their optimizer
  state) as one file in the same directory, the least any save must do;
- check: what linking costs instead of writing. An incremental save reads every linked file
  back and checks it against the previous step's checksums before the step is reported
  written (reuse.check_linked; a file damaged on disk is written again). Measured here with
  the same code (reuse.check_files, which check_linked runs: ranges of reuse.CHECK_RANGE_BYTES,
  4 threads as the daemon's --write-threads) on the files the incremental daemon linked: from the page
  cache (warm: where the daemon finds a file it wrote or read recently) and after evicting
  them (cold: posix_fadvise DONTNEED, read from the disk), against writing and fsyncing the
  same bytes as new files (what `--no-link-unchanged` does with them).

After `--warmup` untimed rounds (the first save of each daemon writes everything), `--rounds`
rounds. Printed: medians (min-max) of the figures and of the ratios taken within each round.
Everything is written under `--out` (default: a new directory in ./bench-out, on the disk under
test), removed at the end unless `--keep`.

    python tests/bench/bench_incremental.py [--tensors 100 1000] [--mib 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ckptd.client import CheckpointClient
from ckptd.format.index import INDEX_NAME, CheckpointIndex
from ckptd.daemon.write import reuse
from ckptd.daemon.storage import step_at
from ckptd.format.units import file_units
from ckptd.demo.process import DaemonProcess, start_daemon

WAYS = ("incremental", "full")


class LoraState(nn.Module):
    """Frozen base weights and a trained adapter pair per layer (no forward: only the state matters)."""

    def __init__(self, layers: int, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.ParameterList(nn.Parameter(torch.randn(width, width), requires_grad=False) for _ in range(layers))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(rank, width) * 0.01) for _ in range(layers))
        self.up = nn.ParameterList(nn.Parameter(torch.zeros(width, rank)) for _ in range(layers))


@dataclass
class Figures:
    stall_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)


def shape_for(tensors: int, mib: int, frozen: float) -> tuple[int, int, int]:
    """(layers, width, rank) giving about `tensors` tensors, `mib` MiB of frozen weights and a
    frozen share of about `frozen` of the save's bytes (adapters + 2 Adam moments = 3 x 2*r*w)."""
    layers = max(1, round(tensors / 9))
    width = max(8, int(math.sqrt(mib * 2**20 / 4 / layers)))
    rank = max(1, round(width * (1 - frozen) / (6 * frozen)))
    return layers, width, rank


def new_bytes(step_dir: Path, previous: Path | None) -> int:
    """Bytes of the step's data files that are not the previous step's files (hard links)."""
    before = {p.stat().st_ino for p in previous.glob("*.safetensors")} if previous is not None and previous.exists() else set()
    return sum(p.stat().st_size for p in step_dir.glob("*.safetensors") if p.stat().st_ino not in before)


def floor_write(path: Path, nbytes: int) -> float:
    """Seconds to write and fsync `nbytes` as one new file (and the directory)."""
    data = os.urandom(min(nbytes, 64 << 20))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, memoryview(data)[: min(left, len(data))])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


CHECK_THREADS = 4  # the daemon's default --write-threads: its check of linked files uses as many


def linked_files(step_dir: Path, previous: Path) -> list[Path]:
    """The step's data files that are hard links of the previous step's (an incremental save's)."""
    before = {p.stat().st_ino for p in previous.glob("*.safetensors")}
    return [p for p in step_dir.glob("*.safetensors") if p.stat().st_ino in before]


def check_files(step_dir: Path, files: list[Path], cold: bool) -> float:
    """Seconds to read `files` of the step back and check every byte against the step's index
    with the daemon's own check of the files it links (reuse.check_files, CHECK_THREADS threads);
    `cold`: evicted from the page cache first."""
    units = file_units(CheckpointIndex.from_json_bytes((step_dir / INDEX_NAME).read_bytes()))
    if cold:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    start = time.perf_counter()
    problems = reuse.check_files(step_at(step_dir).open, {p.name: units[p.name] for p in files}, CHECK_THREADS)
    seconds = time.perf_counter() - start
    assert not problems, problems
    return seconds


def write_files(directory: Path, files: list[Path]) -> float:
    """Seconds to write and fsync files of the sizes of `files` as new files in `directory`."""
    return sum(floor_write(directory / f"write-{i}.bin", p.stat().st_size) for i, p in enumerate(files))


def run_sweep(out: Path, tensors: int, args: argparse.Namespace) -> dict[str, object]:
    layers, width, rank = shape_for(tensors, args.mib, args.frozen)
    torch.manual_seed(0)
    model = LoraState(layers, width, rank)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trained, lr=1e-3)
    base = out / f"t{tensors}"
    daemons: dict[str, DaemonProcess] = {}
    clients: dict[str, CheckpointClient] = {}
    try:
        for way, flag in (("incremental", "--link-unchanged"), ("full", "--no-link-unchanged")):
            root = base / way
            root.mkdir(parents=True)
            sock = Path(tempfile.mkdtemp(prefix="ckptd-bi-")) / "d.sock"
            daemons[way] = start_daemon(root=root, socket=sock, extra_args=[flag, "--keep-last", "2"], log_path=base / f"{way}.log")
            clients[way] = CheckpointClient("lora", address=daemons[way].address, on_error="raise")
        figures = {way: Figures() for way in WAYS}
        floors: list[float] = []
        ratios: dict[str, list[float]] = {
            "bytes inc/full": [], "durable inc/full": [], "background inc/full": [], "durable inc/floor": [],
            "check warm/write": [], "check cold/write": [],
        }
        checks: dict[str, list[float]] = {"warm": [], "cold": [], "write": [], "linked MiB": []}
        changed = 0
        step = 0
        for rnd in range(args.warmup + args.rounds):
            step += 1
            for p in trained:
                p.grad = torch.randn_like(p) * 1e-3
            opt.step()
            state = {"model": model, "optimizer": opt}
            order = WAYS[rnd % 2 :] + WAYS[: rnd % 2]
            took: dict[str, tuple[float, int, float]] = {}
            for way in order:
                start = time.perf_counter()
                handle = clients[way].save(step, state)
                stall = time.perf_counter() - start
                handle.wait_durable(600)
                seconds = time.perf_counter() - start
                root = daemons[way].root / "lora"
                took[way] = (seconds, new_bytes(root / f"step-{step:08d}", root / f"step-{step - 1:08d}" if step > 1 else None), stall)
            changed = sum(p.numel() * 4 for p in trained) + sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
            floor = floor_write(daemons["full"].root / "floor.bin", changed)
            if rnd < args.warmup:
                continue
            root = daemons["incremental"].root / "lora"
            linked = linked_files(root / f"step-{step:08d}", root / f"step-{step - 1:08d}")
            warm, cold = (check_files(root / f"step-{step:08d}", linked, cold) for cold in (False, True))
            write = write_files(daemons["full"].root, linked)
            checks["warm"].append(warm)
            checks["cold"].append(cold)
            checks["write"].append(write)
            checks["linked MiB"].append(sum(p.stat().st_size for p in linked) / 2**20)
            ratios["check warm/write"].append(warm / write)
            ratios["check cold/write"].append(cold / write)
            floors.append(floor)
            for way in WAYS:
                figures[way].durable_s.append(took[way][0])
                figures[way].stall_s.append(took[way][2])
                figures[way].bytes.append(took[way][1])
            ratios["bytes inc/full"].append(took["incremental"][1] / took["full"][1])
            ratios["durable inc/full"].append(took["incremental"][0] / took["full"][0])
            ratios["background inc/full"].append((took["incremental"][0] - took["incremental"][2]) / (took["full"][0] - took["full"][2]))
            ratios["durable inc/floor"].append(took["incremental"][0] / floor)
        count = sum(1 for _ in model.state_dict()) + sum(len([t for t in s.values() if torch.is_tensor(t)]) for s in opt.state.values())
        frozen_bytes = sum(p.numel() * 4 for p in model.base)
        return {
            "tensors": count, "layers": layers, "width": width, "rank": rank,
            "frozen share": frozen_bytes / (frozen_bytes + changed), "figures": figures, "floors": floors, "ratios": ratios, "checks": checks,
        }
    finally:
        for client in clients.values():
            client.close()
        for daemon in daemons.values():
            daemon.stop()


def med(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[100, 1000], help="tensor counts to sweep (about 9 per layer)")
    parser.add_argument("--mib", type=int, default=256, help="MiB of frozen base weights")
    parser.add_argument("--frozen", type=float, default=0.95, help="frozen share of a full save's bytes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="incremental-", dir=Path("bench-out").resolve() if Path("bench-out").is_dir() else None))
    out.mkdir(parents=True, exist_ok=True)
    print(f"# incremental saves: {args.mib} MiB frozen, frozen share {args.frozen:.0%}, {args.rounds} rounds after {args.warmup} warm-up; load {os.getloadavg()[0]:.1f}")
    ok = True
    try:
        for tensors in args.tensors:
            r = run_sweep(out, tensors, args)
            figures: dict[str, Figures] = r["figures"]  # type: ignore[assignment]
            ratios: dict[str, list[float]] = r["ratios"]  # type: ignore[assignment]
            print(f"\n## {r['tensors']} tensors ({r['layers']} layers, width {r['width']}, rank {r['rank']}; frozen share {r['frozen share']:.3f})")
            for way in WAYS:
                f = figures[way]
                print(f"{way:12s} stall {med(f.stall_s)} s   durable {med(f.durable_s)} s   bytes written {med([b / 2**20 for b in f.bytes], '{:.1f}')} MiB")
            print(f"{'floor':12s} write+fsync of the changed bytes {med(r['floors'])} s")  # type: ignore[arg-type]
            checks: dict[str, list[float]] = r["checks"]  # type: ignore[assignment]
            print(
                f"{'check':12s} read back + check the {med(checks['linked MiB'], '{:.1f}')} MiB linked: page cache {med(checks['warm'])} s, "
                f"from disk {med(checks['cold'])} s; write+fsync of them {med(checks['write'])} s"
            )
            for name, values in ratios.items():
                print(f"ratio {name:18s} {med(values)}")
            target = statistics.median(ratios["bytes inc/full"]) <= 0.10
            ok &= target
            print(f"target: bytes per step after the first <= 10% of a full save: {'PASS' if target else 'FAIL'}")
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"\nload at the end {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
