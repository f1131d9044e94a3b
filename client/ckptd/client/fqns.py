"""Parameter names (FQNs) without the prefixes of torch's module wrappers, one rule for the client
(ckptd.client.state, which has the module) and `ckptd import` (the daemon's import_state, which has
only the names).

The wrappers: DDP's "module." and torch.compile's "_orig_mod." at the top; below it
torch.compile's, FSDP's and activation checkpointing's attributes as whole components. A name
loads into a wrapped or unwrapped model alike once they are taken out.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as _dcp_state_dict
from torch.nn.parallel import DistributedDataParallel

WRAPPER_ATTRIBUTES = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
DDP_PREFIX = "module."
# a wrapper's attribute as a whole component of an FQN
INNER_WRAPPER = re.compile(r"(?:^|\.)(?:" + "|".join(WRAPPER_ATTRIBUTES) + r")\.")


def strip_wrappers(fqn: str) -> str:
    """`fqn` without any component that is a wrapper's attribute (WRAPPER_ATTRIBUTES)."""
    while True:
        inner = INNER_WRAPPER.sub(lambda m: "." if m.group(0).startswith(".") else "", fqn)
        if inner == fqn:
            return fqn
        fqn = inner


def canonical_fqns(names: Sequence[str]) -> dict[str, str]:
    """Each of a state_dict's `names`, known by its names alone, without the wrappers' prefixes:
    DDP's "module." when every name has it (a user's own submodule "module" does not name every
    tensor), and the wrappers' attributes (strip_wrappers). Names may become equal: the caller
    decides."""
    ddp = bool(names) and all(n.startswith(DDP_PREFIX) for n in names)
    return {name: strip_wrappers(name[len(DDP_PREFIX):] if ddp else name) for name in names}


def module_fqns(model: nn.Module) -> Callable[[str], str]:
    """The canonical FQN of a key of `model.state_dict()` (or a name from named_parameters), fast:
    the wrappers at the top (DDP's "module.", torch.compile's "_orig_mod.") are found on the
    module and cut off as one known prefix; only a name with a wrapper further down (a compiled
    submodule, FSDP, activation checkpointing) takes torch's walk of the module tree
    (canonical_fqn), which costs hundreds of µs per name."""
    prefix, obj = "", model
    while True:
        if isinstance(obj, DistributedDataParallel):
            prefix, obj = prefix + DDP_PREFIX, obj.module
        elif isinstance(obj, torch._dynamo.eval_frame.OptimizedModule):
            prefix, obj = prefix + "_orig_mod.", obj._orig_mod
        else:
            break

    def canonical(fqn: str) -> str:
        if prefix:
            if not fqn.startswith(prefix):
                return canonical_fqn(model, fqn)
            fqn = fqn[len(prefix):]
        return canonical_fqn(obj, fqn) if INNER_WRAPPER.search(fqn) else fqn

    return canonical


def canonical_fqn(model: nn.Module, fqn: str) -> str:
    """`fqn` (a key of model.state_dict() or a name from named_parameters) without the wrappers' prefixes.

    torch.distributed.checkpoint.state_dict's own helper, which walks the module tree (a prefix is
    taken out only where the module there is such a wrapper, never a user's own "module"
    submodule) and names the optimizer state the same way. A name the walk cannot follow (a
    state_dict hook that renames keys) stays as it is.
    """
    try:
        fqns = _dcp_state_dict._get_fqns(model, fqn)
    except (AttributeError, AssertionError, RuntimeError):
        return fqn
    if len(fqns) != 1:  # an FSDP flat parameter: state_dict() never yields one
        return fqn
    return next(iter(fqns))
