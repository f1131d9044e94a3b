"""A job's own retention (CheckpointClient(retention=JobRetention(...))) with real daemons: it
holds for that job alone, within the daemon's flags (the default and the upper bound), is
recorded in each step's index, and with several nodes every node prunes the steps node 0's
merge decided, whatever its own flags say."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from on_disk import committed  # tests/on_disk.py
from ckptd.client import CheckpointClient, InvalidState, JobRetention
from ckptd.client.errors import CheckpointError


def _save_steps(address: str, job: str, steps: range, retention: JobRetention | None, metrics: dict[int, float] | None = None) -> None:
    state = {"model": {"w": torch.arange(64, dtype=torch.float32)}}
    with CheckpointClient(job, address=address, rank=0, world_size=1, on_error="raise", retention=retention) as ckpt:
        for step in steps:
            ckpt.save(step, state, metric=(metrics or {}).get(step)).wait_durable(timeout=60)


# issue 31 item 7
def test_a_jobs_keep_last_holds_for_it_alone_within_the_daemons(daemon) -> None:
    """Daemon --keep-last 3 (the default): a job asking keep_last=2 keeps 2 steps, a job of the
    same daemon asking nothing keeps 3, a job asking 10 is bounded to the daemon's 3; the index
    records the merged policy and the request."""
    _save_steps(daemon.address, "two", range(1, 6), JobRetention(keep_last=2))
    _save_steps(daemon.address, "plain", range(1, 6), None)
    _save_steps(daemon.address, "greedy", range(1, 6), JobRetention(keep_last=10))
    assert committed(daemon.root, "two") == [4, 5]
    assert committed(daemon.root, "plain") == [3, 4, 5]
    assert committed(daemon.root, "greedy") == [3, 4, 5]
    index = json.loads((daemon.root / "two" / "step-00000005" / "ckptd.index.json").read_text())
    assert index["retention"] == {"keep_last": 2, "keep_every": 0, "keep_best": 0, "best_mode": "min", "asked": {"keep_last": 2}}
    assert "retention" not in json.loads((daemon.root / "plain" / "step-00000005" / "ckptd.index.json").read_text())

    # a run that stops asking: the daemon's flags again, from its next commit on
    _save_steps(daemon.address, "two", range(6, 8), None)
    assert committed(daemon.root, "two") == [5, 6, 7]


# issue 31 item 7
def test_ranks_that_ask_for_different_retention_are_refused(daemon) -> None:
    state = {"model": {"w": torch.zeros(8)}}

    def rank_saves(rank: int) -> str:
        retention = JobRetention(keep_last=1 + rank)
        with CheckpointClient("differ", address=daemon.address, rank=rank, world_size=2, on_error="raise", retention=retention, timeout_s=5) as ckpt:
            try:
                ckpt.save(1, state).wait_durable(timeout=10)
            except (InvalidState, CheckpointError) as exc:
                return str(exc)
        return ""

    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(rank_saves, range(2)))
    assert any("keep_last=2" in e and "keep_last=1" in e and "every rank must pass the same" in e for e in errors), errors
    assert committed(daemon.root, "differ") == []


# issue 31 item 7
def test_every_node_prunes_what_node_0_decided(node_sets) -> None:
    """Two nodes with their own roots and different flags (node 0 keeps 3, node 1 keeps 5): a job
    asking keep_last=2 and the best 1 by a metric (max) keeps the same steps on both roots."""
    cluster = node_sets(2, shared_root=False)
    cluster.start(0, "--keep-last", "3")
    cluster.start(1, "--keep-last", "5")
    retention = JobRetention(keep_last=2, keep_best=1, best_mode="max")
    accuracy = {1: 0.5, 2: 0.9, 3: 0.6, 4: 0.7, 5: 0.1, 6: 0.2}  # step 2 is the best
    kept_after = {1: [1], 2: [1, 2], 3: [2, 3], 4: [2, 3, 4], 5: [2, 4, 5], 6: [2, 5, 6]}
    state = {"model": {f"layer{i}": torch.full((4096,), float(i)) for i in range(4)}}

    def rank_saves(rank: int, step: int) -> None:
        with CheckpointClient("mnr", address=cluster.address(rank // 2), rank=rank, world_size=4, local_world_size=2, on_error="raise",
                              timeout_s=60, retention=retention) as ckpt:
            ckpt.save(step, state, metric=accuracy[step]).wait_durable(timeout=60)

    for step in accuracy:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(rank_saves, range(4), [step] * 4))
        for node in (0, 1):
            assert committed(cluster.root(node), "mnr") == kept_after[step], (node, step)


@pytest.mark.parametrize("bad", ["keep", 3])
def test_a_client_refuses_a_retention_that_is_not_a_job_retention(bad: object) -> None:
    with pytest.raises(TypeError, match="JobRetention"):
        CheckpointClient("j", address="unix:///nowhere.sock", rank=0, world_size=1, retention=bad)  # type: ignore[arg-type]
