"""The gRPC servicer of ckptd.v1.Checkpoint: validate each request, call the service, map errors.

Every field that reaches the service is checked here (job ids, ranks, steps, names, dtypes,
shapes, boxes, sizes); domain errors become status codes in `_STATUS` and nowhere else.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc

from ckptd.common import dtypes
from ckptd.common.boxes import Box
from ckptd.common.names import MAX_EXTRAS_JSON_DEPTH, InvalidNameError, check_job_id, json_depth
from ckptd.common.quant_options import QuantError, check_master_mode, check_scheme
from ckptd.daemon import errors
from ckptd.daemon.checks import check_step, check_timeout, check_who, tensor_specs
from ckptd.daemon.gpu import StagedRange
from ckptd.daemon.format import MODEL_FILES
from ckptd.daemon.plan import SavePlan, TensorSpec
from ckptd.daemon.service import CheckpointService, CommitRecord, PieceInfo, SaveSession
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MODEL_FILE_BYTES = 1 << 20
MAX_STAGED_RANGES = 1 << 20

_STATUS: dict[type[errors.CkptdError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.Precondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Aborted: grpc.StatusCode.ABORTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Timeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}

T = TypeVar("T")


def _status_of(exc: Exception) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]  # type: ignore[index]
    if isinstance(exc, (InvalidNameError, dtypes.UnknownDtypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, where: str) -> None:
    """End the call with the status of `exc`; anything unexpected is INTERNAL and logged (the daemon stays up)."""
    code = _status_of(exc)
    message = str(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", where)
        message = f"internal error in {where}: {type(exc).__name__}: {exc}"
    await context.abort(code, message)


def _mapped(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Map the exceptions of a unary method to status codes (see _abort)."""

    @functools.wraps(method)
    async def wrapper(self: "CheckpointServicer", request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await method(self, request, context)
        except Exception as exc:
            await _abort(context, exc, method.__name__)
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


def parse_json(text: str, what: str, max_depth: int = MAX_EXTRAS_JSON_DEPTH) -> Any:
    """`text` parsed as JSON; InvalidRequest naming `what` if it is not JSON or nests deeper than
    `max_depth` (also when it nests deeper than the parser goes: no RecursionError escapes)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        too_deep = True
    else:
        too_deep = json_depth(value) > max_depth
    if too_deep:
        raise errors.InvalidRequest(f"{what} nests deeper than {max_depth} JSON levels, the limit; flatten it")
    return value


def _box(box: Box) -> pb.Box:
    return pb.Box(offsets=box.offsets, lengths=box.lengths)


# ---------------------------------------------------------------- servicer


def _piece(p: PieceInfo) -> pb.Piece:
    piece = pb.Piece(
        name=p.name, source=p.source, path=p.path, offset=p.offset, nbytes=p.nbytes,
        fragment=_box(p.fragment), dtype=p.dtype, checksum=p.checksum,
        chunk_bytes=p.chunk_bytes, chunk_xxh3=p.chunk_xxh3,
    )
    if p.decode is not None:
        piece.decode.codec = p.decode.codec
        piece.decode.block = p.decode.block
        if p.decode.scales is not None:
            piece.decode.scales.CopyFrom(_piece(p.decode.scales))
        if p.decode.base is not None:
            piece.decode.base.CopyFrom(_piece(p.decode.base))
        if p.decode.frames is not None:
            piece.decode.frame_rows = p.decode.frames.rows
            piece.decode.frame_ends.extend(p.decode.frames.ends)
    return piece


class _SlotMessages:
    """The Slot messages of a rank's share of a plan, built once per (plan, rank): a save of a
    known layout then costs no per-tensor work here. Holds the last few plans only."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._by_plan: dict[int, tuple[SavePlan, dict[int, list[pb.Slot]]]] = {}

    def get(self, plan: SavePlan, rank: int) -> list[pb.Slot]:
        entry = self._by_plan.get(id(plan))
        if entry is None or entry[0] is not plan:
            entry = self._by_plan[id(plan)] = (plan, {})
            while len(self._by_plan) > self._keep:
                del self._by_plan[next(iter(self._by_plan))]
        by_rank = entry[1]
        if rank not in by_rank:
            by_rank[rank] = [pb.Slot(name=s.name, offset=s.offset, nbytes=s.nbytes, box=_box(s.box)) for s in plan.slots_of(rank)]
        return by_rank[rank]


class _ShmPieces:
    """Piece messages of the daemon's memory tier, by value: the same snapshot is served to a
    rank's every load from memory, so each message is built once. Forgets all at `keep`."""

    def __init__(self, keep: int = 200_000) -> None:
        self._keep = keep
        self._pieces: dict[PieceInfo, pb.Piece] = {}

    def get(self, info: PieceInfo) -> pb.Piece:
        piece = self._pieces.get(info)
        if piece is None:
            if len(self._pieces) >= self._keep:
                self._pieces.clear()
            piece = self._pieces[info] = _piece(info)
        return piece


class _LoadSpecs:
    """Validated tensor specs of PlanLoad requests by (job, rank, fingerprint): a rank that
    loads the same structure again sends only the fingerprint. Holds the last `keep`."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._specs: dict[tuple[str, int, str], list[TensorSpec]] = {}

    def resolve(self, job: str, rank: int, fingerprint: str, metas: Any) -> list[TensorSpec]:
        if len(fingerprint) > 256:
            raise errors.InvalidRequest("fingerprint must be at most 256 characters")
        key = (job, rank, fingerprint)
        if not metas and fingerprint:
            specs = self._specs.get(key)
            if specs is None:
                raise errors.Precondition("unknown fingerprint: send the tensor metadata with this request")
            self._specs[key] = self._specs.pop(key)  # most recently used last
            return specs
        specs = tensor_specs(metas)
        if fingerprint:
            self._specs.pop(key, None)
            self._specs[key] = specs
            while len(self._specs) > self._keep:
                del self._specs[next(iter(self._specs))]
        return specs


class CheckpointServicer(pb_grpc.CheckpointServicer):
    def __init__(self, service: CheckpointService) -> None:
        self.service = service
        self._slot_messages = _SlotMessages()
        self._load_specs = _LoadSpecs()
        self._shm_pieces = _ShmPieces()

    @_mapped
    async def BeginSave(self, request: pb.BeginSaveRequest, context: grpc.aio.ServicerContext) -> pb.BeginSaveResponse:
        job, rank, world_size = check_who(request.who)
        step = check_step(request.step)
        if not 0 <= request.who.local_world_size <= world_size:
            raise errors.InvalidRequest(f"local_world_size {request.who.local_world_size} must be between 0 and world_size={world_size}")
        try:
            quantize = check_scheme(request.quantize)
            master_weights = check_master_mode(request.master_weights)
        except QuantError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        if request.no_quantize and quantize is not None:
            raise errors.InvalidRequest(f"quantize={quantize!r} and no_quantize contradict each other; send one")
        if request.lineage_generation < 0:
            raise errors.InvalidRequest(f"lineage_generation {request.lineage_generation} must be >= 0")
        if not request.fingerprint or len(request.fingerprint) > 256:
            raise errors.InvalidRequest("fingerprint must be a non-empty string of at most 256 characters")
        specs = tensor_specs(request.tensors) if request.tensors else None
        if request.has_metric and not math.isfinite(request.metric):
            raise errors.InvalidRequest(f"metric {request.metric} must be a finite number")
        session = await self.service.begin_save(
            job, rank, world_size, step, request.fingerprint, specs,
            request.metric if request.has_metric else None, check_timeout(request.timeout_s), request.who.local_world_size,
            quantize, master_weights, request.lineage_generation, request.no_quantize,
        )
        return self._begin_response(session, rank, request.known_layout)

    def _begin_response(self, session: SaveSession, rank: int, known_layout: str) -> pb.BeginSaveResponse:
        if session.state == "skipped" or session.arenas is None or session.plan is None:
            return pb.BeginSaveResponse(save_id=session.save_id, skipped=True, skip_reason=session.skip_reason or session.state)
        arena = session.arenas.arenas[rank]
        layout_id = session.plan.layout_id(rank)
        reply = pb.BeginSaveResponse(
            save_id=session.save_id,
            arena_path=str(arena.path) if arena is not None else "",
            arena_size=arena.size if arena is not None else 0,
            layout_id=layout_id,
        )
        if known_layout != layout_id:
            reply.slots.extend(self._slot_messages.get(session.plan, rank))
        return reply

    @_mapped
    async def CommitSnapshot(self, request: pb.CommitSnapshotRequest, context: grpc.aio.ServicerContext) -> pb.CommitSnapshotResponse:
        job, rank, _ = check_who(request.who)
        model_files = {}
        for name, text in request.model_files.items():
            if name not in MODEL_FILES:
                raise errors.InvalidRequest(f"model file {name!r} is not one of {', '.join(MODEL_FILES)}")
            if len(text) > MAX_MODEL_FILE_BYTES:
                raise errors.InvalidRequest(f"model file {name} is {len(text)} bytes; the limit is {MAX_MODEL_FILE_BYTES}")
            parse_json(text, f"model file {name}")
            model_files[name] = text.encode()
        stall_s = request.stall_s if math.isfinite(request.stall_s) and 0 <= request.stall_s < 86400 else 0.0
        staged = None
        if request.staging_id:
            if len(request.staged) > MAX_STAGED_RANGES:
                raise errors.InvalidRequest(f"{len(request.staged)} staged ranges; the limit is {MAX_STAGED_RANGES}")
            staged = (request.staging_id, [StagedRange(r.staging_offset, r.arena_offset, r.nbytes) for r in request.staged])
        elif request.staged:
            raise errors.InvalidRequest("staged ranges without a staging_id: open a staging buffer first (OpenStaging)")
        await self.service.commit_snapshot(job, rank, request.save_id, request.extras_json, model_files, staged, stall_s)
        return pb.CommitSnapshotResponse()

    @_mapped
    async def OpenStaging(self, request: pb.OpenStagingRequest, context: grpc.aio.ServicerContext) -> pb.OpenStagingResponse:
        job, rank, _ = check_who(request.who)
        staging_id, reason = await self.service.gpu.open(job, rank, request.gpu_uuid, request.ipc_handle, request.nbytes, request.pid)
        if reason:
            log.warning("rank %s of job %s cannot use mode 'ipc' (it falls back to 'overlap'): %s", rank, job, reason)
        return pb.OpenStagingResponse(staging_id=staging_id, reason=reason)

    @_mapped
    async def CloseStaging(self, request: pb.CloseStagingRequest, context: grpc.aio.ServicerContext) -> pb.CloseStagingResponse:
        job, rank, _ = check_who(request.who)
        await self.service.gpu.close(job, rank, request.staging_id)
        return pb.CloseStagingResponse()

    @_mapped
    async def AbortSave(self, request: pb.AbortSaveRequest, context: grpc.aio.ServicerContext) -> pb.AbortSaveResponse:
        job, rank, _ = check_who(request.who)
        await self.service.abort_save(job, rank, request.save_id, request.reason[:1000])
        return pb.AbortSaveResponse()

    async def WaitDurable(self, request: pb.WaitDurableRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SaveProgress]:
        try:
            job = check_job_id(request.job)
            step = check_step(request.step)
            async for item in self.service.progress(job, step, check_timeout(request.timeout_s)):
                if isinstance(item, str):
                    yield pb.SaveProgress(state="committed", done=True, step_dir=str(self.service.storage.step_dir(job, step)))
                    return
                yield pb.SaveProgress(
                    state=item.state,
                    bytes_total=item.bytes_total,
                    bytes_written=item.progress.written if item.progress else 0,
                    done=item.finished.is_set(),
                    error=item.error or item.skip_reason or "",
                    step_dir=item.step_dir,
                )
        except Exception as exc:
            await _abort(context, exc, "WaitDurable")

    @_mapped
    async def PlanLoad(self, request: pb.PlanLoadRequest, context: grpc.aio.ServicerContext) -> pb.PlanLoadResponse:
        job, rank, world_size = check_who(request.who)
        step = None if request.latest else check_step(request.step)
        wanted = self._load_specs.resolve(job, rank, request.fingerprint, request.tensors)
        for key in request.kinds:
            if not key or "/" in key or len(key) > 256:
                raise errors.InvalidRequest(f"top-level state key {key!r} must be a non-empty name without '/'")
        plan = await self.service.plan_load(
            job, rank, world_size, step, wanted, list(request.kinds), request.strict, request.direct_read, request.decodes, request.decodes_frames
        )
        if len(request.known_plans) > 8:
            raise errors.InvalidRequest(f"{len(request.known_plans)} known plans; send at most 8")
        if plan.plan_id and plan.plan_id in request.known_plans:
            pieces = []  # the rank has them from an earlier answer of this plan
        else:
            pieces = [self._shm_pieces.get(p) if p.source == "shm" else _piece(p) for p in plan.pieces]
        return pb.PlanLoadResponse(
            load_id=plan.load_id, step=plan.step, pieces=pieces, extras_json=json.dumps(plan.extras),
            missing=plan.missing, unexpected=plan.unexpected, tier=plan.tier, generation=plan.generation, plan_id=plan.plan_id,
        )

    @_mapped
    async def LoadDone(self, request: pb.LoadDoneRequest, context: grpc.aio.ServicerContext) -> pb.LoadDoneResponse:
        check_who(request.who)
        self.service.load_done(request.load_id)
        return pb.LoadDoneResponse()

    @_mapped
    async def List(self, request: pb.ListRequest, context: grpc.aio.ServicerContext) -> pb.ListResponse:
        job = check_job_id(request.job)
        infos = []
        for index, path, in_memory in await self.service.list_checkpoints(job):
            infos.append(
                pb.CheckpointInfo(
                    step=index.step, created_at=index.created_at, size_bytes=index.size_bytes,
                    file_count=len(index.files) + 1, path=str(path), in_memory=in_memory,
                    metric=index.metric or 0.0, has_metric=index.metric is not None,
                )
            )
        return pb.ListResponse(checkpoints=infos)

    @_mapped
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        status = self.service.status()
        if request.job:
            check_job_id(request.job)
            status["in_flight"] = [f for f in status["in_flight"] if f["job"] == request.job]
        return pb.StatusResponse(
            version=status["version"], root=status["root"],
            in_flight=[pb.InFlight(**f) for f in status["in_flight"]],
            arena_bytes=status["arena_bytes"], arena_count=status["arena_count"],
            committed_total=status["committed_total"], failed_total=status["failed_total"],
            skipped_total=status["skipped_total"], last_error=status["last_error"], draining=status["draining"],
            queue_depth=status["queue_depth"], node_rank=status["node_rank"], nodes=status["nodes"],
            bytes_written_total=status["bytes_written_total"], uptime_s=status["uptime_s"], loads_active=status["loads_active"],
            last_commit=_last_commit(status["last_commit"]),
        )

    @_mapped
    async def Collect(self, request: pb.CollectRequest, context: grpc.aio.ServicerContext) -> pb.CollectResponse:
        job = check_job_id(request.job) if request.job else None
        removed = await self.service.collect(job, request.dry_run)
        return pb.CollectResponse(
            removed=[pb.Removed(job=r.job, step=r.step, path=r.path, reason=r.reason, bytes=r.bytes) for r in removed]
        )


def _last_commit(record: CommitRecord | None) -> pb.LastCommit | None:
    if record is None:
        return None
    return pb.LastCommit(
        job=record.job, step=record.step, committed_at=record.committed_at, latency_s=record.latency_s,
        bytes=record.bytes, step_dir=record.step_dir,
    )
