"""The writer: executes a node's write plan (plan/node_files.NodeFilePlan) against a
StorageBackend. Threads, ordering, hashing, progress; every byte goes through the backend
(storage/base.py), never to a path.

Runs in worker threads (never on the event loop). Data goes from the shared-memory arenas to
the backend's parts with positional writes of zero-copy views, several tensors in parallel;
each stored tensor's xxh3 checksum is computed from the same views while it is written. What
the files hold (layouts, headers, offsets, arena runs, codings) is plan/node_files.py; the
index records and the small files plan/files.py; both pure.

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
from typing import Any, Callable, Sequence, TypeVar

import xxhash

from ckptd.common.chunks import HASH_SLICE, ChunkHasher, checksum_name, chunk_bytes_for
from ckptd.common.frames import compress as compress_frames
from ckptd.daemon.errors import NoSpace
from ckptd.format.index import CheckpointIndex, FileRecord, FormatError, FragmentRecord, StoredTensor, scales_key
from ckptd.format.safetensors_header import safetensors_header
from ckptd.format.units import Unit, file_units
from ckptd.daemon.plan.files import CodedWrite, NodeManifest, PlacedTensor, fragment_records, step_files
from ckptd.daemon.plan.node_files import AppendedItem, FileItem, FilePlan, FileSpace, NodeFilePlans, TensorBytes
from ckptd.daemon.storage.base import PartWriter, RecycledFile, StorageBackend
from ckptd.daemon.storage.space import reused_bytes, space_problem
from ckptd.daemon.storage.step_commit import StepCommit
from ckptd.daemon.write.digests import TensorDigests
from ckptd.daemon.write.request import PersistRequest, Progress
from ckptd.daemon.write.reuse import Reuse, check_linked, unchanged_files
from ckptd.daemon.write.source import ArenaSource, ScratchPool, flat_bytes, load_torch

log = logging.getLogger(__name__)
T = TypeVar("T")

WRITE_CHUNK = 64 * 2**20
# Tensors written by one writer job: about this many bytes of consecutive small tensors of a file
# (write_batches). At 4,000 tensors of 64 KiB a job, a pwrite and a writeback start per tensor
# were most of the daemon's CPU time of a save (issue 33).
BATCH_BYTES = 8 * 2**20
WRITEBACK_BYTES = 8 * 2**20  # bytes written between two writeback starts (_Extent)
IOV_SLICES = 512  # slices per pwritev, below the kernel's IOV_MAX (1024)


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
            req.job, req.step, req.plan, [manifest], req.extras, req.model_files, req.metric, clock, req.quantization,
            after=storage.catalog.newest_commit_time(req.job),
        )
        StepCommit(storage.writing, storage.catalog, req.job, req.step).commit(files)
        return index
    except BaseException:
        storage.janitor.remove_step(req.job, req.step)
        raise


def write_node_files(storage: StorageBackend, req: PersistRequest, progress: Progress) -> NodeManifest:
    """Write the data files that the plan gives to node `req.node`: temp names, fsync, rename.

    Plans them first (plan/node_files.py, pure), links the unchanged ones from `req.previous`
    (write/reuse.py), then executes the plan. The step is not committed by this (no index).
    With `req.shared_dir` other nodes write into the same step directory at the same time, so
    it is not emptied first. Raises NoSpace when the files would not fit (check_space), before
    the step directory or any file of it is created.
    """
    planner = req.file_plans or NodeFilePlans()  # a fresh one plans anew
    files = planner.plan(
        req.job, req.plan, req.node, req.max_file_bytes, quantize=req.quantize, master_weights=req.master_weights,
        shared_dir=req.shared_dir, previous=req.previous,
    )
    if req.quantize is not None or req.master_weights != "keep":
        load_torch()
    progress.add(files.dropped_bytes)  # dropped master weights: nothing to write
    source = ArenaSource(req.arenas)
    reusable = unchanged_files(files.candidates, source, req.write_threads)
    previous_units: dict[str, tuple[Unit, ...]] = {}
    if reusable and req.previous is not None:
        try:
            previous_units = file_units(req.previous)
        except FormatError as exc:  # its files cannot be checked: none is linked
            log.warning("step %s of job %s writes every file: the files of step %s cannot be checked (%s)", req.step, req.job, req.previous.step, exc)
            reusable = {}
    recycled = storage.writing.take_recycled(req.job)
    check_space(storage, req, [f for f in files.space if f.name not in reusable], [r.size for r in recycled])
    storage.writing.prepare_step(req.job, req.step, fresh=not req.shared_dir)
    # A linked file found damaged is written after all: bytes check_space did not count (rare;
    # a disk that is full then fails the save as any write does).
    linked, damaged = _link_checked(storage, req, reusable, previous_units)
    records = [reuse.record for reuse in linked]
    placed = [p for reuse in linked for p in reuse.placed]
    for reuse in linked:
        progress.link(reuse.candidate.file.snapshot_bytes)
    linked_names = {reuse.name for reuse in linked}

    # A lossless save's records are each tensor's own (fragment_records maps them one by one):
    # made batch by batch while the other writer jobs still write. At 4,000 tensors they take
    # ~14 ms, which the fsyncs no longer hide (their writeback starts early: _Extent).
    lossless = not files.codings and not files.cast
    early: list[tuple[str, FragmentRecord]] = []
    described = 0  # the places on_written described: the first of those _write_files lists

    def on_written(batch: list[PlacedTensor]) -> None:
        nonlocal described
        if lossless:
            early.extend(fragment_records(batch, {}, {}, {}))
            described += len(batch)

    def describe(written_placed: list[PlacedTensor], coded: list[CodedWrite]) -> tuple[tuple[str, FragmentRecord], ...]:
        if lossless:  # what on_written did not see (none today: files are appended to only when coded) described now
            rest = written_placed[described:]
            return fragment_records(placed, {}, {}, {}) + tuple(early) + fragment_records(rest, {}, {}, {})
        outcomes = {(w.tensor.name, w.tensor.box): w for w in coded}
        return fragment_records(placed + written_placed, files.codings, outcomes, files.cast)

    files_to_write = [f for f in files.files if f.name not in linked_names]
    written, fragments = _write_files(storage, req, files_to_write, recycled, source, progress, on_written, describe)
    StepCommit(storage.writing, storage.catalog, req.job, req.step).parts_published()
    return NodeManifest(req.node, tuple(records + written), fragments, tuple(r.name for r in linked), tuple(damaged))


def _write_files(
    storage: StorageBackend, req: PersistRequest, files: Sequence[FilePlan], recycled: list[RecycledFile], source: ArenaSource,
    progress: Progress, on_written: Callable[[list[PlacedTensor]], None], describe: Callable[[list[PlacedTensor], list[CodedWrite]], T],
) -> tuple[list[FileRecord], T]:
    """Write `files` over the recycled files (`recycled`: taken from the front), sync and
    publish each. Returns their records and what `describe` makes of the places of their
    tensors and the coding jobs' outcomes (the index records: made while the files' fsyncs
    run, once every tensor is written). `on_written` is given the places of each writer job's
    tensors as the job finishes, in the order of the files' tensors."""
    throttle = Throttle(req.throttle_bytes_per_s)
    scratch = ScratchPool(min(req.write_threads, os.cpu_count() or 1))
    records: list[FileRecord] = []
    opened: list[PartWriter] = []
    with ThreadPoolExecutor(max(1, req.write_threads), thread_name_prefix="ckptd-write") as pool:
        # Tensors of known size are written at fixed offsets; quantized codes are coded and
        # written by one writer job each, placed after the file's fixed tensors in the order
        # they finish (their size depends on the values), and such a file's header is written
        # last, into room reserved for it.
        writes: list[tuple[list[FileItem], str, Future[list[tuple[int, str]]]]] = []  # (tensors, their file, their digests)
        jobs: list[tuple[int, Callable[[], CodedWrite], list[Future[CodedWrite]]]] = []  # (bytes to code, job, its file's jobs)
        plain: list[tuple[PartWriter, list[Future[Any]]]] = []  # files without coded tensors, and their writes
        finishes: list[tuple[_AppendedFile, FilePlan, list[Future[Any]], list[Future[CodedWrite]]]] = []
        coded: list[Future[CodedWrite]] = []
        try:
            for file in files:
                part = storage.writing.open_part(req.job, req.step, file.name, file.room + file.nbytes, recycled.pop(0) if recycled else None)
                opened.append(part)
                file_writes: list[Future[Any]] = []
                for batch in write_batches(file.fixed):
                    if batch[0].coding is not None:  # a residual: its size is known
                        write: Callable[[], list[tuple[int, str]]] = functools.partial(_write_residual, part, batch[0], source, progress, throttle, scratch)
                    else:
                        write = functools.partial(_write_tensors, part, source, [(item.offset, item.values) for item in batch], progress, throttle)
                    writes.append((batch, file.name, pool.submit(write)))
                    file_writes.append(writes[-1][2])
                if file.record is not None:  # nothing appended: the header is known
                    part.pwrite(0, memoryview(file.header))
                    records.append(file.record)
                    plain.append((part, file_writes))
                    continue
                appended = _AppendedFile(part, file.appended_from)
                file_jobs: list[Future[CodedWrite]] = []
                for late in file.appended:
                    job = functools.partial(_write_coded, appended, late, source, progress, throttle, scratch, req.step)
                    jobs.append((late.tensor.box.numel, job, file_jobs))
                finishes.append((appended, file, file_writes, file_jobs))
            # Coding jobs after the fixed writes (those start the disk early), largest first (the
            # threads finish together instead of one coding the last big tensor alone); then each
            # file's fsync or finish, queued after every job it waits for (a pool job waits only
            # for jobs queued before it, so none deadlocks).
            jobs.sort(key=lambda job: -job[0])
            for _, coding_job, file_jobs in jobs:
                file_jobs.append(pool.submit(coding_job))
                coded.append(file_jobs[-1])
            syncs = [pool.submit(_sync_when_written, part, file_writes) for part, file_writes in plain]
            finished = [pool.submit(_finish_file, *finish, req.node) for finish in finishes]
            placed: list[PlacedTensor] = []
            for batch, name, job in writes:
                done = [PlacedTensor(item.tensor, name, item.offset, *digest) for item, digest in zip(batch, job.result(), strict=True)]
                placed += done
                on_written(done)
            for finish in finished:
                record, late_placed = finish.result()
                records.append(record)
                placed += late_placed
            described = describe(placed, [job.result() for job in coded])
            for sync in syncs:
                sync.result()
        finally:
            # after an error: no job may still be writing when the descriptors are closed
            pool.shutdown(wait=True, cancel_futures=True)
            for part in opened:
                part.close()
    for part in opened:
        part.publish()
    return records, described


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
    linked = [r for r in reusable.values() if storage.writing.link_file(req.job, previous.step, r.previous.name, req.step, r.name, r.record.size)]
    problems = check_linked(storage, req.job, req.step, linked, units, req.write_threads) if linked else {}
    for name, problem in problems.items():
        reuse = reusable[name]
        log.warning(
            "step %s of job %s: %s, linked from step %s (%s), does not match the snapshot: %s. Step %s's copy of it is damaged on disk "
            "(check it: `ckptd verify %s`); step %s writes the file again from the snapshot",
            req.step, req.job, name, previous.step, reuse.previous.name, problem, previous.step,
            storage.catalog.step_location(req.job, previous.step), req.step, extra={"job": req.job, "step": req.step},
        )
    return [r for r in linked if r.name not in problems], sorted(problems)


def check_space(storage: StorageBackend, req: PersistRequest, files: Sequence[FileSpace], recycled: Sequence[int]) -> None:
    """Raise NoSpace unless the data files `files` fit on the storage root's file system with
    `req.disk_reserve` bytes to spare; called before anything of the step is created.

    Needed = the files' bytes (FileSpace.bound: an upper bound for quantized tensors) - the
    bytes that overwrite recycled files in place (`recycled`: the bin's sizes, largest first,
    given to the files largest first, as write_node_files does) + the reserve, against
    statvfs's free bytes. The step's small files (indexes, extra.json, model config files) are
    left to the reserve.

    `files` are this node's; in a root shared by several nodes (req.shared_dir) every node's,
    since they all take the same free space at once: files some node has already started then
    count only for what they still lack (Storage.allocated_in_step), and the rest take the
    recycled files. With several nodes writing at once this is an estimate (the nodes race for
    the recycled files); with a root of its own it is a bound. A file system that reports no
    size is not checked."""
    measured = storage.writing.free_bytes(req.job)
    if measured is None:
        log.debug("the storage of job %s reports no size: step %s is written without a free-space check", req.job, req.step)
        return
    free, where = measured.nbytes, measured.where
    present = storage.writing.allocated_in_step(req.job, req.step) if req.shared_dir else {}
    started = [f for f in files if f.name in present]
    fresh = [f for f in files if f.name not in present]
    fresh.sort(key=lambda f: -f.nbytes)
    sizes = [f.bound for f in fresh]
    write_bytes = sum(sizes) + sum(max(0, f.bound - present[f.name]) for f in started)
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
    file: _AppendedFile, plan: FilePlan, fixed_writes: list[Future[Any]], coded: list[Future[CodedWrite]], node: int,
) -> tuple[FileRecord, list[PlacedTensor]]:
    """Once the file's coding jobs are done, write its header (padded to `plan.room`), cut the
    file after the last coded tensor and fsync it once `fixed_writes` are done too. Returns its
    record and the coded tensors' places."""
    placed = sorted((p for job in coded for p in job.result().placed), key=lambda p: p.offset)
    stored = [item.tensor for item in plan.fixed] + [p.tensor for p in placed]
    header, _ = safetensors_header([(t.key, t.dtype, t.shape) for t in stored], size=plan.room)
    file.part.pwrite(0, memoryview(header))
    _sync_when_written(file.part, fixed_writes, file.end)
    return FileRecord(file.name, file.end, checksum_name(xxhash.xxh3_64_intdigest(header)), node), placed


def _write_coded(
    file: _AppendedFile, item: AppendedItem, source: ArenaSource, progress: Progress, throttle: Throttle, scratch: ScratchPool, step: int,
) -> CodedWrite:
    """Code one tensor (int4 codes: in zstd frames) and write its codes and scales side by side
    at the end of `file`. Values that cannot be quantized are logged and written as they are
    instead."""
    from ckptd.common.blocks import QuantError

    t = item.tensor
    with scratch.take() as space:
        problem = ""
        with source.values(item.values) as values:
            try:
                codes, scale_values = item.coding.codec.encode(values, t.box, space)
            except QuantError as exc:
                problem = str(exc)
            del values  # no export of an arena view may outlive the block
        if problem:
            log.warning("tensor %s of step %s stays lossless: %s", t.name, step, problem)
            raw = StoredTensor(t.name, t.key, item.values.dtype, t.box.lengths, t.box, t.node)
            offset = file.take(raw.nbytes)
            ((digest, chunks),) = _write_tensors(file.part, source, [(offset, item.values)], progress, throttle)
            return CodedWrite(t, (PlacedTensor(raw, file.name, offset, digest, chunks),), None, False)  # progress counted as written
        data, frames = flat_bytes(codes), None
        if item.coding.codec.framed:
            data, frames = compress_frames(data, len(data) // codes.shape[0])
        stored = t if frames is None else StoredTensor(t.name, t.key, "U8", (len(data),), t.box, t.node)
        scale_bytes = flat_bytes(scale_values)
        scales = StoredTensor(t.name, scales_key(t.key), "F32", tuple(scale_values.shape), t.box, t.node, role="scales")
        offset = file.take(len(data) + len(scale_bytes))
        placed = (
            PlacedTensor(stored, file.name, offset, *_write_bytes(file.part, memoryview(data), offset, throttle)),
            PlacedTensor(scales, file.name, offset + len(data), *_write_bytes(file.part, memoryview(scale_bytes), offset + len(data), throttle)),
        )
    progress.add(item.values.nbytes)
    return CodedWrite(t, placed, frames, True)


def _write_residual(
    part: PartWriter, item: FileItem, source: ArenaSource, progress: Progress, throttle: Throttle, scratch: ScratchPool
) -> list[tuple[int, str]]:
    """Write the bf16 residual of master weight `item` to its model weight (`item.twin`) at
    `item.offset`; returns [its xxh3-64 and chunk digests]."""
    from ckptd.common import quant

    assert item.twin is not None
    with scratch.take() as space:
        with source.values(item.values) as master, source.values(item.twin) as weights:
            residual = quant.residual_encode(master, weights, space)
            del master, weights  # no export of an arena view may outlive the block
        digest = _write_bytes(part, memoryview(flat_bytes(residual)), item.offset, throttle)
    progress.add(item.values.nbytes)
    return [digest]


def write_batches(fixed: Sequence[FileItem]) -> list[list[FileItem]]:
    """A file's tensors of known place (`fixed`, in file order) in writer jobs: each residual
    alone (it is coded first); the rest in runs of consecutive tensors (back to back in the
    file) of at most BATCH_BYTES, a tensor of BATCH_BYTES or more alone. Thousands of small tensors then cost tens of jobs,
    pwrites and writeback starts instead of one of each per tensor."""
    batches: list[list[FileItem]] = []
    open_batch: list[FileItem] = []
    nbytes = 0
    for item in fixed:
        if open_batch and (item.coding is not None or nbytes + item.tensor.nbytes > BATCH_BYTES):
            batches.append(open_batch)
            open_batch, nbytes = [], 0
        if item.coding is not None:
            batches.append([item])
            continue
        open_batch.append(item)
        nbytes += item.tensor.nbytes
    if open_batch:
        batches.append(open_batch)
    return batches


def _write_tensors(
    part: PartWriter, source: ArenaSource, tensors: Sequence[tuple[int, TensorBytes]], progress: Progress, throttle: Throttle
) -> list[tuple[int, str]]:
    """Write stored tensors as they are, each (file offset, its arena runs) from its offset on;
    return each one's xxh3-64 and chunk digests (ckptd.common.chunks), in order.

    Each tensor is hashed on its own bytes, HASH_SLICE at a time, and those slices are written
    as they are hashed (while they are in the CPU cache): slices that follow each other in the
    file (tensors back to back, wherever they are in the arenas) go to the file together, one
    pwritev per HASH_SLICE (_Extent)."""
    out = _Extent(part, progress, throttle)
    results = []
    try:
        for offset, values in tensors:
            digest = TensorDigests(sum(run.nbytes for run in values.runs))
            for run in values.runs:
                for begin in range(0, run.nbytes, HASH_SLICE):
                    view = source.view(run, begin, min(HASH_SLICE, run.nbytes - begin))
                    digest.update(view)
                    out.add(offset + run.dst + begin, view)
            results.append(digest.result())
        out.finish()
    finally:
        out.release()
    return results


class _Extent:
    """Slices written to one part in file order: gathered while they follow each other in the
    file, then written with one pwritev once they reach HASH_SLICE bytes (or IOV_SLICES
    slices); the writeback of what was written (PartWriter.start_writeback) started once per
    WRITEBACK_BYTES and at the end, so that the disk writes while the rest of the step is
    copied and coded, and the final fsync waits only for the tail. Every byte written has its
    writeback started exactly once. One thread's; the views it holds are released once written."""

    def __init__(self, part: PartWriter, progress: Progress, throttle: Throttle) -> None:
        self.part = part
        self.progress = progress
        self.throttle = throttle
        self._views: list[memoryview] = []
        self._begin = 0  # file offset of the gathered views
        self._nbytes = 0
        self._written_from = 0  # the written range whose writeback is not started yet
        self._written = 0

    def add(self, offset: int, view: memoryview) -> None:
        """Write `view` at byte `offset` (now or with the next views); the caller gives up `view`."""
        if self._views and offset != self._begin + self._nbytes:
            self._write()
        if not self._views:
            self._begin = offset
        self._views.append(view)
        self._nbytes += len(view)
        if self._nbytes >= HASH_SLICE or len(self._views) >= IOV_SLICES:
            self._write()

    def finish(self) -> None:
        """Write what is gathered and start the writeback of what is not started yet."""
        self._write()
        self._start_writeback()

    def release(self) -> None:
        """Release the views not written (after an error)."""
        for view in self._views:
            view.release()
        self._views, self._nbytes = [], 0

    def _write(self) -> None:
        if not self._views:
            return
        begin, nbytes = self._begin, self._nbytes
        self.throttle.wait(nbytes)
        if len(self._views) == 1:
            self.part.pwrite(begin, self._views[0])
        else:
            self.part.pwritev(begin, self._views)
        self.release()
        self.progress.add(nbytes)
        if self._written and self._written_from + self._written != begin:
            self._start_writeback()
        if not self._written:
            self._written_from = begin
        self._written += nbytes
        if self._written >= WRITEBACK_BYTES:
            self._start_writeback()

    def _start_writeback(self) -> None:
        if self._written:
            self.part.start_writeback(self._written_from, self._written)
            self._written = 0


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
