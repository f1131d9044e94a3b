"""What a rank's save or load derives from its state's structure, kept from one call to the next.

Between two saves of a training run the state's *structure* does not change: the same tensors
under the same names, of the same dtypes, shapes and strides, in the same layout. Everything
derived from it — the validated names, the fragments (boxes in the logical tensors), the
fingerprint that names its metadata to the daemon, the tensor metadata, the placements in the
arena and the copy plans (ckptd.client.arena_copy) — is the same too. `StructureCache` keeps it, so a
save of an unchanged state costs a walk of the state, one comparison per tensor and the copies,
not the checks and layout work again (docs/architecture.md section 6: a host-cost budget per tensor).

Two checks decide what can be reused, both cheap and exact:

- the *signature*: per entry its name, kind, aliases, frozen class, dtype, shape, strides, device and
  whether it is the rank's own (for a DTensor also its placements, its mesh and its local shape
  and strides), plus the layout rules, this rank's coordinates and its rank. Any difference — a new parameter, a resized tensor, optimizer
  state that appears after the first step, a dtype change, other placements or rules — means a
  new structure: everything is validated and derived again. For plain tensors it is made of lists
  (the entries' fields, dtypes, shapes, strides, devices) by C-level maps, so checking an
  unchanged state runs no Python per tensor; the entries' fields are taken over when the flat
  state holds the very same entries (a state walked again unchanged: ckptd.client.walk.StateWalk).
- the *pointers*: per entry the address of its (local) data. Equal signature and pointer mean
  the same memory, so the fragments' views taken earlier still show it (they hold its storage,
  so the address cannot have been reused by another tensor). An entry whose memory moved (a
  parameter replaced, a tensor made anew on each call such as torch's RNG state) gets its
  fragments taken again; its structure, and so the fingerprint and metadata, stay valid.

A structure built from scratch (a new client's first save or load, or a changed state) of the
common kind, plain tensors without layout rules or LocalShards, is derived from the lists the
signature read (`_plain_structure`): checks, whole fragments and fingerprint by C-level maps over
them, a few µs per tensor (tests/bench/bench_structure.py). Any other state, or one that fails a
check, takes the general path, which raises the error; both give the same Structure
(tests/client/test_structure_golden.py).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.distributed.tensor import DTensor

from ckptd.client.layout import Fragment, LayoutRules, RankCoords, layout_state, whole_fragments
from ckptd.client.plain_entries import entries_fingerprint, plain_entries_valid, unmaterialized
from ckptd.client.state import FlatState, TensorEntry, validate_entries
from ckptd.client.subclasses import inner_tensor

Signature = tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class Structure:
    """A flattened state's derived structure (see the module docstring).

    fingerprint: hex digest of the names, kinds, dtypes, shapes, aliases and boxes: the name
    under which this rank's daemon keeps the metadata once it was sent (BeginSave, PlanLoad);
    the daemon plans from its own digest of the metadata, so the fingerprint is only a handle
    (ckptd.client.slots checks every slot of the plan against the tensors). targets: each
    fragment's local tensor, in order (what a load from memory copies into). `fragments`:
    (entry, fragment) for every fragment of every entry, in entry order, made when first asked
    (`make_fragments`): a restarted trainer's load from memory names its tensors by the
    fingerprint and needs only the targets. `cache` holds what callers derive from this
    structure and its bindings (metadata messages, placements, copy plans): it is dropped with it.
    """

    signature: Signature
    pointers: Sequence[int]
    fingerprint: str
    targets: tuple[torch.Tensor, ...]
    make_fragments: Callable[[], tuple[tuple[TensorEntry, Fragment], ...]] = field(repr=False)
    cache: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def fragments(self) -> tuple[tuple[TensorEntry, Fragment], ...]:
        return self.make_fragments()

    @staticmethod
    def of_fragments(signature: Signature, pointers: Sequence[int], fragments: tuple[tuple[TensorEntry, Fragment], ...], fingerprint: str) -> "Structure":
        """A structure whose fragments are made already."""
        return Structure(signature, pointers, fingerprint, tuple(map(_LOCAL, map(_FRAGMENT, fragments))), lambda: fragments)


class _FirstBuild(NamedTuple):
    """What `StructureCache.fingerprint_first` derived of `flat` (without layout rules), which
    the next `for_state` of the very same flat state and coordinates builds from."""

    flat: FlatState
    coords: RankCoords | None
    tensors: list[Any]
    signature: Signature
    digest: str  # the entries' (plain_entries.entries_fingerprint)


class StructureCache:
    """The structure of the last state seen, reused while the next one has the same signature.

    `for_state` returns the same Structure object for a state of the same signature and
    pointers, so a caller may key its own caches on its identity.
    """

    def __init__(self) -> None:
        self._last: Structure | None = None
        self._entries: tuple[TensorEntry, ...] = ()  # the entries whose fields _last's signature holds
        self._first: _FirstBuild | None = None  # what fingerprint_first derived, for the next for_state of that flat state
        self.builds = 0  # how many times a structure was derived from scratch (tests, metrics)
        self.rebinds = 0  # how many times some entries' memory moved and was taken again

    def for_state(self, flat: FlatState, rules: LayoutRules | None, coords: RankCoords | None) -> Structure:
        """The Structure of `flat` (flattened with validate=False): the cached one when nothing
        changed; one with some fragments taken anew when only memory moved; else built (and
        validated: raises ValueError/TypeError/LayoutError naming the tensor) from scratch."""
        first, self._first = self._first, None
        if first is not None and first.flat is flat and rules is None and first.coords == coords and self._last is None:
            self._last = self._build(flat, rules, coords, first.signature, first.tensors, first.digest)
            self._entries = flat.tensors
            return self._last
        last = self._last
        same_entries = last is not None and flat.tensors is self._entries
        tensors = list(map(_TENSOR, flat.tensors))
        signature = _signature(flat, rules, coords, tensors, last.signature if same_entries and last is not None else None)
        if signature is None or last is None or signature != last.signature:
            self._last = self._build(flat, rules, coords, signature, tensors)
            self._entries = flat.tensors
            return self._last
        self._entries = flat.tensors
        pointers = _pointers(tensors)
        if pointers == last.pointers:
            return last
        self._last = _rebind(last, flat, rules, coords, pointers)
        self.rebinds += 1
        return self._last

    def fingerprint_first(self, flat: FlatState, rules: LayoutRules | None, coords: RankCoords | None) -> str | None:
        """The fingerprint that the next `for_state(flat, rules, coords)` gives if its checks pass,
        known before them: for a plain state (each tensor one whole fragment) whose structure is
        the first this cache builds (a new client's first load, whose PlanLoad then travels while
        the checks run). None for any other state or cache: for_state alone knows."""
        if self._last is not None or rules is not None:
            return None
        tensors = list(map(_TENSOR, flat.tensors))
        signature = _signature(flat, rules, coords, tensors)
        if signature is None or len(signature) <= _DEVICES_AT or any(map(_PLACED, flat.tensors)) or any(map(_PER_RANK, flat.tensors)):
            return None
        digest = entries_fingerprint(flat.tensors, signature[_DTYPES_AT], signature[_SHAPES_AT])
        self._first = _FirstBuild(flat, coords, tensors, signature, digest)
        return _whole_fingerprint(digest)

    def _build(
        self, flat: FlatState, rules: LayoutRules | None, coords: RankCoords | None, signature: Signature | None, tensors: list[Any], digest: str | None = None
    ) -> Structure:
        built = _plain_structure(flat, rules, signature, tensors, digest) if signature is not None else None
        if built is None:
            validate_entries(flat)
            fragments = fragments_of_state(flat, rules, coords)
            if signature is None:  # cannot happen for a state that validates; never reused
                signature = (object(),)
            built = Structure.of_fragments(signature, _pointers(tensors), fragments, fingerprint_of(flat, fragments))
        self.builds += 1
        return built


def _plain_structure(flat: FlatState, rules: LayoutRules | None, signature: Signature, tensors: list[Any], digest: str | None = None) -> Structure | None:
    """What `StructureCache._build` derives, for the common state: plain tensors (the signature's
    plain form, also LocalShards' tensors) without layout rules, whose checks all pass; None for any other
    (the general path then checks, and raises the error). One pass over the tensors' metadata:
    the dtypes and shapes the signature read serve the checks, the fragments and the fingerprint
    (a new client's first build costs a few µs per tensor: bench_structure.py). digest: the
    entries' (plain_entries.entries_fingerprint), when known already."""
    if rules is not None or len(signature) <= _DEVICES_AT:
        return None
    dtypes, shapes, devices = signature[_DTYPES_AT], signature[_SHAPES_AT], signature[_DEVICES_AT]
    if not plain_entries_valid(flat.tensors, tensors, dtypes, devices):
        return None
    entries_digest = digest if digest is not None else entries_fingerprint(flat.tensors, dtypes, shapes)
    if any(map(_PLACED, flat.tensors)) or any(map(_PER_RANK, flat.tensors)):  # a fragment's name or place is its own
        fragments = whole_fragments(flat, tensors, shapes)
        return Structure.of_fragments(signature, _pointers(tensors), fragments, _fingerprint(entries_digest, flat.tensors, shapes, fragments))
    # every fragment is all of its tensor under its name (the fingerprint's whole form), made only when asked for
    fingerprint = _whole_fingerprint(entries_digest)
    return Structure(signature, _pointers(tensors), fingerprint, tuple(tensors), lambda: whole_fragments(flat, tensors, shapes))


def fragments_of_state(
    flat: FlatState, rules: LayoutRules | None = None, coords: RankCoords | None = None
) -> tuple[tuple[TensorEntry, Fragment], ...]:
    """Where each of this rank's tensors sits in its logical tensor: DTensor placements, the
    layout rules (manual tensor parallelism), else a whole replica."""
    return tuple((layout.entry, f) for layout in layout_state(flat, rules, coords) for f in layout.fragments)


def fingerprint_of(flat: FlatState, fragments: Sequence[tuple[TensorEntry, Fragment]]) -> str:
    """Names, dtypes, shapes, aliases, global shapes and boxes: everything the tensor metadata
    sent to the daemon says, so that equal fingerprints name equal metadata (the global shape
    too: rank 0's half of a tensor split over two ranks has the box and local shape of a whole
    tensor of half the size)."""
    tensors = list(map(_TENSOR, flat.tensors))
    shapes = list(map(_SHAPE, tensors))  # read once: the entries' digest and the whole form's test share them
    return _fingerprint(entries_fingerprint(flat.tensors, list(map(_DTYPE, tensors)), shapes), flat.tensors, shapes, fragments)


def _fingerprint(entries_digest: str, entries: Sequence[TensorEntry], shapes: Sequence[Sequence[int]], fragments: Sequence[tuple[TensorEntry, Fragment]]) -> str:
    """`fingerprint_of` a flat state whose own fingerprint (FlatState.fingerprint) is given, of
    its entries, their tensors' shapes (as in that fingerprint) and their fragments in order.

    Two forms, never equal (their texts differ): when every entry is one fragment of all of its
    tensor under its own name, the fragments say nothing the entries' digest does not, and the
    fingerprint is its whole form (`_whole_fingerprint`: a restarted trainer's thousands of
    tensors hashed once, not twice); else the digest and one line per fragment."""
    named = list(map(_FRAGMENT, fragments))
    names, places = list(map(_FRAGMENT_NAME, named)), list(map(_PLACE, named))
    if names == list(map(_ENTRY_NAME, entries)) and places == [(whole := tuple(s), (0,) * len(whole), whole) for s in shapes]:
        return _whole_fingerprint(entries_digest)
    h = hashlib.sha256(entries_digest.encode())
    # A fragment's line is f"{f.name}|{f.global_shape}|{f.box.offsets}|{f.box.lengths}\n". Tuples'
    # repr is slow, and fragments of one shape share the part after the name: made once per
    # distinct place, and the lines hashed as one text (the same digest as one update per line).
    tails = {place: "|{}|{}|{}\n".format(*place) for place in set(places)}
    h.update("".join(map(str.__add__, names, map(tails.__getitem__, places))).encode())
    return h.hexdigest()


def _whole_fingerprint(entries_digest: str) -> str:
    """The fingerprint of entries each one fragment of all of its tensor under its own name: the
    entries' digest (64 hex characters) under a prefix no digest begins with."""
    return hashlib.sha256(("whole:" + entries_digest).encode()).hexdigest()


_FRAGMENT = itemgetter(1)
_FRAGMENT_NAME, _LOCAL = attrgetter("name"), attrgetter("local")
_ENTRY_NAME, _PER_RANK = itemgetter(0), itemgetter(6)  # a TensorEntry's name, and whether it is the rank's own
_PLACE = attrgetter("global_shape", "box.offsets", "box.lengths")  # a fragment's place in its logical tensor
_PLACED = itemgetter(4)  # a TensorEntry's placement: a LocalShard's (offsets, global shape), else None


# A signature: (id(rules), coords, rank, the entries, then per entry of plain tensors their dtypes,
# shapes, strides and devices, in four lists, and whether one is unmaterialized; or per entry one
# tuple when some tensor is not plain).
# Made by C-level maps over the entries: no Python runs per tensor while the state is plain.
# TensorEntry's name, kind, aliases, placement, frozen and per_rank: a plain signature holds one
# list of each (no tuple per entry: a first build makes thousands of objects as it is)
_ENTRY_FIELDS = tuple(map(itemgetter, (0, 1, 3, 4, 5, 6)))
_TENSOR = itemgetter(2)
_DTYPE, _SHAPE, _DEVICE = attrgetter("dtype"), attrgetter("shape"), attrgetter("device")
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_ENTRIES_AT = 3  # where the entries' fields are in a signature
_DTYPES_AT, _SHAPES_AT, _DEVICES_AT = 4, 5, 7  # where a plain signature's lists of dtypes, shapes and devices are


def _signature(flat: FlatState, rules: LayoutRules | None, coords: RankCoords | None, tensors: list[Any], known: Any = None) -> Signature | None:
    """Everything the structure depends on (see above); None when a tensor has no strides (a
    sparse tensor: validation names it). tensors: the entries' tensors; `known`: a signature
    made of the very same entries (the same tuple: a StateWalk's unchanged state), whose entry
    fields are taken over. Not the unmaterialized flag: `t.data = torch._neg_view(u)` makes the
    very same tensor object a negated view."""
    try:
        if not _PLAIN.issuperset(map(type, tensors)):
            return (id(rules), coords, flat.rank, [_entry_signature(e) for e in flat.tensors])
        plain = known is not None and len(known) > _DEVICES_AT
        fields = known[_ENTRIES_AT] if plain else tuple([list(map(getter, flat.tensors)) for getter in _ENTRY_FIELDS])
        return (id(rules), coords, flat.rank, fields, list(map(_DTYPE, tensors)), list(map(_SHAPE, tensors)),
                list(map(torch.Tensor.stride, tensors)), list(map(_DEVICE, tensors)), unmaterialized(tensors))
    except (RuntimeError, NotImplementedError):
        return None


def _entry_signature(e: TensorEntry) -> tuple[Any, ...]:
    t = e.tensor
    if isinstance(t, DTensor):
        local = t._local_tensor
        return (e.name, e.kind, e.aliases, e.frozen, t.dtype, t.shape, tuple(t.placements), id(t.device_mesh),
                local.shape, local.stride(), local.device, unmaterialized([local]))
    return (e.name, e.kind, e.aliases, e.frozen, t.dtype, t.shape, t.stride(), t.device, e.placement, e.per_rank, unmaterialized([t]))


def _pointers(tensors: list[Any]) -> list[int]:
    """The address of each tensor's (local) data."""
    if _PLAIN.issuperset(map(type, tensors)):
        return list(map(torch.Tensor.data_ptr, tensors))
    return [_data_ptr(t) for t in tensors]


def _data_ptr(t: Any) -> int:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # nearly all: no lookups
        return int(t.data_ptr())
    return int(inner_tensor(t._local_tensor if isinstance(t, DTensor) else t).data_ptr())


def _rebind(last: Structure, flat: FlatState, rules: LayoutRules | None, coords: RankCoords | None, pointers: list[int]) -> Structure:
    """`last` with the fragments of the entries whose memory moved taken from `flat` again."""
    moved = {i for i, (a, b) in enumerate(zip(last.pointers, pointers)) if a != b}
    by_entry: list[list[tuple[TensorEntry, Fragment]]] = [[] for _ in flat.tensors]
    # a LocalShards' boxes share a name: an entry is its name and placement
    index_of = {(e.name, e.placement): i for i, e in enumerate(flat.tensors)} if moved else {}
    for entry, fragment in last.fragments:
        by_entry[index_of[entry.name, entry.placement]].append((entry, fragment))
    for i in moved:
        entry = flat.tensors[i]
        layout = layout_state(FlatState((entry,), {}, rank=flat.rank), rules, coords)[0]
        by_entry[i] = [(entry, f) for f in layout.fragments]
    fragments = tuple(pair for pairs in by_entry for pair in pairs)
    return Structure.of_fragments(last.signature, pointers, fragments, last.fingerprint)
