"""torch.distributed.checkpoint (DCP) reads and writes ckptd checkpoints.

    import torch.distributed.checkpoint as dcp
    from ckptd.integrations.dcp import CkptdStorageReader, CkptdStorageWriter

    writer = CkptdStorageWriter(job="run-42")                  # one per run: it keeps its client
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=step, planner=writer.planner)  # or dcp.async_save
    dcp.load(state_dict, storage_reader=CkptdStorageReader(step_dir))     # any world size

The writer hands every rank's chunks (DTensor shards, ShardedTensor shards, whole tensors;
several chunks of one tensor on one rank as LocalShards) to the node's daemon through a
CheckpointClient, as LocalShard boxes at the chunks' offsets, so
`dcp.save` returns after the hand-off and the daemon writes and commits in the background
(`durable=True` waits for the commit instead; `writer.handle` is the last save's handle).
The writer is DCP's AsyncStager: `dcp.async_save` makes no copy of its own and returns once
its thread has handed the tensors to the daemon. `writer.planner` (CkptdSavePlanner) keeps
DCP's plans while the state's structure is unchanged.
Names: DCP's flattened key "model.layers.0.weight" is ckptd's "model/layers.0.weight" (kinds
model, master and optimizer by the first part, so the model files stay Hugging Face
loadable); any other key k is "dcp/k". Non-tensor values (DCP's "bytes" entries) travel in
the extras as base64 of DCP's own serialization; ckptd never unpickles them (DCP's load
planner does, as it does for its own directories).

The reader serves a committed ckptd step, written by DCP or by CheckpointClient, to
`dcp.load` in any world size and sharding: DCP plans against the step's fragments (its
chunks), and every read is a box of a fragment, read and checksum-verified from the files,
quantized tensors decoded (ckptd.offline). It needs no daemon.

`export_dcp(step_dir, out)` writes a step's tensors as an ordinary DCP directory
(FileSystemWriter), for tools that only read DCP.
"""

from __future__ import annotations

import base64
import io
import logging
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ckptd.common.names import decimal
from ckptd.client import CheckpointClient, ClientOptions, LocalShard, LocalShards, SaveHandle, tree
from ckptd.client.errors import CheckpointError
from ckptd.common import dtypes
from ckptd.common.paths import new_directory_problem
from ckptd.integrations._dcp_plan import CkptdSavePlanner
from ckptd.offline import Step, open_step

__all__ = ["CkptdSavePlanner", "CkptdStorageReader", "CkptdStorageWriter", "export_dcp", "ckptd_name", "dcp_fqn"]

log = logging.getLogger(__name__)

KINDS_BY_PREFIX = ("model", "master", "optimizer")
OTHER = "dcp"  # the state key of every other DCP entry
BYTES_KEY = "dcp_bytes"  # extras: {fqn: base64 of DCP's serialized object}


def ckptd_name(fqn: str) -> tuple[str, str]:
    """(state key, path under it) of DCP key `fqn`: ("model", "layers.0.weight") for
    "model.layers.0.weight"; (OTHER, fqn) for keys outside model, master and optimizer."""
    head, dot, rest = fqn.partition(".")
    if dot and head in KINDS_BY_PREFIX and rest:
        return head, rest
    return OTHER, fqn


def dcp_fqn(name: str) -> str:
    """The DCP key of ckptd tensor `name`: the inverse of ckptd_name for what DCP wrote, and for
    CheckpointClient's own names DCP's flattening of the same state ("optimizer/state/w/exp_avg"
    -> "optimizer.state.w.exp_avg", as get_state_dict's optimizer dict flattens)."""
    head, _, rest = name.partition("/")
    if head == OTHER and rest:
        return rest
    return name.replace("/", ".")


def _step_of(checkpoint_id: str | os.PathLike[str] | int | None) -> int | None:
    if checkpoint_id is None:
        return None
    text = os.fspath(checkpoint_id) if not isinstance(checkpoint_id, int) else str(checkpoint_id)
    step = None if isinstance(checkpoint_id, bool) else decimal(text)
    if step is None:
        raise ValueError(f"checkpoint_id={checkpoint_id!r}: CkptdStorageWriter takes the step number (an integer >= 0) as the checkpoint id")
    return step


@dataclass(frozen=True)
class _PlanLayout:
    """A save plan's write items as CkptdStorageWriter hands them over, derived once per plan.

    tensor_items: the tensor items, resolved in this order at every save. whole: per state key
    (model, master, optimizer), (path, index into tensor_items) of each whole tensor. chunked:
    (state key, path, pieces) of every other tensor, each piece (index, the chunk's offsets, the
    tensor's size): this rank's boxes of it. results: the tensor items' WriteResults (their
    sizes are the plan's). bytes_items: DCP's bytes entries (serialized at every save).
    """

    plan: SavePlan
    bytes_items: tuple[WriteItem, ...]
    tensor_items: tuple[WriteItem, ...]
    whole: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    chunked: tuple[tuple[str, str, tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]], ...]
    results: tuple[WriteResult, ...]


def _detached(tensor: torch.Tensor | io.BytesIO) -> torch.Tensor:
    """The tensor without autograd history (a plain tensor that needs none as it is)."""
    assert isinstance(tensor, torch.Tensor)
    return tensor if type(tensor) is torch.Tensor and not tensor.requires_grad else tensor.detach()


@dataclass
class _Staged:
    """One dcp.async_save through the writer: set once its tensors are handed to the daemon."""

    handed_off: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class CkptdStorageWriter(StorageWriter):
    """A DCP StorageWriter that hands the state to the node's ckptd daemon (see the module).

    job: the run's ckptd job id. step: the step to save (else dcp.save's checkpoint_id).
    client: a CheckpointClient to use (else one is made at the first save, from `options`, a
    ckptd.client.ClientOptions, or from `client_args`, its fields as keywords: address, on_error
    (default "raise"), ...; checked here; quantize is a save option instead). durable: dcp.save returns once the
    step is committed on every node, instead of after the hand-off. Reuse one writer for every
    save of a run: the client's plans and shared memory are reused from save to save.
    """

    def __init__(
        self,
        job: str,
        step: int | None = None,
        *,
        client: CheckpointClient | None = None,
        durable: bool = False,
        quantize: str | None = None,
        options: ClientOptions | None = None,
        **client_args: Any,
    ) -> None:
        super().__init__()
        self.job = job
        self.step = _step_of(step)
        self.durable = durable
        self.quantize = quantize
        self._client = client
        self._owns_client = client is None
        if options is not None and client_args:
            raise TypeError(f"pass the client's settings either as options=ClientOptions(...) or as keywords {sorted(client_args)}, not both")
        self.options = options if options is not None else ClientOptions(**{"on_error": "raise", **client_args})
        self.handle: SaveHandle | None = None
        self._planner: CkptdSavePlanner | None = None
        self._plan_layout: _PlanLayout | None = None  # of the last plan (_layout)
        self._staged: _Staged | None = None  # the dcp.async_save being staged

    @property
    def planner(self) -> CkptdSavePlanner:
        """A save planner that keeps DCP's plans from save to save while the state's structure is
        unchanged (ckptd.integrations._dcp_plan): pass it with every save,
        `dcp.save(state, storage_writer=writer, planner=writer.planner, checkpoint_id=step)`."""
        if self._planner is None:
            self._planner = CkptdSavePlanner()
        return self._planner

    @property
    def client(self) -> CheckpointClient:
        if self._client is None:
            self._client = CheckpointClient(self.job, options=self.options)
        return self._client

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = _step_of(checkpoint_id)
        if step is not None:
            self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return _step_of(checkpoint_id) is not None
        except ValueError:
            return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._staged is not None:
            self._staged.thread = threading.current_thread()  # dcp.async_save's save thread
        if self.step is None:
            raise ValueError("no step to save: pass CkptdStorageWriter(job, step=N) or dcp.save(..., checkpoint_id=N)")
        # the client's run id is settled here, where every rank is at once (it may broadcast through
        # torch.distributed): write_data may run in dcp.async_save's thread, where no collective may
        _ = self.client.run_id

    # DCP's AsyncStager protocol: dcp.async_save stages through the writer instead of copying the
    # state first (DCP's DefaultStager); async_save returns once the save thread has handed the
    # tensors to the daemon (synchronize_staging), which is the snapshot, and the daemon persists.
    _synchronize_after_execute = True

    @property
    def should_synchronize_after_execute(self) -> bool:
        return True

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """No copy: the save thread's hand-off to the daemon is the snapshot; the caller waits for
        it in synchronize_staging, so training does not change the tensors while they are copied."""
        _ = self.client.run_id  # settled in the caller's thread, where a collective may run
        self._staged = _Staged()
        return state_dict

    def synchronize_staging(self) -> None:
        """Wait until this async save has handed its tensors to the daemon, or its thread left
        DCP's save without doing so (planning failed: its future holds the error)."""
        staged = self._staged
        if staged is None:
            return
        while not staged.handed_off.wait(0.002):
            if staged.thread is not None and not _in_dcp_save(staged.thread):
                return

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self.step is None else str(self.step))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's part of the collective save: every rank calls it, with or without items."""
        assert self.step is not None
        layout = self._layout(plan)
        tensors = [planner.resolve_data(item) for item in layout.tensor_items]
        state: dict[str, Any] = {key: {path: _detached(tensors[i]) for path, i in paths} for key, paths in layout.whole}
        for key, path, pieces in layout.chunked:  # a chunk goes as the LocalShard at its offsets; several as LocalShards
            shards = [LocalShard(_detached(tensors[i]), offsets, size) for i, offsets, size in pieces]
            state.setdefault(key, {})[path] = shards[0] if len(shards) == 1 else LocalShards(shards)
        encoded: dict[str, str] = {}
        results = list(layout.results)
        for item in layout.bytes_items:
            data = planner.resolve_data(item)
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            _check_loadable(item.index.fqn, raw)
            encoded[item.index.fqn] = base64.b64encode(raw).decode("ascii")
            results.append(WriteResult(item.index, len(raw), None))
        state[BYTES_KEY] = encoded  # always a key: a rank with nothing to write still joins the save
        staged = self._staged
        try:
            self.handle = self.client.save(self.step, state, quantize=self.quantize)
        finally:
            if staged is not None:
                staged.handed_off.set()
        if self.handle.error:
            raise CheckpointError(f"ckptd could not take step {self.step} of job {self.job!r}: {self.handle.error}")
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _layout(self, plan: SavePlan) -> _PlanLayout:
        """Where the plan's write items go in the state handed to the client (_PlanLayout), kept
        for the plan object: a planner that keeps its plans (CkptdSavePlanner) hands the same one
        to every save of an unchanged state."""
        if self._plan_layout is not None and self._plan_layout.plan is plan:
            return self._plan_layout
        bytes_items: list[WriteItem] = []
        tensor_items: list[WriteItem] = []
        whole: dict[str, list[tuple[str, int]]] = {}
        chunked: dict[tuple[str, str], list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                bytes_items.append(item)
                continue
            assert item.tensor_data is not None
            key, path = ckptd_name(item.index.fqn)
            chunk, size = item.tensor_data.chunk, tuple(item.tensor_data.size)
            i = len(tensor_items)
            tensor_items.append(item)
            results.append(WriteResult(item.index, math.prod(chunk.sizes) * item.tensor_data.properties.dtype.itemsize, None))
            # a plain tensor under an extras key would be the rank's own (per rank): give those their box
            if key in KINDS_BY_PREFIX and not any(chunk.offsets) and tuple(chunk.sizes) == size:
                whole.setdefault(key, []).append((path, i))
            else:
                chunked.setdefault((key, path), []).append((i, tuple(chunk.offsets), size))
        self._plan_layout = _PlanLayout(
            plan, tuple(bytes_items), tuple(tensor_items),
            tuple((key, tuple(paths)) for key, paths in whole.items()),
            tuple((key, path, tuple(pieces)) for (key, path), pieces in chunked.items()),
            tuple(results),
        )
        return self._plan_layout

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Called on the coordinator rank only: the commit is the daemons' (ckptd.index.json)."""
        if self.durable and self.handle is not None:
            self.handle.wait_durable()

    def close(self) -> None:
        """Close the client this writer made (not one passed in); drop its planner's plans."""
        if self._planner is not None:
            self._planner.forget()
        if self._client is not None and self._owns_client:
            self._client.close()
            self._client = None


def _in_dcp_save(thread: threading.Thread) -> bool:
    """Whether `thread` is inside DCP's save of a state (set_up_storage_writer is called there)."""
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code is _save_state_dict.__code__:
            return True
        frame = frame.f_back
    return False


class CkptdStorageReader(StorageReader):
    """A DCP StorageReader of a committed ckptd step, read from its files (see the module).

    path: the step directory (ROOT/JOB/step-NNNNNNNN), or the storage root with job (and step,
    None: the newest committed). dcp.load's checkpoint_id, when given, is a step directory.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, job: str | None = None, step: int | None = None) -> None:
        super().__init__()
        self._where = (None if path is None else Path(path), job, step)
        self._step: Step | None = None

    @property
    def step(self) -> Step:
        if self._step is None:
            path, job, step = self._where
            if path is None:
                raise ValueError("no checkpoint to read: pass CkptdStorageReader(STEP_DIR) or dcp.load(..., checkpoint_id=STEP_DIR)")
            self._step = open_step(path) if job is None else open_step(path, job, step)
        return self._step

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._where = (Path(checkpoint_id), None, None)
            self._step = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return (Path(checkpoint_id) / "ckptd.index.json").is_file()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's tensors as DCP sees them: each fragment a chunk; DCP's bytes entries."""
        step = self.step
        entries: dict[str, Any] = {}
        for record in step.index.tensors:
            properties = TensorProperties(dtype=getattr(torch, dtypes.torch_name(record.dtype)))
            chunks = [ChunkStorageMetadata(torch.Size(f.box.offsets), torch.Size(f.box.lengths)) for f in record.fragments]
            for name in (record.name, *record.aliases):
                entries[dcp_fqn(name)] = TensorStorageMetadata(properties, torch.Size(record.shape), chunks)
        for fqn in (*_dcp_bytes(step), *_native_values(step)):
            entries.setdefault(fqn, BytesStorageMetadata())
        return Metadata(state_dict_metadata=entries, storage_meta=StorageMeta(checkpoint_id=str(step.path)))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.step  # noqa: B018 - opened here, so a missing step fails before any read is planned

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        step = self.step
        names = {dcp_fqn(n): n for t in step.index.tensors for n in (t.name, *t.aliases)}
        stored = _dcp_bytes(step)
        native: dict[str, Any] | None = None  # made when first asked for
        reads = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn in stored:
                    planner.load_bytes(item, io.BytesIO(_safe_bytes(fqn, stored[fqn], step)))
                else:  # a plain value of a CheckpointClient's step, read from its JSON
                    if native is None:  # this rank's values, over rank 0's (the keys DCP was told of)
                        native = {**_native_values(step), **_native_values(step, dist.get_rank() if dist.is_initialized() else 0)}
                    _set_value(planner, item, native[fqn])
                continue
            chunk_at = item.storage_index.offset or torch.Size([0] * len(item.lengths))
            offsets = [c + o for c, o in zip(chunk_at, item.storage_offsets)]
            reads.append((item, (names[fqn], offsets, item.lengths, planner.resolve_tensor(item).detach())))
        # one parallel read of every box; any target dtype, layout or device (ckptd.offline converts)
        step.read_boxes([box for _, box in reads])
        for item, (_, _, _, target) in reads:
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done



def _check_loadable(fqn: str, raw: bytes) -> None:
    """Refuse (TypeError, before anything is handed over) a DCP entry whose value a load could
    never read back: loads accept only what torch.load(weights_only=True) does (_safe_bytes)."""
    refused = _weights_only_refusal(raw)
    if refused is not None:
        raise TypeError(
            f"cannot checkpoint DCP entry {fqn!r} with ckptd: a load reads DCP's non-tensor values only as "
            f"torch.load(weights_only=True) accepts them, and it refuses this one ({refused}); store it as "
            "plain values (str, int, float, bool, None, lists, dicts), a tensor, or an object with state_dict()/load_state_dict()"
        )


def _weights_only_refusal(raw: bytes) -> str | None:
    """Why torch's restricted (weights-only) unpickler refuses `raw` ("Type: first line"), or None."""
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal of the restricted unpickler is the answer
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
    return None


def _safe_bytes(fqn: str, encoded: str, step: Step) -> bytes:
    """The bytes of DCP entry `fqn`, once torch's restricted (weights-only) unpickler accepts
    them: DCP's default load planner unpickles them without restriction, so a step altered to
    hold a crafted object must fail here, before that. CheckpointError names the entry."""
    raw = base64.b64decode(encoded)
    refused = _weights_only_refusal(raw)
    if refused is not None:
        raise CheckpointError(
            f"step {step.step} of job {step.job!r}: DCP entry {fqn!r} is not a value torch.load(weights_only=True) accepts "
            f"({refused.split(':', 1)[0]}); it is not handed to DCP's planner, which would unpickle it without restriction"
        )
    return raw


class _TensorLeaf:
    """Where a tensor sits in a step's extras tree (DCP sees it as a tensor entry of its own)."""


_TENSOR_LEAF = _TensorLeaf()


def _tensor_leaf(name: str) -> Any:  # tree.decode's get_tensor: a marker, never read
    return _TENSOR_LEAF


def _native_values(step: Step, rank: int = 0) -> dict[str, Any]:
    """The plain values of a step written by CheckpointClient (`rank`'s extras, else rank 0's:
    an optimizer's param_groups, counters), under the keys DCP flattens a state dict's
    non-tensor leaves to (`optimizer.param_groups.0.lr`): what dcp.load of get_state_dict's
    dicts asks for. A step written through the storage writer has its own (DCP's bytes
    entries): none here."""
    by_rank = step.extras_by_rank()
    extras = by_rank.get(rank, by_rank.get(0, {}))
    if BYTES_KEY in extras:
        return {}
    found: dict[str, Any] = {}
    for key, encoded in extras.items():
        if isinstance(key, str):
            _dcp_leaves(tree.decode(encoded, _tensor_leaf), key, found)
    return found


def _set_value(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Put a plain value where DefaultLoadPlanner.load_bytes would put what it unpickles: a
    value made from JSON goes in as it is (never pickled to be unpickled again)."""
    if not isinstance(planner, DefaultLoadPlanner):
        raise CheckpointError(
            f"DCP entry {item.dest_index.fqn!r} is a plain value of a step CheckpointClient wrote, which CkptdStorageReader "
            f"hands to DefaultLoadPlanner only (this load's planner is a {type(planner).__name__}): use DCP's default "
            "planner, or leave the key out of the state dict you load"
        )
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[item.dest_index.fqn], value)
    else:
        planner.state_dict[item.dest_index.fqn] = value


def _dcp_leaves(value: Any, fqn: str, found: dict[str, Any]) -> None:
    """DCP's flattening (torch.distributed.checkpoint._traverse): dicts of string keys and lists
    holding containers or tensors are walked into, other values are leaves."""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                _dcp_leaves(item, f"{fqn}.{key}", found)
    elif _walked_list(value):
        for i, item in enumerate(value):
            _dcp_leaves(item, f"{fqn}.{i}", found)
    elif not _holds_tensor(value):  # a tuple holding a tensor: not a plain value DCP could have
        found[fqn] = value


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, _TensorLeaf):
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_holds_tensor, value))
    return isinstance(value, dict) and any(map(_holds_tensor, value.values()))


def _walked_list(value: Any) -> bool:
    """A list DCP walks into: one holding a dict, a tensor, or such a list."""
    return isinstance(value, list) and any(isinstance(v, (dict, _TensorLeaf)) or _walked_list(v) for v in value)


def _dcp_bytes(step: Step) -> dict[str, str]:
    """DCP's bytes entries of a step, of every rank (each entry written by one rank): fqn -> base64."""
    found: dict[str, str] = {}
    for extras in step.extras_by_rank().values():
        value = extras.get(BYTES_KEY)
        if isinstance(value, dict):
            found.update({k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)})
    return found


def export_dcp(step_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> list[str]:
    """Write the tensors of the committed step `step_dir` as a DCP directory `out` (a new or
    empty directory), under their DCP keys (dcp_fqn); returns the keys. Every tensor is read
    whole into memory (DCP saves a state in one call), so this needs host memory for the
    step's logical size. DCP's bytes entries are carried when torch.load(weights_only=True)
    reads them, else left out with a warning. Runs in one process, without a process group."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    target = Path(out)
    problem = new_directory_problem(target)
    if problem is not None:
        raise ValueError(problem)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("export_dcp runs in a single process: call it outside torch.distributed (it would save collectively)")
    step = open_step(step_dir)
    names = [t.name for t in step.index.tensors]
    whole = step.tensors_named(names)
    state: dict[str, Any] = {dcp_fqn(name): tensor for name, tensor in whole.items()}
    for record in step.index.tensors:
        for alias in record.aliases:
            state.setdefault(dcp_fqn(alias), whole[record.name])
    for fqn, encoded in _dcp_bytes(step).items():
        # DCP re-serializes the value itself; it is read back here only as weights_only allows
        try:
            state[fqn] = torch.load(io.BytesIO(base64.b64decode(encoded)), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any refusal of the restricted unpickler: leave the entry out, say so
            log.warning("export_dcp: %r left out: its value is not one weights_only loading accepts (%s)", fqn, exc)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    dcp_save(state, storage_writer=FileSystemWriter(str(tmp)))
    if target.exists():
        target.rmdir()
    os.replace(tmp, target)
    return sorted(state)
