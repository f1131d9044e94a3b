"""ckptd.client.slots: every slot the daemon gives a rank is checked against the rank's own
tensor before a byte is copied (issue 30 finding 1: a plan made from another job's metadata put
bf16 bytes into a slot the daemon then stored as F16; only name, box and size were checked)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptd.client.slots import SlotMismatch, place
from ckptd.client.state import flatten_state
from ckptd.client.structure import Structure, StructureCache
from ckptd.wire.v1 import checkpoint_pb2 as pb


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2, dtype=torch.bfloat16)
        self.head = torch.nn.Linear(2, 4, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.embed.weight


def _structure() -> Structure:
    flat = flatten_state({"model": Tied(), "step": torch.tensor(3)}, rank=0, for_save=True, validate=False)
    return StructureCache().for_state(flat, None, None)


def _slots(structure: Structure, **change: Any) -> list[pb.Slot]:
    """The slots an honest daemon gives this rank (its fragments one after another), with the
    fields in `change` replaced in the first."""
    slots = []
    offset = 0
    for entry, fragment in structure.fragments:
        nbytes = fragment.local.numel() * fragment.local.element_size()
        slots.append(pb.Slot(
            name=fragment.name, offset=offset, nbytes=nbytes, box=pb.Box(offsets=fragment.box.offsets, lengths=fragment.box.lengths),
            kind=entry.kind, dtype={torch.bfloat16: "BF16", torch.int64: "I64"}[fragment.local.dtype], shape=fragment.global_shape,
            aliases=entry.aliases,
        ))
        offset += 64
    for field, value in change.items():
        if isinstance(value, (list, tuple)):
            del getattr(slots[0], field)[:]
            getattr(slots[0], field).extend(value)
        else:
            setattr(slots[0], field, value)
    return slots


def test_slots_that_describe_the_ranks_tensors_are_placed() -> None:
    structure = _structure()
    placed = place(structure, _slots(structure), "layout", lambda t: False)
    assert [structure.fragments[k][0].name for k in placed.fragment_of] == ["model/embed.weight", "step"]
    assert structure.fragments[0][0].aliases == ("model/head.weight",)
    assert placed.nbytes == 16 + 8 and placed.devices == frozenset() and placed.host == (0, 1)
    on_device = place(structure, _slots(structure), "layout", lambda t: t.dtype == torch.bfloat16)  # the embedding plays a device tensor
    assert on_device.device == frozenset({0}) and on_device.devices == frozenset({torch.device("cpu")}) and on_device.host == (1,)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "F16"}, r"is planned for model F16\[4, 2\] tied to \['model/head.weight'\] but this rank's tensor is model BF16\[4, 2\]"),
        ({"kind": "extra"}, r"planned for extra BF16\[4, 2\]"),
        ({"shape": [8, 1]}, r"planned for model BF16\[8, 1\]"),
        ({"aliases": []}, r"planned for model BF16\[4, 2\] but this rank's tensor is model BF16\[4, 2\] tied to"),
        ({"dtype": ""}, r"planned for model \(no dtype\)\[4, 2\]"),  # a daemon that does not describe its slots
        ({"nbytes": 8}, "has 8 bytes but the tensor has 16"),
        ({"name": "model/other"}, "'model/other' .* which it does not hold"),
    ],
    ids=["dtype", "kind", "shape", "aliases", "undescribed", "bytes", "name"],
)
def test_a_slot_planned_for_another_tensor_is_refused_before_anything_is_copied(change: dict[str, Any], message: str) -> None:
    structure = _structure()
    with pytest.raises(SlotMismatch, match=message) as refused:
        place(structure, _slots(structure, **change), "layout", lambda t: False)
    assert "nothing was copied" in str(refused.value) and "save again" in str(refused.value)
