"""Save planning: from what every rank holds to who copies what where. Pure; no I/O.

Every rank of a job describes the fragments it holds (`TensorSpec`). The plan
- checks that the ranks agree on each logical tensor (kind, dtype, global shape, aliases)
  and that the distinct boxes of each tensor tile it exactly;
- removes replicas: a fragment held by several ranks (data parallelism) is copied by one
  of them only, chosen so that the bytes each rank copies are as even as possible;
- gives every copied fragment a slot in its rank's arena.

Plans are frozen and cached by the daemon under the ranks' fingerprints.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from ckptd.common import dtypes
from ckptd.common.boxes import Box, coverage_problems
from ckptd.common.names import KINDS, check_tensor_name

PAGE = 4096
SMALL_ALIGN = 64


class PlanError(ValueError):
    """The ranks' tensor metadata cannot form a checkpoint; the message names the tensors."""


@dataclass(frozen=True)
class TensorSpec:
    """One fragment a rank holds: the logical tensor it belongs to and the box it covers."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    aliases: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.box.numel * dtypes.itemsize(self.dtype)


@dataclass(frozen=True)
class LogicalTensor:
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return dtypes.nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class FragmentSlot:
    """A unique fragment, the rank that copies it, and where: `offset` bytes into that rank's arena."""

    name: str
    box: Box
    rank: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SavePlan:
    world_size: int
    tensors: tuple[LogicalTensor, ...]  # sorted by name
    slots: tuple[FragmentSlot, ...]  # sorted by (name, box)
    arena_bytes: tuple[int, ...]  # per rank; 0 = the rank copies nothing

    def slots_of(self, rank: int) -> tuple[FragmentSlot, ...]:
        return tuple(s for s in self.slots if s.rank == rank)

    def tensor(self, name: str) -> LogicalTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def align(offset: int, nbytes: int) -> int:
    """Slots of a page or more start on a page boundary (fast copies); small ones on 64 bytes."""
    step = PAGE if nbytes >= PAGE else SMALL_ALIGN
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


def make_save_plan(specs_by_rank: Sequence[Sequence[TensorSpec]]) -> SavePlan:
    """Plan a save of the fragments every rank holds (index = rank). Raises PlanError."""
    world_size = len(specs_by_rank)
    if world_size == 0:
        raise PlanError("a save needs at least one rank")
    logical: dict[str, LogicalTensor] = {}
    holders: dict[tuple[str, Box], list[int]] = defaultdict(list)
    for rank, specs in enumerate(specs_by_rank):
        seen: set[tuple[str, Box]] = set()
        for spec in specs:
            validate_spec(spec)
            if (spec.name, spec.box) in seen:
                raise PlanError(f"rank {rank} sends fragment {spec.box} of tensor {spec.name!r} twice")
            seen.add((spec.name, spec.box))
            described = LogicalTensor(spec.name, spec.kind, spec.dtype, tuple(spec.shape), tuple(spec.aliases))
            known = logical.setdefault(spec.name, described)
            if known != described:
                raise PlanError(
                    f"ranks disagree on tensor {spec.name!r}: {_describe(known)} vs {_describe(described)} "
                    f"(rank {rank}); every rank must describe the same global tensor"
                )
            holders[(spec.name, spec.box)].append(rank)
    _check_aliases(logical)
    _check_coverage(logical, holders)
    return _assign(world_size, logical, holders)


def _describe(t: LogicalTensor) -> str:
    aliases = f", aliases {list(t.aliases)}" if t.aliases else ""
    return f"{t.kind} {t.dtype}{list(t.shape)}{aliases}"


def _check_aliases(logical: dict[str, LogicalTensor]) -> None:
    for t in logical.values():
        for alias in t.aliases:
            if alias in logical:
                raise PlanError(f"{alias!r} is both a tensor and an alias of {t.name!r}; tied tensors are sent once")


def _check_coverage(logical: dict[str, LogicalTensor], holders: dict[tuple[str, Box], list[int]]) -> None:
    boxes: dict[str, list[Box]] = defaultdict(list)
    for name, box in holders:
        boxes[name].append(box)
    for name, tensor in logical.items():
        problems = coverage_problems(tensor.shape, boxes[name])
        if problems:
            raise PlanError(f"the ranks' fragments of {name!r} do not tile its shape {list(tensor.shape)} exactly: "
                            + "; ".join(problems[:3]))


def _assign(world_size: int, logical: dict[str, LogicalTensor], holders: dict[tuple[str, Box], list[int]]) -> SavePlan:
    """Greedy balance: the largest fragments first, each to the holder with the fewest bytes so far."""
    load = [0] * world_size
    chosen: dict[tuple[str, Box], int] = {}
    itemsizes = {name: dtypes.itemsize(t.dtype) for name, t in logical.items()}
    order = sorted(holders, key=lambda key: (-key[1].numel * itemsizes[key[0]], key))
    for key in order:
        rank = min(holders[key], key=lambda r: (load[r], r))
        chosen[key] = rank
        load[rank] += key[1].numel * itemsizes[key[0]]
    cursor = [0] * world_size
    slots = []
    for name, box in sorted(chosen):
        rank = chosen[(name, box)]
        nbytes = box.numel * itemsizes[name]
        offset = align(cursor[rank], nbytes)
        slots.append(FragmentSlot(name, box, rank, offset, nbytes))
        cursor[rank] = offset + nbytes
    arena_bytes = tuple(-(-c // PAGE) * PAGE for c in cursor)
    return SavePlan(world_size, tuple(logical[n] for n in sorted(logical)), tuple(slots), arena_bytes)
