"""A PyTorch Lightning checkpoint dict as a ckptd state, and back (for ckptd.integrations.lightning).

Lightning hands a CheckpointIO one dict per save (Trainer.save_checkpoint; see
lightning.pytorch.trainer.connectors.checkpoint_connector.dump_checkpoint). It becomes a ckptd
state of four top-level keys, so each kind of data goes where ckptd keeps that kind:

    "model"             checkpoint["state_dict"]: tensors named "model/<state_dict key>", in
                        the model files under their state_dict keys (safetensors)
    "optimizer"         checkpoint["optimizer_states"] (torch optimizer state dicts, state keyed
                        by integer ids as Lightning gives them) as {"0": state_dict, "1": ...}:
                        tensors named "optimizer/<i>/state/<id>/<field>", in the optimizer files
                        (so exp_avg / exp_avg_sq can be quantized like any ckptd optimizer state)
    "lightning"         every other key (epoch, global_step, loops, callbacks, lr_schedulers,
                        hyper_parameters, what on_save_checkpoint hooks add): JSON in
                        extra.json, the tensors among them (ModelCheckpoint's scores, an RNG
                        state a hook adds) in extra.safetensors
    "lightning_layout"  what a load needs to rebuild the dict without a template: every
                        tensor's name, dtype and shape, the checkpoint's key order and the
                        state_dict's `_metadata` (module versions)

Everything that is not a tensor must be JSON-able as ckptd.client.tree encodes it (dicts, lists,
tuples, str, int, float, bool, None, bytes, NumPy arrays); nothing is pickled. A value that is
not is refused with the checkpoint key that holds it and how to fix it.

A load first reads "lightning_layout" alone, allocates empty tensors of the recorded dtypes and
shapes under the same names, loads the step into them (CheckpointClient.load fills in place),
and reassembles the dict. Also here: SameStep, whether a later save of the same global_step is
the same checkpoint, and map_tensors, torch's map_location applied to a loaded dict.
Pure: no I/O, no RPC, no Lightning import.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import torch
from torch.distributed.tensor import DTensor

from ckptd.client import tree
from ckptd.common import dtypes

MODEL = "model"
OPTIMIZER = "optimizer"
REST = "lightning"
LAYOUT = "lightning_layout"
LAYOUT_VERSION = 1
STATE_DICT = "state_dict"
OPTIMIZER_STATES = "optimizer_states"
# Lightning's key -> the ckptd key its value is saved under; every other key goes to REST.
PARTS: Mapping[str, str] = {STATE_DICT: MODEL, OPTIMIZER_STATES: OPTIMIZER}
# Bytes of Lightning's own tensors (callbacks' scores: REST) that a pointer may carry when a later
# save of a step differs from it in those alone (SameStep.rest_only); more is not bookkeeping.
MAX_INLINE_BYTES = 1 << 20
# Lightning keys whose value must be a dict (state_dict) or a list (optimizer_states).
_PART_TYPES: Mapping[str, type] = {STATE_DICT: dict, OPTIMIZER_STATES: list}


@dataclass(frozen=True)
class Mapped:
    """One Lightning checkpoint as a ckptd state.

    state: what CheckpointClient.save takes. shape: the non-tensor description of this
    checkpoint (key order, encoded trees of each ckptd key, state_dict metadata): two saves with
    equal tensors and equal shapes are the same checkpoint. tensors: logical name -> tensor,
    for every tensor of the state (the names CheckpointClient gives them).
    """

    state: dict[str, Any]
    shape: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def global_step_of(checkpoint: Any) -> int:
    """checkpoint["global_step"], the ckptd step the checkpoint is saved as.

    Raises TypeError/ValueError when `checkpoint` is not a Lightning checkpoint dict.
    """
    if not isinstance(checkpoint, dict):
        raise TypeError(f"a Lightning checkpoint is a dict (Trainer.save_checkpoint builds it), got {type(checkpoint).__name__}")
    step = checkpoint.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(
            f"the checkpoint's 'global_step' is {step!r}: CkptdCheckpointIO saves a checkpoint as the ckptd step "
            "checkpoint['global_step'], an integer >= 0 that every Lightning checkpoint has"
        )
    return step


def to_state(checkpoint: dict[Any, Any], path: str | None = None) -> Mapped:
    """The ckptd state of a Lightning checkpoint (see the module docstring); nothing is copied.
    path: the file it is saved to (its pointer's), kept in the layout: a resume finds it there
    when the run stopped before the pointer was written (CkptdCheckpointIO.load_checkpoint).

    Raises TypeError naming the checkpoint key (and the path below it) of a value that is
    neither a tensor nor JSON-able, with how to fix it.
    """
    global_step_of(checkpoint)
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    trees: dict[str, Any] = {}
    rest = {k: v for k, v in checkpoint.items() if k not in PARTS}
    parts: dict[str, Any] = {REST: rest}
    for key, ckptd_key in PARTS.items():
        if key in checkpoint:
            parts[ckptd_key] = _part(key, checkpoint[key])
    for ckptd_key, value in parts.items():
        trees[ckptd_key] = _encode(value, ckptd_key, tensors)
        state[ckptd_key] = value
    metadata = getattr(checkpoint.get(STATE_DICT), "_metadata", None)
    shape = {
        "order": _encode(list(checkpoint), "order", {}),
        "trees": trees,
        "state_dict_metadata": _encode(metadata, "state_dict_metadata", {}) if metadata is not None else None,
    }
    state[LAYOUT] = {
        "version": LAYOUT_VERSION,
        "parts": list(parts),
        "tensors": {name: [_dtype_name(name, t), list(t.shape)] for name, t in tensors.items()},
        "order": shape["order"],
        "state_dict_metadata": shape["state_dict_metadata"],
    }
    if path is not None:
        state[LAYOUT]["path"] = path
    return Mapped(state, shape, tensors)


def _part(key: str, value: Any) -> Any:
    expected = _PART_TYPES[key]
    if not isinstance(value, expected):
        raise TypeError(f"checkpoint[{key!r}] is a {type(value).__name__}; Lightning gives a {expected.__name__} there")
    if isinstance(value, list):  # optimizer_states: {"0": ..., "1": ...} names the tensors as the list would
        return {str(i): item for i, item in enumerate(value)}
    return value


def _encode(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    def add(name: str, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):  # the tree also passes ckptd's LocalShard, which Lightning never holds
            raise TypeError(f"cannot checkpoint {name!r}: a {type(tensor).__name__}, where Lightning's checkpoints hold tensors")
        tensors[name] = tensor

    try:
        return tree.encode(value, prefix, add)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"CkptdCheckpointIO cannot save this checkpoint: {exc}. Names start with the part of the checkpoint: "
            f"'{REST}/<key>/...' is checkpoint[<key>] (hyper_parameters, callbacks, what on_save_checkpoint added), "
            f"'{MODEL}/...' is checkpoint['state_dict'], '{OPTIMIZER}/<i>/...' is checkpoint['optimizer_states'][i]. "
            "ckptd stores tensors and JSON-able values only and never pickles: store such a value as plain data "
            "(e.g. save_hyperparameters of ints, floats and strings, or a dict of them) or leave it out"
        ) from None


def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    try:
        dtypes.from_torch_name(dtype)
    except dtypes.UnknownDtypeError as exc:
        raise TypeError(f"CkptdCheckpointIO cannot save tensor {name!r}: {exc}; convert it (e.g. .to(torch.float32))") from None
    return dtype


def monitored_metric(checkpoint: Mapping[Any, Any], path: str) -> float | None:
    """The score ModelCheckpoint saves `path` for, when this save is one of its top-k files.

    ModelCheckpoint's state (in checkpoint["callbacks"]) maps each top-k file to its monitored
    value in "best_k_models", updated before the file is saved; a save that is not a top-k file
    (last.ckpt) is in no such map and has no metric. Non-finite values give None.
    """
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return None
    for callback_state in callbacks.values():
        best = callback_state.get("best_k_models") if isinstance(callback_state, dict) else None
        if isinstance(best, dict) and path in best:
            value = best[path]
            score = float(value.item() if isinstance(value, torch.Tensor) else value)
            return score if math.isfinite(score) else None
    return None


# ------------------------------------------------------------------ load


@dataclass(frozen=True)
class Templates:
    """Fresh tensors to load a step into: `state` for CheckpointClient.load (filled in place),
    `tensors` the same tensors by logical name."""

    state: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def templates(layout: Mapping[str, Any], skip: Collection[str] = ()) -> Templates:
    """Empty tensors of the recorded dtypes and shapes, under the recorded names.

    Each saved part (ckptd key) gets a flat dict {name without "<key>/": tensor}, which
    flattens to the same names as the saved structure; the load then puts the saved structure
    back into it (a part without tensors gets an empty dict, filled the same way). Parts in
    `skip` (the caller brings its own targets for them) get nothing.
    Raises ValueError when the layout is not one this module wrote.
    """
    table = layout.get("tensors")
    parts = layout.get("parts")
    if layout.get("version") != LAYOUT_VERSION or not isinstance(table, dict) or not isinstance(parts, list) or REST not in parts:
        raise ValueError(f"the step's {LAYOUT!r} is not a layout of version {LAYOUT_VERSION} that CkptdCheckpointIO wrote")
    state: dict[str, Any] = {key: {} for key in parts if key in (MODEL, OPTIMIZER, REST) and key not in skip}
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in table.items():
        key, _, rest = name.partition("/")
        if key in skip and key in parts:
            continue
        if key not in state or not (isinstance(spec, list) and len(spec) == 2):
            raise ValueError(f"the step's {LAYOUT!r} lists a tensor {name!r} that no saved part holds")
        dtype_name, shape = spec
        dtypes.from_torch_name(dtype_name)
        tensor = torch.empty([int(n) for n in shape], dtype=getattr(torch, dtype_name))
        state[key][rest] = tensor
        tensors[name] = tensor
    return Templates(state, tensors)


def inline_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A small tensor as JSON a pointer carries: its dtype (safetensors name), shape and bytes (base64)."""
    local = tensor.detach().cpu().contiguous()
    raw = local.reshape(-1).view(torch.uint8).numpy().tobytes() if local.numel() else b""
    return {"dtype": dtypes.from_torch_name(str(local.dtype)), "shape": list(local.shape), "data": base64.b64encode(raw).decode("ascii")}


def _from_inline(name: str, value: Any) -> torch.Tensor:
    """The tensor `inline_tensor` wrote; ValueError naming it when the JSON is not one it writes."""
    try:
        dtype, shape, data = value["dtype"], [int(n) for n in value["shape"]], base64.b64decode(value["data"], validate=True)
        if len(data) != dtypes.nbytes(dtype, shape) or any(n < 0 for n in shape):
            raise ValueError(f"{len(data)} bytes for {dtype}{shape}")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, dtypes.torch_name(dtype))).reshape(shape)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"the pointer's copy of tensor {name!r} is not one CkptdCheckpointIO writes ({exc})") from None


def decode_parts(trees: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], inline: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Parts of a checkpoint from their encoded trees (those a pointer's own shape carries), with
    the pointer's own small tensors (`inline`: `inline_tensor`'s JSON by name) and else the
    step's loaded tensors. Raises ValueError naming a tensor the trees refer to that neither holds."""
    carried = {name: _from_inline(name, value) for name, value in (inline or {}).items()}

    def get(name: str) -> torch.Tensor:
        if name in carried:
            return carried[name]
        try:
            return tensors[name]
        except KeyError:
            raise ValueError(f"the checkpoint refers to a tensor {name!r} that its ckptd step does not hold") from None

    return {key: tree.decode(value, get) for key, value in trees.items()}


def assemble(order: Any, state_dict_metadata: Any, parts: Mapping[str, Any]) -> dict[Any, Any]:
    """The Lightning checkpoint from its loaded parts (ckptd key -> value as saved), with the
    keys in their saved order (`order`, encoded as to_state recorded it).

    state_dict comes back as an OrderedDict with its `_metadata`, optimizer_states as a list of
    torch optimizer state dicts keyed by integer ids, every other value as it was saved.
    Raises ValueError when a part the order names is missing.
    """
    rest = parts.get(REST)
    if not isinstance(rest, dict):
        raise ValueError(f"the ckptd step holds no {REST!r} part: it is not a checkpoint CkptdCheckpointIO saved")
    checkpoint: dict[Any, Any] = {}
    for key in tree.decode(order, _no_tensor):
        if key in PARTS:
            checkpoint[key] = _rebuild_part(key, parts.get(PARTS[key]), state_dict_metadata)
        elif key in rest:
            checkpoint[key] = rest[key]
        else:
            raise ValueError(f"the ckptd step holds no value for checkpoint[{key!r}]")
    return checkpoint


def _rebuild_part(key: str, value: Any, state_dict_metadata: Any) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"the ckptd step holds no {PARTS[key]!r} part for checkpoint[{key!r}]")
    if key == OPTIMIZER_STATES:
        try:
            return [value[str(i)] for i in range(len(value))]
        except KeyError:
            raise ValueError(f"the ckptd step's {OPTIMIZER!r} part is not numbered 0..{len(value) - 1}") from None
    state_dict: OrderedDict[str, Any] = OrderedDict(value)
    if state_dict_metadata is not None:
        state_dict._metadata = tree.decode(state_dict_metadata, _no_tensor)  # type: ignore[attr-defined]
    return state_dict


def _no_tensor(name: str) -> torch.Tensor:
    raise ValueError(f"unexpected tensor {name!r} in the checkpoint's key order or state_dict metadata")


# ------------------------------------------------------------------ a second save of the same step


class SameStep:
    """What a later save of the same global_step must match to reuse the step already handed over.

    ModelCheckpoint saves several files at one global_step (the top-k file, then last.ckpt,
    sometimes last.ckpt again at the epoch's end), and ckptd holds one checkpoint per step. The
    tensors are the same between these saves; Lightning's bookkeeping (ModelCheckpoint's
    last_model_path, loop counters) may differ. A later save is accepted when it has the same
    tensor names, every model and optimizer tensor is the same memory not written since
    (torch's version counter), and every other tensor (small: scores, RNG states) has equal
    values to a copy taken at the first save. Its shape may differ: the caller keeps that. A
    save whose model and optimizer tensors are the step's but whose own small tensors differ
    (two ModelCheckpoints meeting at a step: the second one's best_model_score, best_k_models)
    is accepted too (`rest_only`): its pointer carries those tensors (`own_shape`).
    """

    def __init__(self, step: int, mapped: Mapped) -> None:
        self.step = step
        self.shape = mapped.shape
        self._identity = {n: _identity(t) for n, t in mapped.tensors.items() if not n.startswith(REST + "/")}
        self._values = {n: t.detach().clone() for n, t in mapped.tensors.items() if n.startswith(REST + "/")}

    def own_shape(self, mapped: Mapped) -> dict[str, Any] | None:
        """What a pointer to this step must carry for `mapped` (a later save of the step): None
        when it is the step's; else its key order, its state_dict metadata, the encoded trees of
        the parts that differ (the others are the step's) and, under "tensors", the bytes of its
        own small tensors that the step lacks or holds other values of (`inline_tensor`)."""
        inline = {
            name: inline_tensor(t) for name, t in mapped.tensors.items()
            if name.startswith(REST + "/") and (name not in self._values or not _equal(t, self._values[name]))
        }
        if mapped.shape == self.shape and not inline:
            return None
        trees = {key: tree_ for key, tree_ in mapped.shape["trees"].items() if self.shape["trees"].get(key) != tree_ or (key == REST and inline)}
        shape = {"order": mapped.shape["order"], "trees": trees, "state_dict_metadata": mapped.shape["state_dict_metadata"]}
        return {**shape, "tensors": inline} if inline else shape

    def rest_only(self, mapped: Mapped) -> bool:
        """Whether `mapped` differs from this step in Lightning's own small tensors alone: every
        model and optimizer tensor is the step's, unwritten since, and its other tensors hold at
        most MAX_INLINE_BYTES (a pointer carries those that differ: own_shape)."""
        own = {name: t for name, t in mapped.tensors.items() if not name.startswith(REST + "/")}
        if set(own) != set(self._identity) or any(_identity(t) != self._identity[name] for name, t in own.items()):
            return False
        rest = [t for name, t in mapped.tensors.items() if name.startswith(REST + "/")]
        return not any(isinstance(t, DTensor) for t in rest) and sum(t.numel() * t.element_size() for t in rest) <= MAX_INLINE_BYTES

    def fewer(self, mapped: Mapped) -> bool:
        """Whether `mapped` holds only some of this step's tensors (a weights-only save of it)."""
        return set(mapped.tensors) < set(self._identity) | set(self._values)

    def mismatch(self, mapped: Mapped) -> str | None:
        """Why `mapped` is not the same checkpoint's tensors, or None when it is."""
        names = set(mapped.tensors)
        known = set(self._identity) | set(self._values)
        if names != known:
            changed = sorted(names ^ known)
            listed = f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}"
            if names < known:
                return f"it holds {len(names)} of the step's {len(known)} tensors (not {listed}: a weights-only save of a step saved in full?)"
            return f"other tensors ({listed})"
        for name, tensor in mapped.tensors.items():
            if name in self._identity:
                if _identity(tensor) != self._identity[name]:
                    return f"tensor {name!r} changed"
            elif not _equal(tensor, self._values[name]):
                return f"tensor {name!r} has another value"
        return None


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    # a DTensor's own data_ptr is 0: its rank's local tensor is the memory (the version counter is shared)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return (tensor.device, local.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(local.shape), local.stride(), tensor._version)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.detach().to(b.device), b))


MapLocation = Callable[[Any, str], Any] | str | torch.device | Mapping[str, Any] | None


def map_tensors(checkpoint: dict[Any, Any], map_location: MapLocation) -> dict[Any, Any]:
    """The checkpoint with its (CPU) tensors moved as torch's `map_location` says.

    None keeps them on the CPU; a device or device name moves every tensor there; a dict maps
    "cpu" to a device; a callable is called as torch calls it, (storage, "cpu"), and a storage
    it returns on another device moves the tensor there. Tensors stay where they are otherwise.
    """
    if map_location is None:
        return checkpoint
    if isinstance(map_location, (str, torch.device)):
        target: torch.device | None = torch.device(map_location)
    elif isinstance(map_location, Mapping):
        mapped = map_location.get("cpu")
        target = torch.device(mapped) if mapped is not None else None
    elif callable(map_location):
        target = None
    else:
        raise TypeError(f"map_location must be None, a device, a device name, a dict or a callable, got {type(map_location).__name__}")

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if target is not None:
            return tensor.to(target)
        if callable(map_location):
            storage = map_location(tensor.untyped_storage(), "cpu")
            device = getattr(storage, "device", None)
            if device is not None and device != tensor.device:
                return tensor.to(device)
        return tensor

    return {key: _apply(value, move) for key, value in checkpoint.items()}


def _apply(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, OrderedDict):
        out = OrderedDict((k, _apply(v, move)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, dict):
        return {k: _apply(v, move) for k, v in value.items()}
    if isinstance(value, list):
        return [_apply(v, move) for v in value]
    if isinstance(value, tuple):
        return tuple(_apply(v, move) for v in value)
    return value


def layout_of(client: Any, step: int) -> dict[str, Any]:
    """The layout saved with `step` (to_state's LAYOUT: its top-level parts are "order"), read
    through `client` (a CheckpointClient of the job)."""
    layout: dict[str, Any] = {}
    client.load({LAYOUT: layout}, step=step, strict=False)
    return layout


def parts_lacking(wanted: dict[str, Any], held: dict[str, Any]) -> list[str]:
    """The top-level parts of the layout `wanted` that the layout `held` lacks, sorted."""
    return sorted(map(str, set(wanted.get("order", ())) - set(held.get("order", ()))))
