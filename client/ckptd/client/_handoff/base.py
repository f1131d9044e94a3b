"""The hand-off seam: what a transport does with one save, and the snapshot it leaves pending.

A `HandoffTransport` moves a save's tensors to where the daemon takes them: the CPU copy into
the shared arena (ckptd.client._handoff.shm), device copies into the pinned arena (modes "copy"
and "overlap", ckptd.client._handoff.cuda) or into a device staging buffer the daemon drains
(mode "ipc", ckptd.client._handoff.ipc). `start` prepares and queues the copies and returns
them as `Started`; the client commits the snapshot from `SnapshotCommitter`'s helper thread
once they are done, whose fence keeps the state from changing under copies still in flight.
When the transport waits (mode "copy"), `save` waits for the copies first and the commit has
nothing left to wait for, as in the CPU path. A new transport is one module with one
class, registered by its mode name in ckptd.client._handoff.select and made from the
`TransportHost` that chose it (select.Handoff), which it uses without knowing the registry.

`DeviceBackend` is the seam to CUDA: ckptd.client._handoff.cuda.CudaBackend, a CPU fake in the
tests.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol, Sequence

import torch
from torch import nn

from ckptd.client._handoff.modes import ModeState
from ckptd.client.errors import CheckpointError

if TYPE_CHECKING:
    from ckptd.client._rpc import DaemonRpc, SaveGrant
    from ckptd.client.slots import Placed

LAZY_KINDS = ("optimizer", "master")  # changed only by the optimizer step


class Copy(Protocol):
    """Copies in flight: `wait` blocks until done, `fence` orders later GPU work after them."""

    operations: int

    def wait(self) -> None: ...

    def fence(self, host: bool = False) -> None: ...


class DeviceRestore(Protocol):
    """One load's host-to-device copies (see ckptd.client.cuda_restore.CudaRestore)."""

    def staging(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer of at least `nbytes` bytes that copies read at full speed;
        valid until the next `staging` call of this load."""

    def upload(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue the copies of (host, device target) pairs; returns without waiting."""

    def finish(self) -> None:
        """Block until every copy is done; the targets' streams see the values."""


class DeviceBackend(Protocol):
    """What the hand-off needs from a device (see ckptd.client._handoff.cuda.CudaBackend)."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """The tensor is copied by this backend (a CUDA tensor)."""

    def host_view(self, path: str, size: int) -> torch.Tensor:
        """The arena at `path` as a flat uint8 CPU tensor that device copies can target (pinned)."""

    def copy(self, placements: Sequence[tuple[torch.Tensor, int, int]], dst: torch.Tensor, only: set[int]) -> Copy:
        """Queue the copies of placements[i] for i in `only` into `dst`; returns without waiting."""

    def staging(self, device: torch.device, nbytes: int) -> Any:
        """A device staging buffer (ckptd.client.staging_buffer.DeviceStaging); raises IpcUnavailable."""

    def restore(self) -> "DeviceRestore":
        """The host-to-device copies of one load (ckptd.client.reader.fill.fill_onto_devices)."""

    def close(self) -> None: ...


class Started(NamedTuple):
    """A save's copies as a transport left them (a tuple: made once per save, in C).

    copies: device copies still in flight (none: every byte is in the arena already).
    mode: the mode that ran (SaveHandle.mode). waits: save() waits for the copies (the commit
    still goes from the helper thread). queued: time.perf_counter() when the copies were queued. staging_id, staged: mode
    "ipc": the fields the commit carries (ckptd.client._rpc.DaemonRpc.add_staged).
    """

    copies: Sequence[Copy]
    mode: str
    waits: bool = False
    queued: float = 0.0
    staging_id: str = ""
    staged: Any = None

    def wait(self) -> None:
        """Wait for every copy (before the arena goes back to the daemon on an error)."""
        for copy in self.copies:
            copy.wait()


class HandoffTransport(Protocol):
    """One way of handing a save's tensors over, chosen by mode name (ckptd.client._handoff.select)."""

    mode: str  # its name (ckptd.client._handoff.modes)

    def start(self, state: Mapping[str, Any], placed: "Placed", grant: "SaveGrant") -> Started:
        """Prepare and queue (or run) the copies of `placed` into the arena `grant` names, or
        into what stands for it; the state's CPU tensors go by the shared-memory copy. If it
        raises, no copy it queued is still running."""

    def on_commit_error(self, exc: CheckpointError) -> None:
        """The daemon could not take a snapshot this transport handed over (e.g. fall back)."""

    def close(self) -> None:
        """Release what the transport holds (after the last commit)."""


class HostCopier(Protocol):
    """The shared-memory copy of a placement's CPU tensors (ckptd.client._handoff.shm.ShmTransport)."""

    def copy_host(self, placed: "Placed", arena_path: str, arena_size: int) -> None: ...


class TransportHost(Protocol):
    """What a transport uses of the hand-off that made it (ckptd.client._handoff.select.Handoff):
    the mode state (to fall back), the device backend, the shared-memory copy, the daemon calls
    (mode "ipc"'s staging buffer) and the transport of another mode (the fallback's)."""

    @property
    def mode(self) -> ModeState: ...

    @property
    def backend(self) -> DeviceBackend: ...

    @property
    def shm(self) -> HostCopier: ...

    @property
    def rpc(self) -> "DaemonRpc": ...

    def transport(self, mode: str) -> HandoffTransport:
        """The transport of CUDA tensors in `mode`, made on first use."""


class Fenced:
    """What `fence()` returns: the fence is already in place; usable as `with ckpt.fence(): ...`."""

    def __enter__(self) -> "Fenced":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass
class Pending:
    """A snapshot whose copies are in flight or whose commit is being sent."""

    step: int
    copies: Sequence[Copy]
    future: "Future[None]"


class SnapshotCommitter:
    """The snapshot a client has handed over but not yet committed: one at a time, committed
    from a helper thread once its copies are done, with the fences (optimizer step pre-hooks,
    `fence()`) that keep the state from changing under copies still in flight."""

    def __init__(self) -> None:
        self._pending: Pending | None = None
        self._committer: ThreadPoolExecutor | None = None
        self._hooks: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Any]" = weakref.WeakKeyDictionary()

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

    def start_commit(self, step: int, copies: Sequence[Copy], commit: Callable[[], None], abort: Callable[[str], None]) -> Pending:
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

    def close(self) -> None:
        """Wait for the pending snapshot, remove the hooks, stop the helper thread."""
        self.settle()
        self.remove_hooks()
        if self._committer is not None:
            self._committer.shutdown(wait=True)


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
