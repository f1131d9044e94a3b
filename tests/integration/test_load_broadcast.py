"""Load broadcast on four daemons (loopback), a shared root and node-local roots: every layout a
job saves and loads in (data-parallel, tensor-parallel, pipeline stages, their mixtures, another
world size) loads bit-exact with broadcast on; where replicas on several nodes need one another's
files, the writers serve them from blocks read once (ckptd_load_broadcast_bytes); a writer that
is gone or stopped is not waited for (shared root: the file is read there instead).

Ranks are threads of this process with their own clients; values are a pure function of the
tensor's name, so every layout checks what it loaded.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.shards import LocalShard
from ckptd.format.index import CheckpointIndex, step_dir_name
from daemon_rig import NodeSet, free_ports
from metrics_scrape import scrape

NODES = 4
SHAPES = {f"s{stage}.w{i}": (64, 48) for stage in range(2) for i in range(4)}  # two pipeline stages of 4 tensors


def value(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


@dataclass(frozen=True)
class Rank:
    """One rank of a layout: its node, the pipeline stage it holds (None: all) and its rows (part of parts)."""

    node: int
    stage: int | None
    part: int
    parts: int

    def state(self, fill: Callable[[str], torch.Tensor]) -> dict[str, Any]:
        model = {}
        for name, shape in SHAPES.items():
            if self.stage is not None and not name.startswith(f"s{self.stage}."):
                continue
            lo, hi = shape[0] * self.part // self.parts, shape[0] * (self.part + 1) // self.parts
            model[name] = LocalShard(fill(name)[lo:hi].clone(), (lo, 0), shape)
        return {"model": model}


def dp(nodes: list[int]) -> list[Rank]:
    return [Rank(n, None, 0, 1) for n in nodes]


def tp(nodes: list[int]) -> list[Rank]:
    return [Rank(n, None, i, len(nodes)) for i, n in enumerate(nodes)]


# (name, saved by, loaded by, whether replicas on several nodes need one another's files)
LAYOUTS = [
    ("dp4", dp([0, 1, 2, 3]), dp([0, 1, 2, 3]), True),
    ("tp4", tp([0, 1, 2, 3]), tp([0, 1, 2, 3]), False),
    ("pp2-tp2", [Rank(0, 0, 0, 2), Rank(1, 0, 1, 2), Rank(2, 1, 0, 2), Rank(3, 1, 1, 2)],
     [Rank(0, 0, 0, 2), Rank(1, 0, 1, 2), Rank(2, 1, 0, 2), Rank(3, 1, 1, 2)], False),
    ("tp2-dp2", [Rank(0, None, 0, 2), Rank(1, None, 1, 2), Rank(2, None, 0, 2), Rank(3, None, 1, 2)],
     [Rank(0, None, 0, 2), Rank(1, None, 1, 2), Rank(2, None, 0, 2), Rank(3, None, 1, 2)], True),
    ("pp2-dp2", [Rank(0, 0, 0, 1), Rank(1, 1, 0, 1), Rank(2, 0, 0, 1), Rank(3, 1, 0, 1)],
     [Rank(0, 0, 0, 1), Rank(1, 1, 0, 1), Rank(2, 0, 0, 1), Rank(3, 1, 0, 1)], True),
    ("tp4-to-tp2-dp2", tp([0, 1, 2, 3]), [Rank(0, None, 0, 2), Rank(1, None, 1, 2), Rank(2, None, 0, 2), Rank(3, None, 1, 2)], True),
    ("dp4-to-tp8", dp([0, 1, 2, 3]), tp([0, 0, 1, 1, 2, 2, 3, 3]), True),
    ("tp4-to-dp2", tp([0, 1, 2, 3]), dp([0, 2]), True),
]


class Cluster:
    """Four daemons with a metrics port each; `shared`: one root for all."""

    def __init__(self, make: Callable[..., NodeSet], shared: bool, *args: str) -> None:
        self.nodes = make(NODES, shared_root=shared)
        self.ports = free_ports(NODES)
        for node in range(NODES):
            self.nodes.start(node, "--metrics-port", str(self.ports[node]), "--metrics-host", "127.0.0.1", "--replicas", "0",
                             *(args or (("--load-broadcast", "on") if shared else ())))

    def run(self, job: str, ranks: list[Rank], action: Callable[[CheckpointClient, Rank], Any]) -> list[Any]:
        def one(r: int) -> Any:
            rank = ranks[r]
            local = sum(1 for x in ranks if x.node == rank.node)
            with CheckpointClient(job, address=self.nodes.address(rank.node), rank=r, world_size=len(ranks), local_world_size=local,
                                  on_error="raise", timeout_s=120) as ckpt:
                return action(ckpt, rank)

        with ThreadPoolExecutor(len(ranks)) as pool:
            return list(pool.map(one, range(len(ranks))))

    def save(self, job: str, ranks: list[Rank]) -> None:
        self.run(job, ranks, lambda ckpt, rank: ckpt.save(1, rank.state(value)).wait_durable(timeout=120))

    def load_exact(self, job: str, ranks: list[Rank]) -> None:
        def act(ckpt: CheckpointClient, rank: Rank) -> None:
            state = rank.state(lambda name: torch.zeros(SHAPES[name]))
            assert ckpt.load(state, step=1, strict=rank.stage is None) == 1
            for name, shard in rank.state(value)["model"].items():
                assert torch.equal(state["model"][name].tensor, shard.tensor), (rank, name)

        self.run(job, ranks, act)

    def broadcast_bytes(self, kind: str, nodes: range = range(NODES)) -> float:
        return sum(scrape(self.ports[n]).get(f'ckptd_load_broadcast_bytes_total{{kind="{kind}"}}', 0.0) for n in nodes)

    def writers(self, job: str) -> set[int]:
        root = self.nodes.root(0)
        index = CheckpointIndex.from_json_bytes((root / job / step_dir_name(1) / "ckptd.index.json").read_bytes())
        return {f.node for f in index.files if f.name.endswith(".safetensors")}


@pytest.fixture(scope="module", params=[True, False], ids=["shared-root", "node-local-roots"])
def cluster(request: pytest.FixtureRequest, module_node_sets: Callable[..., NodeSet]) -> Iterator[Cluster]:
    made = Cluster(module_node_sets, request.param)
    yield made
    made.nodes.close()


@pytest.mark.parametrize("name, saved, loaded, shares", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_broadcast_reads_are_bit_exact_in_every_layout(cluster: Cluster, name: str, saved: list[Rank], loaded: list[Rank], shares: bool) -> None:
    cluster.save(name, saved)
    served = cluster.broadcast_bytes("served")
    cluster.load_exact(name, loaded)
    if shares:
        assert cluster.broadcast_bytes("served") > served, "replicas on several nodes read one another's files from storage"
    if not shares:
        assert cluster.broadcast_bytes("served") == served, "each node reads only its own files: nothing to relay"
    assert cluster.broadcast_bytes("fallback") == 0


def test_a_writer_gone_or_stopped_is_not_waited_for(node_sets: Callable[..., NodeSet]) -> None:
    """Shared root: node 2's daemon killed, node 3's stopped (SIGSTOP: it accepts and never
    answers); the other nodes' replicas load their files from the root, bit-exact, within the
    fetch deadline, and count them as fall-back bytes."""
    cluster = Cluster(node_sets, True)
    cluster.save("gone", dp([0, 1, 2, 3]))
    assert {2, 3} <= cluster.writers("gone")
    cluster.nodes.running[2].kill()
    stopped = cluster.nodes.running[3].pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        started = time.monotonic()
        cluster.load_exact("gone", dp([0, 1]))
        took = time.monotonic() - started
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert cluster.broadcast_bytes("fallback", range(2)) > 0
    assert took < 60, f"the load waited {took:.0f} s for nodes that do not answer"


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_shared_root_is_read_where_needed_unless_on(node_sets: Callable[..., NodeSet], tmp_path: Path, mode: str) -> None:
    """off, and auto (the default) with a shared root: every node reads its ranks' files from the
    root itself; no relay, no blocks read once."""
    cluster = Cluster(node_sets, True, "--load-broadcast", mode)
    cluster.save(mode, dp([0, 1, 2, 3]))
    cluster.load_exact(mode, dp([0, 1, 2, 3]))
    assert cluster.broadcast_bytes("served") == cluster.broadcast_bytes("read") == 0
