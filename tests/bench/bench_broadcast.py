"""Load broadcast benchmark (issue 34 item 4): bytes read from storage per job load, and load
time, with and without broadcast, on 4+ daemons with a shared root and with node-local roots.

A job of data-parallel replicas (one rank per node, each holding every tensor whole) saves one
step; then every rank loads it. Four clusters of `--nodes` daemons on loopback run side by side,
{shared root, node-local roots} x {--load-broadcast on, off}, each with its own saved step, and
their loads are interleaved round by round (the order alternates).

Measured, not assumed: every daemon and the rank host (the job's ranks, one per node, threads of
one process) run under `strace --seccomp-bpf -f -y` tracing only the read system calls (read, pread64,
readv, preadv, preadv2, sendfile, copy_file_range); the bytes each returned from a file under the
cluster's root(s) are summed per round. `read/unique` is that sum over the unique bytes of the
step's data files (1.0: each byte read from storage once per job). The step's files are evicted
from the page cache (sync, posix_fadvise DONTNEED) before each round. Time: from the first rank's
`load` call to the last rank's return (the clients are connected before). Every loaded tensor is
compared with what was saved.

On one machine the nodes share a page cache, so the bytes the disk delivers do not tell nodes
apart; the bytes each process asks of the root are what a node of a cluster would read from
shared storage (or its local disk).

    python tests/bench/bench_broadcast.py                 # 4 nodes, 256 MiB, 3 rounds
    python tests/bench/bench_broadcast.py --quick         # 4 nodes, 8 MiB, 1 round (tests/bench/test_bench_broadcast.py)

Targets (PASS/FAIL lines): with broadcast, read/unique <= 1.1 in both root layouts; without it
(shared root) about `nodes` (the gap broadcast closes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, IO

from ckptd.daemon.engine.read_once import LINGER_S

JOB = "bench-broadcast"
TOKEN = "bench-broadcast-token-0123456789"
READS = "read,pread64,readv,preadv,preadv2,sendfile,copy_file_range"
TARGET = 1.1  # read/unique with broadcast
_RESULT = re.compile(r"= (\d+)\s*$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def traced(cmd: list[str], log: Path) -> list[str]:
    """`cmd` under strace: the read system calls of every thread, with the file behind each fd."""
    return ["strace", "-f", "-qq", "--seccomp-bpf", "-s", "0", "-y", "-e", f"trace={READS}", "-o", str(log), *cmd]


class ReadLog:
    """The bytes a traced process read from files under `roots`, read from its strace log as it grows."""

    def __init__(self, path: Path, roots: list[Path]) -> None:
        self.path, self.roots = path, [str(r) + "/" for r in roots]
        self.offset = 0
        self.pending: set[str] = set()  # threads whose unfinished read is of a root file

    def take(self) -> int:
        """The root bytes read since the last call."""
        if not self.path.exists():
            return 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read()
        end = text.rfind(b"\n") + 1
        self.offset += end
        total = 0
        for line in text[:end].decode(errors="replace").splitlines():
            tid, _, call = line.partition(" ")
            if "resumed>" in call:
                if tid not in self.pending:
                    continue
                self.pending.discard(tid)
            elif not any(f"<{root}" in call for root in self.roots):
                continue
            elif call.endswith("<unfinished ...>"):
                self.pending.add(tid)
                continue
            found = _RESULT.search(call)
            if found:
                total += int(found.group(1))
        return total


# ------------------------------------------------------------------ the rank host (a node's ranks)

def make_state(tensors: int, mib: int) -> dict[str, Any]:
    import torch

    each = mib * 2**20 // tensors // 4
    cols = 256 if each >= 256 else 1
    g = torch.Generator().manual_seed(0)
    return {f"t{i:04d}": torch.randn(max(1, each // cols), cols, generator=g) for i in range(tensors)}


def rank_host(args: argparse.Namespace) -> int:
    """The job's ranks, one per node (threads, clients made once, rank r a client of the r-th
    address); commands on stdin, one JSON line each:
    "save" or "load"; answers one JSON line: per rank the wall-clock start and end, and whether
    every loaded tensor equals what was saved."""
    import torch

    from ckptd.client import CheckpointClient, DaemonUnavailable
    from ckptd.client.shards import LocalShard

    state = make_state(args.tensors, args.mib)
    addresses = args.addresses.split(",")
    clients = [CheckpointClient(JOB, address=a, rank=r, world_size=len(addresses), local_world_size=1, on_error="raise", timeout_s=600)
               for r, a in enumerate(addresses)]

    def act(op: str, ckpt: CheckpointClient) -> dict[str, Any]:
        if op == "save":
            model = {n: LocalShard(t, (0,) * t.dim(), tuple(t.shape)) for n, t in state.items()}
            ckpt.save(1, {"model": model}).wait_durable(timeout=600)
            return {}
        targets = {n: torch.empty_like(t) for n, t in state.items()}
        model = {n: LocalShard(t, (0,) * t.dim(), tuple(t.shape)) for n, t in targets.items()}
        for attempt in range(3):  # a daemon restarted a moment ago may not take a connection at once on a busy machine
            t0 = time.time()
            try:
                ckpt.load({"model": model}, step=1)
                break
            except DaemonUnavailable as exc:
                print(f"rank {ckpt.rank}: {exc}; trying again", file=sys.stderr, flush=True)
                if attempt == 2:
                    raise
                time.sleep(2.0)
        t1 = time.time()
        return {"t0": t0, "t1": t1, "exact": all(torch.equal(targets[n], state[n]) for n in state)}

    print(json.dumps({"ready": True}), flush=True)
    with ThreadPoolExecutor(len(clients)) as pool:
        for line in sys.stdin:
            op = json.loads(line)["op"]
            answers = list(pool.map(lambda c: act(op, c), clients))
            print(json.dumps(answers), flush=True)
    for c in clients:
        c.close()
    return 0


# ------------------------------------------------------------------ the clusters

@dataclass
class Cluster:
    """`nodes` traced daemons (shared root or node-local roots, --load-broadcast `mode`) and a
    traced rank host (the job's ranks, one per node)."""

    base: Path
    nodes: int
    shared: bool
    mode: str
    tensors: int
    mib: int
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)
    hosts: list[subprocess.Popen[str]] = field(default_factory=list)
    logs: list[ReadLog] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{'shared' if self.shared else 'local'}-{self.mode}"

    def root(self, node: int) -> Path:
        return self.base / ("root" if self.shared else f"root{node}")

    def roots(self) -> list[Path]:
        return sorted({self.root(n) for n in range(self.nodes)})

    def start(self) -> None:
        from ckptd.demo.process import wait_healthy

        peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(self.nodes))
        if not hasattr(self, "sock"):
            self.sock = Path(tempfile.mkdtemp(prefix="ckbb-"))
        sock = self.sock
        env = {**os.environ, "CKPTD_PEER_TOKEN": TOKEN}
        for node in range(self.nodes):
            shm = self.shm(node)
            shm.mkdir(parents=True, exist_ok=True)
            self.root(node).mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "ckptd.daemon.app.cli", "serve", "--root", str(self.root(node)), "--socket", str(sock / f"n{node}.sock"),
                   "--shm-dir", str(shm), "--node-rank", str(node), "--peers", peers, "--replicas", "0", "--load-broadcast", self.mode, "--keep-last", "1"]
            log = self.base / f"daemon{node}.strace"
            out = open(self.base / f"daemon{node}.log", "ab")
            self.daemons.append(subprocess.Popen(traced(cmd, log), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            self.logs.append(ReadLog(log, self.roots()))
        for node in range(self.nodes):
            wait_healthy(f"unix://{sock / f'n{node}.sock'}", 120, self.daemons[node])
        addresses = ",".join(f"unix://{sock / f'n{node}.sock'}" for node in range(self.nodes))
        cmd = [sys.executable, __file__, "--rank-host", "--addresses", addresses, "--tensors", str(self.tensors), "--mib", str(self.mib)]
        log = self.base / "ranks.strace"
        self.hosts.append(subprocess.Popen(traced(cmd, log), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
                                           env={**os.environ, "CKPTD_RUN_ID": f"bench-{self.name}"}))
        self.logs.append(ReadLog(log, self.roots()))
        for host in self.hosts:
            assert host.stdout is not None
            json.loads(host.stdout.readline())

    def shm(self, node: int) -> Path:
        return Path("/dev/shm") / f"ckptd-bench-bcast-{self.base.name}-{node}"

    def command(self, op: str) -> list[dict[str, Any]]:
        """`op` on every node's ranks at once; their answers."""
        answers: list[list[dict[str, Any]]] = [[] for _ in self.hosts]

        def one(i: int) -> None:
            host = self.hosts[i]
            stdin: IO[str] | None = host.stdin
            assert stdin is not None and host.stdout is not None
            stdin.write(json.dumps({"op": op}) + "\n")
            stdin.flush()
            line = host.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name}: rank host {i} exited (see {self.base})")
            answers[i] = json.loads(line)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(self.hosts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [a for per_host in answers for a in per_host]

    def data_files(self) -> list[Path]:
        return [p for root in self.roots() for p in (root / JOB).glob("step-*/*.safetensors")]

    def unique_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.data_files())

    def evict(self) -> None:
        os.sync()
        for path in self.data_files():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def load_round(self) -> dict[str, Any]:
        """One load by every rank, after the page cache was emptied: seconds, bytes read from the
        root(s) by the daemons and the ranks, all exact."""
        self.evict()
        for log in self.logs:
            log.take()
        answers = self.command("load")
        time.sleep(0.2)  # strace writes its last lines
        reads = [log.take() for log in self.logs]
        return {
            "seconds": max(a["t1"] for a in answers) - min(a["t0"] for a in answers),
            "daemons": reads[: self.nodes], "ranks": reads[self.nodes :], "read": sum(reads),
            "exact": all(a["exact"] for a in answers),
        }

    def stop(self) -> None:
        """Kill the rank hosts and the daemons (their memory goes: a later load reads storage)."""
        for p in [*self.hosts, *self.daemons]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            p.wait()
        self.hosts, self.daemons, self.logs = [], [], []

    def close(self) -> None:
        self.stop()
        for node in range(self.nodes):
            shutil.rmtree(self.shm(node), ignore_errors=True)
        shutil.rmtree(getattr(self, "sock", self.base / "none"), ignore_errors=True)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def run(nodes: int, tensors: int, mib: int, rounds: int, out: Path) -> dict[str, Any]:
    clusters = [Cluster(out / f"{root}-{mode}", nodes, root == "shared", mode, tensors, mib) for root in ("shared", "local") for mode in ("on", "off")]
    results: dict[str, list[dict[str, Any]]] = {c.name: [] for c in clusters}
    try:
        for c in clusters:
            c.start()
        for c in clusters:
            c.command("save")
            c.stop()  # a restarted job: no daemon holds the step in memory, every byte comes from storage
            c.start()
        unique = {c.name: c.unique_bytes() for c in clusters}
        last: dict[str, float] = {}
        for r in range(rounds):
            order = clusters if r % 2 == 0 else clusters[::-1]
            for c in order:
                time.sleep(max(0.0, last.get(c.name, 0.0) + LINGER_S + 1 - time.monotonic()))  # the previous round's blocks are gone
                results[c.name].append(c.load_round())
                last[c.name] = time.monotonic()
    finally:
        for c in clusters:
            c.close()
    return {"unique": unique, "rounds": results}


def report(nodes: int, mib: int, found: dict[str, Any], load: tuple[float, float]) -> bool:
    print(f"\n{nodes} daemons on loopback, data-parallel replicas (1 rank per node), {mib} MiB of unique bytes; load average {load[0]:.2f} at start, {load[1]:.2f} at end")
    print(f"{'cluster':<14} {'read/unique':>22} {'load s':>20} {'daemons MiB (median round)':>40} {'ranks MiB':>10}")
    ok = True
    ratio: dict[str, float] = {}
    seconds: dict[str, list[float]] = {}
    for name, rounds in found["rounds"].items():
        unique = found["unique"][name]
        ratios = [r["read"] / unique for r in rounds]
        seconds[name] = [r["seconds"] for r in rounds]
        ratio[name] = statistics.median(ratios)
        mid = rounds[len(rounds) // 2]
        print(f"{name:<14} {summary(ratios):>22} {summary(seconds[name]):>20} "
              f"{' '.join(f'{b / 2**20:.0f}' for b in mid['daemons']):>40} {sum(mid['ranks']) / 2**20:>10.0f}")
        ok &= all(r["exact"] for r in rounds)
    for root in ("shared", "local"):
        on, off = f"{root}-on", f"{root}-off"
        speed = [b / a for a, b in zip(seconds[on], seconds[off])]
        print(f"{root:<7} off/on load time per round: {summary(speed)}; bytes read: {ratio[off] / max(ratio[on], 1e-9):.2f}x fewer with broadcast")
        verdict = ratio[on] <= TARGET
        ok &= verdict
        print(f"{'PASS' if verdict else 'FAIL'}: {root} root(s), broadcast: each byte read from storage once per job load (read/unique {ratio[on]:.2f} <= {TARGET})")
    print(f"{'PASS' if all(r['exact'] for rs in found['rounds'].values() for r in rs) else 'FAIL'}: every load bit-exact")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256, help="unique MiB of the state")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 nodes, 8 MiB, 16 tensors, 1 round")
    ap.add_argument("--out", type=Path, default=None, help="where the roots and logs go (default: a temporary directory, removed)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--rank-host", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--addresses", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_host:
        return rank_host(args)
    if args.quick:
        args.nodes, args.mib, args.tensors, args.rounds = 4, 8, 16, 1
    if shutil.which("strace") is None:
        print("strace is needed to count the bytes read from the root", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-bcast-"))
    start = os.getloadavg()[0]
    try:
        found = run(args.nodes, args.tensors, args.mib, args.rounds, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    ok = report(args.nodes, args.mib, found, (start, os.getloadavg()[0]))
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
