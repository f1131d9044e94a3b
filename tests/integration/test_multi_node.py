"""Several nodes on loopback: a daemon per node (own socket, shared memory, root or a shared
root), trainer ranks as gloo processes, each talking to its node's daemon."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.errors import CheckpointError
from ckptd.daemon.format import CheckpointIndex


WORKER = Path(__file__).with_name("dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

RANKS_SCRIPT = Path(__file__).with_name("ranks.py")
S0, S1, R = ["S", 0], ["S", 1], ["R"]
SAVED = {"w_even": [S0], "w_uneven": [S0], "b": [R], "tiny": [S0]}


def spread(world: int, nodes: int) -> list[int]:
    """The node of each rank: consecutive blocks, as torchrun places them (sizes differ by at most one)."""
    return [r * nodes // world for r in range(world)]


def run_job(cluster, tmp: Path, mode: str, mesh: list[int], placements: dict, step: int, node_of_rank: list[int], job: str = "mn") -> list[dict]:
    world = math.prod(mesh)
    assert len(node_of_rank) == world
    out = tmp / f"{mode}-{'x'.join(map(str, mesh))}-{free_port()}"
    out.mkdir()
    spec = {
        "addresses": [cluster.address(n) for n in node_of_rank],
        "local_world_size": [node_of_rank.count(n) for n in node_of_rank],
        "job": job, "step": step, "mode": mode, "mesh": mesh, "placements": placements, "out": str(out),
    }
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), json.dumps({**spec, "rank": r, "world_size": world, "port": port})])
        for r in range(world)
    ]
    codes = [p.wait(180) for p in procs]
    assert codes == [0] * world, codes
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def index_of(root: Path, job: str, step: int) -> CheckpointIndex:
    return CheckpointIndex.from_json_bytes((root / job / f"step-{step:08d}" / "ckptd.index.json").read_bytes())


@pytest.fixture(scope="module")
def shared_cluster(module_node_sets):
    """Two nodes sharing one root, and one save by 4 ranks (2 per node, Shard(0) over all 4)."""
    cluster = module_node_sets(2, shared_root=True)
    cluster.start_all()
    results = run_job(cluster, cluster.base, "save", [4], SAVED, step=1, node_of_rank=spread(4, 2))
    return cluster, cluster.base, results


def test_four_ranks_on_two_nodes_commit_one_checkpoint(shared_cluster) -> None:
    cluster, _, results = shared_cluster
    assert sum(r["bytes_copied"] for r in results) == 4 * (8 * 6 + 13 * 7 + 5 + 2 * 3)
    index = index_of(cluster.root(0), "mn", 1)
    assert index.world_size == 4
    w = index.by_name()["model/w_even"]
    assert len(w.fragments) == 4  # sharded across the nodes: stored as fragments by their holders
    assert {f.node for f in index.files if f.name.startswith("model-")} == {0, 1}
    assert (cluster.root(0) / "mn" / "latest").read_text().strip() == "step-00000001"


@pytest.mark.parametrize(
    "mesh, placements, nodes",
    [
        ([3], {"w_even": [S0], "w_uneven": [S0], "b": [S0], "tiny": [S0]}, 2),  # uneven shards over 3 ranks
        ([8], {"w_even": [S1], "w_uneven": [S1], "b": [S0], "tiny": [S1]}, 2),  # Shard(0) -> Shard(1), 8 ranks
        ([2, 2], {"w_even": [R, S0], "w_uneven": [S0, S1], "b": [R, R], "tiny": [S1, S0]}, 2),  # 1-D -> 2-D mesh
        ([2], {"w_even": [R], "w_uneven": [S1], "b": [R], "tiny": [R]}, 1),  # Shard -> Replicate, one node
    ],
)
def test_saved_on_two_nodes_loaded_by_another_layout(shared_cluster, mesh: list[int], placements: dict, nodes: int) -> None:
    cluster, base, _ = shared_cluster
    world = math.prod(mesh)
    loaded = run_job(cluster, base, "load", mesh, placements, step=1, node_of_rank=spread(world, nodes))
    for result in loaded:
        assert result["step"] == 1 and all(result["exact"].values()), result


def test_one_process_loads_plain_tensors(shared_cluster) -> None:
    cluster, _, _ = shared_cluster
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import SHAPES, global_value

    model = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    with CheckpointClient("mn", address=cluster.address(1), rank=0, world_size=1, local_world_size=1, on_error="raise") as ckpt:
        assert ckpt.load({"model": model}) == 1
    for name, tensor in model.items():
        assert torch.equal(tensor, global_value(name)), name


def test_a_call_without_the_token_is_refused(shared_cluster) -> None:
    from ckptd.wire.v1 import peer_pb2, peer_pb2_grpc

    cluster, _, _ = shared_cluster
    with grpc.insecure_channel(cluster.peers[0]) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        for metadata in ((), (("ckptd-peer-token", "wrong-token-0123456789"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Inventory(peer_pb2.InventoryRequest(job="mn", step=1), metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "peer token" in info.value.details()
