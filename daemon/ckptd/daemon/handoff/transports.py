"""The daemon's side of the hand-off transports (the client's side: ckptd.client._handoff).

Most transports need nothing here: the rank itself copies its bytes into its node's arena (mode
"shm" from host memory, "copy"/"overlap" from a GPU through host staging) and hands the snapshot
over. A transport whose bytes the daemon moves into the arenas itself implements
`DaemonTransport` and is listed in `daemon_transports()`: today mode "ipc", whose ranks leave
their bytes in a GPU staging buffer that the daemon drains (gpu.GpuStaging). A new one is one
module implementing the protocol, one entry there, and the wire fields or RPCs its ranks need to
reach it (as OpenStaging/CloseStaging and CommitSnapshotRequest.staged are for "ipc").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from ckptd.daemon.handoff.arena import Arena
from ckptd.daemon.handoff.gpu_ipc import GpuStaging, StagedRange


@dataclass(frozen=True)
class StagedHandOver:
    """A rank's snapshot left with a daemon transport: what to drain into its arena at hand-over."""

    transport: str  # DaemonTransport.name
    staging_id: str
    ranges: Sequence[StagedRange]


class DaemonTransport(Protocol):
    """A hand-off transport whose bytes the daemon moves into the arenas."""

    name: str

    async def before_save(self) -> None:
        """A save begins: free what ranks that died still hold (their restarted successors need it)."""

    async def drain(self, job: str, rank: int, staging_id: str, arena: Arena | None, ranges: Sequence[StagedRange]) -> None:
        """Copy the rank's staged ranges into its arena before its hand-over counts; raises
        errors.Aborted (the save fails, nothing of it is written) when it cannot."""

    def shutdown(self) -> None:
        """Release everything (the daemon is stopping)."""


def daemon_transports() -> dict[str, DaemonTransport]:
    """One instance of each daemon-side transport, by name (made once per daemon)."""
    gpu = GpuStaging()  # loads CUDA only when a rank opens a staging buffer
    return {gpu.name: gpu}
