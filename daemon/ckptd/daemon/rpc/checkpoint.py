"""The gRPC servicer of ckptd.v1.Checkpoint: each method validates its request (rpc/validate.py),
calls the service, and converts the answer (rpc/convert.py).

Every field that reaches the service is checked (job ids, ranks, steps, names, dtypes, shapes,
boxes, sizes). Methods raise domain errors (errors.py); rpc_errors.ErrorStatusInterceptor,
registered on the server, turns them into status codes.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

import grpc

from ckptd.common.names import check_job_id
from ckptd.daemon import errors
from ckptd.daemon.engine.requests import CommitSnapshot
from ckptd.daemon.engine.runs import Client
from ckptd.daemon.handoff.gpu_ipc import GpuStaging
from ckptd.daemon.handoff.transports import StagedHandOver
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.daemon.rpc import convert as rpc_convert
from ckptd.daemon.rpc import validate as checks
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ckptd.daemon.service import CheckpointService

log = logging.getLogger(__name__)


class _LoadSpecs:
    """Validated tensor specs of PlanLoad requests by (job, rank, fingerprint): a rank that
    loads the same structure again sends only the fingerprint. Holds the last `keep`.

    A new process of the rank (a restarted trainer) sends the metadata again: when it is equal,
    message for message, to the metadata these specs were validated from, the same specs object
    is returned (no validation again, and the daemon's memory plans, which key on that object,
    are found: engine/loads.py)."""

    def __init__(self, saved: Callable[[str, int, str], Sequence[TensorSpec] | None] = lambda job, rank, fingerprint: None, keep: int = 64) -> None:
        """saved(job, rank, fingerprint): the metadata that rank of that job sent with that
        fingerprint to a save, validated then (CheckpointService.saved_specs), or None: a
        restarted trainer's first load of the structure it saved names it by fingerprint alone
        (at 4,000 tensors the metadata is ~0.5 MB to build and send and 29 ms to validate)."""
        self._saved = saved
        self._keep = keep
        self._specs: dict[tuple[str, int, str], tuple[list[TensorSpec], Any]] = {}  # -> (specs, the metadata they came from; None: a save's)

    def resolve(self, job: str, rank: int, fingerprint: str, metas: Any) -> list[TensorSpec]:
        key = (job, rank, checks.check_fingerprint(fingerprint, required=False))
        known = self._specs.get(key)
        if not metas and fingerprint:
            if known is None:
                saved = self._saved(job, rank, fingerprint)
                if saved is None:
                    raise errors.UnknownFingerprint()
                known = (list(saved), None)  # kept: the same object each load (memory plans key on it)
            return self._use(key, known)
        if known is not None and metas == known[1]:  # compared in C, field by field
            return self._use(key, known)
        specs = checks.tensor_specs(metas)
        return self._use(key, (specs, metas)) if fingerprint else specs

    def _use(self, key: tuple[str, int, str], entry: tuple[list[TensorSpec], Any]) -> list[TensorSpec]:
        """`entry` kept for `key` as the most recently used (the least recent past `keep`
        forgotten); its specs."""
        self._specs.pop(key, None)
        self._specs[key] = entry
        while len(self._specs) > self._keep:
            del self._specs[next(iter(self._specs))]
        return entry[0]


class CheckpointServicer(pb_grpc.CheckpointServicer):
    def __init__(self, service: "CheckpointService", staging: GpuStaging) -> None:
        """staging: mode "ipc"'s staging buffers, which OpenStaging and CloseStaging open and close."""
        self.service = service
        self._staging = staging
        self._slot_messages = rpc_convert.SlotMessages()
        self._load_specs = _LoadSpecs(service.saved_specs)
        self._shm_pieces = rpc_convert.ShmPieces()
        self._memory_columns = rpc_convert.MemoryColumnsMessages()

    async def BeginSave(self, request: pb.BeginSaveRequest, context: grpc.aio.ServicerContext) -> pb.BeginSaveResponse:
        begin = checks.begin_save_of(request)
        session = await self.service.begin_save(begin)
        return rpc_convert.begin_response(session, begin.rank, request.known_layout, self._slot_messages)

    async def CommitSnapshot(self, request: pb.CommitSnapshotRequest, context: grpc.aio.ServicerContext) -> pb.CommitSnapshotResponse:
        job, rank, _ = checks.check_who(request.who)
        model_files = checks.check_model_files(request.model_files)
        stall_s = checks.check_stall(request.stall_s)
        staged = None
        if checks.check_staged(request.staging_id, len(request.staged)):
            staged = StagedHandOver(GpuStaging.name, request.staging_id, rpc_convert.staged_ranges(request.staged))
        await self.service.commit_snapshot(CommitSnapshot(job, rank, request.save_id, request.extras_json, model_files, staged, stall_s))
        return pb.CommitSnapshotResponse()

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AttachEvent]:
        """Open while the client lives: one event, then nothing until Detach, the client's exit
        (gRPC cancels this call at once) or the daemon's drain."""
        job, rank, _ = checks.check_who(request.who)
        run = checks.check_run(request.who)
        if not run:
            raise errors.InvalidRequest("Attach needs the client's run id (RankId.run_id)")
        client_id = checks.check_client_id(request.who, required=True)
        client = Client(run, rank, request.pid, request.host[:255], time.time())
        ended = self.service.attach(job, client_id, client)
        try:
            yield pb.AttachEvent(owner_run=self.service.runs.owner(job))
            await ended.wait()
        finally:
            self.service.detach(job, client_id, client)

    async def Detach(self, request: pb.DetachRequest, context: grpc.aio.ServicerContext) -> pb.DetachResponse:
        job, _, _ = checks.check_who(request.who)
        self.service.detach(job, checks.check_client_id(request.who, required=True))
        return pb.DetachResponse()

    async def OpenStaging(self, request: pb.OpenStagingRequest, context: grpc.aio.ServicerContext) -> pb.OpenStagingResponse:
        job, rank, _ = checks.check_who(request.who)
        staging_id, reason = await self._staging.open(
            job, rank, request.gpu_uuid, request.ipc_handle, request.nbytes, request.pid, checks.check_client_id(request.who)
        )
        if reason:
            log.warning("rank %s of job %s cannot use mode 'ipc' (it falls back to 'overlap'): %s", rank, job, reason)
        return pb.OpenStagingResponse(staging_id=staging_id, reason=reason)

    async def CloseStaging(self, request: pb.CloseStagingRequest, context: grpc.aio.ServicerContext) -> pb.CloseStagingResponse:
        job, rank, _ = checks.check_who(request.who)
        await self._staging.close(job, rank, request.staging_id)
        return pb.CloseStagingResponse()

    async def AbortSave(self, request: pb.AbortSaveRequest, context: grpc.aio.ServicerContext) -> pb.AbortSaveResponse:
        job, rank, _ = checks.check_who(request.who)
        await self.service.abort_save(job, rank, request.save_id, request.reason[:1000])
        return pb.AbortSaveResponse()

    async def WaitDurable(self, request: pb.WaitDurableRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SaveProgress]:
        job = check_job_id(request.job)
        step = checks.check_step(request.step)
        async for item in self.service.progress(job, step, checks.check_timeout(request.timeout_s)):
            if isinstance(item, str):  # the step is committed
                yield rpc_convert.committed_pb(self.service.storage.catalog.step_location(job, step))
                return
            yield rpc_convert.progress_pb(item)

    async def PlanLoad(self, request: pb.PlanLoadRequest, context: grpc.aio.ServicerContext) -> pb.PlanLoadResponse:
        load = checks.plan_load_of(request, lambda job, rank: self._load_specs.resolve(job, rank, request.fingerprint, request.tensors))
        plan = await self.service.plan_load(load)
        # checked after planning, as always: a rank with too many known plans is told so only then
        known_plans = checks.check_known_plans(request.known_plans)
        if plan.plan_id and plan.plan_id in known_plans:
            return rpc_convert.plan_load_response(plan, [])  # the rank has the pieces from an earlier answer of this plan
        if plan.plan_id and request.memory_columns and (columns := self._memory_columns.get(plan, load.wanted)) is not None:
            return rpc_convert.plan_load_response(plan, [], columns)
        pieces = [self._shm_pieces.get(p) if p.source == "shm" else rpc_convert.piece_pb(p) for p in plan.pieces]
        return rpc_convert.plan_load_response(plan, pieces)

    async def HeldArena(self, request: pb.HeldArenaRequest, context: grpc.aio.ServicerContext) -> pb.HeldArenaResponse:
        job, rank, _ = checks.check_who(request.who)
        part = self.service.held_part(job, rank)
        return pb.HeldArenaResponse() if part is None else pb.HeldArenaResponse(step=part.step, path=part.path, nbytes=part.nbytes)

    async def LoadDone(self, request: pb.LoadDoneRequest, context: grpc.aio.ServicerContext) -> pb.LoadDoneResponse:
        checks.check_who(request.who)
        self.service.load_done(request.load_id)
        return pb.LoadDoneResponse()

    async def List(self, request: pb.ListRequest, context: grpc.aio.ServicerContext) -> pb.ListResponse:
        job = check_job_id(request.job)
        listed = await self.service.list_checkpoints(job)
        return pb.ListResponse(checkpoints=[rpc_convert.checkpoint_info_pb(summary, path, in_memory) for summary, path, in_memory in listed])

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return rpc_convert.status_pb(self.service.status(check_job_id(request.job) if request.job else None))

    async def Collect(self, request: pb.CollectRequest, context: grpc.aio.ServicerContext) -> pb.CollectResponse:
        job = check_job_id(request.job) if request.job else None
        removed = await self.service.collect(job, request.dry_run)
        return pb.CollectResponse(removed=rpc_convert.removed_pb(removed))
