"""Tier 0b on three daemons (loopback, node-local roots): each node's part of its newest committed
step is held in the next node's memory; a node replaced (SIGKILL, root wiped, started empty)
restores its slices from the buddy's memory in another layout, bit-exact, without storage.

Ranks are threads of this process with their own clients (CheckpointClient per rank), holding
row shards (LocalShard) of a few tensors; the values are a pure function of the name, so every
layout can check what it loaded.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import ssl
import threading
import time
from fractions import Fraction
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import grpc

from ckptd.client import CheckpointClient
from ckptd.client.reader import plan_fill
from ckptd.client.errors import CheckpointError
from ckptd.client.shards import LocalShard
from ckptd.daemon.tools.ops import render_status, status_doc
from ckptd.format.file_plan import CHECKED_SOURCE
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc
from daemon_rig import NodeSet, free_port, free_ports
from metrics_scrape import scrape
from pki import make_pki, tls_args

JOB = "rep"
SHAPES = {"w": (96, 64), "v": (60, 33), "b": (12,)}  # rows split over the ranks of a layout
BIG = {"big": (3 * 1024, 1024)}  # 4 MiB per node: a push at 2 MiB/s takes about 2 s
EXTRA = {"epoch": 3, "lr": 0.25}


def value(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn({**SHAPES, **BIG}[name], generator=g)


def even(parts: int) -> tuple[Fraction, ...]:
    return tuple(Fraction(i, parts) for i in range(parts + 1))


def shard_state(
    rank: int, bounds: tuple[Fraction, ...], dim: int, fill: Callable[[str], torch.Tensor], shapes: dict[str, tuple[int, ...]] = SHAPES
) -> dict[str, Any]:
    """Rank's shard of every tensor: [bounds[rank], bounds[rank + 1]) of its extent along `dim`
    (rows 0, columns 1; 1-D tensors by rows)."""
    model = {}
    for name, shape in shapes.items():
        d = dim if len(shape) > 1 else 0
        start, end = int(shape[d] * bounds[rank]), int(shape[d] * bounds[rank + 1])
        full = fill(name)
        part = full.narrow(d, start, end - start).clone()
        offsets = [0] * len(shape)
        offsets[d] = start
        model[name] = LocalShard(part, offsets, shape)
    return {"model": model, "extra": dict(EXTRA)}


def run_ranks(cluster: NodeSet, node_of_rank: list[int], action: Callable[[CheckpointClient, int, int], Any], job: str = JOB) -> list[Any]:
    """action(client, rank, world) on every rank at once, each rank a thread with its node's daemon."""
    world = len(node_of_rank)

    def one(rank: int) -> Any:
        node = node_of_rank[rank]
        with CheckpointClient(job, address=cluster.address(node), rank=rank, world_size=world,
                              local_world_size=node_of_rank.count(node), on_error="raise", timeout_s=60) as ckpt:
            return action(ckpt, rank, world)

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


def save(cluster: NodeSet, node_of_rank: list[int], step: int, shapes: dict[str, tuple[int, ...]] = SHAPES, job: str = JOB) -> None:
    """Every rank saves its share of the rows, durable when this returns."""
    def act(ckpt: CheckpointClient, rank: int, world: int) -> None:
        ckpt.save(step, shard_state(rank, even(world), 0, value, shapes)).wait_durable(timeout=60)

    run_ranks(cluster, node_of_rank, act, job)


def load_exact(
    cluster: NodeSet, node_of_rank: list[int], bounds: tuple[Fraction, ...], dim: int, step: int | None = None,
    shapes: dict[str, tuple[int, ...]] = SHAPES, job: str = JOB, after: dict[int, int] | None = None,
) -> list[int]:
    """Every rank loads its shard (`bounds` along `dim`); asserts each is bit-exact; returns the
    steps loaded. after[r]: rank r starts its load once rank after[r]'s is done."""
    finished = [threading.Event() for _ in node_of_rank]

    def act(ckpt: CheckpointClient, rank: int, world: int) -> int:
        state = shard_state(rank, bounds, dim, lambda name: torch.zeros(shapes[name]), shapes)
        state["extra"] = {"epoch": 0, "lr": 0.0}
        targets = {name: shard.tensor for name, shard in state["model"].items()}
        if after and rank in after:
            assert finished[after[rank]].wait(60), f"rank {after[rank]}'s load did not finish"
        try:
            loaded = ckpt.load(state, step=step)
        finally:
            finished[rank].set()
        expected = shard_state(rank, bounds, dim, value, shapes)
        for name, target in targets.items():
            assert torch.equal(target, expected["model"][name].tensor), (rank, name)
        assert state["extra"] == EXTRA, state["extra"]
        return loaded

    return run_ranks(cluster, node_of_rank, act, job)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def metric(port: int, name: str) -> float:
    return scrape(port).get(name, 0.0)


class Cluster:
    """Three nodes with node-local roots and a metrics port each; `args[node]`: that node's extra flags."""

    def __init__(self, make: Callable[..., NodeSet], args: dict[int, tuple[str, ...]] | None = None) -> None:
        self.nodes = make(3, shared_root=False)
        self.ports = free_ports(3)
        self.args = args or {}
        for node in range(3):
            self.start(node)

    def start(self, node: int) -> None:
        self.nodes.start(node, "--metrics-port", str(self.ports[node]), "--metrics-host", "127.0.0.1", *self.args.get(node, ()))

    def replaced(self, node: int) -> None:
        """The node's machine is replaced: its daemon killed, its root and shared memory gone, started empty."""
        self.nodes.running[node].kill()
        shutil.rmtree(self.nodes.root(node))
        for path in self.nodes.nodes[node].shm_dir.iterdir():
            path.unlink()
        self.start(node)

    def recoverable(self, step: int, job: str = JOB) -> bool:
        return metric(self.ports[0], f'ckptd_recoverable_step{{job="{job}"}}') == step

    def status(self, node: int) -> dict[str, Any]:
        """`ckptd status --json` of the node's daemon, and its text as `status["text"]`."""
        address = self.nodes.address(node)
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.CheckpointStub(channel).Status(pb.StatusRequest(), timeout=10)
        doc = status_doc(reply, address)
        return {**doc, "text": render_status(doc, time.time())}

    def replica_files(self, node: int, job: str = "") -> list[Path]:
        """The node's replica files in its shared memory (of `job` only, when given)."""
        marker = f"-replica-{job}-n" if job else "-replica-"
        return sorted(p for p in self.nodes.nodes[node].shm_dir.iterdir() if marker in p.name)

    def log_after(self, node: int, mark: int) -> str:
        """The node's daemon log from character `mark` on (a shared cluster's log holds earlier tests' lines)."""
        return self.nodes.running[node].log_text()[mark:]


@pytest.fixture
def cluster(node_sets: Callable[..., NodeSet]) -> Cluster:
    """A fresh cluster, for tests that kill, replace or reconfigure daemons or count from zero."""
    return Cluster(node_sets)


@pytest.fixture(scope="module")
def shared_cluster(module_node_sets: Callable[..., NodeSet]) -> Cluster:
    """One cluster for the tests that only save, damage or drop their own job's replicas and
    compare counters and logs with what they were before: each test uses a job of its own."""
    return Cluster(module_node_sets)


def staged(cluster: Cluster, node: int, tier: str) -> float:
    return metric(cluster.ports[node], f'ckptd_load_staged_bytes_total{{tier="{tier}"}}')


def piece_kinds(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    """The kinds of the pieces this process's ranks fill from (file, checked, shm), by the
    directory of their files, as loads fill them from now on (plan_fill.fill_all recorded)."""
    kinds: dict[str, set[str]] = {}
    real_fill_all = plan_fill.fill_all

    def fill_all(pool: Any, maps: Any, fills: Any) -> None:
        for fill in fills:
            for src in fill.sources:
                kinds.setdefault(str(Path(src.path).parent), set()).add(src.kind)
        real_fill_all(pool, maps, fills)

    monkeypatch.setattr(plan_fill, "fill_all", fill_all)
    return kinds


def test_a_replaced_node_restores_its_slices_from_the_buddys_memory_in_another_layout(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    kinds = piece_kinds(monkeypatch)  # the kinds of the pieces the ranks read, by the directory they are in
    shm1 = str(cluster.nodes.nodes[1].shm_dir)
    save(cluster.nodes, [0, 1, 2], step=1)
    save(cluster.nodes, [0, 1, 2], step=2)
    wait_for(lambda: cluster.recoverable(2), what="step 2 recoverable")
    held = [metric(p, "ckptd_replicas") for p in cluster.ports]
    assert held == [1, 1, 1]  # each node holds its predecessor's part, of the newest step only
    status = cluster.status(0)
    assert [(h["node"], h["step"]) for h in status["replicas"]["held"]] == [(2, 2)]
    assert status["replicas"]["jobs"][0]["recoverable_step"] == 2 and "recoverable from memory: step 2" in status["text"]
    assert "this node's part of step 2 held by nodes [1]" in status["text"]

    cluster.replaced(1)
    # node 1's two ranks split the rows of node 1's old part between them (another layout); its
    # files exist nowhere but in node 2's memory: nothing is read from any disk for them
    layout = (Fraction(0), Fraction(1, 3), Fraction(1, 2), Fraction(2, 3), Fraction(1))
    assert load_exact(cluster.nodes, [0, 1, 1, 2], layout, dim=0, step=None) == [2, 2, 2, 2]  # the newest step, from the peers
    assert staged(cluster, 1, "memory-peer") > 0 and staged(cluster, 1, "disk-peer") == 0
    assert metric(cluster.ports[2], "ckptd_replica_served_bytes_total") > 0
    assert not list(cluster.nodes.root(1).glob(f"{JOB}/step-*"))  # nothing of the step was written to node 1's root
    assert kinds[shm1] == {CHECKED_SOURCE}  # node 1's daemon checked every byte as it arrived: its ranks copy them unchecked
    kinds.clear()

    # columns on every node: each rank needs every node's part, from every tier there is
    assert load_exact(cluster.nodes, [0, 0, 1, 1, 2, 2], even(6), dim=1) == [2] * 6
    assert staged(cluster, 0, "memory-local") > 0  # node 2's part, held by node 0
    assert staged(cluster, 1, "disk-peer") > 0  # node 0's part: its replica was on node 1, which was replaced
    assert staged(cluster, 2, "memory-local") > 0  # node 1's part, held by node 2
    assert kinds[shm1] == {CHECKED_SOURCE, "file"}  # what node 1 staged from node 0's disk its ranks check

    # the job goes on: the replaced node saves its part again, and the next step is recoverable
    save(cluster.nodes, [0, 1, 2], step=3)
    wait_for(lambda: cluster.recoverable(3), what="step 3 recoverable")


# issue 34: a replaced node's daemon stages its part from the holder's memory as soon as it
# starts (node 0 says where it is held), before its ranks ask; their load fetches nothing again
# and copies what was checked on arrival unchecked. With --no-replica-prefetch the load fetches.
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_replaced_node_stages_its_part_before_its_ranks_ask(node_sets: Callable[..., NodeSet], monkeypatch: pytest.MonkeyPatch, prefetch: bool) -> None:
    cluster = Cluster(node_sets, {} if prefetch else {1: ("--no-replica-prefetch",)})
    kinds = piece_kinds(monkeypatch)
    save(cluster.nodes, [0, 1, 2], step=1, shapes={**SHAPES, **BIG})
    save(cluster.nodes, [0, 1, 2], step=2, shapes={**SHAPES, **BIG})
    wait_for(lambda: cluster.recoverable(2), what="step 2 recoverable")
    part = sum(path.stat().st_size for path in cluster.replica_files(2, JOB))  # node 1's part, held by node 2
    cluster.replaced(1)
    if prefetch:
        wait_for(lambda: staged(cluster, 1, "memory-peer") > 0, what="node 1's part staged ahead of its ranks")
        assert staged(cluster, 1, "memory-peer") == part
        wait_for(lambda: "staged this node's part" in cluster.nodes.running[1].log_text(), what="the prefetch logged")
    else:
        time.sleep(1.0)
        assert staged(cluster, 1, "memory-peer") == 0
    layout = (Fraction(0), Fraction(1, 3), Fraction(1, 2), Fraction(2, 3), Fraction(1))
    # node 1's second rank comes after its first has loaded (ranks of a relaunched job come apart)
    assert load_exact(cluster.nodes, [0, 1, 1, 2], layout, dim=0, shapes={**SHAPES, **BIG}, after={2: 1}) == [2, 2, 2, 2]
    if prefetch:
        assert staged(cluster, 1, "memory-peer") == part  # both loads found its bytes staged: nothing fetched twice
    else:
        assert 0 < staged(cluster, 1, "memory-peer") <= part
    assert kinds[str(cluster.nodes.nodes[1].shm_dir)] == {CHECKED_SOURCE}
    # the staging files go once the loads are done (the node's last rank's LoadDone ended the hold)
    wait_for(lambda: not [p for p in cluster.nodes.nodes[1].shm_dir.iterdir() if "-fetch-" in p.name], what="staging files removed")
    if prefetch:
        # node 0's part went with node 1's old machine: step 2 is no longer recoverable, yet node
        # 1's own part is still in node 2's memory, and the next replacement stages it again
        wait_for(lambda: not cluster.recoverable(2), timeout_s=30, what="step 2 no longer recoverable")
        cluster.replaced(1)
        wait_for(lambda: staged(cluster, 1, "memory-peer") == part, what="node 1's part staged ahead again")
        # a daemon restarted on its intact root (node 2, whose part node 0 holds) stages nothing
        cluster.nodes.running[2].kill()
        cluster.start(2)
        wait_for(lambda: "part of 1 job(s)' newest step; 0 B of it staged" in cluster.nodes.running[2].log_text(), what="node 2's prefetch done")
        assert staged(cluster, 2, "memory-peer") == 0 and not [p for p in cluster.nodes.nodes[2].shm_dir.iterdir() if "-fetch-" in p.name]


# issue 34: a prefetch that finds the holder's copy damaged (and the writer's disk gone: the node
# was replaced) keeps nothing staged and says why; the ranks' load then fails naming the damaged
# copy, as it does without a prefetch, and nothing damaged is ever handed to them.
def test_a_prefetch_of_a_damaged_replica_keeps_nothing_and_the_load_says_why(cluster: Cluster) -> None:
    save(cluster.nodes, [0, 1, 2], step=1)
    wait_for(lambda: cluster.recoverable(1), what="step 1 recoverable")
    (held,) = cluster.replica_files(2)  # node 1's part, in node 2's memory
    flip_last_byte(held)
    cluster.replaced(1)
    wait_for(lambda: "was not staged ahead of its ranks' load" in cluster.nodes.running[1].log_text(), what="the prefetch's failure logged")
    log = cluster.nodes.running[1].log_text()
    assert re.search(rf"the copy of node 1's part of step 1 of job '{JOB}' held in the memory of node 2 \(.* is damaged", log), log[-3000:]
    assert not [p for p in cluster.nodes.nodes[1].shm_dir.iterdir() if "-fetch-" in p.name]  # nothing kept
    with pytest.raises(CheckpointError, match="damaged"):
        load_exact(cluster.nodes, [0, 1, 2], even(3), dim=0, step=1)


def test_a_buddy_that_is_down_leaves_the_step_durable_and_says_it_is_not_recoverable(cluster: Cluster) -> None:
    cluster.nodes.running[2].kill()  # node 1's buddy; the job runs on nodes 0 and 1 only
    save(cluster.nodes, [0, 1], step=1)
    wait_for(lambda: cluster.status(0)["replicas"]["jobs"] and cluster.status(0)["replicas"]["jobs"][0]["not_recoverable"], what="the report")
    text = cluster.status(0)["text"]
    assert "not recoverable: step 1: node 1's part is held by no other node" in text and "node 2 (" in text, text
    assert metric(cluster.ports[1], 'ckptd_replica_pushes_total{outcome="failed"}') == 1
    assert not cluster.recoverable(1)
    assert "held by no other node" in cluster.status(1)["text"]
    assert load_exact(cluster.nodes, [0, 1], even(2), dim=0) == [1, 1]  # durable: it loads from disk


def test_a_replica_lost_after_the_load_was_planned_is_read_from_the_writers_disk(shared_cluster: Cluster) -> None:
    """The holder lost the replica it listed (here its files are removed from its shared memory,
    as a newer step's push or a restart would): the load reads those slices from the disk of
    the node that wrote them instead of failing."""
    cluster, job = shared_cluster, "lost"
    save(cluster.nodes, [0, 1, 2], step=1, job=job)
    wait_for(lambda: cluster.recoverable(1, job), what="step 1 recoverable")
    for path in cluster.replica_files(2, job):  # node 2 holds node 1's part
        path.unlink()
    staged_before, mark = staged(cluster, 0, "disk-peer"), len(cluster.nodes.running[0].log_text())
    assert load_exact(cluster.nodes, [0], even(1), dim=1, step=1, job=job) == [1]  # one rank on node 0 reads every node's part
    assert staged(cluster, 0, "disk-peer") > staged_before  # node 1's part (node 0's own comes from node 1's memory, tiers' order)
    assert "reading node 1's part from its disk instead" in cluster.log_after(0, mark)


def test_a_buddy_lost_after_the_push_makes_the_step_no_longer_recoverable(cluster: Cluster) -> None:
    """Node 0 keeps asking the holders of the recoverable step (every few seconds): a buddy that
    dies, or restarts with an empty memory, takes the step's recoverability with it until the
    next commit is pushed again."""
    save(cluster.nodes, [0, 1, 2], step=1)
    wait_for(lambda: cluster.recoverable(1), what="step 1 recoverable")
    cluster.nodes.running[2].kill()  # it held node 1's part
    wait_for(lambda: cluster.recoverable(-1), what="step 1 no longer recoverable")
    text = cluster.status(0)["text"]
    assert "not recoverable: step 1: node 1's part is no longer held by another node (node 2 does not answer" in text, text
    cluster.start(2)  # back, with nothing in memory: still not recoverable
    time.sleep(6)
    assert cluster.recoverable(-1) and "no longer held" in cluster.status(0)["text"]
    save(cluster.nodes, [0, 1, 2], step=2)
    wait_for(lambda: cluster.recoverable(2), what="step 2 recoverable")


def test_a_replica_over_the_buddys_memory_is_refused_and_never_half_held(node_sets: Callable[..., NodeSet]) -> None:
    cluster = Cluster(node_sets, {2: ("--replica-memory", "4KiB")})
    save(cluster.nodes, [0, 1, 2], step=1)
    wait_for(lambda: metric(cluster.ports[2], "ckptd_replica_refused_total") == 1, what="the refusal")
    wait_for(lambda: "larger than all of --replica-memory" in cluster.status(0)["text"], what="node 0's report")
    assert metric(cluster.ports[2], "ckptd_replica_bytes") == 0 and cluster.replica_files(2) == []
    cluster.replaced(1)
    with pytest.raises(CheckpointError) as info:  # node 1's part is nowhere: named, nothing served
        load_exact(cluster.nodes, [0, 1, 2], even(3), dim=0, step=1)
    assert info.value.code == "FAILED_PRECONDITION" and "not complete" in str(info.value) and "node 1 (" in str(info.value)


@pytest.mark.parametrize("victim", ["pusher", "buddy"])
def test_a_push_killed_mid_stream_leaves_nothing_servable(node_sets: Callable[..., NodeSet], victim: str) -> None:
    cluster = Cluster(node_sets, {1: ("--replica-bandwidth", "2MiB")})
    save(cluster.nodes, [0, 1, 2], step=1, shapes=BIG)
    wait_for(lambda: 0 < metric(cluster.ports[2], "ckptd_replica_bytes") and metric(cluster.ports[2], "ckptd_replicas") == 0, what="node 1's push under way")
    time.sleep(0.5)  # a part of it has arrived
    if victim == "pusher":
        cluster.nodes.running[1].kill()
        wait_for(lambda: metric(cluster.ports[2], "ckptd_replica_bytes") == 0, what="node 2 to drop the partial replica")
        assert cluster.replica_files(2) == []  # no partial file left, none listed
        assert "node 1" not in str(cluster.status(2)["replicas"]["held"])
        cluster.replaced(1)
        with pytest.raises(CheckpointError, match="not complete"):
            load_exact(cluster.nodes, [0, 1, 2], even(3), dim=0, step=1, shapes=BIG)
    else:
        cluster.nodes.running[2].kill()
        wait_for(lambda: metric(cluster.ports[1], 'ckptd_replica_pushes_total{outcome="failed"}') == 1, what="node 1's push to fail")
        wait_for(lambda: "node 1's part is held by no other node" in cluster.status(0)["text"], what="node 0's report")
        cluster.start(2)  # a restarted daemon holds nothing, and the dead one's files are gone
        assert metric(cluster.ports[2], "ckptd_replicas") == 0 and cluster.replica_files(2) == []
    save(cluster.nodes, [0, 1, 2], step=2)  # the next save is replicated again
    wait_for(lambda: cluster.recoverable(2), what="step 2 recoverable")


def test_replicas_travel_over_mutual_tls_when_the_peer_port_has_it(node_sets: Callable[..., NodeSet], tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", "cluster")
    cluster = Cluster(node_sets, {n: tuple(tls_args(pki)) for n in range(3)})
    save(cluster.nodes, [0, 1, 2], step=1)
    wait_for(lambda: cluster.recoverable(1), what="step 1 recoverable")  # pushed over TLS
    port = int(re.findall(r"bulk port 127\.0\.0\.1:(\d+)", cluster.nodes.running[2].log_text())[-1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:  # no TLS: nothing is served
        plain.sendall(b"CKB1" + bytes(32))
        try:
            answer = plain.recv(1)
        except ConnectionResetError:  # the failed handshake closed it with bytes unread
            answer = b""
        assert answer == b""
    client = ssl.create_default_context(cafile=str(pki["ca"]))  # the port speaks TLS: a handshake with the cluster's certificate completes
    client.load_cert_chain(pki["cert"], pki["key"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        assert tls.version() is not None and tls.getpeercert()
        tls.sendall(b"CKB1" + bytes(32))  # a ticket it never issued: closed, nothing served
        try:
            answer = tls.recv(1)
        except (ConnectionResetError, ssl.SSLError):  # closed under TLS without a close_notify
            answer = b""
        assert answer == b""
    cluster.replaced(1)
    assert load_exact(cluster.nodes, [0, 1, 1, 2], (Fraction(0), Fraction(1, 3), Fraction(1, 2), Fraction(2, 3), Fraction(1)), dim=0) == [1] * 4
    assert staged(cluster, 1, "memory-peer") > 0  # read over TLS


def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        byte = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([byte ^ 0xFF]))


# issue 30 finding 11: a buddy checks every byte of a replica against the step's checksums when it
# arrives; one that does not match is not kept, and the pushing node says which buddy refused it.
def test_a_replica_that_arrives_damaged_is_not_kept_and_the_step_is_not_recoverable(node_sets: Callable[..., NodeSet]) -> None:
    cluster = Cluster(node_sets, {1: ("--replica-bandwidth", "2MiB")})
    save(cluster.nodes, [0, 1, 2], step=1, shapes=BIG)
    # node 1's push reads its file at 2 MiB/s: its last bytes are damaged on disk before they are read
    (part,) = cluster.nodes.root(1).glob(f"{JOB}/step-00000001/*.safetensors")
    flip_last_byte(part)
    wait_for(lambda: metric(cluster.ports[1], 'ckptd_replica_pushes_total{outcome="failed"}') == 1, what="node 1's push to be refused")
    assert metric(cluster.ports[2], 'ckptd_replica_damaged_total{where="arrival"}') == 1
    assert metric(cluster.ports[2], "ckptd_replicas") == 0 and cluster.replica_files(2) == []
    job = cluster.status(1)["replicas"]["jobs"][0]
    assert job["holders"] == [] and "node 2 (" in job["push_error"] and f"{part.name} arrived damaged" in job["push_error"], job
    assert re.search(rf"node 1's part of step 1 of job '{JOB}' was not kept: {part.name} arrived damaged: bytes \[\d+, \d+\) do not match",
                     cluster.nodes.running[2].log_text())
    wait_for(lambda: "node 1's part is held by no other node" in cluster.status(0)["text"], what="node 0's report")
    assert not cluster.recoverable(1)


# issue 30 finding 11: a copy damaged in its holder's memory is named as the holder's, and the load
# reads those bytes from the disk of the node that wrote them instead.
def test_a_replica_damaged_in_memory_is_named_as_its_holders_and_the_load_reads_the_disk_instead(shared_cluster: Cluster) -> None:
    cluster, job = shared_cluster, "damaged"
    save(cluster.nodes, [0, 1, 2], step=1, job=job)
    wait_for(lambda: cluster.recoverable(1, job), what="step 1 recoverable")
    for node in range(3):  # every replica: node 1's part held by node 2, node 2's by node 0, node 0's by node 1
        (held,) = cluster.replica_files(node, job)
        flip_last_byte(held)
    damaged_before = metric(cluster.ports[0], 'ckptd_replica_damaged_total{where="load"}')
    staged_before, mark = staged(cluster, 0, "disk-peer"), len(cluster.nodes.running[0].log_text())
    # one rank on node 0 reads every node's part: its own from node 1's memory, node 1's from node
    # 2's memory, node 2's from its own memory (the tiers' order); each copy is damaged
    assert load_exact(cluster.nodes, [0], even(1), dim=1, step=1, job=job) == [1]
    log = cluster.log_after(0, mark)
    for holder, source in (("node 1 (", 0), ("node 2 (", 1), ("this node (node 0)", 2)):
        assert re.search(rf"the copy of node {source}'s part of step 1 of job '{job}' held in the memory of {re.escape(holder)}.* is damaged: "
                         rf"[\w.-]+\.safetensors: bytes \[\d+, \d+\) do not match", log), (holder, log[-3000:])
    assert metric(cluster.ports[0], 'ckptd_replica_damaged_total{where="load"}') == damaged_before + 3
    assert staged(cluster, 0, "disk-peer") > staged_before and "reading node 1's part from its disk instead" in log


class Forwarder:
    """A TCP relay: connections to (host, port) are passed on to (to_host, port), byte for byte,
    except that with `flip_at` the byte at that position of what comes back on each connection
    is inverted (a copy damaged in transit)."""

    def __init__(self, host: str, port: int, to_host: str, flip_at: int | None = None) -> None:
        self.to = (to_host, port)
        self.flip_at = flip_at
        self.flipped = 0
        self.listener = socket.create_server((host, port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self.to)
            threading.Thread(target=self._pump, args=(conn, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, self.flip_at), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    damaged = bytearray(data)
                    damaged[flip_at - seen] ^= 0xFF
                    data, self.flipped = bytes(damaged), self.flipped + 1
                seen += len(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            src.close()
            dst.close()

    def close(self) -> None:
        self.listener.close()


# issue 34: bytes of a replica damaged on their way from the holder (here by a relay between node 0
# and node 2 that inverts one byte of every bulk transfer) are refused on arrival, named as the
# holder's copy, and the load reads those bytes from the writer's disk instead; the copy in the
# holder's memory is intact.
def test_a_replica_damaged_in_transit_is_refused_on_arrival_and_the_load_reads_the_disk_instead(node_sets: Callable[..., NodeSet]) -> None:
    nodes = node_sets(3, shared_root=False)
    bulk_port = free_port()
    peer_port = int(nodes.peers[2].rpartition(":")[2])
    relays = [Forwarder("127.0.0.2", peer_port, "127.0.0.1"), Forwarder("127.0.0.2", bulk_port, "127.0.0.1", flip_at=100)]
    try:
        # node 0 reaches node 2 (its peer port and its bulk port) through the relays only
        seen_by_0 = ",".join([*nodes.peers[:2], f"127.0.0.2:{peer_port}"])
        cluster = Cluster(lambda *args, **kwargs: nodes, {0: ("--peers", seen_by_0), 2: ("--replica-port", str(bulk_port))})
        save(cluster.nodes, [0, 1, 2], step=1)
        wait_for(lambda: cluster.recoverable(1), what="step 1 recoverable")
        damaged_before, mark = metric(cluster.ports[0], 'ckptd_replica_damaged_total{where="load"}'), len(cluster.nodes.running[0].log_text())
        # one rank on node 0 reads every node's part: node 1's from node 2's memory, through the relay
        assert load_exact(cluster.nodes, [0], even(1), dim=1, step=1) == [1]
        log = cluster.log_after(0, mark)
        assert relays[1].flipped >= 1
        assert re.search(rf"the copy of node 1's part of step 1 of job '{JOB}' held in the memory of node 2 \(.* is damaged: "
                         rf"[\w.-]+\.safetensors: bytes \[\d+, \d+\) do not match", log), log[-3000:]
        assert "reading node 1's part from its disk instead" in log and staged(cluster, 0, "disk-peer") > 0
        assert metric(cluster.ports[0], 'ckptd_replica_damaged_total{where="load"}') == damaged_before + 1
        (held,) = cluster.replica_files(2)
        (written,) = cluster.nodes.root(1).glob(f"{JOB}/step-00000001/*.safetensors")
        assert held.read_bytes() == written.read_bytes()  # the holder's copy was never damaged
    finally:
        for relay in relays:
            relay.close()


# issue 34: only bytes a replica tier checked as they arrived are handed to the ranks unchecked; the
# bytes a load stages from disk instead (a damaged replica's) are checked by the ranks, so a disk
# copy damaged too fails the load rather than being loaded.
def test_when_the_replica_and_the_writers_disk_are_both_damaged_the_load_fails(shared_cluster: Cluster) -> None:
    cluster, job = shared_cluster, "damaged-twice"
    save(cluster.nodes, [0, 1, 2], step=1, job=job)
    wait_for(lambda: cluster.recoverable(1, job), what="step 1 recoverable")
    (held,) = cluster.replica_files(2, job)  # node 1's part in node 2's memory
    (written,) = cluster.nodes.root(1).glob(f"{job}/step-00000001/*.safetensors")
    flip_last_byte(held)
    flip_last_byte(written)
    with pytest.raises(CheckpointError, match=rf"checksum mismatch .* in {re.escape(written.name)}|{re.escape(written.name)}.* damaged"):
        load_exact(cluster.nodes, [0], even(1), dim=1, step=1, job=job)


# issue 34: a replaced node of a large job asks the peers that can hold what its ranks read (the
# lowest other node for the step, the writer's buddies for the files), not every node: here two
# nodes it does not need are stopped (SIGSTOP: every call to them waits out its deadline,
# INVENTORY_TIMEOUT_S = 3 s), and its load does not wait for them
def test_a_replaced_node_asks_only_the_peers_that_can_hold_what_it_reads(node_sets: Callable[..., NodeSet]) -> None:
    nodes = node_sets(5, shared_root=False)
    ports = free_ports(5)
    for n in range(5):
        nodes.start(n, "--metrics-port", str(ports[n]), "--metrics-host", "127.0.0.1")
    save(nodes, [0, 1, 2, 3, 4], step=1)
    wait_for(lambda: metric(ports[0], f'ckptd_recoverable_step{{job="{JOB}"}}') == 1, what="step 1 recoverable")
    nodes.running[1].kill()
    shutil.rmtree(nodes.root(1))
    for path in nodes.nodes[1].shm_dir.iterdir():
        path.unlink()
    nodes.start(1, "--metrics-port", str(ports[1]), "--metrics-host", "127.0.0.1")
    stopped = [nodes.running[n] for n in (3, 4)]
    for daemon in stopped:
        os.kill(daemon.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        # node 1's rank loads its own rows, whose file only node 2 holds now (in memory)
        assert load_exact(nodes, [1], (Fraction(1, 5), Fraction(2, 5)), dim=0, step=None) == [1]
        seconds = time.monotonic() - started
    finally:
        for daemon in stopped:
            os.kill(daemon.pid, signal.SIGCONT)
    assert metric(ports[1], 'ckptd_load_staged_bytes_total{tier="memory-peer"}') > 0
    assert seconds < 3.0, f"the load took {seconds:.1f} s: it waited for a peer it does not need"
