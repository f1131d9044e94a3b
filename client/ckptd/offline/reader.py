"""Reading committed steps from their files, without a daemon (the public names: ckptd.offline).

    from ckptd.offline import list_steps, open_step

    for info in list_steps("/var/lib/ckptd", "run-42"):
        print(info.step, info.path, info.metric)
    step = open_step("/var/lib/ckptd", "run-42")          # the newest committed step
    step.load({"model": model, "optimizer": opt})          # in place, any layout, decoded
    weights = step.state_dict("model")                     # {fqn: whole tensor}

Everything is read from the committed files: every byte checked against the index's
checksums, quantized tensors decoded, fragments assembled into the boxes asked for (whole
tensors, DTensor shards, LocalShards, Megatron layout rules), exactly as a load through the
daemon. Nothing is written, nothing under the root is followed as a link, and a step is
only what its ckptd.index.json says it is.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ckptd.common import json_read
from ckptd.client.arenas import ArenaMaps
from ckptd.client.errors import CheckpointError, CheckpointNotFound
from ckptd.client.layout import LayoutRules, RankCoords
from ckptd.client.reader.fill import Fill, fill_all
from ckptd.client.reader.pieces import Decoding, Source
from ckptd.client.restore import restore_state
from ckptd.client.state import flatten_state
from ckptd.client.structure import fragments_of_state
from ckptd.common import dtypes
from ckptd.common.boxes import Box, intersect
from ckptd.common.frames import Frames
from ckptd.common.names import check_job_id
from ckptd.format.file_plan import FileInPlace, LoadMismatch, PieceInfo, Wanted, plan_pieces, rank_extras
from ckptd.format.index import ENVIRONMENT_JSON, EXTRA_JSON, INDEX_NAME, CheckpointIndex, FormatError, TensorRecord, parse_extra_json, parse_step_dir_name
from ckptd.format.index import check_small_file as _check_small_file
from ckptd.offline.root import StepRoot

__all__ = ["Step", "StepInfo", "TensorInfo", "list_steps", "open_step"]

READ_THREADS = 4


@dataclass(frozen=True)
class StepInfo:
    """A committed step of a job: where it is and what its index says of it."""

    job: str
    step: int
    path: Path
    created_at: float  # unix seconds
    metric: float | None
    size_bytes: int
    world_size: int


@dataclass(frozen=True)
class TensorInfo:
    """A logical tensor of a step: its name ("<state key>/<path>"), kind, dtype (safetensors
    name) and global shape, and whether it is stored lossy (quantized)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    lossy: bool


def list_steps(root: str | os.PathLike[str], job: str) -> list[StepInfo]:
    """The committed steps of `job` under storage root `root`, in commit order (the newest last).

    Raises CheckpointError when `root` is not a directory or the job id is invalid; a step
    whose index cannot be read is left out (`ckptd verify` says why)."""
    steps = _step_root(root)
    check_job_id(job)
    out = []
    for step in steps.commit_order(job):
        try:
            index = steps.read_index(job, step)
        except (OSError, FormatError):
            continue
        out.append(StepInfo(job, step, steps.step_dir(job, step), index.created_at, index.metric, index.size_bytes, index.world_size))
    return out


def open_step(where: str | os.PathLike[str], job: str | None = None, step: int | None = None) -> "Step":
    """A committed step: `open_step(ROOT, JOB, STEP)` (STEP None: the newest committed) or
    `open_step(STEP_DIR)` (a directory ROOT/JOB/step-NNNNNNNN).

    Raises CheckpointNotFound when there is no such committed step, CheckpointError when the
    index is damaged or something in its place is not a regular file."""
    if job is None:
        if step is not None:
            raise ValueError("open_step(STEP_DIR) takes no step; use open_step(ROOT, JOB, STEP)")
        step_dir = Path(where)
        return open_step(step_dir.parent.parent, step_dir.parent.name, _step_number(step_dir))
    steps = _step_root(where)
    check_job_id(job)
    if step is None:
        order = steps.commit_order(job)
        if not order:
            raise CheckpointNotFound(f"job {job!r} has no committed checkpoint under {steps.root}")
        step = order[-1]
    if not steps.is_committed(job, step):
        raise CheckpointNotFound(f"step {step} of job {job!r} is not a committed checkpoint under {steps.root} (`ckptd ls {steps.root}` lists them)")
    try:
        index = steps.read_index(job, step)
    except (OSError, FormatError) as exc:
        raise CheckpointError(f"cannot read the index of step {step} of job {job!r}: {exc}; `ckptd verify {steps.step_dir(job, step)}` says more") from None
    return Step(steps, job, step, index)


class Step:
    """One committed step, read from its files. Cheap to make: only the index is read."""

    def __init__(self, root: StepRoot, job: str, step: int, index: CheckpointIndex) -> None:
        self._root = root
        self.job = job
        self.step = step
        self.index = index
        self.path = root.step_dir(job, step)
        self._extras: dict[int, dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return f"Step(job={self.job!r}, step={self.step}, path={str(self.path)!r}, tensors={len(self.index.tensors)})"

    # ------------------------------------------------------------ what it holds

    def tensors(self, kind: str | None = None) -> list[TensorInfo]:
        """The step's logical tensors (of `kind`: model, master, optimizer or extra), by name."""
        return [
            TensorInfo(t.name, t.kind, t.dtype, tuple(t.shape), t.lossy)
            for t in sorted(self.index.tensors, key=lambda t: t.name)
            if kind is None or t.kind == kind
        ]

    @property
    def environment(self) -> dict[str, Any] | None:
        """The environment record (environment.json: versions, layout, run config); None for a
        step written before ckptd kept one."""
        data = self._small_file(ENVIRONMENT_JSON)
        return None if data is None else json_read.loads(data)

    def extras(self, rank: int = 0) -> dict[str, Any]:
        """Rank `rank`'s extras as saved (the JSON tree, tensors as {"__tensor__": name}
        references to the step's tensors of kind "extra"); {} when the rank saved none."""
        return self.extras_by_rank().get(rank, {})

    def extras_by_rank(self) -> dict[int, dict[str, Any]]:
        """Every rank's extras (extra.json, read and checked once per Step)."""
        if self._extras is None:
            data = self._small_file(EXTRA_JSON)
            record = next((f for f in self.index.files if f.name == EXTRA_JSON), None)
            try:
                self._extras = {} if data is None or record is None else parse_extra_json(data, record)
            except FormatError as exc:
                raise CheckpointError(f"step {self.step} of job {self.job!r}: {exc}") from None
        return self._extras

    # ------------------------------------------------------------ reading tensors

    def tensor(self, name: str) -> torch.Tensor:
        """The whole logical tensor `name` (or one of its aliases), decoded, as a CPU tensor."""
        return self.tensors_named([name])[name]

    def tensors_named(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Whole logical tensors by name, decoded, read in parallel."""
        shapes = {name: tuple(self._record(name).shape) for name in names}
        read = self.read_boxes([(name, (0,) * len(shape), shape, None) for name, shape in shapes.items()])
        return dict(zip(shapes, read))

    def state_dict(self, kind: str = "model") -> dict[str, torch.Tensor]:
        """Every tensor of `kind` whole, keyed by its name without the state key ("model/embed.weight"
        -> "embed.weight"): the form `module.load_state_dict` and safetensors take."""
        records = [t for t in self.index.tensors if t.kind == kind]
        if not records:
            raise KeyError(f"step {self.step} of job {self.job!r} holds no tensors of kind {kind!r} (it has {sorted({t.kind for t in self.index.tensors})})")
        whole = self.tensors_named([t.name for t in records])
        return {name.split("/", 1)[1] if "/" in name else name: tensor for name, tensor in whole.items()}

    def read_box(self, name: str, offsets: Sequence[int], lengths: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The box (offsets, lengths per dimension) of logical tensor `name`, into `out` when
        given (of shape `lengths`, any dtype and device: values are converted), else a new tensor."""
        return self.read_boxes([(name, offsets, lengths, out)])[0]

    def read_boxes(self, boxes: Sequence[tuple[str, Sequence[int], Sequence[int], torch.Tensor | None]]) -> list[torch.Tensor]:
        """read_box for many boxes (name, offsets, lengths, out or None) in one parallel read;
        returns the filled tensors in order."""
        specs = []
        targets = []
        for name, offsets, lengths, out in boxes:
            record = self._record(name)
            box = Box(tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))
            if len(box.offsets) != len(record.shape) or any(o + n > size for o, n, size in zip(box.offsets, box.lengths, record.shape)):
                raise ValueError(f"box {box} is not inside tensor {name!r} of shape {list(record.shape)}")
            if out is None:
                out = torch.empty(box.lengths, dtype=getattr(torch, dtypes.torch_name(record.dtype)))
            elif tuple(out.shape) != box.lengths:
                raise ValueError(f"out has shape {list(out.shape)}, the box {list(box.lengths)}")
            specs.append(Wanted(name, record.kind, tuple(record.shape), box))
            targets.append(out)
        self._read(specs, targets, sorted({s.kind for s in specs}), strict=False)
        return targets

    def load(
        self,
        state: Mapping[str, Any],
        *,
        strict: bool = True,
        rank: int = 0,
        rng: bool = False,
        layout: LayoutRules | None = None,
        coords: RankCoords | None = None,
    ) -> int:
        """Restore `state` in place from this step, as CheckpointClient.load does through the
        daemon: the same state structures, resharded into whatever layout `state` has (DTensors,
        LocalShards, `layout`/`coords` rules), quantized tensors decoded; extras from rank
        `rank`'s (rank 0's, without its RNG state, for a rank the step does not have).
        Returns the step. Raises CheckpointError naming the tensors when strict checks fail."""
        flat = flatten_state(state, rank=rank, rng=rng)
        fragments = fragments_of_state(flat, layout, coords)
        kinds = sorted({e.name.split("/", 1)[0] for e in flat.tensors} | set(flat.extras))
        specs = [
            Wanted(f.name, entry.kind, f.global_shape, f.box, per_rank=f.per_rank, aliases=entry.aliases)
            for entry, f in fragments
        ]
        self._read(specs, [f.local for _, f in fragments], kinds, strict, rank)
        extras = rank_extras(self.extras_by_rank(), rank, self.index.world_size)
        try:
            restore_state(state, flat, extras, strict=strict)
        except ValueError as exc:
            raise CheckpointError(f"step {self.step} of job {self.job!r}: {exc}") from None
        return self.step

    # ------------------------------------------------------------ internals

    def _record(self, name: str) -> TensorRecord:
        record = self.index.by_name().get(name)
        if record is None:
            raise KeyError(f"step {self.step} of job {self.job!r} has no tensor {name!r}; Step.tensors() lists them")
        return record

    def _read(self, specs: Sequence[Wanted], targets: Sequence[torch.Tensor], kinds: Sequence[str], strict: bool, rank: int = 0) -> None:
        """Fill each target with its spec's box (the load planner's file part, then the client's fills)."""
        try:
            planned = plan_pieces(self.index, specs, kinds, strict, self._locations(), rank)
        except LoadMismatch as exc:
            raise CheckpointError(str(exc)) from None
        # each fragment once per name (several boxes of one tensor plan the same fragments)
        by_name: dict[str, dict[Box, Source]] = {}
        for piece in planned.pieces:
            by_name.setdefault(piece.name, {}).setdefault(piece.fragment, _source(piece))
        fills = []
        for spec, target in zip(specs, targets):
            fragments = by_name.get(spec.name)
            if fragments is not None:
                fills.append(Fill(target, spec.box, [src for box, src in fragments.items() if intersect(box, spec.box) is not None]))
        self._fill(fills)

    def _fill(self, fills: list[Fill]) -> None:
        """Run the fills; a target off the CPU (a model on a GPU) is filled through a CPU tensor
        of its shape and dtype, then copied: the reader writes host memory only."""
        on_host, to_device = host_fills(fills)
        maps = ArenaMaps()
        try:
            with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckptd-offline") as pool, torch.no_grad():
                fill_all(pool, maps, on_host)
                for target, staged in to_device:
                    target.copy_(staged)
        finally:
            maps.close()

    def _locations(self) -> dict[str, FileInPlace]:
        """Every data file of the step, read here, each checked to be a regular file (not a
        link) in a step directory that is not one either."""
        _check_directory(self.path)
        out = {}
        for f in self.index.files:
            if f.name.endswith(".safetensors"):
                path = self._root.file_path(self.job, self.step, f.name)
                out[f.name] = FileInPlace(str(path))
        return out

    def _small_file(self, name: str) -> bytes | None:
        """A small file the index lists, checked against its size and checksum; None when unlisted."""
        record = next((f for f in self.index.files if f.name == name), None)
        if record is None:
            return None
        try:
            data = self._root.read_small(self.job, self.step, name, max(record.size, 1))
            _check_small_file(record, data)
        except (OSError, FormatError) as exc:
            raise CheckpointError(f"{self.path}/{name} cannot be read: {exc}; `ckptd verify {self.path}` says what else is damaged") from None
        return data


def host_fills(fills: Sequence[Fill]) -> tuple[list[Fill], list[tuple[torch.Tensor, torch.Tensor]]]:
    """`fills` with every target off the CPU replaced by a new CPU tensor of its shape and dtype,
    and the (target, CPU tensor) pairs to copy once those are filled."""
    on_host: list[Fill] = []
    to_device: list[tuple[torch.Tensor, torch.Tensor]] = []
    for fill in fills:
        if fill.target.device.type == "cpu":
            on_host.append(fill)
            continue
        staged = torch.empty(tuple(fill.target.shape), dtype=fill.target.dtype)
        on_host.append(Fill(staged, fill.want, fill.sources))
        to_device.append((fill.target, staged))
    return on_host, to_device


def _step_root(root: str | os.PathLike[str]) -> StepRoot:
    path = Path(root)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory: give the storage root that `ckptd serve --root` used")
    if (path / INDEX_NAME).exists():
        raise CheckpointError(f"{path} is a step directory, not a storage root: use open_step({str(path)!r})")
    return StepRoot(path.resolve())


def _step_number(step_dir: Path) -> int:
    step = parse_step_dir_name(step_dir.name)
    if step is None:
        raise CheckpointError(f"{step_dir} is not a step directory (ROOT/JOB/step-NNNNNNNN)")
    return step


def _check_directory(path: Path) -> None:
    """`path` and its job directory are real directories, not links."""
    for where in (path.parent, path):
        try:
            mode = os.lstat(where).st_mode
        except OSError as exc:
            raise CheckpointError(f"cannot read {where}: {exc.strerror}") from None
        if not stat.S_ISDIR(mode):
            raise CheckpointError(f"{where} is not a directory (a link or other entry in the storage root is never followed)")


def _source(p: PieceInfo) -> Source:
    """The client's reader description of a planned piece."""
    decoding = None
    if p.decode is not None:
        d = p.decode
        decoding = Decoding(d.codec, d.block, _source(d.scales) if d.scales else None, _source(d.base) if d.base else None, d.frames if isinstance(d.frames, Frames) else None)
    return Source(p.name, p.source, p.path, p.offset, p.nbytes, p.fragment, p.dtype, p.checksum, p.chunk_bytes, p.chunk_xxh3, decoding)
