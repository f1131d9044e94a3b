"""The leases of loads in progress: what a rank is reading between PlanLoad and LoadDone.

A lease keeps its step from retention, its held snapshot from being reused or given back, and
its staging files (and their bytes under --shm-budget) in place. It ends at LoadDone, when the
client that planned it ends (its Attach call ends: the process exited or was killed mid-load),
or after LOAD_LEASE_S (a client too old to attach, a process that hung).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ckptd.daemon.engine.tiers import Snapshot

LOAD_LEASE_S = 3600.0  # seconds a lease lasts when neither LoadDone nor the client's end comes


@dataclass(frozen=True)
class LoadLease:
    job: str
    step: int
    held: Snapshot | None  # the snapshot in memory the load reads, if any
    expires: float  # monotonic seconds
    client: str = ""  # the client id of the rank that planned the load ("": a client older than client ids)
    rank: int = 0  # the rank that planned it
    local_ranks: int = 1  # how many of the job's ranks this daemon serves (the rank's local world)


class LoadLeases:
    """The leases of loads in progress, by load id."""

    def __init__(self, lease_s: float = LOAD_LEASE_S) -> None:
        self._lease_s = lease_s
        self._by_id: dict[str, LoadLease] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, job: str, step: int, held: Snapshot | None, client: str, rank: int = 0, local_ranks: int = 1) -> str:
        """A new lease of a load of `step` of `job` by `client`, rank `rank` of the `local_ranks`
        this daemon serves (`held`, the snapshot it reads, leased with it: Snapshot.lease): its load id."""
        if held is not None:
            held.lease()
        load_id = uuid.uuid4().hex
        self._by_id[load_id] = LoadLease(job, step, held, time.monotonic() + self._lease_s, client, rank, local_ranks)
        return load_id

    def pop(self, load_id: str) -> LoadLease | None:
        """The lease `load_id`, ended, its held snapshot released (Snapshot.release); None: none
        such, or it ended already."""
        lease = self._by_id.pop(load_id, None)
        if lease is not None and lease.held is not None:
            lease.held.release()
        return lease

    def expired(self) -> list[str]:
        """The load ids of the leases past their time."""
        now = time.monotonic()
        return [load_id for load_id, lease in self._by_id.items() if lease.expires < now]

    def of_client(self, job: str, client: str) -> list[str]:
        """The load ids of the leases `client` (a client id, not "") of `job` holds."""
        return [load_id for load_id, lease in self._by_id.items() if client and lease.client == client and lease.job == job]

    def steps(self, job: str) -> set[int]:
        """The steps of `job` that leased loads are reading."""
        return {lease.step for lease in self._by_id.values() if lease.job == job}

    def reading(self, job: str, step: int) -> bool:
        """Whether a leased load reads `step` of `job`."""
        return any(lease.job == job and lease.step == step for lease in self._by_id.values())
