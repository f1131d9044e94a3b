"""The check of a data file's bytes against its checksum units (units.UnitCheck), fed as bytes
pass, and the same check of bytes on disk (units.first_mismatch)."""

from __future__ import annotations

import random

import pytest
import xxhash

from ckptd.format.units import Unit, UnitCheck, first_mismatch

DATA = random.Random(7).randbytes(10_000)


def units_of(bounds: list[int], data: bytes = DATA) -> tuple[Unit, ...]:
    """Units over [bounds[i], bounds[i+1]) of `data`, with their true checksums."""
    return tuple(Unit(a, b - a, xxhash.xxh3_64_intdigest(data[a:b])) for a, b in zip(bounds, bounds[1:]))


def fed(check: UnitCheck, data: bytes, pieces: list[int]) -> UnitCheck:
    """`data` fed to `check` in pieces cut at `pieces` (offsets into data)."""
    for a, b in zip([0, *pieces], [*pieces, len(data)]):
        check.feed(memoryview(data)[a:b])
    return check


# issue 30 review: one streaming check of units, fed in any pieces, used wherever bytes pass
@pytest.mark.parametrize("pieces", [[], [1], [3, 4, 5, 4000], list(range(0, 10_000, 333))])
def test_a_unit_check_fed_in_any_pieces_finds_the_first_unit_that_does_not_match(pieces: list[int]) -> None:
    units = units_of([0, 40, 41, 5000, 5000, 10_000])  # a one-byte and an empty unit among them
    assert fed(UnitCheck(units), DATA, pieces).problem() is None
    damaged = bytearray(DATA)
    damaged[6000] ^= 1
    damaged[9999] ^= 1
    check = fed(UnitCheck(units), bytes(damaged), pieces)
    assert check.problem() == "bytes [5000, 10000) do not match their checksum in the index" and check.position == 10_000


# issue 30 review
def test_a_unit_check_passes_over_bytes_no_unit_covers_and_says_where_bytes_stop_short() -> None:
    units = units_of([100, 200]) + units_of([300, 400])  # from byte 50, with gaps: a staged range
    damaged = bytearray(DATA)
    damaged[60] ^= 1  # in a gap: not checked
    damaged[250] ^= 1
    assert fed(UnitCheck(units, 50), bytes(damaged[50:450]), [7, 120]).problem() is None
    short = fed(UnitCheck(units, 50), DATA[50:350], [])
    assert short.problem() == "the bytes stop at byte 350, short of the end of bytes [300, 400) that the index checksums"
    assert UnitCheck(()).problem() is None


# issue 30 review: bytes on disk are read through the same check (reuse.check_linked)
def test_first_mismatch_reads_units_through_pread_with_the_same_check() -> None:
    data = DATA * 110  # more than HASH_SLICE: several reads
    units = units_of([0, 40, 3000, 2**20 + 5000], data)
    reads: list[tuple[int, int]] = []

    def pread(nbytes: int, offset: int) -> bytes:
        reads.append((nbytes, offset))
        return data[offset : offset + nbytes]

    assert first_mismatch(pread, units) is None
    assert reads == [(2**20, 0), (5000, 2**20)]
    assert first_mismatch(lambda n, o: data[o : min(o + n, 2000)], units) == (
        "the bytes stop at byte 2000, short of the end of bytes [40, 3000) that the index checksums"
    )
    flipped = bytearray(data)
    flipped[13] ^= 1
    assert first_mismatch(lambda n, o: bytes(flipped[o : o + n]), units) == "bytes [0, 40) do not match their checksum in the index"
