"""Where a rank's fragments go in its arena: the daemon's slots bound to the rank's tensors.

The daemon answers each BeginSave with the slots of this rank (fragment, arena offset, size)
and a `layout_id`, a digest of them. `Placed` binds those slots to the fragments of a
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
from ckptd.client.structure import Structure
from ckptd.common.boxes import Box

Placement = tuple[torch.Tensor, int, int]  # (source view, arena offset, bytes)


class SlotLike(Protocol):
    """A slot as the wire carries it (ckptd.wire.v1 Slot)."""

    name: str
    offset: int
    nbytes: int
    box: Any  # offsets, lengths


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

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.placements)

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


def place(structure: Structure, slots: Iterable[SlotLike], layout_id: str, owns_device: Any) -> Placed:
    """Bind the daemon's `slots` to `structure`'s fragments; `owns_device(tensor)`: the device
    backend copies it. Raises CheckpointError when a slot names a fragment this rank lacks."""
    index = {(f.name, f.box): k for k, (_, f) in enumerate(structure.fragments)}
    fragment_of = []
    placements = []
    for s in slots:
        box = Box(tuple(s.box.offsets), tuple(s.box.lengths))
        k = index.get((s.name, box))
        if k is None:
            raise CheckpointError(
                f"the daemon gave this rank a slot for {s.name!r} {box}, which it does not hold; "
                "the daemon's plan and this rank's state disagree: restart the save"
            )
        local = structure.fragments[k][1].local
        if s.nbytes != local.numel() * local.element_size():
            raise CheckpointError(
                f"the daemon's slot for {s.name!r} {box} has {s.nbytes} bytes but the tensor has "
                f"{local.numel() * local.element_size()}; the daemon's plan and this rank's state disagree: restart the save"
            )
        fragment_of.append(k)
        placements.append((local, s.offset, s.nbytes))
    kinds = tuple(structure.fragments[k][0].kind for k in fragment_of)
    device = frozenset(i for i, (t, _, _) in enumerate(placements) if owns_device(t))
    host = tuple(i for i in range(len(placements)) if i not in device)
    frozen = tuple(placements)
    return Placed(structure, layout_id, tuple(fragment_of), frozen, kinds, device, host, frozen)
