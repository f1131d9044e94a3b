"""Moving tensor bytes between a trainer's tensors and the daemon's shared memory or files.

Copies are split into chunks and run on a few threads (numpy releases the GIL while it
copies), so a hand-off runs at memory bandwidth. Reads of committed files go straight into
the target tensors with pread and are checked against the index's xxh3 checksums. A target
that wants only part of a fragment (resharding) gets only the byte ranges it needs (see
ckptd.common.reshard), checked against the checksums of the fragment's chunks they touch (see
ckptd.common.chunks).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence, TypeVar

import numpy as np
import torch
import xxhash

from ckptd.client.errors import CheckpointError
from ckptd.common import dtypes
from ckptd.common.boxes import Box, intersect, relative
from ckptd.common.chunks import HASH_SLICE, ChunkCheck, digest_of
from ckptd.common.frames import Frames, FrameError, decompress
from ckptd.common.reshard import CopyRun, copy_runs, read_ranges, run_count

CHUNK = 32 * 2**20
SPLIT_BYTES = 4 * 2**20  # whole pieces below this are copied or read in batches, not one task each
BATCHES = max(2, os.cpu_count() or 1)  # batches of small pieces per fill
READ_CHUNK = 64 * 2**20
MANY_RUNS = 32  # above this, runs are placed by one strided torch copy, not one by one
T = TypeVar("T")


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (memoized: loads ask once per tensor)."""
    return dtypes.from_torch_name(str(dtype))


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
    """

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._warm: set[str] = set()
        self._addresses: dict[str, tuple[mmap.mmap, int]] = {}

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

    def address(self, path: str, size: int | None = None) -> int:
        """The address of the mapping of `path` (`get` semantics); valid while it stays mapped,
        that is until `close`, or until more than 8 other arenas have been mapped since."""
        mm = self.get(path, size)
        found = self._addresses.get(path)
        if found is None or found[0] is not mm:
            found = self._addresses[path] = (mm, ctypes.addressof(ctypes.c_char.from_buffer(mm)) if len(mm) else 0)
        return found[1]

    def _drop(self, path: str) -> None:
        self._warm.discard(path)
        self._addresses.pop(path, None)
        mm = self._maps.pop(path)
        try:
            mm.close()
        except BufferError:
            pass  # still viewed by a copy in progress; unmapped when that view goes away

    def close(self) -> None:
        for path in list(self._maps):
            self._drop(path)


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


def _chunks(dst: np.ndarray, src: np.ndarray, arena: mmap.mmap | None = None, offset: int = 0) -> list[CopyTask]:
    return [
        CopyTask(dst[i : i + CHUNK], src[i : i + CHUNK], arena, offset + i) for i in range(0, len(src), CHUNK)
    ]


class Source(NamedTuple):
    """Where a fragment's bytes are: an arena ("shm") or a committed file ("file").

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


@dataclass(frozen=True)
class Fill:
    """Fill `target`, which holds box `want` of its logical tensor, from fragments that cover it."""

    target: torch.Tensor
    want: Box
    sources: Sequence[Source]


def fill_all(pool: ThreadPoolExecutor, maps: ArenaMaps, fills: Sequence[Fill]) -> None:
    """Run every fill's copies and reads on the pool at once, then wait for all of them."""
    wholes: list[tuple[Source, torch.Tensor]] = []  # a whole fragment into a plain (contiguous CPU) target
    parts: list[_Part] = []
    decoded: list[tuple[Source, Fill, Box]] = []
    for fill in fills:
        if fill.sources and tuple(fill.target.shape) != fill.want.lengths:
            raise CheckpointError(
                f"the target for tensor {fill.sources[0].name!r} has shape {list(fill.target.shape)} but the wanted box "
                f"{fill.want} has lengths {list(fill.want.lengths)}; pass a target of the wanted box's shape"
            )
        target = fill.target
        plain = target.device.type == "cpu" and target.is_contiguous() and target.numel() > 0  # byte_view would work
        for src in fill.sources:
            common = intersect(src.box, fill.want)
            if common is None:
                continue
            if src.decode is not None:
                decoded.append((src, fill, common))
                continue
            direct = plain and src.dtype == _dtype_name(target.dtype)
            if direct and src.box == fill.want:
                wholes.append((src, target))
            elif run_count(src.box, fill.want if direct else common) > MANY_RUNS:
                parts.append(_Part(src, common, fill, [], direct, strided=True))
            else:
                runs = copy_runs(src.box, fill.want if direct else common, dtypes.itemsize(src.dtype))
                parts.append(_Part(src, common, fill, runs, direct))
    # Only the scattered ranges of parts: whole fragments are read front to back, which the
    # kernel's readahead follows. Advising them too made a cold 1 GiB restore slower (0.38-0.46 s
    # against 0.35-0.42 s): the advice allocates and submits every page up front, on this thread.
    _prefetch([(p.src.path, p.src.offset + lo, n) for p in parts if p.src.kind == "file" for lo, n in p.ranges()])
    jobs = []
    small_files: list[tuple[Source, np.ndarray]] = []
    small_shm: list[tuple[int, int, int]] = []  # (target address, arena address, bytes)
    # files in file order: each front to back, as its readahead goes
    wholes = [w for w in wholes if w[0].kind == "shm"] + sorted((w for w in wholes if w[0].kind != "shm"), key=lambda w: (w[0].path, w[0].offset))
    for src, target in wholes:
        if src.kind == "shm" and src.nbytes < SPLIT_BYTES:
            if src.nbytes != target.numel() * target.element_size():
                raise CheckpointError(f"piece of tensor {src.name!r} has {src.nbytes} bytes for a target of {target.numel() * target.element_size()}")
            # a memmove by address: no view objects per tensor (the maps and `fills` keep both alive)
            small_shm.append((target.data_ptr(), maps.address(src.path, src.offset + src.nbytes) + src.offset, src.nbytes))
            continue
        dst_bytes = byte_view(target)
        assert dst_bytes is not None  # wholes are plain targets
        if src.kind == "shm" and maps.is_cold(src.path):
            # pread from the arena file: no page-table entries to create in this process, which
            # on a new mapping cost more than the copy itself (about 3x a memcpy against 1.5x)
            jobs += [pool.submit(_pread_shm, src, dst_bytes, i) for i in range(0, src.nbytes, CHUNK)]
        elif src.kind == "shm":
            raw = np.frombuffer(maps.get(src.path, src.offset + src.nbytes), dtype=np.uint8, count=src.nbytes, offset=src.offset)
            jobs += [pool.submit(t.run) for t in _chunks(dst_bytes, raw)]
        elif src.nbytes < SPLIT_BYTES:
            small_files.append((src, dst_bytes))
        else:
            jobs.append(pool.submit(_read_verified, src, dst_bytes))
    # small pieces in a few batches of about equal bytes, not one task each (a task costs more
    # than copying a small tensor)
    jobs += [pool.submit(_copy_batch, batch) for batch in _batches(small_shm, lambda p: p[2], BATCHES)]
    jobs += [pool.submit(_read_batch, batch) for batch in _batches(small_files, lambda p: p[0].nbytes, BATCHES)]
    jobs += [pool.submit(_fill_part, maps, part) for part in parts]
    jobs += [pool.submit(_fill_decoded, src, fill, common) for src, fill, common in decoded]
    for job in jobs:
        job.result()
    for fill in fills:
        for src in fill.sources:
            if src.kind == "shm":
                maps.mark_warm(src.path)  # only arenas this process mapped (parts) become warm


@dataclass(frozen=True)
class MemoryCopies:
    """A load from the daemon's memory reduced to memmoves: every fill is a whole fragment of
    under SPLIT_BYTES from an arena into a contiguous CPU target of its dtype. Made once for a
    plan that repeats (ckptd.client.client keeps it with the plan's fills); `run` checks first
    that every arena is still mapped where it was."""

    bases: tuple[tuple[str, int, int], ...]  # (arena path, bytes it must have, address when prepared)
    batches: tuple[tuple[tuple[int, int, int], ...], ...]  # (target address, arena address, bytes)
    keep: tuple[torch.Tensor, ...]  # the targets: their memory must stay while the addresses are used

    @staticmethod
    def prepare(maps: ArenaMaps, fills: Sequence[Fill]) -> "MemoryCopies | None":
        """The memmoves of `fills`, or None when any of them needs more than a memmove."""
        moves: list[tuple[int, int, int]] = []
        need: dict[str, int] = {}
        for fill in fills:
            if len(fill.sources) != 1:
                return None
            src, target = fill.sources[0], fill.target
            if (
                src.kind != "shm" or src.decode is not None or src.box != fill.want or src.nbytes >= SPLIT_BYTES
                or target.device.type != "cpu" or not target.is_contiguous() or src.dtype != _dtype_name(target.dtype)
                or src.nbytes != target.numel() * target.element_size()
            ):
                return None
            need[src.path] = max(need.get(src.path, 0), src.offset + src.nbytes)
            if src.nbytes:
                moves.append((target.data_ptr(), src.offset, src.nbytes, src.path))  # type: ignore[arg-type]
        bases = tuple((path, size, maps.address(path, size)) for path, size in need.items())
        where = {path: base for path, _, base in bases}
        resolved = [(dst, where[path] + offset, n) for dst, offset, n, path in moves]  # type: ignore[misc]
        batches = tuple(tuple(b) for b in _batches(resolved, lambda m: m[2], BATCHES))
        return MemoryCopies(bases, batches, tuple(f.target for f in fills))

    def run(self, pool: ThreadPoolExecutor, maps: ArenaMaps) -> bool:
        """Copy; False (nothing copied) when an arena is no longer mapped where it was."""
        if any(maps.address(path, size) != base for path, size, base in self.bases):
            return False
        for job in [pool.submit(_copy_batch, batch) for batch in self.batches]:
            job.result()
        return True


def _batches(items: Sequence[T], size: Callable[[T], int], count: int) -> list[list[T]]:
    """`items` in at most `count` runs of consecutive items of about equal total size."""
    if not items:
        return []
    target = -(-sum(size(i) for i in items) // count) or 1
    out: list[list[T]] = [[]]
    filled = 0
    for item in items:
        if filled >= target and len(out) < count:
            out.append([])
            filled = 0
        out[-1].append(item)
        filled += size(item)
    return out


def _copy_batch(moves: Sequence[tuple[int, int, int]]) -> None:
    """memmove each (destination address, source address, bytes); ctypes releases the GIL."""
    for dst, src, n in moves:
        ctypes.memmove(dst, src, n)


def _read_batch(pieces: Sequence[tuple[Source, np.ndarray]]) -> None:
    for src, dst in pieces:
        _read_verified(src, dst)


def _pread_shm(src: Source, dst: np.ndarray, start: int) -> None:
    """Copy bytes [start, start + CHUNK) of arena fragment `src` into `dst` by pread."""
    fd = _open(src)
    try:
        _pread_exact(fd, dst[start : start + CHUNK], src.offset + start, src.path)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Part:
    """The share of fragment `src` in `fill` (box `common`) when it is not one plain whole copy.

    `runs` move bytes of the fragment's data straight into the target's bytes when `direct`
    (a contiguous CPU target of the stored dtype), else into a temporary holding `common` in the
    stored dtype, which torch then copies into the target (strided, converting the dtype).
    """

    src: Source
    common: Box
    fill: Fill
    runs: list[CopyRun]  # empty when `strided`
    direct: bool
    strided: bool = False  # many runs: placed by one strided copy of the rows that hold them

    def ranges(self) -> list[tuple[int, int]]:
        """The (offset, nbytes) ranges of the fragment's data to read, each at most READ_CHUNK
        bytes unless a single run is longer (strided: the rows that hold the overlap)."""
        if self.strided:
            inside = relative(self.common, self.src.box)
            row_bytes = dtypes.nbytes(self.src.dtype, self.src.box.lengths[1:])
            return [(inside[0].start * row_bytes, (inside[0].stop - inside[0].start) * row_bytes)]
        return read_ranges(self.runs, max_len=READ_CHUNK)


def _prefetch(ranges: Sequence[tuple[str, int, int]]) -> None:
    """Ask the kernel to start reading every needed (path, offset, nbytes) range now
    (POSIX_FADV_WILLNEED), so the disk works on all of them while the reading threads wait on
    the first ones. Ranges of a file closer than 64 KiB are advised together."""
    by_path: dict[str, list[tuple[int, int]]] = {}
    for path, offset, nbytes in ranges:
        by_path.setdefault(path, []).append((offset, offset + nbytes))
    for path, spans in by_path.items():
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1] + 64 * 1024:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # reported by the read itself, with the tensor's name
        try:
            for lo, hi in merged:
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _fill_part(maps: ArenaMaps, part: _Part) -> None:
    """Place the part's runs (from the arena or from only the needed byte ranges of the file)."""
    src, fill = part.src, part.fill
    expected = dtypes.nbytes(src.dtype, src.box.lengths)
    if src.nbytes != expected:
        raise CheckpointError(
            f"piece of tensor {src.name!r} in {Path(src.path).name} has {src.nbytes} bytes but box {src.box} of {src.dtype} "
            f"needs {expected}; the index and the data disagree — load an older step"
        )
    if part.strided:
        _fill_strided(maps, part)
        return
    if part.direct:
        dest = byte_view(fill.target)
        assert dest is not None  # direct is only chosen for targets that have a byte view
    else:
        dest = np.empty(dtypes.nbytes(src.dtype, part.common.lengths), dtype=np.uint8)
    if src.kind == "shm":
        raw = np.frombuffer(maps.get(src.path, src.offset + src.nbytes), dtype=np.uint8, count=src.nbytes, offset=src.offset)
        for r in part.runs:
            dest[r.dst : r.dst + r.nbytes] = raw[r.src : r.src + r.nbytes]
    else:
        _read_runs(src, part.runs, part.ranges(), dest)
    if not part.direct:
        stored = getattr(torch, dtypes.torch_name(src.dtype))
        assembled = torch.from_numpy(dest).view(stored).view(part.common.lengths)
        fill.target[relative(part.common, fill.want)].copy_(assembled)


def _fill_strided(maps: ArenaMaps, part: _Part) -> None:
    """One strided torch copy instead of one copy per run (e.g. a column slice: a run per row).

    From a file, the fragment's rows that hold the overlap are mapped as one block (other columns
    included: neighbouring runs would be coalesced into the same reads anyway)."""
    src, fill = part.src, part.fill
    stored = getattr(torch, dtypes.torch_name(src.dtype))
    inside = relative(part.common, src.box)
    if src.kind == "shm":
        raw = np.frombuffer(maps.get(src.path, src.offset + src.nbytes), dtype=np.uint8, count=src.nbytes, offset=src.offset)
        block = torch.from_numpy(raw).view(stored).view(src.box.lengths)[inside]
        fill.target[relative(part.common, fill.want)].copy_(block)
        return
    # From a file: map the fragment's rows that hold the overlap and copy straight out of the
    # page cache; a temporary buffer would cost a fresh allocation and a second pass over the bytes.
    first, stop = inside[0].start, inside[0].stop
    row_bytes = dtypes.nbytes(src.dtype, src.box.lengths[1:])
    begin = src.offset + first * row_bytes
    length = (stop - first) * row_bytes
    start = begin - begin % mmap.ALLOCATIONGRANULARITY
    fd = _open(src)
    try:
        if os.fstat(fd).st_size < begin + length:
            raise CheckpointError(f"{src.path} ends before byte {begin + length}: the file is truncated")
        # private and writable only so that torch accepts the view (it warns on read-only
        # memory); nothing writes to it, so no page is ever copied
        mm = mmap.mmap(fd, begin + length - start, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    finally:
        os.close(fd)
    try:  # map every page in one call (read faults: no copy-on-write) instead of one fault per 64 KiB
        mm.madvise(MADV_POPULATE_READ)
    except OSError:
        mm.madvise(mmap.MADV_WILLNEED)  # kernel < 5.14: faults as the copy goes, after readahead
    # no explicit close: the mapping goes when the last view of it does (numpy holds an export)
    data = np.frombuffer(mm, dtype=np.uint8, count=length, offset=begin - start)
    _verify_span(src, first * row_bytes, data)
    rows = torch.from_numpy(data).view(stored).view((stop - first, *src.box.lengths[1:]))
    fill.target[relative(part.common, fill.want)].copy_(rows[(slice(None), *inside[1:])])


def _read_runs(src: Source, runs: Sequence[CopyRun], ranges: Sequence[tuple[int, int]], dest: np.ndarray) -> None:
    """pread the fragment's `ranges` (read_ranges of `runs`) and place each run into `dest`.

    A range that is exactly one run is read straight into `dest`; others go through one
    temporary buffer. The fragment's checksum is checked when the ranges happen to cover all of
    it, else the checksums of the chunks they touch.
    """
    whole = bool(ranges) and ranges[0][0] == 0 and sum(n for _, n in ranges) == src.nbytes
    whole = whole and all(lo == plo + pn for (plo, pn), (lo, _) in zip(ranges, ranges[1:]))
    hasher = xxhash.xxh3_64() if whole and src.checksum else None
    partial = None if whole else _PartialCheck(src)
    buf = np.empty(0, dtype=np.uint8)  # grown to the longest range of several runs (<= READ_CHUNK)
    fd = _open(src)
    try:
        i = 0  # runs are in increasing order of src (copy_runs), so each range takes the next few
        for lo, n in ranges:
            j = i
            while j < len(runs) and runs[j].src < lo + n:
                j += 1
            group, i = runs[i:j], j
            if len(group) == 1 and group[0].src == lo and group[0].nbytes == n:
                data = dest[group[0].dst : group[0].dst + n]
                _pread_exact(fd, data, src.offset + lo, src.path, hasher)
            else:
                if len(buf) < n:
                    buf = np.empty(n, dtype=np.uint8)
                data = buf[:n]
                _pread_exact(fd, data, src.offset + lo, src.path, hasher)
                for r in group:
                    dest[r.dst : r.dst + r.nbytes] = data[r.src - lo : r.src - lo + r.nbytes]
            if partial is not None:
                partial.saw(lo, data)
    finally:
        os.close(fd)
    if hasher is not None:
        _check(src, hasher)
    if partial is not None:
        partial.finish()


def _open(src: Source) -> int:
    try:
        fd = os.open(src.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # never through a link, never waiting on a FIFO
    except OSError as exc:
        raise CheckpointError(f"cannot read {src.path} (tensor {src.name!r}): {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"cannot read {src.path} (tensor {src.name!r}): not a regular file (something other than the daemon put it there)")
    return fd


def _pread_exact(fd: int, out: np.ndarray, offset: int, path: str, hasher: "xxhash.xxh3_64 | None" = None) -> None:
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


def _check(src: Source, hasher: "xxhash.xxh3_64") -> None:
    """Raise CheckpointError naming the tensor and file if the hash differs from the index's checksum."""
    actual = f"xxh3-64:{hasher.intdigest():016x}"
    if src.checksum and actual != src.checksum:
        raise CheckpointError(
            f"checksum mismatch for tensor {src.name!r} in {Path(src.path).name} at byte {src.offset} ({src.nbytes} bytes): expected "
            f"{src.checksum}, read {actual}; the file is damaged — load an older step"
        )


def _verify_span(src: Source, lo: int, data: np.ndarray) -> None:
    """Check the fragment's bytes [lo, lo + len(data)) as read: against the fragment's checksum
    when they are all of it (and the index has that checksum), else against the checksums of
    the chunks they touch."""
    if src.checksum and lo == 0 and len(data) == src.nbytes:
        hasher = xxhash.xxh3_64()
        hasher.update(memoryview(data))
        _check(src, hasher)
        return
    check = _PartialCheck(src)
    check.saw(lo, data)
    check.finish()


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

    def finish(self) -> None:
        """Read and check the chunks cut by the ranges seen."""
        todo = sorted(self.edges - self.checked) if self.chunks is not None else []
        if not todo:
            return
        assert self.chunks is not None
        fd = _open(self.src)
        try:
            for chunk in todo:
                begin, end = self.chunks.span(chunk)
                buf = np.empty(end - begin, dtype=np.uint8)
                _pread_exact(fd, buf, self.src.offset + begin, self.src.path)
                self._compare(chunk, digest_of(memoryview(buf)))
        finally:
            os.close(fd)

    def _compare(self, chunk: int, actual: str) -> None:
        assert self.chunks is not None
        if actual != self.chunks.expected(chunk):
            begin, end = self.chunks.span(chunk)
            raise CheckpointError(
                f"checksum mismatch for tensor {self.src.name!r} in {Path(self.src.path).name} at bytes "
                f"[{self.src.offset + begin}, {self.src.offset + end}) (chunk {chunk} of the fragment): expected "
                f"xxh3-64:{self.chunks.expected(chunk)}, read xxh3-64:{actual}; the file is damaged — load an older step"
            )


def _read_verified(src: Source, out: np.ndarray) -> None:
    """pread `src` into `out` and check its checksum; raise CheckpointError naming the file on a mismatch."""
    hasher = xxhash.xxh3_64()
    fd = _open(src)
    try:
        _pread_exact(fd, out[: src.nbytes], src.offset, src.path, hasher)
    finally:
        os.close(fd)
    _check(src, hasher)


def _fill_decoded(src: Source, fill: Fill, common: Box) -> None:
    """Decode the part `common` of a quantized or residual fragment into the target.

    Reads only the fragment's rows (dim 0) that hold `common`, of the codes and of the scales
    (or of the residual and of the model weight), whole bytes (int4: two codes per byte, rows
    start on a byte boundary), and decodes the columns wanted (ckptd.common.quant.decode).
    """
    from ckptd.common import quant

    decoding = src.decode
    assert decoding is not None
    box = src.box
    r0, r1 = (common.offsets[0] - box.offsets[0], common.end[0] - box.offsets[0]) if box.ndim else (0, 1)
    region = Box((box.offsets[0] + r0, *box.offsets[1:]), (r1 - r0, *box.lengths[1:])) if box.ndim else box
    dst = fill.target[relative(common, fill.want)]
    try:
        if decoding.codec == quant.RESIDUAL:
            if decoding.base is None:
                raise CheckpointError(f"tensor {src.name!r}: a residual without the model weight it adds to; load an older step")
            residual = _read_rows(src, "BF16", box.lengths, r0, r1)
            base = _read_rows(decoding.base, decoding.base.dtype, box.lengths, r0, r1)
            inside = relative(common, region)
            # only the wanted columns; a float32 target is written in place (no temporaries)
            values = quant.residual_decode(base[inside], residual[inside], out=dst if dst.dtype == torch.float32 else None)
        else:
            codec = quant.Codec(decoding.codec, decoding.block)
            if decoding.scales is None:
                raise CheckpointError(f"tensor {src.name!r}: quantized without scales; load an older step")
            codes_shape = codec.codes_shape(box.lengths)
            if decoding.frames is None:
                codes = _read_rows(src, codec.codes_dtype, codes_shape, r0, r1)
            else:
                codes = _read_framed_rows(src, decoding.frames, codec.codes_dtype, codes_shape, r0, r1)
            scales = _read_rows(decoding.scales, "F32", codec.scales_shape(box), r0, r1)
            values = quant.decode(codec, codes, scales, region, common)
    except quant.QuantError as exc:
        raise CheckpointError(f"tensor {src.name!r} in {Path(src.path).name}: {exc}") from None
    if values is not dst:  # decoded into the target already
        dst.copy_(values)


def _read_framed_rows(src: Source, frames: Frames, dtype: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
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
        rows = decompress(_read_span(src, begin, end - begin), frames, f0, f1, row_bytes, shape[0])
    except FrameError as exc:
        raise CheckpointError(f"tensor {src.name!r} in {Path(src.path).name}: {exc}; load an older step") from None
    first = r0 - f0 * frames.rows
    rows = rows[first * row_bytes : (first + r1 - r0) * row_bytes]
    return torch.from_numpy(rows).view(getattr(torch, dtypes.torch_name(dtype))).view((r1 - r0, *shape[1:]))


def _read_rows(src: Source, dtype: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
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
    out = _read_span(src, r0 * row_bytes, (r1 - r0) * row_bytes)
    stored = getattr(torch, dtypes.torch_name(dtype))
    return torch.from_numpy(out).view(stored).view((r1 - r0, *shape[1:]) if shape else ())


def _read_span(src: Source, lo: int, nbytes: int) -> np.ndarray:
    """Bytes [lo, lo + nbytes) of the stored piece, read and checked: all of it against its
    checksum, hashed as it is read; a part by the chunks it touches (_verify_span)."""
    out = np.empty(nbytes, dtype=np.uint8)
    hasher = xxhash.xxh3_64() if src.checksum and lo == 0 and nbytes == src.nbytes else None
    fd = _open(src)
    try:
        _pread_exact(fd, out, src.offset + lo, src.path, hasher)
    finally:
        os.close(fd)
    if hasher is not None:
        _check(src, hasher)
    else:
        _verify_span(src, lo, out)
    return out
