"""The Peer calls of the replica tiers (docs/architecture.md §9): offer a replica, ask for a read, report
where a part is held. Only tickets and decisions travel here (authenticated by the peer token,
TLS when configured); the bytes travel on the holder's bulk port (tiers/bulk.py)."""

from __future__ import annotations

from typing import Mapping, Sequence

import grpc

from ckptd.common.names import check_job_id
from ckptd.daemon.errors import Unavailable
from ckptd.format.index import FileRecord, step_dir_name
from ckptd.format.units import Unit
from ckptd.daemon.records import BulkAnswer
from ckptd.daemon.rpc import convert as rpc_convert
from ckptd.daemon.rpc.peer_client import PeerClient
from ckptd.wire.v1 import peer_pb2 as ppb

CALL_TIMEOUT_S = 10.0  # a replica offer, read or report (the bytes travel on the bulk port)


class ReplicaLinks:
    """This node's replica calls to the other daemons, over the cluster's peer channels."""

    def __init__(self, cluster: PeerClient) -> None:
        self.cluster = cluster
        self.node = cluster.node

    def host_of(self, node: int) -> str:
        """The host of a node's --peers entry (its bulk port listens there too)."""
        return self.cluster.links.peers[node].rpartition(":")[0]

    async def offer(self, node: int, job: str, step: int, files: Sequence[FileRecord], units: Mapping[str, Sequence[Unit]]) -> BulkAnswer | str:
        """Offer this node's part of a committed step to `node` (`units`: each file's checksum units,
        checked by the buddy as the bytes arrive): its answer, or why it did not answer."""
        links = self.cluster.links
        request = rpc_convert.offer_request(job, step, self.node, files, units)
        await links.ready(node, CALL_TIMEOUT_S)  # a buddy restarted a moment ago still gets this step
        try:
            reply = await links.stub(node).OfferReplica(request, timeout=CALL_TIMEOUT_S, metadata=links.metadata)
        except grpc.RpcError as exc:
            return str(exc.details() or exc.code().name)
        return rpc_convert.bulk_answer_of(reply)

    async def read(self, node: int, job: str, step: int, source: int, ranges: Sequence[tuple[str, int, int]]) -> BulkAnswer:
        """A ticket to receive ranges (file, offset, nbytes) of the replica of `source`'s part
        that `node` holds; Unavailable when it gives none."""
        links = self.cluster.links
        request = ppb.ReadReplicaRequest(
            job=job, step=step, node=source, ranges=[ppb.ReplicaRange(file=f, offset=o, nbytes=n) for f, o, n in ranges]
        )
        try:
            reply = await links.stub(node).ReadReplica(request, timeout=CALL_TIMEOUT_S, metadata=links.metadata)
        except grpc.RpcError as exc:
            raise Unavailable(
                f"{self.cluster.describe(node)} could not serve its replica of node {source}'s part of {step_dir_name(step)}: {exc.details() or exc.code().name}"
            ) from None
        return rpc_convert.bulk_answer_of(reply)

    async def held(self, job: str, step: int, holders: Sequence[int], error: str) -> str:
        """Tell node 0 which nodes hold this node's part of a committed step; "" or why it did not answer."""
        links = self.cluster.links
        request = ppb.ReplicaHeldRequest(job=job, step=step, node=self.node, holders=list(holders), error=error[:2000])
        await links.ready(0, CALL_TIMEOUT_S)  # node 0 restarting: tell it once it is back
        try:
            await links.stub(0).ReplicaHeld(request, timeout=CALL_TIMEOUT_S, metadata=links.metadata)
        except grpc.RpcError as exc:
            return str(exc.details() or exc.code().name)
        return ""

    async def held_parts(self) -> list[tuple[str, int, tuple[int, ...]]] | str:
        """Ask node 0 where this node's parts of the jobs' newest steps are held: (job, step,
        holders) each, or why it did not answer. Node 0's answer is checked like any peer input."""
        links = self.cluster.links
        await links.ready(0, CALL_TIMEOUT_S)
        try:
            reply = await links.stub(0).HeldParts(ppb.HeldPartsRequest(node=self.node), timeout=CALL_TIMEOUT_S, metadata=links.metadata)
        except grpc.RpcError as exc:
            return str(exc.details() or exc.code().name)
        nodes = len(links.peers)
        parts = []
        for part in reply.parts:
            try:
                job = check_job_id(part.job)
            except ValueError as exc:
                return f"node 0 named a job that is not a job name: {exc}"
            holders = tuple(h for h in part.holders if 0 <= h < nodes and h != self.node)
            if part.step >= 0 and holders:
                parts.append((job, int(part.step), holders))
        return parts
