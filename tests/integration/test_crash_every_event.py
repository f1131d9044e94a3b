"""Crash at every file event of a save (issue 20): the daemon kills itself (SIGKILL, no cleanup)
just before the N-th file event under its root (ckptd.daemon.faults.files, enabled by
CKPTD_FAULT_KILL_AT / CKPTD_FAULT_LOG), for every N of a save, on one node and on two nodes
(the coordinator, node 0, and the member, node 1, each in turn). The default run kills at a
sample of the events (kill_points: every fourth, every rename, after each commit, the last two)
and on one node and the coordinator; `pytest -m long` at every event, and the member too.

How: a counting run (CKPTD_FAULT_LOG alone) learns how many events a save makes; then for each
N the victim daemon is started with CKPTD_FAULT_KILL_AT=N, a save runs, the daemon dies at
event N, and it is started again. After each restart:

- every step committed before the save loads bit-exact (CheckpointClient.load);
- the interrupted step is fully committed (loads bit-exact; it must be when wait_durable
  returned) or invisible (no index, no step directory left, not listed);
- `<job>/latest` names the newest committed step;
- no temporary file (`.tmp-*`), half-deleted step (`.deleting-*`), uncommitted step directory
  or prepared marker is left under any root, and no arena of a dead daemon in shared memory;
- the next save succeeds (the following kill's save, and a last save at the end).

The restarted daemon is the next victim (killed at N + 1): events are counted from the moment
it is ready, so its start-up recovery is not counted, and the checks above (loads) make no file
event, which the test asserts from the event log. Each victim save starts from the same state
as the counting run (the number of committed steps and of recycled files, which decide which
events a save makes with the default retention, --keep-last 3): when a kill left another state
(the interrupted step committed before retention ran, recycled files taken by a step that was
then removed), a save by a daemon without the hook restores it first.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.errors import CheckpointError
from ckptd.daemon.handoff.arena import ARENA_PREFIX
from ckptd.daemon.faults.files import ARM_FILE_ENV, KILL_AT_ENV, LOG_ENV
from ckptd.format.index import INDEX_NAME, LATEST, PREPARED_NAME
from ckptd.demo.process import DaemonProcess, start_daemon
from ckptd.daemon.storage import DELETING_PREFIX, RECYCLE_DIR, TMP_MARK, Storage
from daemon_rig import free_port

JOB = "crash"
KEEP_LAST = 3  # the default retention: each save in the steady state deletes a step and recycles its files
PEER_TOKEN = "crash-peer-token-0123456789"
# A lower bound of the events a save makes (counted: about 36 on one node): a hook that stops
# counting, or a save that stops writing, fails here instead of passing with nothing killed.
MIN_EVENTS = {"single": 30, "coordinator": 25, "member": 15}


class CrashModel(torch.nn.Module):
    """Trained parameters with distinct values per step, a frozen parameter that is the same at
    every step (its file is linked into each next step: incremental saves), and a buffer that
    changes (its file is written every time)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(step)
        self.w = torch.nn.Parameter(torch.randn(64, generator=g))
        self.b = torch.nn.Parameter(torch.randn(8, generator=g))
        self.base = torch.nn.Parameter(torch.arange(256, dtype=torch.float32), requires_grad=False)
        self.register_buffer("h", torch.arange(32, dtype=torch.float64) * step)


def state_of(step: int, rank: int) -> dict:
    """The state rank `rank` saves at `step`: distinct values per step, the same on every rank
    (a data-parallel replica: with two nodes, each node writes part of it)."""
    return {"model": CrashModel(step)}


def zeros_like_state() -> dict:
    model = CrashModel(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
    return {"model": model}


@dataclass
class Rig:
    """One or two daemons on loopback, each with its own root, socket and shared memory; one
    rank per node (rank r talks to node r's daemon)."""

    base: Path
    nodes: int
    peers: list[str] = field(default_factory=list)
    running: dict[int, DaemonProcess] = field(default_factory=dict)
    starts: int = 0

    def __post_init__(self) -> None:
        if self.nodes > 1:
            self.peers = [f"127.0.0.1:{free_port()}" for _ in range(self.nodes)]
        for n in range(self.nodes):
            self.root(n).mkdir(parents=True)
            self.shm(n).mkdir(parents=True)

    def root(self, node: int) -> Path:
        return self.base / f"root{node}"

    def shm(self, node: int) -> Path:
        return Path("/dev/shm") / f"ckptd-crash-{os.getpid()}-{self.base.name}-{node}"

    def socket(self, node: int) -> Path:
        return Path("/tmp") / f"ckc-{os.getpid()}-{self.base.name}-{node}.sock"

    def start(self, node: int, kill_at: int | None = None, log: Path | None = None, arm: Path | None = None) -> DaemonProcess:
        """Start node's daemon (waits until healthy); with the fault hook when kill_at or log is
        given, counting from when `arm` exists."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_FAULT_")}
        if kill_at is not None:
            env[KILL_AT_ENV] = str(kill_at)
        if log is not None:
            env[LOG_ENV] = str(log)
        if arm is not None:
            env[ARM_FILE_ENV] = str(arm)
        args = ["--shm-dir", str(self.shm(node)), "--keep-last", str(KEEP_LAST)]
        if self.nodes > 1:
            args += ["--node-rank", str(node), "--peers", ",".join(self.peers)]
            env["CKPTD_PEER_TOKEN"] = PEER_TOKEN
        self.starts += 1
        daemon = start_daemon(self.root(node), self.socket(node), args, env=env, log_path=self.base / f"node{node}-{self.starts}.log")
        self.running[node] = daemon
        return daemon

    def close(self) -> None:
        import shutil

        for daemon in self.running.values():
            if daemon.popen.poll() is None:
                daemon.kill()
        for n in range(self.nodes):
            shutil.rmtree(self.shm(n), ignore_errors=True)
            self.socket(n).unlink(missing_ok=True)

    def client(self, rank: int, world: int | None = None) -> CheckpointClient:
        world = self.nodes if world is None else world
        return CheckpointClient(JOB, address=self.running[rank].address, rank=rank if world > 1 else 0, world_size=world,
                                local_world_size=1, on_error="raise", timeout_s=30)

    def save(self, step: int) -> list[object]:
        """Every rank saves state_of(step); each rank's wait_durable() result or the error it raised."""

        def rank_saves(rank: int) -> object:
            try:
                with self.client(rank) as ckpt:
                    return ckpt.save(step, state_of(step, rank)).wait_durable(timeout=30)
            except CheckpointError as exc:
                return exc

        with ThreadPoolExecutor(self.nodes) as pool:
            return list(pool.map(rank_saves, range(self.nodes)))

    def committed(self, node: int) -> list[int]:
        """Committed steps of node's root, oldest commit first."""
        return Storage(self.root(node)).catalog.commit_order(JOB)

    def shape(self) -> list[tuple[int, int, int]]:
        """What decides the events of the next save: per node, committed steps, recycled files
        and other entries of the job's directory (a step being deleted)."""
        out = []
        for n in range(self.nodes):
            job_dir = self.root(n) / JOB
            bin_dir = job_dir / RECYCLE_DIR
            committed = self.committed(n)
            entries = len(list(job_dir.iterdir())) if job_dir.is_dir() else 0
            out.append((len(committed), len(list(bin_dir.iterdir())) if bin_dir.is_dir() else 0, entries))
        return out

    def settle(self, want: list[tuple[int, int, int]], timeout_s: float = 10.0) -> bool:
        """Wait until shape() is `want` (retention on node 0 may end after the ranks' acknowledgement)."""
        deadline = time.monotonic() + timeout_s
        while self.shape() != want:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def read_events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def check_after_restart(rig: Rig, before: list[int], step: int, acked: bool) -> bool:
    """The invariants after a crash in the save of `step` and a restart (module docstring), on
    every node. `before`: the committed steps (commit order) before that save. Returns whether
    the interrupted step was committed."""
    def settled() -> bool:
        return len({tuple(c) for c in committed_on}) == 1 and not any(
            p.name.startswith((TMP_MARK, DELETING_PREFIX)) or (p / PREPARED_NAME).exists() or not (p / INDEX_NAME).exists()
            for n in range(rig.nodes) for p in (rig.root(n) / JOB).iterdir() if p.name not in (LATEST, RECYCLE_DIR)
        )

    # a member settles a step whose outcome it did not hear with node 0 (Service.resolve_prepared): wait for it
    committed_on = [rig.committed(n) for n in range(rig.nodes)]
    deadline = time.monotonic() + 15
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.1)
        committed_on = [rig.committed(n) for n in range(rig.nodes)]
    assert len({tuple(c) for c in committed_on}) == 1, f"the nodes disagree on the committed steps: {committed_on}"
    now = committed_on[0]
    done = step in now
    if acked:
        assert done, f"step {step} was acknowledged durable but is not committed after the restart: {now}"
    if done:  # committed: retention may have removed the oldest, never one of the newest KEEP_LAST
        assert set(now) <= set(before) | {step} and now[-1] == step, (before, step, now)
        assert set((before + [step])[-KEEP_LAST:]) <= set(now), f"a step retention keeps was lost: before {before}, step {step}, now {now}"
    else:
        assert now == before, f"the interrupted step {step} is not committed, but the committed steps changed: {before} -> {now}"
    for n in range(rig.nodes):
        root = rig.root(n)
        job_dir = root / JOB
        latest = (job_dir / LATEST).read_text().strip()
        assert latest == f"step-{now[-1]:08d}" and (job_dir / latest / INDEX_NAME).is_file(), f"node {n}: `latest` names {latest}, the newest committed step is {now[-1]}"
        left = [p for p in root.rglob("*") if p.name.startswith((TMP_MARK, DELETING_PREFIX)) or p.name == PREPARED_NAME]
        assert not left, f"node {n}: leftovers after the restart: {left}"
        step_dirs = {p.name for p in job_dir.iterdir() if p.name.startswith("step-")}
        assert step_dirs == {f"step-{s:08d}" for s in now}, f"node {n}: step directories {sorted(step_dirs)}, committed {now}"
        dead = [p.name for p in rig.shm(n).iterdir() if p.name.startswith(ARENA_PREFIX) and not p.name.startswith(f"{ARENA_PREFIX}{rig.running[n].pid}-")]
        assert not dead, f"node {n}: arenas of dead daemons left in shared memory: {dead}"
    for n in range(rig.nodes):  # through every node: each loads every committed step bit-exact
        with rig.client(n, world=1) as ckpt:
            assert [i.step for i in ckpt.list()] == now
            for s in now:
                out = zeros_like_state()
                assert ckpt.load(out, step=s) == s
                want = state_of(s, 0)["model"].state_dict()
                for name, value in out["model"].state_dict().items():
                    assert torch.equal(value, want[name]), f"node {n}: step {s} tensor {name} is not what was saved"
    return done


def wait_dead(daemon: DaemonProcess, timeout_s: float) -> bool:
    try:
        daemon.popen.wait(timeout_s)
    except Exception:  # subprocess.TimeoutExpired
        return False
    daemon._close_log()
    return True


def kill_points(events: list[dict], every: int) -> list[int]:
    """The events to kill at (1-based; len(events) + 1 is the SIGKILL right after the save): every
    `every`-th, and always each rename (the atomic steps of a save: a recycled file taken, a file
    into its name, a step into `.deleting-`), the event after a commit's rename (of the step's
    index, of `latest`: renamed, not yet fsynced), and the last two (the end of retention)."""
    count = len(events)
    commits = {e["n"] + 1 for e in events if e["kind"] == "rename" and Path(e["path"]).name.startswith((f".tmp-{INDEX_NAME}", f".tmp-{LATEST}"))}
    renames = {e["n"] for e in events if e["kind"] == "rename"}
    return [n for n in range(1, count + 2) if (n - 1) % every == 0 or n in renames or n in commits or n >= count - 1]


def crash_at_every_event(rig: Rig, victim: int, scenario: str, every: int = 1) -> dict:
    """Prime the job, count a save's events on node `victim`, then kill it at each (every=k: at
    the points kill_points picks); returns a summary."""
    started = time.monotonic()
    for n in range(rig.nodes):
        rig.start(n)
    step = 0
    for _ in range(KEEP_LAST + 1):  # the steady state: KEEP_LAST committed steps and a full recycle bin
        step += 1
        assert all(not isinstance(r, Exception) for r in rig.save(step)), step
    time.sleep(0.5)
    canonical = rig.shape()

    # the counting run: the victim with the log only
    rig.running[victim].stop()
    count_log, arm = rig.base / "count.jsonl", rig.base / "arm-count"
    rig.start(victim, log=count_log, arm=arm)
    arm.touch()
    step += 1
    assert all(not isinstance(r, Exception) for r in rig.save(step))
    assert rig.settle(canonical), (rig.shape(), canonical)
    rig.running[victim].stop()  # drained: every event of the save (retention after the commit too) is logged
    events = read_events(count_log)
    count = len(events)
    assert count >= MIN_EVENTS[scenario], f"only {count} file events counted in a save on node {victim}: {events}"

    killed: list[dict] = []
    committed_after_kill = 0
    warmups = 0
    before: list[int] = []  # the committed steps and the ack of the previous kill's save (set from n = 1 on)
    acked = False
    points = kill_points(events, every)
    for n in points:  # count + 1: the save completes, then a SIGKILL right after it
        log, arm = rig.base / f"kill{n}.jsonl", rig.base / f"arm{n}"
        rig.start(victim, kill_at=n, log=log, arm=arm)  # recovers what the kill at n - 1 left
        if n > 1:
            committed_after_kill += check_after_restart(rig, before, step, acked)
        if not rig.settle(canonical, timeout_s=0.5):  # a kill left another state: one more save restores it
            warmups += 1
            step += 1
            assert all(not isinstance(r, Exception) for r in rig.save(step)), f"the save after the restart failed ({step})"
            assert rig.settle(canonical), (rig.shape(), canonical)
        assert read_events(log) == [], "events were counted before the daemon was armed"
        arm.touch()
        before = rig.committed(0)
        step += 1
        results = rig.save(step)
        acked = all(not isinstance(r, Exception) for r in results)
        died = wait_dead(rig.running[victim], 15.0)
        logged = read_events(log)
        if n <= count:
            assert died, f"kill at event {n}: node {victim} did not die (it logged {len(logged)} events; the counting run {count}); the save: {results}"
            assert logged and logged[-1]["n"] == n, logged[-3:]
            killed.append(logged[-1])
        else:
            assert acked and not died and len(logged) == count, (results, died, len(logged))
            rig.running[victim].kill()
    for other in range(rig.nodes):  # the survivors: stop them too, so the last check sees a full restart
        if other != victim:
            # a graceful stop waits up to server.DRAIN_GRACE_S (60 s) for a save still open there;
            # one CI run (2026-11-25) saw node 0 outlast a 60 s limit here: its stacks go to its log now
            rig.running[other].stop(timeout_s=120.0)
    for n in range(rig.nodes):
        rig.start(n)
    committed_after_kill += check_after_restart(rig, before, step, acked)
    step += 1
    assert all(not isinstance(r, Exception) for r in rig.save(step)), "the save after the last restart failed"
    check_after_restart(rig, rig.committed(0)[:-1], step, True)

    kinds: dict[str, int] = {}
    for event in killed:
        kinds[event["kind"]] = kinds.get(event["kind"], 0) + 1
    summary = {
        "scenario": scenario, "events": count, "killed": len(killed), "kinds": kinds,
        "committed_after_kill": committed_after_kill, "warmups": warmups, "seconds": round(time.monotonic() - started, 1),
        "sequence": [f"{e['kind']} {Path(e['path']).relative_to(rig.root(victim))}" for e in events],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "sequence"}))
    print("\n".join(f"  {i + 1:3d} {line}" for i, line in enumerate(summary["sequence"])))
    assert [e["n"] for e in killed] == [n for n in points if n <= count]
    return summary


@pytest.fixture
def rig_factory(tmp_path: Path):
    made: list[Rig] = []

    def make(nodes: int) -> Rig:
        made.append(Rig(tmp_path / f"rig{len(made)}", nodes))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


# The default run kills at every fourth event, at every rename, after each commit and at the last
# two (kill_points: 26 of a single-node save's 60 points); `pytest -m long` kills at every event,
# and the member case (node 1 at each of its events, ~2 min on 2 cores).
@pytest.mark.parametrize("every", [4, pytest.param(1, marks=pytest.mark.long)])
def test_a_single_node_daemon_killed_at_every_file_event_of_a_save(rig_factory, every: int) -> None:
    crash_at_every_event(rig_factory(1), victim=0, scenario="single", every=every)


@pytest.mark.parametrize(
    "victim, scenario, every",
    [(0, "coordinator", 4), pytest.param(0, "coordinator", 1, marks=pytest.mark.long), pytest.param(1, "member", 1, marks=pytest.mark.long)],
)
def test_two_nodes_with_a_daemon_killed_at_every_file_event_of_a_save(rig_factory, victim: int, scenario: str, every: int) -> None:
    crash_at_every_event(rig_factory(2), victim=victim, scenario=scenario, every=every)


def test_the_kill_points_are_every_kth_event_each_rename_each_commit_and_the_end() -> None:
    kinds = ["mkdir"] * 12
    kinds[6] = kinds[8] = kinds[9] = "rename"  # events 7, 9 and 10 (10: the index's commit)
    paths = ["crash/step-5/x"] * 12
    paths[9] = "crash/step-5/.tmp-ckptd.index.json.91-1"
    events = [{"n": i + 1, "kind": k, "path": p} for i, (k, p) in enumerate(zip(kinds, paths))]
    assert kill_points(events, 4) == [1, 5, 7, 9, 10, 11, 12, 13]
    assert kill_points(events, 1) == list(range(1, 14))
