"""Issue 30 finding 1: no job's save is planned from what another job sent.

The daemon used to keep tensor metadata and save plans for the whole daemon under a key the
client chose (its structure fingerprint, a hash of names, dtypes, shapes and boxes anyone can
compute). An attacker's job that saved once under a victim's fingerprint with another dtype made
the victim's next saves commit with that dtype in their index: they loaded back as garbage,
without an error. One that asked for a 2^46-element tensor under it made every job using that
fingerprint fail with "cannot reserve 268435456.0 MiB". Here the attacker speaks raw gRPC, as it
would, against real daemons over their real sockets (one node, then two); the victim is an
ordinary CheckpointClient.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
import pytest
import torch
from torch import nn

from ckptd.client import CheckpointClient
from ckptd.client._rpc import tensor_metas
from ckptd.client.errors import CheckpointError
from ckptd.client.state import flatten_state
from ckptd.client.structure import StructureCache
from ckptd.format.index import CheckpointIndex
from ckptd.daemon.rpc.auth import PEER_TOKEN_KEY
from ckptd.demo.process import DaemonProcess
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc
from daemon_rig import PEER_TOKEN, NodeSet

HUGE = 1 << 46  # elements: 256 TiB of F32


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(torch.bfloat16)


def _victims_description(state: dict[str, Any], rank: int = 0) -> tuple[str, list[pb.TensorMeta]]:
    """What an attacker computes with the public client code: the victim's fingerprint and the
    tensor metadata its client sends."""
    structure = StructureCache().for_state(flatten_state(state, rank=rank, for_save=True, validate=False), None, None)
    return structure.fingerprint, [pb.TensorMeta.FromString(m.SerializeToString()) for m in tensor_metas(structure)]


def _as_f16(metas: Sequence[pb.TensorMeta]) -> list[pb.TensorMeta]:
    """The same names, shapes and boxes (so the same sizes), another dtype."""
    out = [pb.TensorMeta.FromString(m.SerializeToString()) for m in metas]
    for m in out:
        assert m.dtype == "BF16"
        m.dtype = "F16"
    return out


def _huge(metas: Sequence[pb.TensorMeta]) -> list[pb.TensorMeta]:
    """The first tensor grown to 2^46 elements of F32."""
    out = [pb.TensorMeta.FromString(m.SerializeToString()) for m in metas]
    out[0].dtype, out[0].shape[:] = "F32", [HUGE]
    out[0].box.CopyFrom(pb.Box(offsets=[0], lengths=[HUGE]))
    return out


def _evil_save(address: str, step: int, fingerprint: str, metas: list[pb.TensorMeta], rank: int = 0, world: int = 1, local: int = 0) -> None:
    """One rank of job "evil" saves `metas` under the victim's fingerprint, by hand."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CheckpointStub(channel)
        who = pb.RankId(job="evil", rank=rank, world_size=world, local_world_size=local)
        begun = stub.BeginSave(pb.BeginSaveRequest(who=who, step=step, fingerprint=fingerprint, tensors=metas, timeout_s=60), timeout=90)
        stub.CommitSnapshot(pb.CommitSnapshotRequest(who=who, save_id=begun.save_id, extras_json="{}"), timeout=90)
        progress = list(stub.WaitDurable(pb.WaitDurableRequest(job="evil", step=step, timeout_s=60), timeout=90))
        assert progress[-1].state == "committed", progress[-1]


def _index(root: Path, job: str, step: int) -> CheckpointIndex:
    return CheckpointIndex.from_json_bytes((root / job / f"step-{step:08d}" / "ckptd.index.json").read_bytes())


def _loads_back_exactly(ckpt: CheckpointClient, step: int, saved: nn.Module) -> None:
    fresh = _model(seed=99)
    assert ckpt.load({"model": fresh}, step=step) == step
    for name, tensor in saved.state_dict().items():
        got = fresh.state_dict()[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, tensor), name


# issue 30 finding 1
def test_another_jobs_save_under_the_victims_fingerprint_never_changes_the_victims_steps(daemon: DaemonProcess) -> None:
    model = _model()
    fingerprint, metas = _victims_description({"model": model})
    _evil_save(daemon.address, 1, fingerprint, _as_f16(metas))
    assert {t.dtype for t in _index(daemon.root, "evil", 1).tensors} == {"F16"}  # its own step, as it described it

    with CheckpointClient("victim", address=daemon.address, on_error="raise") as ckpt:
        for step in (1, 2):  # the second save names its metadata by the fingerprint alone
            ckpt.save(step, {"model": model}).wait_durable(timeout=60)
            assert {t.dtype for t in _index(daemon.root, "victim", step).tensors} == {"BF16"}
            _loads_back_exactly(ckpt, step, model)


# issue 30 finding 1
def test_a_refused_2_46_element_save_under_a_fingerprint_fails_no_other_job(daemon: DaemonProcess) -> None:
    model = _model()
    fingerprint, metas = _victims_description({"model": model})
    with pytest.raises(grpc.RpcError) as refused:
        _evil_save(daemon.address, 1, fingerprint, _huge(metas))

    with CheckpointClient("victim", address=daemon.address, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model}).wait_durable(timeout=60)
        _loads_back_exactly(ckpt, 1, model)
    details = refused.value.details()
    assert "cannot reserve 256 TiB of shared memory" in details and "MiB" not in details, details


# issue 30 finding 1
def test_the_client_refuses_a_slot_planned_for_another_dtype_and_describes_its_state_again(daemon: DaemonProcess) -> None:
    """Whatever the daemon planned from, the client checks each slot against its own tensor: a
    slot planned as F16 for a bf16 tensor refuses the save (nothing is copied or committed), and
    the next save sends the tensor metadata again instead of the fingerprint."""
    model = _model()
    with CheckpointClient("checked", address=daemon.address, on_error="raise") as ckpt:
        described: list[int] = []
        begin = ckpt._rpc.stub.BeginSave

        def planned_as_f16(request: pb.BeginSaveRequest, **kw: Any) -> pb.BeginSaveResponse:
            described.append(len(request.tensors))
            reply = begin(request, **kw)
            if len(described) == 1:
                reply.slots[0].dtype = "F16"
            return reply

        ckpt._rpc.stub.BeginSave = planned_as_f16  # type: ignore[method-assign]
        with pytest.raises(CheckpointError, match=r"slot for 'model/0.bias' \[0:16\] is planned for model F16\[16\] but this rank's tensor is model BF16\[16\]"):
            ckpt.save(1, {"model": model})
        ckpt.save(2, {"model": model}).wait_durable(timeout=60)
        assert described == [4, 4]  # the metadata was sent again
        assert [c.step for c in ckpt.list()] == [2]
        _loads_back_exactly(ckpt, 2, model)


# ------------------------------------------------------------------ two nodes


@pytest.fixture(scope="module")
def two_nodes(module_node_sets: Callable[..., NodeSet]) -> NodeSet:
    cluster = module_node_sets(2, shared_root=True)
    cluster.start_all()
    return cluster


def _on_both_ranks(run: Callable[[int], None]) -> None:
    """run(rank) for ranks 0 and 1 at once (a save is collective), one thread each."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            run(rank)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


# issue 30 finding 1
def test_two_nodes_plan_a_job_only_from_its_own_ranks_metadata(two_nodes: NodeSet) -> None:
    """The same attack over the Peer service: node 0 plans for every node, member nodes plan from
    node 0's answer; a rank on each node."""
    model = _model()
    fingerprint, metas = _victims_description({"model": model})
    _on_both_ranks(lambda r: _evil_save(two_nodes.address(r), 1, fingerprint, _as_f16(metas), rank=r, world=2, local=1))

    def victim(rank: int) -> None:
        with CheckpointClient("victim", address=two_nodes.address(rank), rank=rank, world_size=2, local_world_size=1, on_error="raise") as ckpt:
            for step in (1, 2):
                ckpt.save(step, {"model": model}).wait_durable(timeout=60)
                _loads_back_exactly(ckpt, step, model)

    _on_both_ranks(victim)
    assert {t.dtype for t in _index(two_nodes.root(0), "victim", 2).tensors} == {"BF16"}


# issue 30 finding 1
def test_node_0_refuses_metadata_that_does_not_match_its_digest(two_nodes: NodeSet) -> None:
    """A joining node names each rank's metadata by the daemon's digest of it; node 0 checks it,
    so no node can claim a digest (node 0 caches the job's metadata and plans under it) for other metadata."""
    _, metas = _victims_description({"model": _model()})
    request = ppb.JoinSaveRequest(
        job="claims", step=1, node=1, world_size=1, fingerprints={0: "0" * 64},
        tensors=[ppb.RankTensors(rank=0, fingerprint="0" * 64, tensors=metas)], timeout_s=5, root_id="x",
    )
    with grpc.insecure_channel(two_nodes.peers[0]) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            ppb_grpc.PeerStub(channel).JoinSave(request, metadata=((PEER_TOKEN_KEY, PEER_TOKEN),), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "node 1 sent metadata of rank 0 that does not match its digest" in refused.value.details()
