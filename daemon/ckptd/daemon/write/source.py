"""The snapshot's side of a write: reading a stored tensor's values out of the shared-memory
arenas (ArenaSource, over the runs plan/node_files.py gives each tensor), the coding buffers
(ScratchPool) and torch, loaded for coding (load_torch). No file I/O: write/writer.py writes.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from typing import Any, Iterator

import numpy as np

from ckptd.common import dtypes
from ckptd.daemon.handoff.arena import ArenaSet
from ckptd.daemon.plan.node_files import ArenaRun, TensorBytes


class ArenaSource:
    """A snapshot's arenas, read by the runs of its stored tensors."""

    def __init__(self, arenas: ArenaSet) -> None:
        self.arenas = arenas

    def view(self, run: ArenaRun, begin: int, nbytes: int) -> memoryview:
        """`nbytes` of `run` from its byte `begin` on: a view of the arena (release it)."""
        arena = self.arenas.arenas[run.rank]
        assert arena is not None, "plan gave a fragment to a rank without an arena"
        return arena.view(run.src + begin, nbytes)

    @contextlib.contextmanager
    def values(self, tensor: TensorBytes) -> Iterator[Any]:
        """The tensor's values as a torch tensor of its shape: a view of the arena when its
        bytes are one run there (the usual case, no copy), else a gathered copy. The view must
        not outlive the block."""
        if len(tensor.runs) != 1:
            yield as_torch(self.gather(tensor), tensor.dtype, tensor.shape)
            return
        view = self.view(tensor.runs[0], 0, tensor.runs[0].nbytes)
        try:
            yield as_torch(np.frombuffer(view, dtype=np.uint8), tensor.dtype, tensor.shape)
        finally:
            view.release()

    def gather(self, tensor: TensorBytes) -> np.ndarray:
        """A copy of the tensor's bytes (its logical dtype, its shape) as a flat uint8 array."""
        out = np.empty(tensor.nbytes, dtype=np.uint8)
        for run in tensor.runs:
            view = self.view(run, 0, run.nbytes)
            try:
                out[run.dst : run.dst + run.nbytes] = np.frombuffer(view, dtype=np.uint8)
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
        from ckptd.common import quant  # the torch math (load_torch imported torch already)

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


def load_torch() -> None:
    """Import torch (only when compressing) for coding (quantized codes, bf16 residuals) on the writer's threads, set up
    for them: one intra-op thread, and the objects torch brings frozen for the garbage collector."""
    first_import = "torch" not in sys.modules
    import torch

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


def as_torch(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.from_numpy(data).view(getattr(torch, dtypes.torch_name(dtype))).view(shape)


def flat_bytes(tensor: Any) -> np.ndarray:
    """A contiguous torch tensor's bytes as a flat uint8 array (no copy; bf16 included)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()
