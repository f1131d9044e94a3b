"""Mode "ipc": a save's CUDA tensors copied device-to-device into the rank's staging buffer.

The buffer (ckptd.client.staging_buffer.DeviceStaging) mirrors the arena's layout and is opened by the
daemon once (OpenStaging); a save queues the copies into it and returns like "overlap"; the
commit names the ranges the daemon drains from the buffer into the arena. When the buffer
cannot be set up (several devices, no GPU memory, the daemon refuses it) or the daemon cannot
drain it, the client falls back to "overlap" for good, the reason logged once and kept in
`mode_reason`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

from ckptd.client._handoff.base import Started, TransportHost
from ckptd.client._handoff.cuda import DeviceCopyTransport
from ckptd.client._handoff.modes import FALLBACK, IPC
from ckptd.client.devcopy import coalesced_ranges, item_of
from ckptd.client.errors import CheckpointError

if TYPE_CHECKING:
    from ckptd.client._rpc import DaemonRpc, SaveGrant
    from ckptd.client.slots import Placed


class IpcTransport(DeviceCopyTransport):
    """HandoffTransport of mode "ipc"; delegates to FALLBACK's transport once it has fallen back."""

    def __init__(self, handoff: TransportHost) -> None:
        super().__init__(handoff, IPC)
        self.rpc: "DaemonRpc" = handoff.rpc
        self.staging: Any = None  # ckptd.client.staging_buffer.DeviceStaging, opened by the daemon

    def start(self, state: Mapping[str, Any], placed: "Placed", grant: "SaveGrant") -> Started:
        staging = self._staging_for(placed, grant.arena_size)
        if staging is None:
            return self.handoff.transport(FALLBACK).start(state, placed, grant)
        started = self.queue(state, placed, grant, staging.tensor, IPC)
        staged = placed.cache.get("staged")
        if staged is None:  # the device ranges the daemon copies out of the staging buffer: fixed for a placement
            device_idx = placed.device
            items = [item_of(t, off, n, "staged" if i in device_idx else None) for i, (t, off, n) in enumerate(placed.for_device)]
            staged = placed.cache["staged"] = self.rpc.staged_ranges(coalesced_ranges(items))
        return Started(started.copies, IPC, False, started.queued, staging.staging_id, staged)

    def _staging_for(self, placed: "Placed", arena_size: int) -> Any:
        """The rank's device staging buffer, opened by the daemon (at least `arena_size` bytes:
        it mirrors the arena's layout); None after falling back (reason logged)."""
        from ckptd.client.staging_buffer import IpcUnavailable

        handoff = self.handoff
        devices = placed.devices
        if len(devices) != 1:
            handoff.mode.fall_back(f"this rank's CUDA tensors are on {len(devices)} devices; one staging buffer serves one")
            return None
        if self.staging is not None and self.staging.nbytes >= arena_size and self.staging.device in devices:
            return self.staging
        self.close()  # the plan grew: a larger buffer
        try:
            staging = handoff.backend.staging(next(iter(devices)), arena_size)
        except IpcUnavailable as exc:
            handoff.mode.fall_back(str(exc))
            return None
        staging_id, reason = self.rpc.open_staging(staging.uuid, staging.handle, staging.nbytes, os.getpid())
        if not staging_id:
            staging.free()
            handoff.mode.fall_back(reason or "the daemon could not open the staging buffer")
            return None
        staging.staging_id = staging_id
        self.staging = staging
        return staging

    def on_commit_error(self, exc: CheckpointError) -> None:
        self.handoff.mode.fall_back(f"the daemon could not copy the staging buffer: {exc}")

    def close(self) -> None:
        """Close the buffer in the daemon, then free it."""
        if self.staging is not None:
            if self.staging.staging_id:
                self.rpc.close_staging(self.staging.staging_id)
            self.staging.free()
            self.staging = None
