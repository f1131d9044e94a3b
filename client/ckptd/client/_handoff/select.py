"""Which transport hands a save over: chosen by mode name, here and nowhere else.

`TRANSPORTS` maps each mode CUDA tensors can take to the class that implements it; a state
without CUDA tensors always takes the shared-memory copy. `Handoff` is one client's hand-off:
the mode in use (and why it fell back), the device backend (made on first use), the
transports, and the pending snapshot with its fences (SnapshotCommitter).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ckptd.client.arenas import ArenaMaps
from ckptd.client._handoff.base import DeviceBackend, HandoffTransport, SnapshotCommitter
from ckptd.client._handoff.cuda import DeviceCopyTransport
from ckptd.client._handoff.ipc import IpcTransport
from ckptd.client._handoff.modes import COPY, IPC, OVERLAP, ModeState, resolve_mode
from ckptd.client._handoff.shm import ShmTransport

if TYPE_CHECKING:
    from ckptd.client._rpc import DaemonRpc
    from ckptd.client.slots import Placed

# mode name -> the transport of CUDA tensors in that mode (made once per client, on first use)
TRANSPORTS: dict[str, Callable[["Handoff"], HandoffTransport]] = {
    COPY: lambda handoff: DeviceCopyTransport(handoff, COPY),
    OVERLAP: lambda handoff: DeviceCopyTransport(handoff, OVERLAP),
    IPC: IpcTransport,
}


class Handoff:
    """One client's hand-off state. `requested`: the mode asked for (checked here);
    backend_factory: makes the DeviceBackend on first use (a stand-in for CUDA in tests);
    owns(tensor): the device backend copies it; rpc: for mode "ipc"'s staging buffer; maps, pool,
    copy_workers: the shared-memory copy's arena mappings, threads and groups."""

    def __init__(
        self,
        requested: str,
        backend_factory: Callable[[], DeviceBackend],
        owns: Callable[[torch.Tensor], bool],
        rpc: "DaemonRpc",
        maps: ArenaMaps,
        pool: ThreadPoolExecutor,
        copy_workers: int,
    ) -> None:
        self.mode = ModeState(requested, resolve_mode(requested))
        self.owns = owns
        self.rpc = rpc
        self.commits = SnapshotCommitter()
        self.shm = ShmTransport(maps, pool, copy_workers)
        self._backend_factory = backend_factory
        self._backend: DeviceBackend | None = None
        self._transports: dict[str, HandoffTransport] = {}

    @property
    def backend(self) -> DeviceBackend:
        if self._backend is None:
            self._backend = self._backend_factory()
        return self._backend

    def transport(self, mode: str) -> HandoffTransport:
        """The transport of CUDA tensors in `mode`, made on first use."""
        found = self._transports.get(mode)
        if found is None:
            found = self._transports[mode] = TRANSPORTS[mode](self)
        return found

    def transport_for(self, placed: "Placed") -> HandoffTransport:
        """The transport of this save: the mode in use when it has CUDA tensors, else the
        shared-memory copy."""
        return self.transport(self.mode.in_use) if placed.device else self.shm

    def before_save(self, state: Mapping[str, Any]) -> BaseException | None:
        """Wait until the previous snapshot is committed (returns its error, if any); unless the
        mode in use waits for its copies, fence the state's optimizers from now on."""
        previous = self.commits.settle()
        if self.mode.in_use != COPY:
            self.commits.install_hooks(state)
        return previous

    def close(self) -> None:
        """Wait for the pending snapshot, then release the transports and the device backend."""
        self.commits.close()
        for transport in self._transports.values():
            transport.close()
        self.shm.close()
        if self._backend is not None:
            self._backend.close()
