"""Write a committed step without a running daemon (`ckptd import`), with the daemon's own writer.

The writer (`writer.persist`) reads a snapshot's bytes from arenas, `arena.view(offset, n)` at
the offsets of a save plan's slots. Here the plan is made for one rank on one node
(`plan.make_save_plan`) from the tensors to write, and its one arena is a `TensorArena`: a view
inside slot k is a view of tensor k's own memory (a mapped file, or a tensor that torch.load
mapped), so no byte is copied into a second buffer. The step's files, its index, extra.json,
the Hugging Face index, the model files and `latest` are then exactly those the daemon writes
for a save by one rank, in the same order: a failure at any point leaves no visible step
(`persist` removes the step directory; a killed process leaves a directory without an index,
which is never served and is removed by the next `ckptd serve` or `ckptd gc`).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from ckptd.common import dtypes
from ckptd.common.boxes import Box
from ckptd.common.names import InvalidNameError, check_job_id, check_step
from ckptd.daemon.config import DaemonConfig
from ckptd.format.index import LATEST, CheckpointIndex
from ckptd.daemon.handoff.arena import Arena, ArenaSet
from ckptd.daemon.plan.save_plan import PlanError, SavePlan, TensorSpec, make_save_plan
from ckptd.daemon.storage import Storage, is_storage_root
from ckptd.daemon.write.request import PersistRequest, Progress
from ckptd.daemon.write.writer import persist


class ImportRefused(ValueError):
    """What was asked cannot be imported (a source that is not safe or not understood, a step
    that exists, a root that is not a ckptd root); the message says what and how to fix it."""


@dataclass(frozen=True)
class DirectTensor:
    """One logical tensor to write whole: its ckptd name ("model/<fqn>", ...), kind, dtype
    (a safetensors dtype name, e.g. "BF16"), shape, and its bytes in C order (`data`: exactly
    dtypes.nbytes(dtype, shape) bytes, a 1-D memoryview of format "B" that stays valid until
    the step is written). `aliases`: other names of the same tensor (tied weights)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    aliases: tuple[str, ...] = ()


class TensorArena(Arena):
    """An Arena whose bytes are other objects' memory: the plan's slot at `offset` is the bytes
    of one tensor. Only `view` is used (by the writer); there is no shared-memory file to map,
    unlink or register, so Arena's constructor is not run."""

    def __init__(self, slots: Sequence[tuple[int, memoryview]], size: int) -> None:
        # Arena.__init__ would create a file in shared memory: deliberately not called.
        self.path = Path("/nonexistent/ckptd-import")
        self.path_text = str(self.path)
        self.size = size
        self.on_close = []
        ordered = sorted(((offset, data) for offset, data in slots if len(data)), key=lambda slot: slot[0])  # empty tensors are never read
        self._starts = [offset for offset, _ in ordered]
        self._data = [data for _, data in ordered]

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A zero-copy view of `nbytes` at `offset`, which must lie inside one tensor's slot."""
        k = bisect.bisect_right(self._starts, offset) - 1
        begin = offset - self._starts[k] if k >= 0 else -1
        if k < 0 or nbytes < 0 or begin + nbytes > len(self._data[k]):
            raise ValueError(f"range {offset}+{nbytes} is not inside one tensor of the import (a plan that does not match its tensors)")
        return self._data[k][begin : begin + nbytes]

    def address(self) -> int:
        raise NotImplementedError("an import's tensors are not in shared memory; CUDA copies into them are not supported")

    def close(self) -> None:
        """Nothing to unmap: the tensors' owners release their memory."""


def _serve_default(name: str) -> Any:
    """The default of `ckptd serve`'s setting `name` (DaemonConfig), so an imported step is laid
    out as a daemon with default settings lays out a save."""
    return next(f.default for f in fields(DaemonConfig) if f.name == name)


def write_step(
    root: Path,
    job: str,
    step: int,
    tensors: Sequence[DirectTensor],
    extras: dict[str, Any],
    model_files: dict[str, bytes],
    *,
    max_file_bytes: int | None = None,
    write_threads: int | None = None,
) -> tuple[CheckpointIndex, Path]:
    """Write `tensors` (each whole), `extras` (rank 0's JSON tree: {top-level key: encoded
    value}) and `model_files` (config.json ...) as committed step `step` of `job` under the
    storage root `root`, as the daemon would; returns the index and the step directory. The step
    becomes the job's newest (`latest`), as a save would.

    max_file_bytes / write_threads: as `ckptd serve --max-file-bytes / --write-threads` (None:
    their defaults). Raises ImportRefused for a bad job id or step, a root that is neither new,
    empty nor a ckptd root (check_root), a step that exists in any state (nothing is ever
    overwritten: check_target), and tensors that cannot form a checkpoint (PlanError's message);
    errors.NoSpace when the files would not fit (nothing written); OSError (ForeignEntry, I/O
    errors) from the writer, with the step directory removed.
    """
    if not tensors:
        raise ImportRefused("nothing to import: the source holds no tensor that can be imported")
    storage = check_target(root, job, step)
    plan = _plan(tensors)
    if not storage.root.is_dir():
        storage.writing.ensure_step(job, step)  # a new root: the writer measures its free space first
    by_name = {t.name: t for t in tensors}
    arena = TensorArena([(slot.offset, by_name[slot.name].data) for slot in plan.slots], plan.arena_bytes[0])
    request = PersistRequest(
        job=job,
        step=step,
        plan=plan,
        arenas=ArenaSet(index=0, arenas=[arena]),
        extras={0: extras},
        model_files=model_files,
        metric=None,
        max_file_bytes=max_file_bytes if max_file_bytes is not None else _serve_default("max_file_bytes"),
        write_threads=write_threads if write_threads is not None else _serve_default("write_threads"),
    )
    index = persist(storage, request, Progress(plan.total_bytes))
    return index, storage.tree.step_dir(job, step)


def check_target(root: Path, job: str, step: int) -> Storage:
    """The storage at `root` if step `step` of `job` can be written there (cheap: an import
    calls it before reading its source); ImportRefused naming the problem otherwise: a bad job
    id or step, a root that is neither new, empty nor a ckptd root (check_root), a step that
    exists in any state, a job directory or `latest` that is a link."""
    try:
        check_job_id(job)
        check_step(step)
    except (InvalidNameError, ValueError) as exc:
        raise ImportRefused(str(exc)) from None
    check_root(root)
    storage = Storage(root)
    _check_new_step(storage, job, step)
    return storage


def _plan(tensors: Sequence[DirectTensor]) -> SavePlan:
    """The save plan of one rank holding every tensor whole; ImportRefused when the tensors
    cannot form a checkpoint or a tensor's bytes do not match its dtype and shape."""
    specs = []
    for t in tensors:
        try:
            expected = dtypes.nbytes(t.dtype, t.shape)
        except dtypes.UnknownDtypeError as exc:
            raise ImportRefused(f"tensor {t.name!r}: {exc}") from None
        if len(t.data) != expected or t.data.itemsize != 1:
            raise ImportRefused(f"tensor {t.name!r}: {t.data.nbytes} bytes for {t.dtype}{list(t.shape)}, which takes {expected}")
        specs.append(TensorSpec(t.name, t.kind, t.dtype, tuple(t.shape), Box.full(tuple(t.shape)), tuple(t.aliases)))
    try:
        return make_save_plan([specs])
    except PlanError as exc:
        raise ImportRefused(f"the imported tensors cannot form a ckptd step: {exc}") from None


def _check_new_step(storage: Storage, job: str, step: int) -> None:
    """ImportRefused unless nothing is at the step's directory, and the job's directory and
    its `latest` are not links (nothing under the root is followed)."""
    job_dir = storage.tree.job_dir(job)
    for path in (job_dir, job_dir / LATEST):
        if os.path.islink(path):
            raise ImportRefused(f"{path} is a symbolic link; ckptd follows no link under its root: remove it or choose another --job")
    path = storage.tree.step_dir(job, step)
    if storage.catalog.is_committed(job, step):
        raise ImportRefused(
            f"step {step} of job {job!r} already exists ({path}); a committed step is never overwritten: "
            "choose another --step or --job (or remove that step first)"
        )
    if os.path.lexists(path):
        raise ImportRefused(
            f"{path} exists but is not a committed step (a save in progress, or one that was interrupted); "
            "choose another --step, or let `ckptd gc` (or the next `ckptd serve`) remove it first"
        )


def check_root(root: Path) -> None:
    """ImportRefused unless `root` can be a storage root to import into: missing (it is made),
    an empty directory (hidden entries and `lost+found` aside), or a ckptd root (holding
    `.ckptd-root-id`, or a job directory with step directories or a `latest`). Anything else,
    such as a directory of other files given by mistake, is refused, as is a root that is not
    a directory."""
    if not os.path.lexists(root):
        return
    if not root.is_dir():
        raise ImportRefused(f"--root {root} exists and is not a directory; give a new or empty directory, or the --root of `ckptd serve`")
    if is_storage_root(root):
        return
    # what a new volume or a file server puts in an empty directory does not make it someone's
    entries = [e for e in os.listdir(root) if not e.startswith(".") and e != "lost+found"]
    if not entries:
        return
    shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
    raise ImportRefused(
        f"--root {root} is not empty ({shown}) and holds no ckptd checkpoint; give a new or empty directory, "
        "or the --root of `ckptd serve`"
    )

