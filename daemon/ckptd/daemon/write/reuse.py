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

from ckptd.common.chunks import HASH_SLICE, ChunkHasher, checksum_name
from ckptd.format.index import FileRecord, FormatError, FragmentRecord
from ckptd.format.units import Unit, checksum_digest, first_mismatch, read_ranges
from ckptd.daemon.plan.files import PlacedTensor
from ckptd.daemon.plan.node_files import ArenaRun, FileItem, LinkCandidate
from ckptd.daemon.storage.base import ReadHandle, StorageBackend
from ckptd.daemon.write.digests import TensorDigests
from ckptd.daemon.write.source import ArenaSource

CHECK_RANGE_BYTES = 64 << 20  # bytes of a linked file one task reads back and checks (consecutive units)


@dataclass(frozen=True)
class Reuse:
    """A link candidate whose tensors all still have the previous step's bytes, with their places."""

    candidate: LinkCandidate
    placed: tuple[PlacedTensor, ...]

    @property
    def name(self) -> str:
        """The file's name in the new step."""
        return self.candidate.file.name

    @property
    def previous(self) -> FileRecord:
        """The previous step's file it is linked from."""
        return self.candidate.previous

    @property
    def record(self) -> FileRecord:
        """The new step's record of it (its own name, this node)."""
        record = self.candidate.file.record
        assert record is not None, "a link candidate has a known header"
        return record


def unchanged_files(candidates: Sequence[LinkCandidate], source: ArenaSource, threads: int) -> dict[str, Reuse]:
    """The files of `candidates` (plan/node_files.link_candidates) whose every tensor's bytes in
    the arenas are still those of its previous fragment, by name. The tensors are hashed by
    `threads` threads, one tensor per task."""
    if not candidates:
        return {}

    def same(task: tuple[FileItem, FragmentRecord]) -> PlacedTensor | None:
        """The tensor's place in the new file when its bytes are the previous fragment's: one
        pass of chunk digests (equal chunks, equal bytes: the whole digest is the previous one),
        or the whole digest where the previous step recorded no chunks."""
        item, before = task
        runs = item.values.runs
        if before.chunk_xxh3:
            if chunk_digests(source, runs, before.chunk_bytes) != before.chunk_xxh3:
                return None
            try:
                digest = checksum_digest(before.checksum, f"{before.file} {before.key}")
            except FormatError:  # a damaged previous index: the file is written
                return None
            return PlacedTensor(item.tensor, "", item.offset, digest, before.chunk_xxh3)
        digest, chunks = digests(source, runs)
        return PlacedTensor(item.tensor, "", item.offset, digest, chunks) if checksum_name(digest) == before.checksum else None

    tasks = [(i, (item, before)) for i, c in enumerate(candidates) for item, before in zip(c.file.fixed, c.expected)]
    # one task per tensor, so a file of many large tensors is hashed by every thread
    with ThreadPoolExecutor(max(1, min(threads, len(tasks) or 1)), thread_name_prefix="ckptd-reuse") as pool:
        results = list(pool.map(same, [task for _, task in tasks]))
    placed: dict[int, list[PlacedTensor | None]] = {}
    for (i, _), result in zip(tasks, results):
        placed.setdefault(i, []).append(result)
    found = {}
    for i, places in placed.items():
        candidate = candidates[i]
        if all(p is not None for p in places):
            name = candidate.file.name
            found[name] = Reuse(candidate, tuple(replace(p, file=name) for p in places if p is not None))
    return found


def check_linked(
    storage: StorageBackend, job: str, step: int, linked: Sequence[Reuse], units: Mapping[str, tuple[Unit, ...]], threads: int
) -> dict[str, str]:
    """Read the files of `linked` back as they are linked into step `step` of `job` and check
    every byte against the previous step's index (`units`: units.file_units of it, by the
    previous file's name; it has every data file of that step), with `check_files`. Returns
    {the new step's file name: what is wrong} for each file that does not match, or cannot be
    read."""
    return check_files(storage.files.step_reader(job, step).open, {r.name: units[r.previous.name] for r in linked}, threads)


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


def digests(source: ArenaSource, runs: Sequence[ArenaRun]) -> tuple[int, str]:
    """The xxh3-64 of a stored tensor's bytes (its arena runs in order) and the digests of its
    chunks, as the writer computes them while writing (writer._write_tensors)."""
    digest = TensorDigests(sum(r.nbytes for r in runs))
    for view in _views(source, runs):
        digest.update(view)
    return digest.result()


def chunk_digests(source: ArenaSource, runs: Sequence[ArenaRun], chunk_bytes: int) -> str:
    """The digests of a stored tensor's chunks of `chunk_bytes` (ckptd.common.chunks), one pass."""
    chunks = ChunkHasher(chunk_bytes)
    for view in _views(source, runs):
        chunks.update(view)
    return chunks.hexdigests()


def _views(source: ArenaSource, runs: Sequence[ArenaRun]) -> Iterator[memoryview]:
    """The tensor's bytes in order, HASH_SLICE at a time, as views of the arenas (each released
    once the caller moves on)."""
    for run in runs:
        for begin in range(0, run.nbytes, HASH_SLICE):
            view = source.view(run, begin, min(HASH_SLICE, run.nbytes - begin))
            try:
                yield view
            finally:
                view.release()
