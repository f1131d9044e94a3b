"""What a step's files hold, pure: the stored tensors of a plan, the index records of what the
writer placed, and the small files (HF indexes, extra.json, ckptd.index.json) that commit a
step. One node's data files are planned in plan/node_files.py. No I/O: write/writer.py executes.
"""

from __future__ import annotations

import json
import math
import platform
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import xxhash

from ckptd.common.boxes import Box
from ckptd.common.chunks import checksum_name, chunk_bytes_for
from ckptd.common.frames import Frames
from ckptd.common.quant_options import CAST, RESIDUAL
from ckptd.format.index import (
    ADAPTER_WEIGHTS,
    ENVIRONMENT_JSON,
    EXTRA_JSON,
    INDEX_NAME,
    CheckpointIndex,
    FileRecord,
    FragmentRecord,
    QuantRecord,
    SideRecord,
    StoredTensor,
    extra_json,
    file_key,
    fragment_key,
)
from ckptd.format.json_text import compact_json
from ckptd.daemon.plan.index_layout import IncompleteStep as IncompleteStep  # raised by step_files; callers import it from here
from ckptd.daemon.plan.index_layout import IndexLayouts
from ckptd.daemon.plan.save_plan import SavePlan, StoredPart

VERSION = "0.1.0"
COMMIT_TIME_STEP_S = 0.001  # a commit after its job's newest by at least this, when the clock reads earlier (commit_time)


@dataclass(frozen=True)
class NodeManifest:
    """What one node wrote of a step: its data files (fsynced, renamed) and where each stored
    tensor or fragment is in them."""

    node: int
    files: tuple[FileRecord, ...]
    fragments: tuple[tuple[str, FragmentRecord], ...]  # (logical tensor, where its bytes are)
    linked: tuple[str, ...] = ()  # files linked from the previous step, not written (this node's own count; not sent)
    rewritten: tuple[str, ...] = ()  # files whose linked copy did not match the snapshot: written again (this node's own count; not sent)


@dataclass(frozen=True)
class PlacedTensor:
    """A stored tensor as written: its file, absolute offset, xxh3-64 and chunk digests."""

    tensor: StoredTensor
    file: str
    offset: int
    digest: int
    chunks: str


@dataclass(frozen=True)
class Coding:
    """A stored tensor whose bytes are made in memory: quantized codes and scales (`codec`, a
    ckptd.common.quant.Codec), or a master weight's bf16 residual to the stored model weight
    `model` (its whole twin, of the same box)."""

    codec: Any = None
    model: StoredTensor | None = None


@dataclass(frozen=True)
class CodedWrite:
    """What a coding job wrote: the codes and scales of `tensor` (`frames`: the table of int4
    codes in zstd frames), or its values as they are when they could not be quantized."""

    tensor: StoredTensor
    placed: tuple[PlacedTensor, ...]
    frames: Frames | None
    quantized: bool


def whole_parts(plan: SavePlan) -> list[StoredPart]:
    """One part per tensor, whole, on node 0 (a plan without parts: one node)."""
    return [StoredPart(t.name, Box.full(t.shape), 0, True) for t in plan.tensors]


def stored_tensors(plan: SavePlan) -> list[StoredTensor]:
    """The tensors every node's files hold, as the plan stores them (before compression): a
    whole tensor once (its parts are one per fragment), a fragment stored on its own under its
    fragment key. The same on every node, so all nodes lay out the same files."""
    tensors = {t.name: t for t in plan.tensors}
    stored = []
    whole_done: set[str] = set()
    for part in plan.parts or whole_parts(plan):
        t = tensors[part.name]
        if part.whole:
            if t.name not in whole_done:
                whole_done.add(t.name)
                stored.append(StoredTensor(t.name, file_key(t.name, t.kind), t.dtype, t.shape, Box.full(t.shape), part.node))
        else:
            key = fragment_key(file_key(t.name, t.kind), part.box)
            stored.append(StoredTensor(t.name, key, t.dtype, part.box.lengths, part.box, part.node))
    return stored


def fragment_records(
    placed: Sequence[PlacedTensor], codings: Mapping[tuple[str, Box], Coding], outcomes: Mapping[tuple[str, Box], CodedWrite],
    cast: Mapping[str, StoredTensor],
) -> tuple[tuple[str, FragmentRecord], ...]:
    """The index records of what was written: codes with their scales and frames (and residuals
    with the model weight they add to) in QuantRecords; dropped master weights as the model
    weight's bytes."""
    # what coded records point to (scales, the model weight of a residual or a cast); hashing
    # every Box costs ~3 ms at 4,000 tensors, so only when some tensor is coded
    where = {(p.tensor.name, p.tensor.box, p.tensor.role): p for p in placed} if codings or cast else {}

    def side(p: PlacedTensor) -> SideRecord:
        t = p.tensor
        return SideRecord(p.file, t.key, t.dtype, t.shape, p.offset, t.nbytes, checksum_name(p.digest), chunk_bytes_for(t.nbytes), p.chunks)

    def fragment(p: PlacedTensor, quant: QuantRecord | None) -> FragmentRecord:
        t = p.tensor
        nbytes = t.nbytes
        return FragmentRecord(p.file, t.key, t.box, t.dtype, p.offset, nbytes, checksum_name(p.digest), chunk_bytes_for(nbytes), p.chunks, quant)

    records = []
    for p in placed:
        t = p.tensor
        if t.role != "data":
            continue
        quant = None
        coding = codings.get((t.name, t.box))
        if coding is not None and coding.model is not None:
            quant = QuantRecord(RESIDUAL, base=side(where[(coding.model.name, coding.model.box, "data")]))
        elif coding is not None and outcomes[(t.name, t.box)].quantized:
            codec = coding.codec
            quant = QuantRecord(codec.name, codec.block, scales=side(where[(t.name, t.box, "scales")]), frames=outcomes[(t.name, t.box)].frames)
        records.append((t.name, fragment(p, quant)))
    for name, model in cast.items():
        records.append((name, fragment(where[(model.name, model.box, "data")], QuantRecord(CAST))))
    return tuple(records)


def environment_json(plan: SavePlan, trainer: bytes | None, host: str) -> bytes:
    """environment.json: the trainer's record as rank 0 sent it (versions of Python, torch and
    ckptd, device meshes, the user's run config; {} from a client that sends none), the layout
    that wrote the step (from the plan) and the daemon that committed it."""
    doc = {
        "trainer": json.loads(trainer) if trainer else {},
        "layout": plan.layout_summary,
        "daemon": {"ckptd": VERSION, "python": platform.python_version(), "host": host},
    }
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


ADAPTER_COPY_LIMIT = 1 << 30  # bytes: a larger adapter file is not copied (`ckptd export` makes one)


def adapter_source(manifests: Sequence[NodeManifest], plan: SavePlan, model_files: dict[str, bytes]) -> FileRecord | None:
    """The data file to copy as ADAPTER_WEIGHTS: the only file holding model tensors, when the
    step's model files include adapter_config.json and those tensors are stored whole and
    lossless in it (a PEFT adapter, saved by ckptd.integrations.peft); else None."""
    if "adapter_config.json" not in model_files:
        return None
    kinds = {t.name: t.kind for t in plan.tensors}
    files = {f.name: f for m in manifests for f in m.files}
    holding = set()
    for manifest in manifests:
        for name, fragment in manifest.fragments:
            if kinds.get(name) == "model":
                if fragment.quant is not None or fragment.key != file_key(name, "model"):
                    return None
                holding.add(fragment.file)
    if len(holding) != 1:
        return None
    record = files[holding.pop()]
    return record if record.size <= ADAPTER_COPY_LIMIT else None


class CompactExtras:
    """Each rank's extras as the compact text extra.json holds (json_text.compact_json), encoded
    once while the rank's extras are the same object from save to save: a daemon parses a
    rank's unchanged extras text into the same object (engine/context.ExtrasTexts.parse), and a state's
    extras are its structure with a placeholder per tensor (~75 bytes a tensor: encoding them
    took 3.7 ms of each commit at 4,000 tensors). Other nodes' ranks' extras arrive parsed anew
    at every save and are encoded every time. Keeps the ranks of the last commit only, and at
    most `max_bytes` of text; extras are never changed in place."""

    def __init__(self, max_bytes: int = 16 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._texts: dict[int, tuple[Any, str]] = {}  # rank -> (its extras, their text)

    def texts(self, ranks: Mapping[int, Any]) -> dict[int, str]:
        """The text of each rank's extras in `ranks`."""
        kept, out, held = {}, {}, 0
        for rank, extras in ranks.items():
            known = self._texts.get(rank)
            text = known[1] if known is not None and known[0] is extras else compact_json(extras)
            out[rank] = text
            if held + len(text) <= self.max_bytes:
                kept[rank], held = (extras, text), held + len(text)
        self._texts = kept
        return out


def commit_time(now: float, after: float | None) -> float:
    """A commit's `created_at` (unix seconds): `now`, or just after the job's newest commit
    (`after`) when the clock reads earlier (stepped back by NTP, a VM restored): steps are
    ordered by it (StepCatalog.commit_order), so a step committed later must never sort as older,
    where retention would take it for the oldest and loads would skip it."""
    if after is None or not math.isfinite(after) or now > after:
        return now
    return after + COMMIT_TIME_STEP_S


def step_files(
    job: str,
    step: int,
    plan: SavePlan,
    manifests: Sequence[NodeManifest],
    extras: dict[int, Any],
    model_files: dict[str, bytes],
    metric: float | None,
    clock: Callable[[], float] = time.time,
    quantization: dict[str, Any] | None = None,
    adapter: tuple[FileRecord, bytes] | None = None,
    retention: dict[str, Any] | None = None,
    layouts: IndexLayouts | None = None,
    extras_texts: CompactExtras | None = None,
    after: float | None = None,
) -> tuple[CheckpointIndex, dict[str, bytes]]:
    """The index and the small files that commit a step whose data files the nodes wrote.

    adapter: (the record of adapter_source's file, its bytes): written as ADAPTER_WEIGHTS,
    recorded with that file's size and header checksum (a safetensors file, as `ckptd verify`
    checks them). retention: the job's own policy (retention.policy_record), recorded in the
    index. layouts: the job's index layouts (plan/index_layout.py), which make the index of a
    save that repeats the last one's layout without its per-tensor work; extras_texts: the
    job's texts of its ranks' extras (CompactExtras), which make extra.json without encoding
    unchanged ones again. after: the `created_at` of the job's most recently committed step
    (StepCatalog.newest_commit_time): this commit's is later, whatever `clock` says (commit_time).
    Returns (index, {file
    name: bytes}) with ckptd.index.json last. Pure. Raises IncompleteStep when the manifests do
    not hold every tensor's bytes exactly once.
    """
    fragments = [named for manifest in manifests for named in manifest.fragments]
    layout = (layouts or IndexLayouts()).of(plan, fragments)
    data_files = [f for manifest in sorted(manifests, key=lambda m: m.node) for f in manifest.files]
    small: dict[str, bytes] = dict(layout.hf_indexes)
    small[EXTRA_JSON] = extra_json(step, extras, extras_texts.texts(extras) if extras_texts is not None else None)
    small.update(model_files)
    host = socket.gethostname()
    small[ENVIRONMENT_JSON] = environment_json(plan, model_files.get(ENVIRONMENT_JSON), host)
    records = [FileRecord(name, len(data), checksum_name(xxhash.xxh3_64_intdigest(data))) for name, data in small.items()]
    if adapter is not None:
        source, data = adapter
        if len(data) != source.size:
            raise ValueError(f"the copy of {source.name} for {ADAPTER_WEIGHTS} has {len(data)} bytes, the file {source.size}")
        small[ADAPTER_WEIGHTS] = data
        records.append(FileRecord(ADAPTER_WEIGHTS, source.size, source.checksum))

    index = CheckpointIndex(
        job=job,
        step=step,
        created_at=commit_time(clock(), after),
        world_size=plan.world_size,
        tensors=layout.tensors(fragments),
        files=tuple(data_files + records),
        metric=metric,
        writer={"host": host, "ckptd": VERSION, "nodes": len(manifests)},
        quantization=quantization,
        retention=retention,
    )
    small[INDEX_NAME] = index.to_json_bytes(layout.tensors_json(fragments))
    return index, small
