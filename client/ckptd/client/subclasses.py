"""Tensor subclasses in a state (torchao's float8 training tensors, other `__torch_dispatch__`
wrappers): stored exactly, or refused with the reason.

ckptd stores plain tensors' bytes and never pickles, so a subclass is storable only when its
values are one plain tensor it wraps: a wrapper whose `__tensor_flatten__` names exactly one
inner tensor, of the wrapper's dtype and shape and equal to it (e.g. torchao's
`WeightWithDynamicFloat8CastTensor`, the high-precision weight that FSDP2 casts to float8 for its
all-gather). That inner tensor is stored and, on load, filled in place, so the wrapper sees the
loaded values. Every other subclass (torchao's `Float8TrainingTensor`: float8 data plus a scale
and a dtype to emulate; quantized optimizer states) is refused with what to save instead: its
parts are plain tensors that ckptd stores exactly (float8 included). DTensor is not a subclass
here: its placements are ckptd's layout (ckptd.client.layout); its local tensor may be a wrapper.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def is_wrapper(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a tensor subclass other than DTensor (torch.nn.Parameter is not one)."""
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(tensor, DTensor)


def inner_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose memory holds `tensor`'s values: `tensor` itself unless it is a
    wrapper (is_wrapper) of one plain tensor of its dtype and shape. Not checked: call
    `check_wrapper` once per structure first."""
    while is_wrapper(tensor):
        names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        tensor = getattr(tensor, names[0])
    return tensor


def check_wrapper(name: str, tensor: torch.Tensor) -> None:
    """Refuse a subclass whose values are not one wrapped plain tensor; TypeError says why and
    what to save instead. Compares the wrapper with its inner tensor once (at the first save or
    load of a state's structure)."""
    if not is_wrapper(tensor):
        return
    kind = type(tensor).__name__
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        raise TypeError(
            f"cannot checkpoint {name!r}: it is a {kind}, a tensor subclass without __tensor_flatten__; "
            "ckptd stores plain tensors: pass its plain value (e.g. tensor.as_subclass(torch.Tensor) if that is its data)"
        )
    names, _ = flatten()
    inner = [getattr(tensor, n) for n in names]
    if len(inner) != 1 or inner[0].dtype != tensor.dtype or inner[0].shape != tensor.shape:
        parts = ", ".join(f"{n}: {t.dtype}{list(t.shape)}" for n, t in zip(names, inner))
        raise TypeError(
            f"cannot checkpoint {name!r}: it is a {kind} ({tensor.dtype}{list(tensor.shape)} made of {parts}), whose "
            "values are not one tensor ckptd could store as they are, and ckptd never pickles a subclass's metadata; "
            "save its parts as tensors of their own (e.g. float8 data and its scale: both are stored exactly) or "
            "its high-precision value, and rebuild the subclass from them after a load"
        )
    check_wrapper(f"{name} ({kind}.{names[0]})", inner[0])
    try:
        with torch.no_grad():  # the subclass's own equality (its dispatch), against the bytes that would be stored
            same = bool(torch.equal(tensor.detach(), inner_tensor(inner[0]).detach()))
    except (RuntimeError, NotImplementedError, TypeError):
        same = False
    if not same:
        raise TypeError(
            f"cannot checkpoint {name!r}: it is a {kind} whose inner tensor {names[0]!r} does not hold its values; "
            "save the values you want restored as a plain tensor"
        )
