"""Putting a loaded checkpoint back into the state the user passed (the other half of
ckptd.client.state, which flattens it): the transport has filled the flattened state's tensors
in place; `restore_state` puts back what in-place copies cannot (docs/architecture.md section 4).
No I/O and no gRPC here."""

from __future__ import annotations

import logging
import random
from collections.abc import MutableMapping, Set
from typing import Any, Callable, Literal, Mapping

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from ckptd.client import tree
from ckptd.client.state import FRESH_OPTIMIZER, FlatState, is_stateful, model_of, optimizer_state_name, wrapped_key
from ckptd.format.file_plan import RNG_KEY

log = logging.getLogger("ckptd.client")


def restore_state(
    state: Mapping[str, Any], targets: FlatState, extras: dict[str, Any], *, strict: bool | Literal["missing"] = True, never_stepped: Set[str] = frozenset()
) -> None:
    """Put a loaded checkpoint back into `state` once the transport has filled `targets`.

    targets: `flatten_state(state, ...)` whose tensors now hold the checkpoint's values.
    extras: the checkpoint's extras {top key: tree} of this rank.
    - modules: already restored by the in-place fill (state_dict tensors share the parameters'
      memory, so tied weights stay tied); load_state_dict is called only for their non-tensor
      items (extra state);
    - optimizers: set_optimizer_state_dict with the filled tensors and the saved param_groups
      (the load side's structure: see _restore_optimizer);
    - stateful objects: load_state_dict of the saved tree;
    - tensors: copied into in place; lists: their items replaced in place;
    - dicts: updated in place (cleared, then filled), so references to them see the values;
      an item of the state's dict holding tensors that the checkpoint's tree does not name stays
      (a rank's tree names the tensors that rank saved: in another layout, a rank holds tensors
      other ranks saved, and the fill has put their values in);
    - other values (int, str, tuple, ...) cannot change in place: state[key] is replaced,
      which needs a mutable mapping (pass a dict, or wrap the value in a dict);
    - "rng" (when targets has it): every generator is set back.
    never_stepped: tensors of fresh optimizers ("<key>/state/<fqn>/<field>") that the step has
    no state for (the parameter had no gradient yet): their parameters get no state, as at the save.
    A key that needs extras the checkpoint lacks raises ValueError when strict, else is left
    as it is with a warning. A tensor of the checkpoint's tree that the state has no place for
    raises ValueError when strict is True; with strict False or "missing" it is left out (a
    warning names it) and a dict keeps its own items the checkpoint does not hold.

    A key of plain values whose extras are the very object `targets.extras` holds for it (the
    caller found the checkpoint's extras JSON equal to the targets' own, `FlatState.extras_json`,
    and passes `targets.extras`) needs nothing put back: its values equal the checkpoint's and
    the fill put the tensors' values in place. Modules, optimizers, stateful objects and the RNG
    state are restored as always.
    """
    tensors = _TensorLookup(targets, strict is True)
    for key in sorted(state):
        value = state[key]
        if isinstance(value, nn.Module) and key not in targets.extras:
            continue  # only tensors, and the transport has filled them in place
        if key not in extras:
            if not _filled_whole(key, value, targets):
                _missing(key, strict)
            continue
        if isinstance(value, torch.optim.Optimizer):
            live = tree.decode(targets.extras[key], tensors.getter(key))
            unstepped = {parsed[1] for parsed in map(optimizer_state_name, never_stepped) if parsed is not None and parsed[0] == key}
            _restore_optimizer(state, key, value, live, extras[key], unstepped)
            continue
        plain = not isinstance(value, nn.Module) and not is_stateful(value)
        if plain and extras[key] is targets.extras.get(key):
            continue  # the checkpoint's own values: nothing to put back
        loaded = tree.decode(extras[key], tensors.getter(key))
        if strict is not True:  # tensors without a place in the state are left out
            loaded = _placed(loaded, key)
        if isinstance(value, nn.Module):
            _restore_module_items(key, value, loaded)
        elif is_stateful(value):
            value.load_state_dict(loaded)
        else:
            _put_back(state, key, value, loaded, keep_own=strict is not True, named=tensors.handed_out)
    if RNG_KEY in targets.extras and RNG_KEY not in state:
        if RNG_KEY not in extras:
            # e.g. a rank that did not exist when the checkpoint was saved (more ranks now)
            log.warning("the checkpoint has no RNG state for this rank: the generators are left as they are")
        else:
            _set_rng_state(tree.decode(extras[RNG_KEY], tensors.getter(RNG_KEY)))


def keys_without_values(state: Mapping[str, Any], targets: FlatState, extras: Mapping[str, Any]) -> list[str]:
    """The keys of `state` that a checkpoint with these `extras` has no value for, which
    `restore_state` refuses when strict: what a load checks before the fill writes a byte, so
    that a refused load leaves the state as it was."""
    return [key for key in sorted(state) if key not in extras and not _filled_whole(key, state[key], targets)]


def _filled_whole(key: str, value: Any, targets: FlatState) -> bool:
    """Whether the fill alone restores state[key], so it needs no extras of the checkpoint: a
    module of tensors only, or a tree of nothing but tensors (str-keyed dicts and lists: a step
    saved from a module loads into a plain dict of its tensors)."""
    if isinstance(value, nn.Module):
        return key not in targets.extras
    return not is_stateful(value) and not isinstance(value, torch.optim.Optimizer) and key in targets.extras and _only_tensors(targets.extras[key])


def _only_tensors(encoded: Any) -> bool:
    """Whether an encoded extras tree (ckptd.client.tree) holds tensors and nothing else, in
    dicts of str keys and lists; not an empty one (a container to be filled with the
    checkpoint's values)."""
    if isinstance(encoded, dict):
        if len(encoded) == 1 and next(iter(encoded)) in tree.TAGS:
            return tree.TENSOR in encoded
        return bool(encoded) and all(map(_only_tensors, encoded.values()))
    if isinstance(encoded, list):
        return bool(encoded) and all(map(_only_tensors, encoded))
    return False


class _NoPlace:
    """Stands for a tensor of the checkpoint's tree that the state has no place for (not strict)."""


_NO_PLACE = _NoPlace()


class _TensorLookup:
    """The targets' tensors by every name and alias, gathered at the first key that asks. A name
    without a target raises ValueError when `strict`, else is _NO_PLACE (left out by _placed)."""

    def __init__(self, targets: FlatState, strict: bool) -> None:
        self._targets = targets
        self._strict = strict
        self._found: dict[str, torch.Tensor] | None = None
        self.handed_out: set[int] = set()  # id() of every target tensor a tree named

    def getter(self, key: str) -> Callable[[str], Any]:
        def get(name: str) -> Any:
            if self._found is None:
                self._found = {n: e.tensor for e in self._targets.tensors for n in (e.name, *e.aliases)}
            found = self._found.get(name, _NO_PLACE)
            if found is _NO_PLACE and self._strict:
                raise ValueError(
                    f"the checkpoint's value of {key!r} holds a tensor {name!r} that the state being loaded has "
                    f"no place for; give state[{key!r}] the structure it had when it was saved (or load with strict=False)"
                )
            if found is _NO_PLACE:
                log.warning("the checkpoint's tensor %r has no place in the state being loaded: left out", name)
            else:
                self.handed_out.add(id(found))
            return found

        return get


def _placed(loaded: Any, key: str) -> Any:
    """`loaded` without the dict items whose tensor had no place in the state (_NO_PLACE)."""
    if isinstance(loaded, dict):
        return {k: _placed(v, key) for k, v in loaded.items() if v is not _NO_PLACE}
    if isinstance(loaded, (list, tuple)):
        if any(item is _NO_PLACE for item in loaded):
            raise ValueError(
                f"the checkpoint's value of {key!r} holds a list with a tensor the state being loaded has no place for; "
                f"give state[{key!r}] the structure it had when it was saved"
            )
        return type(loaded)(_placed(item, key) for item in loaded)
    return loaded


def _missing(key: str, strict: bool | Literal["missing"]) -> None:
    if strict:
        raise ValueError(f"the checkpoint has no value for {key!r}; save it with that key, or leave it out of the load")
    log.warning("the checkpoint has no value for %r: left as it was", key)


class _SavedTensor:
    """Stands for a tensor of the checkpoint's tree: its bytes are already in the targets."""


_SAVED_TENSOR = _SavedTensor()


def _restore_optimizer(
    state: Mapping[str, Any], key: str, optimizer: torch.optim.Optimizer, live: Any, saved_json: Any, never_stepped: Set[str] = frozenset()
) -> None:
    """Load the optimizer with the load side's structure and filled tensors plus the saved non-tensor values.

    The structure (which parameters, which fields, the params of each group) is the load side's,
    so a checkpoint of a tied model loads into an untied one (the tensors came by alias); the
    checkpoint gives the param_groups' hyperparameters and non-tensor state fields.
    never_stepped: the FQNs of parameters whose state the load initialized (a fresh optimizer)
    and the checkpoint has none of (no gradient yet when saved): they get none, as torch's
    load_state_dict leaves them.
    """
    saved = tree.decode(saved_json, lambda name: _SAVED_TENSOR)
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and isinstance(saved.get("param_groups"), list)):
        raise ValueError(f"the checkpoint's value of {key!r} is not an optimizer state that ckptd wrote")
    if len(saved["param_groups"]) != len(live["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimizer {key!r} has {len(saved['param_groups'])} parameter groups, "
            f"the one being loaded has {len(live['param_groups'])}; build the optimizer with the same groups"
        )
    for group, saved_group in zip(live["param_groups"], saved["param_groups"]):
        group.update((k, v) for k, v in saved_group.items() if k != "params" and v is not _SAVED_TENSOR)
    for fqn, fields in live["state"].items():
        saved_fields = saved["state"].get(fqn, {})
        fields.update((k, v) for k, v in saved_fields.items() if v is not _SAVED_TENSOR)
    model = model_of(state, key)
    # not torch's strict check (a trainable parameter without state): the state is the load side's
    # own, which may hold none for a parameter not stepped yet; ckptd's own checks named the tensors
    set_optimizer_state_dict(model, optimizer, optim_state_dict=live, options=_OPTIMIZER_LOAD)
    if never_stepped:
        for fqn, param in model.named_parameters(remove_duplicate=False):
            if fqn in never_stepped:
                optimizer.state.pop(param, None)
    if saved.get(FRESH_OPTIMIZER) is True:
        optimizer.state.clear()  # saved before its first step: it resumes as fresh as it was


_OPTIMIZER_LOAD = StateDictOptions(strict=False)


def _restore_module_items(key: str, module: nn.Module, items: Any) -> None:
    if not isinstance(items, dict):
        raise ValueError(f"the checkpoint's extra items of module {key!r} are a {type(items).__name__}, not a dict")
    result = module.load_state_dict({wrapped_key(module, fqn): value for fqn, value in items.items()}, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"module {key!r} does not take these saved items: {', '.join(result.unexpected_keys)}")


def _put_back(state: Mapping[str, Any], key: str, value: Any, loaded: Any, keep_own: bool = False, named: Set[int] = frozenset()) -> None:
    """Put `loaded` into state[key] (`value`) in place where it can be; keep_own: a dict keeps
    its items the checkpoint does not hold (not strict), else those holding tensors of which
    the checkpoint's trees named none (`named`: their id()s)."""
    if isinstance(value, torch.Tensor):
        if not isinstance(loaded, torch.Tensor) or loaded.shape != value.shape:
            raise ValueError(f"state[{key!r}] is a tensor of shape {list(value.shape)}; the checkpoint holds {_describe(loaded)}")
        if loaded is not value:
            with torch.no_grad():
                value.copy_(loaded)
    elif isinstance(value, dict):
        if not isinstance(loaded, dict):
            raise ValueError(f"state[{key!r}] is a dict; the checkpoint holds {_describe(loaded)}")
        merged = {**value, **loaded} if keep_own else _with_unnamed(value, loaded, named)
        value.clear()
        value.update(merged)
    elif isinstance(value, list):
        if not isinstance(loaded, list):
            raise ValueError(f"state[{key!r}] is a list; the checkpoint holds {_describe(loaded)}")
        value[:] = loaded
    elif isinstance(state, MutableMapping):
        state[key] = loaded
    else:
        raise TypeError(
            f"state[{key!r}] is a {type(value).__name__}, which cannot be changed in place, and the state is a "
            f"read-only {type(state).__name__}; pass the state as a dict or wrap the value in a dict"
        )


def _with_unnamed(own: dict[Any, Any], loaded: dict[Any, Any], named: Set[int]) -> dict[Any, Any]:
    """The checkpoint's dict `loaded` with the items of the state's dict `own` that hold tensors
    none of which the checkpoint's trees named (`named`, by id()): tensors other ranks saved,
    their values filled in place. Dicts in both are merged the same way; own's order first.
    (An item whose tensors a tree names under another structure, such as a flat template of a
    nested tree, is the checkpoint's: not kept.)"""
    out: dict[Any, Any] = {}
    for key, mine in own.items():
        if key in loaded:
            theirs = loaded[key]
            out[key] = _with_unnamed(mine, theirs, named) if isinstance(mine, dict) and isinstance(theirs, dict) else theirs
        else:
            held = _tensors_in(mine)
            if held and not any(id(t) in named for t in held):
                out[key] = mine
    out.update((key, theirs) for key, theirs in loaded.items() if key not in out)
    return out


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _set_rng_state(saved: Any) -> None:
    if not isinstance(saved, dict) or not {"torch_cpu", "python", "numpy"} <= saved.keys():
        raise ValueError("the checkpoint's 'rng' value is not a set of generator states that ckptd wrote")
    torch.set_rng_state(saved["torch_cpu"])
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    if "torch_cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["torch_cuda"])
