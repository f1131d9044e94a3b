"""Checksums of fixed-size chunks of a stored fragment, so that a read of part of it is verified.

A fragment's bytes are split into chunks of `chunk_bytes` (the last one may be shorter), each
with its own xxh3-64. A load that reads only some byte ranges of the fragment (a resharded
slice) checks every chunk those ranges touch: the chunks wholly inside a range from the bytes
it read, the ones it cuts at its edges by reading them whole once more. The chunk size grows
with the fragment so that a fragment has at most MAX_CHUNKS of them (a bounded index) while the
extra bytes read at a range's edges stay below two chunks.

Pure: no file access here; the writer feeds `ChunkHasher`, the reader uses `ChunkCheck`.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

MIN_CHUNK_BYTES = 64 * 2**10
# Bytes read or written at a time where they are also hashed (the writer, a checked load,
# `ckptd verify`): each hash and the kernel's copy then find them in the CPU cache instead of
# reading them from memory once each. Written: hash twice + pwrite of 64 MiB 10.8 -> 5.8 ms;
# read and checked from the page cache, one core (tests/bench/bench_read_hash.py): checked load
# 10.5-11.2 -> 13.0-13.2 GB/s, verify (whole and chunk digests) 6.9-7.2 -> 16.6-16.9 GB/s.
HASH_SLICE = 2**20
MAX_CHUNKS = 64
DIGEST_HEX = 16  # hex characters of one xxh3-64 digest
CHECKSUM_PREFIX = "xxh3-64:"  # an index's checksum of a whole fragment or file: this prefix, then DIGEST_HEX hex digits


def checksum_name(digest: int) -> str:
    """The index's name of an xxh3-64 digest: CHECKSUM_PREFIX and 16 hex digits."""
    return f"{CHECKSUM_PREFIX}{digest:0{DIGEST_HEX}x}"


def chunk_bytes_for(nbytes: int) -> int:
    """The chunk size of a fragment of `nbytes`: a power of two >= MIN_CHUNK_BYTES, and at most
    MAX_CHUNKS chunks."""
    if nbytes < 0:
        raise ValueError(f"a fragment cannot have {nbytes} bytes")
    size = MIN_CHUNK_BYTES
    while size * MAX_CHUNKS < nbytes:
        size *= 2
    return size


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


class ChunkHasher:
    """Digests of consecutive chunks of a byte stream fed in pieces of any size, in order."""

    def __init__(self, chunk_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk size must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._digests: list[str] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current chunk hashed so far

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = min(len(view), self.chunk_bytes - self._filled)
            self._hasher.update(view[:n])
            self._filled += n
            view = view[n:]
            if self._filled == self.chunk_bytes:
                self._close_chunk()

    def hexdigests(self) -> str:
        """The digests of all chunks so far (a last, partial chunk included), concatenated."""
        if self._filled:
            self._close_chunk()
        return "".join(self._digests)

    def _close_chunk(self) -> None:
        self._digests.append(f"{self._hasher.intdigest():016x}")
        self._hasher.reset()
        self._filled = 0


def digest_of(data: memoryview | bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


@dataclass(frozen=True)
class ChunkCheck:
    """What the index says of a fragment's chunks: their size and concatenated digests."""

    nbytes: int  # of the fragment
    chunk_bytes: int
    digests: str

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or len(self.digests) != DIGEST_HEX * chunk_count(self.nbytes, self.chunk_bytes):
            raise ValueError(
                f"chunk checksums of {len(self.digests)} characters do not fit {self.nbytes} bytes in chunks of {self.chunk_bytes}"
            )

    def span(self, chunk: int) -> tuple[int, int]:
        """Byte range [begin, end) of a chunk in the fragment."""
        begin = chunk * self.chunk_bytes
        return begin, min(begin + self.chunk_bytes, self.nbytes)

    def expected(self, chunk: int) -> str:
        return self.digests[chunk * DIGEST_HEX : (chunk + 1) * DIGEST_HEX]

    def split(self, lo: int, n: int) -> tuple[range, list[int]]:
        """For the fragment's bytes [lo, lo + n): the chunks wholly inside, and the ones cut at the edges."""
        if n <= 0:
            return range(0), []
        first, last = lo // self.chunk_bytes, (lo + n - 1) // self.chunk_bytes
        inner_first = first if lo == first * self.chunk_bytes else first + 1
        inner_last = last if lo + n == self.span(last)[1] else last - 1
        inner = range(inner_first, inner_last + 1)
        edges = sorted({c for c in (first, last) if c not in inner})
        return inner, edges
