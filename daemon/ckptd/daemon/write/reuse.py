"""Incremental saves: which data files of a step are byte for byte a file of the job's previous
committed step, so the writer links that file instead of writing it again.

Only files of frozen tensors qualify (TensorSpec.frozen: parameters with requires_grad=False,
buffers; format.layout_files gives them files of their own). Nothing is assumed from the flag:
a file is reused only when its header is the previous file's (same size and header checksum:
the same keys, dtypes, shapes and offsets) and every tensor's bytes, hashed now from the arenas,
have the previous fragment's xxh3-64 and chunk digests. A frozen tensor that changed anyway (a
buffer updated in place, weights loaded again) makes its file be written as usual.

The index says what the previous file held when it was written, not what is on disk now: a
file damaged since (a flipped byte, a stray edit, a same-size replacement) would be linked into
every later step. So each linked file is read back as linked and checked unit by unit against
the previous index (`check_linked`: a read instead of a write) before the step is reported
written; one that does not match is written again from the snapshot (write/writer.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

import xxhash

from ckptd.common.chunks import HASH_SLICE, ChunkHasher, checksum_name, chunk_bytes_for
from ckptd.format.index import CheckpointIndex, FileLayout, FileRecord, FormatError, FragmentRecord, StoredTensor, safetensors_header
from ckptd.format.units import Unit, checksum_digest, first_mismatch, read_ranges
from ckptd.daemon.handoff.arena import ArenaSet
from ckptd.daemon.plan.files import Placed
from ckptd.daemon.plan.save_plan import LogicalTensor
from ckptd.daemon.storage.base import ReadHandle, StorageBackend
from ckptd.daemon.write.source import Piece, Source

CHECK_RANGE_BYTES = 64 << 20  # bytes of a linked file one task reads back and checks (consecutive units)


@dataclass(frozen=True)
class Reuse:
    """A file of the new step that is `source` of the previous step, with its tensors' places."""

    layout: FileLayout
    source: FileRecord
    record: FileRecord  # the new step's record of it (its own name, this node)
    placed: tuple[Placed, ...]


def reusable_files(
    layouts: Sequence[FileLayout], frozen: Mapping[str, str], previous: CheckpointIndex, source: Source,
    node: int, shared_dir: bool, threads: int,
) -> dict[str, Reuse]:
    """The files of `layouts` (this node's, no coded tensors among frozen ones) that equal a data
    file of `previous`, by name. A previous file qualifies when this node wrote it, or any node
    did in a shared root (where every node's files are in the one step directory). The tensors of
    candidate files are hashed by `threads` threads, one tensor per task."""
    by_content: dict[tuple[int, str], FileRecord] = {}
    for f in previous.files:
        if f.name.endswith(".safetensors") and (shared_dir or f.node == node):
            by_content.setdefault((f.size, f.checksum), f)
    fragments = {(frag.file, frag.key): frag for t in previous.tensors for frag in t.fragments}
    candidates = []
    for layout in layouts:
        if not layout.tensors or not all(frozen.get(t.name) for t in layout.tensors):
            continue
        header, entries = safetensors_header((t.key, t.dtype, t.shape) for t in layout.tensors)
        size, checksum = len(header) + layout.nbytes, checksum_name(xxhash.xxh3_64_intdigest(header))
        match = by_content.get((size, checksum))
        if match is not None:
            offsets = tuple(len(header) + e.begin for e in entries)
            candidates.append((layout, match, FileRecord(layout.name, size, checksum, node), offsets))
    if not candidates:
        return {}

    def same(task: tuple[StoredTensor, int, FragmentRecord]) -> Placed | None:
        """The tensor's place in the new file when its bytes are the previous fragment's: one
        pass of chunk digests (equal chunks, equal bytes: the whole digest is the previous one),
        or the whole digest where the previous step recorded no chunks."""
        t, offset, before = task
        pieces = source.pieces(t, offset)
        if before.chunk_xxh3:
            if chunk_digests(source.arenas, pieces, before.chunk_bytes) != before.chunk_xxh3:
                return None
            try:
                digest = checksum_digest(before.checksum, f"{before.file} {before.key}")
            except FormatError:  # a damaged previous index: the file is written
                return None
            return Placed(t, "", offset, digest, before.chunk_xxh3)
        digest, chunks = digests(source.arenas, pieces)
        return Placed(t, "", offset, digest, chunks) if checksum_name(digest) == before.checksum else None

    tasks: list[tuple[int, tuple[StoredTensor, int, FragmentRecord]]] = []
    for i, (layout, match, _, offsets) in enumerate(candidates):
        befores = [fragments.get((match.name, t.key)) for t in layout.tensors]
        if all(b is not None and b.quant is None and (b.offset, b.nbytes, b.box, b.dtype) == (o, t.nbytes, t.box, t.dtype) for t, o, b in zip(layout.tensors, offsets, befores)):
            tasks += [(i, (t, o, b)) for t, o, b in zip(layout.tensors, offsets, befores) if b is not None]
    # one task per tensor, so a file of many large tensors is hashed by every thread
    with ThreadPoolExecutor(max(1, min(threads, len(tasks) or 1)), thread_name_prefix="ckptd-reuse") as pool:
        results = list(pool.map(same, [task for _, task in tasks]))
    placed: dict[int, list[Placed | None]] = {}
    for (i, _), result in zip(tasks, results):
        placed.setdefault(i, []).append(result)
    found = {}
    for i, places in placed.items():
        layout, match, record, _ = candidates[i]
        if all(p is not None for p in places):
            found[layout.name] = Reuse(layout, match, record, tuple(replace(p, file=layout.name) for p in places if p is not None))
    return found


def check_linked(
    storage: StorageBackend, job: str, step: int, linked: Sequence[Reuse], units: Mapping[str, tuple[Unit, ...]], threads: int
) -> dict[str, str]:
    """Read the files of `linked` back as they are linked into step `step` of `job` and check
    every byte against the previous step's index (`units`: units.file_units of it, by the
    previous file's name; it has every data file of that step), with `check_files`. Returns
    {the new step's file name: what is wrong} for each file that does not match, or cannot be
    read."""
    return check_files(storage.files.step_reader(job, step).open, {r.layout.name: units[r.source.name] for r in linked}, threads)


def check_files(open_file: Callable[[str], ReadHandle], files: Mapping[str, Sequence[Unit]], threads: int) -> dict[str, str]:
    """Read each file of `files` (name -> the units that tile it) through `open_file` and check
    every byte (units.first_mismatch), ranges of CHECK_RANGE_BYTES (consecutive units) read by
    `threads` threads, each opening the file. Returns {name: what is wrong} for each file that
    does not match, or cannot be read."""
    tasks = [(name, group) for name, known in files.items() for _, _, group in read_ranges(known, CHECK_RANGE_BYTES)]

    def check(task: tuple[str, tuple[Unit, ...]]) -> str | None:
        name, group = task
        try:
            with open_file(name) as handle:
                return first_mismatch(handle.pread, group)
        except OSError as exc:
            return f"it cannot be read back: {exc}"

    problems: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, min(threads, len(tasks) or 1)), thread_name_prefix="ckptd-reuse-check") as pool:
        for (name, _), problem in zip(tasks, pool.map(check, tasks)):
            if problem is not None:
                problems.setdefault(name, problem)
    return problems


def digests(arenas: ArenaSet, pieces: Sequence[Piece]) -> tuple[int, str]:
    """The xxh3-64 of a stored tensor's bytes (its arena runs in file order) and the digests of
    its chunks, as the writer computes them while writing (writer._write_tensor)."""
    hasher = xxhash.xxh3_64()
    chunks = ChunkHasher(chunk_bytes_for(sum(p.nbytes for p in pieces)))
    for view in _views(arenas, pieces):
        hasher.update(view)
        chunks.update(view)
    return hasher.intdigest(), chunks.hexdigests()


def chunk_digests(arenas: ArenaSet, pieces: Sequence[Piece], chunk_bytes: int) -> str:
    """The digests of a stored tensor's chunks of `chunk_bytes` (ckptd.common.chunks), one pass."""
    chunks = ChunkHasher(chunk_bytes)
    for view in _views(arenas, pieces):
        chunks.update(view)
    return chunks.hexdigests()


def _views(arenas: ArenaSet, pieces: Sequence[Piece]) -> Iterator[memoryview]:
    """The tensor's bytes in file order, HASH_SLICE at a time, as views of the arenas (each
    released once the caller moves on)."""
    for piece in pieces:
        arena = arenas.arenas[piece.rank]
        assert arena is not None, "plan gave a fragment to a rank without an arena"
        for begin in range(0, piece.nbytes, HASH_SLICE):
            view = arena.view(piece.src + begin, min(HASH_SLICE, piece.nbytes - begin))
            try:
                yield view
            finally:
                view.release()


def frozen_names(tensors: Sequence[LogicalTensor]) -> dict[str, str]:
    """{logical name: frozen class} of a plan's tensors that the trainer does not train. Buffers
    count only beside frozen parameters: a model that trains all its parameters keeps the file
    layout it always had (its buffers are small, and often change: running statistics)."""
    frozen = {t.name: t.frozen for t in tensors if t.frozen}
    return frozen if "param" in frozen.values() else {}
