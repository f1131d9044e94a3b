"""Save planning: from what every rank holds to which node writes what and who copies it where.
Pure; no I/O.

Every rank of a job describes the fragments it holds (`TensorSpec`); ranks live on nodes
(one daemon each). The plan
- checks that the ranks agree on each logical tensor (kind, dtype, global shape, aliases)
  and that the distinct boxes of each tensor tile it exactly;
- gives every logical tensor to the nodes that write it, spreading bytes evenly over nodes:
  a tensor that some node holds entirely is written whole by one such node (so model files
  stay loadable by Hugging Face); a tensor no node holds entirely (sharded across nodes) is
  written as fragments, each by a node that holds it;
- removes replicas inside a node: a fragment held by several of its ranks (data parallelism)
  is copied by one of them only, chosen so that the bytes each rank copies are as even as
  possible, and gets a slot in that rank's arena. A rank's own extras tensor (`per_rank`) is
  never a replica: its name carries its rank (`names.per_rank_name`), and it is recorded as that
  rank's (`LogicalTensor.rank`, the index's `rank`).

Every node computes the same plan from the same input (the coordinator sends the metadata
of every rank), so only the input travels. Plans are frozen; the daemon caches them per job
under the digests of the metadata they were made from (`spec_digest`: derived by the daemon
from what the ranks sent, never a key a client chose).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

from ckptd.common import dtypes
from ckptd.common.boxes import Box, coverage_problems
from ckptd.common.names import KINDS, RESERVED_FILE_KEY, check_tensor_name, shared_name
from ckptd.format.index import GROUP_OF_KIND, SCALES_SUFFIX, file_key

PAGE = 4096
SMALL_ALIGN = 64
# Slots of this size or more start on a page, smaller ones on 64 bytes (enough for the copies'
# vector stores): padding costs less than 64 bytes per small slot, and 0.4% of a large one.
# Page-aligning every slot of a page or more cost 0.7% of a state of 1,000 tensors of 256 KiB,
# and up to half of one of tensors a little over 4 KiB (issue 30 finding 5).
PAGE_ALIGN_FROM = 2**20


class PlanError(ValueError):
    """The ranks' tensor metadata cannot form a checkpoint; the message names the tensors."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One fragment a rank holds: the logical tensor it belongs to and the box it covers."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    aliases: tuple[str, ...] = ()
    frozen: str = ""  # "" | "param" | "buffer": what the trainer does not train (ckptd.common.names.FROZEN_CLASSES)
    per_rank: bool = False  # the sending rank's own extras tensor, under its per-rank name (TensorMeta.per_rank)

    @property
    def nbytes(self) -> int:
        return self.box.numel * dtypes.itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()
    frozen: str = ""  # TensorSpec.frozen: frozen tensors are stored in files of their own (format.layout_files)
    rank: int | None = None  # a rank's own extras tensor (TensorSpec.per_rank): that rank

    @property
    def nbytes(self) -> int:
        return dtypes.nbytes(self.dtype, self.shape)


@dataclass(frozen=True, slots=True)
class FragmentSlot:
    """A unique fragment, the rank that copies it, and where: `offset` bytes into that rank's arena."""

    name: str
    box: Box
    rank: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class StoredPart:
    """What `node` writes of a logical tensor: all of it (`whole`) or the fragment `box`."""

    name: str
    box: Box
    node: int
    whole: bool


@dataclass(frozen=True)
class SavePlan:
    world_size: int
    tensors: tuple[LogicalTensor, ...]  # sorted by name
    slots: tuple[FragmentSlot, ...]  # sorted by (name, box)
    arena_bytes: tuple[int, ...]  # per rank; 0 = the rank copies nothing
    parts: tuple[StoredPart, ...] = ()  # sorted by (name, box)
    node_of_rank: tuple[int, ...] = ()  # empty: every rank on node 0

    def slots_of(self, rank: int) -> tuple[FragmentSlot, ...]:
        return self._slots_by_rank.get(rank, ())

    def slots_named(self, name: str) -> tuple[FragmentSlot, ...]:
        """The slots of logical tensor `name` (every rank's), in (name, box) order."""
        return self._slots_by_name.get(name, ())

    def layout_id(self, rank: int) -> str:
        """A digest of `slots_of(rank)` (names, boxes, offsets, sizes, and each slot's tensor:
        kind, dtype, shape, aliases): equal ids mean a rank copies the same fragments of the same
        tensors to the same arena offsets, so it may reuse what it derived (and checked) from an
        earlier answer with that id (ckptd.client: BeginSaveRequest.known_layout)."""
        found = self._layout_ids.get(rank)
        if found is None:
            h = hashlib.sha256()
            for s in self.slots_of(rank):
                t = self.tensor(s.name)
                h.update(repr((s.name, s.box.offsets, s.box.lengths, s.offset, s.nbytes, t.kind, t.dtype, t.shape, t.aliases)).encode())
            found = self._layout_ids[rank] = h.hexdigest()[:32]
        return found

    @functools.cached_property
    def layout_summary(self) -> dict[str, Any]:
        """What environment.json says of the layout: world size, ranks per node and, per kind, the
        tensors, the sharded ones, fragments and bytes. Worked out once per plan (a walk of every
        slot and tensor, about 5 ms at 4,000 tensors, at every commit before); read-only."""
        ranks_of_node = Counter(self.node_of_rank or (0,) * self.world_size)
        ranks_per_node = [ranks_of_node[n] for n in sorted(ranks_of_node)]
        boxes: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}  # (offsets, lengths): tuples hash in C, a Box does not
        for slot in self.slots:
            boxes.setdefault(slot.name, set()).add((slot.box.offsets, slot.box.lengths))
        kinds: dict[str, dict[str, int]] = {}
        for t in self.tensors:
            counts = kinds.setdefault(t.kind, {"tensors": 0, "sharded": 0, "fragments": 0, "bytes": 0})
            counts["tensors"] += 1
            counts["sharded"] += len(boxes.get(t.name, ())) > 1
            counts["fragments"] += len(boxes.get(t.name, ()))
            counts["bytes"] += t.nbytes
        return {"world_size": self.world_size, "nodes": len(ranks_per_node), "ranks_per_node": ranks_per_node, "kinds": kinds}

    @functools.cached_property
    def _slots_by_rank(self) -> dict[int, tuple[FragmentSlot, ...]]:
        by_rank: dict[int, list[FragmentSlot]] = defaultdict(list)
        for s in self.slots:
            by_rank[s.rank].append(s)
        return {r: tuple(slots) for r, slots in by_rank.items()}

    @functools.cached_property
    def _slots_by_name(self) -> dict[str, tuple[FragmentSlot, ...]]:
        by_name: dict[str, list[FragmentSlot]] = defaultdict(list)
        for s in self.slots:
            by_name[s.name].append(s)
        return {n: tuple(slots) for n, slots in by_name.items()}

    @functools.cached_property
    def _layout_ids(self) -> dict[int, str]:
        return {}

    def node(self, rank: int) -> int:
        return self.node_of_rank[rank] if self.node_of_rank else 0

    def arena_bytes_of(self, node: int) -> tuple[int, ...]:
        """arena_bytes with 0 for the ranks of other nodes (their arenas live there)."""
        return tuple(n if self.node(r) == node else 0 for r, n in enumerate(self.arena_bytes))

    def node_bytes(self, node: int) -> int:
        """Bytes of tensor data `node` writes."""
        return sum(s.nbytes for s in self.slots if self.node(s.rank) == node)

    def tensor(self, name: str) -> LogicalTensor:
        return self._tensors_by_name[name]

    @functools.cached_property
    def _tensors_by_name(self) -> dict[str, LogicalTensor]:
        return {t.name: t for t in self.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def spec_digest(specs: Sequence[TensorSpec]) -> str:
    """A digest of one rank's tensor metadata: every field of every spec, in order. The daemon's
    own key for that metadata (its caches of metadata and plans are keyed by it, per job), so a
    client's fingerprint is only a name for metadata the same rank of the same job sent before,
    and two requests share a plan only when they describe the same tensors. Every field, by
    TensorSpec's own field list: a field added later is covered without touching this."""
    names = [f.name for f in fields(TensorSpec)]
    described = [tuple(getattr(s, name) for name in names) for s in specs]
    return hashlib.sha256(repr(described).encode()).hexdigest()


def align(offset: int, nbytes: int) -> int:
    """Slots of PAGE_ALIGN_FROM bytes or more start on a page boundary; others on 64 bytes."""
    step = PAGE if nbytes >= PAGE_ALIGN_FROM else SMALL_ALIGN
    return -(-offset // step) * step


def validate_spec(spec: TensorSpec) -> None:
    """Raise PlanError if one fragment description is malformed."""
    try:
        check_tensor_name(spec.name)
        for alias in spec.aliases:
            check_tensor_name(alias)
        dtypes.itemsize(spec.dtype)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if spec.kind not in KINDS:
        raise PlanError(f"tensor {spec.name!r}: kind {spec.kind!r} is not one of {', '.join(KINDS)}")
    if any(d < 0 for d in spec.shape):
        raise PlanError(f"tensor {spec.name!r}: negative dimension in shape {list(spec.shape)}")
    if not spec.box.fits_in(spec.shape):
        raise PlanError(f"tensor {spec.name!r}: box {spec.box} does not lie inside shape {list(spec.shape)}")


def make_save_plan(specs_by_rank: Sequence[Sequence[TensorSpec]], node_of_rank: Sequence[int] | None = None) -> SavePlan:
    """Plan a save of the fragments every rank holds (index = rank). Raises PlanError.

    `node_of_rank[r]`: the node of rank r (default: every rank on node 0).

    Ranks given the same sequence object (data-parallel replicas: the coordinator keeps one
    object per metadata digest) are one layout: their metadata is checked and described once,
    and each fragment's holders are layouts, not ranks, so the work grows with the distinct
    layouts and the nodes, not with nodes x ranks. Equal but separate sequences give the same
    plan, only planned rank by rank.
    """
    world_size = len(specs_by_rank)
    if world_size == 0:
        raise PlanError("a save needs at least one rank")
    nodes = tuple(node_of_rank) if node_of_rank is not None else (0,) * world_size
    if len(nodes) != world_size or min(nodes, default=0) < 0:
        raise PlanError(f"node_of_rank {list(nodes)} does not give a node >= 0 for each of the {world_size} ranks")
    layouts = _layouts(specs_by_rank)
    logical: dict[str, LogicalTensor] = {}
    holders: dict[tuple[str, Box], list[int]] = defaultdict(list)  # a fragment -> the layouts holding it
    for rank in _describing_ranks(specs_by_rank, layouts):
        layout = layouts.of_first.get(rank)
        if layout is None:  # a later rank of a layout with ranks' own tensors: only those depend on the rank
            for spec in specs_by_rank[rank]:
                if spec.per_rank:
                    _describe_spec(logical, spec, rank)
            continue
        seen: set[tuple[str, Box]] = set()
        for spec in specs_by_rank[rank]:
            validate_spec(spec)
            if (spec.name, spec.box) in seen:
                raise PlanError(f"rank {rank} sends fragment {spec.box} of tensor {spec.name!r} twice")
            seen.add((spec.name, spec.box))
            _describe_spec(logical, spec, rank)
            holders[(spec.name, spec.box)].append(layout)
    _check_aliases(logical)
    _check_file_keys(logical)
    _check_coverage(logical, holders)
    return _assign(logical, holders, layouts, nodes)


@dataclass
class _Layouts:
    """The distinct metadata sequences of a save (by identity), in the order of their first rank."""

    ranks: list[list[int]]  # layout -> its ranks, ascending
    of_first: dict[int, int]  # a layout's first rank -> the layout


def _layouts(specs_by_rank: Sequence[Sequence[TensorSpec]]) -> _Layouts:
    index: dict[int, int] = {}  # id of a rank's sequence -> its layout (the sequences outlive the call)
    ranks: list[list[int]] = []
    for rank, specs in enumerate(specs_by_rank):
        layout = index.setdefault(id(specs), len(ranks))
        if layout == len(ranks):
            ranks.append([rank])
        else:
            ranks[layout].append(rank)
    return _Layouts(ranks, {r[0]: layout for layout, r in enumerate(ranks)})


def _describing_ranks(specs_by_rank: Sequence[Sequence[TensorSpec]], layouts: _Layouts) -> list[int]:
    """The ranks whose metadata is read, ascending (the order of the checks, so that the first
    problem found is the lowest rank's): each layout's first rank, and every rank of a layout
    that holds ranks' own tensors (`per_rank`: named for one rank, so such a layout shared by
    several ranks is refused at its second)."""
    owning = [ranks for ranks in layouts.ranks if len(ranks) > 1 and any(s.per_rank for s in specs_by_rank[ranks[0]])]
    return sorted(set(layouts.of_first).union(*owning))


def _describe_spec(logical: dict[str, LogicalTensor], spec: TensorSpec, rank: int) -> None:
    """Add what `rank` says of `spec`'s logical tensor to `logical`; PlanError when it is not
    the rank's own tensor that it says it is, or when ranks disagree on the tensor."""
    if spec.per_rank and shared_name(spec.name, rank) is None:
        raise PlanError(f"rank {rank} sends {spec.name!r} as its own tensor, but the name does not carry rank{rank} after its state key")
    owner = rank if spec.per_rank else None
    described = LogicalTensor(spec.name, spec.kind, spec.dtype, tuple(spec.shape), tuple(spec.aliases), spec.frozen, owner)
    known = logical.setdefault(spec.name, described)
    if known != described and replace(known, frozen=described.frozen) == described:
        logical[spec.name] = replace(known, frozen="")  # ranks disagree whether it trains: stored as trained
    elif known != described:
        raise PlanError(
            f"ranks disagree on tensor {spec.name!r}: {_describe(known)} vs {_describe(described)} "
            f"(rank {rank}); every rank must describe the same global tensor"
        )


def _describe(t: LogicalTensor) -> str:
    aliases = f", aliases {list(t.aliases)}" if t.aliases else ""
    own = f", rank {t.rank}'s own" if t.rank is not None else ""
    return f"{t.kind} {t.dtype}{list(t.shape)}{aliases}{own}"


def _check_aliases(logical: dict[str, LogicalTensor]) -> None:
    for t in logical.values():
        for alias in t.aliases:
            if alias in logical:
                raise PlanError(f"{alias!r} is both a tensor and an alias of {t.name!r}; tied tensors are sent once")


_DERIVED_SUFFIX = re.compile(rf"@(?:{re.escape(SCALES_SUFFIX[1:])}|\d+(?:,\d+)*)")


def _check_file_keys(logical: dict[str, LogicalTensor]) -> None:
    """Refuse tensors whose safetensors keys (format.file_key) would clash in the files of one
    group: the key safetensors reserves, two tensors under one key (model files drop the first
    "/"-part of a name: "model/w" and "ema/w" are both "w"), or a key that is another tensor's
    key with the suffix of its scales or of one of its fragments ("w@scales", "w@0,0")."""
    owner: dict[tuple[str, str], str] = {}
    for t in logical.values():
        key = file_key(t.name, t.kind)
        if key == RESERVED_FILE_KEY:
            raise PlanError(f"tensor {t.name!r} would be stored under the safetensors key {key!r}, which safetensors reserves; rename it")
        slot = (GROUP_OF_KIND[t.kind], key)
        other = owner.setdefault(slot, t.name)
        if other != t.name:
            raise PlanError(
                f"tensors {other!r} and {t.name!r} would both be stored under the safetensors key {key!r} in the "
                f"{slot[0]} files; rename one of them"
            )
    for (group, key), name in owner.items():
        base, at, _ = key.rpartition("@")
        if at and _DERIVED_SUFFIX.fullmatch(key[len(base):]) and (group, base) in owner:
            raise PlanError(
                f"tensor {name!r} is stored under the safetensors key {key!r}, which ckptd uses for a part of tensor "
                f"{owner[(group, base)]!r} (its scales or a fragment); rename one of them"
            )


def _check_coverage(logical: dict[str, LogicalTensor], holders: dict[tuple[str, Box], list[int]]) -> None:
    boxes: dict[str, list[Box]] = defaultdict(list)
    for name, box in holders:
        boxes[name].append(box)
    for name, tensor in logical.items():
        problems = coverage_problems(tensor.shape, boxes[name])
        if problems:
            raise PlanError(f"the ranks' fragments of {name!r} do not tile its shape {list(tensor.shape)} exactly: "
                            + "; ".join(problems[:3]))


class _LeastLoaded:
    """The least loaded of a fixed set of nodes, by (load, node), under loads that only grow: a
    heap of one (load, node) entry per node whose load may be stale (lower than the node's),
    refreshed when it reaches the top. A top entry that is current is the minimum: every other
    entry is at most its node's load."""

    def __init__(self, candidates: frozenset[int], load: dict[int, int]) -> None:
        self._heap = [(load[n], n) for n in candidates]
        heapq.heapify(self._heap)

    def pick(self, load: dict[int, int]) -> int:
        while True:
            known, node = self._heap[0]
            if known == load[node]:
                return node
            heapq.heapreplace(self._heap, (load[node], node))


def _ranks_by_node(ranks: list[int], nodes: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """A layout's ranks (ascending) by node."""
    at = list(map(nodes.__getitem__, ranks))
    if len(set(at)) == len(at):  # one rank of the layout per node (data parallelism across nodes)
        return dict(zip(at, zip(ranks)))
    by_node: dict[int, list[int]] = defaultdict(list)
    for node, rank in zip(at, ranks):
        by_node[node].append(rank)
    return {node: tuple(held) for node, held in by_node.items()}


def _assign(logical: dict[str, LogicalTensor], holders: dict[tuple[str, Box], list[int]], layouts: _Layouts, nodes: tuple[int, ...]) -> SavePlan:
    """Greedy balance, largest first: tensors (or fragments) to the least loaded node that holds
    them, then each fragment to the least loaded of that node's ranks that hold it.

    `holders`: each fragment's layouts. The nodes that may write a tensor depend only on which
    layouts hold its fragments, so each distinct set of candidates is made once and keeps a heap
    of its nodes (`_LeastLoaded`): a pick costs O(log nodes), not a scan of the nodes."""
    itemsizes = {name: dtypes.itemsize(t.dtype) for name, t in logical.items()}
    boxes: dict[str, list[Box]] = defaultdict(list)
    for name, box in holders:
        boxes[name].append(box)
    ranks_on = [_ranks_by_node(ranks, nodes) for ranks in layouts.ranks]  # layout -> node -> its ranks there
    nodes_of = [frozenset(on) for on in ranks_on]

    holding: dict[tuple[int, ...], frozenset[int]] = {}  # layouts -> the nodes holding a fragment they hold
    everywhere: dict[tuple[tuple[int, ...], ...], frozenset[int]] = {}  # each box's layouts -> the nodes holding every box
    pickers: dict[frozenset[int], _LeastLoaded] = {}
    node_load: dict[int, int] = defaultdict(int)

    def nodes_holding(layouts_holding: tuple[int, ...]) -> frozenset[int]:
        found = holding.get(layouts_holding)
        if found is None:
            found = holding[layouts_holding] = frozenset().union(*(nodes_of[g] for g in layouts_holding))
        return found

    def least_loaded(candidates: frozenset[int]) -> int:
        picker = pickers.get(candidates)
        if picker is None:
            picker = pickers[candidates] = _LeastLoaded(candidates, node_load)
        return picker.pick(node_load)

    parts: list[StoredPart] = []
    for name in sorted(logical, key=lambda n: (-logical[n].nbytes, n)):
        tensor_boxes = sorted(boxes[name])
        key = tuple(tuple(holders[(name, b)]) for b in tensor_boxes)
        common = everywhere.get(key)
        if common is None:
            common = everywhere[key] = frozenset.intersection(*(nodes_holding(k) for k in key))
        if common:
            node = least_loaded(common)
            parts += [StoredPart(name, b, node, True) for b in tensor_boxes]
            node_load[node] += logical[name].nbytes
            continue
        for box in sorted(tensor_boxes, key=lambda b: (-b.numel, b)):
            node = least_loaded(nodes_holding(tuple(holders[(name, box)])))
            parts.append(StoredPart(name, box, node, False))
            node_load[node] += box.numel * itemsizes[name]

    rank_load = [0] * len(nodes)
    chosen: dict[tuple[str, Box], int] = {}
    for part in sorted(parts, key=lambda p: (-p.box.numel * itemsizes[p.name], p.name, p.box)):
        candidates = [r for g in holders[(part.name, part.box)] for r in ranks_on[g].get(part.node, ())]
        rank = min(candidates, key=lambda r: (rank_load[r], r))
        chosen[(part.name, part.box)] = rank
        rank_load[rank] += part.box.numel * itemsizes[part.name]
    return _laid_out(logical, parts, chosen, itemsizes, nodes)


def _laid_out(
    logical: dict[str, LogicalTensor], parts: list[StoredPart], chosen: dict[tuple[str, Box], int], itemsizes: dict[str, int], nodes: tuple[int, ...],
) -> SavePlan:
    """The plan of fragments given to ranks (`chosen`): each rank's slots laid out in its arena
    in (name, box) order, aligned (`align`), each arena rounded up to a page."""
    cursor = [0] * len(nodes)
    slots = []
    for name, box in sorted(chosen):
        rank = chosen[(name, box)]
        nbytes = box.numel * itemsizes[name]
        offset = align(cursor[rank], nbytes)
        slots.append(FragmentSlot(name, box, rank, offset, nbytes))
        cursor[rank] = offset + nbytes
    arena_bytes = tuple(-(-c // PAGE) * PAGE for c in cursor)
    return SavePlan(
        world_size=len(nodes),
        tensors=tuple(logical[n] for n in sorted(logical)),
        slots=tuple(slots),
        arena_bytes=arena_bytes,
        parts=tuple(sorted(parts, key=lambda p: (p.name, p.box))),
        node_of_rank=nodes,
    )
