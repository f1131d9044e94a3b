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
    """The arenas this process has mapped, by path; each is mapped once and reused."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def get(self, path: str, size: int | None = None) -> mmap.mmap:
        mm = self._maps.get(path)
        if mm is not None and (size is None or len(mm) >= size):
            return mm
        if mm is not None:
            self._drop(path)
        fd = os.open(path, os.O_RDWR)
        try:
            length = os.fstat(fd).st_size
            # MAP_POPULATE maps every page now, in one go, instead of one fault per page during the copy.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, length, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._maps[path] = mm
        if len(self._maps) > 8:  # arenas replaced by the daemon: unmap the oldest
            self._drop(next(iter(self._maps)))
        return mm

    def _drop(self, path: str) -> None:
        mm = self._maps.pop(path)
        try:
            mm.close()
        except BufferError:
            pass  # still viewed by a copy in progress; unmapped when that view goes away

    def close(self) -> None:
        for path in list(self._maps):
            self._drop(path)


@dataclass(frozen=True)
class CopyTask:
    """Copy `src` bytes into `dst` (both flat uint8 arrays of the same length)."""

    dst: np.ndarray
    src: np.ndarray


def _chunks(dst: np.ndarray, src: np.ndarray) -> list[CopyTask]:
    return [CopyTask(dst[i : i + CHUNK], src[i : i + CHUNK]) for i in range(0, len(src), CHUNK)]


def _run_copies(pool: ThreadPoolExecutor, tasks: list[CopyTask]) -> None:
    for future in [pool.submit(np.copyto, t.dst, t.src) for t in tasks]:
        future.result()


def copy_to_arena(pool: ThreadPoolExecutor, arena: mmap.mmap, placements: Sequence[tuple[torch.Tensor, int, int]]) -> None:
    """Copy each (tensor, offset, nbytes) into the arena at `offset`."""
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
            tasks += _chunks(dst, src)
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


def fill_from_sources(
    pool: ThreadPoolExecutor, maps: ArenaMaps, target: torch.Tensor, want: Box, sources: Sequence[Source]
) -> None:
    """Fill `target` (holding box `want` of its logical tensor) from fragments that cover it."""
    jobs = []
    for src in sources:
        common = intersect(src.box, want)
        if common is None:
            continue
        dst_bytes = byte_view(target)
        whole = src.box == want and dst_bytes is not None and src.dtype == dtypes.from_torch_name(str(target.dtype))
        if whole and src.kind == "shm":
            arena = maps.get(src.path, src.offset + src.nbytes)
            tasks = _chunks(dst_bytes, np.frombuffer(arena, dtype=np.uint8, count=src.nbytes, offset=src.offset))
            jobs += [pool.submit(np.copyto, t.dst, t.src) for t in tasks]
        elif whole:
            jobs.append(pool.submit(_read_verified, src, dst_bytes))
        else:
            jobs.append(pool.submit(_fill_part, maps, src, common, target, want))
    for job in jobs:
        job.result()


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
