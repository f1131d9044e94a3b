"""How a rank hands its CUDA tensors over, by mode (docs/architecture.md section 6): choice, fences, commits.

Modes (`CheckpointClient(mode=...)`) apply to CUDA tensors only; CPU tensors always take the
plain shared-memory copy (ckptd.client.transport), and a state without CUDA tensors behaves
the same in every mode.

- "copy": device-to-host copies into the pinned arena on a side stream; `save` returns when
  they are done (the trainer waits for the copy).
- "overlap" (what "auto" picks): the same copies, but `save` returns at once. The snapshot is
  committed to the daemon by a helper thread once the copy-done event has fired; until then a
  *fence* keeps the state from changing under the copy: an optimizer step pre-hook installed
  once per optimizer of the state, `handle.wait_snapshot()` and `ckpt.fence()` make the
  compute stream wait on the copy-done event (GPU-side: the host never blocks). Tensors that
  forward passes may change (module buffers such as BatchNorm statistics, extras) are copied
  first and fenced at once, in `save`; parameters, master weights and optimizer state are
  fenced before the next optimizer step.
- "ipc": a device-to-device copy into the rank's staging buffer (ckptd.client.ipc), then like
  "overlap"; the daemon drains the buffer to host memory. Falls back to "overlap", with the
  reason logged once and kept in `reason`, when the buffer cannot be set up.

The next `save`, a `load` and `close` first wait until the previous snapshot is committed (so
a slow copy shows up as stall there, never as a torn snapshot). A snapshot whose copy never
completes is never committed, so the daemon never persists it.

`DeviceBackend` is the seam to CUDA: `CudaBackend` here (lazy imports of ckptd.client.cuda and
ckptd.client.ipc), a CPU fake in the tests.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
from torch import nn

log = logging.getLogger("ckptd.client")

MODES = ("auto", "copy", "overlap", "ipc")
LAZY_KINDS = ("optimizer", "master")  # changed only by the optimizer step


def resolve_mode(requested: str) -> str:
    """The mode CUDA tensors take for `requested` (before any fallback). Raises ValueError."""
    if requested not in MODES:
        raise ValueError(f"mode={requested!r}: use one of {', '.join(MODES)}")
    return "overlap" if requested == "auto" else requested


class Copy(Protocol):
    """Copies in flight: `wait` blocks until done, `fence` orders later GPU work after them."""

    operations: int

    def wait(self) -> None: ...

    def fence(self, host: bool = False) -> None: ...


class DeviceBackend(Protocol):
    """What the hand-off needs from a device (see CudaBackend)."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """The tensor is copied by this backend (a CUDA tensor)."""

    def host_view(self, path: str, size: int) -> torch.Tensor:
        """The arena at `path` as a flat uint8 CPU tensor that device copies can target (pinned)."""

    def copy(self, placements: Sequence[tuple[torch.Tensor, int, int]], dst: torch.Tensor, only: set[int]) -> Copy:
        """Queue the copies of placements[i] for i in `only` into `dst`; returns without waiting."""

    def staging(self, device: torch.device, nbytes: int) -> Any:
        """A device staging buffer (ckptd.client.ipc.DeviceStaging); raises IpcUnavailable."""

    def to_devices(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (host, device target) pair and wait."""

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor from which host-to-device copies run at full speed."""

    def close(self) -> None: ...


class CudaBackend:
    """DeviceBackend for CUDA: pinned arenas, side-stream copies, staging buffers.

    Each arena mapping is page-locked once, in one cudaHostRegister call, the first time
    `host_view` returns it; `copy` reuses its plan while it gets the same placements object
    (ckptd.client.cuda.CudaCopier.copy). tests/fakecuda.py runs it on CPU, strictly.
    """

    def __init__(self) -> None:
        from ckptd.client.cuda import CudaCopier, PinnedArenas, cuda_problem

        problem = cuda_problem()
        if problem is not None:
            raise RuntimeError(problem)
        self.pinned = PinnedArenas()
        self.copier = CudaCopier()

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
        from ckptd.client.ipc import DeviceStaging

        return DeviceStaging.allocate(device, nbytes)

    def to_devices(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        from ckptd.client.cuda import copy_to_devices

        copy_to_devices(pairs)

    def pinned_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def close(self) -> None:
        self.copier.close()
        self.pinned.close()


@dataclass
class Pending:
    """A snapshot whose copies are in flight or whose commit is being sent."""

    step: int
    copies: list[Copy]
    future: "Future[None]"


@dataclass
class ModeState:
    """The mode CUDA tensors take now, and why it is not the one asked for (None: it is)."""

    requested: str
    in_use: str
    reason: str | None = None


class Fenced:
    """What `fence()` returns: the fence is already in place; usable as `with ckpt.fence(): ...`."""

    def __enter__(self) -> "Fenced":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class GpuHandoff:
    """One client's GPU hand-off state: mode, the pending snapshot, fences, optimizer hooks."""

    def __init__(self, requested: str, backend_factory: Callable[[], DeviceBackend], owns: Callable[[torch.Tensor], bool]) -> None:
        self.mode = ModeState(requested, resolve_mode(requested))
        self._backend_factory = backend_factory
        self._backend: DeviceBackend | None = None
        self.owns = owns
        self._pending: Pending | None = None
        self._committer: ThreadPoolExecutor | None = None
        self._hooks: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Any]" = weakref.WeakKeyDictionary()
        self.staging: Any = None

    @property
    def backend(self) -> DeviceBackend:
        if self._backend is None:
            self._backend = self._backend_factory()
        return self._backend

    def fall_back(self, reason: str) -> None:
        """Use "overlap" from now on; log why once."""
        if self.mode.in_use != "overlap":
            log.warning("ckptd mode %r cannot work here, using 'overlap': %s", self.mode.in_use, reason)
            self.mode.in_use = "overlap"
            self.mode.reason = reason

    # ------------------------------------------------------------ fences

    def install_hooks(self, state: Mapping[str, Any]) -> int:
        """Install the fence as a step pre-hook on every optimizer of `state` that has none from
        this client yet; returns how many were installed."""
        installed = 0
        for value in state.values():
            if isinstance(value, torch.optim.Optimizer) and value not in self._hooks:
                self._hooks[value] = value.register_step_pre_hook(self._step_pre_hook)
                installed += 1
        return installed

    def _step_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.fence()

    def fence(self, host: bool = False) -> Fenced:
        """Order every later change of the state after the pending snapshot's copies. A no-op
        when there is none or its copies are done (always, for CPU tensors)."""
        pending = self._pending
        if pending is not None and not pending.future.done():
            for copy in pending.copies:
                copy.fence(host)
        return Fenced()

    def remove_hooks(self) -> None:
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()

    # ------------------------------------------------------------ pending snapshots

    def settle(self) -> BaseException | None:
        """Wait until the previous snapshot is committed (or failed); return its error, if any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.future.result()
        except BaseException as exc:  # reported on that save's handle; the caller logs it
            return exc
        return None

    def start_commit(self, step: int, copies: list[Copy], commit: Callable[[], None], abort: Callable[[str], None]) -> Pending:
        """Commit the snapshot from a helper thread once `copies` are done; abort it if they fail."""
        if self._committer is None:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckptd-commit")

        def finish() -> None:
            try:
                for copy in copies:
                    copy.wait()
            except BaseException as exc:
                abort(f"the device copy failed: {type(exc).__name__}: {exc}")
                raise
            commit()

        pending = Pending(step, copies, self._committer.submit(finish))
        self._pending = pending
        return pending

    def close(self, close_staging: Callable[[Any], None]) -> None:
        self.settle()
        self.remove_hooks()
        if self._committer is not None:
            self._committer.shutdown(wait=True)
        if self.staging is not None:
            close_staging(self.staging)
            self.staging.free()
            self.staging = None
        if self._backend is not None:
            self._backend.close()


def lazy_placements(state: Mapping[str, Any], kinds: Sequence[str], tensors: Sequence[torch.Tensor]) -> set[int]:
    """Indices of the tensors that only an optimizer step changes: parameters of the state's
    modules, and tensors of kind "optimizer" or "master". Others (buffers, extras) may change
    in a forward pass and are fenced in `save` itself."""
    params: set[int] = set()  # the storages of parameters: views of them (shards, fused pieces) count too
    for value in state.values():
        if isinstance(value, nn.Module):
            for p in value.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                if local.numel():
                    params.add(local.untyped_storage().data_ptr())
    return {
        i for i, (kind, t) in enumerate(zip(kinds, tensors))
        if kind in LAZY_KINDS or (t.numel() and t.untyped_storage().data_ptr() in params)
    }
