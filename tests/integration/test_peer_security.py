"""The daemon-to-daemon port refuses every peer RPC from a caller it cannot trust (issue 20).

Mutual TLS (a two-node cluster started with --peer-tls-*): a client certificate signed by
another CA, no client certificate, an expired one, one not valid yet, and plain text all fail the
handshake (UNAVAILABLE) for each peer RPC (JoinSave, ReportManifest, Inventory, Fetch and tier 0b's
OfferReplica, ReadReplica, ReplicaHeld, HeldParts). The peer
token (with TLS and without): a missing, empty, wrong, truncated, extended, re-cased token, one
under another metadata key, and two conflicting tokens are refused with UNAUTHENTICATED for each
RPC, before any work: no save is registered, no byte served. The right certificate and token
reach the handlers (the positive controls), and the daemons stay up.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ckptd.client import CheckpointClient
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc
from daemon_rig import metadata_digest
from pki import Authority, tls_args

TOKEN = "security-peer-token-0123456789abcdef"
TOKEN_KEY = "ckptd-peer-token"
JOB = "sec"
GOOD = ((TOKEN_KEY, TOKEN),)
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # no connection shared between credentials


@dataclass
class Cluster:
    """Two running daemons (node-local roots) with a committed step JOB/1 on node 0."""

    peers: list[str]
    addresses: list[str]
    daemons: list[Any]
    credentials: grpc.ChannelCredentials | None  # a trusted client's, None: no TLS


def _start(module_node_sets: Callable[..., Any], *extra: str) -> Cluster:
    nodes = module_node_sets(2, shared_root=False)
    for node in (0, 1):
        nodes.start(node, "--peer-token", TOKEN, "--save-timeout", "5", *extra)
    state = {"model": {"w": torch.arange(6, dtype=torch.float32)}}
    with CheckpointClient(JOB, address=nodes.address(0), rank=0, world_size=1, local_world_size=1, on_error="raise", timeout_s=30) as ckpt:
        ckpt.save(1, state).wait_durable(60)
    return Cluster(list(nodes.peers), [nodes.address(n) for n in (0, 1)], [nodes.running[n] for n in (0, 1)], None)


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority(tmp_path_factory.mktemp("pki") / "cluster", "cluster")


@pytest.fixture(scope="module")
def tls_cluster(module_node_sets: Callable[..., Any], authority: Authority) -> Iterator[Cluster]:
    node = authority.issue("node")
    cluster = _start(module_node_sets, *tls_args(node))
    client = authority.issue("client")
    cluster.credentials = grpc.ssl_channel_credentials(
        root_certificates=authority.ca_path.read_bytes(), private_key=client["key"].read_bytes(), certificate_chain=client["cert"].read_bytes()
    )
    yield cluster
    _still_serving(cluster)


@pytest.fixture(scope="module")
def plain_cluster(module_node_sets: Callable[..., Any]) -> Iterator[Cluster]:
    cluster = _start(module_node_sets)
    yield cluster
    _still_serving(cluster)


def _still_serving(cluster: Cluster) -> None:
    """Every daemon is up and answers health on its Unix socket; the right caller still gets through."""
    for daemon, address in zip(cluster.daemons, cluster.addresses):
        assert daemon.popen.poll() is None, daemon.log_text()[-4000:]
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert _inventory(cluster, cluster.credentials, GOOD).committed


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def _inventory(cluster: Cluster, credentials: grpc.ChannelCredentials | None, metadata: Any, step: int = 1) -> ppb.InventoryResponse:
    with _channel(cluster.peers[0], credentials) as channel:
        return ppb_grpc.PeerStub(channel).Inventory(ppb.InventoryRequest(job=JOB, step=step), metadata=metadata, timeout=10)


# Well-formed requests: with the right caller each would reach the handler and do work (join a
# save, report a node's part, list files, serve bytes); a refusal is the caller's, not the request's.
def _join(stub: ppb_grpc.PeerStub, metadata: Any) -> Any:
    meta = pb.TensorMeta(name="model/w", kind="model", dtype="F32", shape=[4], box=pb.Box(offsets=[0], lengths=[4]))
    digest = metadata_digest([meta])
    request = ppb.JoinSaveRequest(
        job=JOB, step=77, node=1, world_size=2, fingerprints={1: digest}, tensors=[ppb.RankTensors(rank=1, fingerprint=digest, tensors=[meta])],
        timeout_s=3, root_id="x",
    )
    return stub.JoinSave(request, metadata=metadata, timeout=10)


def _report(stub: ppb_grpc.PeerStub, metadata: Any) -> Any:
    request = ppb.ReportManifestRequest(job=JOB, step=78, save_id="0" * 32, node=1, ok=False, error="node 1 failed")
    return stub.ReportManifest(request, metadata=metadata, timeout=10)


def _inventory_call(stub: ppb_grpc.PeerStub, metadata: Any) -> Any:
    return stub.Inventory(ppb.InventoryRequest(job=JOB, step=1), metadata=metadata, timeout=10)


def _fetch(stub: ppb_grpc.PeerStub, metadata: Any) -> Any:
    return b"".join(c.data for c in stub.Fetch(ppb.FetchRequest(job=JOB, step=1, file="ckptd.index.json"), metadata=metadata, timeout=10))


DATA_FILE = "model-00001-of-00001.safetensors"


def _offer(stub: ppb_grpc.PeerStub, metadata: Any) -> Any:  # tier 0b: node 1 offers its part (a ticket for the bulk port)
    files = [ppb.FileEntry(name=DATA_FILE, size=64, checksum="xxh3-64:0000000000000000")]
    units = [ppb.FileUnits(name=DATA_FILE, units=[ppb.ChecksumUnit(offset=0, nbytes=64, xxh3=0)])]
    return stub.OfferReplica(ppb.OfferReplicaRequest(job=JOB, step=79, node=1, files=files, units=units), metadata=metadata, timeout=10)


def _read(stub: ppb_grpc.PeerStub, metadata: Any) -> Any:  # a replica node 0 does not hold: NOT_FOUND for the right caller
    ranges = [ppb.ReplicaRange(file=DATA_FILE, offset=0, nbytes=8)]
    return stub.ReadReplica(ppb.ReadReplicaRequest(job=JOB, step=1, node=1, ranges=ranges), metadata=metadata, timeout=10)


def _held(stub: ppb_grpc.PeerStub, metadata: Any) -> Any:
    return stub.ReplicaHeld(ppb.ReplicaHeldRequest(job=JOB, step=1, node=1, holders=[0]), metadata=metadata, timeout=10)


def _held_parts(stub: ppb_grpc.PeerStub, metadata: Any) -> Any:
    return stub.HeldParts(ppb.HeldPartsRequest(node=1), metadata=metadata, timeout=10)


RPCS: dict[str, Callable[[ppb_grpc.PeerStub, Any], Any]] = {
    "JoinSave": _join, "ReportManifest": _report, "Inventory": _inventory_call, "Fetch": _fetch,
    "OfferReplica": _offer, "ReadReplica": _read, "ReplicaHeld": _held, "HeldParts": _held_parts,
}


def test_the_peer_proto_has_exactly_these_rpcs() -> None:
    """A new peer RPC must be added to RPCS (and so to every refusal below)."""
    assert sorted(ppb.DESCRIPTOR.services_by_name["Peer"].methods_by_name) == sorted(RPCS)


def _refused(cluster: Cluster, credentials: grpc.ChannelCredentials | None, metadata: Any, rpc: str) -> grpc.RpcError:
    with _channel(cluster.peers[0], credentials) as channel:
        with pytest.raises(grpc.RpcError) as info:
            RPCS[rpc](ppb_grpc.PeerStub(channel), metadata)
    return info.value


def _nothing_done(cluster: Cluster) -> None:
    """The refused JoinSave registered no save (with the right caller it would be in flight)."""
    assert not _inventory(cluster, cluster.credentials, GOOD, step=77).in_flight


# ------------------------------------------------------------------ mutual TLS


def _client_credentials(authority: Authority, kind: str, out: Path) -> grpc.ChannelCredentials:
    """Credentials of an untrusted client that trusts the cluster's CA (so only the server can refuse)."""
    ca = authority.ca_path.read_bytes()
    if kind == "no client certificate":
        return grpc.ssl_channel_credentials(root_certificates=ca)
    if kind == "another CA":
        leaf = Authority(out / "stranger", "stranger").issue("client")
    elif kind == "expired":
        leaf = authority.issue("expired", not_before=datetime.timedelta(days=-10), not_after=datetime.timedelta(days=-1))
    elif kind == "not yet valid":
        leaf = authority.issue("future", not_before=datetime.timedelta(days=1), not_after=datetime.timedelta(days=10))
    else:
        raise AssertionError(kind)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=leaf["key"].read_bytes(), certificate_chain=leaf["cert"].read_bytes())


TLS_CASES = ["another CA", "no client certificate", "expired", "not yet valid", "plain text"]


@pytest.mark.parametrize("rpc", sorted(RPCS))
@pytest.mark.parametrize("case", TLS_CASES)
def test_an_untrusted_client_fails_the_handshake_for_every_rpc(tls_cluster: Cluster, authority: Authority, tmp_path: Path, case: str, rpc: str) -> None:
    credentials = None if case == "plain text" else _client_credentials(authority, case, tmp_path)
    error = _refused(tls_cluster, credentials, GOOD, rpc)  # the right token does not help
    assert error.code() == grpc.StatusCode.UNAVAILABLE, (case, rpc, error.code(), error.details())
    _nothing_done(tls_cluster)


def test_a_trusted_client_with_the_token_reaches_every_rpc(tls_cluster: Cluster) -> None:
    """The positive control: the requests above are refused for the caller, not for themselves."""
    with _channel(tls_cluster.peers[0], tls_cluster.credentials) as channel:
        stub = ppb_grpc.PeerStub(channel)
        assert _inventory_call(stub, GOOD).committed
        assert b'"step": 1' in _fetch(stub, GOOD) or b'"step":1' in _fetch(stub, GOOD)
        reply = _report(stub, GOOD)  # an unknown save: answered (not committed), not refused
        assert not reply.committed and "knows no save" in reply.error
        with pytest.raises(grpc.RpcError) as info:  # reaches the coordinator: rank 0 never joins
            _join(stub, GOOD)
        assert info.value.code() == grpc.StatusCode.ABORTED and "never joined" in info.value.details()
        offer = _offer(stub, GOOD)
        assert offer.accepted and len(offer.ticket) == 32 and offer.port > 0
        with pytest.raises(grpc.RpcError) as info:
            _read(stub, GOOD)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "holds no replica" in info.value.details()
        _held(stub, GOOD)
        assert list(_held_parts(stub, GOOD).parts) == []  # nothing recoverable here


def test_the_server_certificate_is_checked_by_its_callers(tls_cluster: Cluster, tmp_path: Path) -> None:
    """A caller that trusts another CA refuses the daemon's certificate (so does a daemon dialling a fake peer)."""
    stranger = Authority(tmp_path / "stranger", "stranger").issue("client")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=stranger["ca"].read_bytes(), private_key=stranger["key"].read_bytes(), certificate_chain=stranger["cert"].read_bytes()
    )
    error = _refused(tls_cluster, credentials, GOOD, "Inventory")
    assert error.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------------ the peer token

TOKEN_CASES = {
    "missing": (),
    "empty": ((TOKEN_KEY, ""),),
    "wrong": ((TOKEN_KEY, "x" * len(TOKEN)),),
    "truncated": ((TOKEN_KEY, TOKEN[:-1]),),
    "extended": ((TOKEN_KEY, TOKEN + "0"),),
    "re-cased": ((TOKEN_KEY, TOKEN.upper()),),
    "another key": (("authorization", TOKEN),),
    "two different tokens": ((TOKEN_KEY, "x" * len(TOKEN)), (TOKEN_KEY, TOKEN)),
}


@pytest.mark.parametrize("rpc", sorted(RPCS))
@pytest.mark.parametrize("case", sorted(TOKEN_CASES))
@pytest.mark.parametrize("transport", ["tls", "plain"])
def test_a_call_without_the_right_token_is_refused_for_every_rpc(
    request: pytest.FixtureRequest, transport: str, case: str, rpc: str
) -> None:
    cluster: Cluster = request.getfixturevalue(f"{transport}_cluster")
    error = _refused(cluster, cluster.credentials, TOKEN_CASES[case], rpc)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (transport, case, rpc, error.code(), error.details())
    assert "peer token" in error.details() and TOKEN not in error.details()
    _nothing_done(cluster)


def test_the_right_token_without_tls_reaches_the_handlers(plain_cluster: Cluster) -> None:
    assert _inventory(plain_cluster, None, GOOD).committed
