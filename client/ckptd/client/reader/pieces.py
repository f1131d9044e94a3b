"""Verified range reads of stored pieces: where a fragment's bytes are, and reading them back checked.

A piece (`Source`) is a fragment's bytes in a committed file or, when the daemon staged or
holds them, in a shared-memory arena file; both are read the same way here: pread by path
(never through a link, never a FIFO), checked against the index's xxh3-64 checksum of the whole
fragment when all of it is read, else against the checksums of the chunks the read touches
(ckptd.common.chunks). A piece of kind CHECKED_SOURCE (a staging file whose bytes the daemon
checked as they arrived, before they were written) is read the same way, unchecked: it never
holds a byte the daemon did not check. Every function raises CheckpointError naming the tensor
and the file.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch
import xxhash

from ckptd.client.errors import CheckpointError
from ckptd.common import dtypes
from ckptd.common.boxes import Box
from ckptd.common.chunks import CHECKSUM_PREFIX, HASH_SLICE, ChunkCheck, checksum_name, digest_of
from ckptd.common.frames import Frames, FrameError, decompress
from ckptd.common.reshard import CopyRun
from ckptd.format.file_plan import CHECKED_SOURCE

READ_CHUNK = 64 * 2**20


class Source(NamedTuple):
    """Where a fragment's bytes are: an arena ("shm"), a committed file ("file"), or a staging file
    the daemon checked ("checked": CHECKED_SOURCE).

    A named tuple, not a dataclass: a load makes one per tensor, and a tuple is made in C."""

    name: str  # the logical tensor, for messages
    kind: str
    path: str
    offset: int
    nbytes: int
    box: Box
    dtype: str
    checksum: str
    chunk_bytes: int = 0  # files: xxh3-64 of each chunk of the fragment (ckptd.common.chunks)
    chunk_xxh3: str = ""
    decode: "Decoding | None" = None  # the bytes are codes or a residual (ckptd.common.quant)


@dataclass(frozen=True, eq=False)
class ArenaColumns:
    """A load from the daemon's memory as columns (the wire's MemoryColumns): entry i is the i-th
    fragment of the rank's structure, whole, of the stored dtype, `nbytes[i]` bytes at
    `offsets[i]` of arena file `paths[files[i]]` (an empty fragment: 0 bytes, in no arena).
    Checked when made (`of`): equal lengths, arena indices of non-empty fragments in range, no
    negative offset or size."""

    paths: tuple[str, ...]
    files: np.ndarray  # intp, one per fragment: an index into paths
    offsets: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64

    @staticmethod
    def of(paths: Sequence[str], files: Sequence[int], offsets: Sequence[int], nbytes: Sequence[int]) -> "ArenaColumns":
        """Raises CheckpointError when the columns do not describe fragments in `paths`."""
        file_of = np.array(files, dtype=np.intp)
        at, size = np.array(offsets, dtype=np.int64), np.array(nbytes, dtype=np.int64)
        if not len(file_of) == len(at) == len(size):
            malformed = f"columns of {len(file_of)} arenas, {len(at)} offsets and {len(size)} sizes"
        elif len(at) and (at.min() < 0 or size.min() < 0):
            malformed = "a negative offset or size"
        elif not all(0 <= k < len(paths) for k in set(file_of[size > 0].tolist())):
            malformed = f"an arena index outside the {len(paths)} arenas"
        else:
            return ArenaColumns(tuple(paths), file_of, at.astype(np.uint64), size.astype(np.uint64))
        raise CheckpointError(f"the daemon's plan from memory is malformed ({malformed}); upgrade the client and the daemon to the same release")


@dataclass(frozen=True)
class Decoding:
    """How a quantized or residual fragment becomes values: the codec, its block size, and the
    other bytes it needs (its scales; the model weight a residual adds to), each a Source with
    the fragment's box."""

    codec: str
    block: int
    scales: Source | None
    base: Source | None
    frames: Frames | None = None  # the codes are stored as zstd frames of whole rows



def checked_by_daemon(src: Source) -> bool:
    """The daemon checked every byte of the piece against the step's checksums before it wrote
    them where the rank reads them (file_plan.CHECKED_SOURCE): hashing them again finds nothing."""
    return src.kind == CHECKED_SOURCE


def read_runs(src: Source, runs: Sequence[CopyRun], ranges: Sequence[tuple[int, int]], dest: np.ndarray) -> None:
    """pread the fragment's `ranges` (read_ranges of `runs`) and place each run into `dest`.

    A range that is exactly one run is read straight into `dest`; others go through one
    temporary buffer. The fragment's checksum is checked when the ranges happen to cover all of
    it, else the checksums of the chunks they touch (neither when the daemon checked them).
    """
    whole = bool(ranges) and ranges[0][0] == 0 and sum(n for _, n in ranges) == src.nbytes
    whole = whole and all(lo == plo + pn for (plo, pn), (lo, _) in zip(ranges, ranges[1:]))
    trusted = checked_by_daemon(src)
    hasher = xxhash.xxh3_64() if whole and src.checksum and not trusted else None
    partial = None if whole or trusted else _PartialCheck(src)
    buf = np.empty(0, dtype=np.uint8)  # grown to the longest range of several runs (<= READ_CHUNK)
    fd = open_piece(src)
    try:
        i = 0  # runs are in increasing order of src (copy_runs), so each range takes the next few
        for lo, n in ranges:
            j = i
            while j < len(runs) and runs[j].src < lo + n:
                j += 1
            group, i = runs[i:j], j
            if len(group) == 1 and group[0].src == lo and group[0].nbytes == n:
                data = dest[group[0].dst : group[0].dst + n]
                pread_exact(fd, data, src.offset + lo, src.path, hasher)
            else:
                if len(buf) < n:
                    buf = np.empty(n, dtype=np.uint8)
                data = buf[:n]
                pread_exact(fd, data, src.offset + lo, src.path, hasher)
                for r in group:
                    dest[r.dst : r.dst + r.nbytes] = data[r.src - lo : r.src - lo + r.nbytes]
            if partial is not None:
                partial.saw(lo, data)
    finally:
        os.close(fd)
    if hasher is not None:
        check_hash(src, hasher)
    if partial is not None:
        partial.finish()


def read_range(fd: int, src: Source, lo: int, out: np.ndarray) -> None:
    """pread the fragment's bytes [lo, lo + len(out)) from `fd` (open_piece of `src`) into
    `out`, checked as verify_span checks them (all of the fragment: hashed as it is read; a part:
    the chunks it touches, the edge chunks read through `fd`); unchecked when the daemon checked them.

    One call per piece and no descriptor of its own: a load of many row slices of a file reads
    each with a single pread (plus its edge chunks)."""
    whole = lo == 0 and len(out) == src.nbytes
    hasher = xxhash.xxh3_64() if whole and src.checksum and not checked_by_daemon(src) else None
    pread_exact(fd, out, src.offset + lo, src.path, hasher)
    if hasher is not None:
        check_hash(src, hasher)
    else:
        verify_span(src, lo, out, fd)


def open_piece(src: Source) -> int:
    try:
        fd = os.open(src.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # never through a link, never waiting on a FIFO
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"cannot read {src.path} (tensor {src.name!r}): it is a symbolic link, which ckptd never follows in a step (something other than the daemon put it there)") from None
        raise CheckpointError(f"cannot read {src.path} (tensor {src.name!r}): {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"cannot read {src.path} (tensor {src.name!r}): not a regular file (something other than the daemon put it there)")
    return fd


def pread_exact(fd: int, out: np.ndarray, offset: int, path: str, hasher: "xxhash.xxh3_64 | None" = None) -> None:
    """Fill `out` (a flat uint8 array) with the file's bytes from `offset`, READ_CHUNK at a time,
    or HASH_SLICE at a time into `hasher` when one is given."""
    step = READ_CHUNK if hasher is None else HASH_SLICE
    done = 0
    while done < len(out):
        piece = memoryview(out[done : done + min(step, len(out) - done)])
        got = os.preadv(fd, [piece], offset + done)
        if got == 0:
            raise CheckpointError(f"{path} ends before byte {offset + done}: the file is truncated")
        if hasher is not None:
            hasher.update(piece[:got])
        done += got


def check_hash(src: Source, hasher: "xxhash.xxh3_64") -> None:
    """Raise CheckpointError naming the tensor and file if the hash differs from the index's checksum."""
    actual = checksum_name(hasher.intdigest())
    if src.checksum and actual != src.checksum:
        raise CheckpointError(
            f"checksum mismatch for tensor {src.name!r} in {Path(src.path).name} at byte {src.offset} ({src.nbytes} bytes): expected "
            f"{src.checksum}, read {actual}; the file is damaged — load an older step"
        )


def verify_span(src: Source, lo: int, data: np.ndarray, fd: int | None = None) -> None:
    """Check the fragment's bytes [lo, lo + len(data)) as read: against the fragment's checksum
    when they are all of it (and the index has that checksum), else against the checksums of
    the chunks they touch (the chunks cut at the edges read whole, through `fd` when given).
    Nothing for bytes the daemon checked."""
    if checked_by_daemon(src):
        return
    if src.checksum and lo == 0 and len(data) == src.nbytes:
        hasher = xxhash.xxh3_64()
        hasher.update(memoryview(data))
        check_hash(src, hasher)
        return
    check = _PartialCheck(src)
    check.saw(lo, data)
    check.finish(fd)


class _PartialCheck:
    """Checks what a read of part of a fragment saw against the chunk checksums of the index:
    each chunk wholly inside a range read as soon as it is seen, the chunks cut at the ranges'
    edges by reading them whole at the end. Without chunk checksums (an index written before
    they existed) it checks nothing."""

    def __init__(self, src: Source) -> None:
        self.src = src
        try:
            self.chunks = ChunkCheck(src.nbytes, src.chunk_bytes, src.chunk_xxh3) if src.chunk_bytes else None
        except ValueError as exc:
            raise CheckpointError(f"the index's chunk checksums of tensor {src.name!r} in {Path(src.path).name} are malformed: {exc}") from None
        self.checked: set[int] = set()
        self.edges: set[int] = set()

    def saw(self, lo: int, data: np.ndarray) -> None:
        """`data`: the fragment's bytes [lo, lo + len(data)) as read from the file."""
        if self.chunks is None:
            return
        inner, edges = self.chunks.split(lo, len(data))
        for chunk in inner:
            begin, end = self.chunks.span(chunk)
            self._compare(chunk, digest_of(memoryview(data[begin - lo : end - lo])))
        self.checked.update(inner)
        self.edges.update(edges)

    def finish(self, fd: int | None = None) -> None:
        """Read and check the chunks cut by the ranges seen (through `fd`, open_piece of the
        piece, when given; else through a descriptor of its own)."""
        todo = sorted(self.edges - self.checked) if self.chunks is not None else []
        if not todo:
            return
        assert self.chunks is not None
        own = fd is None
        if fd is None:
            fd = open_piece(self.src)
        try:
            for chunk in todo:
                begin, end = self.chunks.span(chunk)
                buf = np.empty(end - begin, dtype=np.uint8)
                pread_exact(fd, buf, self.src.offset + begin, self.src.path)
                self._compare(chunk, digest_of(memoryview(buf)))
        finally:
            if own:
                os.close(fd)

    def _compare(self, chunk: int, actual: str) -> None:
        assert self.chunks is not None
        if actual != self.chunks.expected(chunk):
            begin, end = self.chunks.span(chunk)
            raise CheckpointError(
                f"checksum mismatch for tensor {self.src.name!r} in {Path(self.src.path).name} at bytes "
                f"[{self.src.offset + begin}, {self.src.offset + end}) (chunk {chunk} of the fragment): expected "
                f"{CHECKSUM_PREFIX}{self.chunks.expected(chunk)}, read {CHECKSUM_PREFIX}{actual}; the file is damaged — load an older step"
            )


def read_framed_rows(src: Source, frames: Frames, dtype: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) (along dim 0) of codes of this dtype and shape stored as zstd frames of
    whole rows: reads and checks the frames that hold them, decompresses those frames."""
    if frames.nbytes != src.nbytes:
        raise CheckpointError(
            f"piece of tensor {src.name!r} in {Path(src.path).name} has {src.nbytes} bytes but its frames end at "
            f"{frames.nbytes}; the index and the data disagree — load an older step"
        )
    row_bytes = dtypes.nbytes(dtype, shape[1:])
    try:
        f0, f1, begin, end = frames.span(r0, r1)
        rows = decompress(read_span(src, begin, end - begin), frames, f0, f1, row_bytes, shape[0])
    except FrameError as exc:
        raise CheckpointError(f"tensor {src.name!r} in {Path(src.path).name}: {exc}; load an older step") from None
    first = r0 - f0 * frames.rows
    rows = rows[first * row_bytes : (first + r1 - r0) * row_bytes]
    return torch.from_numpy(rows).view(getattr(torch, dtypes.torch_name(dtype))).view((r1 - r0, *shape[1:]))


def read_rows(src: Source, dtype: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) (along dim 0) of a stored tensor of this dtype and shape, as a tensor; the
    checksum is verified when all rows are read."""
    expected = dtypes.nbytes(dtype, shape)
    if src.nbytes != expected:
        raise CheckpointError(
            f"piece of tensor {src.name!r} in {Path(src.path).name} has {src.nbytes} bytes but {dtype}{list(shape)} needs "
            f"{expected}; the index and the data disagree — load an older step"
        )
    if not shape:
        r0, r1, row_bytes = 0, 1, expected
    else:
        row_bytes = dtypes.nbytes(dtype, shape[1:])
    out = read_span(src, r0 * row_bytes, (r1 - r0) * row_bytes)
    stored = getattr(torch, dtypes.torch_name(dtype))
    return torch.from_numpy(out).view(stored).view((r1 - r0, *shape[1:]) if shape else ())


def read_span(src: Source, lo: int, nbytes: int) -> np.ndarray:
    """Bytes [lo, lo + nbytes) of the stored piece, read and checked (read_range)."""
    out = np.empty(nbytes, dtype=np.uint8)
    fd = open_piece(src)
    try:
        read_range(fd, src, lo, out)
    finally:
        os.close(fd)
    return out
