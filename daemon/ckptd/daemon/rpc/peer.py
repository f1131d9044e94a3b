"""The gRPC servicer of ckptd.v1.Peer (daemon to daemon, on TCP): each method validates its
request (rpc/validate.py), calls the coordinator or the storage, and converts (rpc/convert.py).

The peer token is checked before any method runs (rpc_auth.PeerTokenInterceptor) and domain
errors become status codes in rpc_errors.ErrorStatusInterceptor, both registered on the server.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator

import grpc

from ckptd.common.names import check_job_id, check_run_id
from ckptd.daemon import errors
from ckptd.daemon.engine.coordinator import Coordinator
from ckptd.daemon.engine.requests import ReportManifest
from ckptd.format.index import INDEX_NAME, PREPARED_NAME, CheckpointIndex, FormatError
from ckptd.daemon.records import PeerInventory
from ckptd.daemon.rpc import convert as rpc_convert
from ckptd.daemon.rpc import validate as checks
from ckptd.daemon.storage import ForeignEntry
from ckptd.daemon.tiers.replicas import Replication
from ckptd.wire.v1 import peer_pb2 as ppb
from ckptd.wire.v1 import peer_pb2_grpc as ppb_grpc

if TYPE_CHECKING:
    from ckptd.daemon.service import CheckpointService


FETCH_CHUNK = 4 * 2**20  # bytes per Fetch message
JOIN_ANSWERS_KEPT = 8  # saves whose join answer is kept (a few in flight at once)


class PeerServicer(ppb_grpc.PeerServicer):
    def __init__(self, service: "CheckpointService") -> None:
        assert service.cluster is not None, "the peer service runs only with several nodes"
        self.service = service
        self.cluster = service.cluster
        # The answer to a joining node is the same for every node of a save (with or without the
        # metadata): built once, not once per node (each holds every rank's metadata).
        self._answers: dict[tuple[str, bool], ppb.JoinSaveResponse] = {}

    def _coordinator(self) -> Coordinator:
        if self.cluster.coordinator is None:
            raise errors.Precondition(
                f"this daemon is node {self.cluster.node}, not the coordinator (node 0): check that --peers lists the nodes in the same order everywhere"
            )
        return self.cluster.coordinator

    async def JoinSave(self, request: ppb.JoinSaveRequest, context: grpc.aio.ServicerContext) -> ppb.JoinSaveResponse:
        coordinator = self._coordinator()
        node, joining = checks.join_save_of(request, self.cluster.nodes, self.service.config.save_timeout_s)
        result = await coordinator.join(joining, node, request.root_id)
        key = (result.save_id, result.specs is None)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._answers[key] = rpc_convert.join_response(result)
            while len(self._answers) > JOIN_ANSWERS_KEPT:
                del self._answers[next(iter(self._answers))]
        return answer

    async def ReportManifest(self, request: ppb.ReportManifestRequest, context: grpc.aio.ServicerContext) -> ppb.ReportManifestResponse:
        coordinator = self._coordinator()
        job = check_job_id(request.job)
        step = checks.check_step(request.step)
        node = checks.check_node(request.node, self.cluster.nodes)
        extras = {rank: checks.parse_json(text, f"extras of rank {rank}") if text else {} for rank, text in request.extras_json.items()}
        model_files = checks.check_model_files(request.model_files)
        manifest = None
        if request.ok:
            checks.check_manifest_json(node, request.fragments)
            manifest = rpc_convert.manifest_from_wire(node, request.files, request.fragments)
            for record in manifest.files:
                checks.check_file_name(record.name)
        outcome = await coordinator.report(ReportManifest(job, step, request.save_id, manifest, request.error[:2000], extras, model_files), node)
        return rpc_convert.report_response(outcome)

    async def Inventory(self, request: ppb.InventoryRequest, context: grpc.aio.ServicerContext) -> ppb.InventoryResponse:
        job = check_job_id(request.job)
        step = checks.check_step(request.step)
        storage = self.service.storage
        committed = await asyncio.to_thread(storage.catalog.is_committed, job, step)  # links not followed
        sizes = await self._data_files(job, step, committed)
        coordinator = self.cluster.coordinator
        in_flight = self.service.saving(job, step) or (coordinator is not None and coordinator.deciding(job, step))
        replication = self.service.replication
        replicas = tuple(replication.store.files_of(job, step)) if replication is not None else ()
        newest = await asyncio.to_thread(storage.catalog.latest_step, job) if request.newest else None
        loading = step in self.service.loads.leased_steps(job)
        reply = rpc_convert.inventory_response(PeerInventory(self.cluster.root_id, committed, sizes, in_flight, replicas=replicas, newest=newest, loading=loading))
        if request.run_id:
            reply.run_attached = self.service.runs.live(job, check_run_id(request.run_id))
        return reply

    async def _data_files(self, job: str, step: int, committed: bool) -> dict[str, int]:
        """The step's data files this node offers its peers, name -> bytes: those of a committed
        step, or of its part prepared here (written and fsynced) whose commit node 0 made and
        this node has not recorded yet; {} for any other step."""
        files = await asyncio.to_thread(self.service.storage.files.step_file_sizes, job, step)
        if not committed and PREPARED_NAME not in files:
            return {}
        return {name: size for name, size in sorted(files.items()) if name.endswith(".safetensors")}

    def _replication(self) -> Replication:
        if self.service.replication is None:
            raise errors.Precondition(f"node {self.cluster.node} keeps no replicas")
        return self.service.replication

    async def OfferReplica(self, request: ppb.OfferReplicaRequest, context: grpc.aio.ServicerContext) -> ppb.BulkTicket:
        job = check_job_id(request.job)
        step = checks.check_step(request.step)
        node = checks.check_node(request.node, self.cluster.nodes)
        files = checks.check_replica_files(node, request.files)
        units = checks.check_replica_units(files, request.units)
        return rpc_convert.bulk_ticket(self._replication().offer(job, step, node, files, units))

    async def ReadReplica(self, request: ppb.ReadReplicaRequest, context: grpc.aio.ServicerContext) -> ppb.BulkTicket:
        job = check_job_id(request.job)
        step = checks.check_step(request.step)
        node = checks.check_node(request.node, self.cluster.nodes)
        ranges = checks.check_replica_ranges(request.ranges)
        return rpc_convert.bulk_ticket(await self._replication().read(job, step, node, ranges))

    async def ReplicaHeld(self, request: ppb.ReplicaHeldRequest, context: grpc.aio.ServicerContext) -> ppb.ReplicaHeldResponse:
        self._coordinator()
        job = check_job_id(request.job)
        step = checks.check_step(request.step)
        node = checks.check_node(request.node, self.cluster.nodes)
        holders = [checks.check_node(h, self.cluster.nodes) for h in request.holders]
        await self._replication().held_report(job, step, node, holders, request.error[:2000])
        return ppb.ReplicaHeldResponse()

    async def HeldParts(self, request: ppb.HeldPartsRequest, context: grpc.aio.ServicerContext) -> ppb.HeldPartsResponse:
        self._coordinator()
        node = checks.check_node(request.node, self.cluster.nodes)
        parts = self._replication().recoverability.parts_of(node)
        return ppb.HeldPartsResponse(parts=[ppb.HeldPart(job=job, step=step, holders=list(holders)) for job, step, holders in parts])

    async def Fetch(self, request: ppb.FetchRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[ppb.Chunk]:
        job = check_job_id(request.job)
        step = checks.check_step(request.step)
        name = checks.check_file_name(request.file, data_only=False)
        storage = self.service.storage
        try:
            index: CheckpointIndex | None = await self.service.index(job, step)
        except (errors.Precondition, OSError):
            index = None
        if index is None:  # a data file of this node's prepared part, whose commit node 0 made and this node records later
            offered = await self._data_files(job, step, committed=False)
            if not offered:
                raise errors.NotFound(f"step {step} of job {job!r} is not committed on node {self.cluster.node}")
            size: int | None = offered.get(name)
        elif name == INDEX_NAME:
            size = (await asyncio.to_thread(storage.files.step_file_sizes, job, step)).get(name, 0)
        else:
            record = index.file(name)
            size = record.size if record is not None else None
        if size is None:
            raise errors.NotFound(f"{name} is not a file of step {step} of job {job!r}")
        nbytes = checks.check_byte_range(name, size, request.offset, request.nbytes)
        done = 0
        while done < nbytes:
            n = min(FETCH_CHUNK, nbytes - done)
            try:  # no link followed, no FIFO waited on; a short file is an error, not a short answer
                if index is None:  # the requester checks the bytes against node 0's index
                    data = await asyncio.to_thread(storage.files.read_range, job, step, name, request.offset + done, n)
                else:
                    data = await self.service.fetched_range(index, name, request.offset + done, n)
            except ForeignEntry as exc:
                raise errors.Precondition(f"{name} on node {self.cluster.node} is not served: {exc}") from None
            except FormatError as exc:
                raise errors.Precondition(f"{name} on node {self.cluster.node}: {exc}") from None
            done += len(data)
            yield ppb.Chunk(data=data)
