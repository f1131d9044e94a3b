"""Copies between a rank's CPU tensors and an arena mapping, planned once and run many times.

A save copies the same tensors to the same arena offsets again and again (ckptd.client.structure
keeps what does not change between saves). `CopyPlan` splits that work once into `workers`
groups of about equal bytes, in arena order: small contiguous tensors stay whole and are copied
by one `copy_many` call per group (ckptd.common._copy: one C loop with the GIL released, no
Python and no OpenMP region per tensor); tensors of `SPLIT_BYTES` or more are cut into chunks
copied with the GIL released, so a few large tensors still spread over every core. Once a plan
moves `STREAM_MIN_BYTES` or more, both are copied with streaming stores: pieces of a few MiB
copied by memcpy pay a read of every destination line first, about a third more time than the
same bytes copied at once (measured in _copy.c's comment). Running the plan costs a few Python
calls per group and one data_ptr() per small tensor: one group runs on the calling thread, the
others on the client's copy pool.
"""

from __future__ import annotations

import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ckptd.client.arenas import MADV_POPULATE_WRITE, SPLIT_BYTES  # tensors from SPLIT_BYTES up go in chunks
from ckptd.common._copy import copy_many, stream_copy

CHUNK_BYTES = 16 * 2**20  # largest chunk
MIN_CHUNK_BYTES = 2**20  # smallest chunk (but the last one of a tensor)
MIN_PARALLEL_BYTES = 512 * 2**10  # below this in all, one group: a thread hand-off costs more than it saves
STREAM_MIN_BYTES = 64 * 2**20  # from this in all, chunks bypass the cache (a smaller copy may stay in the L3)


@dataclass
class _Group:
    """One worker's share: small tensors copied by one copy_many call, then chunks of large ones."""

    small_index: list[int] = field(default_factory=list)  # indices into the sources (contiguous ones)
    small_offsets: list[int] = field(default_factory=list)  # their arena offsets
    small_sizes: list[int] = field(default_factory=list)  # their bytes
    chunks: list[tuple[int, int, int, np.ndarray]] = field(default_factory=list)  # (index, start, stop, arena bytes)
    strided: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # non-contiguous sources: one torch copy each
    span: tuple[int, int] = (0, 0)  # [first, last) arena byte this group writes (to populate a cold mapping)
    nbytes: int = 0


class CopyPlan:
    """The copies of sources[i] into arena bytes [offsets[i], offsets[i] + nbytes[i]).

    Built from the sources' shapes, dtypes and strides (`like`); `run` takes the tensors of
    each save, which must have those same shapes, dtypes and strides (ckptd.client.structure
    guarantees it: a plan is reused only for a state of the same structure). CPU tensors only.
    streaming: copy chunks with streaming stores; None: when the plan moves STREAM_MIN_BYTES or more.
    """

    def __init__(self, arena: mmap.mmap, like: Sequence[torch.Tensor], offsets: Sequence[int], workers: int,
                 streaming: bool | None = None) -> None:
        self.arena = arena
        self.count = len(like)
        flat = torch.frombuffer(arena, dtype=torch.uint8) if len(arena) else torch.empty(0, dtype=torch.uint8)
        raw = np.frombuffer(arena, dtype=np.uint8)
        total = sum(t.numel() * t.element_size() for t in like)
        groups = max(1, min(workers, total // MIN_PARALLEL_BYTES if total >= MIN_PARALLEL_BYTES else 1))
        target = -(-total // groups) if total else 1
        self.groups: list[_Group] = [_Group()]
        for i, (t, offset) in enumerate(zip(like, offsets)):
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue
            if not t.is_contiguous():
                group = self._take(target, groups, nbytes, offset)
                group.strided.append((i, flat[offset : offset + nbytes].view(t.dtype).view(t.shape)))
            elif nbytes < SPLIT_BYTES:
                group = self._take(target, groups, nbytes, offset)
                group.small_index.append(i)
                group.small_offsets.append(offset)
                group.small_sizes.append(nbytes)
            else:  # cut where the current group is full, so groups end up with about equal bytes
                start = 0
                while start < nbytes:
                    room = target - self.groups[-1].nbytes
                    if room < MIN_CHUNK_BYTES and len(self.groups) < groups:
                        room = target
                    stop = min(nbytes, start + max(MIN_CHUNK_BYTES, min(room, CHUNK_BYTES)))
                    group = self._take(target, groups, stop - start, offset + start)
                    group.chunks.append((i, start, stop, raw[offset + start : offset + stop]))
                    start = stop
        self.groups = [g for g in self.groups if g.nbytes]
        self.streaming = total >= STREAM_MIN_BYTES if streaming is None else streaming

    def _take(self, target: int, groups: int, nbytes: int, offset: int) -> _Group:
        """The group that gets the next `nbytes` at arena `offset` (a new one once this is full)."""
        group = self.groups[-1]
        if group.nbytes >= target and len(self.groups) < groups:
            group = _Group()
            self.groups.append(group)
        if not group.nbytes:
            group.span = (offset, offset + nbytes)
        group.span = (min(group.span[0], offset), max(group.span[1], offset + nbytes))
        group.nbytes += nbytes
        return group

    def run(self, pool: ThreadPoolExecutor, sources: Sequence[torch.Tensor], cold: bool = False) -> None:
        """Copy `sources` (same structure as the plan's `like`) into the arena; returns when done.

        cold: the mapping is new in this process: each group first maps its range's pages in one
        madvise call (a page fault per 4 KiB otherwise costs more than the copy)."""
        if len(sources) != self.count:
            raise ValueError(f"copy plan for {self.count} tensors run with {len(sources)}")
        futures: list[Future[None]] = [pool.submit(self._run_group, g, sources, cold) for g in self.groups[1:]]
        try:
            if self.groups:
                self._run_group(self.groups[0], sources, cold)
        finally:
            for f in futures:  # every copy has ended before the arena may be handed back
                f.result()

    def _run_group(self, group: _Group, sources: Sequence[torch.Tensor], cold: bool) -> None:
        if cold:
            _populate(self.arena, *group.span)
        if group.small_index:  # the sources have the plan's shapes and strides (contiguous): their bytes
            copy_many(self.arena, group.small_offsets, [sources[i].data_ptr() for i in group.small_index], group.small_sizes, self.streaming)
        for i, dst in group.strided:
            dst.copy_(sources[i])
        if group.chunks:
            copy = stream_copy if self.streaming else np.copyto
            views: dict[int, np.ndarray] = {}
            for i, start, stop, dst_bytes in group.chunks:
                src = views.get(i)
                if src is None:
                    src = views[i] = sources[i].reshape(-1).view(torch.uint8).numpy()
                copy(dst_bytes, src[start:stop])


def _populate(arena: mmap.mmap, start: int, stop: int) -> None:
    begin = start - start % mmap.PAGESIZE
    if stop <= begin:
        return
    try:
        arena.madvise(MADV_POPULATE_WRITE, begin, stop - begin)
    except OSError:
        pass  # kernel < 5.14: the copy faults the pages in instead, page by page
