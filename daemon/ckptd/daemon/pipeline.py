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

import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import xxhash

from ckptd.common import dtypes
from ckptd.common.boxes import Box, contiguous_runs, coverage_problems
from ckptd.common.chunks import ChunkHasher, chunk_bytes_for
from ckptd.daemon.arena import ArenaSet
from ckptd.daemon.format import (
    EXTRA_JSON,
    GROUP_OF_KIND,
    INDEX_NAME,
    CheckpointIndex,
    FileRecord,
    FragmentRecord,
    StoredTensor,
    TensorRecord,
    extra_json,
    file_key,
    fragment_key,
    hf_index_json,
    layout_files,
    safetensors_header,
)
from ckptd.daemon.plan import FragmentSlot, LogicalTensor, SavePlan, StoredPart
from ckptd.daemon.storage import Storage, fsync_dir, tmp_name, write_small_file

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


class IncompleteStep(ValueError):
    """The nodes' manifests do not cover every tensor exactly once; the message names them."""


def persist(storage: Storage, req: PersistRequest, progress: Progress, clock: Callable[[], float] = time.time) -> CheckpointIndex:
    """One node: write the snapshot in `req.arenas` as committed step `req.step`; returns its index.

    Raises OSError (disk full, I/O error) with the step directory removed again.
    """
    try:
        manifest = write_node_files(storage, req, progress)
        index, files = step_files(req.job, req.step, req.plan, [manifest], req.extras, req.model_files, req.metric, clock)
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
    """
    plan = req.plan
    step_dir = storage.prepare_step_dir(req.job, req.step, fresh=not req.shared_dir)
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
    # Largest files first: they take the largest recycled files.
    layouts = [f for f in layout_files(stored, kinds, req.max_file_bytes) if f.node == req.node]
    layouts.sort(key=lambda f: -f.nbytes)

    placed: list[tuple[StoredTensor, str, int, Future[int]]] = []  # (tensor, file, offset, digest)
    files: list[FileRecord] = []
    throttle = Throttle(req.throttle_bytes_per_s)
    with ThreadPoolExecutor(max(1, req.write_threads), thread_name_prefix="ckptd-write") as pool:
        opened = []
        try:
            recycled = storage.take_recycled(req.job)
            for layout in layouts:
                header, entries = safetensors_header((t.key, t.dtype, t.shape) for t in layout.tensors)
                path = step_dir / layout.name
                fd = _open_for_writing(tmp_name(path), recycled.pop(0)[0] if recycled else None, len(header) + layout.nbytes)
                opened.append((fd, path))
                _pwrite_all(fd, memoryview(header), 0)
                files.append(FileRecord(layout.name, len(header) + layout.nbytes, checksum_name(xxhash.xxh3_64_intdigest(header)), req.node))
                for tensor, entry in zip(layout.tensors, entries):
                    offset = len(header) + entry.begin
                    itemsize = dtypes.itemsize(tensor.dtype)
                    if tensor.box == Box.full(tensors[tensor.name].shape):
                        pieces = _pieces(tensor.shape, itemsize, slots_by_name[tensor.name], offset)
                    else:  # a fragment stored on its own: one run from its slot
                        slot = slot_of[(tensor.name, tensor.box)]
                        pieces = [_Piece(slot.rank, slot.offset, offset, slot.nbytes)]
                    digest = pool.submit(_write_tensor, fd, req.arenas, pieces, progress, throttle)
                    placed.append((tensor, layout.name, offset, digest))
            for _, _, _, digest in placed:
                digest.result()
            for fsync_job in [pool.submit(os.fsync, fd) for fd, _ in opened]:
                fsync_job.result()
        finally:
            for fd, _ in opened:
                os.close(fd)
    for _, path in opened:
        os.replace(tmp_name(path), path)
    fsync_dir(step_dir)
    fragments = tuple(
        (t.name, FragmentRecord(file, t.key, t.box, t.dtype, offset, t.nbytes, checksum_name(digest.result()[0]), chunk_bytes_for(t.nbytes), digest.result()[1]))
        for t, file, offset, digest in placed
    )
    return NodeManifest(req.node, tuple(files), fragments)


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
        if in_group and not (group == "model" and split):  # fragments: `ckptd export` makes the HF form
            weight_map = {f.key: f.file for _, f in in_group}
            small[f"{group}.safetensors.index.json"] = hf_index_json(sum(f.nbytes for _, f in in_group), weight_map)
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
    )
    small[INDEX_NAME] = index.to_json_bytes()
    return index, small


def write_step_files(storage: Storage, job: str, step: int, files: dict[str, bytes]) -> None:
    """Write a step's small files (each fsynced), fsync the directory, then the index: the commit.

    `files` comes from step_files(); its ckptd.index.json is written last, atomically."""
    step_dir = storage.step_dir(job, step)
    step_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if name != INDEX_NAME:
            _write_synced(step_dir / name, data)
    fsync_dir(step_dir)
    write_small_file(step_dir / INDEX_NAME, files[INDEX_NAME])


def _open_for_writing(path: Path, recycled: Path | None, size: int) -> int:
    """A new file at `path` of `size` bytes, made from a recycled file when there is one: its
    blocks are overwritten in place (no new allocation), and any excess is cut off."""
    if recycled is not None:
        try:
            os.replace(recycled, path)
        except FileNotFoundError:  # another node sharing the root took it first
            recycled = None
    if recycled is None:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    fd = os.open(path, os.O_WRONLY)
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)
    return fd


def _write_synced(path: Path, data: bytes) -> None:
    """Write a small file of the (not yet committed) step directory and fsync it."""
    with open(path, "wb") as f:
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
                hasher.update(view)
                chunks.update(view)
                _pwrite_all(fd, view, piece.dst + done)
            finally:
                view.release()
            done += n
            progress.add(n)
    return hasher.intdigest(), chunks.hexdigests()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
