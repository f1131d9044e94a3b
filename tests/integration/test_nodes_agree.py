"""Several nodes with their own roots agree on the step a job loads: found by a probe of the
daemon's lifecycle, each node had resolved "the newest step" from its own root, so the ranks of
one job loaded different steps, silently, whenever a member's root lagged node 0's (restored from
an older copy, or unable to record node 0's last commit), and node 0's ranks could not load a
step just acknowledged durable while a member had not recorded it yet."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import small_fs  # tests/small_fs.py
from on_disk import committed  # tests/on_disk.py
from ckptd.client import CheckpointClient
from ckptd.format.index import INDEX_NAME, PREPARED_NAME


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"w{i}": torch.randn(65536, generator=g) for i in range(4)}}  # 1 MiB, spread over both nodes


def _run_ranks(cluster: Any, job: str, work: Any) -> list[Any]:
    """work(ckpt, rank) on ranks 0, 1 (node 0) and 2, 3 (node 1) at once; their results or exceptions."""

    def rank_runs(rank: int) -> Any:
        try:
            with CheckpointClient(job, address=cluster.address(rank // 2), rank=rank, world_size=4, local_world_size=2, on_error="raise", timeout_s=60) as ckpt:
                return work(ckpt, rank)
        except Exception as exc:  # reported per rank: the test says which rank got what
            return exc

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(rank_runs, range(4)))


def _save(ckpt: CheckpointClient, step: int) -> Any:
    return ckpt.save(step, _state(step)).wait_durable(timeout=60)


def _load(ckpt: CheckpointClient) -> tuple[int | None, bool]:
    target = {"model": {f"w{i}": torch.zeros(65536) for i in range(4)}}
    step = ckpt.load(target)
    return step, step is not None and all(torch.equal(target["model"][k], v) for k, v in _state(step)["model"].items())


def test_every_rank_loads_a_step_the_moment_it_is_acknowledged(node_sets) -> None:
    """Loads right after wait_durable: node 0's ranks read the member's part while it records
    the commit (its part is prepared: written and fsynced), instead of failing with "start the
    missing nodes' daemons" for a daemon that runs."""
    cluster = node_sets(2, shared_root=False)
    cluster.start_all()
    for step in (1, 2, 3):
        results = _run_ranks(cluster, "at-once", lambda ckpt, rank: (_save(ckpt, step), _load(ckpt))[1])
        assert results == [(step, True)] * 4, (step, results)


def test_a_member_whose_root_lags_loads_the_step_node_0_committed(node_sets) -> None:
    """Node 1 restarted on an older copy of its root: its ranks loaded that copy's newest step
    while node 0's loaded the job's newest. Every rank now loads node 0's newest, and latest()
    and list() name it on every node."""
    cluster = node_sets(2, shared_root=False)
    cluster.start_all()
    for step in (1, 2):
        assert all(not isinstance(r, Exception) for r in _run_ranks(cluster, "lag", lambda ckpt, rank: _save(ckpt, step)))
    copy = cluster.base / "root-1-copy"
    shutil.copytree(cluster.root(1), copy, symlinks=True)
    assert all(not isinstance(r, Exception) for r in _run_ranks(cluster, "lag", lambda ckpt, rank: _save(ckpt, 3)))
    cluster.running[1].stop()
    shutil.rmtree(cluster.root(1))
    shutil.copytree(copy, cluster.root(1), symlinks=True)
    cluster.start(1)
    assert committed(cluster.root(1), "lag") == [1, 2]
    # latest() and list() answer node 0's newest on every node too (they answered node 1's root's)
    listed = _run_ranks(cluster, "lag", lambda ckpt, rank: (ckpt.latest(), [info.step for info in ckpt.list()]))
    assert listed == [(3, [1, 2, 3])] * 4, listed
    assert "node 0 (" in [info.path for info in _run_ranks(cluster, "lag", lambda ckpt, rank: ckpt.list())[2]][-1]
    results = _run_ranks(cluster, "lag", lambda ckpt, rank: _load(ckpt))
    # node 1's part of step 3 is in node 0's memory (a replica), or the load fails on every rank alike
    assert results == [(3, True)] * 4 or all(isinstance(r, Exception) and "step 3" in str(r) for r in results), results


@pytest.fixture
def member_on_tmpfs(node_sets) -> Any:
    """Two nodes with their own roots, node 1's on a 16 MiB tmpfs (skipped where mounting is not allowed)."""
    cluster = node_sets(2, shared_root=False)
    with small_fs.tmpfs_root(cluster.nodes[1], "16m"):
        yield cluster


def test_a_member_that_could_not_record_a_commit_records_it_once_it_can(member_on_tmpfs) -> None:
    """Node 1's disk filled between writing its part and recording node 0's commit: its part
    stayed prepared, and until a restart its ranks loaded the step before while node 0's could
    not load at all. Now node 1's ranks are told the step is not durable on node 1, every rank
    loads the committed step meanwhile, and node 1 records the commit once space is freed."""
    cluster = member_on_tmpfs
    cluster.start(0, "--write-throttle", "512KiB")  # node 1 writes its part and waits for node 0's commit
    cluster.start(1, "--disk-reserve", "0")
    first = _run_ranks(cluster, "full", lambda ckpt, rank: _save(ckpt, 1))
    assert all(not isinstance(r, Exception) for r in first), first
    prepared = cluster.root(1) / "full" / "step-00000002" / PREPARED_NAME
    filler = cluster.root(1) / "filler"
    filled = threading.Event()

    def fill() -> None:
        deadline = time.monotonic() + 60
        while not prepared.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)
        filled.set()

    filling = threading.Thread(target=fill)
    filling.start()
    results = _run_ranks(cluster, "full", lambda ckpt, rank: _save(ckpt, 2))
    filling.join()
    assert filled.is_set() and prepared.exists()
    assert all(not isinstance(r, Exception) for r in results[:2]), results
    for refused in results[2:]:
        assert isinstance(refused, Exception) and "not on node 1, whose root could not record node 0's commit" in str(refused), refused
    assert _run_ranks(cluster, "full", lambda ckpt, rank: _load(ckpt)) == [(2, True)] * 4
    filler.unlink()
    deadline = time.monotonic() + 30
    while not (cluster.root(1) / "full" / "step-00000002" / INDEX_NAME).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert committed(cluster.root(1), "full") == [1, 2] and not prepared.exists()
    assert _run_ranks(cluster, "full", lambda ckpt, rank: _load(ckpt)) == [(2, True)] * 4


def test_retention_of_a_shared_root_keeps_a_step_another_node_is_loading(node_sets, monkeypatch) -> None:
    """Found by a probe: with one root shared by the nodes, node 0 applies the retention for
    all of them but kept only the steps its own ranks were loading; a load on node 1 failed
    midway ("cannot read ...: No such file or directory"). Node 0 now asks the other nodes."""
    import ckptd.client.client as client_module

    cluster = node_sets(2, shared_root=True)
    cluster.start_all("--keep-last", "1")

    def save(step: int) -> None:
        results = _run_ranks(cluster, "shared", lambda ckpt, rank: _save(ckpt, step))
        assert all(not isinstance(r, Exception) for r in results), results

    save(1)
    filling, go_on = threading.Event(), threading.Event()
    fill = client_module.fill_plan

    def held_fill(*args: Any) -> None:  # the reader's load is planned (its lease open) and waits here
        filling.set()
        assert go_on.wait(60)
        fill(*args)

    monkeypatch.setattr(client_module, "fill_plan", held_fill)
    loaded: list[Any] = []

    def read() -> None:
        with CheckpointClient("shared", address=cluster.address(1), rank=0, world_size=1, on_error="raise", timeout_s=60) as ckpt:
            target = {"model": {f"w{i}": torch.zeros(65536) for i in range(4)}}
            loaded.append((ckpt.load(target, step=1), all(torch.equal(target["model"][k], v) for k, v in _state(1)["model"].items())))

    reader = threading.Thread(target=read)
    reader.start()
    assert filling.wait(60)
    monkeypatch.setattr(client_module, "fill_plan", fill)  # the savers' loads, if any, are not held
    save(2)
    save(3)
    assert committed(cluster.root(0), "shared") == [1, 3]  # 2 went; 1 is being read on node 1
    go_on.set()
    reader.join(60)
    assert loaded == [(1, True)]
    save(4)
    assert committed(cluster.root(0), "shared") == [4]
