"""Several nodes on loopback: a daemon per node (own socket, shared memory, root or a shared
root), trainer ranks as gloo processes, each talking to its node's daemon."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from ckptd.client import CheckpointClient
from ckptd.client.errors import CheckpointError
from ckptd.format.index import CheckpointIndex
from pki import make_pki, tls_args  # tests/pki.py (shared with test_peer_security.py)
from daemon_rig import free_port


WORKER = Path(__file__).with_name("dist_worker.py")


RANKS_SCRIPT = Path(__file__).with_name("ranks.py")
S0, S1, R = ["S", 0], ["S", 1], ["R"]
SAVED = {"w_even": [S0], "w_uneven": [S0], "b": [R], "tiny": [S0]}


def spread(world: int, nodes: int) -> list[int]:
    """The node of each rank: consecutive blocks, as torchrun places them (sizes differ by at most one)."""
    return [r * nodes // world for r in range(world)]


def run_job(
    cluster, tmp: Path, mode: str, mesh: list[int], placements: dict, step: int, node_of_rank: list[int], job: str = "mn", **extra: object
) -> list[dict]:
    world = math.prod(mesh)
    assert len(node_of_rank) == world
    out = tmp / f"{mode}-{'x'.join(map(str, mesh))}-{free_port()}"
    out.mkdir()
    spec = {
        "addresses": [cluster.address(n) for n in node_of_rank],
        "local_world_size": [node_of_rank.count(n) for n in node_of_rank],
        "job": job, "step": step, "mode": mode, "mesh": mesh, "placements": placements, "out": str(out), **extra,
    }
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), json.dumps({**spec, "rank": r, "world_size": world, "port": port})])
        for r in range(world)
    ]
    codes = [p.wait(180) for p in procs]
    assert codes == [0] * world, codes
    results = [json.loads((out / f"{r}.json").read_text()) for r in range(world)]
    for _r, result in enumerate(results):
        result["dir"] = str(out)
    return results


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
    fragments = [f for t in index.tensors for f in t.fragments]
    assert all(f.chunk_bytes and len(f.chunk_xxh3) == 16 * -(-f.nbytes // f.chunk_bytes) for f in fragments)  # partial reads are checked
    assert {f.node for f in index.files if f.name.startswith("model-")} == {0, 1}
    assert (cluster.root(0) / "mn" / "latest").read_text().strip() == "step-00000001"


@pytest.mark.parametrize(
    "mesh, placements, nodes",
    [
        ([3], {"w_even": [S0], "w_uneven": [S0], "b": [S0], "tiny": [S0]}, 2),  # uneven shards over 3 ranks
        pytest.param([8], {"w_even": [S1], "w_uneven": [S1], "b": [S0], "tiny": [S1]}, 2, marks=pytest.mark.long),  # Shard(0) -> Shard(1), 8 ranks (pytest -m long)
        pytest.param([2, 2], {"w_even": [R, S0], "w_uneven": [S0, S1], "b": [R, R], "tiny": [S1, S0]}, 2, marks=pytest.mark.long),  # 1-D -> 2-D mesh (test_reshard loads it from one node by default)
        ([2], {"w_even": [R], "w_uneven": [S1], "b": [R], "tiny": [R]}, 1),  # Shard -> Replicate, one node
    ],
)
def test_saved_on_two_nodes_loaded_by_another_layout(shared_cluster, mesh: list[int], placements: dict, nodes: int) -> None:
    cluster, base, _ = shared_cluster
    world = math.prod(mesh)
    loaded = run_job(cluster, base, "load", mesh, placements, step=1, node_of_rank=spread(world, nodes))
    for result in loaded:
        assert result["step"] == 1 and all(result["exact"].values()), result


def test_export_makes_whole_tensors_of_fragments_written_by_several_nodes(shared_cluster, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ckptd.daemon.tools.export import export_model

    cluster, _, _ = shared_cluster
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import SHAPES, global_value

    step_dir = cluster.root(0) / "mn" / "step-00000001"
    assert not (step_dir / "model.safetensors.index.json").exists()  # fragments: not HF-loadable as they are
    export_model(step_dir, tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    assert sorted(exported) == sorted(SHAPES)
    assert all(torch.equal(exported[name], global_value(name)) for name in SHAPES)


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


# ------------------------------------------------------------------ node-local roots


@pytest.fixture(scope="module")
def local_cluster(module_node_sets):
    """Two nodes, each with its own root, and one save by 4 ranks (2 per node); no replicas in
    the other node's memory (tier 0b: test_replicas.py), so a node's files are on its disk only."""
    cluster = module_node_sets(2, shared_root=False)
    cluster.start_all("--replicas", "0")
    run_job(cluster, cluster.base, "save", [4], SAVED, step=1, node_of_rank=spread(4, 2), job="local")
    return cluster


def test_each_node_keeps_its_own_files_and_the_same_index(local_cluster) -> None:
    cluster = local_cluster
    indexes = [index_of(cluster.root(n), "local", 1) for n in (0, 1)]
    assert indexes[0].tensors == indexes[1].tensors
    for node in (0, 1):
        step_dir = cluster.root(node) / "local" / "step-00000001"
        data = {p.name for p in step_dir.glob("*.safetensors")}
        assert data == {f.name for f in indexes[0].files if f.node == node and f.name.endswith(".safetensors")}
        assert (cluster.root(node) / "local" / "latest").read_text().strip() == "step-00000001"


def test_a_node_fetches_what_the_other_node_wrote(local_cluster) -> None:
    cluster = local_cluster
    loaded = run_job(cluster, cluster.base, "load", [1], {"w_even": [R], "w_uneven": [R], "b": [R], "tiny": [R]}, step=1, node_of_rank=[0], job="local")
    assert loaded[0]["step"] == 1 and all(loaded[0]["exact"].values()), loaded
    loaded = run_job(cluster, cluster.base, "load", [2], {"w_even": [S1], "w_uneven": [S0], "b": [R], "tiny": [S1]}, step=1, node_of_rank=[1, 1], job="local")
    assert all(r["step"] == 1 and all(r["exact"].values()) for r in loaded), loaded
    for node in (0, 1):  # the fetched copies in shared memory are gone once the loads are done
        assert not list(cluster.nodes[node].shm_dir.glob("*-fetch-*"))


def test_a_missing_node_is_named_before_any_byte_is_served(local_cluster) -> None:
    cluster = local_cluster
    cluster.running[1].stop()
    try:
        sys.path.insert(0, str(WORKER.parent))
        from dist_worker import SHAPES

        model = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
        with CheckpointClient("local", address=cluster.address(0), rank=0, world_size=1, local_world_size=1, on_error="raise") as ckpt:
            with pytest.raises(CheckpointError) as info:
                ckpt.load({"model": model}, step=1)
        message = str(info.value)
        assert info.value.code == "FAILED_PRECONDITION"
        assert "not complete" in message and f"node 1 ({cluster.peers[1]})" in message and "model/w_even" in message, message
        assert all(not t.any() for t in model.values())  # nothing was served
    finally:
        cluster.start(1, "--replicas", "0")


# ------------------------------------------------------------------ replicas, failures


def replicated_state(tensors: int = 24, scale: int = 1) -> dict:
    """A data-parallel replica: the same values on every rank, tensors of different sizes."""
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}": torch.randn(scale * (1000 + 300 * i), generator=g) for i in range(tensors)}}


def save_from_threads(cluster, node_of_rank: list[int], step: int, state: dict, job: str, on_saved=None) -> list:
    """Every rank (a thread with its own client to its node's daemon) saves `state`; returns
    each rank's wait_durable() result, or the CheckpointError it raised."""
    from concurrent.futures import ThreadPoolExecutor

    world = len(node_of_rank)

    def rank_saves(rank: int) -> object:
        node = node_of_rank[rank]
        with CheckpointClient(job, address=cluster.address(node), rank=rank, world_size=world,
                              local_world_size=node_of_rank.count(node), on_error="raise", timeout_s=60) as ckpt:
            handle = ckpt.save(step, state)
            if on_saved is not None and rank == 0:
                on_saved()
            try:
                return handle.wait_durable(timeout=60)
            except CheckpointError as exc:
                return exc

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank_saves, range(world)))


def test_a_replicated_save_spreads_the_writing_evenly_over_nodes(shared_cluster) -> None:
    cluster, _, _ = shared_cluster  # a job of its own on the module's two nodes
    results = save_from_threads(cluster, [0, 0, 1, 1], 1, replicated_state(), "ddp")
    assert all(not isinstance(r, Exception) for r in results), results
    index = index_of(cluster.root(0), "ddp", 1)
    per_node = [sum(f.size for f in index.files if f.node == n and f.name.endswith(".safetensors")) for n in (0, 1)]
    assert all(len(t.fragments) == 1 for t in index.tensors)  # replicas are written whole, once
    assert abs(per_node[0] - per_node[1]) <= 0.1 * sum(per_node) / 2, per_node


def test_a_daemon_killed_while_writing_aborts_the_step_everywhere(node_sets) -> None:
    import threading

    cluster = node_sets(2, shared_root=False)
    cluster.start(0)
    cluster.start(1, "--write-throttle", "1MiB")  # node 1 writes slowly: still writing when killed
    state = replicated_state(tensors=8, scale=200)  # about 7 MiB: 3-4 s of writing on node 1
    first = save_from_threads(cluster, [0, 0, 1, 1], 1, state, "kill")
    assert all(not isinstance(r, Exception) for r in first), first

    def kill_node_1() -> None:
        threading.Timer(1.0, cluster.running[1].kill).start()

    second = save_from_threads(cluster, [0, 0, 1, 1], 2, state, "kill", on_saved=kill_node_1)
    assert all(isinstance(r, CheckpointError) for r in second), second
    assert "node 1" in str(second[0]) and "stopped answering" in str(second[0]), second[0]
    assert not (cluster.root(0) / "kill" / "step-00000002").exists()
    assert (cluster.root(0) / "kill" / "latest").read_text().strip() == "step-00000001"
    cluster.start(1)  # a restarted daemon removes its half-written step
    assert not (cluster.root(1) / "kill" / "step-00000002").exists()
    for node in (0, 1):
        restored = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        with CheckpointClient("kill", address=cluster.address(node), rank=0, world_size=1, local_world_size=1, on_error="raise") as ckpt:
            assert ckpt.load(restored) == 1
        assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())


def test_a_node_restarted_before_it_recorded_the_commit_adopts_node_0s_decision(node_sets) -> None:
    """Node-local roots: a node that dies after writing its part, but before node 0's answer
    reached it, restarts with a prepared part and no index. Node 0 decides: the step it
    committed gets its index on the restarted node; a step it never committed is removed."""
    import time

    from ckptd.format.index import PREPARED_NAME

    cluster = node_sets(2, shared_root=False)
    cluster.start_all()
    state = replicated_state(tensors=8)
    for step in (1, 2):
        assert all(not isinstance(r, Exception) for r in save_from_threads(cluster, [0, 0, 1, 1], step, state, "prep"))
    job_dir = cluster.root(1) / "prep"
    cluster.running[1].stop()
    # What a crash in the window leaves: node 1's data files of step 2 and its prepared marker,
    # no index; and a part of step 3, which node 0 never heard of.
    committed = job_dir / "step-00000002"
    for path in committed.iterdir():
        if not path.name.endswith(".safetensors"):
            path.unlink()
    (committed / PREPARED_NAME).write_text('{"save_id": "x", "node": 1, "step": 2}\n')
    (job_dir / "latest").write_text("step-00000001\n")
    orphan = job_dir / "step-00000003"
    orphan.mkdir()
    (orphan / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    (orphan / PREPARED_NAME).write_text('{"save_id": "y", "node": 1, "step": 3}\n')

    cluster.start(1)
    deadline = time.monotonic() + 30
    while ((committed / "ckptd.index.json").exists() is False or orphan.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (committed / "ckptd.index.json").read_bytes() == (cluster.root(0) / "prep" / "step-00000002" / "ckptd.index.json").read_bytes()
    assert not (committed / PREPARED_NAME).exists()
    assert not orphan.exists()
    assert (job_dir / "latest").read_text().strip() == "step-00000002"
    restored = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    with CheckpointClient("prep", address=cluster.address(1), rank=0, world_size=1, local_world_size=1, on_error="raise") as ckpt:
        assert ckpt.load(restored) == 2
    assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())


def test_a_save_started_while_node_0_restarts_commits_once_it_is_back(node_sets) -> None:
    """The member's ranks start a save while node 0 is down (its channel to node 0 fails and
    waits out a reconnect backoff); node 0 comes back within the save's window and its ranks
    join: the save commits instead of failing the member's ranks at once (CI, 2026-11-27)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    cluster = node_sets(2, shared_root=False)
    cluster.start_all()
    state = replicated_state(tensors=4)
    assert all(not isinstance(r, Exception) for r in save_from_threads(cluster, [0, 0, 1, 1], 1, state, "back"))
    cluster.running[0].stop()

    def rank_saves(rank: int) -> object:
        node = rank // 2
        with CheckpointClient("back", address=cluster.address(node), rank=rank, world_size=4, local_world_size=2,
                              on_error="raise", timeout_s=30) as ckpt:
            try:
                return ckpt.save(2, state).wait_durable(timeout=60)
            except CheckpointError as exc:
                return exc

    with ThreadPoolExecutor(4) as pool:
        member = [pool.submit(rank_saves, r) for r in (2, 3)]
        time.sleep(1.5)  # the member's daemon has tried node 0 and failed by now
        cluster.start(0)
        coordinator = [pool.submit(rank_saves, r) for r in (0, 1)]
        results = [f.result() for f in coordinator + member]
    assert all(not isinstance(r, Exception) for r in results), results
    for node in (0, 1):
        assert (cluster.root(node) / "back" / "latest").read_text().strip() == "step-00000002"


def test_quantized_fragments_written_by_two_nodes_load_the_same_in_any_layout(shared_cluster) -> None:
    """Adam moments sharded along their last dim over 4 ranks on 2 nodes (75 columns each: the
    cuts fall inside the O2 blocks of 128), stored as quantized fragments by both nodes; loaded
    by 3 ranks (rows) and by 2 ranks (columns), every layout gets the same values, within the
    error bounds, and no non-zero second moment comes back as zero."""
    from safetensors.torch import load_file

    cluster, base, _ = shared_cluster
    saved = {"exp_avg": [S1], "exp_avg_sq": [S1]}
    run_job(cluster, base, "save", [4], saved, step=7, node_of_rank=spread(4, 2), job="mnq", optimizer=True, quantize="O2")
    index = index_of(cluster.root(0), "mnq", 7)
    record = index.by_name()["optimizer/state/w/exp_avg_sq"]
    assert len(record.fragments) == 4 and all(f.quant is not None and f.quant.codec == "log-u4" for f in record.fragments)
    assert index.quantization is not None and index.quantization["quantize"] == "O2"
    got = []
    for mesh, placement in (([3], [S0]), ([2], [S1])):
        results = run_job(cluster, base, "load", mesh, {"exp_avg": placement, "exp_avg_sq": placement}, step=7,
                          node_of_rank=spread(mesh[0], 2), job="mnq", optimizer=True)
        got.append(load_file(str(Path(results[0]["dir"]) / "0.safetensors")))
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import global_value

    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(got[0][name], got[1][name]), name
        want = global_value(name)
        if name == "exp_avg":
            assert float((got[0][name] - want).abs().max()) <= float(want.abs().max()) / 14 * 1.001
        else:
            assert bool(((got[0][name] > 0) == (want > 0)).all())


# ------------------------------------------------------------------ mutual TLS on the peer port

def test_two_daemons_save_and_load_over_mutual_tls(node_sets, tmp_path: Path) -> None:
    from ckptd.wire.v1 import peer_pb2, peer_pb2_grpc

    pki = make_pki(tmp_path / "pki", "cluster")
    cluster = node_sets(2, shared_root=False)  # node-local roots: loads fetch over the TLS port
    for node in (0, 1):
        cluster.start(node, *tls_args(pki))
    state = replicated_state(tensors=6)
    assert all(not isinstance(r, Exception) for r in save_from_threads(cluster, [0, 0, 1, 1], 1, state, "tls"))
    restored = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    with CheckpointClient("tls", address=cluster.address(1), rank=0, world_size=1, local_world_size=1, on_error="raise") as ckpt:
        assert ckpt.load(restored) == 1
    assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())

    request = peer_pb2.InventoryRequest(job="tls", step=1)
    metadata = (("ckptd-peer-token", "any-token-0123456789"),)  # refused before the token counts
    with grpc.insecure_channel(cluster.peers[0]) as plain:  # no TLS: the handshake fails
        with pytest.raises(grpc.RpcError) as info:
            peer_pb2_grpc.PeerStub(plain).Inventory(request, metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    stranger = make_pki(tmp_path / "stranger", "stranger")  # a certificate of another CA
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki["ca"].read_bytes(), private_key=stranger["key"].read_bytes(), certificate_chain=stranger["cert"].read_bytes()
    )
    with grpc.secure_channel(cluster.peers[0], credentials) as foreign:
        with pytest.raises(grpc.RpcError) as info:
            peer_pb2_grpc.PeerStub(foreign).Inventory(request, metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_unreadable_certificate_stops_the_daemon_with_the_file_named(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki", "cluster")
    pki["key"].unlink()
    result = subprocess.run(
        [sys.executable, "-m", "ckptd.daemon.app.cli", "serve", "--root", str(tmp_path / "root"), "--socket", str(tmp_path / "d.sock"),
         "--node-rank", "0", "--peers", "127.0.0.1:1,127.0.0.1:2", "--peer-token", "0123456789abcdef", *tls_args(pki)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert f"--peer-tls-key {pki['key']}: cannot read it" in result.stderr, result.stderr


# issue 30 finding 11: node 0 down, node 1's ranks and log say the coordinator is not reachable
def test_issue30_finding11_with_node_0_down_node_1_says_the_coordinator_is_not_reachable(node_sets) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cluster = node_sets(2, shared_root=False)
    cluster.start_all("--replicas", "0")  # node 0's part is nowhere else: a load needs node 0
    clients = [
        CheckpointClient("down", address=cluster.address(r), rank=r, world_size=2, local_world_size=1, on_error="raise", timeout_s=6)
        for r in (0, 1)
    ]
    with ThreadPoolExecutor(2) as pool:  # one rank on each node; save is collective
        infos = list(pool.map(lambda r: clients[r].save(1, {"model": {"w": torch.ones(1024)}}).wait_durable(timeout=60), (0, 1)))
    assert all(info is not None for info in infos)
    clients[0].close()
    coordinator = f"node 0 ({cluster.peers[0]})"
    cluster.running[0].kill()

    rank1 = clients[1]
    with pytest.raises(CheckpointError) as loading:
        rank1.load({"model": {"w": torch.zeros(1024)}})
    assert f"{coordinator} did not answer (not reachable: no connection to it within 3 s)" in str(loading.value)
    with pytest.raises(CheckpointError) as saving:
        rank1.save(2, {"model": {"w": torch.ones(1024)}})
    unreachable = f"the coordinator {coordinator} is not reachable (no connection to it within 6 s)"
    assert unreachable in str(saving.value) and "start node 0's daemon, or check its address in --peers" in str(saving.value)
    rank1.close()
    log = cluster.running[1].log_text()
    assert f"step 2 of job down waits up to 6 s for node 0: the coordinator {coordinator} is not reachable" in log
    assert f"save of step 2 of job down failed: {unreachable}" in log


def test_a_root_shared_by_two_of_three_nodes_is_refused_before_anything_is_written(node_sets) -> None:
    """Nodes 1 and 2 write into one root, node 0 into its own: each node would take its root for
    its own and empty the step's directory before writing (deleting the other's files). Every
    rank is refused with the fix, and no step directory is made."""
    cluster = node_sets(3, shared_root=False)
    cluster.nodes[2].root = cluster.root(1)
    cluster.start_all()
    from concurrent.futures import ThreadPoolExecutor

    def rank_saves(rank: int) -> object:
        with CheckpointClient("half-shared", address=cluster.address(rank), rank=rank, world_size=3, local_world_size=1, on_error="raise", timeout_s=60) as ckpt:
            try:
                return ckpt.save(1, replicated_state(4)).wait_durable(timeout=60)
            except CheckpointError as exc:
                return exc

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(rank_saves, range(3)))
    assert all(isinstance(r, CheckpointError) for r in results), results
    for r in results:
        assert "write into one storage root" in str(r) and "every node of a job must write into one shared root" in str(r), r
    for node in (0, 1):
        job_dir = cluster.root(node) / "half-shared"
        assert not job_dir.exists() or not any(p.name.startswith("step-") for p in job_dir.iterdir()), sorted(job_dir.iterdir())
