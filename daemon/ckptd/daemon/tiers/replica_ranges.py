"""Which bytes a load stages from a replica held by another daemon, and in which pieces
(tiers/replicas.py fetches them; pure). The ranges a load reads are widened to whole
checksum units (every staged byte is checked against the step's index), merged where close,
and cut for parallel connections only between units, so that each unit arrives whole on one
connection and is checked as it arrives (units.UnitCheck)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Mapping, Sequence

from ckptd.format.units import Unit

MERGE_GAP_BYTES = 64 * 1024  # ranges of a file closer than this are fetched as one

Range = tuple[str, int, int, int]  # (file, offset, nbytes, staging fd)


def merge_ranges(ranges: Sequence[Range], gap: int = MERGE_GAP_BYTES) -> list[Range]:
    """Ranges of the same file and staging fd that overlap or lie within `gap` bytes merged
    into one (the bytes between are the file's too), in file and offset order."""
    merged: list[Range] = []
    for file, offset, nbytes, fd in sorted(ranges, key=lambda r: (r[0], r[1])):
        if merged and merged[-1][0] == file and merged[-1][3] == fd and offset <= merged[-1][1] + merged[-1][2] + gap:
            last = merged[-1]
            merged[-1] = (file, last[1], max(last[1] + last[2], offset + nbytes) - last[1], fd)
        else:
            merged.append((file, offset, nbytes, fd))
    return merged


Check = tuple[str, int, Unit]  # (file, staging fd, a checksum unit staged there)


def widen_to_units(reads: Sequence[Range], units: Mapping[str, Sequence[Unit]]) -> tuple[list[Range], list[Check]]:
    """The reads widened to the whole checksum units they touch (so that every staged byte can be
    checked; the bytes around a range are the file's too, staged at their own offsets), and the
    units to check, each once, in file order. A file without units is read as asked."""
    widened: list[Range] = []
    touched: dict[tuple[str, int, int], Unit] = {}
    starts: dict[str, list[int]] = {}
    for file, offset, nbytes, fd in reads:
        known = units.get(file)
        if not known:
            widened.append((file, offset, nbytes, fd))
            continue
        if file not in starts:
            starts[file] = [u.offset for u in known]
        first = max(0, bisect_right(starts[file], offset) - 1)
        covered = []
        for unit in known[first:]:
            if unit.offset >= offset + nbytes:
                break
            if unit.end > offset:
                covered.append(unit)
        if not covered:
            widened.append((file, offset, nbytes, fd))
            continue
        widened.append((file, covered[0].offset, covered[-1].end - covered[0].offset, fd))
        for unit in covered:
            touched[(file, fd, unit.offset)] = unit
    return widened, [(file, fd, unit) for (file, fd, _), unit in sorted(touched.items())]


def units_within(ranges: Sequence[Range], units: Mapping[str, Sequence[Unit]]) -> list[Check]:
    """Every unit of `units` (by file, in offset order) that lies wholly inside one of the
    ranges, each once, in file order: what a fetch of merged ranges checks, so that the bytes
    between the reads that merging brings along (whole units, since the reads were widened to
    units) are checked like the rest: every byte staged from a replica is checked before it is
    written, whichever read it belongs to."""
    out: dict[tuple[str, int, int], Unit] = {}
    for file, offset, nbytes, fd in ranges:
        known = units.get(file) or ()
        first = bisect_left(known, offset, key=lambda u: u.offset)
        for unit in known[first:]:
            if unit.end > offset + nbytes:
                break
            out[(file, fd, unit.offset)] = unit
    return [(file, fd, unit) for (file, fd, _), unit in sorted(out.items())]


def cut_ranges(ranges: Sequence[Range], most: int, align: int = 2**20, units: Mapping[str, Sequence[Unit]] | None = None) -> list[Range]:
    """The ranges cut into pieces of about `most` bytes (rounded up to `align`), so that one large
    range can travel over several connections. A cut inside one of a file's `units` (tiling it)
    moves to that unit's end: each unit arrives whole on one connection, checked as it arrives."""
    step = max(align, -(-most // align) * align)
    ends: dict[str, list[int]] = {}
    out: list[Range] = []
    for file, offset, nbytes, fd in ranges:
        known = ends.setdefault(file, [u.end for u in (units or {}).get(file, ())])
        at, end = offset, offset + nbytes
        while at < end:
            cut = min(end, at + step)
            i = bisect_left(known, cut)
            cut = min(end, known[i]) if i < len(known) else cut
            out.append((file, at, cut - at, fd))
            at = cut
    return out


def units_in(ranges: Sequence[Range], checks: Sequence[Check]) -> list[tuple[Unit, ...]]:
    """For each range, the units of `checks` (in file order, as widen_to_units gives them) that
    lie in it: the same file and staging fd, starting inside it (cut_ranges keeps them whole)."""
    placed: dict[tuple[str, int], list[Unit]] = {}
    for file, fd, unit in checks:
        placed.setdefault((file, fd), []).append(unit)
    out = []
    for file, offset, nbytes, fd in ranges:
        known = placed.get((file, fd), [])
        first, last = (bisect_left(known, at, key=lambda u: u.offset) for at in (offset, offset + nbytes))
        out.append(tuple(known[first:last]))
    return out
