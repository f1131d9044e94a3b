"""Filling a load's targets from the plan's pieces: copies out of arenas, verified reads of files,
resharding, dtype conversion and decoding.

Copies are split into chunks and run on a few threads (numpy releases the GIL while it
copies), so a restore runs at memory bandwidth. Reads of committed files go straight into the
target tensors with pread and are checked against the index's xxh3 checksums
(ckptd.client.reader.pieces); pieces the daemon checked as they arrived (a replica staged in
shared memory) are read in chunks on every thread, unchecked. A target that wants only part of a fragment (resharding) gets only the
byte ranges it needs (see ckptd.common.reshard), checked against the checksums of the
fragment's chunks they touch (see ckptd.common.chunks). Quantized pieces go through
ckptd.client.reader.decode.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import stat
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import numpy as np
import torch

from ckptd.client.arenas import CHUNK, SPLIT_BYTES, ArenaMaps, MADV_POPULATE_READ, byte_view, chunk_tasks
from ckptd.client.reader.decode import fill_decoded
from ckptd.client.reader.pieces import READ_CHUNK, ArenaColumns, Source, checked_by_daemon, open_piece, pread_exact, read_range, read_runs, verify_span
from ckptd.client.errors import CheckpointError
from ckptd.common import dtypes
from ckptd.common._copy import copy_pieces
from ckptd.common.boxes import Box, intersect, relative
from ckptd.common.reshard import CopyRun, copy_runs, read_ranges, row_block, run_count

BATCHES = max(2, os.cpu_count() or 1)  # batches of small pieces per fill
MANY_RUNS = 32  # above this, runs are placed by one strided torch copy, not one by one
WAVE_BYTES = 64 * 2**20  # device restores: bytes read into pinned staging before their copies are queued
T = TypeVar("T")
_IS_CPU, _NBYTES = attrgetter("is_cpu"), attrgetter("nbytes")


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (memoized: loads ask once per tensor)."""
    return dtypes.from_torch_name(str(dtype))



@dataclass(frozen=True)
class Fill:
    """Fill `target`, which holds box `want` of its logical tensor, from fragments that cover it."""

    target: torch.Tensor
    want: Box
    sources: Sequence[Source]


def fill_all(pool: ThreadPoolExecutor, maps: ArenaMaps, fills: Sequence[Fill]) -> None:
    """Run every fill's copies and reads on the pool at once, then wait for all of them.

    A piece that goes into a plain target (contiguous, on the CPU, of the stored dtype) as one
    byte range (all of its fragment, or a block of its rows when the later dims match: a row
    slice) is found with integer arithmetic (reshard.row_block) and copied or read by address:
    a load of thousands of such pieces costs a few microseconds of Python each. Other shapes go
    through copy runs (_Part) or decoding.
    """
    spans: list[_Span] = []  # one byte range each, from a file (checked by the rank or by the daemon)
    arena_spans: list[_Span] = []  # one byte range each, from an arena
    parts: list[_Part] = []
    decoded: list[tuple[Source, Fill, Box]] = []
    arenas: set[str] = set()
    for fill in fills:
        target, want = fill.target, fill.want
        if fill.sources and tuple(target.shape) != want.lengths:
            raise CheckpointError(
                f"the target for tensor {fill.sources[0].name!r} has shape {list(target.shape)} but the wanted box "
                f"{want} has lengths {list(want.lengths)}; pass a target of the wanted box's shape"
            )
        plain = target.device.type == "cpu" and target.is_contiguous() and target.numel() > 0  # byte_view would work
        stored = _dtype_name(target.dtype) if plain else None  # pieces of this dtype go straight into the target's bytes
        for src in fill.sources:
            if src.kind == "shm":
                arenas.add(src.path)
            direct = src.dtype == stored
            if direct and src.decode is None and (block := row_block(src.box, want)) is not None:
                if block[2]:
                    size = dtypes.itemsize(src.dtype)
                    _check_size(src)
                    span = _Span(src, block[0] * size, block[2] * size, target.data_ptr() + block[1] * size)
                    (arena_spans if src.kind == "shm" else spans).append(span)
                continue
            common = intersect(src.box, want)
            if common is None:
                continue
            if src.decode is not None:
                decoded.append((src, fill, common))
                continue
            if direct and src.box == want:  # a 0-dim tensor: row_block leaves it here
                _check_size(src)
                (arena_spans if src.kind == "shm" else spans).append(_Span(src, 0, src.nbytes, target.data_ptr()))
            elif run_count(src.box, want if direct else common) > MANY_RUNS:
                parts.append(_Part(src, common, fill, [], direct, strided=True))
            else:
                runs = copy_runs(src.box, want if direct else common, dtypes.itemsize(src.dtype))
                if direct and len(runs) == 1 and checked_by_daemon(src):  # one unchecked range: read in batches
                    _check_size(src)
                    spans.append(_Span(src, runs[0].src, runs[0].nbytes, target.data_ptr() + runs[0].dst))
                else:
                    parts.append(_Part(src, common, fill, runs, direct))
    # Only scattered ranges: all of a fragment is read front to back, which the kernel's
    # readahead follows. Advising those too made a cold 1 GiB restore slower (0.38-0.46 s
    # against 0.35-0.42 s): the advice allocates and submits every page up front, on this thread.
    _prefetch([(p.src.path, p.src.offset + lo, n) for p in parts if p.src.kind == "file" for lo, n in p.ranges()]
              + [(s.src.path, s.src.offset + s.lo, s.nbytes) for s in spans if s.src.kind == "file" and s.nbytes != s.src.nbytes])
    jobs = []
    big: list[_Span] = []  # split into CHUNKs over the threads
    small_shm: list[tuple[int, int, int]] = []  # (target address, arena address, bytes)
    # An export of every mapping copied from by address: ArenaMaps cannot unmap one (it keeps
    # at most MAX_MAPPINGS) until the copies are done; `fills` keeps the targets alive.
    held: dict[int, memoryview] = {}
    for span in arena_spans:
        src = span.src
        if span.nbytes < SPLIT_BYTES:  # a memmove by address
            end = src.offset + src.nbytes
            base = maps.address(src.path, end)
            mm = maps.get(src.path, end)
            if id(mm) not in held:
                held[id(mm)] = memoryview(mm)
            small_shm.append((span.address, base + src.offset + span.lo, span.nbytes))
        else:
            big.append(span)
    reads: list[_Span] = []  # read in batches
    for span in spans:
        (big if span.nbytes >= SPLIT_BYTES and checked_by_daemon(span.src) else reads).append(span)
    for span in big:
        src, dst = span.src, _bytes_at(span.address, span.nbytes)
        if src.kind == "shm":
            # through the mapping, also a fresh one: its page faults cost less than pread of the
            # arena file (row halves of 16 fragments of 16 MiB, a new mapping each round, 2-core
            # VM: 16-19 ms against 18-27 ms, 49 in a first round; MemoryCopies measured the same)
            raw = np.frombuffer(maps.get(src.path, src.offset + src.nbytes), dtype=np.uint8, count=span.nbytes, offset=src.offset + span.lo)
            jobs += [pool.submit(t.run) for t in chunk_tasks(dst, raw)]
        else:  # a piece the daemon checked (nothing to hash in order): pread of its staging file
            jobs += [pool.submit(_pread_chunk, span, dst, i) for i in range(0, span.nbytes, CHUNK)]
    # small pieces in a few batches of about equal bytes, not one task each (a task costs more
    # than copying a small tensor); files in file order, each front to back, as its readahead goes
    if small_shm:  # one call into C, which splits them over threads
        moves = np.array(small_shm, dtype=np.uint64).T.copy()
        jobs.append(pool.submit(copy_pieces, moves[0], moves[1], moves[2], BATCHES))
    reads = [s for s in reads if s.src.kind != "file"] + sorted((s for s in reads if s.src.kind == "file"), key=_file_order)
    jobs += [pool.submit(_read_spans, batch) for batch in _batches(reads, _span_bytes, BATCHES)]
    jobs += [pool.submit(_fill_part, maps, part) for part in parts]
    jobs += [pool.submit(fill_decoded, src, fill.target, fill.want, common) for src, fill, common in decoded]
    wait(jobs)  # all of them, also when one failed: none may still copy once this returns
    for job in jobs:
        job.result()
    held.clear()
    for path in arenas:
        maps.mark_warm(path)  # only arenas this process mapped become warm


class _Span(NamedTuple):
    """Bytes [lo, lo + nbytes) of fragment `src`'s data, for the memory at `address`: inside a
    plain target, which the fill keeps alive until the copy is done."""

    src: Source
    lo: int
    nbytes: int
    address: int


def _span_bytes(span: _Span) -> int:
    return span.nbytes


def _file_order(span: _Span) -> tuple[str, int]:
    return span.src.path, span.src.offset + span.lo


def _check_size(src: Source) -> None:
    """Raise CheckpointError unless the piece has the bytes its box needs: a copy by address
    must never run past its fragment's data or its target."""
    expected = dtypes.nbytes(src.dtype, src.box.lengths)
    if src.nbytes != expected:
        raise CheckpointError(
            f"piece of tensor {src.name!r} in {Path(src.path).name} has {src.nbytes} bytes for a target of {expected} "
            f"(box {src.box} of {src.dtype}); the index and the data disagree — load an older step"
        )


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    """A writable flat uint8 array over `nbytes` of this process's memory at `address` (cheaper
    than byte_view; whoever passes the address keeps its owner alive)."""
    return np.frombuffer(memoryview((ctypes.c_char * nbytes).from_address(address)), dtype=np.uint8)


def _read_spans(spans: Sequence[_Span]) -> None:
    """Read each span into its target, checked as pieces.read_range checks it (as a whole piece
    or a part of one is checked everywhere); each file is opened once per batch."""
    fds: dict[str, int] = {}
    try:
        for src, lo, nbytes, address in spans:
            fd = fds.get(src.path)
            if fd is None:
                fd = fds[src.path] = open_piece(src)
            read_range(fd, src, lo, _bytes_at(address, nbytes))
    finally:
        for fd in fds.values():
            os.close(fd)


@dataclass(frozen=True, eq=False)
class MemoryCopies:
    """A load from the daemon's memory reduced to one call into C: every fill is a whole
    fragment from an arena into a contiguous CPU target of its dtype.

    Made once for a plan that repeats: ckptd.client.reader.plan_fill keeps it with the plan's fills in
    the cache of the state's Structure, whose identity guarantees that every target still has
    the dtype, shape, strides and data address it had here (ckptd.client.structure: a tensor
    reallocated, resized or of another dtype gives another Structure, hence a new plan). `run`
    checks first that every arena is still mapped where it was, then copies everything in one
    call into C (ckptd.common._copy.copy_pieces): no Python per tensor. Also through a mapping
    this process has not copied through before (a restarted trainer): its page faults cost less
    than pread of the arena files (256 MiB from a new client: 37-70 ms against 42-77 ms at 100
    to 4,000 tensors, measured side by side on the 2-core test VM).
    """

    bases: tuple[tuple[str, int, int], ...]  # (arena path, bytes it must have, address when prepared)
    destinations: np.ndarray  # uint64 target addresses, one per piece
    sources: np.ndarray  # uint64 arena addresses
    sizes: np.ndarray  # uint64 bytes
    keep: tuple[torch.Tensor, ...]  # the targets: their memory must stay while the addresses are used

    @staticmethod
    def prepare(maps: ArenaMaps, fills: Sequence[Fill]) -> "MemoryCopies | None":
        """The copies of `fills`, or None when any of them needs more than a memcpy."""
        paths: list[str] = []
        offsets: list[int] = []
        sizes: list[int] = []
        targets: list[int] = []
        need: dict[str, int] = {}
        for fill in fills:
            if len(fill.sources) != 1:
                return None
            src, target = fill.sources[0], fill.target
            if (
                src.kind != "shm" or src.decode is not None or src.box != fill.want
                or target.device.type != "cpu" or not target.is_contiguous() or src.dtype != _dtype_name(target.dtype)
                or src.nbytes != target.numel() * target.element_size()
            ):
                return None
            end = src.offset + src.nbytes
            if need.get(src.path, -1) < end:
                need[src.path] = end
            if src.nbytes:
                paths.append(src.path)
                offsets.append(src.offset)
                sizes.append(src.nbytes)
                targets.append(target.data_ptr())
        bases = tuple((path, size, _mapped(maps, path, size)) for path, size in need.items())
        where = {path: base for path, _, base in bases}
        sources = np.array(offsets, dtype=np.uint64) + np.array([where[p] for p in paths], dtype=np.uint64)
        return MemoryCopies(bases, np.array(targets, dtype=np.uint64), sources, np.array(sizes, dtype=np.uint64), tuple(f.target for f in fills))

    @staticmethod
    def of_columns(maps: ArenaMaps, targets: Sequence[torch.Tensor], columns: ArenaColumns) -> "MemoryCopies | None":
        """The copies of a plan the daemon sent as columns into `targets` (the local tensors of
        the structure's fragments, in order), or None when a target needs more than a memcpy (not
        a contiguous CPU tensor of the fragment's bytes): the caller fills it from Sources
        (`column_fills`), which name what is wrong. Maps run per tensor, no Python loop."""
        _check_count(len(targets), columns)
        if not all(map(_IS_CPU, targets)) or not all(map(torch.Tensor.is_contiguous, targets)):
            return None
        sizes = np.fromiter(map(_NBYTES, targets), dtype=np.uint64, count=len(targets))
        if not np.array_equal(sizes, columns.nbytes):
            return None
        used = sizes > 0
        addresses = np.fromiter(map(torch.Tensor.data_ptr, targets), dtype=np.uint64, count=len(targets))[used]
        arenas, offsets, sizes = columns.files[used], columns.offsets[used], sizes[used]
        ends = offsets + sizes
        needs = [int(ends[arenas == k].max(initial=0)) for k in range(len(columns.paths))]
        bases = tuple((path, need, _mapped(maps, path, need)) for path, need in zip(columns.paths, needs))
        sources = offsets + np.array([base for _, _, base in bases], dtype=np.uint64)[arenas]
        return MemoryCopies(bases, addresses, sources, sizes, tuple(targets))

    def run(self, maps: ArenaMaps, threads: int) -> bool:
        """Copy on `threads` threads; False (nothing copied) when an arena is no longer mapped where it was.
        The copy reads by address, holding no export of the mappings: nothing may map an arena
        meanwhile (the client's warm-up is stopped before every save and load, CheckpointClient._in_run)."""
        if any(maps.address(path, size) != base for path, size, base in self.bases):
            return False
        copy_pieces(self.destinations, self.sources, self.sizes, threads)
        for path, _, _ in self.bases:
            maps.mark_warm(path)
        return True


def column_fills(fragments: Sequence[tuple[str, Box, torch.Tensor]], columns: ArenaColumns) -> list[Fill]:
    """The fills of a plan sent as columns, for the general fill (a target MemoryCopies cannot
    take): fragments are the structure's (name, box, local tensor), in order. The dtype is the
    target's own: the daemon sends columns only for fragments stored in the dtype it was told."""
    _check_count(len(fragments), columns)
    return [
        Fill(target, box, [Source(name, "shm", columns.paths[k], int(at), int(n), box, _dtype_name(target.dtype), "")])
        for (name, box, target), k, at, n in zip(fragments, columns.files.tolist(), columns.offsets.tolist(), columns.nbytes.tolist())
        if n  # an empty fragment: nothing to fill
    ]


def _check_count(fragments: int, columns: ArenaColumns) -> None:
    if fragments != len(columns.offsets):
        raise CheckpointError(
            f"the daemon's plan has {len(columns.offsets)} tensors for the {fragments} fragments of this rank; "
            "upgrade the client and the daemon to the same release"
        )


def _mapped(maps: ArenaMaps, path: str, need: int) -> int:
    """The address of the mapping of arena `path`, which must hold `need` bytes (CheckpointError
    otherwise: a copy by address must never run past it)."""
    if len(maps.get(path, need)) < need:
        raise CheckpointError(f"the daemon's arena {path} is shorter than its plan says ({need} bytes); the daemon may have restarted: load again")
    return maps.address(path, need)


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


def _pread_chunk(span: _Span, dst: np.ndarray, start: int) -> None:
    """Copy bytes [start, start + CHUNK) of `span` (of a piece the daemon checked) into `dst`
    (the span's memory) by pread, unchecked."""
    fd = open_piece(span.src)
    try:
        pread_exact(fd, dst[start : start + CHUNK], span.src.offset + span.lo + start, span.src.path)
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
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # as the read opens it: a FIFO never blocks
        except OSError:
            continue  # reported by the read itself, with the tensor's name
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):  # else the read says what is there
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
        read_runs(src, part.runs, part.ranges(), dest)
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
    fd = open_piece(src)
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
    verify_span(src, first * row_bytes, data)
    rows = torch.from_numpy(data).view(stored).view((stop - first, *src.box.lengths[1:]))
    fill.target[relative(part.common, fill.want)].copy_(rows[(slice(None), *inside[1:])])


def fill_onto_devices(pool: ThreadPoolExecutor, maps: ArenaMaps, fills: Sequence[Fill], backend: Any,
                      owns: Callable[[torch.Tensor], bool], wave_bytes: int = WAVE_BYTES) -> None:
    """Fill `fills` where some targets are on GPUs (`owns(target)`; backend:
    ckptd.client._handoff.base.DeviceBackend), and block until every byte is in place.

    A fragment that is whole in the daemon's memory goes host-to-device straight from the pinned
    arena, queued first, so the copy engine works while the CPU does the rest. CPU targets are
    filled meanwhile. Anything else is assembled in the restore's pinned staging buffers (read,
    resharded, converted by the CPU path) in waves of about `wave_bytes`: each wave's copies are
    queued as soon as its reads are done, while the next wave is read into the other buffer."""
    restore = backend.restore()
    try:
        host_fills: list[Fill] = []
        direct: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged: list[Fill] = []
        for fill in fills:
            target = fill.target
            if not owns(target):
                host_fills.append(fill)
                continue
            src = fill.sources[0] if len(fill.sources) == 1 else None
            if (src is not None and src.box == fill.want and src.kind == "shm"
                    and src.dtype == _dtype_name(target.dtype) and target.numel()):
                arena = backend.host_view(src.path, src.offset + src.nbytes)
                direct.append((arena[src.offset : src.offset + src.nbytes].view(target.dtype).view(target.shape), target))
            else:
                staged.append(fill)
        if direct:
            restore.upload(direct)
        if host_fills:
            fill_all(pool, maps, host_fills)
        for wave, total in _waves(staged, wave_bytes):
            buffer = restore.staging(total)
            pairs = [(buffer[off : off + _nbytes(f.target)].view(f.target.dtype).view(f.target.shape), f.target) for f, off in wave]
            fill_all(pool, maps, [Fill(host, f.want, f.sources) for (f, _), (host, _) in zip(wave, pairs)])
            restore.upload(pairs)
    finally:
        restore.finish()  # also on an error: nothing may still read an arena or a staging buffer


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _waves(fills: Sequence[Fill], wave_bytes: int) -> list[tuple[list[tuple[Fill, int]], int]]:
    """`fills` packed in order into waves of at most `wave_bytes` (a larger fill: a wave alone):
    per wave, each fill with its offset (aligned to its element size, so that equal dtypes pack
    without gaps), and the wave's bytes."""
    waves: list[tuple[list[tuple[Fill, int]], int]] = []
    wave: list[tuple[Fill, int]] = []
    used = 0
    for fill in fills:
        n, align = _nbytes(fill.target), fill.target.element_size()
        off = -(-used // align) * align
        if wave and off + n > wave_bytes:
            waves.append((wave, used))
            wave, off = [], 0
        wave.append((fill, off))
        used = off + n
    if wave:
        waves.append((wave, used))
    return waves
