"""Adapter-only checkpoints of PEFT models through ckptd, with their optimizer state (`ckptd[peft]`).

Passing a whole `PeftModel` to `CheckpointClient.save` saves the frozen base model with every
checkpoint. `adapter_state` gives the client a state that holds only the adapter:

    from ckptd.integrations.peft import adapter_state

    state = adapter_state(peft_model, optimizer, scheduler)
    ckpt.save(step, state)          # the adapter's tensors + their optimizer state + the scheduler
    ckpt.load(state)                # fills the live adapter parameters and the optimizer in place

The model of that state is an `AdapterModel`: an `nn.Module` that owns no tensor of its own but
holds the PeftModel's live adapter parameters (and buffers) in a tree of empty modules laid out
so that their names are the keys PEFT writes in `adapter_model.safetensors`
(`peft.get_peft_model_state_dict`: adapter name removed, e.g.
"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", modules_to_save as
"base_model.model.lm_head.weight"). So:

- its `state_dict()` is the adapter's tensors under those keys, sharing their memory: a save
  copies them, a load fills them in place;
- torch.distributed.checkpoint's get/set_optimizer_state_dict, which walk a module's
  `named_parameters()` and module tree to name each parameter, find every adapter parameter
  under its PEFT key: the optimizer state is keyed "<PEFT key>" -> {"exp_avg", "exp_avg_sq",
  "step"}, and needs no base weight;
- `ckptd_model_files()` gives `adapter_config.json` as `PeftModel.save_pretrained` writes it, so
  the step directory loads with `PeftModel.from_pretrained(base_model, step_dir)`.

The PEFT libraries are imported when an AdapterModel is made, never at import of this module.
"""

from __future__ import annotations

import copy
import importlib
import json
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ADAPTER_CONFIG_NAME", "AdapterModel", "adapter_config_json", "adapter_state"]

ADAPTER_CONFIG_NAME = "adapter_config.json"  # peft.utils.CONFIG_NAME
_SHOWN = 5  # names listed in an error message before "... and N more"


def adapter_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    adapter_name: str | None = None,
    save_embedding_layers: bool | str = "auto",
) -> dict[str, Any]:
    """The state to pass to `CheckpointClient.save` and `.load` for an adapter-only checkpoint.

    Returns {"model": AdapterModel(model, ...)} plus "optimizer" and "scheduler" when given.
    Make it once and pass the same dict to every save and to the load (it is a view: it follows
    the training). Add keys of your own to it as to any ckptd state (e.g. state["extra"] = {...}).

    model: a `peft.PeftModel` (or one wrapped by DistributedDataParallel or torch.compile).
    optimizer: an optimizer over adapter parameters only; raises ValueError naming the
    parameters it updates that the adapter-only checkpoint would not hold (base weights, another
    adapter's weights), since their state and values would be lost on resume.
    scheduler: anything with state_dict()/load_state_dict() (an LR scheduler).
    adapter_name, save_embedding_layers: see AdapterModel.
    """
    adapter = AdapterModel(model, adapter_name=adapter_name, save_embedding_layers=save_embedding_layers)
    state: dict[str, Any] = {"model": adapter}
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        adapter.check_optimizer(optimizer)
        state["optimizer"] = optimizer
    if scheduler is not None:
        if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))):
            raise TypeError(f"scheduler must have state_dict() and load_state_dict(), got {type(scheduler).__name__}")
        state["scheduler"] = scheduler
    return state


class AdapterModel(nn.Module):
    """The tensors of one adapter of a PeftModel, under the keys PEFT saves them by (a view).

    model: a `peft.PeftModel`, or one wrapped by DistributedDataParallel or torch.compile.
    adapter_name: which adapter (default: the active one).
    save_embedding_layers: as in `PeftModel.save_pretrained` (True, False or "auto": the
    embedding layers too when they are adapter targets or were resized); decided once, here.

    The adapter's tensors are the PeftModel's own parameters and buffers, registered again in
    this module's tree; nothing is copied. The module is not for running (forward raises): train
    the PeftModel. If the PeftModel gets new adapter parameters (add_adapter, a replaced module),
    make a new AdapterModel. Raises TypeError for a model that is not a PeftModel, ValueError for
    an adapter that is not there or whose saved tensors are not parameters or buffers of the
    model (prompt-learning methods save computed embeddings: checkpoint the whole PeftModel).
    """

    def __init__(self, model: nn.Module, adapter_name: str | None = None, save_embedding_layers: bool | str = "auto") -> None:
        super().__init__()
        peft_model = _peft_model(model)
        name = _adapter_name(peft_model, adapter_name)
        if save_embedding_layers not in (True, False, "auto"):
            raise ValueError(f"save_embedding_layers={save_embedding_layers!r}: use True, False or 'auto'")
        # Set past nn.Module.__setattr__: as a submodule the whole PeftModel would be part of
        # this module's state_dict and parameters, which is what this class leaves out.
        object.__setattr__(self, "_peft_model", peft_model)
        self.adapter_name = name
        self.adapter_keys: tuple[str, ...] = ()
        self._build(_adapter_tensors(peft_model, name, save_embedding_layers))

    @property
    def peft_model(self) -> nn.Module:
        """The PeftModel whose adapter this is (unwrapped from DDP or torch.compile)."""
        model: nn.Module = self.__dict__["_peft_model"]
        return model

    def __repr__(self) -> str:  # not the tree of empty modules that holds the tensors
        return f"AdapterModel(adapter={self.adapter_name!r}, tensors={len(self.adapter_keys)}, of {type(self.peft_model).__name__})"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("AdapterModel is a view of an adapter's tensors for checkpointing: run the PeftModel itself")

    def ckptd_model_files(self) -> dict[str, str]:
        """{"adapter_config.json": the adapter's PeftConfig as JSON}: the files that the ckptd
        client sends with a save instead of config.json, so that the step directory loads with
        `PeftModel.from_pretrained(base_model, step_dir)`."""
        return {ADAPTER_CONFIG_NAME: adapter_config_json(self.peft_model, self.adapter_name)}

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError if `optimizer` updates a parameter that this adapter does not hold,
        naming it as the PeftModel does; such a parameter's values and optimizer state would not
        be in the checkpoint."""
        mine = {id(p) for p in self.parameters()}
        outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in mine]
        if not outside:
            return
        names = {id(p): n for n, p in self.peft_model.named_parameters(remove_duplicate=False)}
        described = [names.get(id(p), f"<a parameter of shape {list(p.shape)} that is not in the PeftModel>") for p in outside]
        raise ValueError(
            f"the optimizer updates {len(outside)} parameter(s) that are not tensors of adapter {self.adapter_name!r}: "
            f"{_listing(described)}. An adapter-only checkpoint would lose their values and optimizer state. "
            "Build the optimizer over the adapter's parameters only (e.g. [p for p in model.parameters() if p.requires_grad] "
            "with every other parameter frozen), list the modules you train as modules_to_save in the PEFT config, "
            "or checkpoint the whole model: {'model': peft_model, 'optimizer': optimizer}"
        )

    def _build(self, tensors: dict[str, torch.Tensor]) -> None:
        """Register each tensor at its key: the parts before the last are (new, empty) submodules."""
        for key, tensor in tensors.items():
            *path, leaf = key.split(".")
            node: nn.Module = self
            for depth, part in enumerate(path):
                child = node._modules.get(part)
                if child is None:
                    if part in node._parameters or part in node._buffers:
                        raise ValueError(f"adapter key {key!r}: {'.'.join(path[: depth + 1])!r} is both a tensor and a prefix of other keys")
                    child = nn.Module()
                    _register(key, node.add_module, part, child)
                node = child
            if leaf in node._modules or leaf in node._parameters or leaf in node._buffers:
                raise ValueError(f"adapter key {key!r} names the same place as another key of the adapter's state")
            if isinstance(tensor, nn.Parameter):
                _register(key, node.register_parameter, leaf, tensor)
            else:
                _register(key, node.register_buffer, leaf, tensor)
        self.adapter_keys = tuple(tensors)


def adapter_config_json(model: nn.Module, adapter_name: str | None = None) -> str:
    """The adapter's PeftConfig as `PeftModel.save_pretrained` writes `adapter_config.json`:
    inference_mode true, base_model_name_or_path filled from the base model when unset,
    auto_mapping when there is no task type, sorted keys, indent 2. Sets are written as sorted
    lists (save_pretrained writes them in set order, which varies between processes)."""
    peft_model = _peft_model(model)
    name = _adapter_name(peft_model, adapter_name)
    config = copy.deepcopy(peft_model.peft_config[name])  # save_pretrained changes the live one: not this
    base = peft_model.get_base_model()
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path") or None
    config.inference_mode = True
    output = config.to_dict()
    for key, value in output.items():
        if isinstance(value, set):
            output[key] = sorted(value, key=str)
    if config.task_type is None:
        output["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    return json.dumps(output, indent=2, sort_keys=True)


# ------------------------------------------------------------------ helpers


def _import_peft() -> Any:
    try:
        return importlib.import_module("peft")
    except ImportError as exc:
        raise ImportError("ckptd.integrations.peft needs the peft package: pip install 'ckptd[peft]'") from exc


def _peft_model(model: Any) -> Any:
    """`model` without DDP's and torch.compile's wrappers, checked to be a PeftModel."""
    peft = _import_peft()
    inner = model
    while True:
        if isinstance(inner, DistributedDataParallel):
            inner = inner.module
        elif isinstance(inner, torch._dynamo.eval_frame.OptimizedModule):
            inner = inner._orig_mod
        else:
            break
    if not isinstance(inner, peft.PeftModel):
        hint = (
            "it has adapter layers but no PeftModel around them: make the model with peft.get_peft_model(base_model, config)"
            if isinstance(inner, nn.Module) and any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in inner.modules())
            else "make one with peft.get_peft_model(base_model, LoraConfig(...)), or checkpoint a plain model with {'model': model}"
        )
        raise TypeError(f"an adapter-only checkpoint needs a peft.PeftModel, got {type(model).__name__}: {hint}")
    return inner


def _adapter_name(peft_model: Any, adapter_name: str | None) -> str:
    name = peft_model.active_adapter if adapter_name is None else adapter_name
    if not isinstance(name, str) or name not in peft_model.peft_config:
        raise ValueError(f"the PeftModel has no adapter {name!r}; its adapters are {sorted(peft_model.peft_config)}")
    return name


def _adapter_tensors(peft_model: Any, adapter_name: str, save_embedding_layers: bool | str) -> dict[str, torch.Tensor]:
    """{PEFT key: the live parameter or buffer}: what PeftModel.save_pretrained would write, by identity."""
    peft = _import_peft()
    # keep_vars: the values are the parameters themselves, so each key can be traced to one.
    live = peft_model.state_dict(keep_vars=True)
    selected: dict[str, torch.Tensor] = peft.get_peft_model_state_dict(
        peft_model, state_dict=live, adapter_name=adapter_name, save_embedding_layers=save_embedding_layers
    )
    owned = {id(t) for t in live.values() if isinstance(t, torch.Tensor)}
    computed = [key for key, value in selected.items() if not isinstance(value, torch.Tensor) or id(value) not in owned]
    if computed:
        kind = getattr(peft_model.peft_config[adapter_name].peft_type, "value", "?")
        raise ValueError(
            f"PEFT saves adapter {adapter_name!r} ({kind}) with tensors computed from the model, not held by it "
            f"({_listing(computed)}): they cannot be restored in place. Adapter-only checkpoints take adapters whose "
            "saved tensors are parameters or buffers (LoRA and the other tuner methods); checkpoint this model whole: "
            "{'model': peft_model, 'optimizer': optimizer}"
        )
    if not selected:
        raise ValueError(f"adapter {adapter_name!r} of the PeftModel has no tensors to save")
    return selected


def _register(key: str, register: Callable[..., None], name: str, value: Any) -> None:
    """register(name, value), one nn.Module registration, its refusal of a name a ValueError about `key`."""
    try:
        register(name, value)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"adapter key {key!r} cannot be a module path: {exc}") from exc


def _listing(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} ... and {len(names) - _SHOWN} more"
