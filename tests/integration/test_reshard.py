"""Resharded restore on one node: DTensors saved by one layout, loaded by another, values exact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from worker_process import run_ranks  # tests/worker_process.py
from daemon_rig import free_port

WORKER = Path(__file__).with_name("dist_worker.py")


def run_job(daemon, tmp: Path, mode: str, mesh: list[int], placements: dict, step: int, job: str = "reshard") -> list[dict]:
    world = math.prod(mesh)
    out = tmp / f"{mode}-{'x'.join(map(str, mesh))}-{free_port()}"
    out.mkdir()
    run_ranks(WORKER, world, address=daemon.address, job=job, step=step, mode=mode, mesh=mesh, placements=placements, out=str(out))
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


S0, S1, R = ["S", 0], ["S", 1], ["R"]
SAVED_1D = {"w_even": [S0], "w_uneven": [S0], "b": [R], "tiny": [S0]}


@pytest.fixture(scope="module")
def saved(module_daemons):
    """One daemon and one save by 4 ranks (Shard(0)) for every load layout below."""
    daemon = module_daemons.start()
    tmp = module_daemons.root.parent
    return daemon, tmp, run_job(daemon, tmp, "save", [4], SAVED_1D, step=1)


def test_four_ranks_hand_over_each_fragment_once(saved) -> None:
    _, _, results = saved
    assert sum(r["bytes_copied"] for r in results) == 4 * (8 * 6 + 13 * 7 + 5 + 2 * 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, placements",
    [
        ([3], {"w_even": [S0], "w_uneven": [S0], "b": [S0], "tiny": [S0]}),  # uneven: 13 rows over 3, 2 rows over 3
        ([1], {"w_even": [R], "w_uneven": [R], "b": [R], "tiny": [R]}),  # one process, whole tensors
        pytest.param([8], {"w_even": [S1], "w_uneven": [S1], "b": [S0], "tiny": [S1]}, marks=pytest.mark.long),  # Shard(0) -> Shard(1), more ranks than rows (8 processes: pytest -m long)
        ([2, 2], {"w_even": [R, S0], "w_uneven": [S0, S1], "b": [R, R], "tiny": [S1, S0]}),  # 1-D -> 2-D mesh
    ],
)
def test_saved_by_four_ranks_loaded_by_another_layout(saved, mesh: list[int], placements: dict) -> None:
    daemon, tmp, _ = saved
    loaded = run_job(daemon, tmp, "load", mesh, placements, step=1)
    for result in loaded:
        assert result["step"] == 1 and all(result["exact"].values()), result


TRAINER = Path(__file__).with_name("train_worker.py")


def train(daemon, tmp: Path, world: int, start: int, stop: int, save_at: int, job: str, nodes=None) -> dict[int, float]:
    """Losses of a training run; `nodes`: (a NodeSet, the node of each rank) instead of `daemon`."""
    out = tmp / f"losses-{job}-{world}-{start}.json"
    where = {"address": daemon.address} if nodes is None else {
        "addresses": [nodes[0].address(n) for n in nodes[1]],
        "local_world_size": [nodes[1].count(n) for n in nodes[1]],
    }
    run_ranks(TRAINER, world, job=job, start=start, stop=stop, save_at=save_at, out=str(out), **where)
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


@pytest.mark.slow
def test_adam_state_is_resharded_and_training_continues_the_same(daemon, tmp_path: Path) -> None:
    reference = train(daemon, tmp_path, world=2, start=0, stop=6, save_at=0, job="adam-ref")
    first = train(daemon, tmp_path, world=2, start=0, stop=3, save_at=3, job="adam")
    resumed = train(daemon, tmp_path, world=3, start=3, stop=6, save_at=0, job="adam")  # 13 rows over 3 ranks
    losses = {**first, **resumed}
    assert sorted(losses) == sorted(reference)
    assert losses == reference  # exactly: same global computation, Adam moments resharded 2 -> 3


@pytest.mark.long  # the one-node test above runs by default; test_multi_node covers two nodes' fetches
def test_adam_state_saved_on_two_nodes_is_resharded_and_training_continues_the_same(node_sets, tmp_path: Path) -> None:
    """The same on two daemons with node-local roots: 2 ranks (one per node) save, 3 ranks
    (2 on node 0, 1 on node 1) resume; each node fetches the shards the other node wrote."""
    cluster = node_sets(2, shared_root=False)
    cluster.start_all()
    reference = train(None, tmp_path, world=2, start=0, stop=6, save_at=0, job="adam-ref", nodes=(cluster, [0, 1]))
    first = train(None, tmp_path, world=2, start=0, stop=3, save_at=3, job="adam", nodes=(cluster, [0, 1]))
    resumed = train(None, tmp_path, world=3, start=3, stop=6, save_at=0, job="adam", nodes=(cluster, [0, 0, 1]))
    assert {**first, **resumed} == reference
