"""Shared memory on a real daemon (issue 30 finding 5): several jobs share a small shared-memory
directory or a budget, an idle job's memory goes back on its own and by `ckptd gc`, a snapshot
being written is never taken, and `ckptd status` and the metrics say who holds what."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from daemon_rig import DaemonFactory, free_port
from metrics_scrape import scrape  # tests/metrics_scrape.py
from ckptd.client import CheckpointClient
from ckptd.demo.process import wait_healthy

MiB = 1 << 20
STATE_BYTES = 16 * MiB


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", *args], capture_output=True, text=True, timeout=120)


def state_of(job: int, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """16 MiB of fp32 whose values name the job and the step."""
    return {"model": {"w": torch.full((STATE_BYTES // 4,), job * 1000.0 + step)}}


def save(address: str, job: str, step: int, value: int) -> None:
    with CheckpointClient(job, address=address, on_error="raise") as ckpt:
        ckpt.save(step, state_of(value, step)).wait_durable(timeout=120)


def arena_files(shm_dir: Path) -> list[Path]:
    return [p for p in shm_dir.iterdir() if p.name.startswith("ckptd-") and "-fetch-" not in p.name]


def status(address: str) -> dict:
    out = ckptd("status", "--address", address, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@contextlib.contextmanager
def small_shm(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `path`, unmounted at the end; skips where mounting is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for --shm-dir needs root")
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


# issue 30 finding 5 (a): the reproduction: 6 successive jobs of 16 MiB, 2 saves each, in 72 MiB
# of shared memory; before, the ended jobs' arenas were never given back and 4 of 12 saves fit.
# Each job's client stays open (a trainer that still runs, mapping its arenas): the memory given
# back is free at once all the same.
def test_six_successive_jobs_in_a_72_mib_shm_directory_all_save(daemons: DaemonFactory, tmp_path: Path) -> None:
    with small_shm(tmp_path / "shm72", "72m") as shm, contextlib.ExitStack() as clients:
        port = free_port()
        daemon = daemons.start("--shm-dir", str(shm), "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
        try:
            for job in range(6):
                ckpt = clients.enter_context(CheckpointClient(f"job{job}", address=daemon.address, on_error="raise"))
                for step in (1, 2):
                    ckpt.save(step, state_of(job, step)).wait_durable(timeout=120)
            doc = status(daemon.address)
            holders = {h["job"]: h for h in doc["arena_holders"]}
            assert sum(h["bytes"] for h in holders.values()) <= 72 * MiB and "job5" in holders and "job0" not in holders
            assert holders["job5"]["held_steps"] == [2] and holders["job5"]["idle_s"] > 0
            metrics = scrape(port)
            assert metrics['ckptd_job_arena_bytes{job="job5"}'] >= STATE_BYTES
            assert metrics['ckptd_arena_released_bytes_total{reason="pressure"}'] >= 2 * STATE_BYTES
            with CheckpointClient("job0", address=daemon.address, on_error="raise") as ckpt:  # given back: from disk, exact
                target = state_of(0, 0)
                assert ckpt.load(target) == 2 and torch.equal(target["model"]["w"], state_of(0, 2)["model"]["w"])
        finally:
            daemon.stop()


# issue 30 finding 5 (a): --shm-budget bounds all jobs together, without a small directory
def test_the_budget_bounds_the_arenas_of_all_jobs(daemons: DaemonFactory) -> None:
    daemon = daemons.start("--shm-budget", "40MiB")
    for job in range(4):
        save(daemon.address, f"b{job}", 1, job)
        doc = status(daemon.address)
        assert doc["arena_bytes"] <= 40 * MiB and doc["shm_budget"] == 40 * MiB
    assert sorted(h["job"] for h in status(daemon.address)["arena_holders"]) == ["b2", "b3"]
    assert "budget 40 MiB" in ckptd("status", "--address", daemon.address).stdout


# a load whose ranks cannot read the root stages its bytes in shared memory: within the budget,
# another job's idle snapshot given back to make room, the staging gone once the load is done
def test_a_loads_staging_files_stay_within_the_budget(daemons: DaemonFactory) -> None:
    daemon = daemons.start("--shm-budget", "40MiB")
    save(daemon.address, "s0", 1, 0)
    assert ckptd("gc", "--address", daemon.address, "--job", "s0").returncode == 0  # s0's step 1 on disk only
    save(daemon.address, "s1", 1, 1)
    save(daemon.address, "s2", 1, 2)  # 32 MiB held: 16 MiB of staging would exceed the budget
    with CheckpointClient("s0", address=daemon.address, on_error="raise", read_files=False) as ckpt:
        target = state_of(9, 9)
        assert ckpt.load(target) == 1 and torch.equal(target["model"]["w"], state_of(0, 1)["model"]["w"])
    doc = status(daemon.address)
    assert doc["shm_staging"] in (0, STATE_BYTES)  # counted until the load's files are removed (LoadDone, just sent)
    assert [h["job"] for h in doc["arena_holders"]] == ["s2"] and doc["arena_bytes"] <= 40 * MiB  # s1, idle longest, made room
    deadline = time.monotonic() + 10
    while any("-fetch-" in p.name for p in daemons.shm_dir.iterdir()):  # the staging file goes once the load is done
        assert time.monotonic() < deadline, sorted(p.name for p in daemons.shm_dir.iterdir())
        time.sleep(0.1)
    assert status(daemon.address)["shm_staging"] == 0  # no longer counted once its files are removed


# A rank killed mid-load (after PlanLoad, before LoadDone) held its lease for LOAD_LEASE_S (an hour):
# its staging bytes stayed counted under the budget (another job's saves found no room) and its
# step's snapshot stayed pinned. The daemon sees the client's Attach call end and ends the lease.
KILLED_BEFORE_LOAD_DONE = """
import os, signal, sys, torch
from ckptd.client import CheckpointClient
from ckptd.client import _rpc
_rpc.DaemonRpc.load_done = lambda self, load_id: os.kill(os.getpid(), signal.SIGKILL)
with CheckpointClient("s0", address=sys.argv[1], on_error="raise", read_files=False) as ckpt:
    ckpt.load({"model": {"w": torch.zeros(%d)}})
""" % (STATE_BYTES // 4)


def test_a_rank_killed_mid_load_leaves_no_staging_counted_and_no_lease(daemons: DaemonFactory) -> None:
    daemon = daemons.start("--shm-budget", "40MiB")
    save(daemon.address, "s0", 1, 0)
    assert ckptd("gc", "--address", daemon.address, "--job", "s0").returncode == 0  # s0's step 1 on disk only: a load stages it
    killed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_LOAD_DONE, daemon.address], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    deadline = time.monotonic() + 10
    while (doc := status(daemon.address))["loads_active"] or doc["shm_staging"]:
        assert time.monotonic() < deadline, doc
        time.sleep(0.1)
    save(daemon.address, "s1", 1, 1)  # the whole budget is there for another job's saves
    save(daemon.address, "s2", 1, 2)
    assert {h["job"] for h in status(daemon.address)["arena_holders"]} == {"s1", "s2"}


# issue 30 finding 5 (a): ckptd gc and ckptd status: who holds what, then given back
def test_status_names_the_holders_and_gc_gives_their_memory_back(daemons: DaemonFactory) -> None:
    daemon = daemons.start()
    save(daemon.address, "g", 1, 1)
    text = ckptd("status", "--address", daemon.address).stdout
    assert "job g: 16 MiB in 1 arena set(s); holds step 1 for restores from memory; idle" in text, text
    dry = json.loads(ckptd("gc", "--address", daemon.address, "--dry-run", "--json").stdout)
    assert [(r["job"], r["step"], r["reason"], r["bytes"]) for r in dry["removed"]] == [("g", 1, "memory", STATE_BYTES)]
    assert len(arena_files(daemons.shm_dir)) == 1
    out = ckptd("gc", "--address", daemon.address)
    assert out.returncode == 0 and "removed memory" in out.stdout and "g" in out.stdout, out.stdout
    assert arena_files(daemons.shm_dir) == [] and status(daemon.address)["arena_holders"] == []


# issue 30 finding 5 (a): an idle job's memory goes back after --idle-release
def test_an_idle_jobs_arenas_are_given_back_after_the_idle_time(daemons: DaemonFactory) -> None:
    daemon = daemons.start("--idle-release", "1")
    save(daemon.address, "idle", 1, 3)
    deadline = time.monotonic() + 30
    while arena_files(daemons.shm_dir):
        assert time.monotonic() < deadline, f"still held: {arena_files(daemons.shm_dir)}"
        time.sleep(0.2)
    with CheckpointClient("idle", address=daemon.address, on_error="raise") as ckpt:
        target = state_of(0, 0)
        assert ckpt.load(target) == 1 and torch.equal(target["model"]["w"], state_of(3, 1)["model"]["w"])
        assert not ckpt.list()[-1].in_memory


# issue 30 finding 5 (a): a save short of memory waits for another job's snapshot being written
# (the only copy of that step) to become durable, and never takes it
def test_a_snapshot_being_written_is_never_given_to_another_job(daemons: DaemonFactory) -> None:
    daemon = daemons.start("--shm-budget", "24MiB", "--write-throttle", "8MiB")  # a 16 MiB write takes about 2 s
    with CheckpointClient("first", address=daemon.address, on_error="raise") as first:
        handle = first.save(1, state_of(1, 1))
        deadline = time.monotonic() + 30
        while [f.state for f in first.status().in_flight] != ["writing"]:
            assert time.monotonic() < deadline, first.status().in_flight
            time.sleep(0.05)
        save(daemon.address, "second", 1, 2)  # waits for the first's commit, then takes its memory
        assert handle.wait_durable(timeout=60).step == 1
        target = state_of(0, 0)
        assert first.load(target) == 1 and torch.equal(target["model"]["w"], state_of(1, 1)["model"]["w"])
    assert [h["job"] for h in status(daemon.address)["arena_holders"]] == ["second"]


def test_a_daemon_restarted_under_the_same_pid_removes_its_earlier_runs_files_and_its_trainer_saves_exactly(tmp_path: Path) -> None:
    """A container restarted: ckptd is pid 1 of its pid namespace again, and the node's /dev/shm
    (hostIPC) still holds what its earlier run made under pid 1. Those files are removed at
    start (they held the node's memory for good and took the names of this run's first arenas:
    its first save failed, "File exists"), and a trainer that lived through the restart saves
    into the new arena, not through its mapping of the earlier file of the same name (its step
    was durable, and held zeros). Two real daemons, each pid 1 of a pid namespace of its own."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("cannot make a pid namespace here (unshare needs root)")
    shm = Path(tempfile.mkdtemp(prefix="ckptd-samepid-", dir="/dev/shm"))
    socket = Path(tempfile.mkdtemp(prefix="ckptd-samepid-", dir="/tmp")) / "d.sock"
    state = {"model": {"w": torch.arange(1 << 18, dtype=torch.float32)}}

    def start(log: Path) -> subprocess.Popen[bytes]:
        cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m", "ckptd.daemon.app.cli", "serve",
               "--root", str(tmp_path / "root"), "--socket", str(socket), "--shm-dir", str(shm)]
        daemon = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        wait_healthy(f"unix://{socket}", 30, daemon)
        return daemon

    daemon = start(tmp_path / "first.log")
    try:
        with CheckpointClient("samepid", address=f"unix://{socket}", on_error="raise", timeout_s=30) as trainer:
            trainer.save(1, state).wait_durable(timeout=60)
            left = sorted(p.name for p in shm.iterdir() if p.name.startswith("ckptd-"))
            assert any(name.startswith("ckptd-1-samepid-") for name in left), left
            daemon.kill()  # unshare --kill-child: the daemon (pid 1 there) dies with it
            daemon.wait(30)
            daemon = start(tmp_path / "second.log")
            assert not set(left) & set(p.name for p in shm.iterdir())  # the earlier run's files are gone
            assert "removed stale shared-memory arena" in (tmp_path / "second.log").read_text()
            state["model"]["w"] += 1
            handle = trainer.save(2, state)  # the same trainer, its arena mappings made before the restart
            assert handle.wait_durable(timeout=60) is not None, handle.error  # at once: no name of the earlier run in the way
        loaded = {"model": {"w": torch.zeros(1 << 18)}}
        with CheckpointClient("samepid", address=f"unix://{socket}", on_error="raise") as client:
            assert client.load(loaded) == 2
        assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    finally:
        daemon.kill()
        daemon.wait(30)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(socket.parent, ignore_errors=True)
