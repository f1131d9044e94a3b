"""Every conversion between the daemon's records and wire messages, for both services.

Checkpoint (ranks <-> this daemon) and Peer (daemon <-> daemon). Conversions only: requests
are validated in `rpc/validate.py` before their values reach the engine, and what a peer answers is
validated here where it becomes a record (`join_result_of` checks the metadata it carries).
"""

from __future__ import annotations

import json
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ckptd.common import json_read
from ckptd.common.boxes import Box
from ckptd.common.quant_options import check_master_mode, check_scheme
from ckptd.daemon.engine.requests import JoinSave, ReportManifest
from ckptd.daemon.errors import Aborted, InvalidRequest, listed
from ckptd.daemon.memo import IdentityMemo
from ckptd.format.file_plan import SHM_SOURCE
from ckptd.format.index import FileRecord, FragmentRecord, QuantRecord
from ckptd.format.units import Unit
from ckptd.daemon.handoff.gpu_ipc import StagedRange
from ckptd.daemon.plan.compression import Compression
from ckptd.daemon.plan.files import NodeManifest
from ckptd.daemon.plan.retention import JobRetention
from ckptd.daemon.plan.save_plan import FragmentSlot, LogicalTensor, SavePlan, TensorSpec
from ckptd.daemon.records import (
    BulkAnswer, JoinResult, LastCommit, Outcome, PeerInventory, RemoteStatus, ReplicaStatus, StatusSnapshot, StepSummary,
)
from ckptd.daemon.rpc.validate import tensor_specs
from ckptd.wire.v1 import checkpoint_pb2 as pb
from ckptd.wire.v1 import peer_pb2 as ppb

if TYPE_CHECKING:
    from ckptd.daemon.engine.sessions import SaveSession
    from ckptd.daemon.plan.load_plan import LoadPlan
    from ckptd.format.file_plan import PieceInfo

# ------------------------------------------------------------------ Checkpoint service


def box_pb(box: Box) -> pb.Box:
    return pb.Box(offsets=box.offsets, lengths=box.lengths)


def piece_pb(p: "PieceInfo") -> pb.Piece:
    piece = pb.Piece(
        name=p.name, source=p.source, path=p.path, offset=p.offset, nbytes=p.nbytes,
        fragment=box_pb(p.fragment), dtype=p.dtype, checksum=p.checksum,
        chunk_bytes=p.chunk_bytes, chunk_xxh3=p.chunk_xxh3,
    )
    if p.decode is not None:
        piece.decode.codec = p.decode.codec
        piece.decode.block = p.decode.block
        if p.decode.scales is not None:
            piece.decode.scales.CopyFrom(piece_pb(p.decode.scales))
        if p.decode.base is not None:
            piece.decode.base.CopyFrom(piece_pb(p.decode.base))
        if p.decode.frames is not None:
            piece.decode.frame_rows = p.decode.frames.rows
            piece.decode.frame_ends.extend(p.decode.frames.ends)
    return piece


class SlotMessages:
    """The Slot messages of a rank's share of a plan, built once per (plan, rank): a save of a
    known layout then costs no per-tensor work here. Holds the last few plans only."""

    def __init__(self, keep: int = 8) -> None:
        self._by_plan: IdentityMemo[dict[int, list[pb.Slot]]] = IdentityMemo(keep)

    def get(self, plan: SavePlan, rank: int) -> list[pb.Slot]:
        by_rank = self._by_plan.get((plan,), dict)
        if rank not in by_rank:
            by_rank[rank] = [slot_pb(s, plan.tensor(s.name)) for s in plan.slots_of(rank)]
        return by_rank[rank]


def slot_pb(slot: FragmentSlot, tensor: LogicalTensor) -> pb.Slot:
    """A slot and the logical tensor it was planned for (the client checks it against its own)."""
    return pb.Slot(
        name=slot.name, offset=slot.offset, nbytes=slot.nbytes, box=box_pb(slot.box),
        kind=tensor.kind, dtype=tensor.dtype, shape=tensor.shape, aliases=tensor.aliases,
    )


class ShmPieces:
    """Piece messages of the daemon's memory tier, by value: the same snapshot is served to a
    rank's every load from memory, so each message is built once. Forgets all at `keep`."""

    def __init__(self, keep: int = 200_000) -> None:
        self._keep = keep
        self._pieces: dict["PieceInfo", pb.Piece] = {}

    def get(self, info: "PieceInfo") -> pb.Piece:
        piece = self._pieces.get(info)
        if piece is None:
            if len(self._pieces) >= self._keep:
                self._pieces.clear()
            piece = self._pieces[info] = piece_pb(info)
        return piece


def memory_columns(pieces: Sequence["PieceInfo"], wanted: Sequence[TensorSpec]) -> pb.MemoryColumns | None:
    """The plan as MemoryColumns, one entry per wanted spec in its order, when every spec is one
    whole fragment in an arena of its dtype (or has no bytes: an empty tensor has no piece) and
    every piece is one spec's; else None (the pieces are sent). A pure function:
    tests/daemon/test_rpc_convert.py."""
    by_name: dict[str, "PieceInfo"] = {}
    for p in pieces:
        if p.source != SHM_SOURCE or p.decode is not None or p.name in by_name:
            return None
        by_name[p.name] = p
    paths: dict[str, int] = {}
    files, offsets, sizes = [], [], []
    used = 0
    for spec in wanted:
        p = by_name.get(spec.name)
        if p is None and spec.nbytes == 0:
            files.append(0)
            offsets.append(0)
            sizes.append(0)
            continue
        if p is None or p.fragment != spec.box or p.dtype != spec.dtype or p.nbytes != spec.nbytes:
            return None
        used += 1
        files.append(paths.setdefault(p.path, len(paths)))
        offsets.append(p.offset)
        sizes.append(p.nbytes)
    if used != len(by_name):
        return None
    return pb.MemoryColumns(paths=list(paths), file=files, offset=offsets, nbytes=sizes)


class MemoryColumnsMessages:
    """MemoryColumns of the plans served from memory, built once per (pieces, wanted specs): a
    rank's every load of the same snapshot in the same layout gets the same answer (the daemon
    keeps both objects while they hold: MemoryPlans, the rank's resolved specs). Holds the last `keep`."""

    def __init__(self, keep: int = 16) -> None:
        self._memo: IdentityMemo[pb.MemoryColumns | None] = IdentityMemo(keep)

    def get(self, plan: "LoadPlan", wanted: Sequence[TensorSpec]) -> pb.MemoryColumns | None:
        return self._memo.get((plan.pieces, wanted), lambda: memory_columns(plan.pieces, wanted))


def begin_response(session: "SaveSession", rank: int, known_layout: str, slots: SlotMessages) -> pb.BeginSaveResponse:
    """The answer to BeginSave: committed already (kept), skipped, or the rank's arena and (unless
    it knows the layout) slots."""
    if session.kept:
        return pb.BeginSaveResponse(save_id=session.save_id, committed=True, skip_reason=session.kept)
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
        reply.slots.extend(slots.get(session.plan, rank))
    return reply


def staged_ranges(ranges: Iterable[pb.StagedRange]) -> list[StagedRange]:
    return [StagedRange(r.staging_offset, r.arena_offset, r.nbytes) for r in ranges]


def progress_pb(session: "SaveSession") -> pb.SaveProgress:
    return pb.SaveProgress(
        state=session.state,
        bytes_total=session.bytes_total,
        bytes_written=session.progress.written if session.progress else 0,
        bytes_linked=session.progress.linked if session.progress else 0,
        done=session.finished.is_set(),
        error=session.error or session.skip_reason or "",
        step_dir=session.step_dir,
    )


def committed_pb(step_dir: str) -> pb.SaveProgress:
    """The last progress message of a save whose step is committed."""
    return pb.SaveProgress(state="committed", done=True, step_dir=step_dir)


def plan_load_response(plan: "LoadPlan", pieces: Sequence[pb.Piece], columns: pb.MemoryColumns | None = None) -> pb.PlanLoadResponse:
    return pb.PlanLoadResponse(
        load_id=plan.load_id, step=plan.step, pieces=pieces, extras_json=plan.extras_json or json.dumps(plan.extras),
        missing=plan.missing, unexpected=plan.unexpected, tier=plan.tier, generation=plan.generation, plan_id=plan.plan_id,
        columns=columns,
    )


def checkpoint_info_pb(summary: StepSummary, path: str, in_memory: bool) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        step=summary.step, created_at=summary.created_at, size_bytes=summary.size_bytes,
        file_count=summary.file_count, path=path, in_memory=in_memory,
        metric=summary.metric or 0.0, has_metric=summary.metric is not None,
    )


def status_pb(status: StatusSnapshot) -> pb.StatusResponse:
    return pb.StatusResponse(
        version=status.version, root=status.root,
        in_flight=[
            pb.InFlight(
                job=f.job, step=f.step, state=f.state, bytes_total=f.bytes_total, bytes_written=f.bytes_written, age_s=f.age_s,
                ranks_arrived=f.ranks_arrived, ranks_expected=f.ranks_expected, write_s=f.write_s, bytes_linked=f.bytes_linked,
            )
            for f in status.in_flight
        ],
        arena_bytes=status.arena_bytes, arena_count=status.arena_count,
        committed_total=status.committed_total, failed_total=status.failed_total,
        skipped_total=status.skipped_total, last_error=status.last_error, draining=status.draining,
        queue_depth=status.queue_depth, node_rank=status.node_rank, nodes=status.nodes,
        bytes_written_total=status.bytes_written_total, uptime_s=status.uptime_s, loads_active=status.loads_active,
        last_commit=_last_commit_pb(status.last_commit), remote=_remote_pb(status.remote), replicas=_replicas_pb(status.replicas),
        link_mismatches_total=status.link_mismatches_total,
        arena_holders=[
            pb.ArenaHolder(
                job=h.job, bytes=h.bytes, sets=h.sets, held_steps=h.held_steps, in_flight=h.in_flight, readers=h.readers, idle_s=h.idle_s
            )
            for h in status.arena_holders
        ],
        shm_budget=status.shm_budget, shm_free=status.shm_free, shm_staging=status.shm_staging,
    )


def _replicas_pb(record: ReplicaStatus | None) -> pb.ReplicaStatus | None:
    if record is None:
        return None
    return pb.ReplicaStatus(
        held_bytes=record.held_bytes, memory_limit=record.memory_limit,
        held=[pb.HeldReplica(job=job, node=node, step=step, bytes=nbytes) for job, node, step, nbytes in record.held],
        jobs=[pb.JobReplicas(**{f.name: getattr(j, f.name) for f in dataclass_fields(j)}) for j in record.jobs],
        bulk_port=pb.BulkPort(**{f.name: getattr(record.bulk_port, f.name) for f in dataclass_fields(record.bulk_port)}) if record.bulk_port else None,
    )


def _remote_pb(record: RemoteStatus | None) -> pb.RemoteStatus | None:
    if record is None:
        return None
    return pb.RemoteStatus(**{f.name: getattr(record, f.name) for f in dataclass_fields(record)})


def _last_commit_pb(record: LastCommit | None) -> pb.LastCommit | None:
    if record is None:
        return None
    return pb.LastCommit(
        job=record.job, step=record.step, committed_at=record.committed_at, latency_s=record.latency_s,
        bytes=record.bytes, step_dir=record.step_dir,
    )


def removed_pb(removed: Iterable[Any]) -> list[pb.Removed]:
    """Removed messages from service.collect's records (job, step, path, reason, bytes)."""
    return [pb.Removed(job=r.job, step=r.step, path=r.path, reason=r.reason, bytes=r.bytes) for r in removed]


# ------------------------------------------------------------------ Peer service


def meta_of(spec: TensorSpec) -> pb.TensorMeta:
    return pb.TensorMeta(
        name=spec.name, kind=spec.kind, dtype=spec.dtype, shape=spec.shape, box=box_pb(spec.box), aliases=spec.aliases, frozen=spec.frozen,
        per_rank=spec.per_rank,
    )


def join_request(request: JoinSave, node: int, root_id: str) -> ppb.JoinSaveRequest:
    """A node's JoinSave message (`root_id`: its storage root's id)."""
    specs, options, claim = request.specs, request.options, request.claim
    return ppb.JoinSaveRequest(
        job=request.job, step=request.step, node=node, world_size=request.world_size, fingerprints=request.fingerprints,
        tensors=[ppb.RankTensors(rank=r, fingerprint=request.fingerprints[r], tensors=[meta_of(s) for s in specs[r]]) for r in sorted(specs)],
        known_plans=list(request.known_plans), timeout_s=request.timeout_s, metric=request.metric or 0.0, has_metric=request.metric is not None,
        root_id=root_id, quantize=options.quantize or "", master_weights=options.master_weights or "",
        no_quantize=options.no_quantize, lineage=request.lineage, run_id=claim.run, resumed=claim.resumed,
        retention=retention_message(options.retention),
    )


def retention_message(retention: JobRetention | None) -> pb.Retention | None:
    """A job's retention request as the wire carries it (None: the field stays unset)."""
    if retention is None:
        return None
    return pb.Retention(keep_last=retention.keep_last, keep_best=retention.keep_best, best_mode=retention.best_mode or "")


def compression_pb(compression: Compression | None) -> ppb.Compression | None:
    if compression is None:
        return None
    return ppb.Compression(
        quantize=compression.quantize or "", master_weights=compression.master_weights,
        recorded=compression.recorded, generation=compression.generation,
    )


def compression_of(message: ppb.Compression) -> Compression:
    """The coordinator's decision (validated: InvalidRequest for a scheme or mode this node does not know)."""
    try:
        quantize = check_scheme(message.quantize or None)
        master = check_master_mode(message.master_weights) or "keep"
    except ValueError as exc:
        raise InvalidRequest(f"the coordinator decided a compression this node cannot write: {exc}") from None
    return Compression(quantize, master, max(0, message.generation), message.recorded)


def join_response(result: JoinResult) -> ppb.JoinSaveResponse:
    """The answer to a joining node. Every rank's metadata and node, unless the node knows the
    plan (the plan key covers both: the answer is then the same few fields at any scale); a
    rank whose fingerprint an earlier rank has (a data-parallel replica) is sent as that
    fingerprint alone, so the answer grows with the distinct layouts and the ranks, not with
    their product."""
    tensors = []
    node_of_rank: dict[int, int] = {}
    if result.specs is not None:
        node_of_rank = dict(enumerate(result.node_of_rank))
        sent: set[str] = set()
        for rank, rank_specs in enumerate(result.specs):
            fingerprint = result.fingerprints[rank] if result.fingerprints else ""
            if fingerprint and fingerprint in sent:
                tensors.append(ppb.RankTensors(rank=rank, fingerprint=fingerprint))
                continue
            if fingerprint:
                sent.add(fingerprint)
            tensors.append(ppb.RankTensors(rank=rank, fingerprint=fingerprint, tensors=[meta_of(s) for s in rank_specs]))
    return ppb.JoinSaveResponse(
        save_id=result.save_id, plan_key=result.plan_key, node_of_rank=node_of_rank,
        tensors=tensors, shared_root=result.shared_root, compression=compression_pb(result.compression),
    )


def join_result_of(reply: ppb.JoinSaveResponse, world_size: int) -> JoinResult:
    """The coordinator's answer as a record; its metadata is validated like a rank's (InvalidRequest),
    and Aborted when it does not cover every rank or their nodes. The caller checks the metadata
    against its digests (plan_input.check_plan_input). Ranks of one fingerprint get one object
    of metadata (the planner describes it once: plan.make_save_plan). An answer without
    metadata (the plan was known) has no nodes either (JoinResult.node_of_rank empty)."""
    specs_out = None
    digests: tuple[str, ...] = ()
    node_of_rank: tuple[int, ...] = ()
    if reply.tensors:
        by_rank: dict[int, tuple[TensorSpec, ...]] = {}
        digest_of: dict[int, str] = {}
        by_fingerprint: dict[str, tuple[TensorSpec, ...]] = {}
        for t in reply.tensors:  # a rank sent as a digest alone has the metadata of the first rank with it
            rank, fingerprint = t.rank, t.fingerprint
            digest_of[rank] = fingerprint
            shared = by_fingerprint.get(fingerprint) if fingerprint else None
            if shared is not None and not t.tensors:
                by_rank[rank] = shared
                continue
            by_rank[rank] = tuple(tensor_specs(t.tensors))
            if fingerprint:
                by_fingerprint.setdefault(fingerprint, by_rank[rank])
        if len(by_rank) != world_size or not all(map(by_rank.__contains__, range(world_size))):
            raise Aborted(f"the coordinator sent metadata for ranks {listed(sorted(by_rank))}, expected 0..{world_size - 1}")
        specs_out = tuple(map(by_rank.__getitem__, range(world_size)))
        digests = tuple(map(digest_of.__getitem__, range(world_size)))
        nodes = dict(reply.node_of_rank)
        if len(nodes) != world_size or not all(map(nodes.__contains__, range(world_size))):
            raise Aborted(f"the coordinator sent the nodes of {len(nodes)} ranks, expected every rank of 0..{world_size - 1}")
        node_of_rank = tuple(map(nodes.__getitem__, range(world_size)))
    compression = compression_of(reply.compression) if reply.HasField("compression") else None
    return JoinResult(reply.save_id, reply.plan_key, node_of_rank, specs_out, reply.shared_root, compression, fingerprints=digests)


def manifest_to_wire(manifest: NodeManifest) -> tuple[list[ppb.FileEntry], list[ppb.StoredFragment]]:
    files = [ppb.FileEntry(name=f.name, size=f.size, checksum=f.checksum) for f in manifest.files]
    fragments = [
        ppb.StoredFragment(
            name=name, file=f.file, key=f.key, box=box_pb(f.box),
            dtype=f.dtype, offset=f.offset, nbytes=f.nbytes, checksum=f.checksum,
            chunk_bytes=f.chunk_bytes, chunk_xxh3=f.chunk_xxh3,
            quant_json=json.dumps(f.quant.to_json()) if f.quant is not None else "",
        )
        for name, f in manifest.fragments
    ]
    return files, fragments


def manifest_from_wire(node: int, files: Sequence[ppb.FileEntry], fragments: Sequence[ppb.StoredFragment]) -> NodeManifest:
    """Raises InvalidRequest for malformed quantization records (their JSON depth is checked
    before, by checks.parse_json)."""
    try:
        records = tuple(
            (
                f.name,
                FragmentRecord(
                    f.file, f.key, Box(tuple(f.box.offsets), tuple(f.box.lengths)), f.dtype, f.offset, f.nbytes, f.checksum,
                    f.chunk_bytes, f.chunk_xxh3,
                    QuantRecord.from_json(json_read.loads(f.quant_json)) if f.quant_json else None,
                ),
            )
            for f in fragments
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidRequest(f"node {node}'s manifest has a malformed quantization record: {exc}") from None
    return NodeManifest(node, tuple(FileRecord(f.name, f.size, f.checksum, node) for f in files), records)


def report_request(request: ReportManifest, node: int) -> ppb.ReportManifestRequest:
    """A node's ReportManifest message: extras as JSON text, model files as UTF-8 text."""
    manifest = request.manifest
    files, fragments = manifest_to_wire(manifest) if manifest is not None else ([], [])
    return ppb.ReportManifestRequest(
        job=request.job, step=request.step, save_id=request.save_id, node=node, ok=manifest is not None, error=request.error,
        files=files, fragments=fragments, extras_json={r: json.dumps(e) for r, e in request.extras.items()},
        model_files={k: v.decode() for k, v in request.model_files.items()},
    )


def report_response(outcome: Outcome) -> ppb.ReportManifestResponse:
    return ppb.ReportManifestResponse(committed=outcome.committed, error=outcome.error, step_files=outcome.step_files)


def outcome_of(reply: ppb.ReportManifestResponse) -> Outcome:
    return Outcome(reply.committed, reply.error, dict(reply.step_files))


def inventory_response(inventory: PeerInventory) -> ppb.InventoryResponse:
    files = [ppb.FileEntry(name=name, size=size) for name, size in inventory.sizes.items()]
    replicas = [ppb.ReplicaFile(node=node, name=name, size=size) for node, name, size in inventory.replicas]
    newest = -1 if inventory.newest is None else inventory.newest
    return ppb.InventoryResponse(
        root_id=inventory.root_id, committed=inventory.committed, files=files, in_flight=inventory.in_flight, replicas=replicas, newest_step=newest,
        loading=inventory.loading,
    )


def inventory_of(reply: ppb.InventoryResponse) -> PeerInventory:
    replicas = tuple((r.node, r.name, r.size) for r in reply.replicas)
    newest = reply.newest_step if reply.newest_step >= 0 else None
    return PeerInventory(
        reply.root_id, reply.committed, {f.name: f.size for f in reply.files}, reply.in_flight, replicas=replicas, newest=newest, loading=reply.loading
    )


def bulk_ticket(answer: BulkAnswer) -> ppb.BulkTicket:
    return ppb.BulkTicket(accepted=answer.accepted, reason=answer.reason, held=answer.held, port=answer.port, ticket=answer.ticket)


def bulk_answer_of(reply: ppb.BulkTicket) -> BulkAnswer:
    return BulkAnswer(reply.accepted, reply.reason, reply.held, reply.port, reply.ticket)


def offer_request(job: str, step: int, node: int, files: Sequence[FileRecord], units: Mapping[str, Sequence[Unit]]) -> ppb.OfferReplicaRequest:
    entries = [ppb.FileEntry(name=f.name, size=f.size, checksum=f.checksum) for f in files]
    checks = [
        ppb.FileUnits(name=f.name, units=[ppb.ChecksumUnit(offset=u.offset, nbytes=u.nbytes, xxh3=u.xxh3) for u in units[f.name]])
        for f in files
    ]
    return ppb.OfferReplicaRequest(job=job, step=step, node=node, files=entries, units=checks)
