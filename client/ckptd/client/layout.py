"""Where each of a rank's tensors sits in its global (unsharded) tensor (docs/architecture.md sections 3, 4).

A rank's tensor is one or more *fragments*: boxes of the logical tensor, each with a view of the
rank's memory that holds exactly that box. Three sources of layout, in this order:

1. `DTensor` (FSDP2, HSDP, tensor parallel): the placements on the device mesh say it all; any
   mesh, `Shard(d)` on any dim (uneven shards split like `torch.chunk`), `Replicate`, several
   mesh dims sharding the same tensor dim (nested, left to right), and `_StridedShard` (FSDP2
   over TP: a rank's shard may be several separate pieces of the global tensor, one fragment
   each). `Partial` is refused: reduce it before saving. A rule matching a DTensor is an error.
2. Megatron-style manual parallelism, declared with a `LayoutRules` table: `Split`,
   `Fused` (QKV with grouped-query sizes, gate/up), `PaddedVocab`, `Replicated` (tensor
   parallel), `Expert` (expert parallel: a rank's experts under local indices, stored under
   their global ones) and `StoredAs` (a copy of another tensor, e.g. the output layer tied to the
   embedding across pipeline stages); the first rule whose pattern fully matches the tensor's
   *layout key* (see `layout_key`) wins. `Expert` and `StoredAs` rename: the fragment's name
   (the logical tensor it is stored as) is not the entry's.
3. Anything else: a full replica, one fragment covering the whole tensor; a rank's own extras
   tensor (`TensorEntry.per_rank`) is one under its per-rank name (`names.per_rank_name`).

Empty shares (more ranks than rows, a rank holding only vocabulary padding) are kept as one
fragment with an empty box, so every rank names every tensor it has; an empty box covers
nothing and overlaps nothing (ckptd.common.boxes), so consumers may skip it.
A fragment's `local` is a view, never a copy; it may be non-contiguous (a split along a dim
other than the first). No I/O here; only `verify_replicated` talks to other processes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from operator import itemgetter
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor

from ckptd.client.errors import LayoutError
from ckptd.client.placements import Piece as Piece, dtensor_pieces as dtensor_pieces
from ckptd.client.replicas import replicated_checksum as replicated_checksum, verify_replicated as verify_replicated
from ckptd.client.state import FlatState, TensorEntry
from ckptd.client.subclasses import inner_tensor
from ckptd.common.boxes import Box
from ckptd.common.names import decimal, per_rank_name


# ------------------------------------------------------------------ data


@dataclass(frozen=True, eq=False)
class Fragment:
    """A piece of a logical tensor that this rank holds: `local` is a view of the rank's memory.

    name: the logical name (as in TensorEntry; a per-rank tensor's per-rank name). global_shape: the
    logical tensor's shape. box: where `local` sits in the global tensor. local: a view (no copy) of
    the rank's data for exactly that box; `local.shape == box.lengths`. per_rank: the rank's own.
    """

    name: str
    global_shape: tuple[int, ...]
    box: Box
    local: torch.Tensor
    per_rank: bool = False

    def __init__(self, name: str, global_shape: tuple[int, ...], box: Box, local: torch.Tensor, per_rank: bool = False) -> None:
        # The fields, set once through the instance's dict: a frozen dataclass's own __init__ sets
        # each through object.__setattr__, twice the cost of the rest of a fragment (a state has thousands).
        vars(self).update(name=name, global_shape=global_shape, box=box, local=local, per_rank=per_rank)


@dataclass(frozen=True)
class RankCoords:
    """This rank's place in the manual (Megatron-style) tensor-parallel group, and in the
    expert-parallel group (`Expert` rules; ep_size 1: every expert on every rank)."""

    tp_rank: int
    tp_size: int
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={self.tp_rank}, tp_size={self.tp_size}")
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"need 0 <= ep_rank < ep_size, got ep_rank={self.ep_rank}, ep_size={self.ep_size}")


@dataclass(frozen=True)
class Split:
    """The tensor is split evenly along `dim` over the TP ranks: global size = local size * tp_size."""

    dim: int


@dataclass(frozen=True)
class Fused:
    """Sub-tensors concatenated along `dim`, each split over TP separately.

    sizes: the global sizes of the sub-tensors along `dim`, e.g. QKV with grouped-query attention
    (n_q * head_dim, n_kv * head_dim, n_kv * head_dim), or SwiGLU gate/up (ffn, ffn). A rank's
    local tensor along `dim` is [its part of sub 0, its part of sub 1, ...]; the global tensor is
    [whole sub 0, whole sub 1, ...] (the Hugging Face layout). If the framework's TP=1 tensor is
    itself interleaved per rank or head group (Megatron's QKV), the global tensor is the plain
    concatenation of the rank slices: use `Split` instead.
    """

    dim: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class PaddedVocab:
    """Split along `dim` over TP, with the rows from `size` on being padding (vocabulary padded
    to a multiple of tp_size * k). The global tensor has `size` rows: padding is not saved and,
    on load, left as it is. Rank r holds padded rows [r * L, (r + 1) * L), L = its local rows."""

    dim: int
    size: int


@dataclass(frozen=True)
class Replicated:
    """The same on every TP rank. check_equal: the caller should verify it (`verify_replicated`)."""

    check_equal: bool = True


@dataclass(frozen=True)
class Expert:
    r"""A whole expert of a MoE layer that this rank holds under its *local* index, Megatron-style:
    the rule's pattern has one capturing group, the local index i, e.g.
    r"layers\.\d+\.experts\.(\d+)\..*". With `num_experts` experts per layer over ep_size ranks
    (RankCoords.ep_rank, ep_size), rank r holds the k = num_experts / ep_size experts
    [r * k, (r + 1) * k), and local expert i is stored as the tensor named with i replaced by
    r * k + i. So every expert is stored under its own name (none is mistaken for a replica of
    another rank's expert with the same local index), and a load at another ep_size finds each
    rank's experts by the same rule. Optimizer state and master copies follow their expert."""

    num_experts: int


@dataclass(frozen=True)
class StoredAs:
    r"""A copy of the tensor whose layout key is `name`, stored as (a replica of) it: e.g. the
    output layer of the last pipeline stage tied to the embedding of the first,
    Rule(r"lm_head\.weight", StoredAs("embed.weight")). Stored once; a rank holding only the
    copy loads it from that tensor. On a rank where the two are one tied tensor the rule has
    nothing to do and is ignored. Optimizer state and master copies follow it."""

    name: str


Layout = Split | Fused | PaddedVocab | Replicated | Expert | StoredAs
RENAMING = (Expert, StoredAs)  # layouts that store a tensor under another name


@dataclass(frozen=True)
class Rule:
    """pattern: a regular expression that must match a tensor's layout key entirely (re.fullmatch)."""

    pattern: str
    layout: Layout


class LayoutRules:
    r"""A declarative table of layout rules for manually sharded tensors; the first match wins.

    Patterns are written against parameter FQNs, e.g. r"layers\.\d+\.attn\.qkv\.weight",
    and cover the parameter's optimizer state and master copy too (see `layout_key`).
    The table remembers which rules have matched: `unused()` lists the others, which are
    usually typos — report them after the first save.
    """

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        self._compiled = [_compile(i, rule) for i, rule in enumerate(self.rules)]
        self._used: set[int] = set()

    def match(self, name: str) -> Rule | None:
        """The first rule whose pattern fully matches `name` (a layout key), or None."""
        for i, pattern in enumerate(self._compiled):
            if pattern.fullmatch(name):
                self._used.add(i)
                return self.rules[i]
        return None

    def unused(self) -> list[Rule]:
        """The rules that have matched nothing so far, in table order."""
        return [rule for i, rule in enumerate(self.rules) if i not in self._used]


def _compile(index: int, rule: Rule) -> re.Pattern[str]:
    if not isinstance(rule, Rule):
        raise TypeError(f"layout rule #{index} is a {type(rule).__name__}; write Rule(pattern, layout)")
    try:
        compiled = re.compile(rule.pattern)
    except re.error as exc:
        raise ValueError(f"layout rule #{index} has an invalid pattern {rule.pattern!r}: {exc}") from None
    _check_layout(rule, compiled)
    return compiled


def _check_layout(rule: Rule, compiled: re.Pattern[str]) -> None:
    layout = rule.layout
    if isinstance(layout, Fused):
        if not layout.sizes or any(not isinstance(s, int) or s <= 0 for s in layout.sizes):
            raise ValueError(f"rule {rule.pattern!r}: Fused sizes must be positive integers, got {layout.sizes!r}")
    elif isinstance(layout, PaddedVocab):
        if layout.size <= 0:
            raise ValueError(f"rule {rule.pattern!r}: PaddedVocab size must be positive, got {layout.size}")
    elif isinstance(layout, Expert):
        if not isinstance(layout.num_experts, int) or layout.num_experts <= 0:
            raise ValueError(f"rule {rule.pattern!r}: Expert num_experts must be a positive integer, got {layout.num_experts!r}")
        if compiled.groups != 1:
            raise ValueError(
                f"rule {rule.pattern!r}: an Expert rule's pattern needs exactly one capturing group, the local expert index, "
                r"e.g. r'layers\.\d+\.experts\.(\d+)\..*' (write other groups as (?:...))"
            )
    elif isinstance(layout, StoredAs):
        if not isinstance(layout.name, str) or not layout.name or "/" in layout.name:
            raise ValueError(f"rule {rule.pattern!r}: StoredAs needs the layout key (a parameter FQN such as 'embed.weight'), got {layout.name!r}")
    elif not isinstance(layout, (Split, Replicated)):
        raise TypeError(
            f"rule {rule.pattern!r} has layout {layout!r}; use Split, Fused, PaddedVocab, Replicated, Expert or StoredAs"
        )


# ------------------------------------------------------------------ names


def layout_key(entry_name: str) -> str:
    r"""The name that layout rules are matched against, for a logical tensor name.

    - "model/<fqn>" and "master/<fqn>" -> "<fqn>" (weights and their fp32 master copies);
    - "<key>/state/<fqn>/<field...>", the optimizer state that ckptd.client.state names under
      any top-level key (normally "optimizer"), e.g. "optimizer/state/<fqn>/exp_avg" -> "<fqn>":
      optimizer state follows its parameter's rule;
    - any other name (extras, optimizer param_groups) is matched as it is, e.g. a rule
      r"ema/layers\.\d+\.qkv\.weight" for an EMA copy kept under the top-level key "ema".
    FQNs contain no "/" (module names are joined with "."), so the split is unambiguous.
    """
    key, _, rest = entry_name.partition("/")
    if key in ("model", "master") and rest:
        return rest
    if _is_optimizer_state(entry_name):
        return entry_name.split("/", 3)[2]
    return entry_name


def _is_optimizer_state(entry_name: str) -> bool:
    parts = entry_name.split("/", 3)
    return len(parts) == 4 and parts[0] not in ("model", "master") and parts[1] == "state" and all(parts)


# ------------------------------------------------------------------ fragments


def fragments_of(
    entry_name: str,
    tensor: torch.Tensor,
    rules: LayoutRules | None,
    coords: RankCoords | None,
    *,
    param_shape: tuple[int, ...] | None = None,
) -> list[Fragment]:
    """The fragments of this rank's `tensor`, the local part of logical tensor `entry_name`.

    DTensor: from its placements (a matching rule is an error). Otherwise the first rule of
    `rules` matching `layout_key(entry_name)` with this rank's `coords`; no rule: a full replica.
    Optimizer state ("<key>/state/<fqn>/<field>", see `layout_key`) with at most one element, such as
    Adam's "step", is a replica whatever its parameter's rule. param_shape: the parameter's local
    shape, when known, for optimizer state and master copies; a ruled tensor of another shape
    (e.g. a factored second moment) is refused, since its layout would be guessed.
    Raises LayoutError naming the tensor when its layout cannot be described.
    """
    if isinstance(tensor, DTensor):
        if rules is not None and (rule := rules.match(layout_key(entry_name))) is not None:
            raise LayoutError(
                f"{entry_name!r} is a DTensor but also matches layout rule {rule.pattern!r}; remove the rule: "
                "DTensor placements already describe it"
            )
        return _dtensor_fragments(entry_name, tensor)
    rule = rules.match(layout_key(entry_name)) if rules is not None else None
    return _ruled_fragments(entry_name, tensor, rule, coords, param_shape)


def _ruled_fragments(
    name: str, tensor: torch.Tensor, rule: Rule | None, coords: RankCoords | None, param_shape: tuple[int, ...] | None
) -> list[Fragment]:
    shape = tuple(tensor.shape)
    if rule is None or isinstance(rule.layout, Replicated):
        return [Fragment(name, shape, Box.full(shape), tensor)]
    if isinstance(rule.layout, RENAMING):
        return [Fragment(stored_name(name, rule, coords), shape, Box.full(shape), tensor)]
    if _is_optimizer_state(name) and tensor.numel() <= 1:
        return [Fragment(name, shape, Box.full(shape), tensor)]
    if param_shape is not None and shape != tuple(param_shape):
        raise LayoutError(
            f"{name!r} has shape {list(shape)} but its parameter has {list(param_shape)}: rule {rule.pattern!r} "
            "describes the parameter, and how this state field is split over TP ranks cannot be guessed; use an "
            "optimizer whose state has its parameters' shapes, or DTensor parameters (their state carries placements)"
        )
    if coords is None:
        raise LayoutError(
            f"{name!r} matches layout rule {rule.pattern!r}, which needs this rank's tensor-parallel coordinates: "
            "pass coords=RankCoords(tp_rank, tp_size)"
        )
    layout = rule.layout
    dim = _dim(name, rule, tensor)
    if isinstance(layout, Split):
        return [_split(name, tensor, dim, coords)]
    if isinstance(layout, Fused):
        return _fused(name, tensor, dim, layout.sizes, coords, rule)
    return [_padded(name, tensor, dim, layout.size, coords, rule)]


def stored_name(entry_name: str, rule: Rule, coords: RankCoords | None) -> str:
    """The logical name that entry `entry_name`, matched by renaming rule `rule` (Expert or
    StoredAs), is stored as: its layout key replaced, the rest of the name (kind, optimizer
    field) kept. coords None is expert parallelism of size 1. Raises LayoutError when the
    expert's index does not fit this rank's share."""
    key = layout_key(entry_name)
    layout = rule.layout
    if isinstance(layout, StoredAs):
        new_key = layout.name
    else:
        assert isinstance(layout, Expert)
        ep_rank, ep_size = (coords.ep_rank, coords.ep_size) if coords is not None else (0, 1)
        if layout.num_experts % ep_size:
            raise LayoutError(
                f"rule {rule.pattern!r}: {layout.num_experts} experts do not divide over ep_size {ep_size}; "
                "every expert-parallel rank must hold the same number of experts"
            )
        per_rank = layout.num_experts // ep_size
        match = re.fullmatch(rule.pattern, key)
        assert match is not None  # the rule matched this key
        local = match.group(1)
        index = None if local is None else decimal(local)
        if index is None or index >= per_rank:
            raise LayoutError(
                f"{entry_name!r} matches Expert rule {rule.pattern!r} with local expert index {local!r}, but rank "
                f"{ep_rank} of ep_size {ep_size} holds {per_rank} of the {layout.num_experts} experts (local indices "
                f"0..{per_rank - 1}); fix num_experts, this rank's RankCoords(ep_rank, ep_size) or the pattern's group"
            )
        new_key = f"{key[:match.start(1)]}{ep_rank * per_rank + int(local)}{key[match.end(1):]}"
    head, _, rest = entry_name.partition("/")
    if head in ("model", "master") and rest:
        return f"{head}/{new_key}"
    if _is_optimizer_state(entry_name):
        parts = entry_name.split("/", 3)
        return "/".join((parts[0], parts[1], new_key, parts[3]))
    return new_key


def _dim(name: str, rule: Rule, tensor: torch.Tensor) -> int:
    dim = rule.layout.dim  # type: ignore[union-attr]  # every layout but Replicated has one
    if not -tensor.ndim <= dim < tensor.ndim:
        raise LayoutError(
            f"layout rule {rule.pattern!r} splits dim {dim} of {name!r}, which has shape {list(tensor.shape)}; "
            "fix the rule's dim or its pattern"
        )
    return dim % tensor.ndim


def _with(shape: Sequence[int], dim: int, value: int) -> tuple[int, ...]:
    return tuple(value if d == dim else int(n) for d, n in enumerate(shape))


def _split(name: str, tensor: torch.Tensor, dim: int, coords: RankCoords) -> Fragment:
    local = tensor.shape[dim]
    global_shape = _with(tensor.shape, dim, local * coords.tp_size)
    box = Box(_with([0] * tensor.ndim, dim, coords.tp_rank * local), tuple(tensor.shape))
    return Fragment(name, global_shape, box, tensor)


def _fused(
    name: str, tensor: torch.Tensor, dim: int, sizes: tuple[int, ...], coords: RankCoords, rule: Rule
) -> list[Fragment]:
    tp = coords.tp_size
    if any(s % tp for s in sizes) or tensor.shape[dim] * tp != sum(sizes):
        raise LayoutError(
            f"{name!r} has {tensor.shape[dim]} rows along dim {dim} at tp_size {tp}, but rule {rule.pattern!r} fuses "
            f"sub-tensors of sizes {list(sizes)}: every size must divide by tp_size and the local size must be "
            f"sum(sizes) / tp_size = {sum(sizes) / tp:g}; fix the sizes"
        )
    global_shape = _with(tensor.shape, dim, sum(sizes))
    if tp == 1:  # the subs are adjacent in both tensors: one fragment
        return [Fragment(name, global_shape, Box.full(global_shape), tensor)]
    fragments = []
    local_start = global_start = 0
    for size in sizes:
        part = size // tp
        box = Box(_with([0] * tensor.ndim, dim, global_start + coords.tp_rank * part), _with(tensor.shape, dim, part))
        fragments.append(Fragment(name, global_shape, box, tensor.narrow(dim, local_start, part)))
        local_start += part
        global_start += size
    return fragments


def _padded(name: str, tensor: torch.Tensor, dim: int, size: int, coords: RankCoords, rule: Rule) -> Fragment:
    rows = tensor.shape[dim]
    if size > rows * coords.tp_size:
        raise LayoutError(
            f"{name!r} has {rows} rows along dim {dim} at tp_size {coords.tp_size} ({rows * coords.tp_size} padded "
            f"rows in all), fewer than the vocabulary size {size} of rule {rule.pattern!r}; fix the rule's size"
        )
    start = coords.tp_rank * rows
    kept = max(0, min(rows, size - start))
    offset = start if kept else size  # an empty share sits at the end, like DTensor's
    global_shape = _with(tensor.shape, dim, size)
    box = Box(_with([0] * tensor.ndim, dim, offset), _with(tensor.shape, dim, kept))
    return Fragment(name, global_shape, box, tensor.narrow(dim, 0, kept))


# ------------------------------------------------------------------ DTensor


def _dtensor_fragments(name: str, tensor: DTensor) -> list[Fragment]:
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError(f"{name!r} is a DTensor on a device mesh that this rank is not part of; save it from the mesh's ranks")
    global_shape = tuple(int(n) for n in tensor.shape)
    try:
        local_shape, pieces = dtensor_pieces(global_shape, tuple(mesh.shape), coordinate, tensor.placements)
    except LayoutError as exc:
        raise LayoutError(f"{name!r}: {exc}") from None
    local = inner_tensor(tensor.to_local())
    if tuple(local.shape) != local_shape:
        raise LayoutError(
            f"{name!r} is a DTensor whose local tensor has shape {list(local.shape)}, but its placements "
            f"{list(tensor.placements)} on mesh {list(mesh.shape)} give {list(local_shape)}; ckptd supports "
            "DTensors whose shards split like torch.chunk"
        )
    return [Fragment(name, global_shape, p.box, local[_slices(p.local)]) for p in pieces]


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))


# ------------------------------------------------------------------ a whole state


@dataclass(frozen=True, eq=False)
class EntryLayout:
    """One tensor entry of a rank's state with its fragments (one or more, all of one logical tensor).

    check_equal: the entry matched a Replicated(check_equal=True) rule, so every TP rank must hold
    the same values: pass it to `verify_replicated` with the TP group.
    """

    entry: TensorEntry
    global_shape: tuple[int, ...]
    fragments: tuple[Fragment, ...]
    check_equal: bool


def layout_state(flat: FlatState, rules: LayoutRules | None = None, coords: RankCoords | None = None) -> list[EntryLayout]:
    """`fragments_of` for every entry of a flattened state, in order: what save and load need.

    Optimizer state and master copies are checked against their parameter's local shape (the
    entry "model/<fqn>", or one of its aliases). A tied tensor's names (entry name and aliases)
    must match the same rule, or none: otherwise LayoutError. After the first call,
    `rules.unused()` tells which rules matched nothing. A per-rank entry (`TensorEntry.per_rank`)
    that no rule matches is one whole fragment under `per_rank_name(name, flat.rank)`.
    """
    taken = {n for e in flat.tensors for n in (e.name, *e.aliases)} if any(e.per_rank for e in flat.tensors) else set()
    param_shapes = {
        layout_key(name): tuple(e.tensor.shape)
        for e in flat.tensors
        for name in (e.name, *e.aliases)
        if name.startswith("model/")
    }
    out = []
    renamed: dict[str, str] = {}  # stored name -> the entry stored under it by a renaming rule
    for entry in flat.tensors:
        rule = _entry_rule(entry, rules)
        param_shape = None if entry.name.startswith("model/") else param_shapes.get(layout_key(entry.name))
        tensor = entry.tensor if isinstance(entry.tensor, DTensor) else inner_tensor(entry.tensor)
        if entry.placement is not None:  # a LocalShard: its box is given
            offsets, global_shape = entry.placement
            fragments = [Fragment(entry.name, global_shape, Box(offsets, tuple(tensor.shape)), tensor)]
            rule = None
        elif isinstance(tensor, DTensor):
            fragments = fragments_of(entry.name, tensor, rules, coords)
        elif entry.per_rank and rule is None:
            fragments = [_own_fragment(entry, flat.rank, taken)]
        else:
            fragments = _ruled_fragments(entry.name, tensor, rule, coords, param_shape)
        if rule is not None and isinstance(rule.layout, RENAMING):
            _check_renamed(entry, fragments[0].name, rule, flat, renamed)
        check = rule is not None and isinstance(rule.layout, Replicated) and rule.layout.check_equal
        out.append(EntryLayout(entry, fragments[0].global_shape, tuple(fragments), check))
    return out


def whole_fragments(flat: FlatState, tensors: list[torch.Tensor], shapes: list[torch.Size]) -> tuple[tuple[TensorEntry, Fragment], ...]:
    """What `layout_state(flat)` without rules gives, as (entry, fragment) pairs in entry order,
    for entries of plain tensors (torch.Tensor, nn.Parameter: the caller's to know): each tensor
    one fragment, of all of it under its name (a per-rank entry's: `per_rank_name`), or for a
    LocalShard's entry the box its placement gives (its offsets, the tensor's shape) in the
    global shape it gives. tensors, shapes: the entries' tensors and their shapes, in order.

    Made by C-level maps over the entries; fragments of one place (shape, or a LocalShard's
    offsets, global shape and shape) share their global shape and Box (immutable both), made
    once per distinct place."""
    entries = flat.tensors
    placements = list(map(_PLACEMENT, entries))
    if {None}.issuperset(placements):  # the common state: every fragment all of its tensor
        whole = {shape: _fragment_place(None, shape) for shape in set(shapes)}
        made = list(map(whole.__getitem__, shapes))
    else:
        places = {key: _fragment_place(*key) for key in set(zip(placements, shapes))}
        made = list(map(places.__getitem__, zip(placements, shapes)))
    fragments = list(map(Fragment, map(_NAME, entries), map(_GLOBAL_SHAPE, made), map(_BOX, made), tensors))
    if any(map(_PER_RANK, entries)):
        taken = {n for e in entries for n in (e.name, *e.aliases)}
        for i, entry in enumerate(entries):
            if entry.per_rank and entry.placement is None:  # a LocalShard's box is given: never the rank's own
                fragments[i] = _own_fragment(entry, flat.rank, taken)
    return tuple(zip(entries, fragments))


def _fragment_place(placement: tuple[tuple[int, ...], tuple[int, ...]] | None, shape: torch.Size) -> tuple[tuple[int, ...], Box]:
    """(global shape, box) of a fragment of a tensor of `shape`: all of it, or where a LocalShard's
    placement (offsets, global shape) puts it (layout_state's rule, which this must equal)."""
    if placement is None:
        return tuple(shape), Box.full(shape)
    offsets, global_shape = placement
    return global_shape, Box(offsets, tuple(shape))


_NAME, _PLACEMENT, _PER_RANK = itemgetter(0), itemgetter(4), itemgetter(6)  # TensorEntry's fields
_GLOBAL_SHAPE, _BOX = itemgetter(0), itemgetter(1)


def _own_fragment(entry: TensorEntry, rank: int, taken: set[str]) -> Fragment:
    """A rank's own extras tensor: all of it, under its per-rank name (every rank's is stored)."""
    name = per_rank_name(entry.name, rank)
    if name in taken:
        raise LayoutError(
            f"{entry.name!r} is stored per rank as {name!r}, which is the name of another tensor of the state; "
            "rename that key, or declare a layout for one of them (a layout rule such as Replicated)"
        )
    shape = tuple(inner_tensor(entry.tensor).shape)
    return Fragment(name, shape, Box.full(shape), inner_tensor(entry.tensor), per_rank=True)


def _check_renamed(entry: TensorEntry, stored: str, rule: Rule, flat: FlatState, renamed: dict[str, str]) -> None:
    """A tensor stored under another name must be the only one of this rank stored there, and untied."""
    if entry.aliases:
        raise LayoutError(
            f"{entry.name!r} is tied to {list(entry.aliases)} and matches renaming rule {rule.pattern!r}; a tied tensor "
            "is stored under its first name: let the rule match none of its names, or untie them"
        )
    other = renamed.get(stored)
    if other is None and any(stored in (e.name, *e.aliases) for e in flat.tensors if e is not entry):
        other = stored
    if other is not None:
        raise LayoutError(
            f"{entry.name!r} is stored as {stored!r} by rule {rule.pattern!r}, but this rank also holds {other!r} "
            "stored under that name; tie the two (one tensor) or fix the rule"
        )
    renamed[stored] = entry.name


def _entry_rule(entry: TensorEntry, rules: LayoutRules | None) -> Rule | None:
    if rules is None:
        return None
    own = {layout_key(name) for name in (entry.name, *entry.aliases)}
    matched = {name: _own_copy(rules.match(layout_key(name)), own) for name in (entry.name, *entry.aliases)}
    distinct = {id(rule): rule for rule in matched.values()}
    if len(distinct) > 1:
        described = ", ".join(f"{n!r} -> {r.pattern if r else 'no rule'}" for n, r in matched.items())
        raise LayoutError(f"the names of one tied tensor match different layout rules ({described}); make them agree")
    return matched[entry.name]


def _own_copy(rule: Rule | None, own: set[str]) -> Rule | None:
    """None for a StoredAs rule naming a tensor the entry is tied to (nothing to store apart)."""
    if rule is not None and isinstance(rule.layout, StoredAs) and rule.layout.name in own:
        return None
    return rule
