"""Modes "copy" and "overlap": a save's CUDA tensors copied device-to-host into the pinned arena.

- "copy": the copies run on a side stream; `save` waits for them and commits.
- "overlap" (what "auto" picks): the same copies, but `save` returns at once and the snapshot
  is committed from a helper thread once the copy-done event has fired. Until then a fence
  keeps the state from changing under the copy: tensors a forward pass may change (module
  buffers such as BatchNorm statistics, extras) are copied first and fenced at once, in `save`;
  parameters, master weights and optimizer state are fenced before the next optimizer step
  (ckptd.client._handoff.base.SnapshotCommitter).

The state's CPU tensors take the shared-memory copy meanwhile (ckptd.client._handoff.shm).
`CudaBackend` is the DeviceBackend for CUDA; it imports ckptd.client.cuda_copier only when made, so a
CPU-only client never touches CUDA.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ckptd.client._handoff.base import Copy, Started, TransportHost, lazy_placements
from ckptd.client._handoff.modes import COPY
from ckptd.client.errors import CheckpointError

if TYPE_CHECKING:
    from ckptd.client._rpc import SaveGrant
    from ckptd.client.slots import Placed


class CudaBackend:
    """DeviceBackend for CUDA: pinned arenas, side-stream copies, staging buffers.

    Each arena mapping is page-locked once, in one cudaHostRegister call, the first time
    `host_view` returns it; `copy` reuses its plan while it gets the same placements object
    (ckptd.client.cuda_copier.CudaCopier.copy). tests/fakecuda.py runs it on CPU, strictly.
    """

    def __init__(self) -> None:
        from ckptd.client.cuda_copier import CudaCopier, PinnedArenas, cuda_problem

        problem = cuda_problem()
        if problem is not None:
            raise RuntimeError(problem)
        self.pinned = PinnedArenas()
        self.copier = CudaCopier()
        self.restorer: Any = None  # ckptd.client.cuda_restore.CudaRestorer, made by the first restore

    @staticmethod
    def owns(tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def host_view(self, path: str, size: int) -> torch.Tensor:
        return self.pinned.get(path, size).host

    def copy(self, placements: Sequence[tuple[torch.Tensor, int, int]], dst: torch.Tensor, only: set[int]) -> Copy:
        """Pass the same `placements` object from save to save while the state's structure is
        unchanged: the copy plan is then built once, not per save."""
        return self.copier.copy(placements, dst, only)

    def staging(self, device: torch.device, nbytes: int) -> Any:
        from ckptd.client.staging_buffer import DeviceStaging

        return DeviceStaging.allocate(device, nbytes)

    def restore(self) -> Any:
        """A load's host-to-device copies (ckptd.client.cuda_restore.CudaRestore): its pinned
        staging pool and copy streams are made on the first load and reused."""
        if self.restorer is None:
            from ckptd.client.cuda_restore import CudaRestorer

            self.restorer = CudaRestorer()
        return self.restorer.begin()

    def close(self) -> None:
        self.copier.close()
        self.pinned.close()
        if self.restorer is not None:
            self.restorer.close()


class DeviceCopyTransport:
    """HandoffTransport of modes "copy" and "overlap" (`mode`): device copies into the arena."""

    def __init__(self, handoff: TransportHost, mode: str) -> None:
        self.handoff = handoff
        self.mode = mode

    def start(self, state: Mapping[str, Any], placed: "Placed", grant: "SaveGrant") -> Started:
        dst = self.handoff.backend.host_view(grant.arena_path, grant.arena_size)
        return self.queue(state, placed, grant, dst, self.mode)

    def queue(self, state: Mapping[str, Any], placed: "Placed", grant: "SaveGrant", dst: torch.Tensor, mode: str) -> Started:
        """Queue the device copies of `placed` into `dst` (laid out like the arena) in two groups:
        the tensors a forward pass may change first, fenced at once unless `mode` waits for the
        copies; then the rest. The CPU tensors are copied meanwhile."""
        backend = self.handoff.backend
        placements = placed.for_device
        device_idx = set(placed.device)
        waits = mode == COPY
        if not waits:
            lazy = placed.cache.get("lazy")
            if lazy is None:  # which tensors only an optimizer step changes: fixed for a placement
                lazy = placed.cache["lazy"] = lazy_placements(state, placed.kinds, [t for t, _, _ in placed.placements]) & device_idx
        else:
            lazy = set()
        eager = device_idx - lazy
        copies: list[Copy] = []
        queued = time.perf_counter()
        try:
            for group in (eager, lazy):
                if group:
                    copies.append(backend.copy(placements, dst, group))
            if not waits and eager:
                copies[0].fence()  # forward passes may change these: the compute stream waits for their copy now
            if placed.host:
                self.handoff.shm.copy_host(placed, grant.arena_path, grant.arena_size)
        except BaseException:
            for copy in copies:  # the arena goes back to the daemon: nothing may still write into it
                copy.wait()
            raise
        return Started(copies, mode, waits, queued)

    def on_commit_error(self, exc: CheckpointError) -> None:
        return None

    def close(self) -> None:
        return None
