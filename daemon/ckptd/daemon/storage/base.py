"""The storage seam: what the daemon needs of the place its checkpoints live.

A `StorageBackend` owns every byte of I/O on the storage root, through four roles, each the
slice one kind of consumer uses: `StepCatalog` (which jobs and steps there are: listing,
retention, admission), `StepFiles` (reading a step: loads, the peer Fetch, uploads, the
tools), `StepWriting` (writing a step: the writer, the restore from an object store) and
`StepJanitor` (removing: retention, aborts, prepared markers, gc, start-up recovery). Nothing
outside the storage package opens, writes, renames or deletes under the root
(tests/test_hygiene.py checks it, statically and at run time). The contract speaks in plain
values and the frozen records below (`RecycledFile`, `FreeSpace`, `Leftover`), never in a
backend's own types (a `Path`).

Implementations: `Storage` (posix.py: a directory tree on a POSIX file system) and, as a test
double only, tests/memory_backend.py (in memory, with the same rules). Steps are named by a
validated job id and an integer step; files of a step by a plain name (no '/'), so no request
can name anything outside the root.

A step becomes visible (committed) only when its index (format.INDEX_NAME) is published, last;
the order is stated and kept in one place, step_commit.StepCommit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from ckptd.format.index import CheckpointIndex


class PartWriter(Protocol):
    """A data file of a step being written (a safetensors file), invisible until `publish`.

    Opened with its size (`open_part`): the final size of a file of tensors of known size; for
    a file with coded tensors (sizes known once coded) the size reserved, and the final size is
    given to `sync`. Written at any offsets, from several threads at once (`pwrite` of disjoint
    ranges); every byte up to the final size must be written before it is published. The writer writes each file's safetensors
    header LAST, into room reserved at offset 0, once the sizes of coded tensors are known: a
    local file is written in place; an object store can do the same by uploading the header
    as part 1 of a multipart upload after the data parts (a single streaming PUT cannot).
    """

    name: str

    def pwrite(self, offset: int, view: memoryview) -> None:
        """Write all of `view` at byte `offset`."""

    def pwritev(self, offset: int, views: Sequence[memoryview]) -> None:
        """Write all of `views`, back to back, from byte `offset` (one call for many small tensors)."""

    def start_writeback(self, offset: int, nbytes: int) -> bool:
        """A hint: start making [offset, offset + nbytes) durable now (sync_step/sync still
        decide durability). Returns whether the hint was taken."""

    def sync(self, size: int | None = None) -> None:
        """Every write done: cut the file to `size` bytes when given (coded tensors took less
        than reserved), then make its bytes durable. Still not visible."""

    def close(self) -> None:
        """Release what the part holds (idempotent). A part closed without `publish` is never
        visible; remove_step/discard_part take away what is left of it."""

    def publish(self) -> None:
        """Make the synced, closed part visible under its final name (a rename or the multipart
        completion). Durable once `StepWriting.sync_step` returns."""


class ReadHandle(Protocol):
    """One file of a step open for reading."""

    size: int  # bytes of the file when it was opened

    def pread(self, nbytes: int, offset: int) -> bytes:
        """Up to `nbytes` bytes at `offset` (fewer only at the end of the file)."""

    def close(self) -> None: ...

    def __enter__(self) -> "ReadHandle": ...

    def __exit__(self, *exc: object) -> None: ...


class StepReader(Protocol):
    """Read-only view of one step's files, for the operator tools (verify, export, inspect).

    Every method raises FileNotFoundError for a missing file, ForeignEntry for something the
    daemon did not write there (a link, a FIFO: never followed), OSError otherwise."""

    where: str  # the step as shown to people (a path or a URL)

    def names(self) -> list[str]:
        """Every entry in the step, temporaries included, sorted."""

    def exists(self, name: str) -> bool: ...

    def read_small(self, name: str, limit: int = 1 << 30) -> bytes:
        """The whole file; OSError EFBIG when it is larger than `limit`."""

    def open(self, name: str) -> ReadHandle: ...


@dataclass(frozen=True)
class RecycledFile:
    """A data file of a deleted step kept for reuse (StepWriting.take_recycled): `key` is the
    backend's own name for it (opaque to callers: a path on POSIX), `size` its bytes."""

    key: str
    size: int


@dataclass(frozen=True)
class FreeSpace:
    """Bytes free for a job's steps (`nbytes`), and `where` they were measured (for messages)."""

    nbytes: int
    where: str


@dataclass(frozen=True)
class Leftover:
    """What a crash or a failed save left, found (and removed) by the janitor: `where` (for
    messages: a path or a URL), the step it belongs to (-1: none, a temporary of the job),
    `reason` ("uncommitted" or "temporary") and its bytes (0 when not measured)."""

    where: str
    step: int
    reason: str
    nbytes: int


class StepCatalog(Protocol):
    """Which jobs and committed steps there are (listing: retention, admission, the tools)."""

    def step_location(self, job: str, step: int) -> str:
        """Where a step is, for messages and what a commit reports (DurableInfo.step_dir):
        a directory on POSIX."""

    def jobs(self) -> list[str]: ...

    def root_id(self) -> str:
        """The storage's id, made on first use: daemons that share one storage read the same."""

    def is_committed(self, job: str, step: int) -> bool:
        """Whether the step's index is published (links are never taken for a step)."""

    def committed_steps(self, job: str) -> list[int]:
        """Committed steps, ascending by number."""

    def commit_order(self, job: str) -> list[int]:
        """Committed steps in the order they were committed (the index's created_at), oldest
        first: the last is the newest, whatever its number."""

    def latest_step(self, job: str) -> int | None: ...

    def not_followed(self, job: str, step: int | None = None) -> list[str]:
        """What stands where the job's directory or a step directory of it (`step`'s alone when
        given) belongs but is never taken for one (a symbolic link, a file), each said with how to
        fix it; [] when nothing: a load that would silently pass over them (and start the run
        over, or from an older step) is refused instead."""

    def newest_commit_time(self, job: str) -> float | None:
        """The `created_at` of the job's most recently committed step (the last of commit_order),
        None when it has none: the next commit's is later (plan/files.commit_time)."""

    def latest_named(self, job: str) -> int | None:
        """The step the job's `latest` names (a hint for other tools), or None."""

    def step_bytes(self, job: str, step: int) -> int:
        """Bytes the step's files take (retention's report); 0 when it is gone."""


class StepFiles(Protocol):
    """Reading a step's files (loads, the peer Fetch, uploads, the operator tools)."""

    def read_index(self, job: str, step: int) -> CheckpointIndex: ...

    def read_small(self, job: str, step: int, name: str, limit: int = 1 << 30) -> bytes:
        """A whole small file of a step (extra.json, the index's bytes)."""

    def read_range(self, job: str, step: int, name: str, offset: int, nbytes: int) -> bytes:
        """Bytes [offset, offset + nbytes) of a step's file; FormatError when it ends early,
        ValueError for a negative range."""

    def copy_range(self, job: str, step: int, name: str, out_fd: int, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of a step's file to the same offset of `out_fd` (a
        staging file in shared memory, for ranks that cannot read the storage directly)."""

    def step_file_sizes(self, job: str, step: int) -> dict[str, int]:
        """The published files of a step (no temporaries) with their sizes; {} for none."""

    def local_path(self, job: str, step: int, name: str) -> str | None:
        """A file system path ranks may read the file at directly (pread, mmap), or None when
        the backend has no local files: the engine then stages the bytes into shared memory
        (copy_range)."""

    def step_reader(self, job: str, step: int) -> StepReader: ...


class StepWriting(Protocol):
    """Writing a step (the writer, the restore from an object store); the order of the calls
    that commit it is step_commit.StepCommit's."""

    def prepare_step(self, job: str, step: int, fresh: bool = True) -> None:
        """Make room for a new step. `fresh`: an earlier failed attempt's files go; else (nodes
        sharing the storage write into one step) whatever is there stays. FileExistsError
        when the step is committed."""

    def ensure_step(self, job: str, step: int) -> None:
        """The step exists (for the commit of a step other nodes wrote)."""

    def take_recycled(self, job: str) -> list[RecycledFile]:
        """Deleted steps' data files kept for reuse, largest first; one goes to open_part,
        which may still find it gone."""

    def open_part(self, job: str, step: int, name: str, size: int, recycled: RecycledFile | None = None) -> PartWriter:
        """A new data file `name` of `size` bytes (see PartWriter), made from `recycled` (from
        take_recycled) when it is still there. Not visible until PartWriter.publish."""

    def link_file(self, job: str, from_step: int, name: str, to_step: int, to_name: str, size: int) -> bool:
        """Publish data file `name` of committed step `from_step` (`size` bytes) in step
        `to_step` (prepared, being written) as `to_name`, sharing its bytes (an incremental save:
        a file of frozen tensors that did not change). POSIX: a hard link. Deleting either
        step later leaves the other's file whole, and a shared file is never recycled. False
        when it cannot (the step or file is gone or not the daemon's, another size, a backend or
        file system without links): the caller writes the file instead. Durable once
        `sync_step` returns."""

    def sync_step(self, job: str, step: int) -> None:
        """Make the names published in the step so far durable (a directory fsync)."""

    def write_small(self, job: str, step: int, name: str, data: bytes, atomic: bool = True) -> None:
        """Publish a small file of a step, durable on return. `atomic`: readers see the old
        file or the new one, never a part (the index, a prepared marker); else it is written in
        place (a small file of a step not yet committed: the index commits it)."""

    def write_latest(self, job: str, step: int) -> None:
        """Point the job's `latest` at `step` (atomically)."""

    def free_bytes(self, job: str) -> FreeSpace | None:
        """The space free for the job's steps, or None when unknown."""

    def allocated_in_step(self, job: str, step: int) -> dict[str, int]:
        """Bytes already taken by each data file of a step being written (temporaries count
        for their file): what other nodes sharing the storage have written so far."""


class StepJanitor(Protocol):
    """Removing what must go: deleted steps, aborted parts, prepared markers, leftovers."""

    def remove_step(self, job: str, step: int, recycle: bool = False) -> None:
        """Delete a step, atomically invisible first (its index goes with the rename, before
        any data file); `recycle` keeps its data files for take_recycled. Never deletes what
        the daemon did not write (ForeignEntry)."""

    def discard_part(self, job: str, step: int, names: Sequence[str], shared: bool) -> None:
        """Remove what this node wrote of an aborted step (`shared`: only `names`)."""

    def mark_prepared(self, job: str, step: int, save_id: str, node: int) -> None:
        """Record that this node's part of the step is written and durable."""

    def unmark_prepared(self, job: str, step: int) -> None:
        """The step is committed here: its prepared marker and temporaries go."""

    def prepared_steps(self) -> list[tuple[str, int]]:
        """(job, step) holding a node's prepared part but no index."""

    def leftovers(self, job: str, busy: set[int], min_age_s: float = 0.0, dry_run: bool = False) -> list[Leftover]:
        """Remove (unless `dry_run`) what a failed save left of a job (not the steps in `busy`)."""

    def clean_uncommitted(self, min_age_s: float = 0.0) -> list[Leftover]:
        """Start-up recovery: remove what a crash left, fix each job's `latest`. While other
        nodes' daemons serve the storage (a shared root), only leftovers unchanged for
        `min_age_s` seconds (the save timeout): younger ones may be their saves in flight."""


class StorageBackend(Protocol):
    """Where jobs and their steps live (see the module docstring): the four roles, and the
    claim that makes this daemon the one serving its node of the storage. Blocking: call from
    worker threads."""

    @property
    def location(self) -> str:
        """Where the storage is, for messages and `ckptd status` (a directory, or a URL)."""

    @property
    def catalog(self) -> StepCatalog: ...

    @property
    def files(self) -> StepFiles: ...

    @property
    def writing(self) -> StepWriting: ...

    @property
    def janitor(self) -> StepJanitor: ...

    def claim(self, node: int, socket: str) -> None:
        """Make this daemon the one that serves node `node` of the storage, before any recovery
        or cleanup runs (POSIX: root_lock.py); RootInUse naming the daemon that already does."""

    def release(self) -> None:
        """Give up what `claim` took (idempotent)."""
