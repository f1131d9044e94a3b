"""Element types as named in safetensors files, with their sizes and torch names.

The daemon never needs torch to move bytes: it only needs the size of an element.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

# safetensors dtype name -> (bytes per element, torch dtype attribute name)
_TABLE: Final[dict[str, tuple[int, str]]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F32": (4, "float32"),
    "F64": (8, "float64"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
}

DTYPE_NAMES: Final[frozenset[str]] = frozenset(_TABLE)
_BY_TORCH_NAME: Final[dict[str, str]] = {torch_name: name for name, (_, torch_name) in _TABLE.items()}


class UnknownDtypeError(ValueError):
    """A dtype that ckptd cannot store."""


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name, e.g. itemsize("BF16") == 2."""
    try:
        return _TABLE[dtype][0]
    except KeyError:
        raise UnknownDtypeError(
            f"unknown dtype {dtype!r}; expected one of {', '.join(sorted(_TABLE))}"
        ) from None


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of this dtype and shape, e.g. nbytes("BF16", (2, 3)) == 12."""
    n = itemsize(dtype)
    for d in shape:
        n *= d
    return n


def torch_name(dtype: str) -> str:
    """The torch attribute name of a safetensors dtype name, e.g. "BF16" -> "bfloat16"."""
    itemsize(dtype)
    return _TABLE[dtype][1]


def from_torch_name(name: str) -> str:
    """The safetensors dtype name of a torch dtype name ("float32" or "torch.float32")."""
    short = name.removeprefix("torch.")
    try:
        return _BY_TORCH_NAME[short]
    except KeyError:
        raise UnknownDtypeError(
            f"tensors of dtype {name} cannot be checkpointed; supported: "
            f"{', '.join(sorted(_BY_TORCH_NAME))}"
        ) from None
