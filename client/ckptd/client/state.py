"""A training state as flat, named tensors plus JSON extras, and back (docs/architecture.md section 4).

`flatten_state` reads what a user passes to save/load:

    {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": {"epoch": 3}}

Top-level keys choose the kind of the tensors under them ("model", "master", "optimizer" are
themselves, any other key is "extra"); values choose how they are read:

- nn.Module: its state_dict(); tensors named "<key>/<fqn>", the FQN canonical as
  torch.distributed.checkpoint.state_dict names it (and names the optimizer state): without the
  prefixes of wrappers (DDP's "module.", torch.compile's "_orig_mod.", FSDP's
  "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."), so a checkpoint of a wrapped model
  loads into the bare one and back, and its model files are the bare model's. Tensors that
  share memory (tied embeddings) become one entry under the first name, with the other names as aliases.
  `*._extra_state` items and other non-tensor items go to the extras.
- torch.optim.Optimizer: torch.distributed.checkpoint's get_optimizer_state_dict, which keys
  the state by parameter name (FQN) instead of by integer id, so it needs the model of the same
  state under "model". Tensors are named "<key>/state/<fqn>/<field>" (a tied parameter's state
  has its other FQNs as aliases); param_groups go to the extras. A fresh optimizer (no step
  taken yet) gets its state initialized by a zero-lr step, which gives a load the tensors to
  fill; when saving, that state is taken out of the optimizer again and the checkpoint marks the
  optimizer fresh, so a save before the first step changes neither the training that goes on
  nor a resume from it (Adam's step count starts at 0 in both).
- anything with state_dict()/load_state_dict() (LR schedulers, user objects): its state_dict
  tree, tensors named "<key>/<path>".
- tensors and JSON-able values (see ckptd.client.tree): tensors named "<key>/<path>".

The tensors of the last two under an extras key (not "model", "master" or "optimizer") are the
rank's own (`TensorEntry.per_rank`): unless their layout is declared (a DTensor, a LocalShard, a
layout rule), every rank's copy is stored, under `names.per_rank_name` (ckptd.client.layout),
and comes back to that rank, as its JSON extras do (docs/usage.md: extras).

Loading is the same walk on the load side: `flatten_state` of a fresh state of the same
structure yields the same names, dtypes and shapes; the transport copies the checkpoint's
bytes into those entries' tensors in place (for modules and optimizers they are the live
parameters and state); then `restore_state` puts back what in-place copies cannot.
No I/O and no gRPC here.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, itemgetter, methodcaller
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel

from ckptd.client import tree
from ckptd.client.shards import LocalShard, LocalShards
from ckptd.client.fqns import module_fqns
from ckptd.client.plain_entries import entries_fingerprint, plain_entries_valid
from ckptd.client.subclasses import check_wrapper
from ckptd.client.ties import memory_key, shared_names
from ckptd.common import dtypes
from ckptd.common.names import InvalidNameError, check_tensor_name, kind_of
from ckptd.format.file_plan import RNG_KEY

log = logging.getLogger("ckptd.client")

# Marks, in the saved optimizer's extras, an optimizer that had taken no step when it was saved.
FRESH_OPTIMIZER = "ckptd_fresh"
MODEL_KEY = "model"
_EXTRA_STATE_SUFFIX = "_extra_state"  # torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX


class TensorEntry(NamedTuple):
    """One logical tensor of a rank's state (a named tuple: a save makes one per tensor, and a
    tuple is made in C).

    name: "<top-level key>/<path>", e.g. "model/embed.weight". kind: model, master, optimizer
    or extra. tensor: the live tensor (may be non-contiguous). aliases: the other logical names
    of the same memory (tied weights), stored once under `name`. frozen: what a module does not
    train: "param" (a parameter with requires_grad=False), "buffer", or "" (ckptd.common.names.FROZEN_CLASSES); the
    daemon stores frozen tensors in files of their own, linked into the next step when unchanged.
    """

    name: str
    kind: str
    tensor: torch.Tensor
    aliases: tuple[str, ...] = ()
    placement: "tuple[tuple[int, ...], tuple[int, ...]] | None" = None  # (offsets, global shape) of a LocalShard
    frozen: str = ""
    # this rank's own extras tensor: stored per rank unless a layout rule matches it (ckptd.client.layout)
    per_rank: bool = False


# TensorEntry's fields and tensors' attributes, read by C-level maps over whole lists
_NAME, _TENSOR = itemgetter(0), itemgetter(2)
_PARTED, _BEFORE_SLASH = methodcaller("partition", "/"), itemgetter(0)
_DTYPE, _SHAPE, _DEVICE = attrgetter("dtype"), attrgetter("shape"), attrgetter("device")
_PLAIN_TENSORS = frozenset({torch.Tensor, nn.Parameter})


@dataclass(frozen=True)
class FlatState:
    """A rank's state as tensors in a deterministic order plus JSON-able extras {top key: tree}."""

    tensors: tuple[TensorEntry, ...]
    extras: dict[str, Any]
    # keys of optimizers that had no state before this flattening gave them one (a load that
    # finds nothing to load makes them fresh again: `unfresh`)
    fresh: tuple[str, ...] = ()
    rank: int = 0  # the rank this state is of: names its per-rank tensors (ckptd.client.layout)
    extras_text: str | None = field(default=None, repr=False, compare=False)  # extras_json when known (StateWalk)

    def unfresh(self, state: Mapping[str, Any]) -> None:
        """Take back the state this flattening initialized in fresh optimizers of `state`."""
        for key in self.fresh:
            state[key].state.clear()

    @functools.cached_property
    def extras_json(self) -> str:
        """The extras as the strict JSON text a save sends (made once per flat state: a state
        walked again unchanged is the same FlatState, ckptd.client.walk.StateWalk)."""
        return self.extras_text if self.extras_text is not None else json.dumps(self.extras, allow_nan=False)

    @functools.cached_property
    def tensor_kinds(self) -> frozenset[str]:
        """The top-level keys its tensors' names begin with."""
        return frozenset(map(_BEFORE_SLASH, map(_PARTED, map(_NAME, self.tensors))))

    def fingerprint(self) -> str:
        """A hex digest of every entry's (name, kind, dtype, shape, aliases, frozen, per_rank), in order.

        Equal across processes and runs for equal metadata; tensor values do not enter it.
        """
        tensors = list(map(_TENSOR, self.tensors))
        return entries_fingerprint(self.tensors, list(map(_DTYPE, tensors)), list(map(_SHAPE, tensors)))


def flatten_state(
    state: Mapping[str, Any], *, rank: int, rng: bool = False, for_save: bool = False, validate: bool = True
) -> FlatState:
    """The tensors and extras of `state` (see the module docstring); nothing is copied.

    for_save: the flat state is about to be saved: fresh optimizers are left fresh (see above).
    validate=False skips the per-tensor checks of names, layouts and dtypes (duplicate names
    are still refused): for a caller that has checked a state of the same structure before and
    calls `validate_entries` whenever the structure is new (ckptd.client.structure).

    rng=True adds the random generators' states under the extras key "rng": torch's CPU (and
    CUDA) generators as tensors named "rng/rank<rank>/...", Python's and NumPy's as JSON.
    Raises TypeError/ValueError naming the key for values that cannot be checkpointed.
    """
    check_state(state, rng)
    entries = Entries(validate)
    extras: dict[str, Any] = {}
    fresh_keys: list[str] = []
    for key in sorted(state):
        encoded = flatten_value(state, key, entries, for_save, fresh_keys)
        if encoded is not None:
            extras[key] = encoded
    if rng:
        extras[RNG_KEY] = flatten_rng(rank, entries)
    return FlatState(tuple(entries.entries), extras, tuple(fresh_keys), rank)


def flatten_value(state: Mapping[str, Any], key: str, entries: Entries, for_save: bool, fresh_keys: list[str]) -> Any:
    """Add the tensors of state[key] to `entries`; return its extras tree (None: none)."""
    value = state[key]
    kind = kind_of(key)
    if isinstance(value, nn.Module):
        return _flatten_module(key, value, entries)
    if isinstance(value, torch.optim.Optimizer):
        model = model_of(state, key)
        fresh = not value.state
        optimizer_state = _optimizer_state(model, key, value)
        if fresh and for_save:
            value.state.clear()  # the tensors stay referenced by this flat state until copied
            optimizer_state = {**optimizer_state, FRESH_OPTIMIZER: True}
        elif fresh:
            fresh_keys.append(key)
        return tree.encode(optimizer_state, key, *_optimizer_adders(key, model, entries))
    per_rank = kind == "extra"  # a tree's tensors under an extras key: the rank's own
    add, add_plain = entries.adder(kind, per_rank), entries.plain_adder(kind, per_rank)
    if is_stateful(value):
        return tree.encode(value.state_dict(), key, add, add_plain)
    return tree.encode(value, key, add, add_plain)


def flatten_rng(rank: int, entries: Entries) -> Any:
    """Add the random generators' tensors to `entries`, named by rank already (and optional on
    load: the daemon's load planner); return their extras tree."""
    return tree.encode(_rng_state(), f"{RNG_KEY}/rank{rank}", entries.adder(kind_of(RNG_KEY)))


# ------------------------------------------------------------------ flatten


def validate_entries(flat: FlatState) -> None:
    """The checks `flatten_state(validate=False)` skipped: every name and alias is a valid
    tensor name, every tensor is strided, materialized and of a dtype ckptd stores. Raises
    ValueError/TypeError naming the tensor and how to fix it."""
    tensors = list(map(_TENSOR, flat.tensors))
    if _PLAIN_TENSORS.issuperset(map(type, tensors)) and plain_entries_valid(flat.tensors, tensors, list(map(_DTYPE, tensors)), list(map(_DEVICE, tensors))):
        return
    for entry in flat.tensors:
        for name in (entry.name, *entry.aliases):
            _check_tensor(name, entry.tensor)


class Entries:
    """Collects entries in order; refuses duplicate names and (when validating) tensors without storable data."""

    def __init__(self, validate: bool = True) -> None:
        self.entries: list[TensorEntry] = []
        self.names: set[str] = set()
        self.chunked: set[str] = set()  # the name of the LocalShards being added
        self.validate = validate

    def adder(self, kind: str, per_rank: bool = False) -> Callable[[str, "torch.Tensor | LocalShard | LocalShards"], None]:
        """Adds the tensors of a tree; per_rank: plain tensors among them (not a DTensor or a
        LocalShard, whose layout is given) are the rank's own (TensorEntry.per_rank)."""

        def add(name: str, value: torch.Tensor | LocalShard | LocalShards) -> None:
            if isinstance(value, LocalShard):
                self.add(TensorEntry(name, kind, value.tensor, placement=(value.offsets, value.global_shape)))
            elif isinstance(value, LocalShards):
                for shard in value.shards:  # one entry per box, all under the tensor's name
                    self.add(TensorEntry(name, kind, shard.tensor, placement=(shard.offsets, shard.global_shape)), chunk=True)
                self.chunked.discard(name)  # the next value of this name is another tensor
            else:
                self.add(TensorEntry(name, kind, value, per_rank=per_rank and not isinstance(value, DTensor)))

        return add

    def plain_adder(self, kind: str, per_rank: bool = False) -> tree.AddPlainTensors:
        """Adds plain tensors (torch.Tensor, nn.Parameter) of a tree several at once, exactly as
        `adder(kind, per_rank)` adds them one by one (tree.encode's add_plain_tensors)."""

        def add_plain(names: list[str], tensors: list[torch.Tensor]) -> None:
            self.add_plain(kind, per_rank, names, tensors)

        return add_plain

    def add_plain(self, kind: str, per_rank: bool, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Add entries (name, kind, tensor) of plain tensors, the rank's own when per_rank: as
        `add` one by one, at C speed when there is nothing to check (not validating, no name
        taken twice)."""
        new = set(names)
        if self.validate or len(new) != len(names) or not self.names.isdisjoint(new):
            for name, tensor in zip(names, tensors):  # one by one: the checks, the error for a duplicate
                self.add(TensorEntry(name, kind, tensor, per_rank=per_rank))
            return
        self.names |= new
        # TensorEntry's fields in order, made into entries by tuple.__new__ in C (what TensorEntry(...) makes)
        fields = zip(names, repeat(kind), tensors, repeat(()), repeat(None), repeat(""), repeat(per_rank))
        self.entries.extend(map(tuple.__new__, repeat(TensorEntry), fields))

    def add(self, entry: TensorEntry, chunk: bool = False) -> None:  # chunk: a box of a LocalShards (they share a name)
        for name in (entry.name, *entry.aliases):
            if self.validate:
                _check_tensor(name, entry.tensor)
            if name in self.names and not (chunk and name in self.chunked):
                raise ValueError(
                    f"two tensors of the state are both named {name!r}; rename a key so that "
                    "no key path joined with '/' equals another"
                )
            self.names.add(name)
        if chunk:
            self.chunked.add(entry.name)
        self.entries.append(entry)


def check_state(state: Mapping[str, Any], rng: bool) -> None:
    if not isinstance(rng, bool):
        raise TypeError(f"rng={rng!r}: pass True (save or load the random generators' states too) or False")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping such as {{'model': model, 'optimizer': optimizer}}, got {type(state).__name__}")
    if not state:
        raise ValueError("state is empty: pass what to checkpoint, e.g. {'model': model, 'optimizer': optimizer}")
    for key in state:
        if not isinstance(key, str):
            raise TypeError(f"state key {key!r} is a {type(key).__name__}: top-level keys must be strings such as 'model'")
        if not key or "/" in key:
            raise ValueError(f"state key {key!r} must be a non-empty string without '/'")
    if rng and RNG_KEY in state:
        raise ValueError(f"state has a key {RNG_KEY!r}, which rng=True uses for the random generators; rename the key")


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    try:
        check_tensor_name(name)
    except InvalidNameError as exc:
        raise ValueError(f"cannot checkpoint {name!r}: {exc}") from None
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    check_wrapper(name, local)
    if local.is_nested:  # torch.nested's strided layout: no sizes of its own to store (its jagged one is a wrapper, refused above)
        raise TypeError(
            f"cannot checkpoint {name!r}: it is a nested tensor, whose components have shapes of their own; save its "
            "components as tensors of their own (tensor.unbind()) or a padded copy (tensor.to_padded_tensor(0)) and "
            "rebuild it after a load"
        )
    if tensor.layout != torch.strided:
        raise TypeError(f"cannot checkpoint {name!r}: it is a {tensor.layout} tensor; convert it with .to_dense() first")
    if local.is_neg():  # ckptd copies memory as it is: a save would store, and a load write, the values negated
        raise ValueError(
            f"cannot checkpoint {name!r}: it is a lazily negated view (torch's negative bit, is_neg() is True: e.g. the "
            ".imag of a conjugated view), whose memory holds the negatives of its values; checkpoint tensor.resolve_neg() "
            "or the tensor it views instead"
        )
    if local._is_zerotensor():  # no memory at all: a copy would read, or write, address 0
        raise ValueError(f"cannot checkpoint {name!r}: it is one of torch's efficient zero tensors, which have no memory; checkpoint torch.zeros_like(tensor)")
    if tensor.is_meta:
        raise ValueError(
            f"cannot checkpoint {name!r}: it is on the meta device and has no data; "
            "materialize it first (e.g. module.to_empty(device='cpu') and initialize it)"
        )
    try:
        dtypes.from_torch_name(str(tensor.dtype))
    except dtypes.UnknownDtypeError as exc:
        raise TypeError(f"cannot checkpoint {name!r}: {exc}") from None


def _flatten_module(key: str, module: nn.Module, entries: Entries) -> Any:
    """Add the module's state_dict tensors (tied ones once, with aliases); return its other items encoded, or None."""
    kind = kind_of(key)
    tensor_of: dict[str, torch.Tensor] = {}
    others: dict[str, Any] = {}
    canonical_of: dict[str, str] = {}  # canonical FQN -> state_dict key
    canonical = module_fqns(module)
    frozen_of = _frozen_names(module) if kind == "model" else {}
    frozen_by_name: dict[str, str] = {}
    for wrapped_fqn, value in module.state_dict().items():
        fqn = canonical(wrapped_fqn)
        if canonical_of.setdefault(fqn, wrapped_fqn) != wrapped_fqn:
            raise ValueError(
                f"state[{key!r}]: the state_dict keys {canonical_of[fqn]!r} and {wrapped_fqn!r} both name "
                f"{fqn!r} once the wrappers' prefixes are taken out"
            )
        name = f"{key}/{fqn}"
        if not isinstance(value, torch.Tensor) or fqn.endswith(_EXTRA_STATE_SUFFIX):
            # Extra state is produced on demand, not a view of the module: restored by load_state_dict.
            others[fqn] = value
            continue
        tensor_of[name] = value
        frozen_by_name[name] = frozen_of.get(wrapped_fqn, "")
    for name, aliases in shared_names(tensor_of.items(), memory_key).items():
        entries.add(TensorEntry(name, kind, tensor_of[name], tuple(aliases), frozen=frozen_by_name[name]))
    return tree.encode(others, key, entries.adder(kind)) if others else None


def _frozen_names(module: nn.Module) -> dict[str, str]:
    """What `module` does not train, by its own (state_dict) names: parameters with
    requires_grad=False ("param") and buffers ("buffer"). Tied parameters are one Parameter, so
    every name of a tied group agrees. Empty when every parameter trains and there are no buffers."""
    frozen = {name: "buffer" for name, _ in module.named_buffers(remove_duplicate=False)}
    frozen.update((name, "param") for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad)
    return frozen


def wrapped_key(model: nn.Module, fqn: str) -> str:
    """The key that model.load_state_dict takes for canonical `fqn`: DDP's and torch.compile's
    prefixes put back where the module tree has such wrappers (FSDP and checkpoint wrappers take
    canonical keys: their load hooks put their own prefixes back)."""
    parts = fqn.split(".")
    out: list[str] = []
    obj: Any = model
    for i, part in enumerate(parts):
        while True:
            if isinstance(obj, DistributedDataParallel):
                out.append("module")
                obj = obj.module
            elif isinstance(obj, torch._dynamo.eval_frame.OptimizedModule):
                out.append("_orig_mod")
                obj = obj._orig_mod
            else:
                break
        nxt = getattr(obj, part, None) if isinstance(obj, nn.Module) else None
        if not isinstance(nxt, nn.Module):
            out.extend(parts[i:])  # a parameter, buffer or extra state: the rest is as it is
            break
        out.append(part)
        obj = nxt
    return ".".join(out)


def model_of(state: Mapping[str, Any], key: str) -> nn.Module:
    model = state.get(MODEL_KEY)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"state[{key!r}] is an optimizer, whose state ckptd keys by parameter name: put its model "
            f"in the same state under {MODEL_KEY!r}, e.g. {{'model': model, {key!r}: optimizer}}"
        )
    return model


def _optimizer_state(model: nn.Module, key: str, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    try:
        return get_optimizer_state_dict(model, optimizer)
    except (KeyError, ValueError, RuntimeError, AssertionError) as exc:
        raise ValueError(
            f"cannot read the optimizer state of state[{key!r}] by parameter name ({type(exc).__name__}: {exc}); "
            f"every parameter the optimizer updates must belong to state[{MODEL_KEY!r}]"
        ) from exc


def _optimizer_adders(key: str, model: nn.Module, entries: Entries) -> tuple[Callable[[str, torch.Tensor], None], tree.AddPlainTensors | None]:
    """The adder of optimizer tensors; the state of a tied parameter also gets the names under its other FQNs.
    With it, for a model without tied parameters (no aliases to give), the adder of a dict's
    plain tensors at once (tree.encode's add_plain_tensors; None for a tied model).

    As aliases, these names let a checkpoint of a tied model load into an untied one.
    """
    tied = _tied_parameter_names(model)
    kind = kind_of(key)

    def add(name: str, tensor: torch.Tensor) -> None:
        parsed = optimizer_state_name(name)
        aliases: tuple[str, ...] = ()
        if parsed is not None and parsed[1] in tied:
            aliases = tuple(f"{key}/state/{other}/{parsed[2]}" for other in tied[parsed[1]])
        entries.add(TensorEntry(name, kind, tensor, aliases))

    return add, None if tied else entries.plain_adder(kind)


def optimizer_state_name(name: str) -> tuple[str, str, str] | None:
    """(optimizer key, parameter FQN, field path) of an optimizer state tensor's name
    "<key>/state/<fqn>/<field>", else None."""
    parts = name.split("/", 3)
    return (parts[0], parts[2], parts[3]) if len(parts) == 4 and parts[1] == "state" else None


def _tied_parameter_names(model: nn.Module) -> dict[str, list[str]]:
    """{first FQN: [other FQNs]} of every parameter that the model holds under several names."""
    canonical = module_fqns(model)
    named = [(canonical(name), param) for name, param in model.named_parameters(remove_duplicate=False)]  # as the optimizer state names them
    return {first: others for first, others in shared_names(named, id).items() if others}


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state
