"""Training-time benchmark: issue 33 item 6, the training time a save costs a trainer that uses every core.

A real training loop (an MLP's forward, backward and AdamW step, torch intra-op threads = the
machine's cores, `--threads`; the batch is calibrated so a step takes about `--step-ms`) runs
steps back to back. The state saved is the model's parameters, AdamW's exp_avg and exp_avg_sq,
and padding tensors up to `--size-gib` (64 MiB each; every value of the state changes before
each round, so no save can skip unchanged bytes). Per round and per system, in an order that
rotates from round to round:

1. the daemon(s) and DCP's process are let go idle (bench_handoff.Quiet), then `--baseline-steps`
   steps without a save: their median is the round's baseline step time;
2. the save starts inside a step (its call's own time, the stall, counts in that step) and
   training goes on until the save is durable;
3. `--baseline-steps` steps more without a save; the baseline is the median of these and the
   first ones (both sides of the window: the load of the machine drifts);
4. training time lost = the sum over the steps of that window of (step time - baseline).

Beside it: the CPU seconds the system's own process (the daemon, DCP's process) and the
trainer's process used in the window.

Systems: `ckptd` (a daemon with its defaults, background priority off; `client.save`, then
`handle.wait_durable()` in a side thread), `ckptd-nice` (a second daemon whose background threads
run at `--background-nice 10 --background-ionice best-effort`; set through the environment, so
older daemons start too) and `dcp` (`async_save` with the PROCESS executor
and one reused shared-memory DefaultStager: bench_handoff.DcpSession; the step after the call
waits for `staging_completion` before its optimizer step, as DCP's docs ask, until
`upload_completion` is done). Target: ckptd's lost time <= 0.5x DCP's, judged on the median of
the per-round ratios.

It prints every figure as median [min - max] over the rounds, the targets with PASS or FAIL and
the load average. Exits 0 whether the target passes or fails; 1 when a part could not run; 130
when interrupted. Everything it starts or writes (daemons, DCP's process, scratch directory,
arenas) is removed at the end, also on an error or Ctrl-C. See tests/bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/bench is not a package
import bench_handoff as bh  # noqa: E402
import bench_save as bs  # noqa: E402

SYSTEMS = ("ckptd", "ckptd-nice", "dcp")
PRIORITY_NICE = {"CKPTD_BACKGROUND_NICE": "10", "CKPTD_BACKGROUND_IONICE": "best-effort"}
PRIORITY_ENV = (*PRIORITY_NICE, "CKPTD_BACKGROUND_CPUS")
PAD_BYTES = 64 << 20  # bytes per padding tensor
HIDDEN = 512  # the MLP's width
LAYERS = 4
WINDOW_LIMIT_S = 600.0  # a save not durable after this long fails the part
State = dict[str, Any]


# ------------------------------------------------------------------ the trainer


class Trainer:
    """An MLP trained with AdamW on one fixed random batch; `step` is one forward, backward and
    optimizer step. before_update, if given, runs between the backward and the optimizer step
    (DCP: wait for the staging of a save in flight, which reads the parameters)."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            blocks += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*blocks)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batch = 64
        self.x = torch.randn(self.batch, HIDDEN, generator=gen)
        self.steps = 0

    def step(self, before_update: Callable[[], None] | None = None) -> None:
        loss = self.model(self.x).square().mean()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.steps += 1

    def timed_step(self, before_update: Callable[[], None] | None = None) -> float:
        start = time.perf_counter()
        self.step(before_update)
        return time.perf_counter() - start

    def calibrate(self, target_s: float) -> float:
        """Set the batch so that a step takes about target_s: the median of 5 steps within 20% of
        it twice in a row (a burst of other work on the machine misleads one probe); returns the
        last probe's seconds."""
        took, hits = target_s, 0
        for _ in range(12):
            self.x = torch.randn(self.batch, HIDDEN)
            self.timed_step()  # warm-up at this size
            took = statistics.median(self.timed_step() for _ in range(5))
            hits = hits + 1 if 0.8 * target_s <= took <= 1.2 * target_s else 0
            if hits == 2:
                break
            if hits == 0:
                factor = min(4.0, max(0.25, target_s / took))
                self.batch = max(8, min(1 << 16, round(self.batch * factor)))
        return took

    def state(self, total_bytes: int) -> State:
        """{"model": parameters, "optimizer": exp_avg and exp_avg_sq, "padding": tensors up to
        total_bytes}: the trainer's live tensors, which its steps change in place."""
        if not self.optimizer.state:
            self.step()  # AdamW makes its moments at the first step
        model = {name: p.data for name, p in self.model.named_parameters()}
        optimizer = {}
        for name, p in self.model.named_parameters():
            moments = self.optimizer.state[p]
            optimizer[f"{name}.exp_avg"] = moments["exp_avg"]
            optimizer[f"{name}.exp_avg_sq"] = moments["exp_avg_sq"]
        left = total_bytes - sum(t.nbytes for t in [*model.values(), *optimizer.values()])
        padding = {}
        gen = torch.Generator().manual_seed(1)
        while left > 0:
            n = min(PAD_BYTES, left) // 4 or 1
            padding[f"pad.{len(padding)}"] = torch.rand(n, generator=gen)
            left -= n * 4
        return {"model": model, "optimizer": optimizer, "padding": padding}


def change_padding(state: State) -> None:
    """Every padding value changes (the training steps change the rest), untimed."""
    with torch.no_grad():
        for t in state["padding"].values():
            t.add_(1.0)


# ------------------------------------------------------------------ the systems


@dataclass
class Pending:
    """A save in flight: durable() says whether it is durable (raising what failed);
    before_update runs before each optimizer step until then."""

    durable: Callable[[], bool]
    before_update: Callable[[], None] | None = None
    cleanup: Callable[[], None] = lambda: None


@dataclass
class Ckptd:
    """One daemon and its client; `nice`: its background threads at nice 10, best-effort IO level 7."""

    name: str
    rig: bs.DaemonRig
    client: Any = None
    step: int = 0

    def start(self, nice: bool) -> None:
        with environ(PRIORITY_NICE if nice else {}):
            self.rig.start()

    def save(self, state: State) -> Pending:
        self.step += 1
        handle = self.client.save(self.step, state)
        if not handle.ok:
            raise RuntimeError(f"{self.name}: save of step {self.step} failed: {handle.error}")
        done = threading.Event()
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                handle.wait_durable()
            except BaseException as exc:  # noqa: BLE001  reported by durable() in the trainer's thread
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait, name=f"{self.name}-durable", daemon=True).start()

        def durable() -> bool:
            if failed:
                raise RuntimeError(f"{self.name}: step {self.step} did not become durable: {failed[0]}")
            return done.is_set()

        return Pending(durable)

    def pid(self) -> int:
        return int(self.rig.daemon.pid) if self.rig.daemon is not None else 0

    def warm_up(self, state: State, saves: int) -> None:
        for _ in range(saves):
            self.step += 1
            bh.ckptd_save(self.client, self.step, state)


@dataclass
class Dcp:
    """DCP async_save through bench_handoff's session (PROCESS executor, one reused DefaultStager)."""

    session: bh.DcpSession
    name: str = "dcp"
    saves: int = 0

    def save(self, state: State) -> Pending:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

        path = self.session.workdir / f"train-dcp-{self.saves}"
        self.saves += 1
        response = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.session.stager,
        )
        if not isinstance(response, AsyncSaveResponse):
            raise RuntimeError(f"async_save returned {type(response).__name__}, not AsyncSaveResponse: is staging async?")

        def durable() -> bool:
            if not response.upload_completion.done():
                return False
            response.upload_completion.result()  # raises what failed
            return True

        return Pending(durable, before_update=lambda: response.staging_completion.result(),
                       cleanup=lambda: shutil.rmtree(path, ignore_errors=True))

    def pid(self) -> int:
        return self.session.child_pid() or 0

    def warm_up(self, state: State, saves: int) -> None:
        for _ in range(saves):
            self.session.save(state)


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with the priority variables set to `values` only (the others unset), restored after."""
    saved = {k: os.environ.get(k) for k in PRIORITY_ENV}
    try:
        for k in PRIORITY_ENV:
            os.environ.pop(k, None)
        os.environ.update(values)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------ one measurement


@dataclass
class Window:
    """One save measured: baseline step times, then the step times from the save's start until durable."""

    baseline: list[float]  # before and after the window
    steps: list[float] = field(default_factory=list)
    call_s: float = 0.0  # the save call's own time, inside the first step
    durable_s: float = 0.0  # from the save call until durable was seen (at the end of a step)
    helper_cpu_s: float = 0.0  # CPU seconds of the system's own process (daemon, DCP's process) in the window
    trainer_cpu_s: float = 0.0  # CPU seconds of this process (the trainer and, for DCP, its staging) in the window

    @property
    def base(self) -> float:
        return statistics.median(self.baseline)

    @property
    def lost_s(self) -> float:
        return sum(t - self.base for t in self.steps)


def measure(trainer: Trainer, system: Ckptd | Dcp, state: State, baseline_steps: int) -> Window:
    """Settle, the baseline steps, then one save of `state` while training on until it is durable."""
    gc.collect()
    bh.QUIET.settle()
    window = Window([trainer.timed_step() for _ in range(baseline_steps)])
    helper = system.pid()
    helper_cpu, trainer_cpu = bh.total_cpu([helper]) if helper else 0.0, time.process_time()
    start = time.perf_counter()
    pending = system.save(state)
    window.call_s = time.perf_counter() - start
    try:
        trainer.step(pending.before_update)
        window.steps.append(time.perf_counter() - start)
        while not pending.durable():
            if time.perf_counter() - start > WINDOW_LIMIT_S:
                raise RuntimeError(f"{system.name}: the save was not durable after {WINDOW_LIMIT_S:.0f} s")
            window.steps.append(trainer.timed_step(pending.before_update))
        window.durable_s = time.perf_counter() - start
        window.trainer_cpu_s = time.process_time() - trainer_cpu
        helper = helper or system.pid()
        window.helper_cpu_s = bh.total_cpu([helper]) - helper_cpu if helper else 0.0
    finally:
        pending.cleanup()
    window.baseline += [trainer.timed_step() for _ in range(baseline_steps)]
    return window


def record(run: bh.Run, name: str, w: Window) -> None:
    run.add(f"{name}.lost", f"{name}: training time lost per save", "s", w.lost_s)
    run.add(f"{name}.durable", f"{name}: save until durable (the window)", "s", w.durable_s)
    run.add(f"{name}.call", f"{name}: the save call (in the first step)", "s", w.call_s)
    run.add(f"{name}.base", f"{name}: baseline step (median, no save, before and after)", "s", w.base)
    run.add(f"{name}.helper_cpu", f"{name}: CPU of its process ({'daemon' if name != 'dcp' else 'DCP process'}) in the window", "s", w.helper_cpu_s)
    run.add(f"{name}.trainer_cpu", f"{name}: CPU of the trainer's process in the window", "s", w.trainer_cpu_s)
    run.add(f"{name}.steps", f"{name}: steps in the window", "", float(len(w.steps)))
    run.add(f"{name}.slowdown", f"{name}: mean step in the window / baseline", "", statistics.mean(w.steps) / w.base)


def targets(systems: list[str]) -> list[bh.Target]:
    out = []
    if "ckptd" in systems and "dcp" in systems:
        out.append(bh.Target("training time lost: ckptd / DCP async_save", "ckptd.lost", "dcp.lost", 0.5))
    if "ckptd-nice" in systems and "dcp" in systems:
        out.append(bh.Target("training time lost: ckptd, background nice 10 / DCP", "ckptd-nice.lost", "dcp.lost", None))
    if "ckptd" in systems and "ckptd-nice" in systems:
        out.append(bh.Target("training time lost: ckptd nice 10 / ckptd", "ckptd-nice.lost", "ckptd.lost", None))
    return out


def rounds(trainer: Trainer, systems: dict[str, Ckptd | Dcp], state: State, args: argparse.Namespace, run: bh.Run) -> None:
    names = list(systems)
    for r in range(args.rounds):
        change_padding(state)
        order = names[r % len(names):] + names[:r % len(names)]  # who goes first rotates
        line = []
        for name in order:
            w = measure(trainer, systems[name], state, args.baseline_steps)
            record(run, name, w)
            line.append(f"{name} lost {w.lost_s:.3f} s over {len(w.steps)} steps ({w.durable_s:.2f} s, base {w.base * 1e3:.0f} ms)")
        print(f"  round {r + 1}/{args.rounds} (load {bs.load_average()}): " + "; ".join(line), flush=True)


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default: 5; --quick: 2)")
    p.add_argument("--size-gib", type=float, default=None, help="state saved, GiB (default: 1; --quick: 1/16)")
    p.add_argument("--step-ms", type=float, default=None, help="target step time, ms (default: 100; --quick: 50)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads of the trainer (default: every core)")
    p.add_argument("--baseline-steps", type=int, default=None, help="steps without a save before and after each (default: 10; --quick: 5)")
    p.add_argument("--batch", type=int, default=None, help="the trainer's batch (default: calibrated to --step-ms)")
    p.add_argument("--warmup-saves", type=int, default=None, help="untimed saves per system before the rounds (default: 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 64 MiB, 2 rounds, 50 ms steps (under a minute)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="scratch directory on the disk under test (default: ./bench-out)")
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs for ckptd's arenas (default: /dev/shm)")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        p.error(f"--systems: unknown or none {', '.join(unknown)}; use some of {', '.join(SYSTEMS)}")
    quick = args.quick
    args.rounds = args.rounds if args.rounds is not None else (2 if quick else 5)
    args.size_gib = args.size_gib if args.size_gib is not None else (1 / 16 if quick else 1.0)
    args.step_ms = args.step_ms if args.step_ms is not None else (50.0 if quick else 100.0)
    args.baseline_steps = args.baseline_steps if args.baseline_steps is not None else (5 if quick else 10)
    args.warmup_saves = args.warmup_saves if args.warmup_saves is not None else (1 if quick else 3)
    if min(args.rounds, args.threads, args.baseline_steps, args.batch or 1) < 1 or args.size_gib <= 0 or args.step_ms <= 0 or args.warmup_saves < 0:
        p.error("--rounds, --threads, --baseline-steps must be >= 1, --size-gib and --step-ms > 0, --warmup-saves >= 0")
    return args


def start_systems(args: argparse.Namespace, workdir: Path, stack: contextlib.ExitStack) -> dict[str, Ckptd | Dcp]:
    """The systems asked for, started (daemons healthy, DCP's group made), in args.systems order."""
    systems: dict[str, Ckptd | Dcp] = {}
    for name in args.systems:
        if name == "dcp":
            session = bh.DcpSession(workdir)
            stack.callback(session.close)
            systems[name] = Dcp(session)
            continue
        rig = bs.DaemonRig(root=workdir / f"{name}-root", logs=workdir, shm_parent=args.shm_dir)
        stack.callback(rig.close)
        system = Ckptd(name, rig)
        system.start(nice=name == "ckptd-nice")
        system.client = stack.enter_context(bh.client_for(rig.address, f"train-{name}"))
        systems[name] = system
    return systems


def report(run: bh.Run, header: list[str], started: float, systems: list[str]) -> list[bh.Verdict]:
    verdicts = [bh.Verdict(t, t.per_round(run)) for t in targets(systems)]
    print()
    print("\n".join(header))
    print(f"load average at start: {run.loadavg['start']}   at end: {run.loadavg['end']}   (other work on the machine skews the figures)")
    print(f"run took {time.perf_counter() - started:.0f} s")
    print("each row: median [min - max] of the rounds; lost = sum over the window's steps of (step - baseline median)")
    print()
    bh.print_results(run, verdicts)
    return verdicts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(["bench_training.py", *argv])
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, bh._interrupt)
    torch.set_num_threads(args.threads)
    made_out = not args.out.exists()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="training-", dir=args.out.resolve()))
    run = bh.Run()
    started = time.perf_counter()
    machine = bs.machine_info(workdir)
    run.loadavg["start"] = bs.load_average()
    header = [
        "ckptd training-time benchmark, issue 33 item 6 (tests/bench/bench_training.py)",
        f"command: {command}",
        f"machine: {bh.cpu_model()}, {machine['cores']} cores ({machine['usable_cores']} usable), {machine['ram_gib']} GiB RAM, {machine['kernel']}",
        f"software: Python {machine['python']}, torch {machine['torch']} ({args.threads} intra-op threads for the trainer)",
        f"scratch: {workdir} ({machine['out_fs']})   arenas in: {args.shm_dir} ({bs.fs_type(args.shm_dir)})",
        f"systems: {','.join(args.systems)}   rounds: {args.rounds}   baseline: {args.baseline_steps} steps   warm-up: {args.warmup_saves} saves each",
    ]
    print("\n".join(header), flush=True)
    print(f"load average at start: {run.loadavg['start']}", flush=True)
    interrupted = False
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(gc.collect)
            trainer = Trainer()
            if args.batch is None:
                step_s = trainer.calibrate(args.step_ms / 1e3)
            else:
                trainer.batch = args.batch
                trainer.x = torch.randn(trainer.batch, HIDDEN)
                step_s = statistics.median(trainer.timed_step() for _ in range(5))
            state = trainer.state(int(args.size_gib * bs.GIB))
            every = [t for group in state.values() for t in group.values()]
            nbytes, ntensors = sum(t.nbytes for t in every), len(every)
            header.append(f"trainer: MLP {LAYERS} x {HIDDEN}, batch {trainer.batch}, AdamW; step {step_s * 1e3:.0f} ms at the start")
            header.append(f"state: {ntensors} fp32 tensors, {nbytes:,} bytes ({nbytes / bs.GIB:.2f} GiB): parameters, AdamW moments, "
                          f"padding in {PAD_BYTES >> 20} MiB tensors")
            print("\n".join(header[-2:]), flush=True)
            systems = start_systems(args, workdir, stack)
            bh.QUIET.pids = lambda: [s.pid() for s in systems.values()]
            bh.run_part("warm-up", run, lambda: [s.warm_up(state, args.warmup_saves or 0) for s in systems.values()])
            if "warm-up" not in run.errors:
                bh.run_part("rounds", run, lambda: rounds(trainer, systems, state, args, run))
            bases = [b for k, v in run.series.items() if k.endswith(".base") for b in v]
            if bases and not 0.5 <= statistics.median(bases) / step_s <= 2.0:
                run.notes.append(
                    f"the baseline steps ({statistics.median(bases) * 1e3:.0f} ms, median) are far from the step at the start "
                    f"({step_s * 1e3:.0f} ms): the machine's load changed a lot; a 2-thread step is slowed most when another "
                    "process takes a core (both threads wait at each operation's end), so only ratios within a round compare")
            if run.errors:
                for name, s in systems.items():
                    log = s.rig.daemon.log_text() if isinstance(s, Ckptd) and s.rig.daemon is not None else (
                        s.session.log_text() if isinstance(s, Dcp) else "")
                    if log:
                        print(f"{name} log (last 3000 characters):\n{log[-3000:]}", flush=True)
    except Exception as exc:  # setting up: a daemon or DCP's group did not start
        if bh.SIGNALLED:
            interrupted = True
        else:
            run.errors["setup"] = f"{type(exc).__name__}: {exc}"
            print(f"setup FAILED: {run.errors['setup']}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if made_out:
            with contextlib.suppress(OSError):
                args.out.rmdir()  # only if empty
    if interrupted or bh.SIGNALLED:
        print(f"interrupted ({', '.join(bh.SIGNALLED) or 'SIGINT'}): the daemons and DCP's process are stopped, "
              "the scratch directory removed", flush=True)
        return 130
    run.loadavg["end"] = bs.load_average()
    report(run, header, started, args.systems)
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
