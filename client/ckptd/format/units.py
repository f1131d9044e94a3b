"""How the bytes of a step's data file are checked against the step's index: *units*. Pure
(reading is the caller's: bytes fed to a UnitCheck as they pass, or a pread function).

A data file (safetensors) is tiled exactly by units, byte ranges whose xxh3-64 the index
records: the header ([0, first tensor), its FileRecord checksum) and every stored piece (a
fragment, its scales), a large piece by its chunks (ckptd.common.chunks). Every place that takes
a data file's bytes on trust checks them unit by unit: the object-store tier (what it uploads
and downloads, remote/), an incremental save (a file it links from the previous step, write/reuse.py),
a buddy holding a replica in memory (what arrives, tiers/replica_store.py) and a load staging
ranges of a replica (tiers/replicas.py). Bytes that pass through the daemon anyway (an
upload, a replica or staged range arriving) are checked as they pass (UnitCheck); bytes that
only lie on disk are read to be checked (first_mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import xxhash

from ckptd.common.chunks import CHECKSUM_PREFIX, HASH_SLICE, ChunkCheck, chunk_count
from ckptd.format.index import CheckpointIndex, FormatError

# A stored piece larger than this is verified by its chunks, so that no unit (and no ranged GET)
# has to hold a whole multi-GiB tensor; smaller pieces are one unit each.
SPLIT_PIECES_ABOVE = 8 << 20

Pread = Callable[[int, int], bytes]  # (nbytes, offset) -> the bytes there (fewer at the end of the file)


def checksum_digest(name: str, what: str) -> int:
    """The xxh3-64 digest an index records as `name` (checksum_name's inverse); FormatError
    naming `what` when it is not one."""
    if not name.startswith(CHECKSUM_PREFIX) or len(name) != len(CHECKSUM_PREFIX) + 16:
        raise FormatError(f"{what}: checksum {name!r} is not {CHECKSUM_PREFIX}<16 hex digits>")
    try:
        return int(name[len(CHECKSUM_PREFIX):], 16)
    except ValueError:
        raise FormatError(f"{what}: checksum {name!r} is not {CHECKSUM_PREFIX}<16 hex digits>") from None


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
    (bytes no checksum covers, or overlapping records): such a file cannot be verified. A data
    file that is a byte copy of another (the PEFT adapter copy: same size and header checksum,
    no pieces of its own) gets that file's units."""
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
        problem = tiling_problem(units, record.size)
        if problem is not None:
            raise FormatError(f"{name}: the index's records of it {problem}: it cannot be verified")
        out[name] = units
    for name, record in records.items():
        if name in out:
            continue
        source = next((n for n, r in records.items() if n in out and r.size == record.size and r.checksum == record.checksum), None)
        if source is None:
            raise FormatError(f"{name}: no tensor of the index is stored in it and it is no copy of a file that has: it cannot be verified")
        out[name] = out[source]  # a byte copy (the PEFT adapter file): verified as its source
    return out


def tiling_problem(units: Sequence[Unit], size: int) -> str | None:
    """None when `units`, in order, tile bytes [0, size) exactly; else what is wrong ("overlap",
    "bytes [a, b) no checksum covers", "end at byte b, the file has n")."""
    cursor = 0
    for unit in units:
        if unit.offset != cursor or unit.nbytes < 0:
            return "overlap" if unit.offset < cursor or unit.nbytes < 0 else f"bytes [{cursor}, {unit.offset}) no checksum covers"
        cursor = unit.end
    return None if cursor == size else f"end at byte {cursor}, the file has {size}"


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


class UnitCheck:
    """Checks bytes fed in file order, from byte `start` on, against `units` (in offset order, not
    overlapping, none before `start`): a unit's xxh3-64 is compared once its last byte is fed.
    Bytes no unit covers are passed over; hashing stops at the first unit that does not match.
    Where bytes arrive (a replica, a staged range, an upload) they are checked as they pass, so
    nothing is read back to be checked."""

    def __init__(self, units: Sequence[Unit], start: int = 0) -> None:
        self.units = units
        self.position = start  # the file offset of the next byte fed
        self.bad: str | None = None  # the first unit that did not match
        self._next = 0  # the index of the unit being hashed
        self._hasher = xxhash.xxh3_64()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The next bytes of the file, from `position` on."""
        view = memoryview(data)
        while self._next < len(self.units) and self.bad is None:
            unit = self.units[self._next]
            if self.position < unit.offset:  # bytes before the unit: passed over
                skip = min(len(view), unit.offset - self.position)
                if not skip:
                    break
                view, self.position = view[skip:], self.position + skip
                continue
            take = view[: unit.end - self.position]
            self._hasher.update(take)
            view, self.position = view[len(take):], self.position + len(take)
            if self.position < unit.end:
                break
            if self._hasher.intdigest() != unit.xxh3:
                self.bad = f"bytes [{unit.offset}, {unit.end}) do not match their checksum in the index"
            self._hasher.reset()
            self._next += 1
        self.position += len(view)

    def problem(self) -> str | None:
        """None when every unit was fed and matched; else what is wrong with the first that did
        not ("bytes [a, b) do not match their checksum in the index"), or where the bytes
        stopped short of a unit."""
        self.feed(b"")  # settles empty units at the end
        if self.bad is not None or self._next == len(self.units):
            return self.bad
        unit = self.units[self._next]
        return f"the bytes stop at byte {self.position}, short of the end of bytes [{unit.offset}, {unit.end}) that the index checksums"


def first_mismatch(pread: Pread, units: Sequence[Unit]) -> str | None:
    """Read bytes [units[0].offset, units[-1].end) through `pread` (HASH_SLICE bytes at a time, one
    pass, stopping at the first mismatch) and check them (UnitCheck): None when every unit
    matches its checksum, else what is wrong with the first that does not, or where the file
    ends short. For bytes on disk; bytes that arrive are checked as they pass (UnitCheck)."""
    if not units:
        return None
    check = UnitCheck(units, units[0].offset)
    end = units[-1].end
    while check.position < end and check.bad is None:
        data = pread(min(HASH_SLICE, end - check.position), check.position)
        if not data:
            break
        check.feed(data)
    return check.problem()
