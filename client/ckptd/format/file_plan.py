"""Which stored bytes of a step's files serve a load: the file part of the load planner. Pure: no
I/O, no awaits.

Shared by the daemon's load planner (its plan/load_plan.py adds the snapshot the daemon holds in
memory and chooses where each file is read: its root, a peer, a replica) and the offline reader
(ckptd.offline: every file in place). `plan_pieces` checks a load's wanted boxes against the
step's index (names, shapes, a rank's own extras tensors) and lists, per box, the pieces of the
fragments that overlap it, with how the client decodes them; `extras_source` / `rank_extras`:
whose extras (JSON and per-rank tensors) a rank gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence, TypeVar

from ckptd.common.boxes import Box, overlaps
from ckptd.common.frames import Frames
from ckptd.common.names import per_rank_name, shared_name
from ckptd.common.quant_options import CAST
from ckptd.format.index import CheckpointIndex, TensorRecord

OPTIONAL_PREFIXES = ("rng/",)  # per-rank RNG states: never "missing" nor "unexpected"
RNG_KEY = "rng"  # the extras key of the RNG states (ckptd.client.state saves them under it)
SHM_SOURCE, FILE_SOURCE = "shm", "file"  # the wire's Piece.source: a held snapshot's arena, or any file
# ... or a staging file whose bytes of the piece the daemon checked against the step's checksums
# as they arrived (a replica): the rank copies them unchecked. A client that does not know the
# name reads the piece as a FILE_SOURCE, checked again.
CHECKED_SOURCE = "checked"


class LoadMismatch(ValueError):
    """The state being loaded does not match the step: a shape differs, or (strict) tensors are
    missing or unexpected. The message names them and says what to do."""


def extras_source(rank: int, world_size: int) -> int:
    """The rank whose extras (its JSON extras and its own extras tensors) `rank` loads from a step
    saved by `world_size` ranks: its own when the step has its rank, else rank 0's (more ranks
    than at save time). The extras of ranks beyond the loading world are not loaded."""
    return rank if rank < world_size else 0


def rank_extras(extras_by_rank: Mapping[int, Any], rank: int, world_size: int) -> Any:
    """`rank`'s extras tree from every saved rank's: `extras_source`'s, without its RNG state
    when it is another rank's (each rank's generators are its own)."""
    source = extras_source(rank, world_size)
    extras = extras_by_rank.get(source, {})
    if source != rank and isinstance(extras, dict):
        extras = {k: v for k, v in extras.items() if k != RNG_KEY}
    return extras


class PieceInfo(NamedTuple):
    """One source of bytes for (part of) a requested tensor (a named tuple: a load makes one
    per tensor, and a tuple is made in C)."""

    name: str  # the requested name
    source: str  # SHM_SOURCE | FILE_SOURCE | CHECKED_SOURCE (the wire's Piece.source)
    path: str
    offset: int
    nbytes: int
    fragment: Box
    dtype: str
    checksum: str
    chunk_bytes: int = 0  # file pieces: the fragment's chunk checksums (FragmentRecord)
    chunk_xxh3: str = ""
    decode: "DecodeInfo | None" = None  # the bytes are codes or a residual, not values


@dataclass(frozen=True)
class DecodeInfo:
    """How the client turns a piece's bytes into values (ckptd.common.quant)."""

    codec: str
    block: int
    scales: PieceInfo | None
    base: PieceInfo | None
    frames: Frames | None = None  # the codes are stored in zstd frames


class WantedBox(Protocol):
    """A box of a logical tensor that a rank loads (the daemon's TensorSpec, the offline reader's Wanted)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def box(self) -> Box: ...
    @property
    def per_rank(self) -> bool:
        """A rank's own extras tensor, named for the rank (ckptd.common.names.per_rank_name)."""
    @property
    def aliases(self) -> tuple[str, ...]:
        """The state's other names of this one tensor (tied to it)."""


@dataclass(frozen=True)
class Wanted:
    """A WantedBox as a plain record."""

    name: str
    kind: str
    shape: tuple[int, ...]
    box: Box
    per_rank: bool = False
    aliases: tuple[str, ...] = ()


class FileLocation(Protocol):
    """Where the rank reads one data file of the step (the daemon's load_plan.Location also says
    from which tier)."""

    @property
    def node(self) -> int:
        """The node that holds the file."""
    @property
    def path(self) -> str:
        """What the rank opens: the file itself, or its staging copy in shared memory."""
    @property
    def staged(self) -> bool:
        """The daemon copies the needed ranges to `path` first."""


@dataclass(frozen=True)
class FileInPlace:
    """A data file the rank opens where it is (the offline reader's every file)."""

    path: str
    node: int = 0
    staged: bool = False


@dataclass(frozen=True)
class StagedRead:
    """Bytes [offset, offset + nbytes) of `file` (on `node`) to copy to the same offset of its staging file."""

    file: str
    node: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PlannedPieces:
    pieces: tuple[PieceInfo, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    reads: tuple[StagedRead, ...]  # to perform before the rank reads (in the order found)
    # a tied tensor's aliases that the step holds apart, found or not by their values: a plan
    # that holds for this step's values only (not for another step of the same layout)
    compared: tuple[str, ...] = ()


W = TypeVar("W", bound=WantedBox)


def plan_pieces(
    index: CheckpointIndex,
    wanted: Sequence[W],
    kinds: Sequence[str],
    strict: bool,
    locations: Mapping[str, FileLocation],
    rank: int = 0,
    in_memory: Callable[[W, TensorRecord], list[PieceInfo] | None] | None = None,
) -> PlannedPieces:
    """The pieces of every wanted tensor box of rank `rank`, the names missing from the step and
    those in it (of the requested kinds) not asked for. Raises LoadMismatch for a shape that
    differs from the step's, and (strict) for missing or unexpected names.

    Each box's pieces come from `in_memory` when it gives them for a lossless tensor (the
    daemon's held snapshot), else from the step's files at `locations` (file name -> where the
    rank reads it; a staged file adds the StagedRead of each fragment read through it).

    A rank's own extras tensor (`WantedBox.per_rank`, named for `rank`) comes from the copy of
    `extras_source`'s rank, or from the one tensor of that name a step saved before extras were
    per rank; other ranks' own tensors are neither expected nor unexpected.

    A tied tensor (a spec with aliases) loads its name's value. A step that holds one of its
    aliases as a tensor apart (saved untied, or imported) has it found too when the two hold the
    same values (`_told_apart`); with different values it stays unexpected (strict: LoadMismatch),
    since one tensor cannot take both."""
    table = index.by_name()
    step = index.step
    source = extras_source(rank, index.world_size)
    missing = []
    pieces: list[PieceInfo] = []
    reads: dict[tuple[str, int], StagedRead] = {}
    found: set[str] = set()
    torn: list[tuple[str, str, str]] = []  # (name, alias, why): one tensor of the state, two values in the step
    compared: list[str] = []
    for spec in wanted:
        record = _record_of(table, spec, rank, source)
        if record is None:
            if not spec.name.startswith(OPTIONAL_PREFIXES):
                missing.append(spec.name)
            continue
        found.add(record.name)
        for alias in spec.aliases:
            other = table.get(alias)
            if other is not None and other is not record:
                compared.append(alias)
                why = _told_apart(record, other)
                if why is None:
                    found.add(other.name)
                else:
                    torn.append((spec.name, alias, why))
        if tuple(record.shape) != tuple(spec.shape):
            raise LoadMismatch(
                f"tensor {spec.name!r} has shape {list(record.shape)} in step {step} but the state being "
                f"loaded has {list(spec.shape)}; build the model with the configuration it was saved with"
            )
        held = in_memory(spec, record) if in_memory is not None and not record.lossy else None
        pieces += held if held is not None else _file_pieces(spec, record, locations, reads)
    requested_kinds = set(kinds)
    unexpected = sorted(
        t.name
        for t in index.tensors
        if t.name not in found and t.name.split("/", 1)[0] in requested_kinds and not t.name.startswith(OPTIONAL_PREFIXES)
        and t.rank in (None, source)
    )
    if strict and torn:
        name, alias, why = torn[0]
        more = f" (and {len(torn) - 1} more such pairs)" if len(torn) > 1 else ""
        raise LoadMismatch(
            f"{name!r} and {alias!r} are one tensor in the state being loaded (tied), but step {step} holds {why} "
            f"for them{more}; load into a model where they are not tied (and tie them after), or pass strict=False to load "
            f"the value of {name!r} into both"
        )
    if strict and (missing or unexpected):
        raise LoadMismatch(mismatch_text(step, missing, unexpected))
    return PlannedPieces(tuple(pieces), tuple(missing), tuple(unexpected), tuple(reads.values()), tuple(compared))


def mismatch_text(step: int, missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """What a strict load refuses: the state's tensors the step lacks and the step's tensors the state lacks."""
    parts = [f"missing from step {step}: {names_text(missing)}"] if missing else []
    parts += [f"in step {step} but not in the state being loaded: {names_text(unexpected)}"] if unexpected else []
    return "; ".join(parts) + " (pass strict=False to load the rest)"


def _told_apart(record: TensorRecord, other: TensorRecord) -> str | None:
    """None when two tensors of a step hold the same values, told by their records alone: same
    dtype and shape, stored as values (not coded) in fragments of the same boxes with the same
    checksums; else what the step holds for them, for a message."""
    if record.lossy or other.lossy:
        return "values stored coded (quantized or cast), which cannot be told equal,"
    if record.dtype != other.dtype or tuple(record.shape) != tuple(other.shape):
        return "values of different dtypes or shapes"
    if {f.box for f in record.fragments} != {f.box for f in other.fragments}:
        return "values stored in fragments of different boxes, which cannot be told equal,"
    stored = {(f.box, f.dtype, f.checksum) for f in record.fragments}
    return None if stored == {(f.box, f.dtype, f.checksum) for f in other.fragments} else "different values"


def names_text(names: Sequence[str], limit: int = 20) -> str:
    """The first `limit` names, and how many more, for a message."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _record_of(table: Mapping[str, TensorRecord], spec: WantedBox, rank: int, source: int) -> TensorRecord | None:
    """The step's tensor that `spec` of rank `rank` loads (source: `extras_source`), or None.

    A per-rank request ("extra/rank<rank>/t") takes the source rank's own copy
    ("extra/rank<source>/t"), else a tensor "extra/t" shared by every rank (saved with a layout
    rule, imported, or saved before extras were per rank). A plain request of a tensor that the
    step holds per rank (now loaded with a layout rule, or as a DTensor) takes the source rank's copy.
    """
    if not spec.per_rank:
        record = table.get(spec.name)
        if record is None and spec.kind == "extra":
            own = table.get(per_rank_name(spec.name, source))
            return own if own is not None and own.rank == source else None
        return record
    base = shared_name(spec.name, rank)
    if base is None:
        raise LoadMismatch(f"rank {rank} asks for {spec.name!r} as its own tensor, but the name does not carry rank{rank} after its state key")
    own = table.get(per_rank_name(base, source))
    if own is not None and own.rank == source:
        return own
    shared = table.get(base)
    return shared if shared is not None and shared.rank is None else None


def _file_pieces(
    spec: WantedBox, record: TensorRecord, locations: Mapping[str, FileLocation], reads: dict[tuple[str, int], StagedRead]
) -> list[PieceInfo]:
    def path_of(file: str, offset: int, nbytes: int) -> str:
        location = locations[file]
        if location.staged and (file, offset) not in reads:
            reads[(file, offset)] = StagedRead(file, location.node, offset, nbytes)
        return location.path

    out = []
    for frag in record.fragments:
        if not overlaps(frag.box, spec.box):
            continue
        path = path_of(frag.file, frag.offset, frag.nbytes)
        decode = None
        if frag.quant is not None and frag.quant.codec != CAST:  # "cast": the model weight's bytes, converted as any dtype
            sides: list[PieceInfo | None] = []
            for side in (frag.quant.scales, frag.quant.base):
                if side is None:
                    sides.append(None)
                    continue
                side_path = path_of(side.file, side.offset, side.nbytes)
                sides.append(
                    PieceInfo(
                        spec.name, FILE_SOURCE, side_path, side.offset, side.nbytes, frag.box, side.dtype, side.checksum,
                        chunk_bytes=side.chunk_bytes, chunk_xxh3=side.chunk_xxh3,
                    )
                )
            decode = DecodeInfo(frag.quant.codec, frag.quant.block, sides[0], sides[1], frag.quant.frames)
        out.append(
            PieceInfo(
                spec.name, FILE_SOURCE, path, frag.offset, frag.nbytes, frag.box, frag.dtype, frag.checksum,
                chunk_bytes=frag.chunk_bytes, chunk_xxh3=frag.chunk_xxh3, decode=decode,
            )
        )
    return out
