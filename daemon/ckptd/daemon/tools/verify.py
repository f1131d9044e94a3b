"""`ckptd verify STEP_DIR`: check a committed step against its index, reading every byte.

Checks, each reported as a `Problem` naming the file and tensor:
- the index exists and parses (its presence is what makes a step committed);
- every file the index lists is there with its recorded size; the small JSON files match their
  xxh3 checksum; each safetensors file's header matches its checksum, parses, and holds each
  stored tensor under its key at the recorded offset;
- every stored tensor or fragment matches its xxh3-64 checksum, and its chunks their checksums;
- coverage: the fragments of each logical tensor cover its global shape exactly once.

Reads only, through a StepReader of the storage backend (storage/base.py); never changes the
step. On POSIX no file is read through a symbolic link or waited on as a FIFO: a link, FIFO or
directory where the index puts a file is a problem of kind "foreign" naming it. Files another node wrote into a node-local root
can be left out with `node` (check them on that node).
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath
from dataclasses import dataclass, field
from typing import Callable

import xxhash

from ckptd.common.boxes import coverage_problems
from ckptd.common.chunks import HASH_SLICE, ChunkHasher, checksum_name
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FormatError, parse_step_dir_name
from ckptd.format.safetensors_header import HeaderEntry, parse_safetensors_header, read_header
from ckptd.daemon.storage import TMP_MARK, ForeignEntry, ReadHandle, StepReader
from ckptd.daemon.tools.locate import open_step_reader


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a step. kind: index | missing | foreign | size | checksum | header | coverage."""

    kind: str
    file: str  # the file concerned, relative to the step directory ("" for coverage)
    message: str  # says what is wrong and what it affects


@dataclass(frozen=True)
class VerifyReport:
    step_dir: str
    job: str = ""
    step: int = -1
    files_checked: int = 0
    files_skipped: int = 0  # written by other nodes (node-local roots), left out on request
    bytes_checked: int = 0
    tensors: int = 0
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = field(default=())  # harmless findings, e.g. files the index does not list

    @property
    def ok(self) -> bool:
        return not self.problems


def _hash_range(f: ReadHandle, offset: int, nbytes: int, on_bytes: Callable[[int], None], chunk_bytes: int = 0) -> tuple[str, int, str]:
    """The xxh3-64 checksum name of bytes [offset, offset + nbytes), how many could be read, and
    the digests of their chunks of `chunk_bytes` (ckptd.common.chunks; "" when 0)."""
    hasher = xxhash.xxh3_64()
    chunks = ChunkHasher(chunk_bytes) if chunk_bytes else None
    done = 0
    while done < nbytes:
        data = f.pread(min(HASH_SLICE, nbytes - done), offset + done)
        if not data:
            break
        hasher.update(data)
        if chunks is not None:
            chunks.update(data)
        done += len(data)
        on_bytes(len(data))
    return checksum_name(hasher.intdigest()), done, chunks.hexdigests() if chunks is not None else ""


def verify_step(location: str | os.PathLike[str], node: int | None = None, on_bytes: Callable[[int], None] = lambda n: None) -> VerifyReport:
    """Verify the committed step at `location` (a step directory, or s3://BUCKET/PREFIX/JOB/step-N;
    BucketStepError when that cannot be opened); see the module docstring.

    node: check only the data files written by this node (and the small files every node has);
        None checks every file. on_bytes: called with each chunk's size as data is read (progress).
    """
    return verify_files(open_step_reader(location), node, on_bytes)


def verify_files(files: StepReader, node: int | None = None, on_bytes: Callable[[int], None] = lambda n: None) -> VerifyReport:
    """Verify the committed step that `files` reads (any backend: StorageBackend.step_reader);
    as verify_step."""
    problems: list[Problem] = []
    step_dir = files.where
    index_path = f"{step_dir}/{INDEX_NAME}"
    try:
        index = CheckpointIndex.from_json_bytes(files.read_small(INDEX_NAME), where=index_path)
    except FileNotFoundError:
        return VerifyReport(str(step_dir), problems=(Problem("index", INDEX_NAME, f"{step_dir} is not a committed checkpoint: it has no {INDEX_NAME} (an interrupted save; `ckptd gc` removes it)"),))
    except (OSError, FormatError) as exc:
        return VerifyReport(str(step_dir), problems=(Problem("index", INDEX_NAME, f"the index cannot be read: {exc}"),))

    named = parse_step_dir_name(PurePosixPath(str(step_dir)).name)
    if named is not None and named != index.step:
        problems.append(Problem("index", INDEX_NAME, f"{step_dir} holds the index of step {index.step} (a step directory copied or renamed by hand?)"))
    tensors_in: dict[str, list[str]] = {}
    for t in index.tensors:
        for frag in t.fragments:
            tensors_in.setdefault(frag.file, []).append(t.name)

    def affected(file: str) -> str:
        names = sorted(set(tensors_in.get(file, [])))
        if not names:
            return ""
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"; tensors affected: {shown}"

    headers: dict[str, tuple[int, dict[str, HeaderEntry]]] = {}  # file -> (data offset, entries)
    readable: set[str] = set()
    skipped = checked = nbytes = 0
    for record in index.files:
        is_data = record.name.endswith(".safetensors")
        if node is not None and is_data and record.node != node:
            skipped += 1
            continue
        try:
            handle = files.open(record.name)
        except FileNotFoundError:
            where = f" (written by node {record.node}; with node-local roots verify it there, or pass --node)" if record.node else ""
            problems.append(Problem("missing", record.name, f"{record.name} is missing{where}{affected(record.name)}"))
            continue
        except ForeignEntry as exc:
            problems.append(Problem("foreign", record.name, f"{exc}{affected(record.name)}"))
            continue
        except OSError as exc:
            problems.append(Problem("missing", record.name, f"{record.name} cannot be read: {exc.strerror or exc}{affected(record.name)}"))
            continue
        checked += 1
        size = handle.size
        if size != record.size:
            handle.close()
            problems.append(Problem("size", record.name, f"{record.name} has {size} bytes, the index says {record.size} (truncated or replaced){affected(record.name)}"))
            continue
        with handle as f:
            if not is_data:
                digest, _, _ = _hash_range(f, 0, size, on_bytes)
                nbytes += size
                if digest != record.checksum:
                    problems.append(Problem("checksum", record.name, f"{record.name} does not match its checksum ({digest}, the index says {record.checksum})"))
                continue
            header = read_header(f.pread, size)
            if header is None:
                problems.append(Problem("header", record.name, f"{record.name} has no valid safetensors header{affected(record.name)}"))
                continue
            nbytes += len(header)
            digest = checksum_name(xxhash.xxh3_64_intdigest(header))
            if digest != record.checksum:
                problems.append(Problem("checksum", record.name, f"the safetensors header of {record.name} does not match its checksum{affected(record.name)}"))
                continue
            try:
                headers[record.name] = parse_safetensors_header(header, size)
            except FormatError as exc:
                problems.append(Problem("header", record.name, f"{record.name}: {exc}{affected(record.name)}"))
                continue
            readable.add(record.name)

    listed = {f.name for f in index.files} | {INDEX_NAME}
    notes = []
    for name in files.names():
        if name not in listed:
            kind = "a temporary file of an interrupted write (`ckptd gc` removes it)" if name.startswith(TMP_MARK) else "not listed in the index (ignored by ckptd)"
            notes.append(f"{name}: {kind}")

    for t in index.tensors:
        for problem in coverage_problems(t.shape, [f.box for f in t.fragments]):
            problems.append(Problem("coverage", "", f"tensor {t.name} ({t.dtype}{list(t.shape)}): {problem}"))
        for piece in (piece for frag in t.fragments for piece in frag.stored_pieces()):  # "cast": checked as the model weight
            if piece.file not in readable:
                continue  # reported above (missing, damaged) or left out (another node's)
            data_offset, entries = headers[piece.file]
            entry = entries.get(piece.key)
            if entry is None or data_offset + entry.begin != piece.offset or entry.end - entry.begin != piece.nbytes:
                problems.append(Problem("header", piece.file, f"{piece.file} does not hold {piece.key!r} (tensor {t.name}) where the index says"))
                continue
            with files.open(piece.file) as f:
                digest, got, chunk_digests = _hash_range(f, piece.offset, piece.nbytes, on_bytes, piece.chunk_bytes)
            nbytes += got
            if digest != piece.checksum:
                problems.append(
                    Problem("checksum", piece.file, f"tensor {t.name} (key {piece.key!r}, {piece.nbytes} bytes at offset {piece.offset} of {piece.file}) does not match its checksum: the data is corrupt")
                )
            elif piece.chunk_bytes and chunk_digests != piece.chunk_xxh3:
                problems.append(
                    Problem("checksum", piece.file, f"tensor {t.name} (key {piece.key!r} in {piece.file}) matches its checksum but not its chunk checksums: the index is damaged, resharded loads of it will fail")
                )
    return VerifyReport(
        str(step_dir), index.job, index.step, checked, skipped, nbytes, len(index.tensors), tuple(problems), tuple(notes)
    )
