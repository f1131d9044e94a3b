"""This node's peer client: the coordinator (in process on node 0, over the Peer service
elsewhere), and the peers' inventories and files (engine/peers.py `Peers`).

Daemons authenticate each other with a shared token in the call metadata (PEER_TOKEN_KEY, sent
by peer_links.PeerLinks), checked on every Peer call by rpc/auth.py PeerTokenInterceptor. The
messages are built and read in rpc/convert.py; a failed call to node 0 becomes a domain error in
rpc/errors.py coordinator_error.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Sequence

import grpc

from ckptd.daemon.engine.coordinator import Coordinator, OnCommit
from ckptd.daemon.engine.plan_inputs import check_plan_input
from ckptd.daemon.engine.requests import JoinSave, ReportManifest
from ckptd.daemon.engine.runs import Runs
from ckptd.daemon.errors import Unavailable
from ckptd.format.index import step_dir_name
from ckptd.daemon.plan.compression import Decide, lossless_by_default
from ckptd.daemon.plan.retention import DEFAULT_JOB_POLICY, JobPolicy
from ckptd.daemon.records import JoinResult, Outcome, PeerInventory
from ckptd.daemon.rpc import convert as rpc_convert
from ckptd.daemon.rpc.errors import coordinator_error, coordinator_unreachable
from ckptd.daemon.rpc.peer_links import PeerLinks
from ckptd.daemon.rpc.tls import PeerTls
from ckptd.daemon.storage import StorageBackend
from ckptd.wire.v1 import peer_pb2 as ppb

log = logging.getLogger(__name__)

INVENTORY_TIMEOUT_S = 3.0  # a peer that does not answer within this counts as absent for a load
COORDINATOR_NOTICE_S = 5.0  # a save that cannot reach node 0 this long is logged (it waits on, up to its join window)


class PeerClient:
    """This node's view of the other nodes: the coordinator (in process on node 0, over gRPC
    elsewhere) and the peers' inventories and files."""

    def __init__(
        self,
        node: int,
        peers: Sequence[str],
        token: str,
        storage: StorageBackend,
        on_commit: OnCommit,
        tls: PeerTls | None = None,
        decide: Decide = lossless_by_default,
        runs: Runs | None = None, job_policy: JobPolicy = DEFAULT_JOB_POLICY,
    ) -> None:
        self.node = node
        self._job_policy = job_policy
        self.runs = runs
        self.links = PeerLinks(peers, token, tls)
        self.storage = storage
        self.root_id = ""
        self._on_commit = on_commit
        self._decide = decide
        self.coordinator: Coordinator | None = None

    def start(self) -> None:
        """Read (or create) the root's id; node 0 becomes the coordinator."""
        self.root_id = self.storage.catalog.root_id()
        if self.node == 0:
            self.coordinator = Coordinator(self.storage, self.links, self.root_id, self._on_commit, self._decide, self.runs, self._job_policy)

    @property
    def nodes(self) -> int:
        return len(self.links.peers)

    def describe(self, node: int) -> str:
        return f"node {node} ({self.links.peers[node]})" if 0 <= node < self.nodes else f"node {node}"

    def coordinator_problem(self, waited_s: float) -> str | None:
        """Why this node's save, waiting `waited_s` seconds, cannot reach the coordinator
        (`coordinator_unreachable`), or None: this is node 0, or its channel to node 0 is
        connected (the coordinator waits for other nodes' ranks)."""
        if self.coordinator is not None or self.links.connected(0):
            return None
        return coordinator_unreachable(self.describe(0), f"no connection to it within {waited_s:.0f} s")

    async def join_save(self, request: JoinSave) -> JoinResult:
        """Join the save at the coordinator (Coordinator.join); returns once every rank has."""
        if self.coordinator is not None:
            return await self.coordinator.join(request, self.node, self.root_id)
        message = rpc_convert.join_request(request, self.node, self.root_id)
        # A coordinator that is restarting joins late rather than failing this node's ranks (the
        # log says at once that it waits); one that stays away past the join window fails the
        # save (the watchdog says why the same way).
        timeout_s = request.timeout_s
        notice_s = min(timeout_s, COORDINATOR_NOTICE_S)
        if not await self.links.ready(0, notice_s):
            log.warning(
                "step %s of job %s waits up to %.0f s for node 0: %s", request.step, request.job, timeout_s,
                coordinator_unreachable(self.describe(0), f"no connection to it within {notice_s:.0f} s"),
            )
            if not await self.links.ready(0, timeout_s - notice_s):
                raise Unavailable(coordinator_unreachable(self.describe(0), f"no connection to it within {timeout_s:.0f} s"))
        reply = await self._call_coordinator(self.links.stub(0).JoinSave, message, timeout_s + 30)
        result = rpc_convert.join_result_of(reply, request.world_size)
        check_plan_input(result, self.describe(0))
        return result

    async def report(self, request: ReportManifest) -> Outcome:
        """Report this node's part; returns the outcome."""
        if self.coordinator is not None:
            return await self.coordinator.report(request, self.node)
        message = rpc_convert.report_request(request, self.node)
        try:
            reply = await self.links.stub(0).ReportManifest(message, metadata=self.links.metadata)
        except grpc.RpcError as exc:
            details = exc.details() or exc.code().name
            why = coordinator_unreachable(self.describe(0), details) if exc.code() == grpc.StatusCode.UNAVAILABLE else f"the coordinator {self.describe(0)} did not answer: {details}"
            return Outcome(False, why, decided=False)
        return rpc_convert.outcome_of(reply)

    async def _call_coordinator(self, method: Any, request: Any, timeout_s: float) -> Any:
        try:
            return await method(request, timeout=timeout_s, metadata=self.links.metadata)
        except grpc.RpcError as exc:
            raise coordinator_error(exc, self.describe(0)) from None

    async def inventory(self, node: int, job: str, step: int, newest: bool = False) -> PeerInventory | str:
        """What a peer holds of a step (PeerInventory; with `newest`, also its newest committed
        step of the job), or why it did not answer."""
        try:
            reply = await self.links.stub(node).Inventory(
                ppb.InventoryRequest(job=job, step=step, newest=newest), timeout=INVENTORY_TIMEOUT_S, metadata=self.links.metadata, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not self.links.connected(node):
                return f"not reachable: no connection to it within {INVENTORY_TIMEOUT_S:.0f} s"
            return str(exc.details() or exc.code().name)
        return rpc_convert.inventory_of(reply)

    async def fetch(self, node: int, job: str, step: int, file: str, offset: int, nbytes: int, out_fd: int) -> None:
        """Copy bytes [offset, offset + nbytes) of a peer's step file to the same offset of out_fd."""
        request = ppb.FetchRequest(job=job, step=step, file=file, offset=offset, nbytes=nbytes)
        position = offset
        try:
            async for chunk in self.links.stub(node).Fetch(request, timeout=3600, metadata=self.links.metadata):
                await asyncio.to_thread(os.pwrite, out_fd, chunk.data, position)
                position += len(chunk.data)
        except grpc.RpcError as exc:
            raise Unavailable(f"fetching {file} of {step_dir_name(step)} from {self.describe(node)} failed: {exc.details() or exc.code().name}") from None
        if position != offset + nbytes:
            raise Unavailable(f"{self.describe(node)} sent {position - offset} of {nbytes} bytes of {file}")

    async def fetch_bytes(self, node: int, job: str, step: int, file: str, limit: int = 256 * 2**20) -> bytes:
        """A whole small file of a peer's committed step (the index, extra.json, ...)."""
        request = ppb.FetchRequest(job=job, step=step, file=file, offset=0, nbytes=0)
        parts: list[bytes] = []
        try:
            async for chunk in self.links.stub(node).Fetch(request, timeout=600, metadata=self.links.metadata):
                parts.append(chunk.data)
                if sum(map(len, parts)) > limit:
                    raise Unavailable(f"{file} of {step_dir_name(step)} on {self.describe(node)} is larger than {limit} bytes")
        except grpc.RpcError as exc:
            raise Unavailable(f"fetching {file} of {step_dir_name(step)} from {self.describe(node)} failed: {exc.details() or exc.code().name}") from None
        return b"".join(parts)

    async def close(self) -> None:
        await self.links.close()
