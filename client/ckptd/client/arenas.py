"""The daemon's shared-memory arenas as this process maps them, and chunked copies through them.

A save copies a rank's CPU tensors into an arena (ckptd.client.arena_copy); a load from the
daemon's memory copies out of one (ckptd.client.reader.fill). Both map each arena once
(`ArenaMaps`) and reuse the mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

CHUNK = 32 * 2**20
# Arenas mapped at once, at most. A load from a snapshot held in the daemon's memory maps the
# arena of every local rank that saved it (a node of 16 ranks resharded: 16, and the rank's own
# two); more are arenas the daemon has replaced, whose files are dropped first.
MAX_MAPPINGS = 32
SPLIT_BYTES = 4 * 2**20  # whole pieces below this are copied or read in batches, not one task each


def byte_view(t: torch.Tensor) -> np.ndarray | None:
    """A writable flat uint8 numpy view of a contiguous CPU tensor's memory, else None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.reshape(-1).view(torch.uint8).numpy()


class ArenaMaps:
    """The arenas this process has mapped, by path; each is mapped once and reused.

    A mapping is "cold" until a copy has gone through it: its pages are not in this process's
    page tables yet, so copies populate them chunk by chunk first (see CopyTask and
    ckptd.client.arena_copy). On a warm
    mapping that would only cost time.

    Thread-safe: a client's warm-up (ckptd.client.arena_warm) maps an arena on its own thread.
    """

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._warm: set[str] = set()
        self._addresses: dict[str, tuple[mmap.mmap, int]] = {}
        self._ids: dict[str, tuple[int, int]] = {}  # path -> (device, inode) of the file mapped
        self._lock = threading.RLock()

    def is_cold(self, path: str) -> bool:
        with self._lock:
            return path not in self._warm

    def mark_warm(self, path: str) -> None:
        with self._lock:
            if path in self._maps:
                self._warm.add(path)

    def get(self, path: str, size: int | None = None) -> mmap.mmap:
        """The mapping of the file at `path` (at least `size` bytes): the one made before while
        `path` still names that very file (device and inode), else a new one. A name alone is
        never trusted: a daemon restarted under the same pid (a container's pid 1) makes its
        arenas under the names its earlier run used, and a copy through the earlier file's
        mapping would have gone where the daemon never reads."""
        with self._lock:
            mm = self._maps.get(path)
            if mm is not None and (size is None or len(mm) >= size) and file_id(path) == self._ids.get(path):
                return mm
            if mm is not None:
                self._drop(path)
            fd = os.open(path, os.O_RDWR)
            try:
                st = os.fstat(fd)
                mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._maps[path] = mm
            self._ids[path] = (st.st_dev, st.st_ino)
            for gone in [p for p in self._maps if p != path and file_id(p) != self._ids[p]]:  # arenas the daemon removed or replaced
                self._drop(gone)
            while len(self._maps) > MAX_MAPPINGS:  # the oldest
                self._drop(next(iter(self._maps)))
            return mm

    def address(self, path: str, size: int | None = None) -> int:
        """The address of the mapping of `path` (`get` semantics); valid while it stays mapped,
        that is until `close`, until its file is removed or replaced and another arena is mapped,
        or until more than MAX_MAPPINGS other arenas have been mapped since."""
        with self._lock:
            mm = self.get(path, size)
            found = self._addresses.get(path)
            if found is None or found[0] is not mm:
                found = self._addresses[path] = (mm, ctypes.addressof(ctypes.c_char.from_buffer(mm)) if len(mm) else 0)
            return found[1]

    def _drop(self, path: str) -> None:
        self._warm.discard(path)
        self._addresses.pop(path, None)
        self._ids.pop(path, None)
        mm = self._maps.pop(path)
        try:
            mm.close()
        except BufferError:
            pass  # still viewed by a copy in progress; unmapped when that view goes away

    def close(self) -> None:
        with self._lock:
            for path in list(self._maps):
                self._drop(path)


def file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file `path` names now, None when it names none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


# madvise(2) advice that maps a range's pages for writing in one call (Linux >= 5.14). A fresh mapping of
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

    def run(self) -> None:
        if self.arena is not None and len(self.src):
            try:
                start = self.offset - self.offset % mmap.PAGESIZE
                self.arena.madvise(MADV_POPULATE_WRITE, start, self.offset + len(self.src) - start)
            except OSError:
                pass  # kernel without MADV_POPULATE_*: the copy faults the pages in instead
        np.copyto(self.dst, self.src)


def chunk_tasks(dst: np.ndarray, src: np.ndarray, arena: mmap.mmap | None = None, offset: int = 0) -> list[CopyTask]:
    return [
        CopyTask(dst[i : i + CHUNK], src[i : i + CHUNK], arena, offset + i) for i in range(0, len(src), CHUNK)
    ]
