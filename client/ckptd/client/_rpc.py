"""The client's wire edge: the only module of ckptd.client that imports grpc and the stubs.

`DaemonRpc` holds the channel and the stub, builds every request, turns the answers into the
client's records (`SaveGrant`, `LoadPlan`, `CheckpointInfo`, ckptd.client.reader.pieces.Source) and
every failed call into an error with `status_error`. The rest of the client never sees a
protocol message, except as an opaque value it keeps and hands back (cached tensor metadata,
staged ranges, a commit request).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import grpc

from ckptd.client.reader.pieces import ArenaColumns, Decoding, Source
from ckptd.client.errors import ABORTED, CheckpointError, CheckpointNotFound, DaemonUnavailable, InvalidState
from ckptd.client.layout import Fragment
from ckptd.client.slots import SlotLike
from ckptd.client.state import TensorEntry
from ckptd.client.structure import Structure
from ckptd.common import dtypes
from ckptd.common.boxes import Box
from ckptd.common.frames import Frames
from ckptd.common.retention import JobRetention
from ckptd.wire import MESSAGE_SIZE_OPTIONS, RECONNECT_OPTIONS, UNKNOWN_FINGERPRINT, reason_of
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import checkpoint_pb2_grpc as pb_grpc

log = logging.getLogger("ckptd.client")

StatusResponse = pb.StatusResponse  # what CheckpointClient.status() returns, as the daemon sent it


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as the daemon lists it."""

    step: int
    created_at: float  # unix seconds
    size_bytes: int
    file_count: int
    path: str
    in_memory: bool  # the snapshot is still in the daemon's memory (fast restore)
    metric: float | None


@dataclass(frozen=True)
class DurableInfo:
    """A committed checkpoint: on disk, fsynced, visible to loads.

    `bytes_written`: the bytes of the tensor files (safetensors, headers included; a compressed
    step's, as encoded) that this rank's node daemon wrote for the step (its part of it).
    `bytes_linked`: those of the files it did not write because an incremental save linked them,
    unchanged and read back against their checksums, from the previous step (files of frozen
    tensors). Both are 0 when the daemon no longer knows the save (a step committed
    before it restarted)."""

    step: int
    step_dir: str
    bytes_written: int
    bytes_linked: int = 0


@dataclass(frozen=True)
class SaveOptions:
    """A save's compression options as the client sends them."""

    quantize: str | None  # "O1" | "O2" | None
    no_quantize: bool  # quantize="none": lossless whatever the daemon's default
    master_weights: str  # "" (the daemon's default) | keep | drop | residual


class SaveGrant(NamedTuple):
    """The daemon's answer to BeginSave: where this rank's snapshot goes (a tuple: made per save, in C).

    slots: this rank's slots (ckptd.client.slots); empty when the daemon kept the layout
    `layout_id` the client named as known. skipped: the daemon skips this step (skip_reason).
    """

    save_id: str
    skipped: bool
    skip_reason: str
    arena_path: str
    arena_size: int  # bytes
    layout_id: str
    slots: Sequence[SlotLike]
    committed: bool = False  # the step is committed already (a resumed run redid it): nothing to hand over; skip_reason says so


@dataclass(frozen=True)
class LoadPlan:
    """The daemon's answer to PlanLoad. plan_id: set when the plan reads the daemon's memory
    (then `pieces` is empty when the rank named it as known, or when `columns` says the same
    in one entry per fragment of the rank's structure); generation: the quantization
    generation of the step (compounding guard for the next save)."""

    load_id: str
    plan_id: str
    step: int
    generation: int
    extras_json: str
    missing: Sequence[str]
    pieces: list[Source]
    columns: ArenaColumns | None = None
    unexpected: Sequence[str] = ()  # in the step, not in the request (reported when the request was not strict)


@dataclass(frozen=True)
class PlanAhead:
    """A PlanLoad in flight, sent before the client knew its state's structure (for the one of its
    last load: ckptd.client.client.CheckpointClient.load); `call` is grpc's future."""

    request: pb.PlanLoadRequest
    call: Any


def status_error(exc: grpc.RpcError, address: str, refusal: bool = False) -> CheckpointError:
    """The client's error for a failed call: DaemonUnavailable, CheckpointNotFound, else
    CheckpointError with the status name as `code`. refusal: the call was BeginSave, whose
    INVALID_ARGUMENT refuses what the caller passed (InvalidState), except a job whose world size
    changed while an earlier save is still in flight (an elastic restart; it passes once that
    save ends)."""
    code = exc.code()
    details = exc.details() or str(code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return DaemonUnavailable(
            f"no ckptd answers at {address} ({details}); start it with `ckptd serve` or set CKPTD_ADDRESS", code.name
        )
    if code == grpc.StatusCode.NOT_FOUND:
        return CheckpointNotFound(details, code.name)
    if refusal and code == grpc.StatusCode.INVALID_ARGUMENT and "has a save in flight with world size" not in details:
        return InvalidState(details, code.name)
    return CheckpointError(details, code.name, reason_of(exc))


def _unknown_fingerprint(exc: CheckpointError) -> bool:
    """The daemon does not know the structure's fingerprint (it restarted): describe it again."""
    return exc.reason == UNKNOWN_FINGERPRINT


def tensor_meta(entry: TensorEntry, fragment: Fragment) -> pb.TensorMeta:
    """The wire description of one fragment of a tensor (under the fragment's name: a per-rank
    tensor's carries the rank)."""
    box = fragment.box
    return pb.TensorMeta(
        name=fragment.name,
        kind=entry.kind,
        dtype=dtypes.from_torch_name(str(fragment.local.dtype)),
        shape=fragment.global_shape,
        box=pb.Box(offsets=box.offsets, lengths=box.lengths),
        aliases=entry.aliases,
        frozen=entry.frozen,
        per_rank=fragment.per_rank,
    )


def tensor_metas(structure: Structure) -> list[pb.TensorMeta]:
    """The tensor metadata of a structure's fragments, built when sent: the first save and
    load of a structure, and after a daemon restart. Not kept: about 1.1 KiB per tensor held in
    the trainer for the rare resend (issue 30 finding 5)."""
    return [tensor_meta(e, f) for e, f in structure.fragments]


def load_fingerprint(structure: Structure) -> str:
    """What a PlanLoad names `structure` by: its fingerprint, none for a state without tensors."""
    return structure.fingerprint if structure.targets else ""


def _source(p: pb.Piece) -> Source:
    decoding = None
    if p.HasField("decode"):
        d = p.decode
        decoding = Decoding(
            d.codec, d.block, _source(d.scales) if d.HasField("scales") else None, _source(d.base) if d.HasField("base") else None,
            Frames(d.frame_rows, tuple(d.frame_ends)) if d.frame_rows else None,
        )
    box = Box(tuple(p.fragment.offsets), tuple(p.fragment.lengths))
    return Source(p.name, p.source, p.path, p.offset, p.nbytes, box, p.dtype, p.checksum, p.chunk_bytes, p.chunk_xxh3, decoding)


class DaemonRpc:
    """One rank's calls to its node's daemon. `stub` is looked up at each call (tests wrap its
    methods); every call but the best-effort ones (abort, close, done) raises `status_error`'s
    error."""

    def __init__(
        self, address: str, job: str, rank: int, world_size: int, local_world_size: int, timeout_s: float, retention: JobRetention | None = None
    ) -> None:
        self.address = address
        self.job = job
        self.timeout_s = timeout_s
        self.retention = retention  # the job's own, sent with every BeginSave
        self.who = pb.RankId(job=job, rank=rank, world_size=world_size, local_world_size=local_world_size, client_id=secrets.token_hex(16))
        self.channel = grpc.insecure_channel(address, options=[*MESSAGE_SIZE_OPTIONS, *RECONNECT_OPTIONS])
        self.stub = pb_grpc.CheckpointStub(self.channel)  # type: ignore[no-untyped-call]
        self._known_fingerprints: set[str] = set()  # the daemon has their tensor metadata (BeginSave)
        self._attachment: Any = None  # the open Attach call (grpc's call object), None before the first
        self._attach_unsupported = False  # the daemon predates Attach
        self._load_done: Any = None  # the LoadDone call in flight (grpc's future), None when none is
        self._pid = os.getpid()  # grpc's channel is this process's: a forked child cannot use it

    # ------------------------------------------------------------ run

    def identify(self, run_id: str) -> None:
        """Send `run_id` with every request from now on (client/ckptd/client/run_id.py)."""
        self.who.run_id = run_id

    def attach(self) -> None:
        """Keep an Attach call open, so the daemon knows this client lives: opened at the first
        call and again after it ended (the daemon restarted). Never read: the daemon sees it end
        when this process exits. Best effort: a daemon that is down fails the next call anyway."""
        call = self._attachment
        if call is not None and call.done():
            if call.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._attach_unsupported = True
            call = None
        if call is not None or self._attach_unsupported:
            return
        self._attachment = self.stub.Attach(pb.AttachRequest(who=self.who, pid=os.getpid(), host=socket.gethostname()))

    def detach(self) -> None:
        """Tell the daemon this client is done (before a later client of the job saves), and end
        the Attach call. Best effort: a failure is logged."""
        call, self._attachment = self._attachment, None
        if call is None:
            return
        if not call.done():
            try:
                self.stub.Detach(pb.DetachRequest(who=self.who), timeout=10)
            except grpc.RpcError as exc:
                log.debug("Detach failed (the daemon sees the client end anyway): %s", exc.details())
        call.cancel()

    def call(self, method: Any, request: Any, refusal: bool = False) -> Any:
        """`method(request)` with the save/load timeout (timeout_s + 30 s); raises status_error's error."""
        self.settle_load_done()
        try:
            return method(request, timeout=self.timeout_s + 30)
        except grpc.RpcError as exc:
            raise status_error(exc, self.address, refusal) from None

    # ------------------------------------------------------------ save

    def begin_save(
        self, structure: Structure, step: int, metric: float | None, options: SaveOptions, lineage: int, known_layout: str,
        resumed_from: int | None = None,
    ) -> SaveGrant:
        """BeginSave with only the structure's fingerprint when the daemon has its metadata from
        an earlier save; with the metadata when it has not (or forgot it: restarted). Raises
        InvalidState when the daemon refuses the state. resumed_from: the step this run loaded
        before its first save (a resume), else None."""
        fingerprint = structure.fingerprint
        request = pb.BeginSaveRequest(
            who=self.who,
            step=step,
            fingerprint=fingerprint,
            timeout_s=self.timeout_s,
            metric=metric or 0.0,
            has_metric=metric is not None,
            quantize=options.quantize or "",
            no_quantize=options.no_quantize,
            master_weights=options.master_weights,
            lineage_generation=lineage,
            known_layout=known_layout,
            retention=_retention_message(self.retention),
            resumed=resumed_from is not None,
            resumed_from=resumed_from or 0,
        )
        if fingerprint not in self._known_fingerprints:
            request.tensors.extend(tensor_metas(structure))
        try:
            reply = self.call(self.stub.BeginSave, request, refusal=True)
        except CheckpointError as exc:
            if not _unknown_fingerprint(exc):
                raise
            request.tensors.extend(tensor_metas(structure))  # the daemon restarted: describe again
            reply = self.call(self.stub.BeginSave, request, refusal=True)
        self._known_fingerprints.add(fingerprint)
        return SaveGrant(
            reply.save_id, reply.skipped, reply.skip_reason, reply.arena_path, reply.arena_size, reply.layout_id, reply.slots, reply.committed
        )

    def forget_fingerprint(self, fingerprint: str) -> None:
        """The next BeginSave of this structure sends its tensor metadata, not only its fingerprint."""
        self._known_fingerprints.discard(fingerprint)

    def commit_request(self, save_id: str, extras_json: str, model_files: dict[str, str], stall_s: float) -> Any:
        """The CommitSnapshot request of a save (opaque to the caller); stall_s: how long save()
        has blocked training so far (for the daemon's stall metric)."""
        commit = pb.CommitSnapshotRequest(who=self.who, save_id=save_id, extras_json=extras_json, stall_s=stall_s)
        if model_files:
            commit.model_files.update(model_files)
        return commit

    @staticmethod
    def staged_ranges(ranges: Sequence[tuple[int, int]]) -> Any:
        """The (offset, bytes) ranges the daemon copies from the staging buffer to the same
        offsets of the arena, as a value for `add_staged` (build once per placement)."""
        return [pb.StagedRange(staging_offset=o, arena_offset=o, nbytes=n) for o, n in ranges]

    @staticmethod
    def add_staged(commit: Any, staging_id: str, staged: Any) -> None:
        """Mode "ipc": the commit tells the daemon to drain these ranges of the staging buffer."""
        commit.staging_id = staging_id
        commit.staged.extend(staged)

    def commit(self, commit: Any) -> None:
        self.call(self.stub.CommitSnapshot, commit)

    def abort(self, save_id: str, reason: str) -> None:
        """Best effort: a failure is logged (the daemon's watchdog ends the save anyway)."""
        self.settle_load_done()
        try:
            self.stub.AbortSave(pb.AbortSaveRequest(who=self.who, save_id=save_id, reason=reason), timeout=10)
        except grpc.RpcError as exc:
            log.warning("could not abort save %s: %s", save_id, exc.details())

    def wait_durable(self, step: int, timeout: float | None) -> DurableInfo:
        """Block until `step` is committed; raises CheckpointError (ABORTED) when it is not."""
        self.settle_load_done()
        request = pb.WaitDurableRequest(job=self.job, step=step, timeout_s=timeout or 0.0)
        last = None
        try:
            for last in self.stub.WaitDurable(request, timeout=None if timeout is None else timeout + 30):
                if last.done:
                    break
        except grpc.RpcError as exc:
            raise status_error(exc, self.address) from None
        if last is None or last.state != "committed":
            reason = last.error if last is not None else "no answer"
            raise CheckpointError(f"step {step} was not committed: {reason}", ABORTED)
        return DurableInfo(step=step, step_dir=last.step_dir, bytes_written=last.bytes_written, bytes_linked=last.bytes_linked)

    # ------------------------------------------------------------ mode "ipc"

    def open_staging(self, gpu_uuid: str, ipc_handle: bytes, nbytes: int, pid: int) -> tuple[str, str]:
        """Ask the daemon to open a staging buffer: (its id, "") or ("", why not)."""
        request = pb.OpenStagingRequest(who=self.who, gpu_uuid=gpu_uuid, ipc_handle=ipc_handle, nbytes=nbytes, pid=pid)
        try:
            answer = self.call(self.stub.OpenStaging, request)
        except CheckpointError as exc:
            return "", f"the daemon refused the staging buffer: {exc}"
        return answer.staging_id, answer.reason

    def close_staging(self, staging_id: str) -> None:
        """Best effort: a failure is logged."""
        self.settle_load_done()
        try:
            self.stub.CloseStaging(pb.CloseStagingRequest(who=self.who, staging_id=staging_id), timeout=30)
        except grpc.RpcError as exc:
            log.warning("could not close the staging buffer in the daemon: %s", exc.details())

    # ------------------------------------------------------------ load

    def plan_load(
        self, structure: Structure, step: int | None, kinds: Sequence[str], strict: bool, direct_read: bool, known_plans: Sequence[str],
        ahead: "PlanAhead | None" = None,
    ) -> LoadPlan:
        """PlanLoad with only the fingerprint when the daemon has this structure's metadata
        from an earlier load or save; with the metadata when it has not (or forgot it: restarted): `_plan_load`.
        ahead: a PlanLoad sent before (`plan_load_ahead`), whose answer is taken when its request
        is this one, field for field; else it is released."""
        request = self._plan_load_request(load_fingerprint(structure), step, kinds, strict, direct_read, known_plans)
        if ahead is not None and ahead.request != request:
            self.drop_ahead(ahead)
            ahead = None
        reply = self._plan_load(request, structure, ahead)
        columns = None
        if reply.HasField("columns"):
            c = reply.columns
            columns = ArenaColumns.of(c.paths, c.file, c.offset, c.nbytes)
        return LoadPlan(
            reply.load_id, reply.plan_id, reply.step, reply.generation, reply.extras_json, reply.missing, [_source(p) for p in reply.pieces], columns,
            reply.unexpected,
        )

    def plan_load_ahead(
        self, fingerprint: str, step: int | None, kinds: Sequence[str], strict: bool, direct_read: bool, known_plans: Sequence[str]
    ) -> "PlanAhead":
        """Send PlanLoad (the structure's fingerprint alone) without waiting for the answer:
        `plan_load` takes it, or releases it, later."""
        self.settle_load_done()
        request = self._plan_load_request(fingerprint, step, kinds, strict, direct_read, known_plans)
        return PlanAhead(request, self.stub.PlanLoad.future(request, timeout=self.timeout_s + 30))

    def drop_ahead(self, ahead: "PlanAhead | None") -> None:
        """Release the load a PlanLoad sent ahead was granted, if any (its answer is waited for)."""
        if ahead is None:
            return
        try:
            reply = ahead.call.result()
        except grpc.RpcError as exc:
            log.debug("a PlanLoad sent ahead failed, which nothing waited for: %s", exc.details())
            return
        self.load_done(reply.load_id)

    def _plan_load_request(
        self, fingerprint: str, step: int | None, kinds: Sequence[str], strict: bool, direct_read: bool, known_plans: Sequence[str]
    ) -> pb.PlanLoadRequest:
        return pb.PlanLoadRequest(
            who=self.who,
            step=step or 0,
            latest=step is None,
            kinds=kinds,
            strict=strict,
            direct_read=direct_read,
            decodes=True,
            decodes_frames=True,
            fingerprint=fingerprint,
            known_plans=known_plans,
            memory_columns=True,
        )

    def _plan_load(self, request: pb.PlanLoadRequest, structure: Structure, ahead: "PlanAhead | None" = None) -> Any:
        """The fingerprint alone first (or its answer when `ahead` sent this request already): the
        daemon keeps the metadata by job, rank and fingerprint, so it knows it from any earlier
        load or save of this rank, this process's or a previous one's (a restarted trainer describes
        thousands of tensors no more). Refused as unknown (never sent, or the daemon restarted):
        sent again with the metadata."""
        try:
            return self._answer(ahead) if ahead is not None else self.call(self.stub.PlanLoad, request)
        except CheckpointError as exc:
            if not request.fingerprint or not _unknown_fingerprint(exc):
                raise
        request.tensors.extend(tensor_metas(structure))
        return self.call(self.stub.PlanLoad, request)

    def _answer(self, ahead: "PlanAhead") -> Any:
        """The answer to a PlanLoad sent ahead; raises status_error's error."""
        try:
            return ahead.call.result()
        except grpc.RpcError as exc:
            raise status_error(exc, self.address) from None

    def load_done(self, load_id: str) -> None:
        """Tell the daemon the load is done, without waiting for its answer: the trainer goes on
        while the message travels (about 1.5 ms of a load from memory). The next call of this
        client waits for it first (`settle_load_done`), so the daemon has released the load
        before it sees what follows (a save reusing the arena). Best effort: a failure is logged
        (the daemon releases the step later by itself)."""
        self.settle_load_done()
        self._load_done = self.stub.LoadDone.future(pb.LoadDoneRequest(who=self.who, load_id=load_id), timeout=10)

    def settle_load_done(self) -> None:
        """Before every call: in the process that made this connection (else CheckpointError
        saying to make a new client; a forked child's calls on it hang or go nowhere); then wait
        for the LoadDone call in flight, if any (at most its 10 s timeout); log its failure."""
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"this CheckpointClient was made in process {self._pid}, and process {os.getpid()} (a fork of it) cannot use its "
                "connection to the daemon or its shared memory: make a new CheckpointClient in this process"
            )
        call, self._load_done = self._load_done, None
        if call is None:
            return
        try:
            call.result()
        except grpc.RpcError as exc:
            log.warning("LoadDone failed (the daemon releases the step later by itself): %s", exc.details())
        except grpc.FutureCancelledError:
            log.debug("LoadDone was cancelled (the channel closed): the daemon releases the step later by itself")

    # ------------------------------------------------------------ queries

    def list(self) -> list[CheckpointInfo]:
        reply = self.call(self.stub.List, pb.ListRequest(job=self.job))
        return [
            CheckpointInfo(c.step, c.created_at, c.size_bytes, c.file_count, c.path, c.in_memory, c.metric if c.has_metric else None)
            for c in reply.checkpoints
        ]

    def status(self) -> StatusResponse:
        reply: StatusResponse = self.call(self.stub.Status, pb.StatusRequest(job=self.job))
        return reply

    def close(self) -> None:
        self.settle_load_done()
        self.detach()
        self.channel.close()


def _retention_message(retention: JobRetention | None) -> pb.Retention | None:
    """The job's retention request as BeginSaveRequest carries it (None: unset, the daemon's flags)."""
    if retention is None:
        return None
    return pb.Retention(keep_last=retention.keep_last, keep_best=retention.keep_best, best_mode=retention.best_mode or "")
