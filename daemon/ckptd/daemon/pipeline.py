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
from typing import Any, Callable

import xxhash

from ckptd.common import dtypes
from ckptd.common.boxes import Box, contiguous_runs
from ckptd.daemon.arena import ArenaSet
from ckptd.daemon.format import (
    EXTRA_JSON,
    INDEX_NAME,
    CheckpointIndex,
    FileLayout,
    FileRecord,
    FragmentRecord,
    StoredTensor,
    TensorRecord,
    extra_json,
    file_key,
    hf_index_json,
    layout_files,
    safetensors_header,
)
from ckptd.daemon.plan import FragmentSlot, LogicalTensor, SavePlan
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


class Throttle:
    """Limits the write rate shared by all writer threads (simulates a slow disk)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
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


def persist(storage: Storage, req: PersistRequest, progress: Progress, clock: Callable[[], float] = time.time) -> CheckpointIndex:
    """Write the snapshot in `req.arenas` as committed step `req.step`; returns its index.

    Raises OSError (disk full, I/O error) with the step directory removed again.
    """
    step_dir = storage.prepare_step_dir(req.job, req.step)
    try:
        return _persist(storage, step_dir, req, progress, clock)
    except BaseException:
        storage.remove_step(req.job, req.step)
        raise


def _persist(storage: Storage, step_dir: Path, req: PersistRequest, progress: Progress, clock: Callable[[], float]) -> CheckpointIndex:
    plan = req.plan
    slots_by_name: dict[str, list[FragmentSlot]] = {}
    for slot in plan.slots:
        slots_by_name.setdefault(slot.name, []).append(slot)
    kinds = {t.name: t.kind for t in plan.tensors}
    stored = [
        StoredTensor(t.name, file_key(t.name, t.kind), t.dtype, t.shape, Box.full(t.shape)) for t in plan.tensors
    ]
    # Largest files first: they take the largest recycled files.
    layouts = sorted(layout_files(stored, kinds, req.max_file_bytes), key=lambda f: -f.nbytes)

    placed: dict[str, tuple[str, str, int]] = {}  # tensor name -> (file, key, offset)
    digests: dict[str, Future[int]] = {}
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
                files.append(FileRecord(layout.name, len(header) + layout.nbytes, checksum_name(xxhash.xxh3_64_intdigest(header))))
                for tensor, entry in zip(layout.tensors, entries):
                    offset = len(header) + entry.begin
                    pieces = _pieces(tensor.shape, dtypes.itemsize(tensor.dtype), slots_by_name[tensor.name], offset)
                    digests[tensor.name] = pool.submit(_write_tensor, fd, req.arenas, pieces, progress, throttle)
                    placed[tensor.name] = (layout.name, tensor.key, offset)
            for job in digests.values():
                job.result()
            for fsync_job in [pool.submit(os.fsync, fd) for fd, _ in opened]:
                fsync_job.result()
        finally:
            for fd, _ in opened:
                os.close(fd)
    for _, path in opened:
        os.replace(tmp_name(path), path)

    small: dict[str, bytes] = {}
    for group in ("model", "master_weights", "optimizer"):
        group_files = [layout for layout in layouts if layout.group == group]
        if group_files:
            weight_map = {t.key: layout.name for layout in group_files for t in layout.tensors}
            total = sum(layout.nbytes for layout in group_files)
            small[f"{group}.safetensors.index.json"] = hf_index_json(total, weight_map)
    small[EXTRA_JSON] = extra_json(req.step, req.extras)
    small.update(req.model_files)
    for name, data in small.items():
        _write_synced(step_dir / name, data)
        files.append(FileRecord(name, len(data), checksum_name(xxhash.xxh3_64_intdigest(data))))
    fsync_dir(step_dir)

    def record(t: LogicalTensor) -> TensorRecord:
        file, key, offset = placed[t.name]
        fragment = FragmentRecord(file, key, Box.full(t.shape), t.dtype, offset, t.nbytes, checksum_name(digests[t.name].result()))
        return TensorRecord(t.name, t.kind, t.dtype, t.shape, (fragment,), t.aliases)

    index = CheckpointIndex(
        job=req.job,
        step=req.step,
        created_at=clock(),
        world_size=plan.world_size,
        tensors=tuple(record(t) for t in plan.tensors),
        files=tuple(files),
        metric=req.metric,
        writer={"host": socket.gethostname(), "ckptd": VERSION},
    )
    write_small_file(step_dir / INDEX_NAME, index.to_json_bytes())
    storage.write_latest(req.job, req.step)
    return index


def _open_for_writing(path: Path, recycled: Path | None, size: int) -> int:
    """A new file at `path` of `size` bytes, made from a recycled file when there is one: its
    blocks are overwritten in place (no new allocation), and any excess is cut off."""
    if recycled is None:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    os.replace(recycled, path)
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


def _write_tensor(fd: int, arenas: ArenaSet, pieces: list[_Piece], progress: Progress, throttle: Throttle) -> int:
    """Write one tensor's runs (in file order) and return the xxh3-64 of its bytes."""
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        arena = arenas.arenas[piece.rank]
        assert arena is not None, "plan gave a fragment to a rank without an arena"
        done = 0
        while done < piece.nbytes:
            n = min(WRITE_CHUNK, piece.nbytes - done)
            throttle.wait(n)
            view = arena.view(piece.src + done, n)
            try:
                hasher.update(view)
                _pwrite_all(fd, view, piece.dst + done)
            finally:
                view.release()
            done += n
            progress.add(n)
    return hasher.intdigest()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
