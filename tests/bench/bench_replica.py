"""Bench: a lost node's slices restored from a peer's memory, against the bulk channel's floor
and against a cold restore from its disk, at a fast and at a cluster's storage-to-network ratio
(issues 23 and 34).

Per "TENSORS:MiB" of `--sweep` (tensors of the state, MiB of node 1's part), two clusters of 3
daemons on loopback, each with node-local roots, save the same state (step 1) by 3 ranks, one
per node, each holding a third of every tensor's rows. Then, in each round, interleaved (the
order rotates round by round):

- **floor**: the bulk channel alone, node 1's part's bytes from a holder *process* (a replica file
  in /dev/shm, `sendfile`) to this one (`recv_into` + `pwrite` into a fresh file in /dev/shm), over
  one connection and over as many as a restore uses (tiers/replicas.FETCH_STREAMS, no more than
  the cores); the floor is the faster of the two. Nothing is checked: raw bytes.
- **memory** (`--replicas 1`): node 1 is *replaced*: its daemon SIGKILLed, its root and shared
  memory wiped, a new daemon started on the empty root. Its slices come from node 2's memory
  (tier memory-peer), checked on arrival by node 1's daemon, which starts fetching them as it
  starts (--replica-prefetch, on by default: node 0 tells it where its part is held), while
  its ranks' processes start, as a relaunched job's do (on a real cluster the relaunch takes
  seconds longer than here: 10.5 s in bench_recovery.py). Timed as the ranks see it.
- **on demand**: the same, node 1's new daemon started with --no-replica-prefetch: the fetch
  starts when the ranks ask, so this row times the fetch itself against the floor.
- **disk** (`--replicas 0`): node 1's daemon is SIGKILLed (its memory is gone: arenas die with
  it), its step files evicted from the page cache (posix_fadvise DONTNEED after a sync, so the
  restore reads the device), and a new daemon started on the intact root: its slices come from
  its own disk (tier disk-local, read and checked by the ranks themselves).

Node 1's ranks load, in another layout: two ranks, each a process of its own as on a real node
(`--ranks-as threads`: two threads of this process, the way before 2026-11-30, whose Python
waits for each other's), each take half of node 1's rows. Timed: from the moment both are told
to go to the end of the slower one (the processes started, their clients made and their
targets made before; the daemon restart is not). The targets are written before the go
(zeros), as a relaunched trainer's model is initialized and its optimizer state made before it
loads into them (`--untouched-targets`: torch.empty, memory the load itself faults in: the
benchmark's way before 2026-11-30's afternoon). Every loaded tensor is compared with what was
saved (by xxh3 digest, for the processes).

Storage: the roots live on an ext4 file system on a loop device (`losetup --direct-io=on`, an
image under --out), and this process and every daemon it starts run in a cgroup v1 blkio group
of their own. Phase 1 reads the device unlimited; phase 2 limits reads from it
(`blkio.throttle.read_bps_device`) to 1/10 of the floor measured in phase 1, a cluster's ratio
of shared storage to network. Without root, cgroup v1 blkio, losetup or mkfs.ext4 the roots go
on a plain directory and phase 2 is skipped, saying why.

Targets (issue 34), PASS/FAIL each, ratios taken per round (median of the rounds):
memory restore >= 0.8x the floor (phase 1, bytes per second); with reads limited: disk
time / memory time >= 5. Both are judged on the restore as the ranks see it (memory), and
shown for the fetch on demand beside it.

    python tests/bench/bench_replica.py                     # the full sweep, about 5-10 minutes on 2 idle cores
    python tests/bench/bench_replica.py --quick             # a small sample (CI: tests/test_bench_replica.py)

The daemon's own figure for the memory path (how long staging took, "staged ... in S s") is
parsed from node 1's log and shown beside each round.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch
import xxhash

from ckptd.client import CheckpointClient
from ckptd.client.shards import LocalShard
from ckptd.daemon.tiers.bulk import BUFFER_BYTES, BulkServer, connect, recv_into_file, send_file_ranges
from ckptd.daemon.tiers.replicas import FETCH_STREAMS, STREAM_MIN_BYTES
from ckptd.demo.process import DaemonProcess, start_daemon

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the test rig's port allocator
from daemon_rig import free_port  # noqa: E402  (below the ephemeral range: a restarted daemon binds its port again)

JOB = "bench-replica"
TOKEN = "bench-replica-token-0123456789"
FLOOR_TARGET = 0.8  # memory restore / floor, phase 1
DISK_TARGET = 5.0  # disk restore time / memory restore time, reads limited
SLOW_RATIO = 10  # phase 2: storage reads limited to floor / SLOW_RATIO
BLKIO = Path("/sys/fs/cgroup/blkio")


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
    log_marks: dict[int, int] = field(default_factory=dict)  # node -> where its running daemon's lines begin in its log

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
        return Path("/dev/shm") / f"ckptd-bench-replica-{os.getpid()}-{self.base.name}-{node}"

    def log(self, node: int) -> Path:
        return self.base / f"node{node}.log"

    def start(self, node: int, *extra: str) -> None:
        self.starts += 1
        self.log_marks[node] = self.log(node).stat().st_size if self.log(node).exists() else 0
        self.running[node] = start_daemon(
            self.root(node), self.sock / f"n{node}.sock",
            ["--shm-dir", str(self.shm(node)), "--node-rank", str(node), "--peers", ",".join(self.peers), "--replicas", str(self.replicas),
             "--metrics-port", str(self.metrics[node]), "--metrics-host", "127.0.0.1", "--keep-last", "1", *extra],
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


def tensor_shape(tensors: int, node_mib: int) -> tuple[int, int]:
    """(rows, cols) of every tensor of make_state(tensors, node_mib)."""
    each = 3 * node_mib * 2**20 // tensors // 4  # elements per tensor
    cols = 256 if each >= 6 * 256 else 6
    return max(6, each // cols // 6 * 6), cols


def make_state(tensors: int, node_mib: int) -> dict[str, torch.Tensor]:
    """`tensors` fp32 tensors of 3 * node_mib MiB in all, rows divisible by 6, random values."""
    rows, cols = tensor_shape(tensors, node_mib)
    g = torch.Generator().manual_seed(0)
    return {f"t{i:04d}": torch.randn(rows, cols, generator=g) for i in range(tensors)}


def shards(state: dict[str, torch.Tensor], lo_frac: tuple[int, int], hi_frac: tuple[int, int], fill: bool, touched: bool = True) -> dict[str, LocalShard]:
    """Each tensor's rows [lo_frac, hi_frac) as a LocalShard: the saved values (fill), else a
    target of zeros (touched: its memory written, as a trainer's model is) or torch.empty."""
    out = {}
    for name, full in state.items():
        lo, hi = full.shape[0] * lo_frac[0] // lo_frac[1], full.shape[0] * hi_frac[0] // hi_frac[1]
        part = full[lo:hi].clone() if fill else _target(hi - lo, full.shape[1], touched)
        out[name] = LocalShard(part, (lo, 0), tuple(full.shape))
    return out


def _target(rows: int, cols: int, touched: bool) -> torch.Tensor:
    return torch.zeros(rows, cols) if touched else torch.empty(rows, cols)


def save(cluster: Cluster, state: dict[str, torch.Tensor]) -> None:
    def rank(r: int) -> None:
        with CheckpointClient(JOB, address=cluster.address(r), rank=r, world_size=3, local_world_size=1, on_error="raise", timeout_s=600) as ckpt:
            ckpt.save(1, {"model": shards(state, (r, 3), (r + 1, 3), True)}).wait_durable(timeout=600)

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(rank, range(3)))


HALVES = [((2, 6), (3, 6)), ((3, 6), (4, 6))]  # node 1's ranks 1 and 2: each half of node 1's third of the rows


def timed_load(cluster: Cluster, state: dict[str, torch.Tensor], ranks_as: str = "processes", touched: bool = True) -> float:
    """Node 1's two ranks (a world of 4: one rank on node 0, two on node 1, one on node 2) load
    halves of node 1's rows; returns the seconds from both ranks' start to the slower one's end;
    checks every value. ranks_as "processes": each rank a process of its own, as on a real
    node (rank_worker); "threads": two threads of this process, which share its interpreter
    lock (the benchmark's way before 2026-11-30: one rank's Python waits for the other's).
    touched: the targets written before the go (`shards`)."""
    if ranks_as == "processes":
        return _timed_load_processes(cluster, state, touched)
    halves = HALVES
    clients = [
        CheckpointClient(JOB, address=cluster.address(1), rank=1 + i, world_size=4, local_world_size=2, on_error="raise", timeout_s=600)
        for i in range(2)
    ]
    targets = [shards(state, lo, hi, False, touched) for lo, hi in halves]
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


def _timed_load_processes(cluster: Cluster, state: dict[str, torch.Tensor], touched: bool) -> float:
    """timed_load with each rank a process (rank_worker): both are started, their clients made
    and their targets allocated, then told to go at once; timed from that moment (the
    monotonic clock is the machine's) to the later one's end. Each returns an xxh3 digest of
    every tensor it loaded, compared here with the saved values."""
    rows, cols = next(iter(state.values())).shape
    command = [sys.executable, str(Path(__file__).resolve()), "--rank-worker", cluster.address(1), str(len(state)), str(rows), str(cols), str(int(touched))]
    workers = [subprocess.Popen([*command, str(rank)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for rank in (1, 2)]
    try:
        for worker in workers:
            assert worker.stdout is not None
            if worker.stdout.readline().strip() != "ready":
                raise SystemExit(f"a rank process did not start (exit status {worker.wait(60)})")
        go = time.monotonic()
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        answers = []
        for worker in workers:
            assert worker.stdout is not None
            line = worker.stdout.readline()
            if not line:
                raise SystemExit(f"a rank process failed to load (exit status {worker.wait(60)})")
            answers.append(json.loads(line))
        for worker in workers:
            worker.wait(60)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for (lo, hi), answer in zip(HALVES, answers):
        expected = shards(state, lo, hi, True)
        bad = [n for n in state if answer["digests"][n] != xxhash.xxh3_64_hexdigest(expected[n].tensor.numpy())]
        if bad:
            raise SystemExit(f"restore came back wrong: {bad[:5]}")
    return max(answer["ended"] for answer in answers) - go


def rank_worker(address: str, tensors: int, rows: int, cols: int, touched: int, rank: int) -> None:
    """One of node 1's ranks (1 or 2) in a process of its own (_timed_load_processes): its client
    made and its half of node 1's rows made (`_target`), prints "ready", loads step 1 once a line comes
    on stdin, then prints {"ended": time.monotonic() at the end of the load, "digests": {tensor:
    xxh3 of its bytes}} as one JSON line."""
    (lo_n, lo_d), (hi_n, hi_d) = HALVES[rank - 1]
    lo, hi = rows * lo_n // lo_d, rows * hi_n // hi_d
    targets = {f"t{i:04d}": LocalShard(_target(hi - lo, cols, bool(touched)), (lo, 0), (rows, cols)) for i in range(tensors)}
    with CheckpointClient(JOB, address=address, rank=rank, world_size=4, local_world_size=2, on_error="raise", timeout_s=600) as client:
        # The full garbage collection that importing torch leaves due in a fresh process (~0.1 s
        # here, over its ~10^5 objects) otherwise falls inside whichever call comes next: paid
        # before the go, as a relaunched trainer pays it while it builds its model.
        gc.collect()
        print("ready", flush=True)
        sys.stdin.readline()
        client.load({"model": dict(targets)}, step=1)
        ended = time.monotonic()
    digests = {name: xxhash.xxh3_64_hexdigest(shard.tensor.numpy()) for name, shard in targets.items()}
    print(json.dumps({"ended": ended, "digests": digests}), flush=True)


def replace_node(cluster: Cluster, prefetch: bool) -> None:
    cluster.kill(1)
    shutil.rmtree(cluster.root(1))
    for p in cluster.shm(1).iterdir():
        p.unlink()
    cluster.start(1, *(() if prefetch else ("--no-replica-prefetch",)))


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


PREFETCHED = re.compile(r"staged this node's part \(([\d.]+ \w+), held by nodes \[[\d, ]*\]\) for its ranks' load in ([\d.]+) s")


def last_staging(cluster: Cluster) -> str:
    with open(cluster.log(1), "rb") as log:  # the running daemon's lines only
        log.seek(cluster.log_marks.get(1, 0))
        text = log.read().decode(errors="replace")
    found = STAGED.findall(text)
    staging = "-" if not found else f"{found[-1][2]} GB/s ({found[-1][0]}, {found[-1][3]} ranges, {found[-1][4]} conns)"
    prefetched = PREFETCHED.findall(text)
    return staging if not prefetched else f"{staging}, prefetched in {prefetched[-1][1]} s"


def wait_recoverable(cluster: Cluster, timeout_s: float = 600.0) -> float:
    start = time.monotonic()
    while scrape(cluster.metrics[0], f'ckptd_recoverable_step{{job="{JOB}"}}') != 1.0:
        if time.monotonic() - start > timeout_s:
            raise SystemExit("step 1 never became recoverable; see the daemons' logs in " + str(cluster.base))
        time.sleep(0.1)
    return time.monotonic() - start


class Storage:
    """Where the roots live: an ext4 file system on a loop device in a blkio cgroup of this
    process (and so of every daemon it starts) whose reads from the device can be limited
    (`limit`); or a plain directory when that cannot be had here (`why_not` says why)."""

    def __init__(self, out: Path, image_gib: int) -> None:
        self.out = out
        self.why_not = self._missing()
        self.device = ""
        self.cgroup: Path | None = None
        self.mount = out / "roots"
        self.image = out / "roots.img"
        self.mount.mkdir(parents=True, exist_ok=True)
        if self.why_not:
            return
        try:
            subprocess.run(["truncate", "-s", f"{image_gib}G", str(self.image)], check=True)
            self.device = _run(["losetup", "--find", "--show", "--direct-io=on", str(self.image)])
            _run(["mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.device])
            _run(["mount", self.device, str(self.mount)])
            self.major_minor = _run(["lsblk", "-dno", "MAJ:MIN", self.device]).strip()
            self.cgroup = BLKIO / f"ckptd-bench-replica-{os.getpid()}"
            self.cgroup.mkdir()
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        except (OSError, subprocess.CalledProcessError) as exc:
            self.why_not = f"setting up the loop device and its blkio group failed: {exc}"
            self.close()
            self.mount.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _missing() -> str:
        if os.geteuid() != 0:
            return "not root (a loop device, a mount and a blkio cgroup need it)"
        if not (BLKIO / "blkio.throttle.read_bps_device").exists():
            return f"no cgroup v1 blkio hierarchy with throttling at {BLKIO}"
        for tool in ("losetup", "mkfs.ext4", "mount", "umount", "lsblk", "truncate"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        return ""

    def limit(self, read_bps: int) -> None:
        """Limit this group's reads from the roots' device to read_bps bytes per second (0: none)."""
        assert self.cgroup is not None
        (self.cgroup / "blkio.throttle.read_bps_device").write_text(f"{self.major_minor} {read_bps}")

    def describe(self) -> str:
        if self.why_not:
            return f"roots in {self.mount} (a plain directory: {self.why_not})"
        return f"roots on {self.device} (ext4, loop --direct-io=on, image {self.image}) in blkio group {self.cgroup}"

    def close(self) -> None:
        """Leave the group, unmount, detach, remove the group and the image (each step tried)."""
        if self.cgroup is not None:
            try:
                (BLKIO / "cgroup.procs").write_text(str(os.getpid()))
                self.cgroup.rmdir()
            except OSError as exc:
                print(f"could not remove {self.cgroup}: {exc}", file=sys.stderr)
            self.cgroup = None
        if self.device:
            subprocess.run(["umount", str(self.mount)], check=False)
            subprocess.run(["losetup", "-d", self.device], check=False)
            self.device = ""
        self.image.unlink(missing_ok=True)
        shutil.rmtree(self.mount, ignore_errors=True)


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


class Holder:
    """The floor's sending side: another process holding a file in /dev/shm of node 1's part's
    size (as a buddy holds a replica) behind a bulk port (tiers/bulk.BulkServer), handing out
    tickets that send it in `streams` contiguous pieces (`--holder`, below)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.proc = subprocess.Popen([sys.executable, __file__, "--holder", str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def floor(self, streams: int) -> float:
        """GB/s of the part sent over `streams` connections into a fresh file in /dev/shm."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{streams}\n")
        self.proc.stdin.flush()
        tickets = [bytes.fromhex(t) for t in self.proc.stdout.readline().split()]
        pieces = floor_pieces(self.nbytes, streams)
        fd, sink = tempfile.mkstemp(prefix="ckptd-bench-replica-floor-", dir="/dev/shm")
        try:
            def receive(i: int) -> None:
                offset, nbytes = pieces[i]
                with connect("127.0.0.1", self.port, tickets[i], None) as sock:
                    recv_into_file(sock, fd, offset, nbytes, memoryview(bytearray(min(BUFFER_BYTES, nbytes))))

            start = time.perf_counter()
            with ThreadPoolExecutor(streams) as pool:
                list(pool.map(receive, range(streams)))
            return self.nbytes / (time.perf_counter() - start) / 1e9
        finally:
            os.close(fd)
            os.unlink(sink)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def floor_pieces(nbytes: int, streams: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of `streams` contiguous pieces of about equal size, cut at 1 MiB."""
    step = -(-nbytes // streams // 2**20) * 2**20 or nbytes
    return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)][:streams]


def serve_holder(nbytes: int) -> None:
    """`--holder NBYTES`: hold NBYTES of random bytes in /dev/shm behind a bulk port; print the
    port, then for each line "STREAMS" read from stdin, print a ticket per piece (hex)."""
    fd, path = tempfile.mkstemp(prefix="ckptd-bench-replica-held-", dir="/dev/shm")
    os.unlink(path)  # gone with this process
    block = os.urandom(2**20)
    for offset in range(0, nbytes, len(block)):
        os.pwrite(fd, block[: nbytes - offset], offset)
    server = BulkServer("127.0.0.1", 0)
    server.start()
    print(server.port, flush=True)
    for line in sys.stdin:
        pieces = floor_pieces(nbytes, int(line))
        tickets = [server.issue(lambda sock, o=o, n=n: send_file_ranges(sock, [(fd, o, n)])) for o, n in pieces]
        print(" ".join(t.hex() for t in tickets), flush=True)
    server.close()


def restore_streams(nbytes: int) -> int:
    """The connections a restore of nbytes from one holder uses (Replication.fetch)."""
    return max(1, min(FETCH_STREAMS, os.cpu_count() or 1, nbytes // STREAM_MIN_BYTES))


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def rounds_of(
    memory_cluster: Cluster, disk_cluster: Cluster, holder: Holder, state: dict[str, torch.Tensor], part: int, rounds: int, label: str,
    ranks_as: str = "processes", touched: bool = True,
) -> dict[str, list[float]]:
    """`rounds` rounds of floor, memory (prefetched), on demand and disk, the order rotated each
    round; seconds (floor: GB/s)."""
    kinds = ("floor", "memory", "on-demand", "disk")
    got: dict[str, list[float]] = {k: [] for k in (*kinds, "floor1", "floorN")}
    streams = restore_streams(part)
    for r in range(rounds):
        order = kinds[r % 4:] + kinds[: r % 4]
        staging = demand_staging = "-"
        for kind in order:
            if kind == "floor":
                one, many = holder.floor(1), holder.floor(streams)
                got["floor1"].append(one)
                got["floorN"].append(many)
                got["floor"].append(max(one, many))
            elif kind in ("memory", "on-demand"):
                replace_node(memory_cluster, prefetch=kind == "memory")
                got[kind].append(timed_load(memory_cluster, state, ranks_as, touched))
                if kind == "memory":
                    staging = last_staging(memory_cluster)
                else:
                    demand_staging = last_staging(memory_cluster)
            else:
                restart_cold(disk_cluster)
                got["disk"].append(timed_load(disk_cluster, state, ranks_as, touched))
        floor, mem, demand, disk = got["floor"][-1], got["memory"][-1], got["on-demand"][-1], got["disk"][-1]
        print(
            f"  {label} round {r + 1} ({', '.join(order)}): floor {floor:.2f} GB/s (1 conn {got['floor1'][-1]:.2f}, {streams} conns {got['floorN'][-1]:.2f}); "
            f"memory {mem:.3f} s ({part / mem / 1e9:.2f} GB/s = {part / mem / 1e9 / floor:.2f}x the floor; staging {staging}); "
            f"on demand {demand:.3f} s ({part / demand / 1e9 / floor:.2f}x the floor; staging {demand_staging}); "
            f"disk {disk:.3f} s ({part / disk / 1e9:.2f} GB/s); disk/memory {disk / mem:.2f}x; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return got


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def run(tensors: int, node_mib: int, rounds: int, storage: Storage, ranks_as: str = "processes", touched: bool = True) -> list[str]:
    """One sweep item, both phases; its PASS/FAIL lines."""
    state = make_state(tensors, node_mib)
    part = sum(t.numel() * 4 for t in state.values()) // 3
    print(f"\n== {tensors} tensors, node 1's part {part / 2**20:.0f} MiB", flush=True)
    base = storage.mount / f"{tensors}-{node_mib}"
    memory_cluster = Cluster(base / "mem", replicas=1)
    disk_cluster = Cluster(base / "disk", replicas=0)
    holder = Holder(part)
    name = f"{tensors} tensors, {part / 2**20:.0f} MiB"
    try:
        for cluster in (memory_cluster, disk_cluster):
            started = time.perf_counter()
            save(cluster, state)
            print(f"  saved ({'replicas 1' if cluster.replicas else 'replicas 0'}) in {time.perf_counter() - started:.1f} s", flush=True)
        print(f"  recoverable {wait_recoverable(memory_cluster):.2f} s after the save returned", flush=True)
        fast = rounds_of(memory_cluster, disk_cluster, holder, state, part, rounds, "reads unlimited", ranks_as, touched)
        of_floor = [part / m / 1e9 / f for m, f in zip(fast["memory"], fast["floor"])]
        demand_of_floor = [part / m / 1e9 / f for m, f in zip(fast["on-demand"], fast["floor"])]
        lines = [
            f"{name}: memory restore / floor = {summary(of_floor)} as the ranks see it, prefetched (floor {summary(fast['floor'])} GB/s, memory "
            f"{summary([part / m / 1e9 for m in fast['memory']])} GB/s, disk/memory {summary([d / m for d, m in zip(fast['disk'], fast['memory'])])}x), "
            f"target >= {FLOOR_TARGET}: {verdict(statistics.median(of_floor) >= FLOOR_TARGET)}; on demand {summary(demand_of_floor)}"
        ]
        if storage.why_not:
            lines.append(f"{name}: reads limited to floor/{SLOW_RATIO}: NOT MEASURED: {storage.why_not}")
            return lines
        rate = int(statistics.median(fast["floor"]) * 1e9 / SLOW_RATIO)
        storage.limit(rate)
        try:
            print(f"  the roots' reads limited to {rate / 1e6:.0f} MB/s (floor/{SLOW_RATIO})", flush=True)
            slow = rounds_of(memory_cluster, disk_cluster, holder, state, part, rounds, "reads limited", ranks_as, touched)
        finally:
            storage.limit(0)
        ratios = [d / m for d, m in zip(slow["disk"], slow["memory"])]
        demand_ratios = [d / m for d, m in zip(slow["disk"], slow["on-demand"])]
        lines.append(
            f"{name}: reads limited to {rate / 1e6:.0f} MB/s: disk/memory = {summary(ratios)}x as the ranks see it (memory {summary(slow['memory'])} s, disk "
            f"{summary(slow['disk'])} s), target >= {DISK_TARGET}: {verdict(statistics.median(ratios) >= DISK_TARGET)}; on demand {summary(demand_ratios)}x"
        )
        return lines
    finally:
        holder.close()
        memory_cluster.close()
        disk_cluster.close()
        shutil.rmtree(base, ignore_errors=True)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", default="100:256,1000:256,100:1024,1000:1024", help="TENSORS:MiB of node 1's part, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small sample: 20 tensors, 16 MiB, one round")
    parser.add_argument("--out", type=Path, default=None, help="where the roots' image goes (a real disk; default: a temporary directory under /var/tmp)")
    parser.add_argument(
        "--ranks-as", choices=("processes", "threads"), default="processes",
        help="node 1's two loading ranks as processes of their own (default, as on a real node) or as threads of this process (the way before 2026-11-30)",
    )
    parser.add_argument(
        "--untouched-targets", action="store_true",
        help="the ranks load into torch.empty tensors, whose memory the load faults in (default: zeros, written before the go, as a trainer's model is)",
    )
    parser.add_argument("--holder", type=int, default=0, help=argparse.SUPPRESS)  # the floor's holder process (serve_holder)
    parser.add_argument("--rank-worker", nargs=6, default=None, help=argparse.SUPPRESS)  # ADDRESS TENSORS ROWS COLS TOUCHED RANK: rank_worker
    args = parser.parse_args()
    if args.rank_worker:
        address, *numbers = args.rank_worker
        rank_worker(address, *(int(x) for x in numbers))
        return 0
    if args.holder:
        serve_holder(args.holder)
        return 0
    if args.quick:
        args.sweep, args.rounds = "20:16", 1
    sweep = [tuple(int(x) for x in item.split(":")) for item in args.sweep.split(",")]
    signal.signal(signal.SIGTERM, _interrupted)
    out = args.out or Path(tempfile.mkdtemp(prefix="ckptd-bench-replica-", dir="/var/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    image_gib = max(2, -(-6 * max(mib for _, mib in sweep) // 1024) + 1)  # two clusters of 3 nodes, step 1 kept
    storage = Storage(out, image_gib)
    started = os.getloadavg()
    targets = "torch.empty (untouched)" if args.untouched_targets else "zeros (written before the go)"
    print(
        f"cores {os.cpu_count()}, load {' '.join(f'{x:.2f}' for x in started)}, torch threads {torch.get_num_threads()}; node 1's ranks as {args.ranks_as}, "
        f"their targets {targets}; {storage.describe()}",
        flush=True,
    )
    lines: list[str] = []
    try:
        for tensors, mib in sweep:
            lines += run(tensors, mib, args.rounds, storage, args.ranks_as, not args.untouched_targets)
    finally:
        storage.close()
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    print(f"\nsummary (median (min-max) of {args.rounds} rounds; load at start {started[0]:.2f}, at end {os.getloadavg()[0]:.2f}):")
    for line in lines:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
