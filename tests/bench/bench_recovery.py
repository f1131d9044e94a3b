"""Time from a node's loss to training resumed, end to end (issue 34 item 3), beside its floor.

Three daemons on loopback (bench_replica's Cluster: node-local roots, their own shared memory,
--peers, --replicas 1, --keep-last 1) and a real job: one torchrun agent per node (static
rendezvous, gloo, `--nproc` ranks per node as processes; tests/bench/recovery_rank.py), its
state `--tensors` fp32 tensors row-sharded over the ranks, `--node-mib` MiB per node. The job
trains, saves every `--every` steps with the real client, `--saves` times, each waited durable,
and trains on. Once its last step is recoverable from memory (node 0's metric), node 1 is lost:
its daemon, its agent and its ranks SIGKILLed at once. Then, as a scheduler would:

  detection   the survivors' ranks fail their next collective and their agents exit
  (wipe)      node 1's root and shared memory are emptied (a new machine)
  restart     a replacement daemon on node 1, from its start until it answers health checks
  launch      the job relaunched with its launcher (3 agents), until every rank calls load;
              meanwhile node 1's new daemon stages its part from the buddy's memory
              (--replica-prefetch: "staged this node's part ... in S s, before they asked")
  load        until every rank's load returned; the load of node 1's rank that ended last
              (the node restored from its buddy) broken down into
              planning (its PlanLoad less a fetch in it), fetch (bytes from the buddy's memory
              fetched during the load, the daemon's "staged ... in S s" line: none when the
              prefetch was done before) and fill (its tensors filled), as the client's
              "planned in / filled in" line and node 1's daemon log say
  first step  until every rank has trained one step after the restore

Every phase is a difference of timestamps written by the ranks (JSON lines), the daemons (log
lines) or this script at the moment it acts; the phases are contiguous and add up to the total.
The restored state is checked bit-exact by every rank (after its first step). The floor: node
1's bytes divided by the bulk channel's raw throughput measured in the same run, on the same
files, before the loss (bench_replica.Holder: another process sends that many bytes from /dev/shm
over the bulk port into a fresh file in /dev/shm, over 1 connection and as many as a restore uses;
the faster counts).

    python tests/bench/bench_recovery.py                # 256 MiB per node, 300 tensors, 2 ranks per node
    python tests/bench/bench_recovery.py --quick        # a small sample (tests/test_bench_recovery.py)
"""

from __future__ import annotations

import argparse
import re
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench_replica import JOB, PREFETCHED, STAGED, Cluster, Holder, free_port, restore_streams, scrape  # tests/bench/bench_replica.py

RANK_SCRIPT = Path(__file__).with_name("recovery_rank.py")
LOST = 1  # the node that is lost; node 2 holds its part in memory
NODES = 3


@dataclass
class Settings:
    tensors: int
    node_mib: int
    nproc: int
    saves: int
    every: int


QUICK = Settings(tensors=24, node_mib=8, nproc=1, saves=1, every=2)
FULL = Settings(tensors=300, node_mib=256, nproc=2, saves=2, every=3)


class Job:
    """The job's launchers: one torchrun agent per node, each in a session of its own."""

    def __init__(self, cluster: Cluster, out: Path, settings: Settings, mode: str) -> None:
        self.out = out / mode
        self.out.mkdir(parents=True)
        port = free_port()
        spec = {"job": JOB, "mode": mode, "out": str(self.out), "tensors": settings.tensors, "node_mib": settings.node_mib,
                "nodes": NODES, "saves": settings.saves, "every": settings.every}
        self.agents: list[subprocess.Popen[bytes]] = []
        self.exited: dict[int, float] = {}
        for node in range(NODES):
            env = {**os.environ, "CKPTD_ADDRESS": cluster.address(node), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            env.pop("CKPTD_RUN_ID", None)  # the run id is torchrun's
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node),
                "--nproc-per-node", str(settings.nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--max-restarts", "0", "--monitor-interval", "0.1", str(RANK_SCRIPT), json.dumps(spec),
            ]
            with open(out / f"agent-{mode}-{node}.log", "wb") as log:
                self.agents.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def kill(self, node: int) -> None:
        """SIGKILL the node's agent and its ranks, as the node's loss would (torchrun starts each
        rank in a session of its own: they are the agent's children, not its session's)."""
        agent = self.agents[node]
        ranks = children(agent.pid)
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it had exited
        agent.wait()

    def wait(self, nodes: list[int], timeout_s: float) -> dict[int, float]:
        """Wait until the nodes' agents exited (polled every 10 ms); when each did (epoch seconds)."""
        deadline = time.monotonic() + timeout_s
        while any(n not in self.exited for n in nodes):
            for n in nodes:
                if n not in self.exited and self.agents[n].poll() is not None:
                    self.exited[n] = time.time()
            if time.monotonic() > deadline:
                raise SystemExit(f"the agents of nodes {[n for n in nodes if n not in self.exited]} did not exit within {timeout_s} s; see {self.out.parent}")
            time.sleep(0.01)
        return {n: self.exited[n] for n in nodes}

    def events(self) -> list[dict[str, Any]]:
        """Every rank's events, each with its "rank"."""
        found = []
        for path in sorted(self.out.glob("rank*.jsonl")):
            rank = int(path.stem[4:])
            found += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines() if line.strip()]
        return found

    def close(self) -> None:
        for node in range(NODES):
            self.kill(node)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def last(events: list[dict[str, Any]], event: str, **match: Any) -> float:
    """The latest time of `event` among the events that match."""
    times = [e["time"] for e in events if e["event"] == event and all(e.get(k) == v for k, v in match.items())]
    if not times:
        raise SystemExit(f"no rank logged {event!r} ({match}): {events[-5:]}")
    return max(times)


def log_time(line: str) -> float:
    """The epoch time of a daemon log line ("2026-11-29 12:11:34,123 INFO ...", local time)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def fetches(cluster: Cluster, since: float, pattern: "re.Pattern[str]" = STAGED) -> list[tuple[float, float]]:
    """(logged at, seconds) of node LOST's "staged ... from the memory of" lines after `since`
    (`pattern` PREFETCHED: its "staged this node's part ... before they asked" lines)."""
    found = []
    for line in cluster.log(LOST).read_text(errors="replace").splitlines():
        hit = pattern.search(line)
        if hit is not None and line[:4].isdigit() and log_time(line) >= since:
            found.append((log_time(line), float(hit.group(2))))
    return found


def wait_recoverable(cluster: Cluster, step: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while scrape(cluster.metrics[0], f'ckptd_recoverable_step{{job="{JOB}"}}') != step:
        if time.monotonic() > deadline:
            raise SystemExit(f"step {step} never became recoverable; see the daemons' logs in {cluster.base}")
        time.sleep(0.05)


def staged(cluster: Cluster, tier: str) -> float:
    """Node LOST's bytes staged for loads from `tier` (0 when it staged none: no sample yet)."""
    found = scrape(cluster.metrics[LOST], f'ckptd_load_staged_bytes_total{{tier="{tier}"}}')
    return 0.0 if math.isnan(found) else found


def part_bytes(cluster: Cluster, node: int) -> int:
    return sum(p.stat().st_size for p in (cluster.root(node) / JOB).rglob("*.safetensors"))


@dataclass
class Recovery:
    """One loss and recovery: phases as (name, start, end) epoch seconds (contiguous at the top
    level; an indented name is a part of the phase above it, `start` 0 for a bare duration), and
    what it restored against its floor."""

    killed: float
    rows: list[tuple[str, float, float]]
    nbytes: int
    loopback: float  # the bulk channel's raw throughput, GB/s
    cold: float  # a cold read of the same files, GB/s
    fetch_s: float
    load_s: float  # the load of the lost node's rank that finished last
    notes: list[str]
    checks: dict[str, bool]

    @property
    def total(self) -> float:
        return self.rows[-1][2] - self.killed

    @property
    def floor_s(self) -> float:
        return self.nbytes / (self.loopback * 1e9)

    def seconds(self) -> dict[str, float]:
        return {name.strip(): end - start for name, start, end in self.rows} | {"total": self.total}

    def print(self) -> None:
        print(f"\nnode {LOST} lost and replaced — breakdown (seconds; 'at' = since the kill):")
        for name, start, end in self.rows:
            at = f"{end - self.killed:8.3f}" if start else "        "
            print(f"  {name:<48} {end - start:8.3f}   at {at}")
        print(f"  {'total: loss to the first step trained':<48} {self.total:8.3f}")
        print(f"  the phases add up to {sum(end - start for name, start, end in self.rows if not name.startswith(' ')):.3f} s")
        print(f"floor: node {LOST}'s {self.nbytes / 2**20:.1f} MiB / the bulk channel's {self.loopback:.2f} GB/s = {self.floor_s:.3f} s"
              f" (a cold disk read of them: {self.cold:.2f} GB/s)")
        if self.fetch_s:
            print(f"  fetch {self.fetch_s:.3f} s = {self.fetch_s / self.floor_s:.2f}x the floor; node {LOST}'s slowest rank's load {self.load_s:.3f} s = "
                  f"{self.load_s / self.floor_s:.2f}x; the total {self.total:.1f} s = {self.total / self.floor_s:.0f}x")
        for note in self.notes:
            print(f"  {note}")
        for check, ok in self.checks.items():
            print(f"{check}: {'PASS' if ok else 'FAIL'}")


def ceilings(cluster: Cluster, nbytes: int) -> tuple[float, float]:
    """(cold read, bulk channel) GB/s for node LOST's part of `nbytes`: a sequential read of its
    data files after posix_fadvise(DONTNEED), and bench_replica's floor (Holder: the same bytes
    sent over the bulk port into fresh shared memory, 1 connection or as many as a restore uses)."""
    files = sorted((cluster.root(LOST) / JOB).rglob("*.safetensors"))
    os.sync()
    buffer = bytearray(8 * 2**20)
    start = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            offset = 0
            while (n := os.preadv(fd, [buffer], offset)) > 0:
                offset += n
        finally:
            os.close(fd)
    cold = sum(f.stat().st_size for f in files) / (time.perf_counter() - start) / 1e9
    holder = Holder(nbytes)
    try:
        loopback = max(holder.floor(streams) for streams in sorted({1, restore_streams(nbytes)}))
    finally:
        holder.close()
    return cold, loopback


def measure(settings: Settings, out: Path) -> Recovery:
    """Train, lose node LOST, replace it, relaunch and resume once; the timestamps and checks."""
    cluster = Cluster(out / f"recovery-{os.getpid()}", replicas=1)
    jobs: list[Job] = []
    try:
        jobs.append(train := Job(cluster, out, settings, "train"))
        step = settings.saves * settings.every
        while not any(e["event"] == "durable" and e["step"] == step for e in train.events()):
            if any(a.poll() is not None for a in train.agents):
                raise SystemExit(f"the job stopped before step {step} was durable; see {out}/agent-train-*.log")
            time.sleep(0.1)
        wait_recoverable(cluster, step)
        nbytes = part_bytes(cluster, LOST)
        cold, loopback = ceilings(cluster, nbytes)  # node 1's files: the floors, measured now (the replacement's root is empty)
        print(f"step {step} durable and recoverable; node {LOST}'s part {nbytes / 2**20:.1f} MiB; load {os.getloadavg()[0]:.2f}", flush=True)

        killed = time.time()
        train.kill(LOST)
        cluster.kill(LOST)
        detected = max(train.wait([n for n in range(NODES) if n != LOST], timeout_s=120).values())
        shutil.rmtree(cluster.root(LOST))
        for path in cluster.shm(LOST).iterdir():
            path.unlink()
        spawned = time.time()
        cluster.start(LOST)
        ready = time.time()
        jobs.append(resume := Job(cluster, out, settings, "resume"))
        resume.wait(list(range(NODES)), timeout_s=600)
        events = resume.events()

        ranks = sorted({e["rank"] for e in events})
        lost_ranks = {e["rank"] for e in events if e["event"] == "started" and e["node"] == LOST}
        begun, loaded, stepped = last(events, "load_begin"), last(events, "loaded"), last(events, "first_step")
        restorer = max(lost_ranks, key=lambda r: last(events, "loaded", rank=r))  # the lost node's rank whose load ended last
        own = last(events, "loaded", rank=restorer) - last(events, "load_begin", rank=restorer)
        timing = [e for e in events if e["event"] == "client_load" and e["rank"] == restorer][-1]
        fetched = fetches(cluster, spawned)
        prefetched = fetches(cluster, spawned, PREFETCHED)
        fetch_s = sum(s for _, s in fetched)  # every fetch of node LOST's part, before the load or in it
        ahead = prefetched[0][0] if prefetched else spawned  # the prefetch's own fetch is logged just before it
        in_load = sum(s for at, s in fetched if at > ahead)
        rows = [
            ("detection (the survivors' launchers exited)", killed, detected),
            ("  the first rank's collective failed", killed, min((e["time"] for e in train.events() if e["event"] == "lost"), default=float("nan"))),
            (f"(node {LOST} wiped: a new machine)", detected, spawned),
            ("restart (replacement daemon healthy)", spawned, ready),
            ("launch (agents, rendezvous, ranks at load)", ready, begun),
            ("  ranks' processes started", ready, max(e["process_start"] for e in events if e["event"] == "started")),
            ("  torch and the client imported", ready, last(events, "started")),
            ("  process groups formed", ready, last(events, "group")),
            *((f"  node {LOST}'s part prefetched by its daemon (from the buddy's memory)", at - seconds, at) for at, seconds in prefetched),
            ("load (every rank's load returned)", begun, loaded),
            (f"  node {LOST}'s slowest rank's load", last(events, "loaded", rank=restorer) - own, last(events, "loaded", rank=restorer)),
            ("    planning (PlanLoad less a fetch in it)", 0.0, timing["plan_s"] - in_load),
            ("    fetch in the load (from the buddy's memory)", 0.0, in_load),
            ("    fill (the rank's tensors filled)", 0.0, timing["fill_s"]),
            ("first step (every rank trained one step)", loaded, stepped),
        ]
        checked = [e for e in events if e["event"] == "checked"]
        codes = [a.returncode for a in resume.agents]
        staged_memory, staged_disk = (staged(cluster, tier) for tier in ("memory-peer", "disk-peer"))
        saved = [e for e in events if e["event"] == "saved_again"]
        notes = [f"node {LOST} staged {staged_memory:.0f} bytes of its {nbytes} from a peer's memory, {staged_disk:.0f} from a peer's disk"]
        if len(saved) == len(ranks):
            notes.append(f"the job went on: its next save (step {step + 1}) durable {last(events, 'saved_again') - stepped:.2f} s after the first step")
        checks = {
            f"restored bit-exact on all {NODES * settings.nproc} ranks": len(checked) == len(ranks) == NODES * settings.nproc and all(e["exact"] for e in checked) and codes == [0] * NODES,
            f"node {LOST}'s part read from the buddy's memory only": staged_memory >= 0.99 * nbytes and staged_disk == 0 and bool(fetched),  # its tensors' bytes, not every header byte
            "the job saved again after the recovery": len(saved) == len(ranks),
        }
        return Recovery(killed, rows, nbytes, loopback, cold, fetch_s, own, notes, checks)
    finally:
        for job in jobs:
            job.close()
        cluster.close()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.3f} ({min(values):.3f}-{max(values):.3f})"


def summary(recoveries: list[Recovery]) -> None:
    """Per phase, median (min-max) over the rounds; each check's verdict over all of them."""
    print(f"\nsummary over {len(recoveries)} rounds, seconds: median (min-max)")
    for name in recoveries[0].seconds():
        print(f"  {name:<48} {spread([r.seconds()[name] for r in recoveries])}")
    print(f"  {'floor (node bytes / bulk channel)':<48} {spread([r.floor_s for r in recoveries])}")
    if all(r.fetch_s for r in recoveries):
        for name, values in (("fetch / floor", [r.fetch_s / r.floor_s for r in recoveries]), (f"node {LOST}'s slowest rank's load / floor", [r.load_s / r.floor_s for r in recoveries])):
            print(f"  {name:<48} {spread(values)}")
    for check in recoveries[0].checks:
        print(f"{check}, every round: {'PASS' if all(r.checks[check] for r in recoveries) else 'FAIL'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a small sample: {QUICK}")
    parser.add_argument("--tensors", type=int, default=None, help=f"tensors of the state (default {FULL.tensors})")
    parser.add_argument("--node-mib", type=int, default=None, help=f"MiB of state per node (default {FULL.node_mib})")
    parser.add_argument("--nproc", type=int, default=None, help=f"ranks per node (default {FULL.nproc})")
    parser.add_argument("--rounds", type=int, default=None, help="losses and recoveries, each on a fresh cluster and job (default 2; --quick 1)")
    parser.add_argument("--out", type=Path, default=None, help="where the roots and logs go (a real disk; default: a temporary directory under /var/tmp, removed)")
    args = parser.parse_args()
    base = QUICK if args.quick else FULL
    settings = Settings(args.tensors or base.tensors, args.node_mib or base.node_mib, args.nproc or base.nproc, base.saves, base.every)
    rounds = args.rounds or (1 if args.quick else 2)
    out = args.out or Path(tempfile.mkdtemp(prefix="ckptd-bench-recovery-", dir="/var/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"cores {os.cpu_count()}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {settings}, {rounds} rounds; out {out}", flush=True)
    recoveries = []
    try:
        for r in range(rounds):
            print(f"\n== round {r + 1}", flush=True)
            recoveries.append(measure(settings, out / f"round{r + 1}"))
            recoveries[-1].print()
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    if rounds > 1:
        summary(recoveries)
    print(f"load at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if all(all(r.checks.values()) for r in recoveries) else 1


if __name__ == "__main__":
    sys.exit(main())
