"""The writer: executes a save's write plan against a StorageBackend. Threads, ordering,
hashing, progress; every byte goes through the backend (storage/base.py), never to a path.

Runs in worker threads (never on the event loop). Data goes from the shared-memory arenas to
the backend's parts with positional writes of zero-copy views, several tensors in parallel;
each stored tensor's xxh3 checksum is computed from the same views while it is written. What
the files hold (layouts, header room, records, the small files) is plan/files.py, pure.

Commit order (a crash anywhere before the index is published leaves no visible step): data
parts (temporary, synced, published) → sync_step → HF indexes, extra.json → sync_step →
ckptd.index.json, atomically → `latest`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import xxhash

from ckptd.common.chunks import HASH_SLICE, ChunkHasher, checksum_name, chunk_bytes_for
from ckptd.common.frames import compress as compress_frames
from ckptd.daemon.errors import NoSpace
from ckptd.format.index import CheckpointIndex, FileLayout, FileRecord, FormatError, StoredTensor, layout_files, safetensors_header, scales_key
from ckptd.format.units import Unit, file_units
from ckptd.daemon.handoff.arena import ArenaSet
from ckptd.daemon.plan.files import (
    CodedWrite,
    Coding,
    NodeManifest,
    Placed,
    file_bytes_bound,
    fragment_records,
    header_room,
    placed_when_coded,
    scales_shapes,
    step_files,
    stored_tensors,
)
from ckptd.daemon.plan.save_plan import FragmentSlot, LogicalTensor, SavePlan
from ckptd.daemon.storage.base import PartWriter, StorageBackend
from ckptd.daemon.storage.space import reused_bytes, space_problem
from ckptd.daemon.storage.step_commit import StepCommit
from ckptd.daemon.write.reuse import Reuse, check_linked, frozen_names, reusable_files
from ckptd.daemon.write.source import Piece, ScratchPool, Source, compress, flat_bytes

log = logging.getLogger(__name__)

WRITE_CHUNK = 64 * 2**20


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
    previous: CheckpointIndex | None = None  # the job's newest committed step: its unchanged files of frozen tensors are linked (write/reuse.py)


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
    """A save's bytes (of stored tensors) written so far, and those linked from the previous step
    instead (incremental saves: read back and checked, not written); read by WaitDurable and
    Status from another thread. `total`: all of the save's bytes, written or linked."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._written = 0
        self._linked = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """`nbytes` more were written."""
        with self._lock:
            self._written += nbytes

    def link(self, nbytes: int) -> None:
        """`nbytes` more were linked from the previous step (and checked) instead of written."""
        with self._lock:
            self._linked += nbytes

    @property
    def written(self) -> int:
        return self._written

    @property
    def linked(self) -> int:
        return self._linked


def persist(storage: StorageBackend, req: PersistRequest, progress: Progress, clock: Callable[[], float] = time.time) -> CheckpointIndex:
    """One node alone: write the snapshot in `req.arenas` as committed step `req.step`; returns
    its index. The writer's own test harness and tools use it; the daemon commits every save
    through its coordinator instead (engine/commit.py), which writes the same index the same way.

    Raises NoSpace, before anything is written, when the step's files would not fit (see
    check_space); OSError (disk full, I/O error) with the step directory removed again.
    """
    try:
        manifest = write_node_files(storage, req, progress)
        index, files = step_files(
            req.job, req.step, req.plan, [manifest], req.extras, req.model_files, req.metric, clock, req.quantization
        )
        StepCommit(storage.writing, storage.catalog, req.job, req.step).commit(files)
        return index
    except BaseException:
        storage.janitor.remove_step(req.job, req.step)
        raise


def write_node_files(storage: StorageBackend, req: PersistRequest, progress: Progress) -> NodeManifest:
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
    stored = stored_tensors(plan)
    files: list[FileRecord] = []
    placed: list[Placed] = []
    throttle = Throttle(req.throttle_bytes_per_s)
    source = Source(req.arenas, tensors, slots_by_name, slot_of)
    stored, codings, cast = compress(source, stored, kinds, req, progress)
    # Largest files first: they take the largest recycled files.
    frozen = frozen_names(plan.tensors)
    every_node = layout_files(stored, kinds, req.max_file_bytes, frozen)
    layouts = [f for f in every_node if f.node == req.node]
    layouts.sort(key=lambda f: -f.nbytes)
    previous = req.previous if frozen else None
    reusable: dict[str, Reuse] = {}
    previous_units: dict[str, tuple[Unit, ...]] = {}
    if previous is not None:
        uncoded = [f for f in layouts if not any((t.name, t.box) in codings for t in f.tensors)]
        reusable = reusable_files(uncoded, frozen, previous, source, req.node, req.shared_dir, req.write_threads)
        if reusable:
            try:
                previous_units = file_units(previous)
            except FormatError as exc:  # its files cannot be checked: none is linked
                log.warning("step %s of job %s writes every file: the files of step %s cannot be checked (%s)", req.step, req.job, previous.step, exc)
                reusable = {}
    recycled = storage.writing.take_recycled(req.job)
    check_space(storage, req, [f for f in (every_node if req.shared_dir else layouts) if f.name not in reusable], tensors, [r.size for r in recycled])
    storage.writing.prepare_step(req.job, req.step, fresh=not req.shared_dir)
    # A linked file found damaged is written after all: bytes check_space did not count (rare;
    # a disk that is full then fails the save as any write does).
    linked, damaged = _link_checked(storage, req, reusable, previous_units)
    for reuse in linked:
        files.append(reuse.record)
        placed += reuse.placed
        progress.link(sum(source.nbytes(t) for t in reuse.layout.tensors))
    linked_names = {reuse.layout.name for reuse in linked}
    layouts = [f for f in layouts if f.name not in linked_names]
    scratch = ScratchPool(min(req.write_threads, os.cpu_count() or 1))
    opened: list[PartWriter] = []
    with ThreadPoolExecutor(max(1, req.write_threads), thread_name_prefix="ckptd-write") as pool:
        # Which tensors go into which file follows from the shapes (all nodes number the same
        # files). Tensors of known size are written at fixed offsets; quantized codes are coded
        # and written by one writer job each, placed after the file's fixed tensors in the
        # order they finish (their size depends on the values), and such a file's header is
        # written last, into room reserved for it.
        writes: list[tuple[StoredTensor, str, int, Future[tuple[int, str]]]] = []
        jobs: list[tuple[int, Callable[[], CodedWrite], list[Future[CodedWrite]]]] = []  # (bytes to code, job, its file's jobs)
        plain: list[tuple[int, list[Future[Any]]]] = []  # files without coded tensors, and their writes
        finishes: list[tuple[_AppendedFile, list[StoredTensor], int, list[Future[Any]], list[Future[CodedWrite]]]] = []
        coded: list[Future[CodedWrite]] = []
        try:
            for layout in layouts:
                fixed = [t for t in layout.tensors if not placed_when_coded(t, codings)]
                late = [t for t in layout.tensors if placed_when_coded(t, codings) and t.role == "data"]
                header, entries = safetensors_header((t.key, t.dtype, t.shape) for t in fixed)
                header_size = header_room(fixed, late, tensors, scales_shapes(layout)) if late else len(header)
                part = storage.writing.open_part(req.job, req.step, layout.name, header_size + layout.nbytes, recycled.pop(0) if recycled else None)
                opened.append(part)
                file_writes = []
                for tensor, entry in zip(fixed, entries):
                    offset = header_size + entry.begin
                    coding = codings.get((tensor.name, tensor.box))
                    if coding is not None:  # a residual: its size is known
                        write = functools.partial(_write_residual, part, offset, tensor, coding, source, progress, throttle, scratch)
                    else:
                        write = functools.partial(_write_tensor, part, req.arenas, source.pieces(tensor, offset), progress, throttle)
                    writes.append((tensor, layout.name, offset, pool.submit(write)))
                    file_writes.append(writes[-1][3])
                if not late:
                    part.pwrite(0, memoryview(header))
                    files.append(FileRecord(layout.name, len(header) + layout.nbytes, checksum_name(xxhash.xxh3_64_intdigest(header)), req.node))
                    plain.append((part, file_writes))
                    continue
                file = _AppendedFile(part, header_size + sum(t.nbytes for t in fixed))
                file_jobs: list[Future[CodedWrite]] = []
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
            syncs = [pool.submit(_sync_when_written, part, file_writes) for part, file_writes in plain]
            finished = [pool.submit(_finish_file, *finish, req.node) for finish in finishes]
            placed += [Placed(t, name, offset, *digest.result()) for t, name, offset, digest in writes]
            for finish in finished:
                record, late_placed = finish.result()
                files.append(record)
                placed += late_placed
            for sync in syncs:
                sync.result()
        finally:
            # after an error: no job may still be writing when the descriptors are closed
            pool.shutdown(wait=True, cancel_futures=True)
            for part in opened:
                part.close()
    for part in opened:
        part.publish()
    StepCommit(storage.writing, storage.catalog, req.job, req.step).parts_published()
    outcomes = {(w.tensor.name, w.tensor.box): w for w in (f.result() for f in coded)}
    return NodeManifest(req.node, tuple(files), fragment_records(placed, codings, outcomes, cast), tuple(r.layout.name for r in linked), tuple(damaged))


def _link_checked(
    storage: StorageBackend, req: PersistRequest, reusable: dict[str, Reuse], units: dict[str, tuple[Unit, ...]]
) -> tuple[list[Reuse], list[str]]:
    """Link the reusable files of the previous step into the new one and read each back against
    the previous index (reuse.check_linked): (the files linked and checked, the names of those
    linked that did not match). A file that did not match stays linked only until the writer
    publishes it, written from the snapshot, under the same name (publish replaces the link)."""
    previous = req.previous
    if previous is None or not reusable:
        return [], []
    linked = [r for r in reusable.values() if storage.writing.link_file(req.job, previous.step, r.source.name, req.step, r.layout.name, r.record.size)]
    problems = check_linked(storage, req.job, req.step, linked, units, req.write_threads) if linked else {}
    for name, problem in problems.items():
        reuse = reusable[name]
        log.warning(
            "step %s of job %s: %s, linked from step %s (%s), does not match the snapshot: %s. Step %s's copy of it is damaged on disk "
            "(check it: `ckptd verify %s`); step %s writes the file again from the snapshot",
            req.step, req.job, name, previous.step, reuse.source.name, problem, previous.step,
            storage.catalog.step_location(req.job, previous.step), req.step, extra={"job": req.job, "step": req.step},
        )
    return [r for r in linked if r.layout.name not in problems], sorted(problems)


def check_space(
    storage: StorageBackend, req: PersistRequest, layouts: Sequence[FileLayout], tensors: dict[str, LogicalTensor], recycled: Sequence[int]
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
    measured = storage.writing.free_bytes(req.job)
    if measured is None:
        log.debug("the storage of job %s reports no size: step %s is written without a free-space check", req.job, req.step)
        return
    free, where = measured.nbytes, measured.where
    present = storage.writing.allocated_in_step(req.job, req.step) if req.shared_dir else {}
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

    def __init__(self, part: PartWriter, end: int) -> None:
        self.part = part
        self.name = part.name
        self.end = end
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> int:
        """The offset of a range of `nbytes` at the end of the file, now this caller's."""
        with self._lock:
            offset, self.end = self.end, self.end + nbytes
        return offset


def _sync_when_written(part: PartWriter, writes: list[Future[Any]], size: int | None = None) -> None:
    """Sync a part (cut to `size` when given) once its writes are done (raises what a write raised)."""
    for write in writes:
        write.result()
    part.sync(size)


def _finish_file(
    file: _AppendedFile, fixed: list[StoredTensor], header_size: int, fixed_writes: list[Future[Any]],
    coded: list[Future["CodedWrite"]], node: int,
) -> tuple[FileRecord, list[Placed]]:
    """Once the file's coding jobs are done, write its header (padded to `header_size`), cut
    the file after the last coded tensor and fsync it once `fixed_writes` are done too.
    Returns its record and the coded tensors' places."""
    placed = sorted((p for job in coded for p in job.result().placed), key=lambda p: p.offset)
    header, _ = safetensors_header([(t.key, t.dtype, t.shape) for t in fixed] + [(p.tensor.key, p.tensor.dtype, p.tensor.shape) for p in placed], size=header_size)
    file.part.pwrite(0, memoryview(header))
    _sync_when_written(file.part, fixed_writes, file.end)
    return FileRecord(file.name, file.end, checksum_name(xxhash.xxh3_64_intdigest(header)), node), placed


def _write_coded(
    file: _AppendedFile, t: StoredTensor, coding: Coding, source: Source, progress: Progress, throttle: Throttle,
    scratch: ScratchPool, step: int,
) -> CodedWrite:
    """Code one tensor (int4 codes: in zstd frames) and write its codes and scales side by side
    at the end of `file`. Values that cannot be quantized are logged and written as they are
    instead."""
    from ckptd.common.blocks import QuantError

    with scratch.take() as space:
        problem = ""
        with source.values(t) as values:
            try:
                codes, scale_values = coding.codec.encode(values, t.box, space)
            except QuantError as exc:
                problem = str(exc)
            del values  # no export of an arena view may outlive the block
        if problem:
            log.warning("tensor %s of step %s stays lossless: %s", t.name, step, problem)
            raw = StoredTensor(t.name, t.key, source.tensors[t.name].dtype, t.box.lengths, t.box, t.node)
            offset = file.take(raw.nbytes)
            digest, chunks = _write_tensor(file.part, source.arenas, source.pieces(raw, offset), progress, throttle)
            return CodedWrite(t, (Placed(raw, file.name, offset, digest, chunks),), None, False)  # progress counted as written
        data, frames = flat_bytes(codes), None
        if coding.codec.framed:
            data, frames = compress_frames(data, len(data) // codes.shape[0])
        stored = t if frames is None else StoredTensor(t.name, t.key, "U8", (len(data),), t.box, t.node)
        scale_bytes = flat_bytes(scale_values)
        scales = StoredTensor(t.name, scales_key(t.key), "F32", tuple(scale_values.shape), t.box, t.node, role="scales")
        offset = file.take(len(data) + len(scale_bytes))
        placed = (
            Placed(stored, file.name, offset, *_write_bytes(file.part, memoryview(data), offset, throttle)),
            Placed(scales, file.name, offset + len(data), *_write_bytes(file.part, memoryview(scale_bytes), offset + len(data), throttle)),
        )
    progress.add(source.nbytes(t))
    return CodedWrite(t, placed, frames, True)


def _write_residual(
    part: PartWriter, offset: int, t: StoredTensor, coding: Coding, source: Source, progress: Progress, throttle: Throttle, scratch: ScratchPool
) -> tuple[int, str]:
    """Write the bf16 residual of master weight `t` to its model weight at `offset`; returns
    its xxh3-64 and chunk digests."""
    from ckptd.common import quant

    assert coding.model is not None
    with scratch.take() as space:
        with source.values(t) as master, source.values(coding.model) as weights:
            residual = quant.residual_encode(master, weights, space)
            del master, weights  # no export of an arena view may outlive the block
        digest = _write_bytes(part, memoryview(flat_bytes(residual)), offset, throttle)
    progress.add(source.nbytes(t))
    return digest


def _write_tensor(part: PartWriter, arenas: ArenaSet, pieces: list[Piece], progress: Progress, throttle: Throttle) -> tuple[int, str]:
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
                _write_hashed(part, view, piece.dst + done, hasher, chunks)
            finally:
                view.release()
            done += n
            progress.add(n)
    return hasher.intdigest(), chunks.hexdigests()


def _write_bytes(part: PartWriter, data: memoryview, offset: int, throttle: Throttle) -> tuple[int, str]:
    """Write bytes made in memory at `offset`; returns their xxh3-64 and the digests of their
    chunks (ckptd.common.chunks)."""
    hasher = xxhash.xxh3_64()
    chunks = ChunkHasher(chunk_bytes_for(len(data)))
    for done in range(0, len(data), throttle.chunk):
        chunk = data[done : done + throttle.chunk]
        throttle.wait(len(chunk))
        _write_hashed(part, chunk, offset + done, hasher, chunks)
    return hasher.intdigest(), chunks.hexdigests()


def _write_hashed(part: PartWriter, view: memoryview, offset: int, hasher: Any, chunks: ChunkHasher) -> None:
    """Hash `view` into `hasher` and `chunks` and write it at `offset`, HASH_SLICE at a time; then
    start its writeback (PartWriter.start_writeback): the disk writes it while the rest of the
    step is copied and coded, and the final fsync waits only for the tail."""
    for begin in range(0, len(view), HASH_SLICE):
        piece = view[begin : begin + HASH_SLICE]
        hasher.update(piece)
        chunks.update(piece)
        part.pwrite(offset + begin, piece)
    part.start_writeback(offset, len(view))
