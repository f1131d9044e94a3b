"""A loaded training state -> ckptd's logical tensors, kinds and extras, with notes on what is
not imported. Used by `ckptd import` (importer/importing.py) for torch.save files and DCP directories.

The state is what torch.load (weights_only) or a DCP directory gives: dicts of tensors and
plain values. ckptd's names (client/ckptd/client/state.py):
- model weights: "model/<fqn>", kind "model". They are the entry "model", "state_dict" or
  "module" when it holds tensors, else the state's own top-level tensors (a bare state_dict).
  Wrapper prefixes are removed from the FQNs by the client's rule (ckptd.client.fqns.canonical_fqns:
  DDP's "module." when every name has it; "_orig_mod.", "_fsdp_wrapped_module.",
  "_checkpoint_wrapped_module."). Tensors that share memory (tied weights) become one tensor with
  the other names as aliases, by the client's rule too (ckptd.client.ties), for plain tensors only.
- optimizer state keyed by parameter name (torch.distributed.checkpoint.state_dict's
  get_optimizer_state_dict, as the client saves it): tensors "optimizer/state/<fqn>/<field>",
  kind "optimizer", and the whole state (param_groups, non-tensor fields) in the extras under
  "optimizer". State keyed by parameter index (Optimizer.state_dict()) is not imported: which
  parameter an index is cannot be known without the model.
- any other top-level key: its tensors "<key>/<path>" (kind by ckptd.common.names.kind_of) and
  its value in the extras, encoded by ckptd.client.tree, as the client encodes extras.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ckptd.client import tree
from ckptd.client.fqns import canonical_fqns
from ckptd.client.ties import memory_key, shared_names
from ckptd.common import dtypes
from ckptd.common.names import InvalidNameError, check_tensor_name, kind_of
from ckptd.daemon.importer.direct_write import DirectTensor, ImportRefused

MODEL_KEYS = ("model", "state_dict", "module")
OPTIMIZER_KEY = "optimizer"

# The tags of ckptd.client.tree's encoding (its module docstring is the format's definition).

_SHOWN = 5  # names listed in one note


@dataclass
class Mapped:
    """What a source becomes: tensors to write, rank 0's extras ({top-level key: encoded tree}),
    model files (config.json ...), notes on how names were mapped, and what was not imported
    (each with the reason)."""

    tensors: list[DirectTensor] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    model_files: dict[str, bytes] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def map_state(state: Any, where: str) -> Mapped:
    """The ckptd tensors and extras of `state` (see the module docstring); `where` names the
    source in messages. Raises ImportRefused when `state` is not a dict or holds no model
    weights, or when a model weight cannot be stored (dtype, layout, name)."""
    if not isinstance(state, dict):
        raise ImportRefused(
            f"{where} holds a {_type_name(state)}, not a dict; ckptd imports a state_dict (tensor name -> tensor), "
            f"or a dict with the state_dict under one of {', '.join(map(repr, MODEL_KEYS))}"
        )
    out = Mapped()
    model_key = next((k for k in MODEL_KEYS if isinstance(state.get(k), dict) and any(_is_tensor(v) for v in state[k].values())), None)
    if model_key is not None:
        model, rest = state[model_key], {k: v for k, v in state.items() if k != model_key}
        if model_key != "model":
            out.notes.append(f"model weights: the entry {model_key!r}")
    else:
        model = {k: v for k, v in state.items() if _is_tensor(v)}
        rest = {k: v for k, v in state.items() if not _is_tensor(v)}
        if not model:
            keys = ", ".join(map(repr, list(state)[:10])) or "none"
            raise ImportRefused(
                f"{where} holds no model weights: no tensors at its top level and none under "
                f"{', '.join(map(repr, MODEL_KEYS))} (its keys: {keys})"
            )
    add_model(model, out)
    for key, value in rest.items():
        if not isinstance(key, str) or key in MODEL_KEYS:
            why = "a name ckptd keeps for the model weights" if key in MODEL_KEYS else "not a string key"
            out.skipped.append(f"{key!r}: {why}, not imported")
        elif key == OPTIMIZER_KEY:
            _add_optimizer(value, out)
        elif _index_keyed_optimizer(value):
            out.skipped.append(f"{key!r}: {_INDEX_KEYED}")
        else:
            _add_tree(key, value, kind_of(key), out)
    return out


def add_model(model: dict[Any, Any], out: Mapped) -> None:
    """Add a model state_dict's tensors to `out` under their canonical FQNs ("model/<fqn>"),
    tied ones once with aliases; its other entries are reported as not imported."""
    tensors = {k: v for k, v in model.items() if isinstance(k, str) and _is_tensor(v)}
    others = [k for k in model if k not in tensors]
    if others:
        out.skipped.append(f"model entries that are not tensors (extra state, metadata), not imported: {_names(others)}")
    canonical = _canonical_names(list(tensors), out.notes, "model weights")
    named = {"model/" + canonical[key]: tensor for key, tensor in tensors.items()}
    aliases = shared_names(named.items(), _tie_key)
    for name, tensor in named.items():
        if name in aliases:
            out.tensors.append(direct_tensor(name, "model", tensor, tuple(aliases[name])))
    tied = sum(len(a) for a in aliases.values())
    if tied:
        out.notes.append(f"{tied} tied model weights stored once, under the first name that holds them (the others are aliases)")


_INDEX_KEYED = (
    "optimizer state keyed by parameter index (torch.optim.Optimizer.state_dict()): which parameter each index "
    "is cannot be known without the model, so it is not imported. To import it, save it keyed by parameter "
    "name: torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer)"
)


def _index_keyed_optimizer(value: Any) -> bool:
    return _optimizer_like(value) and any(not isinstance(k, str) for k in value["state"])


def _optimizer_like(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("state"), dict) and isinstance(value.get("param_groups"), list)


def _add_optimizer(value: Any, out: Mapped) -> None:
    """Optimizer state keyed by parameter name: tensors "optimizer/state/<fqn>/<field>" and the
    whole state in the extras; anything else is skipped with the reason."""
    if not _optimizer_like(value):
        out.skipped.append(f"{OPTIMIZER_KEY!r}: not an optimizer state_dict (a dict with 'state' and 'param_groups'), not imported")
        return
    if _index_keyed_optimizer(value):
        out.skipped.append(f"{OPTIMIZER_KEY!r}: {_INDEX_KEYED}")
        return
    groups = value["param_groups"]
    if not all(isinstance(g, dict) and all(isinstance(p, str) for p in g.get("params", ())) for g in groups):
        out.skipped.append(f"{OPTIMIZER_KEY!r}: its param_groups name parameters by index, not by name: {_INDEX_KEYED}")
        return
    state = value["state"]
    names = list(dict.fromkeys([*state, *(p for g in groups for p in g.get("params", ()))]))
    canonical = _canonical_names(names, out.notes, "optimizer state")
    renamed = {canonical[k]: v for k, v in state.items()}
    groups = [{**g, "params": [canonical[p] for p in g.get("params", ())]} for g in groups]
    _add_tree(OPTIMIZER_KEY, {**value, "state": renamed, "param_groups": groups}, "optimizer", out)


def _add_tree(key: str, value: Any, kind: str, out: Mapped) -> None:
    """A top-level value into the extras (its tensors as tensors of `kind`); skipped, with the
    reason, when some part of it cannot be stored."""
    found: list[tuple[str, torch.Tensor]] = []
    try:
        encoded = encode(value, key, lambda name, tensor: found.append((name, tensor)))
        for name, _ in found:
            check_tensor_name(name)
        tensors = [direct_tensor(name, kind, tensor) for name, tensor in found]
    except (_Unencodable, InvalidNameError, ImportRefused) as exc:
        out.skipped.append(f"{key!r}: {exc}; not imported")
        return
    out.tensors += tensors
    out.extras[key] = encoded


def direct_tensor(name: str, kind: str, tensor: torch.Tensor, aliases: tuple[str, ...] = ()) -> DirectTensor:
    """The tensor's bytes in C order, without a copy when it is contiguous (a tensor torch.load
    mapped stays a view of the file). Raises ImportRefused naming the tensor when ckptd cannot
    store it (a dtype it does not know, a sparse, quantized or distributed tensor)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
        what = type(tensor).__name__ if type(tensor) not in (torch.Tensor, torch.nn.Parameter) else str(tensor.layout)
        raise ImportRefused(
            f"tensor {name!r} is a {what} tensor; ckptd imports dense tensors (a DTensor or sharded tensor saved by "
            "torch.save is one rank's shard: gather it first, or import the torch.distributed.checkpoint directory)"
        )
    try:
        dtype = dtypes.from_torch_name(str(tensor.dtype))
    except dtypes.UnknownDtypeError as exc:
        raise ImportRefused(f"tensor {name!r}: {exc}") from None
    values = tensor.detach().to("cpu")
    if values.is_neg():  # a lazily negated view (torch.save keeps the bit): its memory holds the negatives
        values = values.resolve_neg()
    if not values.is_contiguous():
        values = values.contiguous()  # this tensor's own copy: ckptd stores C order
    data = values.reshape(-1).view(torch.uint8).numpy().data  # a view; the numpy array under it keeps the tensor alive
    return DirectTensor(name, kind, dtype, tuple(values.shape), data, aliases)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _tie_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """The client's memory_key, for plain tensors only: a subclass read from a file is stored as it
    is, never tied."""
    return memory_key(tensor) if type(tensor) in (torch.Tensor, torch.nn.Parameter) else None


def _canonical_names(names: list[str], notes: list[str], what: str) -> dict[str, str]:
    """Each FQN without wrapper prefixes (see the module docstring); ImportRefused when two
    names become one."""
    out = canonical_fqns(names)
    clash = len(set(out.values())) != len(out)
    if clash:
        raise ImportRefused(f"the {what} hold names that differ only by wrapper prefixes (module., _orig_mod. ...); remove the wrappers' duplicates before importing")
    changed = [n for n in names if out[n] != n]
    if changed:
        notes.append(f"{what}: wrapper prefixes removed from {len(changed)} names (e.g. {changed[0]!r} -> {out[changed[0]]!r})")
    return out


# ------------------------------------------------------------------ extras, as ckptd.client.tree encodes them


class _Unencodable(ValueError):
    """A value the extras cannot hold; the message names its path and type."""


def encode(value: Any, prefix: str, add_tensor: Callable[[str, torch.Tensor], None]) -> Any:
    """The strict-JSON form of `value` (ckptd.client.tree's, which the client decodes); each
    tensor goes to add_tensor(name, tensor) under "<prefix>/<path>" and is referred to by name.
    Raises _Unencodable naming the path of a value it cannot hold."""
    try:
        return tree.encode(value, prefix, add_tensor)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise _Unencodable(str(exc)) from None


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _names(names: list[Any]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")

