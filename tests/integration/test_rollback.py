"""Rollback with a real daemon (issue 20, finding 1; docs/architecture.md §9): a job that loads an older
step and saves a lower step number than it saved before. The newest step is the most recently
committed one, for load() without a step, `latest`, `ckptd ls` and retention alike; the commit
that acknowledged a step never deletes it."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from on_disk import committed  # tests/on_disk.py
from ckptd.client import CheckpointClient
from ckptd.format.index import INDEX_NAME

RETENTION = ("--keep-last", "2", "--keep-every", "10")


def latest_file(root: Path, job: str) -> str:
    """The step directory `<job>/latest` names; it must be a committed step."""
    name = (root / job / "latest").read_text().strip()
    assert (root / job / name / INDEX_NAME).is_file(), f"`latest` names {name}, which is not a committed step"
    return name


def ls_latest(root: Path, job: str) -> list[int]:
    out = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "ls", str(root), job, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [r["step"] for r in json.loads(out.stdout) if r["latest"]]


def filled(model: torch.nn.Linear, value: float) -> dict:
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return {"model": model}


def test_a_step_saved_after_a_rollback_is_kept_latest_and_loaded(daemons) -> None:
    daemon = daemons.start(*RETENTION)
    model = torch.nn.Linear(8, 8)
    with CheckpointClient("rb", address=daemon.address, on_error="raise") as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, filled(model, step)).wait_durable(timeout=60)
        assert ckpt.load(filled(model, 0), step=10) == 10 and torch.all(model.weight == 10)  # the rollback
        durable = ckpt.save(15, filled(model, 15)).wait_durable(timeout=60)

        # acknowledged as durable: it is there, and the commit that acknowledged it did not delete it
        assert Path(durable.step_dir).name == "step-00000015"
        assert (Path(durable.step_dir) / INDEX_NAME).is_file()
        assert committed(daemon.root, "rb") == [10, 15, 20, 30]
        assert latest_file(daemon.root, "rb") == "step-00000015"
        assert ckpt.load(filled(model, 0)) == 15 and torch.all(model.weight == 15)
        assert ckpt.latest() == 15 and [i.step for i in ckpt.list()] == [10, 20, 30, 15]  # commit order
        assert ls_latest(daemon.root, "rb") == [15]

    daemon.stop()
    daemon = daemons.start(*RETENTION)  # a restarted daemon (crash cleanup rewrites `latest`) agrees
    with CheckpointClient("rb", address=daemon.address, on_error="raise") as ckpt:
        assert latest_file(daemon.root, "rb") == "step-00000015"
        assert ckpt.load(filled(model, 0)) == 15 and torch.all(model.weight == 15)
        assert ckpt.latest() == 15

        # the new timeline goes on: keep_last counts the most recently committed steps
        ckpt.save(16, filled(model, 16)).wait_durable(timeout=60)
        assert committed(daemon.root, "rb") == [10, 15, 16, 20, 30]
        ckpt.save(17, filled(model, 17)).wait_durable(timeout=60)
        assert committed(daemon.root, "rb") == [10, 16, 17, 20, 30]  # 15 aged out; 10, 20, 30 by keep_every
        assert latest_file(daemon.root, "rb") == "step-00000017"
        assert ckpt.load(filled(model, 0)) == 17 and torch.all(model.weight == 17)
    assert ls_latest(daemon.root, "rb") == [17]


def test_a_reused_job_id_keeps_its_new_steps_below_the_old_ones(daemons) -> None:
    daemon = daemons.start("--keep-last", "2")
    model = torch.nn.Linear(4, 4)
    with CheckpointClient("reused", address=daemon.address, on_error="raise") as ckpt:
        for step in (100, 200, 300):  # an earlier run of the job
            ckpt.save(step, filled(model, step)).wait_durable(timeout=60)
        ckpt.save(1, filled(model, 1)).wait_durable(timeout=60)  # a new run, same job id
        assert committed(daemon.root, "reused") == [1, 300]  # the last two committed: 300, then 1
        assert latest_file(daemon.root, "reused") == "step-00000001"
        assert ckpt.load(filled(model, 0)) == 1 and torch.all(model.weight == 1)
        ckpt.save(2, filled(model, 2)).wait_durable(timeout=60)
        assert committed(daemon.root, "reused") == [1, 2]
        assert latest_file(daemon.root, "reused") == "step-00000002"


def _on_two_nodes(cluster, job: str, work) -> list:
    """Ranks 0, 1 on node 0 and 2, 3 on node 1 each run work(client); returns their results."""

    def rank(r: int):
        with CheckpointClient(job, address=cluster.address(r // 2), rank=r, world_size=4, local_world_size=2, on_error="raise", timeout_s=60) as ckpt:
            return work(ckpt)

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(rank, range(4)))


def test_a_rollback_on_two_nodes_with_their_own_roots(node_sets) -> None:
    """Node 0 commits (coordinator) and node 1 records the commit in its own root: both keep the
    step saved after the rollback and name it in `latest`, and a load without a step gets it."""
    cluster = node_sets(2, shared_root=False)
    for node in (0, 1):
        cluster.start(node, *RETENTION)
    state = {"model": {"w": torch.zeros(4096)}}  # a replica on every rank

    def save(step: int):
        state["model"]["w"].fill_(step)
        _on_two_nodes(cluster, "rb2", lambda ckpt: ckpt.save(step, state).wait_durable(timeout=60))

    for step in (10, 20, 30, 15):
        save(step)
    for node in (0, 1):
        assert committed(cluster.root(node), "rb2") == [10, 15, 20, 30], node
        assert latest_file(cluster.root(node), "rb2") == "step-00000015", node

    def load_latest(ckpt: CheckpointClient) -> tuple[int | None, float]:
        out = {"model": {"w": torch.zeros(4096)}}
        return ckpt.load(out), float(out["model"]["w"][0])

    assert _on_two_nodes(cluster, "rb2", load_latest) == [(15, 15.0)] * 4
    save(16)
    save(17)
    for node in (0, 1):
        assert committed(cluster.root(node), "rb2") == [10, 16, 17, 20, 30], node
        assert latest_file(cluster.root(node), "rb2") == "step-00000017", node
