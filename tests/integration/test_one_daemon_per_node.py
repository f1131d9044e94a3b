"""One daemon per node of a storage root (issue 30 finding 4), with real daemons over real sockets.

A second `ckptd serve` on a root that a running daemon serves for the same node rank must stop
before it touches anything, naming the running daemon (host, pid, socket); nodes that share one
root under distinct node ranks keep working, and a node restarting there leaves the others'
saves in flight alone; the lock of a SIGKILLed daemon is taken over at the next start.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from daemon_rig import PEER_TOKEN

from ckptd.client import CheckpointClient

STATE_SEED = 30


def lock_path(root: Path, node: int) -> Path:
    return root / f".ckptd-node-{node}.lock"  # root_lock.lock_path, spelled out: the layout is what operators see


def _model() -> torch.nn.Module:
    torch.manual_seed(STATE_SEED)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])  # ~4 MiB of fp32


def _wait_writing(ckpt: CheckpointClient, step: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(f.step == step and f.state == "writing" and f.bytes_written > 0 for f in ckpt.status().in_flight):
        assert time.monotonic() < deadline, "the save never started writing"
        time.sleep(0.05)


def _serve_until_exit(root: Path, sock: Path, *extra: str, timeout_s: float = 60.0, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run `ckptd serve` and wait for it to exit; (exit code, output). A daemon still serving after
    `timeout_s` is stopped and reported with code None."""
    shm = tempfile.mkdtemp(prefix="ckptd-test-", dir="/dev/shm")
    cmd = [sys.executable, "-m", "ckptd.daemon.app.cli", "serve", "--root", str(root), "--socket", str(sock), "--shm-dir", shm, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return None, out
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _zeros() -> torch.nn.Module:
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    return model


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# issue 30 finding 4
def test_a_second_daemon_on_a_served_root_is_refused_and_removes_nothing(daemons, tmp_path: Path) -> None:
    first = daemons.start("--write-throttle", "2MiB")  # ~2 s of writing: the save is in flight meanwhile
    model = _model()
    with CheckpointClient("busy", address=first.address, on_error="raise") as ckpt:
        handle = ckpt.save(1, {"model": model})
        _wait_writing(ckpt, 1)
        step_dir = first.root / "busy" / "step-00000001"

        code, out = _serve_until_exit(first.root, tmp_path / "second.sock", timeout_s=30)

        assert code == 1, f"the second daemon was not refused (exit {code}):\n{out[-3000:]}"
        assert f"pid {first.pid}" in out and socket.gethostname() in out and str(first.socket) in out, out
        assert "node 0" in out and "Nothing was changed" in out, out
        assert step_dir.is_dir()  # the save in flight (or committed meanwhile) is untouched
        assert not (tmp_path / "second.sock").exists()
        info = handle.wait_durable(timeout=120)
        restored = _zeros()
        assert ckpt.load({"model": restored}) == info.step == 1
    assert _same(model, restored)
    assert "FileNotFoundError" not in first.log_text()


# issue 30 finding 4
def test_nodes_sharing_a_root_each_serve_their_own_node_and_a_duplicate_is_refused(node_sets, tmp_path: Path) -> None:
    cluster = node_sets(2, shared_root=True)
    cluster.start_all()
    root = cluster.root(0)
    owners = {n: json.loads(lock_path(root, n).read_text()) for n in (0, 1)}
    assert {n: o["pid"] for n, o in owners.items()} == {0: cluster.running[0].pid, 1: cluster.running[1].pid}

    code, out = _serve_until_exit(root, tmp_path / "dup.sock", "--node-rank", "1", "--peers", ",".join(cluster.peers),
                                  timeout_s=30, env={**os.environ, "CKPTD_PEER_TOKEN": PEER_TOKEN})
    assert code == 1 and f"pid {cluster.running[1].pid}" in out and "node 1" in out, out
    with CheckpointClient("shared", address=cluster.address(1), rank=0, world_size=1, local_world_size=1, on_error="raise") as ckpt:
        assert ckpt.save(1, {"model": torch.nn.Linear(4, 4)}).wait_durable(timeout=60).step == 1


# issue 30 finding 4
def test_a_node_restarting_on_a_shared_root_leaves_another_nodes_save_in_flight_alone(node_sets) -> None:
    cluster = node_sets(2, shared_root=True)
    cluster.start(0, "--write-throttle", "512KiB")  # ~8 s of writing: longer than node 1's restart
    cluster.start(1)
    model = _model()
    with CheckpointClient("solo", address=cluster.address(0), rank=0, world_size=1, local_world_size=1, on_error="raise") as ckpt:
        handle = ckpt.save(1, {"model": model})
        _wait_writing(ckpt, 1)
        cluster.running[1].kill()
        restarted = cluster.start(1)  # its start-up recovery must not take node 0's step for a leftover
        assert any(f.step == 1 and f.state == "writing" for f in ckpt.status().in_flight), "written before node 1 was back: no test"
        assert handle.wait_durable(timeout=120).step == 1
        restored = _zeros()
        assert ckpt.load({"model": restored}) == 1
    assert _same(model, restored)
    assert "start-up recovery" in restarted.log_text() and "skipped" in restarted.log_text()


# issue 30 finding 4
def test_the_lock_of_a_killed_daemon_is_taken_over_at_the_next_start(daemons) -> None:
    first = daemons.start()
    with CheckpointClient("again", address=first.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(4, 4)}).wait_durable(timeout=60)
    first.kill()  # SIGKILL: no clean-up; the kernel drops its lock
    assert json.loads(lock_path(first.root, 0).read_text())["pid"] == first.pid  # the record stays, stale

    second = daemons.start()
    assert json.loads(lock_path(first.root, 0).read_text())["pid"] == second.pid
    with CheckpointClient("again", address=second.address, on_error="raise") as ckpt:
        assert [i.step for i in ckpt.list()] == [1]


# issue 30 review: with other nodes' daemons on the shared root, a restarted node still removes
# its own old leftovers (as `ckptd gc` does, older than the save timeout), keeping fresh ones
def test_a_node_restarting_on_a_shared_root_removes_its_old_leftovers_and_keeps_fresh_ones(node_sets) -> None:
    cluster = node_sets(2, shared_root=True)
    cluster.start_all()
    job_dir = cluster.root(0) / "leftovers"
    dead, in_flight = job_dir / "step-00000003", job_dir / "step-00000004"  # no index: a dead save, one being written
    for step_dir in (dead, in_flight):
        step_dir.mkdir(parents=True)
        (step_dir / ".tmp-model-00001-of-00001.safetensors.1").write_bytes(b"x" * 100)
    long_ago = time.time() - 3600  # older than the save timeout (600 s)
    os.utime(dead, (long_ago, long_ago))
    cluster.running[1].kill()
    restarted = cluster.start(1)
    assert not dead.exists(), restarted.log_text()[-3000:]
    assert (in_flight / ".tmp-model-00001-of-00001.safetensors.1").read_bytes() == b"x" * 100
    assert "start-up recovery" in restarted.log_text() and "skipped" in restarted.log_text()
