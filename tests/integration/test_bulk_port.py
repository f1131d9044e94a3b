"""The replica bulk port cannot be starved or stopped without credentials (issue 30 finding 8),
on a real daemon pair on loopback: 200 idle connections that never send a ticket do not keep a
real push waiting; a daemon out of file descriptors keeps accepting once they free up, and says
in `ckptd status` (and a metric) that the port had trouble. Every connection is to 127.0.0.1,
bounded in count and closed at the end of its test."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ckptd.client import CheckpointClient
from daemon_rig import NodeSet, free_port
from metrics_scrape import scrape

JOB = "bulk"
IDLE = 200


class Pair:
    """Two daemons with node-local roots; node 1's bulk port and both metrics ports are known."""

    def __init__(self, make: Callable[..., NodeSet]) -> None:
        self.nodes = make(2, shared_root=False)
        self.metrics = [free_port(), free_port()]
        self.bulk_port = free_port()
        self.nodes.start(0, "--metrics-port", str(self.metrics[0]), "--metrics-host", "127.0.0.1")
        self.nodes.start(1, "--metrics-port", str(self.metrics[1]), "--metrics-host", "127.0.0.1", "--replica-port", str(self.bulk_port))

    def save(self, step: int) -> None:
        """One rank per node saves its half of a tensor; durable when this returns."""
        def rank(r: int) -> None:
            with CheckpointClient(JOB, address=self.nodes.address(r), rank=r, world_size=2, local_world_size=1, on_error="raise", timeout_s=60) as ckpt:
                ckpt.save(step, {"model": {f"w{r}": torch.full((256, 256), float(step + r))}}).wait_durable(timeout=60)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(rank, range(2)))

    def recoverable(self) -> float:
        return scrape(self.metrics[0]).get(f'ckptd_recoverable_step{{job="{JOB}"}}', -1.0)

    def wait_recoverable(self, step: int, timeout_s: float) -> float:
        """Seconds until node 0 reports `step` recoverable (every node's part held by the other)."""
        started = time.monotonic()
        while self.recoverable() != step:
            assert time.monotonic() - started < timeout_s, f"step {step} not recoverable within {timeout_s} s"
            time.sleep(0.1)
        return time.monotonic() - started

    def status(self, node: int) -> dict:
        out = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "status", "--address", self.nodes.address(node), "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def status_text(self, node: int) -> str:
        return subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "status", "--address", self.nodes.address(node)],
                              capture_output=True, text=True, timeout=60).stdout


def _idle(port: int, count: int) -> list[socket.socket]:
    """Up to `count` connections to the port that never send a byte (those it refuses at once are not kept)."""
    opened = []
    for _ in range(count):
        try:
            opened.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            continue
    return opened


# issue 30 finding 8
def test_two_hundred_idle_connections_do_not_starve_a_real_push(node_sets) -> None:
    pair = Pair(node_sets)
    idle = _idle(pair.bulk_port, IDLE)
    try:
        assert len(idle) >= IDLE // 2
        pair.save(1)
        seconds = pair.wait_recoverable(1, timeout_s=20)  # node 0's push to node 1 went through at once
        status = pair.status(1)["replicas"]["bulk_port"]
        assert status["healthy"] and status["refused"] > 0 and status["port"] == pair.bulk_port, status
        assert status["opening"] <= 16
    finally:
        for sock in idle:
            sock.close()
    assert seconds < 20
    assert scrape(pair.metrics[1]).get('ckptd_bulk_refused_total{reason="per-source"}', 0) > 0


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# issue 30 finding 8
def test_a_bulk_port_out_of_file_descriptors_keeps_accepting_and_says_so(node_sets) -> None:
    pair = Pair(node_sets)
    pair.save(1)
    pair.wait_recoverable(1, timeout_s=30)
    daemon = pair.nodes.running[1].pid
    limits = resource.prlimit(daemon, resource.RLIMIT_NOFILE)
    resource.prlimit(daemon, resource.RLIMIT_NOFILE, (_open_fds(daemon) + 6, limits[1]))  # a handful of descriptors left
    idle: list[socket.socket] = []
    try:
        idle = _idle(pair.bulk_port, 60)  # more than the daemon has descriptors for: accepting fails (EMFILE)
        time.sleep(1.0)
    finally:
        for sock in idle:
            sock.close()
        resource.prlimit(daemon, resource.RLIMIT_NOFILE, limits)

    pair.save(2)  # the port accepts again: node 0's push of step 2 reaches node 1
    pair.wait_recoverable(2, timeout_s=30)
    # ... and says, for a minute after, that it ran out of descriptors
    status = pair.status(1)["replicas"]["bulk_port"]
    assert not status["healthy"] and "Too many open files" in status["problem"] and status["accept_errors"] > 0, status
    assert "bulk port" in pair.status_text(1) and "UNHEALTHY" in pair.status_text(1)
    assert scrape(pair.metrics[1])["ckptd_bulk_port_healthy"] == 0
    assert scrape(pair.metrics[1])["ckptd_bulk_accept_errors_total"] > 0
    assert "accepting a connection failed" in pair.nodes.running[1].log_text()
