"""Where a rank's fragments go in its arena: the daemon's slots bound to the rank's tensors.

The daemon answers each BeginSave with the slots of this rank (fragment, arena offset, size,
and the logical tensor it planned the slot for: kind, dtype, shape, aliases) and a `layout_id`,
a digest of them. Every slot is checked against this rank's own tensor before a byte is copied:
a plan that disagrees (it would store these bytes as another dtype or shape) refuses the save. `Placed` binds those slots to the fragments of a
Structure (ckptd.client.structure) once; while the structure and the layout id stay the same,
the client sends the id back (`known_layout`), the daemon leaves the slots out and the same
Placed serves the next save: no per-tensor work on either side. When only some tensors' memory
moved (a rebind of the structure), `rebound` takes their views again and keeps the rest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import torch

from ckptd.client.errors import CheckpointError
from ckptd.client.layout import Fragment
from ckptd.client.state import TensorEntry
from ckptd.client.structure import Structure
from ckptd.common import dtypes
from ckptd.common.boxes import Box

Placement = tuple[torch.Tensor, int, int]  # (source view, arena offset, bytes)


class SlotLike(Protocol):
    """A slot as the wire carries it (ckptd.wire.v1 Slot)."""

    name: str
    offset: int
    nbytes: int
    box: Any  # offsets, lengths
    kind: str
    dtype: str
    shape: Any  # a sequence of ints: the logical tensor's global shape
    aliases: Any  # a sequence of names


class SlotMismatch(CheckpointError):
    """The daemon's plan gave this rank a slot that does not fit its state (another fragment,
    size, kind, dtype, shape or aliases): the save is refused before anything is copied."""


@dataclass(frozen=True, eq=False)
class Placed:
    """A structure's fragments placed into the arena layout `layout_id`.

    placements[i]: (the fragment's view, its arena offset, its bytes) for slot i; kinds[i]: its
    kind (model, optimizer, ...). fragment_of[i]: which of structure.fragments slot i copies.
    device: the slots whose tensors the device backend copies (CUDA); host: the others.
    for_device: the placements object to hand to the device backend; it stays the same object
    across rebinds that moved no device tensor, so the backend may keep its copy plan.
    `cache` holds what callers derive from this placement (copy plans, staging ranges).
    """

    structure: Structure
    layout_id: str
    fragment_of: tuple[int, ...]
    placements: tuple[Placement, ...]
    kinds: tuple[str, ...]
    device: frozenset[int]
    host: tuple[int, ...]
    for_device: tuple[Placement, ...]
    cache: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def nbytes(self) -> int:
        """The bytes of every slot (fixed for a placement: counted once, not per save)."""
        return sum(n for _, _, n in self.placements)

    @functools.cached_property
    def devices(self) -> frozenset[torch.device]:
        """The devices of the `device` slots' tensors."""
        return frozenset(self.for_device[i][0].device for i in self.device)

    @functools.cached_property
    def host_sources(self) -> tuple[torch.Tensor, ...]:
        """The tensors of the `host` slots, in order: what the CPU copy plan copies."""
        return tuple(self.placements[i][0] for i in self.host)

    def rebound(self, structure: Structure) -> "Placed":
        """The same placement over a rebind of its structure (same signature, some views new)."""
        placements = tuple((structure.fragments[k][1].local, off, n) for k, (_, off, n) in zip(self.fragment_of, self.placements))
        moved = {i for i, (a, b) in enumerate(zip(self.placements, placements)) if a[0] is not b[0]}
        for_device = self.for_device if not (moved & self.device) else placements
        return Placed(structure, self.layout_id, self.fragment_of, placements, self.kinds, self.device, self.host, for_device)


_DISAGREE = "the daemon's plan and this rank's state disagree, so nothing was copied: save again (the next save sends this rank's tensor metadata anew)"


def place(structure: Structure, slots: Iterable[SlotLike], layout_id: str, owns_device: Any) -> Placed:
    """Bind the daemon's `slots` to `structure`'s fragments; `owns_device(tensor)`: the device
    backend copies it. Raises SlotMismatch when a slot names a fragment this rank lacks, or
    describes it otherwise than this rank's tensor (size, kind, dtype, global shape, aliases)."""
    index = {(f.name, f.box): k for k, (_, f) in enumerate(structure.fragments)}
    fragment_of = []
    placements = []
    for s in slots:
        box = Box(tuple(s.box.offsets), tuple(s.box.lengths))
        k = index.get((s.name, box))
        if k is None:
            raise SlotMismatch(f"the daemon gave this rank a slot for {s.name!r} {box}, which it does not hold; {_DISAGREE}")
        entry, fragment = structure.fragments[k]
        local = fragment.local
        if s.nbytes != local.numel() * local.element_size():
            raise SlotMismatch(
                f"the daemon's slot for {s.name!r} {box} has {s.nbytes} bytes but the tensor has "
                f"{local.numel() * local.element_size()}; {_DISAGREE}"
            )
        _check_tensor(s, box, entry, fragment)
        fragment_of.append(k)
        placements.append((local, s.offset, s.nbytes))
    kinds = tuple(structure.fragments[k][0].kind for k in fragment_of)
    device = frozenset(i for i, (t, _, _) in enumerate(placements) if owns_device(t))
    host = tuple(i for i in range(len(placements)) if i not in device)
    frozen = tuple(placements)
    return Placed(structure, layout_id, tuple(fragment_of), frozen, kinds, device, host, frozen)


def _check_tensor(slot: SlotLike, box: Box, entry: TensorEntry, fragment: Fragment) -> None:
    """The slot was planned for this rank's tensor: same kind, dtype, global shape and aliases
    (equal sizes are not enough: bf16 bytes stored as F16 load back as garbage, without an error)."""
    planned = (slot.kind, slot.dtype, tuple(slot.shape), tuple(slot.aliases))
    own = (entry.kind, dtypes.from_torch_name(str(fragment.local.dtype)), tuple(fragment.global_shape), tuple(entry.aliases))
    if planned != own:
        raise SlotMismatch(
            f"the daemon's slot for {slot.name!r} {box} is planned for {_describe(*planned)} but this rank's tensor is "
            f"{_describe(*own)}; {_DISAGREE}"
        )


def _describe(kind: str, dtype: str, shape: tuple[int, ...], aliases: tuple[str, ...]) -> str:
    tied = f" tied to {list(aliases)}" if aliases else ""
    return f"{kind} {dtype or '(no dtype)'}{list(shape)}{tied}"
