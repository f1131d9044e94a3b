"""The tiers, as the engine sees them: where a committed step's bytes are held besides what this
daemon writes (docs/architecture.md §9). One `Tier` per place, named by `plan.load_plan.TierName`:

    HELD          tiers/held.py           this daemon's arenas (the newest committed snapshot)
    REPLICA_HERE  tiers/replica_tiers.py  replicas of other nodes' parts in this daemon's memory
    REPLICA_PEER  tiers/replica_tiers.py  replicas in the peers' memory
    ROOT          engine/root.py          this node's root
    PEER_DISK     tiers/peer_disks.py     the peers' roots
    BUCKET        remote/tier.py          the object store (--remote)

The composition root (service.py) builds them, in that order, and hands them to the engine's
parts: `Loads` finds the step (`newest`, `locate`), the snapshot a load may read in place
(`snapshot`), which files each tier holds (`files`), and stages reads through the tier a file's
location names (`stage`); `Commit` tells every tier of a commit (`after_commit`); `Housekeeping`
unions what they keep from retention (`protected`), add to listings (`listing`) and report
(`status_fields`, `live`). A tier overrides what it takes part in; the defaults take no part.
The engine never imports a tier's module (tests/layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Protocol, Sequence

from ckptd.daemon.errors import NotFound, Unavailable
from ckptd.format.index import CheckpointIndex, FileRecord
from ckptd.daemon.metrics import LiveState
from ckptd.daemon.plan.load_plan import HeldSnapshot, TierName
from ckptd.format.file_plan import StagedRead
from ckptd.daemon.records import PeerInventory, StepSummary

Listing = list[tuple[StepSummary, str, bool]]  # (the step's summary, where, held in memory), commit order


class StepCopy(Protocol):
    """Where a load reads a committed step's index and extras."""

    async def index(self, job: str, step: int) -> CheckpointIndex:
        """The step's index (Precondition: damaged or unreadable)."""

    async def extras(self, job: str, step: int, record: FileRecord) -> dict[int, Any]:
        """Every rank's extras from the step's extra.json (`record`: its index entry, which its
        bytes must match; Precondition: missing, damaged or malformed)."""


@dataclass(frozen=True)
class Located:
    """A committed step a tier found; its index and small files are read from `copy` (None: this
    node's root, also where the bucket restores a step)."""

    step: int
    copy: StepCopy | None = None


class Snapshot(HeldSnapshot, Protocol):
    """A held snapshot a load reads in place (HELD): kept from reuse while leased."""

    def lease(self) -> None:
        """A load reads it from now on."""

    def release(self) -> None:
        """A load that leased it is done."""


@dataclass(frozen=True)
class StagingTarget:
    """Where a load's staged reads go: each data file's staging file (same offsets)."""

    paths: Mapping[str, str]  # data file -> its staging file in shared memory
    open: Callable[[str], int]  # (thread) a staging file opened for writing one range (StagingFiles.open)
    # (on the loop) a tier says that a read (its file, its offset) reached the staging file whole,
    # every byte checked against the step's checksums before it was written: the rank copies it
    # unchecked (StagingFiles.mark_checked). A tier that does not call it leaves the check to the rank.
    checked: Callable[[str, int], None] = lambda file, offset: None


@dataclass(frozen=True)
class Unstaged:
    """Reads a tier could not stage (a replica lost or damaged since the load was planned): the
    engine stages them from the disk of the node that wrote the files (`source`) instead."""

    source: int
    reads: tuple[StagedRead, ...]
    cause: Unavailable | NotFound


@dataclass(frozen=True)
class Committed:
    """A step committed here (Commit), or adopted after a restart (node 0 committed it before)."""

    job: str
    step: int
    index: CheckpointIndex
    shared_root: bool
    adopted: bool = False


class Tier:
    """One tier (see the module docstring). Every method's default takes no part."""

    name: TierName

    async def newest(self, job: str, found: Located | None) -> Located | None:
        """A load of the newest step: what this tier offers, given what the tiers before it found
        (`found`); None keeps `found`."""
        return None

    async def locate(self, job: str, step: int) -> Located | None:
        """A load of `step` that the tiers before did not find: whether this tier holds it."""
        return None

    def snapshot(self, job: str, step: int) -> Snapshot | None:
        """The step held whole in this daemon's memory, read in place by the ranks."""
        return None

    async def files(self, index: CheckpointIndex, inventories: Mapping[int, PeerInventory]) -> Mapping[int, Mapping[str, int]]:
        """The step's data files this tier can stage, by node: file name -> size (a holder counts
        only with the index's size). `inventories`: the peers' answers (empty when not asked)."""
        return {}

    def peers_holding(self, writers: Collection[int]) -> set[int]:
        """The other nodes this tier expects to hold files written by `writers` (their roots,
        their buddies' memory): the peers a load asks first, so that a replaced node of a large
        job does not ask every node (the engine asks the rest only when these lack a file)."""
        return set()

    async def stage(self, index: CheckpointIndex, reads: Sequence[StagedRead], target: StagingTarget) -> Sequence[Unstaged]:
        """Copy each read's bytes to the same offset of its staging file; returns what it could
        not stage and why (staged from the writer's disk instead). Raises when the bytes are
        nowhere to be had."""
        raise NotImplementedError(f"the {self.name} tier stages nothing")

    def after_commit(self, commit: Committed) -> None:
        """A step was committed here (on the event loop: start background work, never wait)."""

    def protected(self, job: str) -> set[int]:
        """Steps of `job` local retention must keep for this tier."""
        return set()

    async def listing(self, job: str, rows: Listing) -> Listing:
        """The job's steps as listed (`ckptd ls`, List), with this tier's added."""
        return rows

    def status_fields(self, job: str | None = None) -> dict[str, Any]:
        """What `ckptd status` shows of this tier (StatusSnapshot fields); of `job` alone when
        given (`ckptd status --job`: no other job's steps, uploads or errors)."""
        return {}

    def live(self, state: LiveState) -> LiveState:
        """The metrics' gauges, with this tier's."""
        return state


class Tiers:
    """The tiers of one daemon in TierName's order, by name."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.all = tuple(tiers)
        self.by_name = {t.name: t for t in tiers}
        assert len(self.by_name) == len(self.all), "one tier per name"

    def __getitem__(self, name: TierName) -> Tier:
        return self.by_name[name]

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.all)


async def locate(tiers: Sequence[Tier], job: str, step: int | None) -> Located | None:
    """The step to load (None: the newest) from the tiers, in order: for a given step the first
    tier that holds it; for the newest, each tier may offer one over what the tiers before it
    found (the bucket's, committed after the root's newest). None when no tier holds it."""
    found: Located | None = None
    for tier in tiers:
        if step is None:
            found = await tier.newest(job, found) or found
        else:
            found = await tier.locate(job, step)
            if found is not None:
                return found
    return found
