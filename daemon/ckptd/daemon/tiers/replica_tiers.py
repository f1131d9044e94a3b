"""The two replica tiers (engine/tiers.py) over this daemon's `Replication` (tiers/replicas.py):
REPLICA_HERE, the other nodes' parts this daemon holds in memory (copied into staging files
here), and REPLICA_PEER, the parts the peers hold (received from them over the bulk port). A
replica lost or damaged since the load was planned is handed back as `Unstaged`: the engine
stages those ranges from the disk of the node that wrote them. A range staged whole, each byte
checked against the step's checksums as it arrived, is marked checked (StagingTarget.checked):
the ranks copy it without hashing it again; ranges of a step whose index has no units, and
anything staged from disk instead, the ranks check."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace
from typing import Any, Collection, Mapping, Sequence

from ckptd.daemon.engine.tiers import Committed, StagingTarget, Tier, Unstaged
from ckptd.daemon.errors import NotFound, Unavailable
from ckptd.format.index import CheckpointIndex, FormatError
from ckptd.format.units import Unit, file_units
from ckptd.daemon.metrics import LiveState
from ckptd.daemon.plan.load_plan import TierName
from ckptd.format.file_plan import StagedRead
from ckptd.daemon.records import PeerInventory
from ckptd.daemon.tiers.replicas import Replication, buddies

log = logging.getLogger(__name__)


def step_units(index: CheckpointIndex) -> dict[str, tuple[Unit, ...]]:
    """The checksum units of the step's data files, by which bytes staged from a replica are
    checked (units.file_units); none when the index's records do not tile its files (logged:
    the ranks still check what they read)."""
    try:
        return file_units(index)
    except FormatError as exc:
        log.warning("step %s of job %s: replicas are staged unchecked: %s", index.step, index.job, exc)
        return {}


def _replicas(index: CheckpointIndex, held: Sequence[tuple[int, str, int]]) -> dict[str, int]:
    """The held (source node, file, size) that are the step's files as their writer wrote them."""
    writer = {f.name: f.node for f in index.files if f.name.endswith(".safetensors")}
    return {name: size for source, name, size in held if writer.get(name) == source}


class ReplicasHere(Tier):
    """Other nodes' parts held in this daemon's memory; also where this node's own part is
    pushed from after a commit, and what `ckptd status` and the metrics show of the replica tiers."""

    name = TierName.REPLICA_HERE

    def __init__(self, replication: Replication) -> None:
        self.replication = replication

    async def files(self, index: CheckpointIndex, inventories: Mapping[int, PeerInventory]) -> Mapping[int, Mapping[str, int]]:
        return {self.replication.engine.node: _replicas(index, self.replication.store.files_of(index.job, index.step))}

    async def stage(self, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget) -> Sequence[Unstaged]:
        """Copy each range from the replica held here, checked as it passes (Replication.copy_local);
        each range copied whole and checked is marked so (target.checked)."""
        units = step_units(index)
        writer = {f.name: f.node for f in index.files}
        unstaged = []
        for read in reads:
            fd = await asyncio.to_thread(target.open, target.paths[read.file])
            try:
                await asyncio.to_thread(
                    self.replication.copy_local, index.job, index.step, writer[read.file], read.file, read.offset, read.nbytes, fd, units
                )
            except (Unavailable, NotFound) as exc:  # damaged, or replaced by a newer step's since the load was planned
                unstaged.append(Unstaged(writer[read.file], (read,), exc))
                continue
            finally:
                os.close(fd)
            if units.get(read.file):
                target.checked(read.file, read.offset)
        return unstaged

    def after_commit(self, commit: Committed) -> None:
        if not commit.adopted:  # a step adopted after a restart is not the newest: not pushed
            self.replication.committed(commit.job, commit.step, commit.index)

    def status_fields(self, job: str | None = None) -> dict[str, Any]:
        return {"replicas": self.replication.status()}  # told of one job by StatusSnapshot.of_job

    def live(self, state: LiveState) -> LiveState:
        store = self.replication.store
        return replace(state, replica_bytes=store.nbytes, replicas=len(store.held))


class ReplicasOnPeers(Tier):
    """Parts held in the peers' memory, received for this node's loads."""

    name = TierName.REPLICA_PEER

    def __init__(self, replication: Replication) -> None:
        self.replication = replication

    async def files(self, index: CheckpointIndex, inventories: Mapping[int, PeerInventory]) -> Mapping[int, Mapping[str, int]]:
        return {node: _replicas(index, answer.replicas) for node, answer in inventories.items()}

    def peers_holding(self, writers: Collection[int]) -> set[int]:
        """A node's part is held by its buddies (tiers/replicas.buddies, under this daemon's --replicas)."""
        engine = self.replication.engine
        assert engine.cluster is not None
        nodes, here = engine.cluster.nodes, engine.node
        return {b for w in writers if 0 <= w < nodes for b in buddies(w, nodes, engine.config.replicas) if b != here}

    async def stage(self, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget) -> Sequence[Unstaged]:
        """Receive the ranges from each holder (read.node) at once, one batch per holder and
        writer (merged ranges, parallel connections: Replication.fetch); a batch that arrived
        whole and checked has its ranges marked so (target.checked)."""
        units = step_units(index)
        by_holder: dict[int, list[StagedRead]] = {}
        for read in reads:
            by_holder.setdefault(read.node, []).append(read)
        batches = await asyncio.gather(*(self._fetch(index, holder, batch, target, units) for holder, batch in by_holder.items()))
        return [u for batch in batches for u in batch]

    async def _fetch(
        self, index: CheckpointIndex, holder: int, reads: Sequence[StagedRead], target: StagingTarget, units: Mapping[str, Sequence[Unit]]
    ) -> list[Unstaged]:
        writer = {f.name: f.node for f in index.files}
        fds: dict[str, int] = {}
        unstaged = []
        try:
            for read in reads:
                if read.file not in fds:
                    fds[read.file] = await asyncio.to_thread(target.open, target.paths[read.file])
            by_source: dict[int, list[StagedRead]] = {}
            for read in reads:
                by_source.setdefault(writer[read.file], []).append(read)
            for source, mine in by_source.items():
                ranges = [(r.file, r.offset, r.nbytes, fds[r.file]) for r in mine]
                try:
                    await self.replication.fetch(holder, index.job, index.step, source, ranges, units)
                except Unavailable as exc:  # the holder lost the replica since the load was planned, or its copy is damaged
                    unstaged.append(Unstaged(source, tuple(mine), exc))
                    continue
                for read in mine:  # every byte arrived and matched its unit before it was written
                    if units.get(read.file):
                        target.checked(read.file, read.offset)
        finally:
            for fd in fds.values():
                os.close(fd)
        return unstaged
