"""A state walked again from one save or load to the next (issue 33 item 5: the walk of an
unchanged state costs no Python per tensor).

`StateWalk.flatten` is `flatten_state(..., validate=False)` (ckptd.client.state), keeping per
top-level key what it flattened to; a key of plain values is taken over while its tree is the
very same (ckptd.client.tree.TreeIdentity), and an unchanged state is the same FlatState, whose
extras JSON is made once. Tensors' metadata and memory are the structure's to check
(ckptd.client.structure).
"""

from __future__ import annotations

import json
from itertools import chain
from typing import Any, Mapping

import torch
from torch import nn

from ckptd.client import tree
from ckptd.client.state import Entries, FlatState, TensorEntry, check_state, flatten_rng, flatten_value, is_stateful
from ckptd.format.file_plan import RNG_KEY


class _Part:
    """What one top-level key of a state flattens to, with what tells that it is still valid."""

    __slots__ = ("entries", "encoded", "identity", "_text")

    def __init__(self, entries: tuple[TensorEntry, ...], encoded: Any, identity: "tree.TreeIdentity | None") -> None:
        self.entries = entries
        self.encoded = encoded  # its extras tree, None for none
        self.identity = identity  # a plain tree's: the part is valid while it holds
        self._text: str | None = None

    def text(self) -> str:
        """The extras tree as strict JSON text, made once."""
        if self._text is None:
            # no cycle check: encode made the tree anew and refuses a value that contains itself
            self._text = json.dumps(self.encoded, allow_nan=False, check_circular=False)
        return self._text


class StateWalk:
    """`flatten_state(..., validate=False)` (ckptd.client.state) kept from one call to the next (one client's saves and
    loads share one): what a top-level key of plain values (dicts, lists, tuples, tensors,
    scalars: not a module, an optimizer or a stateful object, whose state_dict() is asked anew
    every time) flattened to is taken over while its tree is the very same (tree.TreeIdentity:
    the same containers holding the same objects). When every key is taken over, and no RNG
    state is asked for, the FlatState of the last call is returned itself, with its extras JSON.

    A tensor is taken over for being the same object: its dtype, shape, strides, device and
    memory are the structure's to check (ckptd.client.structure.StructureCache.for_state), as for
    any flat state.
    """

    def __init__(self) -> None:
        self._parts: dict[str, _Part] = {}
        self._last: FlatState | None = None
        self.reused = 0  # parts taken over (tests)

    def flatten(self, state: Mapping[str, Any], *, rank: int, rng: bool = False, for_save: bool = False) -> FlatState:
        """As flatten_state(state, rank=rank, rng=rng, for_save=for_save, validate=False)."""
        check_state(state, rng)
        parts: dict[str, _Part] = {}
        fresh_keys: list[str] = []
        same = self._last is not None and self._last.rank == rank and not rng
        for key in sorted(state):
            part = self._parts.get(key)
            if part is not None and part.identity is not None and part.identity.holds(state[key]):
                self.reused += 1
            else:
                part = _flatten_part(state, key, for_save, fresh_keys)
                same = False
            parts[key] = part
        same = same and len(parts) == len(self._parts)
        self._parts = parts
        if same and self._last is not None:
            return self._last
        listed = list(parts.items())
        if rng:
            own = Entries(validate=False)
            encoded = flatten_rng(rank, own)
            listed.append((RNG_KEY, _Part(tuple(own.entries), encoded, None)))
        extras = {key: part.encoded for key, part in listed if part.encoded is not None}
        entries = tuple(chain.from_iterable(part.entries for _, part in listed))
        # json.dumps(extras, allow_nan=False), made of the parts' texts (of the unchanged ones kept)
        text = "{" + ", ".join(f"{json.dumps(key)}: {part.text()}" for key, part in listed if part.encoded is not None) + "}"
        self._last = FlatState(entries, extras, tuple(fresh_keys), rank, text)
        return self._last


def _flatten_part(state: Mapping[str, Any], key: str, for_save: bool, fresh_keys: list[str]) -> _Part:
    entries = Entries(validate=False)  # names of two keys never collide: each begins with its key and "/"
    encoded = flatten_value(state, key, entries, for_save, fresh_keys)
    value = state[key]
    plain = not isinstance(value, (nn.Module, torch.optim.Optimizer)) and not is_stateful(value)
    return _Part(tuple(entries.entries), encoded, tree.TreeIdentity.of(value) if plain else None)
