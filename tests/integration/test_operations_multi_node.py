"""Operations with several nodes on loopback: retention by metric applied on every node's own
root after each commit, status and metrics on each node, and a member's peer-port health while
it drains."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from on_disk import committed  # tests/on_disk.py
from ckptd.client import CheckpointClient
from daemon_rig import free_port


def save_on_two_nodes(cluster, step: int, state: dict, metric: float) -> None:
    """Ranks 0, 1 on node 0 and 2, 3 on node 1 save `state` with `metric`, until committed."""

    def rank_saves(rank: int) -> None:
        node = rank // 2
        with CheckpointClient("mnk", address=cluster.address(node), rank=rank, world_size=4, local_world_size=2, on_error="raise", timeout_s=60) as ckpt:
            ckpt.save(step, state, metric=metric).wait_durable(timeout=60)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(rank_saves, range(4)))


def test_retention_by_metric_on_node_local_roots_and_status_per_node(node_sets) -> None:
    cluster = node_sets(2, shared_root=False)
    ports = [free_port(), free_port()]
    for node in (0, 1):
        cluster.start(node, "--keep-last", "1", "--keep-best", "1", "--best-mode", "max", "--metrics-port", str(ports[node]), "--metrics-host", "127.0.0.1")
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}": torch.randn(20000 + 3000 * i, generator=g) for i in range(8)}}  # a replica on every rank
    accuracy = {1: 0.5, 2: 0.8, 3: 0.6, 4: 0.7, 5: 0.1}  # higher is better: step 2 is the best
    kept_after = {1: [1], 2: [2], 3: [2, 3], 4: [2, 4], 5: [2, 5]}
    for step, metric in accuracy.items():
        save_on_two_nodes(cluster, step, state, metric)
        for node in (0, 1):  # each node keeps the same steps in its own root
            assert committed(cluster.root(node), "mnk") == kept_after[step], (node, step)

    for node in (0, 1):
        out = subprocess.run([sys.executable, "-m", "ckptd.daemon.app.cli", "status", "--address", cluster.address(node), "--json"],
                             capture_output=True, text=True, timeout=60)
        doc = json.loads(out.stdout)
        assert (doc["node_rank"], doc["nodes"], doc["committed_total"]) == (node, 2, 5)
        assert doc["last_commit"]["step"] == 5 and doc["bytes_written_total"] > 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{ports[node]}/metrics", timeout=10).read().decode()
        assert f'ckptd_info{{node="{node}",version="0.1.0"}} 1.0' in text
        assert 'ckptd_commits_total{job="mnk"} 5.0' in text
        assert 'ckptd_retention_deleted_steps_total{job="mnk"} 3.0' in text
        # each node wrote about half of the data (replicas are spread over the nodes)
        assert 'ckptd_written_bytes_total{job="mnk"}' in text


def test_a_draining_member_is_not_ready_on_its_peer_port(node_sets) -> None:
    """SIGTERM on node 1 with a save open: its peer port's health ("" and ckptd.v1.Peer) is
    NOT_SERVING while it drains (HealthServicer.enter_graceful_shutdown), and it exits 0 once
    the save is decided."""
    import signal
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ckptd.wire.v1 import checkpoint_pb2 as pb
    from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

    cluster = node_sets(2, shared_root=False)
    cluster.start_all()
    member = cluster.running[1]
    who = pb.RankId(job="drained", rank=1, world_size=2, local_world_size=1)
    meta = pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], box=pb.Box(offsets=[0], lengths=[4]))
    with grpc.insecure_channel(member.address) as channel, grpc.insecure_channel(cluster.peers[1]) as peer:
        stub = pb_grpc.CheckpointStub(channel)
        begun = stub.BeginSave.future(pb.BeginSaveRequest(who=who, step=1, fingerprint="f-drain", tensors=[meta], timeout_s=4), timeout=30)
        deadline = time.monotonic() + 10
        while not stub.Status(pb.StatusRequest(), timeout=10).in_flight and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 1 joined; rank 0 never does
        member.popen.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(peer)

        def status(service: str) -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

        while status("") != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [status(""), status("ckptd.v1.Peer")] == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2
        assert begun.exception(timeout=30) is not None  # the save never completed
    assert member.stop(timeout_s=60) == 0
