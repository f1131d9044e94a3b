"""What the object-store tier moves for one committed step, from the step's index alone. Pure.

- Which node uploads which file (`uploads_of`): the node that wrote a data file uploads it
  (node-local roots); node 0 uploads the small files and, last, the index; with a root shared
  by every node, node 0 uploads everything.
- How each file is verified (`file_units`): a data file (safetensors) is tiled exactly by
  *units*, byte ranges whose xxh3-64 the index records: the header ([0, first tensor), its
  FileRecord checksum) and every stored piece (a fragment, its scales), a large piece by its
  chunks (ckptd.common.chunks). The bytes read for an upload and the bytes downloaded for a
  restore are checked unit by unit against the index. A small file (JSON) is checked whole
  (format.check_small_file). A data file that is a byte copy of another (the PEFT adapter
  copy: same size and header checksum, no pieces of its own) is checked with that file's units.
- Whether two files are byte-identical (`file_signature`): same size and the same units, so a
  file unchanged since an earlier uploaded step (an incremental save's hard link) is copied
  inside the bucket instead of uploaded again.
- How a file is fetched (`read_ranges`): consecutive units grouped into ranged GETs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from ckptd.common.chunks import ChunkCheck, chunk_count
from ckptd.daemon.format import INDEX_NAME, CheckpointIndex, FileRecord, FormatError
from ckptd.daemon.step_build import checksum_digest

# A stored piece larger than this is verified by its chunks, so that no unit (and no ranged GET)
# has to hold a whole multi-GiB tensor; smaller pieces are one unit each.
SPLIT_PIECES_ABOVE = 8 << 20


@dataclass(frozen=True)
class Unit:
    """Bytes [offset, offset + nbytes) of a file and the xxh3-64 the index records for them."""

    offset: int
    nbytes: int
    xxh3: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def is_data_file(name: str) -> bool:
    return name.endswith(".safetensors")


def _piece_units(file: str, offset: int, nbytes: int, checksum: str, chunk_bytes: int, chunk_xxh3: str) -> list[Unit]:
    if nbytes <= SPLIT_PIECES_ABOVE or not chunk_bytes:
        return [Unit(offset, nbytes, checksum_digest(checksum, f"{file} at {offset}"))]
    try:
        check = ChunkCheck(nbytes, chunk_bytes, chunk_xxh3)
    except ValueError as exc:
        raise FormatError(f"{file} at {offset}: {exc}") from None
    units = []
    for i in range(chunk_count(nbytes, chunk_bytes)):
        begin, end = check.span(i)
        units.append(Unit(offset + begin, end - begin, int(check.expected(i), 16)))
    return units


def file_units(index: CheckpointIndex) -> dict[str, tuple[Unit, ...]]:
    """Every data file of the step -> the units that tile it exactly, in offset order.

    Raises FormatError naming the file when the index's records of a data file do not tile it
    (bytes no checksum covers, or overlapping records): such a file cannot be verified."""
    pieces: dict[str, dict[tuple[int, int], list[Unit]]] = {}
    for tensor in index.tensors:
        for fragment in tensor.fragments:
            for piece in fragment.stored_pieces():
                found = pieces.setdefault(piece.file, {})
                if (piece.offset, piece.nbytes) not in found and piece.nbytes > 0:
                    found[(piece.offset, piece.nbytes)] = _piece_units(
                        piece.file, piece.offset, piece.nbytes, piece.checksum, piece.chunk_bytes, piece.chunk_xxh3
                    )
    records = {f.name: f for f in index.files if is_data_file(f.name)}
    out: dict[str, tuple[Unit, ...]] = {}
    for name, record in records.items():
        if name not in pieces:
            continue
        body = [u for key in sorted(pieces[name]) for u in pieces[name][key]]
        header = Unit(0, body[0].offset if body else record.size, checksum_digest(record.checksum, name))
        units = (header, *body)
        cursor = 0
        for unit in units:
            if unit.offset != cursor:
                what = "overlap" if unit.offset < cursor else f"bytes [{cursor}, {unit.offset}) no checksum covers"
                raise FormatError(f"{name}: the index's records of it {what}: it cannot be verified")
            cursor = unit.end
        if cursor != record.size:
            raise FormatError(f"{name}: the index's records of it end at byte {cursor}, the file has {record.size}: it cannot be verified")
        out[name] = units
    for name, record in records.items():
        if name in out:
            continue
        source = next((n for n, r in records.items() if n in out and r.size == record.size and r.checksum == record.checksum), None)
        if source is None:
            raise FormatError(f"{name}: no tensor of the index is stored in it and it is no copy of a file that has: it cannot be verified")
        out[name] = out[source]  # a byte copy (the PEFT adapter file): verified as its source
    return out


def file_signature(record: FileRecord, units: Sequence[Unit]) -> str:
    """An identity of the file's bytes: equal for two files only when they hold the same bytes
    (same size, same units and checksums; up to xxh3-64 collisions)."""
    text = f"{record.size};" + ";".join(f"{u.offset},{u.nbytes},{u.xxh3:016x}" for u in units)
    return hashlib.sha256(text.encode()).hexdigest()


def uploads_of(index: CheckpointIndex, node: int, shared_root: bool) -> list[FileRecord]:
    """The files of the step that `node` uploads (the index itself not included; node 0 writes
    it last, see the module docstring). Data files first, in the index's order."""
    if shared_root:
        mine = list(index.files) if node == 0 else []
    else:
        mine = [f for f in index.files if (f.node == node if is_data_file(f.name) else node == 0)]
    return sorted(mine, key=lambda f: not is_data_file(f.name))


def writes_index(node: int) -> bool:
    """Whether `node` writes the step's index into the bucket (node 0, the coordinator)."""
    return node == 0


def read_ranges(units: Sequence[Unit], target_bytes: int) -> list[tuple[int, int, tuple[Unit, ...]]]:
    """Consecutive units grouped into ranges of about `target_bytes` (a unit larger than that is a
    range of its own): (start, end, units) in file order."""
    ranges: list[tuple[int, int, tuple[Unit, ...]]] = []
    group: list[Unit] = []
    for unit in units:
        if group and unit.end - group[0].offset > target_bytes:
            ranges.append((group[0].offset, group[-1].end, tuple(group)))
            group = []
        group.append(unit)
    if group:
        ranges.append((group[0].offset, group[-1].end, tuple(group)))
    return ranges


def small_files(index: CheckpointIndex, units: dict[str, tuple[Unit, ...]]) -> list[FileRecord]:
    """The files verified whole by their recorded checksum: those without units (the index excluded)."""
    return [f for f in index.files if f.name not in units and f.name != INDEX_NAME]
