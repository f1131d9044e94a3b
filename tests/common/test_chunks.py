"""Chunk checksums of stored fragments: sizes, digests fed in any pieces, ranges split into chunks."""

from __future__ import annotations

import pytest
import xxhash

from ckptd.common.chunks import CHECKSUM_PREFIX, MAX_CHUNKS, MIN_CHUNK_BYTES, ChunkCheck, ChunkHasher, checksum_name, chunk_bytes_for, chunk_count

KIB, MIB, GIB = 2**10, 2**20, 2**30


@pytest.mark.parametrize(
    "nbytes, expected",
    [(0, 64 * KIB), (1, 64 * KIB), (4 * MIB, 64 * KIB), (4 * MIB + 1, 128 * KIB), (256 * MIB, 4 * MIB), (GIB + 1, 32 * MIB)],
)
def test_chunk_size_grows_with_the_fragment(nbytes: int, expected: int) -> None:
    assert chunk_bytes_for(nbytes) == expected
    assert chunk_count(nbytes, expected) <= MAX_CHUNKS and expected >= MIN_CHUNK_BYTES


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="-1 bytes"):
        chunk_bytes_for(-1)


@pytest.mark.parametrize("pieces", [[1000], [1, 999], [100] * 10, [7, 93, 300, 600], [64, 64, 872]])
def test_digests_do_not_depend_on_how_the_bytes_are_fed(pieces: list[int]) -> None:
    data = (bytes(range(256)) * 4)[:1000]
    hasher = ChunkHasher(64)
    at = 0
    for n in pieces:
        hasher.update(data[at : at + n])
        at += n
    expected = "".join(f"{xxhash.xxh3_64_intdigest(data[i : i + 64]):016x}" for i in range(0, 1000, 64))
    assert hasher.hexdigests() == expected
    assert len(expected) == 16 * 16  # 15 whole chunks and a last one of 40 bytes


# chunks of 64 bytes of a 520-byte fragment: 8 whole ones and a last one of 8 bytes
@pytest.mark.parametrize(
    "lo, n, inner, edges",
    [
        (0, 520, range(0, 9), []),
        (120, 240, range(2, 5), [1, 5]),
        (128, 64, range(2, 3), []),
        (130, 10, range(0), [2]),
        (0, 1, range(0), [0]),
        (512, 8, range(8, 9), []),
        (500, 20, range(8, 9), [7]),
        (64, 0, range(0), []),
    ],
)
def test_a_range_splits_into_chunks_inside_and_chunks_cut(lo: int, n: int, inner: range, edges: list[int]) -> None:
    check = ChunkCheck(520, 64, "0" * 16 * 9)
    got_inner, got_edges = check.split(lo, n)
    assert list(got_inner) == list(inner) and got_edges == edges
    assert check.span(8) == (512, 520)


def test_digests_that_do_not_fit_the_fragment_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit 520 bytes in chunks of 64"):
        ChunkCheck(520, 64, "0" * 16 * 8)


@pytest.mark.parametrize(
    "digest, name",
    [(0, "xxh3-64:0000000000000000"), (1, "xxh3-64:0000000000000001"), (0xFF, "xxh3-64:00000000000000ff"), (2**64 - 1, "xxh3-64:ffffffffffffffff")],
)
def test_checksum_name_is_the_prefix_and_16_hex_digits(digest: int, name: str) -> None:
    """The one spelling of an index's checksum (the daemon writes it, the client's reader compares it)."""
    assert checksum_name(digest) == name and name.startswith(CHECKSUM_PREFIX)
