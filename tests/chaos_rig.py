"""The chaos suite (issue 30): several nodes, two jobs on the same daemons at once, random SIGKILLs
of daemons and ranks, and injected faults; then the one promise is checked.

Invariant: every step acknowledged durable (a rank's `wait_durable` returned) loads back
bit-exact, on the layout that saved it, unless retention removed it (`--keep-last` newer committed
steps of its job exist); a step whose stored bytes the chaos damaged on purpose may instead be
refused with an error, never loaded as other bytes. Nothing one job does may change the other's
saves or loads: both jobs' states are pure functions of (job, step, rank) (tests/chaos_rank.py),
so any bytes of the other job, of another step or another rank fail the bit-exact check.

Actions, one every `pause` seconds at random:
- kill a daemon (SIGKILL) and start it again a moment later, sometimes with a slow disk
  (`--write-throttle`);
- kill a job's ranks: one rank first, the rest a moment later (as torchrun restarts a group), then
  start the job again; it resumes from its newest committed step and checks what it loaded;
- damage a data file of a committed step (flip one byte; every step that links the same file is
  damaged with it);
- damage a replica another node holds in memory (flip one byte);
- fill a node's disk for a few seconds (each root is on its own small tmpfs; skipped where
  mounting is not allowed).

Used by tests/integration/test_chaos.py (a short run in CI) and tests/bench/chaos.py (long runs).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.demo.process import DaemonProcess, start_daemon
from daemon_rig import free_port, free_ports  # tests/daemon_rig.py

RANK_SCRIPT = Path(__file__).with_name("chaos_rank.py")
PEER_TOKEN = "chaos-peer-token-0123456789"
TMPFS_SIZE = "96m"


@dataclass
class ChaosReport:
    """What a run did and what it found: `failures` empty means the invariant held."""

    actions: Counter[str] = field(default_factory=Counter)
    acked: dict[str, list[int]] = field(default_factory=dict)
    failed_saves: dict[str, int] = field(default_factory=dict)
    verified: Counter[str] = field(default_factory=Counter)
    damaged: dict[str, list[int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        acked = {job: len(steps) for job, steps in self.acked.items()}
        return (
            f"actions {dict(self.actions)}; acknowledged saves {acked}; failed saves {self.failed_saves}; "
            f"verified {dict(self.verified)}; damaged steps {self.damaged}; skipped {self.skipped}; "
            f"failures {len(self.failures)}"
        )


class Node:
    """One node's daemon: its root on its own tmpfs (when it can be mounted), its shared memory."""

    def __init__(self, base: Path, index: int, peers: list[str], keep_last: int) -> None:
        self.index = index
        self.peers = peers
        self.keep_last = keep_last
        self.fs = base / f"fs{index}"
        self.fs.mkdir(parents=True)
        self.mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(self.fs)], capture_output=True
        ).returncode == 0 if os.geteuid() == 0 else False
        self.root = self.fs / "root"
        self.sock = base / f"n{index}.sock"
        self.shm = Path(os.environ.get("CKPTD_CHAOS_SHM", "/dev/shm")) / f"ckptd-chaos-{os.getpid()}-{index}"
        self.shm.mkdir(parents=True)
        self.log = base / f"node{index}.log"
        self.daemon: DaemonProcess | None = None
        self.slow = False

    def start(self, slow: bool = False) -> None:
        self.slow = slow
        args = [
            "--shm-dir", str(self.shm), "--node-rank", str(self.index), "--peers", ",".join(self.peers),
            "--keep-last", str(self.keep_last), "--disk-reserve", "0", "--save-timeout", "40",
        ]
        if slow:
            args += ["--write-throttle", "4MiB"]
        self.daemon = start_daemon(
            self.root, self.sock, args, env={**os.environ, "CKPTD_PEER_TOKEN": PEER_TOKEN}, log_path=self.log, timeout_s=60
        )

    @property
    def address(self) -> str:
        return f"unix://{self.sock}"

    def kill(self) -> None:
        if self.daemon is not None:
            self.daemon.kill()
            self.daemon = None

    def close(self) -> None:
        self.kill()
        if self.mounted and subprocess.run(["umount", str(self.fs)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.fs)], capture_output=True)
        subprocess.run(["rm", "-rf", str(self.shm)], capture_output=True)


class Job:
    """A job's ranks: one per node, a gloo group of their own."""

    def __init__(self, name: str, base: Path, nodes: list[Node]) -> None:
        self.name = name
        self.base = base
        self.nodes = nodes
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [base / f"{name}-rank{r}.jsonl" for r in range(len(nodes))]

    def start(self) -> None:
        port = free_port()
        self.procs = [
            self._spawn({"mode": "train", "port": port}, rank, node) for rank, node in enumerate(self.nodes)
        ]

    def _spawn(self, extra: dict[str, Any], rank: int, node: Node, log: Path | None = None) -> subprocess.Popen[bytes]:
        spec = {
            "job": self.name, "rank": rank, "world_size": len(self.nodes), "address": node.address,
            "log": str(log or self.logs[rank]), **extra,
        }
        out = open(self.base / f"{self.name}-rank{rank}.out", "ab")
        try:
            return subprocess.Popen([sys.executable, str(RANK_SCRIPT), json.dumps(spec)], stdout=out, stderr=subprocess.STDOUT)
        finally:
            out.close()

    def kill_one(self, rng: random.Random) -> None:
        live = [p for p in self.procs if p.poll() is None]
        if live:
            rng.choice(live).send_signal(signal.SIGKILL)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.procs = []

    def verify(self, steps: list[int], tag: str, timeout_s: float = 600) -> list[dict[str, Any]]:
        """Every rank loads each of `steps`; their results, one record per rank and step."""
        logs = [self.base / f"{self.name}-verify-{tag}-rank{r}.jsonl" for r in range(len(self.nodes))]
        procs = [self._spawn({"mode": "verify", "steps": steps}, r, node, log) for r, (node, log) in enumerate(zip(self.nodes, logs))]
        for p in procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
        return [{**rec, "rank": r} for r, log in enumerate(logs) for rec in read_records(log)]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a rank's log; a line cut by a SIGKILL is not a record."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def flip_byte(path: Path, rng: random.Random) -> bool:
    """Flip one byte of `path` in place (its inode: every hard link sees it). False if it is gone."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return False
        offset = rng.randrange(size)
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x5A]), offset)
        return True
    finally:
        os.close(fd)


class Chaos:
    """A chaos run: `run()` returns the report; `close()` (always) stops and removes everything."""

    def __init__(self, base: Path, seconds: float, seed: int, nodes: int = 3, jobs: tuple[str, ...] = ("alpha", "beta"),
                 keep_last: int = 3, pause: tuple[float, float] = (2.0, 5.0)) -> None:
        self.base = base
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.keep_last = keep_last
        self.pause = pause
        peers = [f"127.0.0.1:{port}" for port in free_ports(nodes)]
        self.nodes = [Node(base, n, peers, keep_last) for n in range(nodes)]
        self.jobs = [Job(name, base, self.nodes) for name in jobs]
        self.report = ChaosReport()
        self.damaged: dict[str, set[int]] = {job: set() for job in jobs}

    # ---------------------------------------------------------------- actions
    def _kill_daemon(self) -> None:
        node = self.rng.choice(self.nodes)
        node.kill()
        time.sleep(self.rng.uniform(0.2, 2.0))
        slow = self.rng.random() < 0.3
        node.start(slow=slow)
        self.report.actions["daemon killed" + (" (restarted with a slow disk)" if slow else "")] += 1

    def _kill_ranks(self) -> None:
        job = self.rng.choice(self.jobs)
        job.kill_one(self.rng)
        time.sleep(self.rng.uniform(0.1, 1.5))
        job.kill()
        job.start()
        self.report.actions["job's ranks killed"] += 1

    def _step_dirs(self, node: Node, job: str) -> list[Path]:
        where = node.root / job
        return sorted(p for p in where.glob("step-*") if (p / "ckptd.index.json").exists()) if where.is_dir() else []

    def _damage_file(self) -> None:
        node = self.rng.choice(self.nodes)
        job = self.rng.choice(self.jobs).name
        files = [f for d in self._step_dirs(node, job) for f in d.glob("*.safetensors")]
        if not files:
            return
        target = self.rng.choice(files)
        try:
            inode = target.stat().st_ino
        except FileNotFoundError:
            return
        if not flip_byte(target, self.rng):
            return
        for other in (node.root / job).glob("step-*/*.safetensors"):
            try:
                if other.stat().st_ino == inode:
                    self.damaged[job].add(int(other.parent.name.split("-")[1]))
            except FileNotFoundError:
                continue
        self.report.actions["data file damaged"] += 1

    def _damage_replica(self) -> None:
        node = self.rng.choice(self.nodes)
        replicas = [p for p in node.shm.glob("*.safetensors") if "-n" in p.name and "-s" in p.name]
        if not replicas:
            return
        target = self.rng.choice(replicas)
        if flip_byte(target, self.rng):
            # the replica's job and step are in its name (engine/replica_store.py): a load may refuse that step
            for job in self.damaged:
                if f"{job}-n" in target.name:
                    step = int(target.name.split("-s", 1)[1].split("-", 1)[0])
                    self.damaged[job].add(step)
            self.report.actions["replica damaged"] += 1

    def _fill_disk(self) -> None:
        node = self.rng.choice(self.nodes)
        if not node.mounted:
            return
        balloon = node.fs / "balloon"
        free = os.statvfs(node.fs).f_bavail * os.statvfs(node.fs).f_frsize
        with open(balloon, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, max(free - 4096, 1))
            except OSError:
                pass  # as full as it gets: that is the point
        time.sleep(self.rng.uniform(2.0, 5.0))
        balloon.unlink()
        self.report.actions["disk filled"] += 1

    # ---------------------------------------------------------------- the run
    def _enough(self, min_acked: int, min_actions: int) -> bool:
        acked = [len({rec["ack"] for log in job.logs for rec in read_records(log) if "ack" in rec}) for job in self.jobs]
        return min(acked) >= min_acked and sum(self.report.actions.values()) >= min_actions

    def run(self, min_acked: int = 0, min_actions: int = 0) -> ChaosReport:
        """Chaos for `seconds` once both jobs have saved, and on (up to twice as long again) until
        each job has `min_acked` acknowledged saves and `min_actions` actions were taken: a loaded
        machine gets the same test, slower."""
        if not all(n.mounted for n in self.nodes):
            self.report.skipped.append("disk full (no tmpfs could be mounted for the roots: not root, or no mount permission)")
        for node in self.nodes:
            node.start()
        for job in self.jobs:
            job.start()
        actions = [self._kill_daemon, self._kill_ranks, self._damage_file, self._damage_replica, self._fill_disk]
        weights = [3, 3, 1, 1, 1]
        self._wait_for_first_acks(timeout_s=180.0)  # the chaos starts once both jobs train and save
        deadline = time.monotonic() + self.seconds
        overtime = deadline + 2 * self.seconds
        while time.monotonic() < deadline or (time.monotonic() < overtime and not self._enough(min_acked, min_actions)):
            self.rng.choices(actions, weights)[0]()
            time.sleep(self.rng.uniform(*self.pause))
        for job in self.jobs:
            job.kill()
        self._check()
        return self.report

    def _wait_for_first_acks(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(any("ack" in rec for log in job.logs for rec in read_records(log)) for job in self.jobs):
                return
            time.sleep(0.5)
        raise TimeoutError(f"not every job acknowledged a save within {timeout_s} s of starting: see the *.out files in {self.base}")

    def _committed(self, job: str) -> list[int]:
        return sorted({int(d.name.split("-")[1]) for d in self._step_dirs(self.nodes[0], job)})

    def _check(self) -> None:
        # A clean restart of every daemon: what follows reads what is durable, not what is in memory.
        for node in self.nodes:
            node.kill()
        for node in self.nodes:
            node.start()
        for job in self.jobs:
            records = [rec for log in job.logs for rec in read_records(log)]
            acked = sorted({rec["ack"] for rec in records if "ack" in rec})
            damaged = self.damaged[job.name]
            self.report.acked[job.name] = acked
            self.report.failed_saves[job.name] = sum(1 for rec in records if "failed" in rec)
            self.report.damaged[job.name] = sorted(damaged)
            for rec in records:
                # a resume that failed (a daemon down) is retried by the rank; loading other bytes never is allowed
                if "resume" in rec and rec["result"].startswith("mismatch"):
                    self.report.failures.append(f"job {job.name}: the resume from step {rec['resume']} gave {rec['result']}")
            committed = self._committed(job.name)
            kept = []
            for step in acked:
                if step in committed:
                    kept.append(step)
                elif sum(1 for c in committed if c > step) < self.keep_last:
                    self.report.failures.append(
                        f"job {job.name}: step {step} was acknowledged durable and is gone, with only "
                        f"{sum(1 for c in committed if c > step)} newer committed steps (committed: {committed})"
                    )
            results = job.verify(kept, "final")
            seen = {(rec["verify"], rec["rank"]) for rec in results}
            for step in kept:
                for r in range(len(self.nodes)):
                    if (step, r) not in seen:
                        self.report.failures.append(f"job {job.name}: rank {r} did not report its load of step {step}")
            for rec in results:
                result, step = rec["result"], rec["verify"]
                if result == "exact":
                    self.report.verified["exact"] += 1
                elif result.startswith("error") and step in damaged:
                    self.report.verified["refused (damaged on purpose)"] += 1
                else:
                    self.report.failures.append(f"job {job.name}: rank {rec['rank']} loading acknowledged step {step}: {result}")

    def close(self) -> None:
        for job in self.jobs:
            job.kill()
        for node in self.nodes:
            node.close()
