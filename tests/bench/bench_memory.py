"""Host memory per byte of state: ckptd with its default settings against
torch.distributed.checkpoint's async_save, in one interleaved run (issue 30 finding 5).

For each state (a 1 GiB transformer-like state of 81 tensors, and 256 MiB in 1,000 tensors),
one trainer process per system builds the same state, then, round by round, each system saves
once, waited until durable (ckptd, dcp, dcp-thread). The systems:

- ckptd: a daemon started for the state with no flags (default settings);
- dcp: async_save as bench_save.py and bench_handoff.py run it, the setup the stall targets
  compare against: the PROCESS executor and one reused DefaultStager with shared memory and
  async staging (its fastest CPU setup; save() returns before the copy ends);
- dcp-thread: async_save with its own defaults (thread executor, a staging copy made before
  async_save returns: the trainer waits for the whole copy). Printed for context, not judged.

Each runs on a gloo group of world size 1 (the DCP ones).

The measure: the summed PSS (proportional set size, /proc/PID/smaps_rollup: Pss_Anon +
Pss_Shmem) of the system's processes (the trainer; for ckptd also the daemon; with their
children), minus the same sum before the first save. PSS divides a page mapped by several
processes among them, so the daemon's shared-memory arenas, mapped by the daemon and the
trainer, count once. Page cache (the files written) counts for neither, nor do mapped files
(library code, whose pages both trainers share). Sampled every 20 ms during each save:

- peak: the most memory during the save, until durable;
- held: half a second after the save is durable (what stays between saves: ckptd keeps the
  newest snapshot for restores from memory; DCP keeps nothing).

Both are divided by the state's bytes. Targets: ckptd's peak <= 1.05 in every round and below
dcp's peak in every round. Exits 0 whether they pass or fail; 1 if a part could not run.
See tests/bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench is not a package
import bench_save as bs  # noqa: E402

MiB = 2**20
SAMPLE_S = 0.02
PIDS_EVERY = 5
SETTLE_S = 0.5
STATES = ("1GiB", "256MiB/1000")
SYSTEMS = ("ckptd", "dcp", "dcp-thread")
PEAK_LIMIT = 1.05


# ------------------------------------------------------------------ states


def make_state(spec: str) -> bs.State:
    """'1GiB': bench_save.py's transformer-like state; '256MiB/1000': 256 MiB in 1,000 fp32 tensors."""
    if spec == "1GiB":
        return bs.make_state(bs.shape_for(bs.GIB))
    size, count = spec.split("/")
    elements = int(size.removesuffix("MiB")) * MiB // int(count) // 4
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"blocks.{i}.weight": torch.randn(elements, generator=gen) for i in range(int(count))}}


def all_tensors(state: bs.State) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(state)
    return out


# ------------------------------------------------------------------ the trainer processes


def worker(system: str, spec: str, target: str) -> None:
    """A trainer: builds the state, connects, then saves on each `save N` line of stdin until EOF.
    target: the daemon's address (ckptd) or the checkpoint directory (dcp)."""
    state = make_state(spec)
    tensors = all_tensors(state)
    if system == "ckptd":
        from ckptd.client import CheckpointClient

        client = CheckpointClient(job="bench-memory", address=target, rank=0, world_size=1, on_error="raise")
    else:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        os.environ["MASTER_ADDR"] = "127.0.0.1"  # the PROCESS executor's child builds its own gloo group there
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{bs.free_port()}", rank=0, world_size=1)
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False))
    print("ready", sum(t.numel() * t.element_size() for t in tensors), len(tensors), flush=True)
    for line in sys.stdin:
        step = int(line.split()[1])
        for t in tensors:  # new values, as after an optimizer step
            t.add_(1.0)
        start = time.perf_counter()
        if system == "ckptd":
            handle = client.save(step, state)
            handle.wait_durable()
        else:
            path = Path(target) / f"step-{step}"
            if system == "dcp":
                bs.dcp_save_once(state, path, stager)
            else:
                dcp.async_save(state, checkpoint_id=path).result()
            shutil.rmtree(Path(target) / f"step-{step - 1}", ignore_errors=True)
        print("done", time.perf_counter() - start, flush=True)


@dataclass
class Trainer:
    """One trainer process and the other processes whose memory counts for its system."""

    system: str
    popen: subprocess.Popen[str]
    extra_pids: tuple[int, ...] = ()
    log: Path | None = None
    state_bytes: int = 0
    tensors: int = 0

    @classmethod
    def start(cls, system: str, spec: str, target: str, log: Path, extra_pids: tuple[int, ...] = ()) -> "Trainer":
        """The trainer of `system`; what it (and DCP's process) logs goes to `log`."""
        with log.open("ab") as log_file:
            popen = subprocess.Popen(
                [sys.executable, __file__, "--worker", system, "--states", spec, "--target", target],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
            )
        trainer = cls(system, popen, extra_pids, log=log)
        _, nbytes, count = trainer._read("ready")
        trainer.state_bytes, trainer.tensors = int(nbytes), int(count)
        return trainer

    def pids(self) -> list[int]:
        roots = [self.popen.pid, *self.extra_pids]
        return roots + [p for root in roots for p in descendants(root)]

    def save(self, step: int) -> float:
        """One save until durable; returns its seconds."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(f"save {step}\n")
        self.popen.stdin.flush()
        return float(self._read("done")[1])

    def _read(self, word: str) -> list[str]:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if not line.startswith(word):
            tail = self.log.read_text(errors="replace")[-2000:] if self.log is not None and self.log.exists() else ""
            raise RuntimeError(f"{self.system} trainer: expected {word!r}, got {line!r} (exit code {self.popen.poll()}); its log ends:\n{tail}")
        return line.split()

    def stop(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        try:
            self.popen.wait(60)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


# ------------------------------------------------------------------ memory


def pss_bytes(pid: int) -> int:
    """The process's proportional set size of anonymous and shared memory (0 once it is gone).
    Mapped files (the libraries' code, shared by both trainers) are left out: their pages are
    divided among every process that maps them, so one system's trainer would move the other's."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return sum(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith(("Pss_Anon:", "Pss_Shmem:")))


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def total_pss(pids: Callable[[], list[int]]) -> int:
    return sum(pss_bytes(p) for p in pids())


class Sampler:
    """The largest summed PSS of `pids()` while it runs (a thread samples every SAMPLE_S; the
    processes are listed again every PIDS_EVERY samples: DCP's starts during its first save)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._list = pids
        self._pids = pids()
        self.peak = total_pss(lambda: self._pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        samples = 0
        while not self._stop.wait(SAMPLE_S):
            samples += 1
            if samples % PIDS_EVERY == 0:
                self._pids = self._list()
            self.peak = max(self.peak, total_pss(lambda: self._pids))

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, total_pss(self._list))


def steady_pss(pids: Callable[[], list[int]]) -> int:
    """The median of 5 samples over SETTLE_S."""
    samples = []
    for _ in range(5):
        time.sleep(SETTLE_S / 5)
        samples.append(total_pss(pids))
    return int(statistics.median(samples))


# ------------------------------------------------------------------ the run


@dataclass
class Figures:
    """Per system: each round's peak and held memory per state byte, and save seconds."""

    peak: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    held: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    seconds: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    state_bytes: int = 0
    tensors: int = 0
    shm_bytes: list[int] = field(default_factory=list)  # ckptd: bytes in its shared-memory directory after each save


def shm_usage(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.iterdir() if p.is_file())


def run_state(spec: str, workdir: Path, rounds: int) -> Figures:
    rig = bs.DaemonRig(root=workdir / "ckptd-root", logs=workdir)
    trainers: dict[str, Trainer] = {}
    figures = Figures()
    try:
        rig.start()
        trainers["ckptd"] = Trainer.start("ckptd", spec, rig.address, workdir / "ckptd-trainer.log", (rig.daemon.pid,))
        for system in SYSTEMS[1:]:
            (workdir / system).mkdir()
            trainers[system] = Trainer.start(system, spec, str(workdir / system), workdir / f"{system}-trainer.log")
        figures.state_bytes, figures.tensors = trainers["ckptd"].state_bytes, trainers["ckptd"].tensors
        baseline = {s: steady_pss(t.pids) for s, t in trainers.items()}
        for step in range(1, rounds + 1):
            for system in SYSTEMS:
                trainer = trainers[system]
                with Sampler(trainer.pids) as sampler:
                    seconds = trainer.save(step)
                held = steady_pss(trainer.pids)
                figures.peak[system].append((sampler.peak - baseline[system]) / figures.state_bytes)
                figures.held[system].append((held - baseline[system]) / figures.state_bytes)
                figures.seconds[system].append(seconds)
                if system == "ckptd":
                    figures.shm_bytes.append(shm_usage(rig.shm_dir))
            print(f"  round {step}: " + ", ".join(f"{s} peak {figures.peak[s][-1]:.3f} held {figures.held[s][-1]:.3f}" for s in SYSTEMS), flush=True)
    finally:
        for trainer in trainers.values():
            trainer.stop()
        rig.close()
    return figures


def report(spec: str, f: Figures) -> tuple[list[str], list[tuple[str, bool]]]:
    lines = [f"state {spec}: {f.tensors} fp32 tensors, {f.state_bytes:,} bytes ({f.state_bytes / MiB:.1f} MiB)"]
    lines.append(f"  {'host memory / state bytes':<28} {'median':>7}  {'[min - max]':<15}  rounds")
    for system in SYSTEMS:
        for what, values in (("peak", f.peak[system]), ("held", f.held[system])):
            spread = f"[{min(values):.3f} - {max(values):.3f}]"
            lines.append(f"  {system + ' ' + what:<28} {statistics.median(values):7.3f}  {spread:<15}  " + " ".join(f"{v:.3f}" for v in values))
        lines.append(f"  {system + ' save until durable (s)':<28} {statistics.median(f.seconds[system]):7.3f}")
    lines.append("  ckptd shared-memory directory after each save: " + ", ".join(f"{b / f.state_bytes:.3f}" for b in f.shm_bytes) + " x the state")
    worst = max(f.peak["ckptd"])
    below = all(c < d for c, d in zip(f.peak["ckptd"], f.peak["dcp"]))
    verdicts = [
        (f"{spec}: ckptd peak <= {PEAK_LIMIT} in every round (worst {worst:.3f})", worst <= PEAK_LIMIT),
        (f"{spec}: ckptd peak < dcp peak in every round (" + ", ".join(f"{c:.3f} < {d:.3f}" for c, d in zip(f.peak["ckptd"], f.peak["dcp"])) + ")", below),
    ]
    return lines, verdicts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", default=",".join(STATES), help=f"comma-separated: {', '.join(STATES)} (default: both)")
    p.add_argument("--rounds", type=int, default=3, help="saves per system and state, interleaved (default: 3)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on the disk under test (default: ./bench-out)")
    p.add_argument("--json", action="store_true", help="also print a JSON summary")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.states, args.target)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    machine = bs.machine_info(args.out)
    header = [
        "ckptd host memory benchmark (tests/bench/bench_memory.py)",
        f"machine: {machine['cores']} cores, {machine['ram_gib']} GiB RAM, {machine['kernel']}; torch {machine['torch']}",
        "measure: summed PSS (anonymous + shared memory) of the trainer (+ ckptd's daemon, + DCP's process) minus before the first save, / state bytes",
        "ckptd: `ckptd serve` with no flags; dcp: PROCESS executor + shared-memory async stager (as bench_save.py); dcp-thread: async_save's defaults",
        f"load average at start: {bs.load_average()}",
    ]
    print("\n".join(header), flush=True)
    results: dict[str, Figures] = {}
    errors = []
    for spec in args.states.split(","):
        workdir = Path(tempfile.mkdtemp(prefix="memory-", dir=args.out.resolve()))
        print(f"state {spec}:", flush=True)
        try:
            results[spec] = run_state(spec, workdir, args.rounds)
        except Exception as exc:  # reported at the end; the other state still runs
            errors.append(f"{spec}: {type(exc).__name__}: {exc}")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print("\n".join(header))
    print(f"load average at end:   {bs.load_average()}")
    verdicts: list[tuple[str, bool]] = []
    for spec, figures in results.items():
        lines, judged = report(spec, figures)
        print("\n".join(lines))
        verdicts += judged
    print("targets:")
    for label, passed in verdicts:
        print(f"  {label}: {'PASS' if passed else 'FAIL'}")
    if args.json:
        print(json.dumps({spec: vars(f) for spec, f in results.items()}, indent=1))
    for error in errors:
        print(f"error: {error}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
