"""A node lost while its replica is being pushed (issue 34): three daemons on loopback with
node-local roots; step 1 is recoverable from memory, step 2 is committed and node 1's part of it
is on its way to node 2 (its buddy; node 1 sends at 4 MiB/s, so the push of its 16 MiB takes
about 4 s) when the writer (node 1) or the buddy (node 2) is SIGKILLed.

What must hold: the buddy never lists a partial replica (node 1's part of step 2 is never among
what node 2 holds; step 1's stays until a complete newer one replaces it); the commit (step 2)
and the previous step load bit-exact once the node is back with its disk; a replacement node
with an empty root restores what survives in its buddies' memory bit-exact; and nothing is left
in shared memory: no `.part` file, no file of a dead daemon.

Ranks are threads of this process with their own clients; a rank's rows of every tensor at step
s are a pure function of (name, s), so every load checks what it got.
"""

from __future__ import annotations

import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.errors import CheckpointError
from ckptd.client.shards import LocalShard
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc
from daemon_rig import NodeSet, free_ports
from metrics_scrape import scrape

pytestmark = pytest.mark.slow

JOB = "pushloss"
SHAPES = {"big": (3 * 4096, 1024), "small": (96, 33)}  # 16 MiB of node 1's part: a push of about 4 s at 4 MiB/s
NODE_1_BANDWIDTH = "4MiB"


def value(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) + 1000 * step)
    return torch.randn(SHAPES[name], generator=g)


def shard_state(rank: int, world: int, fill: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """Rank's rows [rank/world, (rank+1)/world) of every tensor."""
    model = {}
    for name, shape in SHAPES.items():
        start, end = shape[0] * rank // world, shape[0] * (rank + 1) // world
        model[name] = LocalShard(fill(name)[start:end].clone(), (start, 0), shape)
    return {"model": model}


class Cluster:
    """Three nodes, node-local roots, a metrics port each; node 1 pushes its replicas slowly."""

    def __init__(self, make: Callable[..., NodeSet]) -> None:
        self.nodes = make(3, shared_root=False)
        self.ports = free_ports(3)
        self.pids: dict[int, list[int]] = {n: [] for n in range(3)}  # every daemon each node ran
        for node in range(3):
            self.start(node)

    def start(self, node: int) -> None:
        extra = ("--replica-bandwidth", NODE_1_BANDWIDTH) if node == 1 else ()
        daemon = self.nodes.start(node, "--metrics-port", str(self.ports[node]), "--metrics-host", "127.0.0.1", "--keep-last", "3", *extra)
        self.pids[node].append(daemon.pid)

    def kill(self, node: int) -> None:
        self.nodes.running[node].kill()

    def replace(self, node: int) -> None:
        """A new machine for the node: its daemon gone, its root and shared memory empty, started."""
        self.kill(node)
        shutil.rmtree(self.nodes.root(node))
        for path in self.shm(node).iterdir():
            path.unlink()
        self.start(node)

    def shm(self, node: int) -> Path:
        return self.nodes.nodes[node].shm_dir

    def metric(self, node: int, name: str) -> float:
        return scrape(self.ports[node]).get(name, 0.0)

    def recoverable(self, step: int) -> bool:
        return self.metric(0, f'ckptd_recoverable_step{{job="{JOB}"}}') == step

    def held(self, node: int) -> list[tuple[int, int]]:
        """(source node, step) of every replica the node's daemon lists as held."""
        with grpc.insecure_channel(self.nodes.address(node)) as channel:
            reply = pb_grpc.CheckpointStub(channel).Status(pb.StatusRequest(), timeout=10)
        return sorted((h.node, h.step) for h in reply.replicas.held)

    def receiving(self, node: int, source: int, step: int) -> list[Path]:
        """The `.part` files of source's part of the step that the node is receiving."""
        return [p for p in self.shm(node).iterdir() if f"-replica-{JOB}-n{source}-s{step}-" in p.name and p.name.endswith(".part")]

    def left_behind(self) -> list[str]:
        """Shared-memory files no running daemon owns: any `.part` file, any file of a dead daemon."""
        found = []
        for node in range(3):
            live = self.nodes.running[node].pid
            for path in self.shm(node).iterdir():
                pids = {int(p) for p in re.findall(r"-(\d+)-", path.name)}
                if path.name.endswith(".part") or (pids & set(self.pids[node]) - {live}):
                    found.append(f"node {node}: {path.name}")
        return found


def run_ranks(cluster: Cluster, nodes: list[int], action: Callable[[CheckpointClient, int, int], Any]) -> list[Any]:
    """action(client, rank, world) on one rank per node of `nodes` at once, each a thread."""
    world = len(nodes)

    def one(rank: int) -> Any:
        with CheckpointClient(JOB, address=cluster.nodes.address(nodes[rank]), rank=rank, world_size=world, local_world_size=1,
                              on_error="raise", timeout_s=120) as ckpt:
            return action(ckpt, rank, world)

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


def save(cluster: Cluster, step: int) -> None:
    run_ranks(cluster, [0, 1, 2], lambda ckpt, rank, world: ckpt.save(step, shard_state(rank, world, lambda n: value(n, step))).wait_durable(timeout=120))


def load_exact(cluster: Cluster, step: int) -> None:
    """Every node's rank loads its rows of the step; each checked bit-exact."""
    def act(ckpt: CheckpointClient, rank: int, world: int) -> None:
        state = shard_state(rank, world, lambda n: torch.zeros(SHAPES[n]))
        assert ckpt.load(state, step=step) == step
        expected = shard_state(rank, world, lambda n: value(n, step))
        for name in SHAPES:
            assert torch.equal(state["model"][name].tensor, expected["model"][name].tensor), (step, rank, name)

    run_ranks(cluster, [0, 1, 2], act)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def staged(cluster: Cluster, node: int, tier: str) -> float:
    return cluster.metric(node, f'ckptd_load_staged_bytes_total{{tier="{tier}"}}')


def push_of_step_2_under_way(cluster: Cluster) -> None:
    """Step 1 recoverable, step 2 committed; returns once node 2 has received part of node 1's
    step-2 part, checking all along that it lists only step 1's."""
    save(cluster, 1)
    wait_for(lambda: cluster.recoverable(1), "step 1 recoverable")
    save(cluster, 2)
    deadline = time.monotonic() + 60
    while not cluster.receiving(2, 1, 2):
        assert (1, 1) in cluster.held(2) and (1, 2) not in cluster.held(2)
        assert time.monotonic() < deadline, "node 1's push of step 2 never started"
        time.sleep(0.05)
    time.sleep(1.0)  # a part of it has arrived: about 4 MiB of 16
    assert cluster.receiving(2, 1, 2) and (1, 1) in cluster.held(2) and (1, 2) not in cluster.held(2), cluster.held(2)


def test_the_writer_lost_mid_push_leaves_the_buddy_with_the_previous_replica_only(node_sets: Callable[..., NodeSet]) -> None:
    cluster = Cluster(node_sets)
    push_of_step_2_under_way(cluster)
    cluster.kill(1)
    wait_for(lambda: not cluster.receiving(2, 1, 2), "node 2 to drop the partial replica")
    assert (1, 2) not in cluster.held(2) and (1, 1) in cluster.held(2), cluster.held(2)  # never listed; step 1's kept
    assert not any("-s2-" in p.name for p in cluster.shm(2).iterdir() if "-n1-" in p.name)

    # the node back with its disk: the commit and the previous step load bit-exact
    cluster.start(1)
    load_exact(cluster, 2)
    load_exact(cluster, 1)
    assert cluster.left_behind() == []  # the dead daemon's arenas went with its restart

    # a new machine for node 1: step 1's part survives in node 2's memory and restores from it
    cluster.replace(1)
    load_exact(cluster, 1)
    assert staged(cluster, 1, "memory-peer") >= 16 * 2**20 and staged(cluster, 1, "disk-peer") == 0  # the new daemon's counters
    with pytest.raises(CheckpointError, match="not complete"):  # node 1's part of step 2 was on its lost disk only
        load_exact(cluster, 2)
    assert cluster.left_behind() == []


def test_the_buddy_lost_mid_push_leaves_nothing_and_the_surviving_copies_restore(node_sets: Callable[..., NodeSet]) -> None:
    cluster = Cluster(node_sets)
    push_of_step_2_under_way(cluster)
    assert (2, 2) in cluster.held(0)  # node 2's own part of step 2 (not slowed) is in node 0's memory
    cluster.kill(2)
    wait_for(lambda: cluster.metric(1, 'ckptd_replica_pushes_total{outcome="failed"}') == 1, "node 1's push to fail")
    assert not cluster.recoverable(2)

    # the buddy back with its disk and an empty memory: nothing of the dead one's is served or left
    cluster.start(2)
    assert cluster.held(2) == [] and cluster.left_behind() == []
    load_exact(cluster, 2)
    load_exact(cluster, 1)

    # a new machine for node 2: its part of step 2 survives in node 0's memory and restores from it
    cluster.replace(2)
    load_exact(cluster, 2)
    assert staged(cluster, 2, "memory-peer") > 0 and staged(cluster, 2, "disk-peer") == 0
    assert cluster.left_behind() == []

    save(cluster, 3)  # the job goes on: the next commit is pushed whole again
    wait_for(lambda: cluster.recoverable(3), "step 3 recoverable")
    assert (1, 3) in cluster.held(2) and cluster.left_behind() == []
