"""Tier 0b benchmark: a lost node's slices restored from a peer's memory, against the same slices
restored from that node's disk (issue 23 target: at least 5x faster, bit-exact, another layout).

Two clusters of 3 daemons on loopback, each with node-local roots under `--out`, save the same
state (step 1) by 3 ranks, one per node, each holding a third of every tensor's rows:

- **memory** (`--replicas 1`): once the step is recoverable (node 0's metric), node 1 is
  *replaced*: its daemon SIGKILLed, its root and shared memory wiped, a new daemon started on the
  empty root. Its slices come from node 2's memory (tier memory-peer).
- **disk** (`--replicas 0`): node 1's daemon is SIGKILLed (its memory is gone: arenas die with
  it), its step files evicted from the page cache (posix_fadvise DONTNEED after a sync, so the
  restore reads the disk), and a new daemon started on the intact root: its slices come from
  its own disk (tier disk-local, read by the ranks themselves).

Then node 1's ranks load, in another layout: two ranks (threads of this process with their own
clients) each take half of node 1's rows. Timed: from a barrier just before both `load` calls
to the end of the slower one (the clients are made and connected before; the daemon restart is
not timed). Every loaded tensor is compared with what was saved. Memory and disk rounds are
interleaved (the order alternates), `--rounds` each; ratios are disk / memory per round, shown
as median (min-max). The sweep runs each "TENSORS:MiB" of `--sweep` (tensors of the state,
MiB of node 1's part).

The memory path's own figures: the daemon logs how long staging took and at what rate
("staged ... in S s"), parsed from node 1's log; `bulk` is that rate.

    python tests/bench/bench_replica.py --sweep 100:256,1000:256,100:1024 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptd.client import CheckpointClient
from ckptd.client.shards import LocalShard
from ckptd.demo.process import DaemonProcess, start_daemon

JOB = "bench-replica"
TOKEN = "bench-replica-token-0123456789"
TARGET = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
    return found[0] if found else float("nan")


@dataclass
class Cluster:
    """Three daemons with node-local roots; `replicas` the --replicas of every one."""

    base: Path
    replicas: int
    peers: list[str] = field(default_factory=list)
    metrics: list[int] = field(default_factory=list)
    running: dict[int, DaemonProcess] = field(default_factory=dict)
    starts: int = 0

    def __post_init__(self) -> None:
        self.peers = [f"127.0.0.1:{free_port()}" for _ in range(3)]
        self.metrics = [free_port() for _ in range(3)]
        self.base.mkdir(parents=True, exist_ok=True)
        self.sock = Path(tempfile.mkdtemp(prefix="ckb-"))
        for node in range(3):
            self.shm(node).mkdir(parents=True, exist_ok=True)
            self.start(node)

    def root(self, node: int) -> Path:
        return self.base / f"root{node}"

    def shm(self, node: int) -> Path:
        return Path("/dev/shm") / f"ckptd-bench-{self.base.name}-{node}"

    def log(self, node: int) -> Path:
        return self.base / f"node{node}.log"

    def start(self, node: int) -> None:
        self.starts += 1
        self.running[node] = start_daemon(
            self.root(node), self.sock / f"n{node}.sock",
            ["--shm-dir", str(self.shm(node)), "--node-rank", str(node), "--peers", ",".join(self.peers), "--replicas", str(self.replicas),
             "--metrics-port", str(self.metrics[node]), "--metrics-host", "127.0.0.1", "--keep-last", "1"],
            env={**os.environ, "CKPTD_PEER_TOKEN": TOKEN}, log_path=self.log(node), timeout_s=60,
        )

    def address(self, node: int) -> str:
        return self.running[node].address

    def kill(self, node: int) -> None:
        self.running[node].kill()

    def close(self) -> None:
        for daemon in self.running.values():
            daemon.kill()
        for node in range(3):
            shutil.rmtree(self.shm(node), ignore_errors=True)
        shutil.rmtree(self.sock, ignore_errors=True)


def make_state(tensors: int, node_mib: int) -> dict[str, torch.Tensor]:
    """`tensors` fp32 tensors of 3 * node_mib MiB in all, rows divisible by 6, random values."""
    each = 3 * node_mib * 2**20 // tensors // 4  # elements per tensor
    cols = 256 if each >= 6 * 256 else 6
    rows = max(6, each // cols // 6 * 6)
    g = torch.Generator().manual_seed(0)
    return {f"t{i:04d}": torch.randn(rows, cols, generator=g) for i in range(tensors)}


def shards(state: dict[str, torch.Tensor], lo_frac: tuple[int, int], hi_frac: tuple[int, int], fill: bool) -> dict[str, LocalShard]:
    out = {}
    for name, full in state.items():
        lo, hi = full.shape[0] * lo_frac[0] // lo_frac[1], full.shape[0] * hi_frac[0] // hi_frac[1]
        part = full[lo:hi].clone() if fill else torch.empty(hi - lo, full.shape[1])
        out[name] = LocalShard(part, (lo, 0), tuple(full.shape))
    return out


def save(cluster: Cluster, state: dict[str, torch.Tensor]) -> None:
    def rank(r: int) -> None:
        with CheckpointClient(JOB, address=cluster.address(r), rank=r, world_size=3, local_world_size=1, on_error="raise", timeout_s=600) as ckpt:
            ckpt.save(1, {"model": shards(state, (r, 3), (r + 1, 3), True)}).wait_durable(timeout=600)

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(rank, range(3)))


def timed_load(cluster: Cluster, state: dict[str, torch.Tensor]) -> float:
    """Node 1's two ranks (a world of 4: one rank on node 0, two on node 1, one on node 2) load
    halves of node 1's rows; returns the slower rank's seconds; checks every value."""
    halves = [((2, 6), (3, 6)), ((3, 6), (4, 6))]
    clients = [
        CheckpointClient(JOB, address=cluster.address(1), rank=1 + i, world_size=4, local_world_size=2, on_error="raise", timeout_s=600)
        for i in range(2)
    ]
    targets = [shards(state, lo, hi, False) for lo, hi in halves]
    barrier = threading.Barrier(2)
    seconds = [0.0, 0.0]

    def rank(i: int) -> None:
        barrier.wait()
        start = time.perf_counter()
        clients[i].load({"model": dict(targets[i])}, step=1)
        seconds[i] = time.perf_counter() - start

    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(rank, range(2)))
    finally:
        for c in clients:
            c.close()
    for (lo, hi), target in zip(halves, targets):
        expected = shards(state, lo, hi, True)
        bad = [n for n in state if not torch.equal(target[n].tensor, expected[n].tensor)]
        if bad:
            raise SystemExit(f"restore came back wrong: {bad[:5]}")
    return max(seconds)


def replace_node(cluster: Cluster) -> None:
    cluster.kill(1)
    shutil.rmtree(cluster.root(1))
    for p in cluster.shm(1).iterdir():
        p.unlink()
    cluster.start(1)


def restart_cold(cluster: Cluster) -> int:
    """Kill node 1, evict its step files from the page cache, start it again; bytes evicted."""
    cluster.kill(1)
    os.sync()
    evicted = 0
    for path in (cluster.root(1) / JOB).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            evicted += path.stat().st_size
    cluster.start(1)
    return evicted


STAGED = re.compile(r"staged ([\d.]+ \w+) of node 1's part .* in ([\d.]+) s \(([\d.]+) GB/s, (\d+) ranges in (\d+) connections\)")


def last_staging(cluster: Cluster) -> str:
    found = STAGED.findall(cluster.log(1).read_text(errors="replace"))
    return "-" if not found else f"{found[-1][2]} GB/s ({found[-1][0]}, {found[-1][3]} ranges, {found[-1][4]} conns)"


def wait_recoverable(cluster: Cluster, timeout_s: float = 600.0) -> float:
    start = time.monotonic()
    while scrape(cluster.metrics[0], f'ckptd_recoverable_step{{job="{JOB}"}}') != 1.0:
        if time.monotonic() - start > timeout_s:
            raise SystemExit("step 1 never became recoverable; see the daemons' logs in " + str(cluster.base))
        time.sleep(0.1)
    return time.monotonic() - start


def ceilings(cluster: Cluster) -> tuple[float, float]:
    """(cold read, loopback) GB/s of node 1's data files on this machine: a sequential read of
    them after posix_fadvise(DONTNEED), and the same bytes sent over loopback TCP by the bulk
    channel (sendfile) into a fresh file in /dev/shm (recv_into + pwrite): the two floors the
    disk and the memory path stand on."""
    from ckptd.daemon.tiers.bulk import BulkServer, connect, recv_into_file, send_file_ranges

    files = sorted((cluster.root(1) / JOB).rglob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
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
    cold = total / (time.perf_counter() - start) / 1e9
    server = BulkServer("127.0.0.1", 0)
    server.start()
    sinks = [Path(tempfile.mkstemp(prefix="ckptd-bench-sink-", dir="/dev/shm")[1]) for _ in files]
    try:
        start = time.perf_counter()
        for path, sink in zip(files, sinks):  # the files stay in the page cache from the read above
            fd = os.open(path, os.O_RDONLY)
            size = path.stat().st_size
            ticket = server.issue(lambda sock, fd=fd, size=size: send_file_ranges(sock, [(fd, 0, size)]))
            out = os.open(sink, os.O_WRONLY)
            with connect("127.0.0.1", server.port, ticket, None) as sock:
                recv_into_file(sock, out, 0, size, memoryview(bytearray(8 * 2**20)))
            os.close(out)
            os.close(fd)
        loopback = total / (time.perf_counter() - start) / 1e9
    finally:
        server.close()
        for sink in sinks:
            sink.unlink()
    return cold, loopback


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def run(tensors: int, node_mib: int, rounds: int, out: Path) -> dict[str, Any]:
    state = make_state(tensors, node_mib)
    part = sum(t.numel() * 4 for t in state.values()) // 3
    print(f"\n== {tensors} tensors, node 1's part {part / 2**20:.0f} MiB", flush=True)
    memory_cluster = Cluster(out / f"mem-{tensors}-{node_mib}", replicas=1)
    disk_cluster = Cluster(out / f"disk-{tensors}-{node_mib}", replicas=0)
    try:
        for cluster in (memory_cluster, disk_cluster):
            started = time.perf_counter()
            save(cluster, state)
            print(f"  saved ({'replicas 1' if cluster.replicas else 'replicas 0'}) in {time.perf_counter() - started:.1f} s", flush=True)
        print(f"  recoverable {wait_recoverable(memory_cluster):.2f} s after the save returned", flush=True)
        mem, disk, ratios = [], [], []
        for r in range(rounds):
            order = ("memory", "disk") if r % 2 == 0 else ("disk", "memory")
            got: dict[str, float] = {}
            for kind in order:
                if kind == "memory":
                    replace_node(memory_cluster)
                    got[kind] = timed_load(memory_cluster, state)
                    staging = last_staging(memory_cluster)
                else:
                    restart_cold(disk_cluster)
                    got[kind] = timed_load(disk_cluster, state)
            mem.append(got["memory"])
            disk.append(got["disk"])
            ratios.append(got["disk"] / got["memory"])
            print(
                f"  round {r + 1}: memory {got['memory']:.3f} s ({part / got['memory'] / 1e9:.2f} GB/s; staging {staging}), "
                f"disk {got['disk']:.3f} s ({part / got['disk'] / 1e9:.2f} GB/s), disk/memory {ratios[-1]:.2f}x; load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        served = scrape(memory_cluster.metrics[2], "ckptd_replica_served_bytes_total")
        print(f"  memory: {summary(mem)} s   disk: {summary(disk)} s   disk/memory: {summary(ratios)}x (target >= {TARGET})   node 2 served {served / 2**20:.0f} MiB")
        cold, loopback = ceilings(disk_cluster)
        print(f"  floors of this machine for node 1's files: cold read {cold:.2f} GB/s, loopback TCP into fresh /dev/shm {loopback:.2f} GB/s (ratio {loopback / cold:.2f})")
        return {"tensors": tensors, "part_mib": part / 2**20, "memory_s": mem, "disk_s": disk, "ratio": ratios, "floors": (cold, loopback)}
    finally:
        memory_cluster.close()
        disk_cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", default="100:256,1000:256,100:1024", help="TENSORS:MiB of node 1's part, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="where the roots go (a real disk; default: a temporary directory under /var/tmp)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ckptd-bench-replica-", dir="/var/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"cores {os.cpu_count()}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, roots in {out}, torch threads {torch.get_num_threads()}")
    results = []
    try:
        for item in args.sweep.split(","):
            tensors, mib = (int(x) for x in item.split(":"))
            results.append(run(tensors, mib, args.rounds, out))
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    print("\nsummary (disk / memory, median (min-max) of the rounds):")
    for r in results:
        verdict = "meets" if statistics.median(r["ratio"]) >= TARGET else "misses"
        cold, loopback = r["floors"]
        print(
            f"  {r['tensors']:>5} tensors, {r['part_mib']:>6.0f} MiB: {summary(r['ratio'])}x -> {verdict} the {TARGET}x target "
            f"(machine floors: loopback / cold read = {loopback / cold:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
