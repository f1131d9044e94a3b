"""Persist one complete snapshot: arenas → safetensors files → fsync → index → `latest`.

This is the only module that writes checkpoint files. It runs in worker threads (never on
the event loop). Data goes from the shared-memory arenas to the files with positional writes
of zero-copy views, several tensors in parallel; each stored tensor's xxh3 checksum is
computed from the same views while it is written.

Commit order (a crash anywhere before the last rename leaves no visible step):
data files (temp names) → fsync each → rename; HF indexes, extra.json (each fsynced) → fsync
dir → ckptd.index.json (temp, fsync, rename, fsync dir) → `latest`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import xxhash

from ckptd.common import dtypes
from ckptd.common.boxes import Box, contiguous_runs, coverage_problems
from ckptd.common.chunks import HASH_SLICE, ChunkHasher, chunk_bytes_for
from ckptd.common.frames import Frames
from ckptd.common.frames import compress as compress_frames
from ckptd.common.quant_options import CAST, RESIDUAL
from ckptd.daemon.arena import ArenaSet
from ckptd.daemon.format import (
    EXTRA_JSON,
    GROUP_OF_KIND,
    INDEX_NAME,
    CheckpointIndex,
    FileLayout,
    FileRecord,
    HEADER_ALIGN,
    FragmentRecord,
    QuantRecord,
    SideRecord,
    StoredTensor,
    TensorRecord,
    extra_json,
    file_key,
    fragment_key,
    hf_index_json,
    layout_files,
    safetensors_header,
    scales_key,
)
from ckptd.daemon.plan import FragmentSlot, LogicalTensor, SavePlan, StoredPart
from ckptd.daemon.errors import NoSpace
from ckptd.daemon.storage import Storage, create_file, fsync_dir, open_recycled, reused_bytes, space_problem, start_writeback, tmp_name, write_small_file

log = logging.getLogger(__name__)

WRITE_CHUNK = 64 * 2**20
VERSION = "0.1.0"


def checksum_name(digest: int) -> str:
    return f"xxh3-64:{digest:016x}"


@dataclass(frozen=True)
class PersistRequest:
    job: str
    step: int
    plan: SavePlan
    arenas: ArenaSet
    extras: dict[int, Any]  # rank -> JSON tree
    model_files: dict[str, bytes]  # small files for model tools (config.json), validated names
    metric: float | None
    max_file_bytes: int
    write_threads: int
    throttle_bytes_per_s: float = 0.0  # 0: as fast as the disk goes (a slow disk, for tests and drills)
    node: int = 0  # this daemon's node: it writes the plan's parts of this node
    shared_dir: bool = False  # other nodes write into the same step directory
    quantize: str | None = None  # "O1" | "O2": quantize the optimizer moments (ckptd.common.quant)
    master_weights: str = "keep"  # "keep" | "drop" | "residual"
    quantization: dict[str, Any] | None = None  # the index's record (generation ...); None: lossless lineage
    disk_reserve: int = 0  # bytes to leave free on the root's file system (check_space); 0: the files only have to fit


class Throttle:
    """Limits the write rate shared by all writer threads (simulates a slow disk)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        # bytes per write: about 1/8 s of throttled writing (at least 1 MiB), so progress moves smoothly
        self.chunk = WRITE_CHUNK if bytes_per_s <= 0 else int(max(1 << 20, min(WRITE_CHUNK, bytes_per_s / 8)))
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        if self.bytes_per_s <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + nbytes / self.bytes_per_s
            delay = self._next - now
        time.sleep(delay)


class Progress:
    """Bytes written so far; read by WaitDurable and Status from another thread."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._written = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._written += nbytes

    @property
    def written(self) -> int:
        return self._written


@dataclass(frozen=True)
class _Piece:
    """A contiguous run of a stored tensor: `nbytes` from arena `rank` at `src` to file offset `dst`."""

    rank: int
    src: int
    dst: int
    nbytes: int


def _pieces(tensor_shape: tuple[int, ...], itemsize: int, slots: list[FragmentSlot], data_offset: int) -> list[_Piece]:
    """The runs that assemble a whole tensor from its fragments, in file order."""
    pieces = []
    for slot in slots:
        for dst, src, n in contiguous_runs(slot.box, tensor_shape):
            pieces.append(_Piece(slot.rank, slot.offset + src * itemsize, data_offset + dst * itemsize, n * itemsize))
    pieces.sort(key=lambda p: p.dst)
    return pieces


@dataclass(frozen=True)
class NodeManifest:
    """What one node wrote of a step: its data files (fsynced, renamed) and where each stored
    tensor or fragment is in them."""

    node: int
    files: tuple[FileRecord, ...]
    fragments: tuple[tuple[str, FragmentRecord], ...]  # (logical tensor, where its bytes are)
    quantization: dict[str, Any] | None = None  # the index's record as this node decided it (several nodes)


class IncompleteStep(ValueError):
    """The nodes' manifests do not cover every tensor exactly once; the message names them."""


def persist(storage: Storage, req: PersistRequest, progress: Progress, clock: Callable[[], float] = time.time) -> CheckpointIndex:
    """One node: write the snapshot in `req.arenas` as committed step `req.step`; returns its index.

    Raises NoSpace, before anything is written, when the step's files would not fit (see
    check_space); OSError (disk full, I/O error) with the step directory removed again.
    """
    try:
        manifest = write_node_files(storage, req, progress)
        index, files = step_files(
            req.job, req.step, req.plan, [manifest], req.extras, req.model_files, req.metric, clock, req.quantization
        )
        write_step_files(storage, req.job, req.step, files)
        storage.write_latest(req.job, req.step)
        return index
    except BaseException:
        storage.remove_step(req.job, req.step)
        raise


def write_node_files(storage: Storage, req: PersistRequest, progress: Progress) -> NodeManifest:
    """Write the data files that the plan gives to node `req.node`: temp names, fsync, rename.

    The step is not committed by this (no index). With `req.shared_dir` other nodes write into
    the same step directory at the same time, so it is not emptied first.
    Raises NoSpace when the files would not fit (check_space), before the step directory or any
    file of it is created.
    """
    plan = req.plan
    slots_by_name: dict[str, list[FragmentSlot]] = {}
    for slot in plan.slots:
        slots_by_name.setdefault(slot.name, []).append(slot)
    slot_of = {(s.name, s.box): s for s in plan.slots}
    tensors = {t.name: t for t in plan.tensors}
    kinds = {t.name: t.kind for t in plan.tensors}
    stored = []
    whole_done: set[str] = set()  # a whole tensor has a part per fragment; it is stored once
    for part in plan.parts or _whole_parts(plan):
        t = tensors[part.name]
        if part.whole:
            if t.name not in whole_done:
                whole_done.add(t.name)
                stored.append(StoredTensor(t.name, file_key(t.name, t.kind), t.dtype, t.shape, Box.full(t.shape), part.node))
        else:
            key = fragment_key(file_key(t.name, t.kind), part.box)
            stored.append(StoredTensor(t.name, key, t.dtype, part.box.lengths, part.box, part.node))
    files: list[FileRecord] = []
    placed: list[_Placed] = []
    throttle = Throttle(req.throttle_bytes_per_s)
    source = _Source(req.arenas, tensors, slots_by_name, slot_of)
    stored, codings, cast = _compress(source, stored, kinds, req, progress)
    # Largest files first: they take the largest recycled files.
    every_node = layout_files(stored, kinds, req.max_file_bytes)
    layouts = [f for f in every_node if f.node == req.node]
    layouts.sort(key=lambda f: -f.nbytes)
    recycled = storage.take_recycled(req.job)
    check_space(storage, req, every_node if req.shared_dir else layouts, tensors, [size for _, size in recycled])
    step_dir = storage.prepare_step_dir(req.job, req.step, fresh=not req.shared_dir)
    scratch = _ScratchPool(min(req.write_threads, os.cpu_count() or 1))
    opened: list[tuple[int, Path]] = []
    with ThreadPoolExecutor(max(1, req.write_threads), thread_name_prefix="ckptd-write") as pool:
        # Which tensors go into which file follows from the shapes (all nodes number the same
        # files). Tensors of known size are written at fixed offsets; quantized codes are coded
        # and written by one writer job each, placed after the file's fixed tensors in the
        # order they finish (their size depends on the values), and such a file's header is
        # written last, into room reserved for it.
        writes: list[tuple[StoredTensor, str, int, Future[tuple[int, str]]]] = []
        jobs: list[tuple[int, Callable[[], _CodedWrite], list[Future[_CodedWrite]]]] = []  # (bytes to code, job, its file's jobs)
        plain: list[tuple[int, list[Future[Any]]]] = []  # files without coded tensors, and their writes
        finishes: list[tuple[_AppendedFile, list[StoredTensor], int, list[Future[Any]], list[Future[_CodedWrite]]]] = []
        coded: list[Future[_CodedWrite]] = []
        try:
            for layout in layouts:
                fixed = [t for t in layout.tensors if not _placed_when_coded(t, codings)]
                late = [t for t in layout.tensors if _placed_when_coded(t, codings) and t.role == "data"]
                header, entries = safetensors_header((t.key, t.dtype, t.shape) for t in fixed)
                header_size = _header_room(fixed, late, tensors, _scales_shapes(layout)) if late else len(header)
                path = step_dir / layout.name
                fd = _open_for_writing(tmp_name(path), recycled.pop(0)[0] if recycled else None, header_size + layout.nbytes)
                opened.append((fd, path))
                file_writes = []
                for tensor, entry in zip(fixed, entries):
                    offset = header_size + entry.begin
                    coding = codings.get((tensor.name, tensor.box))
                    if coding is not None:  # a residual: its size is known
                        write = functools.partial(_write_residual, fd, offset, tensor, coding, source, progress, throttle, scratch)
                    else:
                        write = functools.partial(_write_tensor, fd, req.arenas, source.pieces(tensor, offset), progress, throttle)
                    writes.append((tensor, layout.name, offset, pool.submit(write)))
                    file_writes.append(writes[-1][3])
                if not late:
                    _pwrite_all(fd, memoryview(header), 0)
                    files.append(FileRecord(layout.name, len(header) + layout.nbytes, checksum_name(xxhash.xxh3_64_intdigest(header)), req.node))
                    plain.append((fd, file_writes))
                    continue
                file = _AppendedFile(fd, layout.name, header_size + sum(t.nbytes for t in fixed))
                file_jobs: list[Future[_CodedWrite]] = []
                for t in late:
                    job = functools.partial(_write_coded, file, t, codings[(t.name, t.box)], source, progress, throttle, scratch, req.step)
                    jobs.append((t.box.numel, job, file_jobs))
                finishes.append((file, fixed, header_size, file_writes, file_jobs))
            # Coding jobs after the fixed writes (those start the disk early), largest first (the
            # threads finish together instead of one coding the last big tensor alone); then each
            # file's fsync or finish, queued after every job it waits for (a pool job waits only
            # for jobs queued before it, so none deadlocks).
            jobs.sort(key=lambda job: -job[0])
            for _, job, file_jobs in jobs:
                file_jobs.append(pool.submit(job))
                coded.append(file_jobs[-1])
            syncs = [pool.submit(_sync_when_written, fd, file_writes) for fd, file_writes in plain]
            finished = [pool.submit(_finish_file, *finish, req.node) for finish in finishes]
            placed += [_Placed(t, name, offset, *digest.result()) for t, name, offset, digest in writes]
            for finish in finished:
                record, late_placed = finish.result()
                files.append(record)
                placed += late_placed
            for sync in syncs:
                sync.result()
        finally:
            # after an error: no job may still be writing when the descriptors are closed
            pool.shutdown(wait=True, cancel_futures=True)
            for fd, _ in opened:
                os.close(fd)
    for _, path in opened:
        os.replace(tmp_name(path), path)
    fsync_dir(step_dir)
    outcomes = {(w.tensor.name, w.tensor.box): w for w in (f.result() for f in coded)}
    return NodeManifest(req.node, tuple(files), _fragment_records(placed, codings, outcomes, cast), req.quantization)


@dataclass(frozen=True)
class _Placed:
    """A stored tensor as written: its file, absolute offset, xxh3-64 and chunk digests."""

    tensor: StoredTensor
    file: str
    offset: int
    digest: int
    chunks: str


def _placed_when_coded(t: StoredTensor, codings: dict[tuple[str, Box], "_Coding"]) -> bool:
    """Whether `t` (codes or scales of a quantized tensor) is placed once coded; scales are
    written beside their codes (layout_files keeps both in one file)."""
    coding = codings.get((t.name, t.box))
    return coding is not None and coding.codec is not None


def _header_room(
    fixed: list[StoredTensor], late: list[StoredTensor], tensors: dict[str, LogicalTensor], scales_shapes: dict[tuple[str, Box], tuple[int, ...]]
) -> int:
    """Bytes to reserve for the header of a file whose `late` tensors (codes) are placed, with
    their scales, once coded.

    The header is measured as if every quantized tensor fell back to its values as they are
    (its logical dtype and shape: more bytes than its codes, so larger offsets, a dtype name at
    least as long, a shape whose digits outnumber the coded size's) and its scales stayed: the
    real header is never longer."""
    bound = [(t.key, t.dtype, t.shape) for t in fixed]
    for t in late:
        bound.append((t.key, tensors[t.name].dtype, t.box.lengths))
        bound.append((scales_key(t.key), "F32", scales_shapes[(t.name, t.box)]))
    header, _ = safetensors_header(bound)
    return len(header) + HEADER_ALIGN * 2 * len(late)  # spare room: a compressed size can exceed its codes by a few bytes


def _scales_shapes(layout: FileLayout) -> dict[tuple[str, Box], tuple[int, ...]]:
    """The shapes of the scales of the file's quantized tensors, by (name, box) of their codes."""
    return {(t.name, t.box): t.shape for t in layout.tensors if t.role == "scales"}


def file_bytes_bound(layout: FileLayout, tensors: dict[str, LogicalTensor]) -> int:
    """The most bytes the file of `layout` can take once written, header included.

    Exact for a file of tensors of known size (values, bf16 residuals). A quantized tensor's
    size is known only once it is coded (int4 codes are zstd-compressed; a tensor that cannot
    be quantized is stored as its values instead), so each counts as its values as they are
    (logical dtype over its box) plus its scales, and the header as _header_room reserves it.
    Only floating point values (2 bytes or more each) are quantized, to codes of 1 or 1/2 byte
    per value; zstd adds under 1% to incompressible int4 codes, and a few bytes of framing that
    can outgrow the values only for a fragment of a handful of values (the reserve covers that)."""
    shapes = _scales_shapes(layout)
    if not shapes:
        header, _ = safetensors_header((t.key, t.dtype, t.shape) for t in layout.tensors)
        return len(header) + layout.nbytes
    coded = [t for t in layout.tensors if (t.name, t.box) in shapes]
    fixed = [t for t in layout.tensors if (t.name, t.box) not in shapes]
    late = [t for t in coded if t.role == "data"]
    values = sum(dtypes.nbytes(tensors[t.name].dtype, t.box.lengths) for t in late)
    scales = sum(t.nbytes for t in coded if t.role == "scales")
    return _header_room(fixed, late, tensors, shapes) + sum(t.nbytes for t in fixed) + values + scales


def check_space(
    storage: Storage, req: PersistRequest, layouts: Sequence[FileLayout], tensors: dict[str, LogicalTensor], recycled: Sequence[int]
) -> None:
    """Raise NoSpace unless the data files of `layouts` fit on the storage root's file system
    with `req.disk_reserve` bytes to spare; called before anything of the step is created.

    Needed = the files' bytes (file_bytes_bound: an upper bound for quantized tensors) - the
    bytes that overwrite recycled files in place (`recycled`: the bin's sizes, largest first,
    given to the files in the order of `layouts`, largest first, as write_node_files does) +
    the reserve, against statvfs's free bytes. The step's small files (indexes, extra.json,
    model config files) are left to the reserve.

    `layouts` are this node's files; in a root shared by several nodes (req.shared_dir) every
    node's files, since they all take the same free space at once: files some node has already
    started then count only for what they still lack (Storage.allocated_in_step), and the rest
    take the recycled files. With several nodes writing at once this is an estimate (the nodes
    race for the recycled files); with a root of its own it is a bound. A file system that
    reports no size is not checked."""
    measured = storage.free_bytes(req.job)
    if measured is None:
        log.debug("the file system of %s reports no size: step %s is written without a free-space check", storage.root, req.step)
        return
    free, where = measured
    present = storage.allocated_in_step(req.job, req.step) if req.shared_dir else {}
    started = [f for f in layouts if f.name in present]
    fresh = [f for f in layouts if f.name not in present]
    fresh.sort(key=lambda f: -f.nbytes)
    sizes = [file_bytes_bound(f, tensors) for f in fresh]
    write_bytes = sum(sizes) + sum(max(0, file_bytes_bound(f, tensors) - present[f.name]) for f in started)
    problem = space_problem(write_bytes, reused_bytes(sizes, recycled), req.disk_reserve, free, where)
    if problem is not None:
        raise NoSpace(f"step {req.step} of job {req.job!r} refused: {problem}")


class _AppendedFile:
    """A file being written whose coded tensors are placed, as they finish, from byte `end` on."""

    def __init__(self, fd: int, name: str, end: int) -> None:
        self.fd = fd
        self.name = name
        self.end = end
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> int:
        """The offset of a range of `nbytes` at the end of the file, now this caller's."""
        with self._lock:
            offset, self.end = self.end, self.end + nbytes
        return offset


class _ScratchPool:
    """At most `size` coding buffers (ckptd.common.quant.Scratch), handed from one coding job
    to the next: a save faults in fresh memory for each buffer once instead of once per tensor,
    and no more jobs code at once than there are buffers (the rest of the writer threads keep
    writing; coders beyond the cores only take turns)."""

    def __init__(self, size: int) -> None:
        self._free: list[Any] = []
        self._made = 0
        self._size = max(1, size)
        self._ready = threading.Condition()

    @contextlib.contextmanager
    def take(self) -> Iterator[Any]:
        from ckptd.common import quant  # imported by _compress already: a lookup

        with self._ready:
            self._ready.wait_for(lambda: self._free or self._made < self._size)
            if self._free:
                scratch = self._free.pop()
            else:
                scratch, self._made = quant.Scratch(), self._made + 1
        try:
            yield scratch
        finally:
            with self._ready:
                self._free.append(scratch)
                self._ready.notify()


def _sync_when_written(fd: int, writes: list[Future[Any]]) -> None:
    """fsync a file once its writes are done (raises what a write raised)."""
    for write in writes:
        write.result()
    os.fsync(fd)


def _finish_file(
    file: _AppendedFile, fixed: list[StoredTensor], header_size: int, fixed_writes: list[Future[Any]],
    coded: list[Future["_CodedWrite"]], node: int,
) -> tuple[FileRecord, list[_Placed]]:
    """Once the file's coding jobs are done, write its header (padded to `header_size`), cut
    the file after the last coded tensor and fsync it once `fixed_writes` are done too.
    Returns its record and the coded tensors' places."""
    placed = sorted((p for job in coded for p in job.result().placed), key=lambda p: p.offset)
    header, _ = safetensors_header([(t.key, t.dtype, t.shape) for t in fixed] + [(p.tensor.key, p.tensor.dtype, p.tensor.shape) for p in placed], size=header_size)
    _pwrite_all(file.fd, memoryview(header), 0)
    os.ftruncate(file.fd, file.end)
    _sync_when_written(file.fd, fixed_writes)
    return FileRecord(file.name, file.end, checksum_name(xxhash.xxh3_64_intdigest(header)), node), placed


class _Source:
    """Where a stored tensor's bytes are in the arenas."""

    def __init__(
        self, arenas: ArenaSet, tensors: dict[str, LogicalTensor], slots_by_name: dict[str, list[FragmentSlot]],
        slot_of: dict[tuple[str, Box], FragmentSlot],
    ) -> None:
        self.arenas = arenas
        self.tensors = tensors
        self.slots_by_name = slots_by_name
        self.slot_of = slot_of

    def nbytes(self, tensor: StoredTensor) -> int:
        """The snapshot's bytes of a stored tensor (its logical dtype over its box), whatever it
        is stored as: what Progress counts."""
        return dtypes.nbytes(self.tensors[tensor.name].dtype, tensor.box.lengths)

    def pieces(self, tensor: StoredTensor, offset: int) -> list[_Piece]:
        """The arena runs of `tensor` (a whole tensor or a fragment) placed from byte `offset` on."""
        itemsize = dtypes.itemsize(self.tensors[tensor.name].dtype)
        if tensor.box == Box.full(self.tensors[tensor.name].shape):
            return _pieces(tensor.box.lengths, itemsize, self.slots_by_name[tensor.name], offset)
        slot = self.slot_of[(tensor.name, tensor.box)]  # a fragment stored on its own: one run from its slot
        return [_Piece(slot.rank, slot.offset, offset, slot.nbytes)]

    @contextlib.contextmanager
    def values(self, tensor: StoredTensor) -> Iterator[Any]:
        """The tensor's values as a torch tensor of the box's shape: a view of the arena when its
        bytes are one run there (the usual case, no copy), else a gathered copy. The view must
        not outlive the block."""
        logical = self.tensors[tensor.name]
        pieces = self.pieces(tensor, 0)
        if len(pieces) != 1:
            yield _as_torch(self.gather(tensor), logical.dtype, tensor.box.lengths)
            return
        arena = self.arenas.arenas[pieces[0].rank]
        assert arena is not None, "plan gave a fragment to a rank without an arena"
        view = arena.view(pieces[0].src, pieces[0].nbytes)
        try:
            yield _as_torch(np.frombuffer(view, dtype=np.uint8), logical.dtype, tensor.box.lengths)
        finally:
            view.release()

    def gather(self, tensor: StoredTensor) -> np.ndarray:
        """A copy of the tensor's bytes (its logical dtype, the box's shape) as a flat uint8 array."""
        logical = self.tensors[tensor.name]
        out = np.empty(dtypes.nbytes(logical.dtype, tensor.box.lengths), dtype=np.uint8)
        for piece in self.pieces(tensor, 0):
            arena = self.arenas.arenas[piece.rank]
            assert arena is not None, "plan gave a fragment to a rank without an arena"
            view = arena.view(piece.src, piece.nbytes)
            try:
                out[piece.dst : piece.dst + piece.nbytes] = np.frombuffer(view, dtype=np.uint8)
            finally:
                view.release()
        return out


@dataclass(frozen=True)
class _Coding:
    """A stored tensor whose bytes are made in memory: quantized codes and scales (`codec`, a
    ckptd.common.quant.Codec), or a master weight's bf16 residual to the stored model weight
    `model` (its whole twin, of the same box)."""

    codec: Any = None
    model: StoredTensor | None = None


@dataclass(frozen=True)
class _CodedWrite:
    """What a coding job wrote: the codes and scales of `tensor` (`frames`: the table of int4
    codes in zstd frames), or its values as they are when they could not be quantized."""

    tensor: StoredTensor
    placed: tuple[_Placed, ...]
    frames: Frames | None
    quantized: bool


def _compress(
    source: _Source, stored: list[StoredTensor], kinds: dict[str, str], req: PersistRequest, progress: Progress
) -> tuple[list[StoredTensor], dict[tuple[str, Box], _Coding], dict[str, StoredTensor]]:
    """Decide how each of `stored` is compressed (req.quantize, req.master_weights).

    Returns the tensors to lay out (codes, scales and residuals with their stored dtypes and
    the shapes of uncompressed codes, for every node's tensors: all nodes lay out the same
    files), how this node's coded tensors are made, by (name, box), and the dropped master
    weights (name -> the stored model tensor whose bytes stand for it). A tensor that cannot be
    quantized (inf/nan, a negative second moment) is found when it is coded and stored as it is.
    """
    mode = req.master_weights
    if req.quantize is None and mode == "keep":
        return stored, {}, {}
    first_import = "torch" not in sys.modules
    from ckptd.common import quant  # torch: imported by the writer thread, only when compressing
    import torch

    # One intra-op thread: coding runs in parallel over tensors (on the writer threads) instead
    # of inside each op; on a busy machine OpenMP's spinning threads cost several times the work.
    # torch is used for nothing else in the daemon.
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    if first_import:
        # torch brings ~140,000 objects that live as long as the process; left to the garbage
        # collector, every full collection scans them again (80-95 ms, now and then in the
        # middle of a save). Frozen, they are never scanned.
        gc.freeze()

    whole_model = {t.name: t for t in stored if kinds[t.name] == "model" and t.box == Box.full(source.tensors[t.name].shape)}
    out: list[StoredTensor] = []
    codings: dict[tuple[str, Box], _Coding] = {}
    cast: dict[str, StoredTensor] = {}
    for t in stored:
        logical = source.tensors[t.name]
        codec = quant.codec_for(req.quantize, t.name, logical.kind, logical.dtype, logical.shape)
        model = _model_twin(t, logical, source, whole_model) if logical.kind == "master" and mode != "keep" else None
        if codec is not None:
            out.append(StoredTensor(t.name, t.key, codec.codes_dtype, codec.codes_shape(t.box.lengths), t.box, t.node))
            out.append(StoredTensor(t.name, scales_key(t.key), "F32", codec.scales_shape(t.box), t.box, t.node, role="scales"))
            if t.node == req.node:
                codings[(t.name, t.box)] = _Coding(codec=codec)
        elif model is not None and mode == "drop":
            cast[t.name] = model
            progress.add(t.nbytes if t.node == req.node else 0)
        elif model is not None:
            out.append(StoredTensor(t.name, t.key, "BF16", t.shape, t.box, t.node))
            if t.node == req.node:
                codings[(t.name, t.box)] = _Coding(model=model)
        else:
            out.append(t)
    return out, codings, cast


def _model_twin(t: StoredTensor, logical: LogicalTensor, source: _Source, whole_model: dict[str, StoredTensor]) -> StoredTensor | None:
    """The stored model weight a whole fp32 master weight can be rebuilt from: "model/<fqn>" for
    "master/<fqn>", stored whole by this node, of the same shape in bf16 or fp16. None otherwise
    (the master weight is then kept)."""
    if logical.dtype != "F32" or t.box != Box.full(logical.shape):
        return None
    model = whole_model.get("model/" + t.name.split("/", 1)[1])
    if model is None or model.node != t.node:
        return None
    twin = source.tensors[model.name]
    if twin.dtype not in ("BF16", "F16") or twin.shape != logical.shape:
        return None
    return model


def _as_torch(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.from_numpy(data).view(getattr(torch, dtypes.torch_name(dtype))).view(shape)


def _write_coded(
    file: _AppendedFile, t: StoredTensor, coding: _Coding, source: _Source, progress: Progress, throttle: Throttle,
    scratch: _ScratchPool, step: int,
) -> _CodedWrite:
    """Code one tensor (int4 codes: in zstd frames) and write its codes and scales side by side
    at the end of `file`. Values that cannot be quantized are logged and written as they are
    instead."""
    from ckptd.common import quant  # imported by _compress already: a lookup

    with scratch.take() as space:
        problem = ""
        with source.values(t) as values:
            try:
                codes, scale_values = quant.encode(coding.codec, values, t.box, space)
            except quant.QuantError as exc:
                problem = str(exc)
            del values  # no export of an arena view may outlive the block
        if problem:
            log.warning("tensor %s of step %s stays lossless: %s", t.name, step, problem)
            raw = StoredTensor(t.name, t.key, source.tensors[t.name].dtype, t.box.lengths, t.box, t.node)
            offset = file.take(raw.nbytes)
            digest, chunks = _write_tensor(file.fd, source.arenas, source.pieces(raw, offset), progress, throttle)
            return _CodedWrite(t, (_Placed(raw, file.name, offset, digest, chunks),), None, False)  # progress counted as written
        data, frames = _flat_bytes(codes), None
        if coding.codec.bits == 4:
            data, frames = compress_frames(data, len(data) // codes.shape[0])
        stored = t if frames is None else StoredTensor(t.name, t.key, "U8", (len(data),), t.box, t.node)
        scale_bytes = _flat_bytes(scale_values)
        scales = StoredTensor(t.name, scales_key(t.key), "F32", tuple(scale_values.shape), t.box, t.node, role="scales")
        offset = file.take(len(data) + len(scale_bytes))
        placed = (
            _Placed(stored, file.name, offset, *_write_bytes(file.fd, memoryview(data), offset, throttle)),
            _Placed(scales, file.name, offset + len(data), *_write_bytes(file.fd, memoryview(scale_bytes), offset + len(data), throttle)),
        )
    progress.add(source.nbytes(t))
    return _CodedWrite(t, placed, frames, True)


def _write_residual(
    fd: int, offset: int, t: StoredTensor, coding: _Coding, source: _Source, progress: Progress, throttle: Throttle, scratch: _ScratchPool
) -> tuple[int, str]:
    """Write the bf16 residual of master weight `t` to its model weight at `offset`; returns
    its xxh3-64 and chunk digests."""
    from ckptd.common import quant

    assert coding.model is not None
    with scratch.take() as space:
        with source.values(t) as master, source.values(coding.model) as weights:
            residual = quant.residual_encode(master, weights, space)
            del master, weights  # no export of an arena view may outlive the block
        digest = _write_bytes(fd, memoryview(_flat_bytes(residual)), offset, throttle)
    progress.add(source.nbytes(t))
    return digest


def _flat_bytes(tensor: Any) -> np.ndarray:
    """A contiguous torch tensor's bytes as a flat uint8 array (no copy; bf16 included)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()


def _fragment_records(
    placed: list[_Placed], codings: dict[tuple[str, Box], _Coding], outcomes: dict[tuple[str, Box], _CodedWrite],
    cast: dict[str, StoredTensor],
) -> tuple[tuple[str, FragmentRecord], ...]:
    """The index records of what was written: codes with their scales and frames (and residuals
    with the model weight they add to) in QuantRecords; dropped master weights as the model
    weight's bytes."""
    where = {(p.tensor.name, p.tensor.box, p.tensor.role): p for p in placed}

    def side(p: _Placed) -> SideRecord:
        t = p.tensor
        return SideRecord(p.file, t.key, t.dtype, t.shape, p.offset, t.nbytes, checksum_name(p.digest), chunk_bytes_for(t.nbytes), p.chunks)

    def fragment(p: _Placed, quant: QuantRecord | None) -> FragmentRecord:
        t = p.tensor
        return FragmentRecord(p.file, t.key, t.box, t.dtype, p.offset, t.nbytes, checksum_name(p.digest), chunk_bytes_for(t.nbytes), p.chunks, quant)

    records = []
    for p in placed:
        t = p.tensor
        if t.role != "data":
            continue
        quant = None
        coding = codings.get((t.name, t.box))
        if coding is not None and coding.model is not None:
            quant = QuantRecord(RESIDUAL, base=side(where[(coding.model.name, coding.model.box, "data")]))
        elif coding is not None and outcomes[(t.name, t.box)].quantized:
            codec = coding.codec
            quant = QuantRecord(codec.name, codec.block, scales=side(where[(t.name, t.box, "scales")]), frames=outcomes[(t.name, t.box)].frames)
        records.append((t.name, fragment(p, quant)))
    for name, model in cast.items():
        records.append((name, fragment(where[(model.name, model.box, "data")], QuantRecord(CAST))))
    return tuple(records)


def _whole_parts(plan: SavePlan) -> list[StoredPart]:
    return [StoredPart(t.name, Box.full(t.shape), 0, True) for t in plan.tensors]


def step_files(
    job: str,
    step: int,
    plan: SavePlan,
    manifests: Sequence[NodeManifest],
    extras: dict[int, Any],
    model_files: dict[str, bytes],
    metric: float | None,
    clock: Callable[[], float] = time.time,
    quantization: dict[str, Any] | None = None,
) -> tuple[CheckpointIndex, dict[str, bytes]]:
    """The index and the small files that commit a step whose data files the nodes wrote.

    Returns (index, {file name: bytes}) with ckptd.index.json last. Pure. Raises
    IncompleteStep when the manifests do not hold every tensor's bytes exactly once.
    """
    by_name: dict[str, list[FragmentRecord]] = {}
    for manifest in manifests:
        for name, fragment in manifest.fragments:
            by_name.setdefault(name, []).append(fragment)
    problems = []
    for t in plan.tensors:
        found = coverage_problems(t.shape, [f.box for f in by_name.get(t.name, [])])
        if found:
            problems.append(f"{t.name}: {found[0]}")
    if problems:
        raise IncompleteStep(f"{len(problems)} tensors are not written exactly once: " + "; ".join(problems[:5]))
    data_files = [f for manifest in sorted(manifests, key=lambda m: m.node) for f in manifest.files]
    kinds = {t.name: t.kind for t in plan.tensors}
    small: dict[str, bytes] = {}
    for group in ("model", "master_weights", "optimizer"):
        in_group = [(name, f) for name, fs in sorted(by_name.items()) for f in fs if GROUP_OF_KIND[kinds[name]] == group]
        split = any(len(by_name[name]) > 1 for name, _ in in_group)
        # a dropped master weight is the model weight's bytes: not in the master files
        pieces = [piece for _, f in in_group for piece in f.stored_pieces()]
        if pieces and not (group == "model" and split):  # fragments: `ckptd export` makes the HF form
            weight_map = {piece.key: piece.file for piece in pieces}
            small[f"{group}.safetensors.index.json"] = hf_index_json(sum(piece.nbytes for piece in pieces), weight_map)
    small[EXTRA_JSON] = extra_json(step, extras)
    small.update(model_files)
    records = [FileRecord(name, len(data), checksum_name(xxhash.xxh3_64_intdigest(data))) for name, data in small.items()]

    def record(t: LogicalTensor) -> TensorRecord:
        fragments = tuple(sorted(by_name[t.name], key=lambda f: f.box))
        return TensorRecord(t.name, t.kind, t.dtype, t.shape, fragments, t.aliases)

    index = CheckpointIndex(
        job=job,
        step=step,
        created_at=clock(),
        world_size=plan.world_size,
        tensors=tuple(record(t) for t in plan.tensors),
        files=tuple(data_files + records),
        metric=metric,
        writer={"host": socket.gethostname(), "ckptd": VERSION, "nodes": len(manifests)},
        quantization=quantization,
    )
    small[INDEX_NAME] = index.to_json_bytes()
    return index, small


def write_step_files(storage: Storage, job: str, step: int, files: dict[str, bytes]) -> None:
    """Write a step's small files (each fsynced), fsync the directory, then the index: the commit.

    `files` comes from step_files(); its ckptd.index.json is written last, atomically."""
    step_dir = storage.ensure_step_dir(job, step)
    for name, data in files.items():
        if name != INDEX_NAME:
            _write_synced(step_dir / name, data)
    fsync_dir(step_dir)
    write_small_file(step_dir / INDEX_NAME, files[INDEX_NAME])


def _open_for_writing(path: Path, recycled: Path | None, size: int) -> int:
    """A new file at `path` of `size` bytes (mode 0640, never through a link), made from a
    recycled file when there is one that is still the daemon's own (storage.open_recycled: gone,
    taken by another node sharing the root, or foreign, it is not used): its blocks are
    overwritten in place (no new allocation), and any excess is cut off."""
    fd = open_recycled(recycled, path) if recycled is not None else None
    if fd is None:
        return create_file(path)
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)
    return fd


def _write_synced(path: Path, data: bytes) -> None:
    """Write a small file of the (not yet committed) step directory and fsync it (mode 0640,
    never through a link: storage.create_file)."""
    with os.fdopen(create_file(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_tensor(fd: int, arenas: ArenaSet, pieces: list[_Piece], progress: Progress, throttle: Throttle) -> tuple[int, str]:
    """Write one tensor's runs (in file order, contiguous); return the xxh3-64 of its bytes and
    the digests of its chunks (ckptd.common.chunks)."""
    hasher = xxhash.xxh3_64()
    chunks = ChunkHasher(chunk_bytes_for(sum(p.nbytes for p in pieces)))
    for piece in pieces:
        arena = arenas.arenas[piece.rank]
        assert arena is not None, "plan gave a fragment to a rank without an arena"
        done = 0
        while done < piece.nbytes:
            n = min(throttle.chunk, piece.nbytes - done)
            throttle.wait(n)
            view = arena.view(piece.src + done, n)
            try:
                _write_hashed(fd, view, piece.dst + done, hasher, chunks)
            finally:
                view.release()
            done += n
            progress.add(n)
    return hasher.intdigest(), chunks.hexdigests()


def _write_bytes(fd: int, data: memoryview, offset: int, throttle: Throttle) -> tuple[int, str]:
    """Write bytes made in memory at `offset`; returns their xxh3-64 and the digests of their
    chunks (ckptd.common.chunks)."""
    hasher = xxhash.xxh3_64()
    chunks = ChunkHasher(chunk_bytes_for(len(data)))
    for done in range(0, len(data), throttle.chunk):
        chunk = data[done : done + throttle.chunk]
        throttle.wait(len(chunk))
        _write_hashed(fd, chunk, offset + done, hasher, chunks)
    return hasher.intdigest(), chunks.hexdigests()


def _write_hashed(fd: int, view: memoryview, offset: int, hasher: Any, chunks: ChunkHasher) -> None:
    """Hash `view` into `hasher` and `chunks` and write it at `offset`, HASH_SLICE at a time; then
    start its writeback (storage.start_writeback): the disk writes it while the rest of the
    step is copied and coded, and the final fsync waits only for the tail."""
    for begin in range(0, len(view), HASH_SLICE):
        piece = view[begin : begin + HASH_SLICE]
        hasher.update(piece)
        chunks.update(piece)
        _pwrite_all(fd, piece, offset + begin)
    start_writeback(fd, offset, len(view))


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
