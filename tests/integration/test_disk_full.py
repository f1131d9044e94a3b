"""A save that cannot fit on the storage root is refused before anything of it is written
(issue 19, item 6): real daemons over their sockets, the reserve reloaded on SIGHUP, a small
real file system (a tmpfs, when this runs as root), and two nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import torch

import small_fs  # tests/small_fs.py
from metrics_scrape import scrape  # tests/metrics_scrape.py
from on_disk import committed  # tests/on_disk.py
from ckptd.client import CheckpointClient
from ckptd.client.errors import CheckpointError
from daemon_rig import free_port

MiB = 1 << 20


def status(address: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "status", "--address", address, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def reload(daemon, config: Path, reserve: int) -> None:
    """Set disk_reserve in the daemon's config file and SIGHUP it; returns once it reloaded."""
    config.write_text(f"disk_reserve = {reserve}\n")
    before = daemon.log_text().count("configuration reloaded")
    daemon.popen.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while daemon.log_text().count("configuration reloaded") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.log_text().count("configuration reloaded") > before, daemon.log_text()[-2000:]


def test_a_reserve_above_the_free_space_refuses_the_save_and_keeps_the_previous_step(daemons, tmp_path: Path) -> None:
    config = tmp_path / "ckptd.toml"
    config.write_text('disk_reserve = "1MiB"\n')
    port = free_port()
    # one arena set: a set the refused save kept would make the next save skip
    daemon = daemons.start("--config", str(config), "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--max-inflight", "1", "--arena-policy", "skip")
    job_dir = daemon.root / "full"
    model = torch.nn.Linear(256, 256)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointClient("full", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model}).wait_durable(timeout=60)

        reload(daemon, config, free_bytes(daemon.root) + (1 << 30))
        with torch.no_grad():
            model.weight.add_(1.0)
        handle = ckpt.save(2, {"model": model})
        started = time.monotonic()
        with pytest.raises(CheckpointError) as refused:
            handle.wait_durable(timeout=60)
        assert time.monotonic() - started < 30  # an answer, not a wait for a timeout
        message = str(refused.value)
        assert "step 2" in message and "not enough disk space: needs " in message, message
        assert "reserve), " in message and f"free on {job_dir}: free space or lower --disk-reserve" in message, message

        assert committed(daemon.root, "full") == [1]
        assert not (job_dir / "step-00000002").exists()
        assert (job_dir / "latest").read_text() == "step-00000001\n"
        assert not [p for p in job_dir.iterdir() if p.name.startswith(".") and p.name != ".recycle"]

        m = scrape(port)
        assert m['ckptd_saves_refused_no_space_total{job="full"}'] == 1
        assert m['ckptd_save_failures_total{cause="no_space"}'] == 1
        assert m['ckptd_save_failures_total{cause="write_error"}'] == 0
        doc = status(daemon.address)
        assert doc["in_flight"] == [] and doc["failed_total"] == 1 and "not enough disk space" in doc["last_error"]

        restored = torch.nn.Linear(256, 256)
        assert ckpt.load({"model": restored}) == 1  # from disk: step 2 took the arena of step 1
        assert all(torch.equal(restored.state_dict()[k], v) for k, v in saved.items())

        reload(daemon, config, MiB)  # SIGHUP lowers the reserve again: the arena was given back, the next save works
        ckpt.save(3, {"model": model}).wait_durable(timeout=60)
        assert committed(daemon.root, "full") == [1, 3]
    assert scrape(port)['ckptd_saves_refused_no_space_total{job="full"}'] == 1


@pytest.fixture
def small_root(daemons) -> Iterator:
    """The daemons' root on a 32 MiB tmpfs; unmounted (daemons stopped first) at the end."""
    with small_fs.tmpfs_root(daemons, "32m") as mounted:
        yield mounted


def test_on_a_small_file_system_a_state_larger_than_the_space_is_refused_and_recycled_files_count(small_root) -> None:
    daemon = small_root.start("--disk-reserve", "1MiB", "--keep-last", "1")
    g = torch.Generator().manual_seed(0)
    small = {"model": {"w": torch.randn(3 * MiB, generator=g)}}  # 12 MiB
    large = {"model": {"w": torch.randn(10 * MiB, generator=g)}}  # 40 MiB: more than the file system
    job_dir = daemon.root / "tiny"
    with CheckpointClient("tiny", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, small).wait_durable(timeout=60)
        ckpt.save(2, small).wait_durable(timeout=60)  # retention keeps 2; step 1's file goes to the recycle bin
        assert committed(daemon.root, "tiny") == [2] and len(list((job_dir / ".recycle").iterdir())) == 1
        # 12 MiB of step 2 and 12 MiB in the bin: under 8 MiB free, but the next step overwrites the bin
        assert free_bytes(daemon.root) < 9 * MiB
        ckpt.save(3, small).wait_durable(timeout=60)
        assert committed(daemon.root, "tiny") == [3]

        with pytest.raises(CheckpointError, match=r"not enough disk space: needs 29 MiB \(28 MiB of data \+ 1 MiB reserve; another 12 MiB reuse recycled files\), [78](\.\d)? MiB free"):
            ckpt.save(4, large).wait_durable(timeout=60)
        assert not (job_dir / "step-00000004").exists()
        assert (job_dir / "latest").read_text() == "step-00000003\n"
        assert len(list((job_dir / ".recycle").iterdir())) == 1  # the bin as it was

        small["model"]["w"] += 1
        ckpt.save(5, small).wait_durable(timeout=60)
        restored = {"model": {"w": torch.zeros(3 * MiB)}}
        assert ckpt.load(restored) == 5 and torch.equal(restored["model"]["w"], small["model"]["w"])
    assert "No space left" not in daemon.log_text()


def test_a_refusal_on_one_node_fails_the_step_on_every_node(node_sets, tmp_path: Path) -> None:
    cluster = node_sets(2, shared_root=False)
    config = tmp_path / "node1.toml"
    config.write_text('disk_reserve = "1MiB"\n')
    ports = [free_port(), free_port()]
    for node in (0, 1):
        cluster.start(node, "--metrics-port", str(ports[node]), "--metrics-host", "127.0.0.1", *(["--config", str(config)] if node else []))
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}": torch.randn(20000 + 3000 * i, generator=g) for i in range(8)}}  # a replica: both nodes write

    def save(step: int) -> list:
        def rank_saves(rank: int) -> object:
            with CheckpointClient("mn", address=cluster.address(rank // 2), rank=rank, world_size=4, local_world_size=2, on_error="raise", timeout_s=60) as ckpt:
                try:
                    return ckpt.save(step, state).wait_durable(timeout=60)
                except CheckpointError as exc:
                    return exc

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(rank_saves, range(4)))

    assert not any(isinstance(r, Exception) for r in save(1))
    reload(cluster.running[1], config, free_bytes(cluster.root(1)) + (1 << 30))
    results = save(2)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert all("node 1" in str(r) and "not enough disk space" in str(r) for r in results), results
    for node in (0, 1):
        job_dir = cluster.root(node) / "mn"
        assert committed(cluster.root(node), "mn") == [1], node
        assert not (job_dir / "step-00000002").exists(), node
        assert (job_dir / "latest").read_text() == "step-00000001\n", node
    m0, m1 = scrape(ports[0]), scrape(ports[1])
    assert m1['ckptd_saves_refused_no_space_total{job="mn"}'] == 1 and m1['ckptd_save_failures_total{cause="no_space"}'] == 1
    # node 0 fails the step too ("peer", or "write_error" when the abort removed the files it was writing)
    assert sum(v for k, v in m0.items() if k.startswith("ckptd_save_failures_total")) == 1
    assert m0['ckptd_save_failures_total{cause="no_space"}'] == 0 and m0.get('ckptd_saves_refused_no_space_total{job="mn"}', 0) == 0
    for node in (0, 1):
        restored = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        with CheckpointClient("mn", address=cluster.address(node), rank=0, world_size=1, local_world_size=1, on_error="raise") as ckpt:
            assert ckpt.load(restored) == 1
        assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())
