"""Few, large copies of a rank's device tensors into a flat byte buffer (docs/architecture.md section 6).

A GPU hand-off copies every CUDA tensor of a rank into its slot of a flat destination: the
rank's arena (pinned host memory, modes "copy" and "overlap") or its device staging buffer
(mode "ipc"). One copy per tensor would queue hundreds of small operations on the copy stream
(a CUDA stream holds about 1000 pending operations before the host blocks, and each small
device-to-host copy costs its launch and latency). So the copies are planned first:

- `Run`: a tensor of at least `small_bytes`, or several that lie back to back both in their
  storage and in the destination (flat parameters, a contiguous parameter buffer), copied by one
  `copy_` of their bytes;
- `Gather`: consecutive small tensors, packed by one `torch._foreach_copy_` into a device bounce
  buffer laid out exactly like their span of the destination, which then goes over in one copy
  (into a device destination the pack goes straight in, no bounce).

One asynchronous copy may never span two host-memory registrations (CUDA refuses it with
`invalid argument`). Arenas are registered whole, in one call (ckptd.common.cudart.register_host),
so no run ever crosses one; should a destination ever be registered in pieces, pass the piece
boundaries to `plan_copies` and no run or gather crosses them (a run that would is split).

`plan_copies` is pure (tested with tables). `bind_copies` makes the views each copy reads and
writes, once (ckptd.client.cuda_copier caches them from save to save); `issue_copies` queues the torch
operations on whatever stream is current, one per run and one pack per gather, never one per
tensor. Both are device-agnostic, so they run on CPU tensors in the tests too. Nothing here
waits for a copy: the caller records an event (see ckptd.client.cuda_copier).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

SMALL_BYTES = 1 << 20  # tensors below this size are gathered
MAX_GATHER_BYTES = 64 << 20  # the largest span one gather covers (the bounce buffer's size)


@dataclass(frozen=True)
class Item:
    """One tensor to place: `nbytes` bytes at `offset` of the destination.

    device: the group it is copied in (e.g. "cuda:0"), or None when it is copied by other means
    (a CPU tensor: the CPU path); a gather never spans over such an item, whose bytes it would
    overwrite. source: (storage id, byte offset in that storage) when the tensor's bytes are
    contiguous in its storage, else None (it is copied alone, through a contiguous temporary).
    """

    offset: int
    nbytes: int
    device: Hashable | None
    source: tuple[int, int] | None


@dataclass(frozen=True)
class Run:
    """Items (indices into the plan's input) copied by one copy of `nbytes` bytes to `offset`.

    skip: bytes of the items' source before the ones this copy takes (0 unless a run was split
    at a registration boundary: then each piece is a Run of the same items).
    """

    offset: int
    nbytes: int
    items: tuple[int, ...]
    skip: int = 0


@dataclass(frozen=True)
class Gather:
    """Small items packed together: `span` bytes of the destination from `offset`, each member
    (index, position inside the span). Bytes of the span between members are padding."""

    offset: int
    span: int
    members: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class DeviceCopyPlan:
    runs: tuple[Run, ...]
    gathers: tuple[Gather, ...]

    @property
    def operations(self) -> int:
        """Copy operations queued on the stream (a gather into a host buffer is two)."""
        return len(self.runs) + 2 * len(self.gathers)

    @property
    def max_span(self) -> int:
        """The bounce buffer a gather into host memory needs, in bytes."""
        return max((g.span for g in self.gathers), default=0)


def plan_copies(
    items: Sequence[Item],
    small_bytes: int = SMALL_BYTES,
    max_gather_bytes: int = MAX_GATHER_BYTES,
    boundaries: Sequence[int] = (),
) -> DeviceCopyPlan:
    """Plan the copies of every item whose `device` is not None (see the module docstring).

    boundaries: destination offsets that no copy may cross (where one host registration ends
    and the next begins; empty for a destination registered whole, as arenas are).
    Items must not overlap in the destination. Raises ValueError for negative sizes or offsets.
    """
    if small_bytes < 0 or max_gather_bytes <= 0:
        raise ValueError(f"small_bytes={small_bytes} must be >= 0 and max_gather_bytes={max_gather_bytes} > 0")
    for item in items:
        if item.offset < 0 or item.nbytes < 0:
            raise ValueError(f"item at offset {item.offset} of {item.nbytes} bytes: both must be >= 0")
    cuts = sorted(set(boundaries))

    def crosses(start: int, end: int) -> bool:
        """A boundary lies strictly inside [start, end)."""
        at = bisect.bisect_right(cuts, start)
        return at < len(cuts) and cuts[at] < end
    order = sorted((i for i, it in enumerate(items) if it.nbytes > 0), key=lambda i: items[i].offset)
    runs: list[Run] = []
    gathers: list[Gather] = []
    run: list[int] = []
    gather: list[int] = []

    def close_run() -> None:
        if run:
            first, last = items[run[0]], items[run[-1]]
            runs.append(Run(first.offset, last.offset + last.nbytes - first.offset, tuple(run)))
            run.clear()

    def close_gather() -> None:
        if len(gather) == 1:  # alone: no point in packing it
            only = items[gather[0]]
            runs.append(Run(only.offset, only.nbytes, (gather[0],)))
        elif gather:
            start = items[gather[0]].offset
            last = items[gather[-1]]
            gathers.append(Gather(start, last.offset + last.nbytes - start, tuple((i, items[i].offset - start) for i in gather)))
        gather.clear()

    for i in order:
        item = items[i]
        if item.device is None:  # bytes someone else writes: nothing may span over them
            close_run()
            close_gather()
            continue
        end = item.offset + item.nbytes
        if item.nbytes < small_bytes and item.source is not None and not crosses(item.offset, end):
            close_run()
            if gather:
                head = items[gather[0]]
                if head.device != item.device or end - head.offset > max_gather_bytes or crosses(head.offset, end):
                    close_gather()
            gather.append(i)
            continue
        close_gather()
        if run and not (_follows(items[run[-1]], item) and item.offset not in cuts):
            close_run()
        run.append(i)
        if item.source is None:
            close_run()
    close_run()
    close_gather()
    pieces = [piece for r in runs for piece in _split(r, cuts)] if cuts else runs
    return DeviceCopyPlan(tuple(sorted(pieces, key=lambda r: r.offset)), tuple(gathers))


def _split(run: Run, cuts: list[int]) -> list[Run]:
    """`run` cut at every boundary strictly inside it (sorted `cuts`)."""
    end = run.offset + run.nbytes
    starts = [run.offset] + [c for c in cuts[bisect.bisect_right(cuts, run.offset) :] if c < end]
    return [Run(a, b - a, run.items, run.skip + a - run.offset) for a, b in zip(starts, starts[1:] + [end])]


def _follows(prev: Item, item: Item) -> bool:
    """`item` starts where `prev` ends, both in the destination and in the same storage."""
    if prev.source is None or item.source is None or prev.device != item.device:
        return False
    same_storage = prev.source[0] == item.source[0] and prev.source[1] + prev.nbytes == item.source[1]
    return same_storage and prev.offset + prev.nbytes == item.offset


def item_of(tensor: torch.Tensor, offset: int, nbytes: int, device: Hashable | None) -> Item:
    """The Item of `tensor` placed at `offset`; `device` None: copied by other means."""
    source = None
    if tensor.is_contiguous():
        source = (tensor.untyped_storage().data_ptr(), tensor.storage_offset() * tensor.element_size())
    return Item(offset, nbytes, device, source)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def storage_bytes(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of `nbytes` bytes of `tensor`'s storage from the tensor's first byte
    (may reach past the tensor into the next one: merged runs)."""
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return view.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (nbytes,), (1,))


@dataclass
class Pack:
    """One gather, bound: `targets[k]` (byte views of the bounce buffer, or of the destination
    when it is on the sources' device) receive `sources[k]` (byte views of the small tensors)
    in one `_foreach_copy_`; then `span_src` (the packed bounce bytes) goes to `span_dst` in one
    copy, unless the pack went straight into the destination (both None)."""

    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    span_dst: torch.Tensor | None
    span_src: torch.Tensor | None


@dataclass
class BoundCopies:
    """A DeviceCopyPlan bound to its tensors: the views each copy reads and writes. Made once by
    `bind_copies` (per-tensor work) and reused by `issue_copies` while the tensors stay the same.

    runs: (destination bytes, source bytes), one copy each.
    strided: (destination bytes, non-contiguous source, skip): copied through a contiguous
    temporary made at issue time (its values change from save to save).
    """

    runs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    strided: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    packs: list[Pack] = field(default_factory=list)
    operations: int = 0


def bind_copies(
    plan: DeviceCopyPlan, sources: Sequence[torch.Tensor], dst: torch.Tensor, bounce: torch.Tensor | None = None
) -> BoundCopies:
    """Bind `plan` to `sources` (the plan's items, in the same order) and `dst` (a flat uint8
    tensor, host or device). Queues nothing.

    bounce: a flat uint8 tensor of at least `plan.max_span` bytes on the sources' device, needed
    when `dst` is on another device (gathers into host memory). Raises ValueError when a gather
    needs a bounce buffer and none (or a short one) is given.
    """
    bound = BoundCopies(operations=plan.operations)
    for run in plan.runs:
        first = sources[run.items[0]]
        target = dst[run.offset : run.offset + run.nbytes]
        if len(run.items) > 1:
            bound.runs.append((target, storage_bytes(first, run.skip + run.nbytes)[run.skip :]))
        elif first.is_contiguous():
            bound.runs.append((target, flat_bytes(first)[run.skip : run.skip + run.nbytes]))
        else:
            bound.strided.append((target, first, run.skip))
    for gather in plan.gathers:
        device = sources[gather.members[0][0]].device
        direct = dst.device == device
        if direct:
            packed = dst[gather.offset : gather.offset + gather.span]
        else:
            if bounce is None or bounce.numel() < gather.span or bounce.device != device:
                raise ValueError(f"a gather of {gather.span} bytes into {dst.device} needs a bounce buffer of that size on {device}")
            packed = bounce[: gather.span]
        targets = [packed[pos : pos + sources[i].numel() * sources[i].element_size()] for i, pos in gather.members]
        span_dst = None if direct else dst[gather.offset : gather.offset + gather.span]
        bound.packs.append(Pack(targets, [flat_bytes(sources[i]) for i, _ in gather.members], span_dst, None if direct else packed))
    return bound


def issue_copies(bound: BoundCopies) -> list[torch.Tensor]:
    """Queue the bound copies on the current stream, non-blocking: one copy per run, one
    `_foreach_copy_` (and one copy out of the bounce buffer) per gather. Returns the temporaries
    made (contiguous copies of non-contiguous sources), which must stay alive until the copies
    are done."""
    temporaries: list[torch.Tensor] = []
    for target, src in bound.runs:
        target.copy_(src, non_blocking=True)
    for target, tensor, skip in bound.strided:
        contiguous = tensor.contiguous()
        temporaries.append(contiguous)
        target.copy_(flat_bytes(contiguous)[skip : skip + target.numel()], non_blocking=True)
    for pack in bound.packs:
        torch._foreach_copy_(pack.targets, pack.sources, non_blocking=True)
        if pack.span_dst is not None and pack.span_src is not None:
            pack.span_dst.copy_(pack.span_src, non_blocking=True)
    return temporaries


def run_copies(
    plan: DeviceCopyPlan, sources: Sequence[torch.Tensor], dst: torch.Tensor, bounce: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Bind and issue in one go (`bind_copies`, then `issue_copies`): queue the plan's copies
    from `sources` into `dst` on the current stream; returns the temporaries to keep alive."""
    return issue_copies(bind_copies(plan, sources, dst, bounce))


def coalesced_ranges(items: Sequence[Item]) -> list[tuple[int, int]]:
    """(offset, nbytes) spans covering the bytes of every item whose `device` is not None, merged
    over padding but never over an item copied by other means (whose bytes a span would overwrite)."""
    spans: list[tuple[int, int]] = []
    open_span = False
    for item in sorted((it for it in items if it.nbytes > 0), key=lambda it: it.offset):
        if item.device is None:
            open_span = False
            continue
        if open_span:
            start, _ = spans[-1]
            spans[-1] = (start, item.offset + item.nbytes - start)
        else:
            spans.append((item.offset, item.nbytes))
            open_span = True
    return spans
