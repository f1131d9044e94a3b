"""Incremental saves: which data files of a step are byte for byte a file of the job's previous
committed step, so the writer links that file instead of writing it again.

Only files of frozen tensors qualify (TensorSpec.frozen: parameters with requires_grad=False,
buffers; format.layout_files gives them files of their own). Nothing is assumed from the flag:
a file is reused only when its header is the previous file's (same size and header checksum:
the same keys, dtypes, shapes and offsets) and every tensor's bytes, hashed now from the arenas,
have the previous fragment's xxh3-64 and chunk digests. A frozen tensor that changed anyway (a
buffer updated in place, weights loaded again) makes its file be written as usual.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

import xxhash

from ckptd.common.chunks import HASH_SLICE, ChunkHasher, chunk_bytes_for
from ckptd.daemon.arena import ArenaSet
from ckptd.daemon.format import CheckpointIndex, FileLayout, FileRecord, safetensors_header
from ckptd.daemon.plan import LogicalTensor
from ckptd.daemon.snapshot_source import Piece, Source
from ckptd.daemon.step_build import Placed, checksum_name


@dataclass(frozen=True)
class Reuse:
    """A file of the new step that is `source` of the previous step, with its tensors' places."""

    layout: FileLayout
    source: FileRecord
    record: FileRecord  # the new step's record of it (its own name, this node)
    placed: tuple[Placed, ...]

    @property
    def data_bytes(self) -> int:
        return self.layout.nbytes


def reusable_files(
    layouts: Sequence[FileLayout], frozen: Mapping[str, str], previous: CheckpointIndex, source: Source,
    node: int, shared_dir: bool, threads: int,
) -> dict[str, Reuse]:
    """The files of `layouts` (this node's, no coded tensors among frozen ones) that equal a data
    file of `previous`, by name. A previous file qualifies when this node wrote it, or any node
    did in a shared root (where every node's files are in the one step directory). Tensors are
    hashed in `threads` threads, one file per thread, each file stopping at its first change."""
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

    def check(candidate: tuple[FileLayout, FileRecord, FileRecord, tuple[int, ...]]) -> Reuse | None:
        layout, match, record, offsets = candidate
        placed = []
        for t, offset in zip(layout.tensors, offsets):
            before = fragments.get((match.name, t.key))
            if before is None or before.quant is not None or (before.offset, before.nbytes, before.box, before.dtype) != (offset, t.nbytes, t.box, t.dtype):
                return None
            digest, chunks = digests(source.arenas, source.pieces(t, offset))
            if checksum_name(digest) != before.checksum or (before.chunk_xxh3 and chunks != before.chunk_xxh3):
                return None
            placed.append(Placed(t, layout.name, offset, digest, chunks))
        return Reuse(layout, match, record, tuple(placed))

    with ThreadPoolExecutor(max(1, min(threads, len(candidates))), thread_name_prefix="ckptd-reuse") as pool:
        found = [r for r in pool.map(check, candidates) if r is not None]
    return {r.layout.name: r for r in found}


def digests(arenas: ArenaSet, pieces: Sequence[Piece]) -> tuple[int, str]:
    """The xxh3-64 of a stored tensor's bytes (its arena runs in file order) and the digests of
    its chunks, as the writer computes them while writing (writer._write_tensor)."""
    hasher = xxhash.xxh3_64()
    chunks = ChunkHasher(chunk_bytes_for(sum(p.nbytes for p in pieces)))
    for piece in pieces:
        arena = arenas.arenas[piece.rank]
        assert arena is not None, "plan gave a fragment to a rank without an arena"
        for begin in range(0, piece.nbytes, HASH_SLICE):
            view = arena.view(piece.src + begin, min(HASH_SLICE, piece.nbytes - begin))
            try:
                hasher.update(view)
                chunks.update(view)
            finally:
                view.release()
    return hasher.intdigest(), chunks.hexdigests()


def frozen_names(tensors: Sequence[LogicalTensor]) -> dict[str, str]:
    """{logical name: frozen class} of a plan's tensors that the trainer does not train. Buffers
    count only beside frozen parameters: a model that trains all its parameters keeps the file
    layout it always had (its buffers are small, and often change: running statistics)."""
    frozen = {t.name: t.frozen for t in tensors if t.frozen}
    return frozen if "param" in frozen.values() else {}
