"""The snapshot's side of a write: where each stored tensor's bytes are in the shared-memory
arenas (Source, arena_runs), how each is coded (compress: quantized codes, bf16 residuals,
dropped master weights), and the coding buffers (ScratchPool). No file I/O: write/writer.py writes.

The compression decision is made here, per node, while writing; issue 21 item 4 moves it to
plan time.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ckptd.common import dtypes
from ckptd.common.boxes import Box, contiguous_runs
from ckptd.format.index import StoredTensor, scales_key
from ckptd.daemon.handoff.arena import ArenaSet
from ckptd.daemon.plan.files import Coding
from ckptd.daemon.plan.save_plan import FragmentSlot, LogicalTensor

if TYPE_CHECKING:
    from ckptd.daemon.write.writer import PersistRequest, Progress


@dataclass(frozen=True)
class Piece:
    """A contiguous run of a stored tensor: `nbytes` from arena `rank` at `src` to file offset `dst`."""

    rank: int
    src: int
    dst: int
    nbytes: int


def arena_runs(tensor_shape: tuple[int, ...], itemsize: int, slots: list[FragmentSlot], data_offset: int) -> list[Piece]:
    """The runs that assemble a whole tensor from its fragments, in file order."""
    pieces = []
    for slot in slots:
        for dst, src, n in contiguous_runs(slot.box, tensor_shape):
            pieces.append(Piece(slot.rank, slot.offset + src * itemsize, data_offset + dst * itemsize, n * itemsize))
    pieces.sort(key=lambda p: p.dst)
    return pieces


class Source:
    """Where a stored tensor's bytes are in the arenas."""

    def __init__(
        self, arenas: ArenaSet, tensors: dict[str, LogicalTensor], slots_by_name: dict[str, list[FragmentSlot]],
        slot_of: dict[tuple[str, Box], FragmentSlot],
    ) -> None:
        self.arenas = arenas
        self.tensors = tensors
        self.slots_by_name = slots_by_name
        self.slot_of = slot_of

    def nbytes(self, tensor: StoredTensor) -> int:
        """The snapshot's bytes of a stored tensor (its logical dtype over its box), whatever it
        is stored as: what Progress counts."""
        return dtypes.nbytes(self.tensors[tensor.name].dtype, tensor.box.lengths)

    def pieces(self, tensor: StoredTensor, offset: int) -> list[Piece]:
        """The arena runs of `tensor` (a whole tensor or a fragment) placed from byte `offset` on."""
        itemsize = dtypes.itemsize(self.tensors[tensor.name].dtype)
        if tensor.box == Box.full(self.tensors[tensor.name].shape):
            return arena_runs(tensor.box.lengths, itemsize, self.slots_by_name[tensor.name], offset)
        slot = self.slot_of[(tensor.name, tensor.box)]  # a fragment stored on its own: one run from its slot
        return [Piece(slot.rank, slot.offset, offset, slot.nbytes)]

    @contextlib.contextmanager
    def values(self, tensor: StoredTensor) -> Iterator[Any]:
        """The tensor's values as a torch tensor of the box's shape: a view of the arena when its
        bytes are one run there (the usual case, no copy), else a gathered copy. The view must
        not outlive the block."""
        logical = self.tensors[tensor.name]
        pieces = self.pieces(tensor, 0)
        if len(pieces) != 1:
            yield as_torch(self.gather(tensor), logical.dtype, tensor.box.lengths)
            return
        arena = self.arenas.arenas[pieces[0].rank]
        assert arena is not None, "plan gave a fragment to a rank without an arena"
        view = arena.view(pieces[0].src, pieces[0].nbytes)
        try:
            yield as_torch(np.frombuffer(view, dtype=np.uint8), logical.dtype, tensor.box.lengths)
        finally:
            view.release()

    def gather(self, tensor: StoredTensor) -> np.ndarray:
        """A copy of the tensor's bytes (its logical dtype, the box's shape) as a flat uint8 array."""
        logical = self.tensors[tensor.name]
        out = np.empty(dtypes.nbytes(logical.dtype, tensor.box.lengths), dtype=np.uint8)
        for piece in self.pieces(tensor, 0):
            arena = self.arenas.arenas[piece.rank]
            assert arena is not None, "plan gave a fragment to a rank without an arena"
            view = arena.view(piece.src, piece.nbytes)
            try:
                out[piece.dst : piece.dst + piece.nbytes] = np.frombuffer(view, dtype=np.uint8)
            finally:
                view.release()
        return out


class ScratchPool:
    """At most `size` coding buffers (ckptd.common.quant.Scratch), handed from one coding job
    to the next: a save faults in fresh memory for each buffer once instead of once per tensor,
    and no more jobs code at once than there are buffers (the rest of the writer threads keep
    writing; coders beyond the cores only take turns)."""

    def __init__(self, size: int) -> None:
        self._free: list[Any] = []
        self._made = 0
        self._size = max(1, size)
        self._ready = threading.Condition()

    @contextlib.contextmanager
    def take(self) -> Iterator[Any]:
        from ckptd.common import quant  # the torch math (compress imported torch already)

        with self._ready:
            self._ready.wait_for(lambda: self._free or self._made < self._size)
            if self._free:
                scratch = self._free.pop()
            else:
                scratch, self._made = quant.Scratch(), self._made + 1
        try:
            yield scratch
        finally:
            with self._ready:
                self._free.append(scratch)
                self._ready.notify()


def compress(
    source: Source, stored: list[StoredTensor], kinds: dict[str, str], req: PersistRequest, progress: Progress
) -> tuple[list[StoredTensor], dict[tuple[str, Box], Coding], dict[str, StoredTensor]]:
    """Decide how each of `stored` is compressed (req.quantize, req.master_weights).

    Returns the tensors to lay out (codes, scales and residuals with their stored dtypes and
    the shapes of uncompressed codes, for every node's tensors: all nodes lay out the same
    files), how this node's coded tensors are made, by (name, box), and the dropped master
    weights (name -> the stored model tensor whose bytes stand for it). A tensor that cannot be
    quantized (inf/nan, a negative second moment) is found when it is coded and stored as it is.
    """
    mode = req.master_weights
    if req.quantize is None and mode == "keep":
        return stored, {}, {}
    first_import = "torch" not in sys.modules
    import torch

    from ckptd.common import codecs  # torch: imported by the writer thread, only when compressing

    # One intra-op thread: coding runs in parallel over tensors (on the writer threads) instead
    # of inside each op; on a busy machine OpenMP's spinning threads cost several times the work.
    # torch is used for nothing else in the daemon.
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    if first_import:
        # torch brings ~140,000 objects that live as long as the process; left to the garbage
        # collector, every full collection scans them again (80-95 ms, now and then in the
        # middle of a save). Frozen, they are never scanned.
        gc.freeze()

    whole_model = {t.name: t for t in stored if kinds[t.name] == "model" and t.box == Box.full(source.tensors[t.name].shape)}
    out: list[StoredTensor] = []
    codings: dict[tuple[str, Box], Coding] = {}
    cast: dict[str, StoredTensor] = {}
    for t in stored:
        logical = source.tensors[t.name]
        codec = codecs.codec_for(req.quantize, t.name, logical.kind, logical.dtype, logical.shape)
        model = model_twin(t, logical, source, whole_model) if logical.kind == "master" and mode != "keep" else None
        if codec is not None:
            out.append(StoredTensor(t.name, t.key, codec.codes_dtype, codec.codes_shape(t.box.lengths), t.box, t.node))
            out.append(StoredTensor(t.name, scales_key(t.key), "F32", codec.scales_shape(t.box), t.box, t.node, role="scales"))
            if t.node == req.node:
                codings[(t.name, t.box)] = Coding(codec=codec)
        elif model is not None and mode == "drop":
            cast[t.name] = model
            progress.add(t.nbytes if t.node == req.node else 0)
        elif model is not None:
            out.append(StoredTensor(t.name, t.key, "BF16", t.shape, t.box, t.node))
            if t.node == req.node:
                codings[(t.name, t.box)] = Coding(model=model)
        else:
            out.append(t)
    return out, codings, cast


def model_twin(t: StoredTensor, logical: LogicalTensor, source: Source, whole_model: dict[str, StoredTensor]) -> StoredTensor | None:
    """The stored model weight a whole fp32 master weight can be rebuilt from: "model/<fqn>" for
    "master/<fqn>", stored whole by this node, of the same shape in bf16 or fp16. None otherwise
    (the master weight is then kept)."""
    if logical.dtype != "F32" or t.box != Box.full(logical.shape):
        return None
    model = whole_model.get("model/" + t.name.split("/", 1)[1])
    if model is None or model.node != t.node:
        return None
    twin = source.tensors[model.name]
    if twin.dtype not in ("BF16", "F16") or twin.shape != logical.shape:
        return None
    return model


def as_torch(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.from_numpy(data).view(getattr(torch, dtypes.torch_name(dtype))).view(shape)


def flat_bytes(tensor: Any) -> np.ndarray:
    """A contiguous torch tensor's bytes as a flat uint8 array (no copy; bf16 included)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()
