"""Checks and digests of a flat state's entries made over whole lists, by C-level maps: no
Python per tensor for the common state of plain tensors (torch.Tensor, nn.Parameter).

Each function answers for all entries at once or says "check one by one" (False), so the
per-tensor checks of ckptd.client.state keep raising the same error for the same bad input.
Entries are ckptd.client.state.TensorEntry tuples, read by position (this module cannot import
state.py, which imports it)."""

from __future__ import annotations

import hashlib
import json
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, Sequence

import torch

from ckptd.common import dtypes
from ckptd.common.names import tensor_names_valid

# TensorEntry's fields (name, kind, tensor, aliases, placement, frozen, per_rank) and tensors' attributes
_NAME, _KIND, _ALIASES, _FROZEN, _PER_RANK = (itemgetter(i) for i in (0, 1, 3, 5, 6))
_LAYOUT = attrgetter("layout")
_NESTED = attrgetter("is_nested")


def entries_fingerprint(entries: Sequence[Any], tensor_dtypes: list[torch.dtype], tensor_shapes: list[torch.Size]) -> str:
    """`FlatState.fingerprint` of `entries`, given their tensors' dtypes and shapes (in order)."""
    # One row per entry, made by C-level maps: json writes tuples (torch.Size too) as the lists
    # [name, kind, dtype, shape, aliases, frozen, per_rank] they always were, byte for byte.
    dtype_names = {dtype: str(dtype) for dtype in set(tensor_dtypes)}
    meta = list(zip(
        map(_NAME, entries), map(_KIND, entries), map(dtype_names.__getitem__, tensor_dtypes), tensor_shapes,
        map(_ALIASES, entries), map(_FROZEN, entries), map(_PER_RANK, entries),
    ))
    return hashlib.sha256(json.dumps(meta, separators=(",", ":"), check_circular=False).encode()).hexdigest()


def plain_entries_valid(
    entries: Sequence[Any], tensors: list[torch.Tensor], tensor_dtypes: list[torch.dtype], tensor_devices: list[torch.device]
) -> bool:
    """Whether entries of plain tensors (torch.Tensor, nn.Parameter: the caller's to know) all
    pass ckptd.client.state's `_check_tensor` under their names and aliases, told by checks over whole lists at C
    speed (no Python per tensor). tensors, tensor_dtypes, tensor_devices: the entries' tensors
    and theirs, in order. False means "check one by one": the general check then raises the
    first error in entry order, as it always did, so this never changes which error is raised."""
    if not tensor_names_valid([*map(_NAME, entries), *chain.from_iterable(map(_ALIASES, entries))]):
        return False
    if not {torch.strided}.issuperset(map(_LAYOUT, tensors)) or any(device.type == "meta" for device in set(tensor_devices)):
        return False
    if any(map(_NESTED, tensors)):  # torch.nested's strided layout (refused by the general check)
        return False
    if unmaterialized(tensors):  # refused by the general check
        return False
    return all(map(_storable, set(tensor_dtypes)))  # per distinct dtype: a few


def unmaterialized(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether some tensor's memory does not hold its values (a lazily negated view, torch's
    efficient zero tensor): the checks refuse those, and a cached structure must not take one
    in for the tensor it replaced at the same address (its signature says it)."""
    return any(map(torch.Tensor.is_neg, tensors)) or any(map(torch.Tensor._is_zerotensor, tensors))


def _storable(dtype: torch.dtype) -> bool:
    try:
        dtypes.from_torch_name(str(dtype))
    except dtypes.UnknownDtypeError:
        return False
    return True
