"""Which tensors of a state are one (tied weights, a tensor under several names): one rule for the
client (ckptd.client.state) and `ckptd import` (the daemon's import_state).

A tied group is stored once, under its first name, with the other names as aliases.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, TypeVar

import torch
from torch.distributed.tensor import DTensor

from ckptd.client.subclasses import inner_tensor

T = TypeVar("T")


def memory_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same data: equal device, storage, offset, shape, stride and
    dtype. A DTensor is identified by its local shard (its own storage is not real memory), its
    global shape and placements; a wrapper subclass by the tensor it wraps
    (ckptd.client.subclasses). None when the memory says nothing: an empty or non-strided tensor."""
    if t.numel() == 0:
        return None
    if isinstance(t, DTensor):
        local = t.to_local()
        if local.numel() == 0:
            return ("dtensor", id(t))
        return ("dtensor", *(memory_key(local) or ()), tuple(t.shape), tuple(t.placements))
    t = inner_tensor(t)
    if t.layout != torch.strided:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def shared_names(named: Iterable[tuple[str, T]], key: Callable[[T], Hashable | None]) -> dict[str, list[str]]:
    """{first name: [the later names of the same thing]} of `named` (unique names), in order.

    Items whose `key` (e.g. memory_key, or id for one Parameter object) equals an earlier item's
    are listed under that item's name, and are no key of the result; a None key is never shared.
    Every other name is a key, with an empty list when nothing shares it."""
    groups: dict[str, list[str]] = {}
    first_of: dict[Hashable, str] = {}
    for name, value in named:
        k = key(value)
        if k is not None:
            first = first_of.setdefault(k, name)
            if first != name:
                groups[first].append(name)
                continue
        groups[name] = []
    return groups
