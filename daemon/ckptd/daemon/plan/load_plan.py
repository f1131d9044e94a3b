"""Where each requested tensor box's bytes come from: the load planner. Pure: no I/O, no awaits.

The tiers (`TierName`, the one vocabulary of code, metrics, logs and docs), tried in this order
for each tensor:

    held          the snapshot this daemon still holds in shared memory (the newest committed
                  step), seen through `HeldSnapshot` (tiers/held.py); lossless tensors only
    replica-here  a replica of another node's part that this daemon holds in memory
    replica-peer  a replica of the file's node's part in a peer daemon's memory
    root          the step's files in this node's root, read by the rank itself, or staged: copied
                  into shared memory first when the rank cannot read them (no access to the root,
                  a backend without local files)
    peer-disk     a file another node wrote (own roots): fetched into shared memory first
    bucket        the object store: never a file's source; a step only it holds is restored into
                  the root before the load is planned

`file_sources` picks each file's tier and node, `file_locations` where the rank reads it;
`plan_pieces` lists the pieces per tensor: the held snapshot's (`HeldSnapshot`; `MemoryPlans`
keeps them for a repeated request), else the files' through the load planner's file part, which
needs nothing of the daemon but the index and is shared with the offline reader
(ckptd.format.file_plan: the pieces, the staged reads, whose extras a rank gets). The engine
(engine/loads.py) asks the tiers what they hold before, and has them perform the staged reads
after. Replicas (memory tiers of files) are always staged into shared memory by the loading daemon. Quantized tensors always load as stored (codes and
scales), from any tier but the held snapshot.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Collection, Mapping, Protocol, Sequence

from ckptd.common.boxes import intersect
from ckptd.common.quant_options import CAST
from ckptd.daemon.errors import InvalidRequest
from ckptd.daemon.plan.save_plan import TensorSpec
from ckptd.format import file_plan
from ckptd.format.file_plan import SHM_SOURCE, LoadMismatch, PieceInfo, PlannedPieces, names_text
from ckptd.format.index import CheckpointIndex, FileRecord, TensorRecord

class TierName(StrEnum):
    """Where a step's bytes are held. The values are the `tier` label of
    ckptd_load_staged_bytes_total (a contract for dashboards); the wire names a piece's source
    "shm" (HELD) or "file" (every other tier), and a load "memory", "disk" or "mixed" (load_tier).
    docs/architecture.md §9 names them the same way."""

    HELD = "held"  # this daemon's arenas: the newest committed snapshot (tier 0)
    REPLICA_HERE = "memory-local"  # a replica of another node's part in this daemon's memory (tier 0b)
    REPLICA_PEER = "memory-peer"  # a replica in a peer daemon's memory (tier 0b)
    ROOT = "disk-local"  # this node's root (tier 1)
    PEER_DISK = "disk-peer"  # another node's root
    BUCKET = "object-store"  # the object store, --remote (tier 2)


@dataclass(frozen=True)
class LoadPlan:
    load_id: str
    step: int
    pieces: tuple[PieceInfo, ...]
    extras: Any
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    tier: str  # "memory" | "disk" | "mixed" (the wire's and the metrics' label)
    generation: int = 0
    plan_id: str = ""  # memory tier: a digest of `pieces` (see MemoryPlans)
    extras_json: str = ""  # `extras` as JSON text, when the engine has it already ("": encode `extras`)


@dataclass(frozen=True)
class Location:
    """Where the rank reads one data file of the step."""

    tier: TierName
    node: int  # the node whose root (or memory, for a replica) has the file
    path: str  # what the rank opens: the file itself, or its staging copy in shared memory
    staged: bool  # the daemon copies the needed ranges to `path` first


class HeldSnapshot(Protocol):
    """A committed step still held in this daemon's shared memory, as the planner and MemoryPlans
    read it (tiers/held.py implements it over an arena set)."""

    @property
    def key(self) -> int:
        """Equal for views of the same held snapshot."""

    @property
    def layout(self) -> object:
        """The save plan that laid it out (MemoryPlans reuses pieces while it is the same)."""

    @property
    def extras(self) -> Mapping[int, Any] | None:
        """The extras of this node's ranks, by rank (None: not kept)."""

    def current(self, step: int) -> bool:
        """Whether it still holds `step`."""

    def pieces(self, spec: TensorSpec, record: TensorRecord) -> list[PieceInfo] | None:
        """The pieces of `spec`'s box (SHM_SOURCE), or None when some overlapping fragment is not
        in this node's arenas (a rank of another node copied it)."""


FILE_TIER_ORDER = (TierName.REPLICA_HERE, TierName.REPLICA_PEER, TierName.ROOT, TierName.PEER_DISK)


def file_sources(
    files: Sequence[FileRecord], node: int, disk: Mapping[int, Mapping[str, int]], memory: Mapping[int, Mapping[str, int]]
) -> tuple[dict[str, tuple[TierName, int]], list[FileRecord]]:
    """Where to read each data file from: (tier, node) by FILE_TIER_ORDER (this node's memory, a
    peer's memory, this node's disk, a peer's disk), the lowest node first among peers of one
    tier. disk / memory: node -> file name -> size it holds (memory: replicas of other nodes'
    parts); a holder counts only with the size the index gives. Returns the choice per file and
    the files that no node holds."""
    chosen: dict[str, tuple[TierName, int]] = {}
    missing = []
    peers = sorted((set(disk) | set(memory)) - {node})
    holders = {
        TierName.REPLICA_HERE: ([node], memory), TierName.REPLICA_PEER: (peers, memory), TierName.ROOT: ([node], disk), TierName.PEER_DISK: (peers, disk)
    }
    for f in files:
        found = next(((tier, n) for tier in FILE_TIER_ORDER for n in holders[tier][0] if holders[tier][1].get(n, {}).get(f.name) == f.size), None)
        if found is None:
            missing.append(f)
        else:
            chosen[f.name] = found
    return chosen, missing


def file_locations(
    files: Sequence[FileRecord],
    node: int,
    where: Mapping[str, int],
    local_path: Callable[[str], str | None],
    staging_path: Callable[[str], str],
    tiers: Mapping[str, TierName] | None = None,
) -> dict[str, Location]:
    """Each data file's location. where: file -> the node that has it (absent: this one);
    tiers: file -> its tier when it is a replica in memory (file_sources; absent: on disk), read
    from the node in `where` and always staged; local_path: the path by which the rank reads a
    file of this node's storage itself, None when it cannot (a rank without access to the root,
    a backend without local files): the file is then staged."""
    out = {}
    for f in files:
        holder = where.get(f.name, node)
        tier = (tiers or {}).get(f.name)
        path = local_path(f.name) if holder == node and tier is None else None
        if tier in (TierName.REPLICA_HERE, TierName.REPLICA_PEER):
            out[f.name] = Location(tier, holder, staging_path(f.name), True)
        elif holder != node:
            out[f.name] = Location(TierName.PEER_DISK, holder, staging_path(f.name), True)
        elif path is None:
            out[f.name] = Location(TierName.ROOT, node, staging_path(f.name), True)
        else:
            out[f.name] = Location(TierName.ROOT, node, path, False)
    return out


@dataclass(frozen=True)
class BroadcastRoutes:
    """Load broadcast (docs/architecture.md §13): how a load reads each needed data file once per
    job. fetch: file -> its writer, from which this node fetches it (a shared root: the file is
    here too, so a failed fetch reads it here); read_once: this node's own files, read once into
    memory for its ranks and the peers that fetch them."""

    fetch: Mapping[str, int]
    read_once: frozenset[str]


NO_ROUTES = BroadcastRoutes({}, frozenset())


def broadcast_routes(
    files: Sequence[FileRecord], node: int, nodes: int, where: Mapping[str, int], needed: Collection[str], avoid: Collection[int] = ()
) -> BroadcastRoutes:
    """The broadcast routes of a load that needs the data files `needed`, read from the nodes in
    `where` (file -> node; absent: this one; replicas in memory excluded by the caller). A file
    of this root written by another node of the job (0 <= writer < nodes, not in `avoid`: a
    writer that failed a fetch lately) is fetched from its writer. Sharing is in play when the
    load reads some file from another node (the data-parallel replicas of a layout need one
    another's files); then this node's own needed files are read once for all, else nothing
    changes (each node reads only its own files: a relay would add a hop and save no read)."""
    fetch = {
        f.name: f.node for f in files
        if f.name in needed and where.get(f.name, node) == node and f.node != node and 0 <= f.node < nodes and f.node not in avoid
    }
    shared = bool(fetch) or any(where.get(name, node) != node for name in needed)
    if not shared:
        return NO_ROUTES
    return BroadcastRoutes(fetch, frozenset(f.name for f in files if f.name in needed and f.node == node and where.get(f.name, node) == node))


def plan_pieces(
    index: CheckpointIndex,
    wanted: Sequence[TensorSpec],
    kinds: Sequence[str],
    strict: bool,
    held: HeldSnapshot | None,
    locations: Mapping[str, Location],
    rank: int = 0,
) -> PlannedPieces:
    """file_plan.plan_pieces, with the held snapshot's pieces for each lossless tensor it holds
    wholly on this node. Raises InvalidRequest where the state being loaded does not match the
    step (file_plan.LoadMismatch: a shape, or under `strict` missing or unexpected names)."""
    try:
        return file_plan.plan_pieces(index, wanted, kinds, strict, locations, rank, held.pieces if held is not None else None)
    except LoadMismatch as exc:
        raise InvalidRequest(str(exc)) from None


def load_tier(pieces: Sequence[PieceInfo], held: HeldSnapshot | None) -> str:
    """The load's label (the wire's LoadPlan.tier and the metrics' ckptd_loads_total{tier}, a
    contract): "memory" (all from the HELD tier), "disk" (none) or "mixed"."""
    sources = {p.source for p in pieces}
    if sources == {SHM_SOURCE} or (held is not None and not pieces):
        return "memory"
    return "disk" if SHM_SOURCE not in sources else "mixed"


def needs_decoding(index: CheckpointIndex, wanted: Sequence[TensorSpec]) -> tuple[bool, bool]:
    """Whether the pieces of `wanted` include quantized codes or residuals (which a load always
    reads as stored, whatever the tier), and whether some of those codes are in zstd frames.
    "cast" fragments (a dropped master weight: the model weight's bytes) need no decoding."""
    table = index.by_name()
    coded = [
        f.quant for spec in wanted if spec.name in table for f in table[spec.name].fragments
        if f.quant is not None and f.quant.codec != CAST and intersect(f.box, spec.box) is not None
    ]
    return bool(coded), any(q.frames is not None for q in coded)


def incomplete_message(index: CheckpointIndex, missing: Sequence[FileRecord], unreachable: Mapping[int, str], describe: Callable[[int], str]) -> str:
    """Why a step cannot be loaded from the nodes present: which files and tensors are where."""
    lost = {f.name for f in missing}
    tensors = sorted({t.name for t in index.tensors for frag in t.fragments if frag.file in lost})
    writers = sorted({f.node for f in missing})
    parts = [
        f"step {index.step} of job {index.job!r} is not complete on the nodes present: "
        f"{len(missing)} files ({names_text([f.name for f in missing], 5)}) with tensors {names_text(tensors, 10)} were written by "
        + ", ".join(describe(n) for n in writers)
    ]
    for node, why in sorted(unreachable.items()):
        parts.append(f"{describe(node)} did not answer ({why})")
    parts.append("start the missing nodes' daemons on their storage, or load an older step")
    return "; ".join(parts)


def plan_digest(pieces: Sequence[PieceInfo]) -> str:
    h = hashlib.sha256()
    for p in pieces:
        h.update(f"{p.name}|{p.path}|{p.offset}|{p.nbytes}|{p.fragment.offsets}|{p.fragment.lengths}|{p.dtype}\n".encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True, eq=False)
class MemoryPlan:
    """Pieces of a load served wholly from a held snapshot, for the same request again."""

    held: HeldSnapshot
    layout: object  # the held snapshot's layout (HeldSnapshot.layout) when these pieces were derived
    wanted: Sequence[TensorSpec]
    pieces: tuple[PieceInfo, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    plan_id: str


class MemoryPlans:
    """HELD-tier load plans by (job, rank, options, held snapshot key): a rank that loads the same
    tensors (the very specs object its fingerprint resolved to) from an arena set laid out by the
    same save plan again gets the same pieces (they name arena paths and offsets, not steps)
    without their per-tensor derivation. Keeps the last `keep` plans."""

    def __init__(self, keep: int = 32) -> None:
        self._keep = keep
        self._plans: dict[tuple[Any, ...], MemoryPlan] = {}

    def get(self, key: tuple[Any, ...], held: HeldSnapshot | None, wanted: Sequence[TensorSpec], step: int) -> MemoryPlan | None:
        plan = self._plans.get(key)
        if plan is None or held is None or plan.held.key != held.key or plan.wanted is not wanted or plan.layout is not held.layout:
            return None
        return plan if held.current(step) else None

    def put(self, key: tuple[Any, ...], plan: MemoryPlan) -> None:
        self._plans.pop(key, None)
        self._plans[key] = plan
        while len(self._plans) > self._keep:
            del self._plans[next(iter(self._plans))]
