"""DeepSpeed ZeRO stage 1, 2 and 3 engines through ckptd (needs `deepspeed`, imported only when called).

What a user writes instead of `engine.save_checkpoint(dir)` / `engine.load_checkpoint(dir)`:

    from ckptd.client import CheckpointClient
    from ckptd.integrations.deepspeed import load, save

    engine, *_ = deepspeed.initialize(model=model, config=config, ...)
    ckpt = CheckpointClient(job="run-1")                   # after deepspeed.init_distributed
    start = load(engine, ckpt) or 0                        # the newest checkpoint's step; None: a fresh start
    ...
    save(engine, ckpt, step)                               # every rank, after engine.step()

Each rank hands ckptd its own partitions, with no gather: for every trained parameter, the part
of its fp32 master weights and of its optimizer moments that the rank's ZeRO partition holds.
DeepSpeed keeps them in flat buffers whose cut depends on the data-parallel size; ckptd gets
them as `LocalShard`s of per-parameter logical tensors instead, each the parameter flattened
(row-major) to one dimension:

    "master/<fqn>"                          float32, shape (numel,): the fp32 master weights
    "optimizer/state/<fqn>/<key>"           shape (numel,): each per-element optimizer state
                                            (Adam's "exp_avg", "exp_avg_sq", ...)
    "model/<fqn>"                           buffers, and ZeRO-1/2's frozen parameters, whole
                                            (the same on every rank: written once)
    "scheduler"                             engine.lr_scheduler's state_dict, when there is one
    "deepspeed"                             JSON: the parameters' shapes, the optimizer's
                                            param_groups with their scalar state (Adam's
                                            "step"), the engine's step counters, the loss scaler
    other keys                              the caller's own (`extra=`): more top-level keys of
                                            the state, as CheckpointClient.save takes them
    RNG                                     torch, Python and NumPy generators of every rank

A ZeRO-1/2 rank holds a contiguous range of each parameter it shares in (its partition of the
flat group buffer), a ZeRO-3 rank the range [rank * p, (rank + 1) * p) of each parameter (p its
partition size, the last one short); both are one box of the flattened parameter, and a rank
whose partition misses a parameter hands an empty box. So any data-parallel size and any stage
loads any checkpoint (ckptd reshards the boxes: DeepSpeed's universal-checkpoint case, without a
conversion step), and `load_consolidated` gives a plain PyTorch model the whole fp32 weights.

The bf16/fp16 weights of the module are not saved: they are the master weights rounded, and a
load sets them from the master weights as DeepSpeed's own loads do. Saves use
master_weights="keep" for that reason (a daemon default of "drop" would lose the only copy).

Not supported (refused with the reason): ZeRO stage 0 and the bf16 optimizer without ZeRO (save
engine.module and engine.optimizer with the plain client), pipeline or tensor (model) parallel
engines, MoE expert groups, ZeRO-Infinity's NVMe offload, ZeRO-3 parameters that do not train,
a save in the middle of a gradient accumulation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, MutableMapping

import torch
from torch import nn

from ckptd.client import CheckpointClient, LocalShard, SaveHandle

log = logging.getLogger("ckptd.integrations.deepspeed")

__all__ = ["FORMAT", "RESERVED_KEYS", "load", "load_consolidated", "save"]

META_KEY = "deepspeed"
# the top-level keys of the state this module saves ("rng": CheckpointClient's random generators)
RESERVED_KEYS = frozenset({"master", "optimizer", "model", "scheduler", META_KEY, "rng"})
FORMAT = "ckptd.deepspeed/1"  # the layout of this module's checkpoints; a change of it changes the name
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
_SHOWN = 5  # names listed in an error message before "... and N more"


@dataclass(frozen=True)
class _Slot:
    """The part of trained parameter `fqn` that this rank's partition holds.

    start, length: the box [start, start + length) of the parameter flattened to `numel`
    elements (length 0: an empty box at numel). flat, flat_offset: where it sits in the fp32
    flat partition that the inner optimizer steps. group: the optimizer's param group index.
    """

    fqn: str
    shape: tuple[int, ...]
    numel: int
    start: int
    length: int
    flat: torch.Tensor
    flat_offset: int
    group: int

    def view(self, tensor: torch.Tensor) -> LocalShard:
        """This slot's box of `tensor` (the flat partition or a state buffer shaped like it)."""
        return LocalShard(tensor.narrow(0, self.flat_offset, self.length), (self.start,), (self.numel,))


def save(
    engine: Any,
    client: CheckpointClient,
    step: int,
    *,
    extra: Mapping[str, Any] | None = None,
    metric: float | None = None,
    quantize: str | None = None,
) -> SaveHandle:
    """Hand the ZeRO engine's training state to ckptd as checkpoint `step` (module docstring).

    Collective: every rank of the engine calls it for the same step, after `engine.step()` (at
    a gradient accumulation boundary). Returns the client's SaveHandle. extra: more top-level
    keys of the state, as `CheckpointClient.save` takes them (stateful objects such as a data
    loader, dicts, tensors, JSON values; per rank), e.g. what a trainer built on DeepSpeed keeps
    beside the engine; not the keys of this module (RESERVED_KEYS). metric, quantize: as
    `CheckpointClient.save`. Raises ValueError/TypeError for what can never be saved.
    """
    optimizer = _check(engine, client)
    if engine.micro_steps % engine.gradient_accumulation_steps():
        raise ValueError(
            f"the engine is in the middle of a gradient accumulation (micro step {engine.micro_steps}, "
            f"{engine.gradient_accumulation_steps()} per step): save after engine.step() has applied it"
        )
    slots = _slots(engine, optimizer)
    flats = _flats(optimizer)
    keys, meta_groups = _optimizer_meta(optimizer, flats)
    state = _state(engine, slots, keys, extra)
    state[META_KEY] = {
        "format": FORMAT,
        "zero_stage": engine.zero_optimization_stage(),
        "dp_world_size": engine.dp_world_size,
        "params": {s.fqn: list(s.shape) for s in slots},
        "frozen": sorted({name for name, _ in engine.module.named_parameters()} - {s.fqn for s in slots}),  # stored as model tensors
        "state_keys": keys,
        "param_groups": meta_groups,
        "counters": {name: int(getattr(engine, name)) for name in _COUNTERS},
        "loss_scaler": _scalars(vars(optimizer.loss_scaler)) if getattr(optimizer, "loss_scaler", None) is not None else {},
        "loss_scaler_kind": _scaler_kind(engine, optimizer),
        "scheduler": engine.lr_scheduler is not None,
    }
    return client.save(step, state, metric=metric, quantize=quantize, master_weights="keep", rng=True)


def load(engine: Any, client: CheckpointClient, step: int | None = None, *, extra: MutableMapping[str, Any] | None = None) -> int | None:
    """Restore the ZeRO engine's training state from ckptd checkpoint `step` (None: the newest).

    Collective, like `engine.load_checkpoint`: every rank calls it, after `deepspeed.initialize`
    built the engine with the same model and optimizer type as when the checkpoint was saved;
    the data-parallel size and the ZeRO stage may differ. The fp32 master weights, optimizer
    state, param_groups, scheduler, loss scaler, step counters and random generators are set
    back, and the module's weights from the master weights. extra: the keys given to `save`'s
    extra, with objects of the same structure: stateful objects, tensors and dicts are filled in
    place, and every entry of `extra` is then set to what was loaded. Returns the step loaded, or None when the job has no
    checkpoint yet (nothing changed). Raises CheckpointError when the step cannot be loaded and
    ValueError when it holds another model, was not saved by this module, or was saved without
    the LR scheduler this engine has (nothing changed then).
    """
    optimizer = _check(engine, client)
    probe: dict[str, Any] = {META_KEY: {}}
    loaded = client.load(probe, step=step, strict=False)  # a step of another saver lacks the key: _check_meta says so
    if loaded is None:
        return None
    meta = probe[META_KEY]
    slots = _slots(engine, optimizer)
    _check_meta(meta, {s.fqn: s.shape for s in slots}, loaded)
    _check_scheduler(engine, meta, loaded)
    flats = _flats(optimizer)
    _init_state(optimizer, flats, meta["state_keys"], meta["param_groups"])
    if _is_stage3(optimizer):
        optimizer.checkpoint_event_prologue()  # every parameter partitioned, as DeepSpeed's own load does
    state = _state(engine, slots, meta["state_keys"], extra)
    client.load(state, step=loaded, rng=True)
    if extra is not None:
        extra.update((key, state[key]) for key in extra)  # JSON values cannot be filled in place
    _restore_param_groups(optimizer, flats, meta["param_groups"])
    for name, value in meta["counters"].items():
        setattr(engine, name, int(value))
    if meta.get("loss_scaler") and getattr(optimizer, "loss_scaler", None) is not None:
        kind = _scaler_kind(engine, optimizer)
        saved_kind = meta.get("loss_scaler_kind", kind)  # a step saved before the kind was recorded: taken as this one
        if saved_kind == kind:
            for name, value in meta["loss_scaler"].items():
                if hasattr(optimizer.loss_scaler, name):
                    setattr(optimizer.loss_scaler, name, value)
        else:  # another precision or scaler: its scale (an fp32 run's static 1.0) would be wrong here
            log.warning("step %s was saved with loss scaling %s, this engine runs %s: its own loss scaler is kept", loaded, saved_kind, kind)
    _master_to_module(optimizer)
    return loaded


def load_consolidated(
    model: nn.Module,
    source: CheckpointClient | str | Path,
    *,
    job: str | None = None,
    step: int | None = None,
    strict: bool = True,
) -> int:
    """Put a checkpoint of `save` into a plain PyTorch `model` (the module as it was before
    deepspeed.initialize, any dtype and device): its parameters from the whole fp32 master
    weights, its buffers (and frozen parameters) as saved. Returns the step read.

    source: a CheckpointClient (through the daemon; collective over the client's ranks, made
    e.g. with rank=0, world_size=1 for one evaluation process), or a directory read without a
    daemon (ckptd.offline): a step directory ROOT/JOB/step-N, or ROOT with `job` (and `step`,
    None: the newest committed). strict: every parameter and buffer of the model must be in the
    checkpoint and every saved parameter in the model (ValueError naming them); False loads the
    names both have. The model's tensors are filled in place (tied parameters stay tied).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    if isinstance(source, CheckpointClient):
        probe: dict[str, Any] = {META_KEY: {}}
        read = source.load(probe, step=step, strict=False)
        if read is None:
            raise ValueError(f"job {source.job!r} has no committed checkpoint to load")
        meta = probe[META_KEY]
    else:
        from ckptd.offline import open_step

        opened = open_step(source, job, step) if job is not None else open_step(source)
        read, meta = opened.step, opened.extras(0).get(META_KEY)
    _check_format(meta, read)
    wanted = _consolidated_state(model, meta, strict, read)
    if isinstance(source, CheckpointClient):
        source.load(wanted, step=read, strict=strict)
    else:
        opened.load(wanted, strict=strict)
    return read


# ------------------------------------------------------------------ checks


def _check(engine: Any, client: CheckpointClient) -> Any:
    """The engine's ZeRO optimizer, once the engine and client are ones this module serves."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # type: ignore[import-untyped,import-not-found,unused-ignore]

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"expected a deepspeed.DeepSpeedEngine (what deepspeed.initialize returns first), got {type(engine).__name__}")
    if not isinstance(client, CheckpointClient):
        raise TypeError(f"expected a ckptd.client.CheckpointClient, got {type(client).__name__}")
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3):
        raise ValueError(
            f"ckptd.integrations.deepspeed serves ZeRO stages 1, 2 and 3; this engine runs stage {stage}: save "
            "{'model': engine.module, 'optimizer': engine.optimizer} with CheckpointClient.save instead"
        )
    if engine.mp_world_size > 1 or engine.mpu is not None or type(engine).__name__ == "PipelineEngine":
        raise ValueError("ckptd.integrations.deepspeed serves data-parallel ZeRO engines only, not pipeline or tensor (model) parallel ones")
    if getattr(engine, "has_moe_layers", False):
        raise ValueError("ckptd.integrations.deepspeed does not serve MoE expert groups (their partitions follow expert-parallel groups)")
    optimizer = engine.optimizer
    if not (_is_stage3(optimizer) or hasattr(optimizer, "bit16_groups")):
        raise ValueError(
            f"this engine has no ZeRO optimizer (engine.optimizer is {type(optimizer).__name__}: deepspeed.initialize was given "
            "no optimizer); save its weights with CheckpointClient.save({'model': engine.module}) instead"
        )
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "optimizer_swapper", None) is not None:
        raise ValueError("ckptd.integrations.deepspeed does not serve ZeRO-Infinity's NVMe offload (the optimizer state lives in swap files)")
    if (client.rank, client.world_size) != (engine.global_rank, engine.world_size):
        raise ValueError(
            f"the CheckpointClient is rank {client.rank} of {client.world_size}, the engine rank {engine.global_rank} of "
            f"{engine.world_size}: make the client after deepspeed.init_distributed, or pass rank= and world_size="
        )
    return optimizer


def _check_format(meta: Any, step: int) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(
            f"ckptd step {step} was not saved by ckptd.integrations.deepspeed.save (format {found!r}, expected {FORMAT!r})"
        )


def _check_meta(meta: Any, shapes: Mapping[str, tuple[int, ...]], step: int) -> None:
    _check_format(meta, step)
    saved = {name: tuple(shape) for name, shape in meta["params"].items()}
    missing = sorted(set(shapes) - set(saved))
    unexpected = sorted(set(saved) - set(shapes))
    reshaped = sorted(n for n in set(saved) & set(shapes) if saved[n] != tuple(shapes[n]))
    problems = [
        f"{what}: {_listing(names)}"
        for what, names in (("not in the checkpoint", missing), ("not trained by this engine", unexpected), ("of another shape", reshaped))
        if names
    ]
    if problems:
        raise ValueError(f"ckptd step {step} holds another model than this engine's trained parameters ({'; '.join(problems)})")


def _check_scheduler(engine: Any, meta: Mapping[str, Any], step: int) -> None:
    """An engine with an LR scheduler loads only a step saved with one: a fresh schedule would
    start over at its first step in the middle of the run. (A step saved with a scheduler loads
    into an engine without one: the scheduler's state is left unread.)"""
    if engine.lr_scheduler is not None and meta.get("scheduler") is False:
        raise ValueError(
            f"ckptd step {step} was saved from an engine without an LR scheduler, and this engine has one "
            f"({type(engine.lr_scheduler).__name__}): its schedule would start over at step {step}. Resume this step "
            "with an engine built without lr_scheduler (then set up your schedule at that step yourself), or load a step saved with one"
        )
    if engine.lr_scheduler is None and meta.get("scheduler"):
        log.warning("step %s was saved with an LR scheduler, and this engine has none: the scheduler's state is not loaded", step)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} ... and {len(names) - _SHOWN} more"


# ------------------------------------------------------------------ the partitions


def _scaler_kind(engine: Any, optimizer: Any) -> str:
    """The engine's precision and its loss scaler's kind, e.g. "fp16 DynamicLossScaler": a
    scaler's state is set back only into an engine of the same kind."""
    precision = "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"
    scaler = getattr(optimizer, "loss_scaler", None)
    dynamic = "dynamic" if getattr(scaler, "dynamic", False) else "static"
    return f"{precision} {type(scaler).__name__} {dynamic}"


def _is_stage3(optimizer: Any) -> bool:
    return hasattr(optimizer, "fp32_partitioned_groups_flat")


def _flats(optimizer: Any) -> list[tuple[torch.Tensor, int]]:
    """The fp32 flat partitions that the inner optimizer steps, each with its param group index."""
    if _is_stage3(optimizer):
        return [(flat, optimizer.sub_group_to_group_id[i]) for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat)]
    return [(flat, i) for i, flat in enumerate(optimizer.single_partition_of_fp32_groups)]


def _trained_named(engine: Any, optimizer: Any) -> list[tuple[str, nn.Parameter]]:
    """The parameters the ZeRO optimizer trains, with their names in engine.module, in module order."""
    if _is_stage3(optimizer):
        frozen = [name for name, p in engine.module.named_parameters() if not p.requires_grad]
        if frozen:
            raise ValueError(f"ckptd.integrations.deepspeed does not serve ZeRO-3 parameters that do not train: {_listing(frozen)}")
        return list(engine.module.named_parameters())
    trained = {id(p) for group in optimizer.bit16_groups for p in group}
    return [(name, p) for name, p in engine.module.named_parameters() if id(p) in trained]


def _param_shape(param: nn.Parameter) -> tuple[int, ...]:
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)


def _slots(engine: Any, optimizer: Any) -> list[_Slot]:
    """This rank's part of every trained parameter (an empty one where its partition has none)."""
    stage3 = _is_stage3(optimizer)
    slots = []
    for name, param in _trained_named(engine, optimizer):
        shape = _param_shape(param)
        numel = math.prod(shape)
        if stage3:
            group, offset, size = optimizer.grad_position[optimizer.get_param_id(param)]
            start = optimizer._get_param_partition_rank(param) * size
            length = max(0, min(size, numel - start))
            flat, group_index = optimizer.fp32_partitioned_groups_flat[group], optimizer.sub_group_to_group_id[group]
        else:
            mapping = getattr(param, "_hp_mapping", None)  # DeepSpeed sets it on every parameter of a ZeRO-1/2 group
            if mapping is None:
                start, length, offset, group_index = numel, 0, 0, 0
            else:
                start, length = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
                offset, group_index = mapping.hp_fragment_address.start, mapping.param_group_index
            flat = optimizer.single_partition_of_fp32_groups[group_index]
        slots.append(_Slot(name, shape, numel, start if length else numel, length, flat, offset, group_index))
    return slots


def _state(engine: Any, slots: list[_Slot], keys: list[str], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The state to save or to load into: views of the live partitions, so a load fills them in place."""
    inner = engine.optimizer.optimizer
    state: dict[str, Any] = {
        "master": {s.fqn: s.view(s.flat) for s in slots},
        "optimizer": {"state": {s.fqn: {key: s.view(inner.state[s.flat][key]) for key in keys} for s in slots}},
    }
    whole = _whole_tensors(engine)
    if whole:
        state["model"] = whole
    if engine.lr_scheduler is not None:
        state["scheduler"] = engine.lr_scheduler
    if extra is not None:
        taken = sorted(set(extra) & RESERVED_KEYS)
        if taken:
            raise ValueError(f"extra uses the keys {taken}, which ckptd.integrations.deepspeed saves itself; rename them")
        state.update(extra)
    return state


def _whole_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """The module's buffers and (ZeRO-1/2) frozen parameters: the same on every rank."""
    tensors = {name: b for name, b in engine.module.named_buffers() if name.rsplit(".", 1)[-1] in _persistent(engine.module, name)}
    if not _is_stage3(engine.optimizer):
        tensors.update((name, p) for name, p in engine.module.named_parameters() if not p.requires_grad)
    return tensors


def _persistent(module: nn.Module, name: str) -> set[str]:
    """The names of the buffers that the owner of buffer `name` keeps in its state_dict."""
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    return {n for n in owner._buffers if n not in owner._non_persistent_buffers_set}


# ------------------------------------------------------------------ the optimizer


def _optimizer_meta(optimizer: Any, flats: list[tuple[torch.Tensor, int]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The per-element state keys, and each param group's hyperparameters with its scalar state."""
    inner = optimizer.optimizer
    keys: set[str] = set()
    scalars: dict[int, dict[str, Any]] = {}
    for flat, group in flats:
        for key, value in inner.state.get(flat, {}).items():
            if torch.is_tensor(value) and value.shape == flat.shape and value.numel() > 1:
                keys.add(key)
            elif torch.is_tensor(value) and value.numel() == 1:
                scalars.setdefault(group, {})[key] = {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
            elif isinstance(value, (bool, int, float)):
                scalars.setdefault(group, {})[key] = {"value": value}
            else:
                raise ValueError(
                    f"the optimizer's state {key!r} is a {type(value).__name__} of shape {list(getattr(value, 'shape', []))}, "
                    f"neither one value per element of the flat partition ({flat.numel()}) nor a scalar: ckptd cannot tell "
                    "how to partition it"
                )
    groups = [
        {"hyper": _scalars({k: v for k, v in group.items() if k != "params"}), "scalars": scalars.get(i, {})}
        for i, group in enumerate(inner.param_groups)
    ]
    return sorted(keys), groups


def _scalars(values: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-able numbers, strings, None and tuples of them among `values` (tuples as lists)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
            out[name] = list(value)
    return out


def _init_state(optimizer: Any, flats: list[tuple[torch.Tensor, int]], keys: Iterable[str], groups: list[dict[str, Any]]) -> None:
    """Give a fresh inner optimizer the state tensors a load fills (what its first step would create)."""
    inner = optimizer.optimizer
    if len(groups) != len(inner.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} param groups, this engine's {len(inner.param_groups)}: build the same optimizer")
    for flat, group in flats:
        state = inner.state[flat]
        for key in keys:
            if key not in state:
                state[key] = torch.zeros_like(flat)
        _set_scalars(state, groups[group]["scalars"])


def _set_scalars(state: dict[str, Any], scalars: Mapping[str, Any]) -> None:
    for key, saved in scalars.items():
        if "dtype" in saved:
            current = state.get(key)
            device = current.device if torch.is_tensor(current) else torch.device("cpu")
            state[key] = torch.tensor(saved["value"], dtype=getattr(torch, saved["dtype"]), device=device).reshape(saved["shape"])
        else:
            state[key] = saved["value"]


def _restore_param_groups(optimizer: Any, flats: list[tuple[torch.Tensor, int]], groups: list[dict[str, Any]]) -> None:
    inner = optimizer.optimizer
    for group, saved in zip(inner.param_groups, groups):
        for name, value in saved["hyper"].items():
            if name in group:
                group[name] = tuple(value) if isinstance(group[name], tuple) else value
    for flat, index in flats:
        _set_scalars(inner.state[flat], groups[index]["scalars"])


def _master_to_module(optimizer: Any) -> None:
    """Set the module's (bf16/fp16/fp32) weights from the loaded fp32 master partitions, as
    DeepSpeed's own universal-checkpoint loads do (engine.load_checkpoint)."""
    if not _is_stage3(optimizer):
        optimizer.update_lp_params()  # the rank's partition, then an all-gather of the flat groups
        # link the parameters to the (new) optimizer state now, not at the first step, so that
        # deepspeed.utils.safe_get_full_optimizer_state works right after a load
        optimizer._lazy_init_hp_params_optimizer_state()
        return
    for i, fp32 in enumerate(optimizer.fp32_partitioned_groups_flat):
        if fp32.numel() > 0:
            optimizer.fp16_partitioned_groups_flat[i].data.copy_(fp32.data)
    for i, flat in enumerate(optimizer.fp16_partitioned_groups_flat):
        for param, part in zip(optimizer.fp16_partitioned_groups[i], optimizer.unflatten(flat, optimizer.fp16_partitioned_groups[i])):
            param.data = part.data
    optimizer.checkpoint_event_epilogue()  # persistent parameters gathered whole again


# ------------------------------------------------------------------ consolidated


def _consolidated_state(model: nn.Module, meta: Mapping[str, Any], strict: bool, step: int) -> dict[str, Any]:
    """{"master": flat views of the model's parameters, "model": its buffers and frozen parameters}."""
    shapes = {name: tuple(shape) for name, shape in meta["params"].items()}
    params = dict(model.named_parameters())
    # parameters frozen in training are the step's model tensors, whatever requires_grad says now (a
    # checkpoint from before "frozen" was recorded: the model's own frozen ones)
    frozen = set(meta["frozen"]) if isinstance(meta.get("frozen"), list) else {n for n, p in params.items() if not p.requires_grad}
    problems = [
        f"{what}: {_listing(names)}"
        for what, names in (
            ("not in the checkpoint", sorted(n for n in params if n not in shapes and n not in frozen)),
            ("not in the model", sorted(set(shapes) - set(params))),
            ("of another shape", sorted(n for n in set(shapes) & set(params) if tuple(params[n].shape) != shapes[n])),
        )
        if names
    ]
    if problems and strict:
        raise ValueError(f"ckptd step {step} does not fit this model ({'; '.join(problems)}); strict=False loads what both have")
    master = {
        name: LocalShard(p.data.view(-1), (0,), (p.numel(),))
        for name, p in params.items()
        if name in shapes and tuple(p.shape) == shapes[name]
    }
    whole: dict[str, torch.Tensor] = {name: p.data for name, p in params.items() if name not in shapes}
    whole.update((name, b) for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in _persistent(model, name))
    state: dict[str, Any] = {"master": master}
    if whole:
        state["model"] = whole
    return state
