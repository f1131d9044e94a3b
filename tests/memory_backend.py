"""MemoryStorage: a StorageBackend (ckptd.daemon.storage.base) held in memory, one class per
role (MemoryCatalog, MemoryFiles, MemoryWriting, MemoryJanitor) over one shared MemoryState.
A TEST DOUBLE only: the writer, commit and load tests run against it as well as POSIX, so the
writer cannot depend on anything but the protocols.

It enforces the protocol's rules, so it hides no bug: a part is invisible until published, is
published only once synced and closed, and only when every byte up to its final size was
written (the header last into its reserved room included); a write past a synced part, a range
outside a file, a second publish, and a commit of an unprepared step all raise.
"""

from __future__ import annotations

import errno
import json
import math
import threading
from dataclasses import dataclass, field
from typing import Sequence

from ckptd.common.names import check_job_id
from ckptd.format.index import INDEX_NAME, PREPARED_NAME, CheckpointIndex, FormatError, step_dir_name
from ckptd.daemon.storage.base import FreeSpace, Leftover, RecycledFile


class MemoryPart:
    """A PartWriter over a bytearray; tracks which bytes were written."""

    def __init__(self, owner: "MemoryState", job: str, step: int, name: str, size: int, base: bytearray | None) -> None:
        self.name = name
        self.size = size
        self._owner, self._job, self._step = owner, job, step
        self._data = base if base is not None else bytearray()
        del self._data[size:]
        self._written: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._final: int | None = None
        self._closed = self._published = False
        self.writeback: list[tuple[int, int]] = []

    def pwrite(self, offset: int, view: memoryview) -> None:
        self._put(offset, view)

    def pwritev(self, offset: int, views: Sequence[memoryview]) -> None:
        for view in views:
            self._put(offset, view)
            offset += len(view)

    def _put(self, offset: int, view: memoryview) -> None:
        if self._final is not None or self._closed:
            raise ValueError(f"{self.name}: a write after it was synced or closed")
        if offset < 0:
            raise ValueError(f"{self.name}: a write at offset {offset}")
        data = bytes(view)
        with self._lock:
            if len(self._data) < offset + len(data):
                self._data.extend(bytes(offset + len(data) - len(self._data)))
            self._data[offset : offset + len(data)] = data
            self._written.append((offset, offset + len(data)))

    def start_writeback(self, offset: int, nbytes: int) -> bool:
        self.writeback.append((offset, nbytes))
        return True

    def sync(self, size: int | None = None) -> None:
        final = self.size if size is None else size
        end = max((e for _, e in self._written), default=0)
        if end > final:
            raise ValueError(f"{self.name}: bytes written up to {end}, past its final size {final}")
        covered = 0
        for begin, stop in sorted(self._written):
            if begin > covered:
                raise ValueError(f"{self.name}: bytes [{covered}, {begin}) were never written")
            covered = max(covered, stop)
        if covered != final:
            raise ValueError(f"{self.name}: {covered} bytes written of its final size {final}")
        del self._data[final:]
        self._final = final

    def close(self) -> None:
        self._closed = True

    def publish(self) -> None:
        if self._final is None or not self._closed:
            raise ValueError(f"{self.name}: published before it was synced and closed")
        if self._published:
            raise ValueError(f"{self.name}: published twice")
        self._published = True
        self._owner.step(self._job, self._step).files[self.name] = bytes(self._data)


class _Handle:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.size = len(data)

    def pread(self, nbytes: int, offset: int) -> bytes:
        return self._data[offset : offset + nbytes]

    def close(self) -> None:
        pass  # nothing held

    def __enter__(self) -> "_Handle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryStepReader:
    def __init__(self, files: dict[str, bytes], where: str) -> None:
        self._files = files
        self.where = where

    def names(self) -> list[str]:
        return sorted(self._files)

    def exists(self, name: str) -> bool:
        return name in self._files

    def read_small(self, name: str, limit: int = 1 << 30) -> bytes:
        data = self.open(name)._data
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        return data

    def open(self, name: str) -> _Handle:
        if name not in self._files:
            raise FileNotFoundError(errno.ENOENT, "no such file", f"{self.where}/{name}")
        return _Handle(self._files[name])


@dataclass
class _Step:
    files: dict[str, bytes] = field(default_factory=dict)  # published only: parts are not here until publish
    parts: list[MemoryPart] = field(default_factory=list)


@dataclass
class MemoryState:
    """What every role reads and changes. `free`: the free bytes free_bytes reports (None:
    unknown); `recycled`: the bin, keyed by the RecycledFile key of each buffer."""

    free: int | None = None
    steps: dict[tuple[str, int], _Step] = field(default_factory=dict)
    latest: dict[str, int] = field(default_factory=dict)
    recycled: dict[str, dict[str, bytearray]] = field(default_factory=dict)
    parts: list[MemoryPart] = field(default_factory=list)  # every part opened, for tests
    recycled_made: int = 0  # keys handed out so far

    def step(self, job: str, step: int) -> _Step:
        check_job_id(job)
        if (job, step) not in self.steps:
            raise FileNotFoundError(errno.ENOENT, "no such step", f"{job}/{step_dir_name(step)}")
        return self.steps[(job, step)]

    def file(self, job: str, step: int, name: str) -> bytes:
        files = self.step(job, step).files
        if name not in files:
            raise FileNotFoundError(errno.ENOENT, "no such file", f"{job}/{step_dir_name(step)}/{name}")
        return files[name]

    def is_committed(self, job: str, step: int) -> bool:
        return (job, step) in self.steps and INDEX_NAME in self.steps[(job, step)].files

    def step_file_sizes(self, job: str, step: int) -> dict[str, int]:
        if (job, step) not in self.steps:
            return {}
        return {name: len(data) for name, data in self.steps[(job, step)].files.items()}


class MemoryCatalog:
    """base.StepCatalog in memory."""

    def __init__(self, state: MemoryState) -> None:
        self.state = state

    def step_location(self, job: str, step: int) -> str:
        return f"memory://{check_job_id(job)}/{step_dir_name(step)}"

    def jobs(self) -> list[str]:
        return sorted({job for job, _ in self.state.steps})

    def root_id(self) -> str:
        return "memory-root"

    def is_committed(self, job: str, step: int) -> bool:
        return self.state.is_committed(job, step)

    def committed_steps(self, job: str) -> list[int]:
        return sorted(s for j, s in self.state.steps if j == job and self.is_committed(j, s))

    def _created(self, job: str, step: int) -> float:
        value = float(json.loads(self.state.file(job, step, INDEX_NAME))["created_at"])
        return value if math.isfinite(value) else 0.0

    def commit_order(self, job: str) -> list[int]:
        return sorted(self.committed_steps(job), key=lambda s: (self._created(job, s), s))

    def not_followed(self, job: str, step: int | None = None) -> list[str]:
        return []  # nothing in memory is a link

    def newest_commit_time(self, job: str) -> float | None:
        order = self.commit_order(job)
        return self._created(job, order[-1]) if order else None

    def latest_step(self, job: str) -> int | None:
        order = self.commit_order(job)
        return order[-1] if order else None

    def latest_named(self, job: str) -> int | None:
        return self.state.latest.get(job)

    def step_bytes(self, job: str, step: int) -> int:
        return sum(self.state.step_file_sizes(job, step).values())


class MemoryFiles:
    """base.StepFiles in memory: no local files (local_path is None), so loads stage."""

    def __init__(self, state: MemoryState) -> None:
        self.state = state

    def read_index(self, job: str, step: int) -> CheckpointIndex:
        return CheckpointIndex.from_json_bytes(self.state.file(job, step, INDEX_NAME), where=f"{job}/{step_dir_name(step)}/{INDEX_NAME}")

    def read_small(self, job: str, step: int, name: str, limit: int = 1 << 30) -> bytes:
        return self.step_reader(job, step).read_small(name, limit)

    def read_range(self, job: str, step: int, name: str, offset: int, nbytes: int) -> bytes:
        if offset < 0 or nbytes < 0:
            raise ValueError(f"bytes [{offset}, +{nbytes}) of {name}")
        data = self.state.file(job, step, name)
        if offset + nbytes > len(data):
            raise FormatError(f"{name} ends at byte {len(data)}, before the {nbytes} bytes asked from {offset}")
        return data[offset : offset + nbytes]

    def copy_range(self, job: str, step: int, name: str, out_fd: int, offset: int, nbytes: int) -> None:
        import os

        data = self.read_range(job, step, name, offset, nbytes)
        os.pwrite(out_fd, data, offset)  # a staging file in shared memory, not the storage

    def step_file_sizes(self, job: str, step: int) -> dict[str, int]:
        return self.state.step_file_sizes(job, step)

    def local_path(self, job: str, step: int, name: str) -> str | None:
        return None

    def step_reader(self, job: str, step: int) -> MemoryStepReader:
        return MemoryStepReader(self.state.step(job, step).files, f"memory:{job}/{step_dir_name(step)}")


class MemoryWriting:
    """base.StepWriting in memory."""

    def __init__(self, state: MemoryState) -> None:
        self.state = state

    def prepare_step(self, job: str, step: int, fresh: bool = True) -> None:
        check_job_id(job)
        if self.state.is_committed(job, step):
            raise FileExistsError(f"{job}/{step_dir_name(step)} is already committed")
        if fresh or (job, step) not in self.state.steps:
            self.state.steps[(job, step)] = _Step()

    def ensure_step(self, job: str, step: int) -> None:
        check_job_id(job)
        self.state.steps.setdefault((job, step), _Step())

    def take_recycled(self, job: str) -> list[RecycledFile]:
        return sorted((RecycledFile(key, len(buf)) for key, buf in self.state.recycled.get(job, {}).items()), key=lambda f: -f.size)

    def open_part(self, job: str, step: int, name: str, size: int, recycled: RecycledFile | None = None) -> MemoryPart:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a data file name of a step")
        record = self.state.step(job, step)
        base = self.state.recycled.get(job, {}).pop(recycled.key, None) if recycled is not None else None
        part = MemoryPart(self.state, job, step, name, size, base)
        record.parts.append(part)
        self.state.parts.append(part)
        return part

    def link_file(self, job: str, from_step: int, name: str, to_step: int, to_name: str, size: int) -> bool:
        if not self.state.is_committed(job, from_step):
            return False
        data = self.state.step(job, from_step).files.get(name)
        if data is None or len(data) != size:
            return False
        self.state.step(job, to_step).files[to_name] = data  # bytes are immutable: shared, as a hard link shares
        return True

    def sync_step(self, job: str, step: int) -> None:
        self.state.step(job, step)

    def write_small(self, job: str, step: int, name: str, data: bytes, atomic: bool = True) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a file name of a step")
        self.state.step(job, step).files[name] = bytes(data)

    def write_latest(self, job: str, step: int) -> None:
        if not self.state.is_committed(job, step):
            raise ValueError(f"`latest` would name {job}/{step_dir_name(step)}, which is not committed")
        self.state.latest[job] = step

    def free_bytes(self, job: str) -> FreeSpace | None:
        return None if self.state.free is None else FreeSpace(self.state.free, "memory")

    def allocated_in_step(self, job: str, step: int) -> dict[str, int]:
        record = self.state.steps.get((job, step))
        if record is None:
            return {}
        found = {name: len(data) for name, data in record.files.items()}
        for part in record.parts:
            found.setdefault(part.name, part.size)
        return found


class MemoryJanitor:
    """base.StepJanitor in memory."""

    def __init__(self, state: MemoryState, catalog: MemoryCatalog, writing: MemoryWriting) -> None:
        self.state, self.catalog, self.writing = state, catalog, writing

    def remove_step(self, job: str, step: int, recycle: bool = False) -> None:
        record = self.state.steps.pop((job, step), None)
        if record is not None and recycle:
            # as POSIX: a file another step still names (linked, link_file) is never recycled
            shared = {id(data) for other in self.state.steps.values() for data in other.files.values()}
            kept = [bytearray(data) for name, data in record.files.items() if name.endswith(".safetensors") and id(data) not in shared]
            self.state.recycled[job] = {}
            for buf in kept:
                self.state.recycled_made += 1
                self.state.recycled[job][f"memory-recycled-{self.state.recycled_made}"] = buf

    def discard_part(self, job: str, step: int, names: Sequence[str], shared: bool) -> None:
        if not shared:
            self.remove_step(job, step)
            return
        record = self.state.steps.get((job, step))
        if record is None or INDEX_NAME in record.files:
            return
        for name in names:
            record.files.pop(name, None)

    def mark_prepared(self, job: str, step: int, save_id: str, node: int) -> None:
        self.writing.write_small(job, step, PREPARED_NAME, json.dumps({"save_id": save_id, "node": node, "step": step}).encode())

    def unmark_prepared(self, job: str, step: int) -> None:
        if (job, step) in self.state.steps:
            self.state.steps[(job, step)].files.pop(PREPARED_NAME, None)

    def prepared_steps(self) -> list[tuple[str, int]]:
        return sorted(k for k, s in self.state.steps.items() if PREPARED_NAME in s.files and INDEX_NAME not in s.files)

    def leftovers(self, job: str, busy: set[int], min_age_s: float = 0.0, dry_run: bool = False) -> list[Leftover]:
        found = [Leftover(f"memory:{job}/{step_dir_name(s)}", s, "uncommitted", self.catalog.step_bytes(job, s))
                 for (j, s), rec in sorted(self.state.steps.items()) if j == job and s not in busy and INDEX_NAME not in rec.files and PREPARED_NAME not in rec.files]
        if not dry_run:
            for left in found:
                self.state.steps.pop((job, left.step), None)
        return found

    def clean_uncommitted(self, min_age_s: float = 0.0) -> list[Leftover]:
        removed = []
        for job in self.catalog.jobs():
            removed += self.leftovers(job, set())
        return removed


class MemoryStorage:
    """The StorageBackend protocol in memory (see the module docstring)."""

    def __init__(self, free: int | None = None) -> None:
        self.state = MemoryState(free)
        self.catalog = MemoryCatalog(self.state)
        self.files = MemoryFiles(self.state)
        self.writing = MemoryWriting(self.state)
        self.janitor = MemoryJanitor(self.state, self.catalog, self.writing)

    @property
    def location(self) -> str:
        return "memory://"

    def claim(self, node: int, socket: str) -> None:
        """One process's memory: no other daemon can serve it."""

    def release(self) -> None:
        pass
