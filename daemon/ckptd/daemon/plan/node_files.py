"""One node's data files of a save, planned before a byte is written (DCP's WriteItem list):
which files the node writes, what each holds and where (header bytes or the room reserved for
them, every stored tensor's offset, the arena runs its bytes come from, how it is coded), the
files that may be linked from the previous step instead (incremental saves), and the bytes the
free-space check counts.

Pure: made from the save plan, the save's compression options and the previous step's index;
no arena is opened, nothing is read or written. write/writer.py executes a NodeFilePlan,
write/reuse.py hashes its link candidates' bytes in the arenas.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import xxhash

from ckptd.common import dtypes
from ckptd.common.boxes import Box, contiguous_runs
from ckptd.common.chunks import checksum_name
from ckptd.common.codecs import codec_for
from ckptd.format.index import (
    CheckpointIndex,
    FileLayout,
    FileRecord,
    FragmentRecord,
    StoredTensor,
    layout_files,
    scales_key,
)
from ckptd.format.safetensors_header import HEADER_ALIGN, safetensors_header
from ckptd.daemon.plan.files import Coding, stored_tensors
from ckptd.daemon.plan.save_plan import FragmentSlot, LogicalTensor, SavePlan


@dataclass(frozen=True)
class ArenaRun:
    """A contiguous run of a stored tensor's snapshot bytes: `nbytes` from arena `rank` at byte
    `src`, to byte `dst` of the tensor's values (row-major over its box)."""

    rank: int
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class TensorBytes:
    """Where a stored tensor's snapshot values are: `runs` in the arenas, in the order of the
    values (by `dst`); `dtype` the logical tensor's, `shape` its box's lengths."""

    dtype: str
    shape: tuple[int, ...]
    runs: tuple[ArenaRun, ...]

    @property
    def nbytes(self) -> int:
        """The snapshot's bytes of the tensor, whatever it is stored as: what Progress counts."""
        return dtypes.nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class FileItem:
    """A stored tensor written at a known place: `tensor` at absolute byte `offset` of its file,
    made from `values`; as they are, or (`coding` with a model weight) as the bf16 residual of
    master weight `values` to its model weight `twin`."""

    tensor: StoredTensor
    offset: int
    values: TensorBytes
    coding: Coding | None = None
    twin: TensorBytes | None = None


@dataclass(frozen=True)
class AppendedItem:
    """A quantized tensor: its codes (`tensor`, at their uncompressed shape) and scales, coded
    from `values` by `coding.codec` and placed at the end of its file once coded (their size is
    known only then); stored as `values` as they are when they cannot be quantized."""

    tensor: StoredTensor
    values: TensorBytes
    coding: Coding


@dataclass(frozen=True)
class FilePlan:
    """One data file this node writes.

    `header`: the safetensors header of the `fixed` items; the whole file's when nothing is
    appended, written at byte 0 and recorded as `record`. With `appended` items the real header
    is made once they are placed, written last into `room` bytes reserved for it (header_room),
    and `record` is None (the file's size and checksum are known only then). The file is opened
    at `room + nbytes` bytes (coded tensors counted at their uncompressed size) and may grow to
    `bound` (file_bytes_bound)."""

    name: str
    node: int
    nbytes: int
    header: bytes
    room: int
    fixed: tuple[FileItem, ...]
    appended: tuple[AppendedItem, ...]
    record: FileRecord | None
    bound: int

    @property
    def appended_from(self) -> int:
        """The byte where the appended items start: after the header room and the fixed items."""
        return self.room + sum(item.tensor.nbytes for item in self.fixed)

    @property
    def snapshot_bytes(self) -> int:
        """The snapshot's bytes the file holds (logical dtypes): what Progress counts for it."""
        return sum(item.values.nbytes for item in self.fixed) + sum(item.values.nbytes for item in self.appended)


@dataclass(frozen=True)
class LinkCandidate:
    """A file of frozen, uncoded tensors whose header is that of `previous`, a data file of the
    job's previous step (same size and header checksum: the same keys, dtypes, shapes and
    offsets), and whose tensors have the same places as there: linked instead of written when
    each of `file.fixed` still has the bytes of its fragment in `expected` (write/reuse.py)."""

    file: FilePlan
    previous: FileRecord
    expected: tuple[FragmentRecord, ...]  # one per item of file.fixed, in that order


@dataclass(frozen=True)
class FileSpace:
    """A file as the free-space check counts it: laid-out bytes `nbytes` (its order among the
    files that take recycled ones, largest first) and `bound`, the most it can take on disk."""

    name: str
    nbytes: int
    bound: int


@dataclass(frozen=True)
class NodeFilePlan:
    """What node `node` writes of a save.

    files: its data files, largest first (they take the largest recycled files).
    space: the files the free-space check counts: this node's, or, in a step directory shared
    by the nodes, every node's (they all take the same free space at once).
    candidates: those of `files` that may be linked from the previous step.
    codings: how this node's coded tensors are made, by (name, box): for the index records.
    cast: every node's dropped master weights: name -> the stored model tensor standing for it.
    dropped_bytes: the snapshot bytes of this node's dropped master weights (counted as written).
    """

    node: int
    files: tuple[FilePlan, ...]
    space: tuple[FileSpace, ...]
    candidates: tuple[LinkCandidate, ...]
    codings: Mapping[tuple[str, Box], Coding]
    cast: Mapping[str, StoredTensor]
    dropped_bytes: int


def plan_node_files(
    plan: SavePlan, node: int, max_file_bytes: int, *, quantize: str | None = None, master_weights: str = "keep",
    shared_dir: bool = False, previous: CheckpointIndex | None = None,
) -> NodeFilePlan:
    """The files node `node` writes of `plan`: stored tensors (plan/files.stored_tensors), coded
    as `quantize` and `master_weights` say (compressed_tensors), laid out in files of at most
    `max_file_bytes` (format.layout_files: every node lays out the same files, frozen tensors in
    files of their own), each file's header and offsets; link candidates from `previous` (the
    job's newest committed step), only when the plan has frozen tensors."""
    tensors = {t.name: t for t in plan.tensors}
    kinds = {t.name: t.kind for t in plan.tensors}
    uncoded = stored_tensors(plan)
    stored, codings, cast = compressed_tensors(uncoded, tensors, node, quantize, master_weights)
    frozen = frozen_names(plan.tensors)
    every_node = layout_files(stored, kinds, max_file_bytes, frozen)
    layouts = sorted((f for f in every_node if f.node == node), key=lambda f: -f.nbytes)
    values = _Snapshot(plan)
    files = tuple(_file_plan(layout, tensors, codings, values) for layout in layouts)
    bound = {f.name: f.bound for f in files}
    space = tuple(
        FileSpace(f.name, f.nbytes, bound[f.name] if f.name in bound else file_bytes_bound(f, tensors))
        for f in (every_node if shared_dir else layouts)
    )
    dropped = sum(t.nbytes for t in uncoded if t.name in cast and t.node == node)
    return with_link_candidates(NodeFilePlan(node, files, space, (), codings, cast, dropped), plan, previous, shared_dir)


def with_link_candidates(files: NodeFilePlan, plan: SavePlan, previous: CheckpointIndex | None, shared_dir: bool) -> NodeFilePlan:
    """`files` (planned from `plan`) with their link candidates from `previous` (link_candidates),
    only when the plan has frozen tensors; none without a previous step."""
    frozen = frozen_names(plan.tensors)
    candidates = link_candidates(files.files, frozen, previous, files.node, shared_dir) if previous is not None and frozen else ()
    return replace(files, candidates=candidates)


class NodeFilePlans:
    """The node file plan last made for each of the `jobs` jobs planned most recently, made
    again only when its inputs change. A job saves with the same SavePlan object step after
    step (the coordinator's plan cache), and planning its files costs ~25 us per tensor (0.1 s
    of the daemon's CPU per save at 4,000 tensors). The link candidates depend on the previous
    step: found again at each save (with_link_candidates). One thread's (the engine's writer)."""

    def __init__(self, jobs: int = 16) -> None:
        self.jobs = jobs
        self._last: OrderedDict[str, tuple[SavePlan, tuple[Any, ...], NodeFilePlan]] = OrderedDict()

    def plan(
        self, job: str, plan: SavePlan, node: int, max_file_bytes: int, *, quantize: str | None = None, master_weights: str = "keep",
        shared_dir: bool = False, previous: CheckpointIndex | None = None,
    ) -> NodeFilePlan:
        """plan_node_files(plan, node, max_file_bytes, ...) for a save of `job`."""
        inputs = (node, max_file_bytes, quantize, master_weights, shared_dir)
        last = self._last.get(job)
        if last is not None and last[0] is plan and last[1] == inputs:
            files = last[2]
            self._last.move_to_end(job)
        else:
            files = plan_node_files(plan, node, max_file_bytes, quantize=quantize, master_weights=master_weights, shared_dir=shared_dir)
            self._last[job] = (plan, inputs, files)
            self._last.move_to_end(job)
            while len(self._last) > self.jobs:
                self._last.popitem(last=False)
        return with_link_candidates(files, plan, previous, shared_dir)


def compressed_tensors(
    stored: list[StoredTensor], tensors: Mapping[str, LogicalTensor], node: int, quantize: str | None, master_weights: str
) -> tuple[list[StoredTensor], dict[tuple[str, Box], Coding], dict[str, StoredTensor]]:
    """How each of `stored` is compressed (`quantize`: a scheme of ckptd.common.codecs;
    `master_weights`: "keep" | "drop" | "residual").

    Returns the tensors to lay out (codes, scales and residuals with their stored dtypes and
    the shapes of uncompressed codes, for every node's tensors: all nodes lay out the same
    files), how node `node`'s coded tensors are made, by (name, box), and the dropped master
    weights (name -> the stored model tensor whose bytes stand for it). A tensor that cannot be
    quantized (inf/nan, a negative second moment) is found when it is coded and stored as it is.
    """
    if quantize is None and master_weights == "keep":
        return stored, {}, {}
    whole_model = {t.name: t for t in stored if tensors[t.name].kind == "model" and t.box == Box.full(tensors[t.name].shape)}
    out: list[StoredTensor] = []
    codings: dict[tuple[str, Box], Coding] = {}
    cast: dict[str, StoredTensor] = {}
    for t in stored:
        logical = tensors[t.name]
        codec = codec_for(quantize, t.name, logical.kind, logical.dtype, logical.shape)
        model = model_twin(t, logical, tensors, whole_model) if logical.kind == "master" and master_weights != "keep" else None
        if codec is not None:
            out.append(StoredTensor(t.name, t.key, codec.codes_dtype, codec.codes_shape(t.box.lengths), t.box, t.node))
            out.append(StoredTensor(t.name, scales_key(t.key), "F32", codec.scales_shape(t.box), t.box, t.node, role="scales"))
            if t.node == node:
                codings[(t.name, t.box)] = Coding(codec=codec)
        elif model is not None and master_weights == "drop":
            cast[t.name] = model
        elif model is not None:
            out.append(StoredTensor(t.name, t.key, "BF16", t.shape, t.box, t.node))
            if t.node == node:
                codings[(t.name, t.box)] = Coding(model=model)
        else:
            out.append(t)
    return out, codings, cast


def model_twin(
    t: StoredTensor, logical: LogicalTensor, tensors: Mapping[str, LogicalTensor], whole_model: Mapping[str, StoredTensor]
) -> StoredTensor | None:
    """The stored model weight a whole fp32 master weight can be rebuilt from: "model/<fqn>" for
    "master/<fqn>", stored whole by the same node, of the same shape in bf16 or fp16. None
    otherwise (the master weight is then kept)."""
    if logical.dtype != "F32" or t.box != Box.full(logical.shape):
        return None
    model = whole_model.get("model/" + t.name.split("/", 1)[1])
    if model is None or model.node != t.node:
        return None
    twin = tensors[model.name]
    if twin.dtype not in ("BF16", "F16") or twin.shape != logical.shape:
        return None
    return model


def frozen_names(tensors: Sequence[LogicalTensor]) -> dict[str, str]:
    """{logical name: frozen class} of a plan's tensors that the trainer does not train. Buffers
    count only beside frozen parameters: a model that trains all its parameters keeps the file
    layout it always had (its buffers are small, and often change: running statistics)."""
    frozen = {t.name: t.frozen for t in tensors if t.frozen}
    return frozen if "param" in frozen.values() else {}


def link_candidates(
    files: Sequence[FilePlan], frozen: Mapping[str, str], previous: CheckpointIndex, node: int, shared_dir: bool
) -> tuple[LinkCandidate, ...]:
    """The files of `files` made only of frozen, uncoded tensors whose header is that of a data
    file of `previous` and whose every tensor is a lossless fragment there at the same offset,
    of the same size, box and dtype. A previous file qualifies when node `node` wrote it, or any
    node did in a shared directory (where every node's files are in the one step directory)."""
    by_content: dict[tuple[int, str], FileRecord] = {}
    for f in previous.files:
        if f.name.endswith(".safetensors") and (shared_dir or f.node == node):
            by_content.setdefault((f.size, f.checksum), f)
    fragments = {(frag.file, frag.key): frag for t in previous.tensors for frag in t.fragments}
    found = []
    for file in files:
        if file.record is None or not file.fixed:
            continue
        if any(item.coding is not None or not frozen.get(item.tensor.name) for item in file.fixed):
            continue
        match = by_content.get((file.record.size, file.record.checksum))
        if match is None:
            continue
        expected = [fragments.get((match.name, item.tensor.key)) for item in file.fixed]
        if all(_same_place(item, before) for item, before in zip(file.fixed, expected)):
            found.append(LinkCandidate(file, match, tuple(b for b in expected if b is not None)))
    return tuple(found)


def _same_place(item: FileItem, before: FragmentRecord | None) -> bool:
    t = item.tensor
    return before is not None and before.quant is None and (before.offset, before.nbytes, before.box, before.dtype) == (item.offset, t.nbytes, t.box, t.dtype)


def placed_when_coded(t: StoredTensor, codings: Mapping[tuple[str, Box], Coding]) -> bool:
    """Whether `t` (codes or scales of a quantized tensor) is placed once coded; scales are
    written beside their codes (layout_files keeps both in one file)."""
    coding = codings.get((t.name, t.box))
    return coding is not None and coding.codec is not None


def scales_shapes(layout: FileLayout) -> dict[tuple[str, Box], tuple[int, ...]]:
    """The shapes of the scales of the file's quantized tensors, by (name, box) of their codes."""
    return {(t.name, t.box): t.shape for t in layout.tensors if t.role == "scales"}


def header_room(
    fixed: Sequence[StoredTensor], late: Sequence[StoredTensor], tensors: Mapping[str, LogicalTensor],
    scales_shapes: Mapping[tuple[str, Box], tuple[int, ...]],
) -> int:
    """Bytes to reserve for the header of a file whose `late` tensors (codes) are placed, with
    their scales, once coded.

    The header is measured as if every quantized tensor fell back to its values as they are
    (its logical dtype and shape: more bytes than its codes, so larger offsets, a dtype name at
    least as long, a shape whose digits outnumber the coded size's) and its scales stayed: the
    real header is never longer."""
    bound = [(t.key, t.dtype, t.shape) for t in fixed]
    for t in late:
        bound.append((t.key, tensors[t.name].dtype, t.box.lengths))
        bound.append((scales_key(t.key), "F32", scales_shapes[(t.name, t.box)]))
    header, _ = safetensors_header(bound)
    return len(header) + HEADER_ALIGN * 2 * len(late)  # spare room: a compressed size can exceed its codes by a few bytes


def file_bytes_bound(layout: FileLayout, tensors: Mapping[str, LogicalTensor]) -> int:
    """The most bytes the file of `layout` can take once written, header included.

    Exact for a file of tensors of known size (values, bf16 residuals). A quantized tensor's
    size is known only once it is coded (int4 codes are zstd-compressed; a tensor that cannot
    be quantized is stored as its values instead), so each counts as its values as they are
    (logical dtype over its box) plus its scales, and the header as header_room reserves it.
    Only floating point values (2 bytes or more each) are quantized, to codes of 1 or 1/2 byte
    per value; zstd adds under 1% to incompressible int4 codes, and a few bytes of framing that
    can outgrow the values only for a fragment of a handful of values (the reserve covers that)."""
    shapes = scales_shapes(layout)
    if not shapes:
        header, _ = safetensors_header((t.key, t.dtype, t.shape) for t in layout.tensors)
        return len(header) + layout.nbytes
    coded = [t for t in layout.tensors if (t.name, t.box) in shapes]
    fixed = [t for t in layout.tensors if (t.name, t.box) not in shapes]
    late = [t for t in coded if t.role == "data"]
    values = sum(dtypes.nbytes(tensors[t.name].dtype, t.box.lengths) for t in late)
    scales = sum(t.nbytes for t in coded if t.role == "scales")
    return header_room(fixed, late, tensors, shapes) + sum(t.nbytes for t in fixed) + values + scales


def arena_runs(tensor_shape: tuple[int, ...], itemsize: int, slots: Sequence[FragmentSlot]) -> list[ArenaRun]:
    """The runs that assemble a whole tensor from its fragments' slots, in the order of its values."""
    runs = []
    for slot in slots:
        for dst, src, n in contiguous_runs(slot.box, tensor_shape):
            runs.append(ArenaRun(slot.rank, slot.offset + src * itemsize, dst * itemsize, n * itemsize))
    runs.sort(key=lambda r: r.dst)
    return runs


class _Snapshot:
    """Where a plan's stored tensors are in the arenas (its slots), by logical name and box."""

    def __init__(self, plan: SavePlan) -> None:
        self.tensors = {t.name: t for t in plan.tensors}
        self.slots_by_name: dict[str, list[FragmentSlot]] = {}
        for slot in plan.slots:
            self.slots_by_name.setdefault(slot.name, []).append(slot)
        self.slot_of = {(s.name, s.box): s for s in plan.slots}

    def values(self, t: StoredTensor) -> TensorBytes:
        """A whole tensor's runs over its fragments' slots; a fragment stored on its own: one
        run, its slot."""
        logical = self.tensors[t.name]
        if t.box == Box.full(logical.shape):
            runs = arena_runs(t.box.lengths, dtypes.itemsize(logical.dtype), self.slots_by_name[t.name])
        else:
            slot = self.slot_of[(t.name, t.box)]
            runs = [ArenaRun(slot.rank, slot.offset, 0, slot.nbytes)]
        return TensorBytes(logical.dtype, t.box.lengths, tuple(runs))


def _file_plan(layout: FileLayout, tensors: Mapping[str, LogicalTensor], codings: Mapping[tuple[str, Box], Coding], snapshot: _Snapshot) -> FilePlan:
    fixed = [t for t in layout.tensors if not placed_when_coded(t, codings)]
    late = [t for t in layout.tensors if placed_when_coded(t, codings) and t.role == "data"]
    header, entries = safetensors_header((t.key, t.dtype, t.shape) for t in fixed)
    room = header_room(fixed, late, tensors, scales_shapes(layout)) if late else len(header)
    items = []
    for t, entry in zip(fixed, entries):
        coding = codings.get((t.name, t.box))
        twin = snapshot.values(coding.model) if coding is not None and coding.model is not None else None
        items.append(FileItem(t, room + entry.begin, snapshot.values(t), coding, twin))
    appended = tuple(AppendedItem(t, snapshot.values(t), codings[(t.name, t.box)]) for t in late)
    record = None if late else FileRecord(layout.name, len(header) + layout.nbytes, checksum_name(xxhash.xxh3_64_intdigest(header)), layout.node)
    bound = file_bytes_bound(layout, tensors) if late else len(header) + layout.nbytes  # the same, without a second header
    return FilePlan(layout.name, layout.node, layout.nbytes, header, room, tuple(items), appended, record, bound)
