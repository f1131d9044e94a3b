"""Moving tensor bytes between a trainer's tensors and the daemon's shared memory or files.

Copies are split into chunks and run on a few threads (numpy releases the GIL while it
copies), so a hand-off runs at memory bandwidth. Reads of committed files go straight into
the target tensors with pread and are checked against the index's xxh3 checksums.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import xxhash

from ckptd.client.errors import CheckpointError
from ckptd.common import dtypes
from ckptd.common.boxes import Box, intersect, relative

CHUNK = 32 * 2**20
READ_CHUNK = 64 * 2**20


def byte_view(t: torch.Tensor) -> np.ndarray | None:
    """A writable flat uint8 numpy view of a contiguous CPU tensor's memory, else None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.reshape(-1).view(torch.uint8).numpy()


class ArenaMaps:
    """The arenas this process has mapped, by path; each is mapped once and reused.

    A mapping is "cold" until a copy has gone through it: its pages are not in this process's
    page tables yet, so copies populate them chunk by chunk first (see CopyTask). On a warm
    mapping that would only cost time.
    """

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._warm: set[str] = set()

    def is_cold(self, path: str) -> bool:
        return path not in self._warm

    def mark_warm(self, path: str) -> None:
        if path in self._maps:
            self._warm.add(path)

    def get(self, path: str, size: int | None = None) -> mmap.mmap:
        mm = self._maps.get(path)
        if mm is not None and (size is None or len(mm) >= size):
            return mm
        if mm is not None:
            self._drop(path)
        fd = os.open(path, os.O_RDWR)
        try:
            length = os.fstat(fd).st_size
            mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._maps[path] = mm
        if len(self._maps) > 8:  # arenas replaced by the daemon: unmap the oldest
            self._drop(next(iter(self._maps)))
        return mm

    def _drop(self, path: str) -> None:
        self._warm.discard(path)
        mm = self._maps.pop(path)
        try:
            mm.close()
        except BufferError:
            pass  # still viewed by a copy in progress; unmapped when that view goes away

    def close(self) -> None:
        for path in list(self._maps):
            self._drop(path)


# madvise(2) advice that maps a range's pages in one call (Linux >= 5.14). A fresh mapping of
# an arena otherwise takes one page fault per 4 KiB during the copy, which costs more than the
# copy itself; populating chunk by chunk on the copying threads spreads that work over cores.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23


@dataclass(frozen=True)
class CopyTask:
    """Copy `src` bytes into `dst` (both flat uint8 arrays of the same length).

    `arena`, `offset`: the arena range (of the same length) to populate first, if any.
    """

    dst: np.ndarray
    src: np.ndarray
    arena: mmap.mmap | None = None
    offset: int = 0
    advice: int = MADV_POPULATE_WRITE

    def run(self) -> None:
        if self.arena is not None and len(self.src):
            try:
                start = self.offset - self.offset % mmap.PAGESIZE
                self.arena.madvise(self.advice, start, self.offset + len(self.src) - start)
            except OSError:
                pass  # kernel without MADV_POPULATE_*: the copy faults the pages in instead
        np.copyto(self.dst, self.src)


def _chunks(dst: np.ndarray, src: np.ndarray, arena: mmap.mmap | None = None, offset: int = 0, advice: int = MADV_POPULATE_WRITE) -> list[CopyTask]:
    return [
        CopyTask(dst[i : i + CHUNK], src[i : i + CHUNK], arena, offset + i, advice) for i in range(0, len(src), CHUNK)
    ]


def _run_copies(pool: ThreadPoolExecutor, tasks: list[CopyTask]) -> None:
    for future in [pool.submit(t.run) for t in tasks]:
        future.result()


def copy_to_arena(
    pool: ThreadPoolExecutor, arena: mmap.mmap, placements: Sequence[tuple[torch.Tensor, int, int]], cold: bool
) -> None:
    """Copy each (tensor, offset, nbytes) into the arena at `offset` (`cold`: a fresh mapping)."""
    tasks = []
    for tensor, offset, nbytes in placements:
        if nbytes != tensor.numel() * tensor.element_size():
            raise CheckpointError(f"slot of {nbytes} bytes for a tensor of {tensor.numel() * tensor.element_size()} bytes")
        if nbytes == 0:
            continue
        dst = np.frombuffer(arena, dtype=np.uint8, count=nbytes, offset=offset)
        src = byte_view(tensor)
        if src is None:  # non-contiguous or not on the CPU: let torch gather it
            target = torch.from_numpy(dst).view(tensor.dtype).view(tensor.shape)
            target.copy_(tensor)
        else:
            tasks += _chunks(dst, src, arena if cold else None, offset, MADV_POPULATE_WRITE)
    _run_copies(pool, tasks)


@dataclass(frozen=True)
class Source:
    """Where a fragment's bytes are: an arena ("shm") or a committed file ("file")."""

    name: str  # the logical tensor, for messages
    kind: str
    path: str
    offset: int
    nbytes: int
    box: Box
    dtype: str
    checksum: str


@dataclass(frozen=True)
class Fill:
    """Fill `target`, which holds box `want` of its logical tensor, from fragments that cover it."""

    target: torch.Tensor
    want: Box
    sources: Sequence[Source]


def fill_all(pool: ThreadPoolExecutor, maps: ArenaMaps, fills: Sequence[Fill]) -> None:
    """Run every fill's copies and reads on the pool at once, then wait for all of them."""
    _prefetch([src for fill in fills for src in fill.sources if src.kind == "file"])
    jobs = []
    for fill in fills:
        for src in fill.sources:
            common = intersect(src.box, fill.want)
            if common is None:
                continue
            dst_bytes = byte_view(fill.target)
            same_dtype = src.dtype == dtypes.from_torch_name(str(fill.target.dtype))
            whole = src.box == fill.want and dst_bytes is not None and same_dtype
            if whole and src.kind == "shm":
                arena = maps.get(src.path, src.offset + src.nbytes)
                raw = np.frombuffer(arena, dtype=np.uint8, count=src.nbytes, offset=src.offset)
                populate = arena if maps.is_cold(src.path) else None
                jobs += [pool.submit(t.run) for t in _chunks(dst_bytes, raw, populate, src.offset, MADV_POPULATE_READ)]
            elif whole:
                jobs.append(pool.submit(_read_verified, src, dst_bytes))
            else:
                jobs.append(pool.submit(_fill_part, maps, src, common, fill.target, fill.want))
    for job in jobs:
        job.result()
    for fill in fills:
        for src in fill.sources:
            if src.kind == "shm":
                maps.mark_warm(src.path)


def _prefetch(sources: Sequence[Source]) -> None:
    """Ask the kernel to start reading every needed byte range now (POSIX_FADV_WILLNEED), so the
    disk works on all of them while the reading threads wait on the first ones."""
    ranges: dict[str, tuple[int, int]] = {}
    for src in sources:
        lo, hi = ranges.get(src.path, (src.offset, src.offset + src.nbytes))
        ranges[src.path] = (min(lo, src.offset), max(hi, src.offset + src.nbytes))
    for path, (lo, hi) in ranges.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # reported by the read itself, with the tensor's name
        try:
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _fill_part(maps: ArenaMaps, src: Source, common: Box, target: torch.Tensor, want: Box) -> None:
    if src.kind == "shm":
        raw = np.frombuffer(maps.get(src.path, src.offset + src.nbytes), dtype=np.uint8, count=src.nbytes, offset=src.offset)
    else:
        raw = np.empty(src.nbytes, dtype=np.uint8)
        _read_verified(src, raw)
    dtype = getattr(torch, dtypes.torch_name(src.dtype))
    fragment = torch.from_numpy(raw).view(dtype).view(src.box.lengths)
    target[relative(common, want)].copy_(fragment[relative(common, src.box)])


def _read_verified(src: Source, out: np.ndarray) -> None:
    """pread `src` into `out` and check its checksum; raise CheckpointError naming the file on a mismatch."""
    hasher = xxhash.xxh3_64()
    try:
        fd = os.open(src.path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"cannot read {src.path}: {exc.strerror}") from None
    try:
        done = 0
        while done < src.nbytes:
            n = min(READ_CHUNK, src.nbytes - done)
            view = memoryview(out[done : done + n])
            got = os.preadv(fd, [view], src.offset + done)
            if got == 0:
                raise CheckpointError(f"{src.path} ends before byte {src.offset + done}: the file is truncated")
            hasher.update(view[:got])
            done += got
    finally:
        os.close(fd)
    actual = f"xxh3-64:{hasher.intdigest():016x}"
    if src.checksum and actual != src.checksum:
        raise CheckpointError(
            f"checksum mismatch for tensor {src.name!r} in {Path(src.path).name} at byte {src.offset} ({src.nbytes} bytes): expected "
            f"{src.checksum}, read {actual}; the file is damaged — load an older step"
        )
