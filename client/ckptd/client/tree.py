"""Exact, pickle-free JSON encoding of the non-tensor parts of a checkpoint ("extras trees").

`encode` turns a tree of Python values into strict JSON (no NaN or Infinity literals) and hands
every tensor it meets to a callback under a logical name; `decode` turns that JSON back into
equal values, asking a callback for the tensors by name. What goes in comes back:

    dict (str keys)          JSON object
    dict (other keys)        {"__dict__": [[key, value], ...]}      keys keep their type (int, tuple, ...)
    list                     JSON array
    tuple                    {"__tuple__": [...]}                   comes back as a tuple
    str, bool, None, int     themselves (ints of any size)
    float                    itself; NaN and +-inf as {"__float__": "nan" | "inf" | "-inf"}
    bytes                    {"__bytes__": "<base64>"}
    torch.Tensor             {"__tensor__": "<logical name>"}       the tensor goes to add_tensor
    numpy.ndarray            {"__ndarray__": {"dtype", "shape", "data": "<base64>"}}
    numpy scalar             {"__npscalar__": {"dtype", "shape": [], "data": "<base64>"}}

NumPy arrays are stored inline as raw bytes (exact, NaN payloads included) rather than as
tensors: they are small in practice (RNG states, data-loader positions) and keep their NumPy
dtype and type this way. Subclasses come back as their base type (an OrderedDict as a dict, a
namedtuple or torch.Size as a tuple). A tag is a JSON object with exactly one key from TAGS; a
user dict that would look like one is written in the `__dict__` form, so nothing collides.

A tensor's logical name is the prefix and the path of keys and list indices below it, joined
by "/": encode({"a": [t]}, "extra", add) names the tensor "extra/a/0". A tensor at the top of
the tree is named by the prefix alone.

A tree may nest at most MAX_EXTRAS_DEPTH (64) containers deep; encode refuses a deeper one with
a ValueError naming the path (the daemon refuses deeper extras JSON with INVALID_ARGUMENT).
"""

from __future__ import annotations

import base64
import math
from itertools import chain, repeat
from typing import Any, Callable

import numpy as np
import torch

from ckptd.client.shards import LocalShard, LocalShards
from ckptd.common.names import MAX_EXTRAS_DEPTH

TENSOR = "__tensor__"
TUPLE = "__tuple__"
FLOAT = "__float__"
BYTES = "__bytes__"
NDARRAY = "__ndarray__"
NPSCALAR = "__npscalar__"
MAPPING = "__dict__"
TAGS = frozenset({TENSOR, TUPLE, FLOAT, BYTES, NDARRAY, NPSCALAR, MAPPING})

# numpy dtype kinds stored exactly as raw bytes: bool, signed and unsigned ints, floats, complex.
_NUMPY_KINDS = "biufc"
_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

AddTensor = Callable[[str, "torch.Tensor | LocalShard | LocalShards"], None]  # LocalShard(s): boxes of the logical tensor
GetTensor = Callable[[str], torch.Tensor]
AddPlainTensors = Callable[[list[str], list[torch.Tensor]], None]  # names, plain tensors (torch.Tensor, nn.Parameter)
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def encode(value: Any, tensor_name_prefix: str, add_tensor: AddTensor, add_plain_tensors: AddPlainTensors | None = None) -> Any:
    """The strict-JSON form of `value`; every tensor in it is passed to add_tensor(name, tensor).

    add_plain_tensors, when given, takes the tensors of a dict of plain tensors alone (every
    value a torch.Tensor or nn.Parameter: a model's or an optimizer field's) in one call,
    add_plain_tensors(names, tensors) in the dict's order, instead of add_tensor one by one; it
    must do what those add_tensor calls would (a state of thousands of tensors is mostly such dicts).

    Raises TypeError naming the path of the first value that cannot be encoded (an unsupported
    type, a tensor used as a dict key, an object dtype array, a container that contains itself),
    ValueError naming the path of a container nested more than MAX_EXTRAS_DEPTH deep.
    """
    return _Encoder(tensor_name_prefix, add_tensor, add_plain_tensors).value(value, ())


def decode(json_value: Any, get_tensor: GetTensor) -> Any:
    """The value that `encode` turned into `json_value`; tensors come from get_tensor(name).

    Raises ValueError when json_value is not something encode wrote (a malformed tag).
    """
    if isinstance(json_value, dict):
        if len(json_value) == 1:
            (key, payload), = json_value.items()
            if key in TAGS:
                return _decode_tag(key, payload, get_tensor)
        return {k: decode(v, get_tensor) for k, v in json_value.items()}
    if isinstance(json_value, list):
        return [decode(v, get_tensor) for v in json_value]
    if json_value is None or isinstance(json_value, (str, bool, int, float)):
        return json_value
    raise ValueError(f"not an encoded tree: a value of type {type(json_value).__name__}")


class _Encoder:
    def __init__(self, prefix: str, add_tensor: AddTensor, add_plain_tensors: AddPlainTensors | None) -> None:
        self.prefix = prefix
        self.add_tensor = add_tensor
        self.add_plain_tensors = add_plain_tensors
        self.open: set[int] = set()  # ids of the containers on the current path (cycle check)

    def where(self, path: tuple[str, ...]) -> str:
        return "/".join((self.prefix, *path))

    def value(self, value: Any, path: tuple[str, ...], in_key: bool = False) -> Any:
        # Order matters: bool is an int, numpy's float64 is a float. Tensors first: a state is
        # mostly tensors, and none of the other types is one.
        if isinstance(value, (torch.Tensor, LocalShard, LocalShards)) and not in_key:
            name = self.where(path)
            self.add_tensor(name, value)
            return {TENSOR: name}
        if value is None or isinstance(value, (str, bool)):
            return value
        if isinstance(value, np.generic):
            return {NPSCALAR: self.array(np.asarray(value), path)}
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {FLOAT: repr(float(value))}
        if isinstance(value, bytes):
            return {BYTES: base64.b64encode(value).decode("ascii")}
        if isinstance(value, np.ndarray) and not in_key:
            return {NDARRAY: self.array(value, path)}
        if isinstance(value, (dict, list, tuple)):
            return self.container(value, path, in_key)
        what = "a dict key" if in_key else "a value"
        raise TypeError(
            f"cannot checkpoint {self.where(path)!r}: {what} of type {_type_name(value)} is not supported; "
            "convert it to a JSON-able value (dict, list, tuple, str, int, float, bool, None, bytes), "
            "a tensor or a NumPy array, or give the object state_dict()/load_state_dict()"
        )

    def container(self, value: dict | list | tuple, path: tuple[str, ...], in_key: bool) -> Any:
        if id(value) in self.open:
            raise TypeError(f"cannot checkpoint {self.where(path)!r}: the {_type_name(value)} contains itself")
        if len(self.open) >= MAX_EXTRAS_DEPTH:
            raise ValueError(
                f"cannot checkpoint {self.where(path)!r}: it is nested {len(self.open) + 1} containers deep and ckptd "
                f"stores values nested at most {MAX_EXTRAS_DEPTH} deep; flatten the structure (or store it as bytes)"
            )
        self.open.add(id(value))
        try:
            if isinstance(value, dict):
                return self.mapping(value, path)
            items = [self.value(v, (*path, str(i)), in_key) for i, v in enumerate(value)]
            return {TUPLE: items} if isinstance(value, tuple) else items
        finally:
            self.open.discard(id(value))

    def mapping(self, value: dict, path: tuple[str, ...]) -> Any:
        plain = _plain_keys(value)
        add_plain_tensors = self.add_plain_tensors
        if plain and add_plain_tensors is not None and value:
            encoded = self.plain_tensors(value, path, add_plain_tensors)
            if encoded is not None:
                return encoded
        if plain:
            return {k: self.value(v, (*path, k)) for k, v in value.items()}
        return {MAPPING: [[self.value(k, (*path, str(k)), in_key=True), self.value(v, (*path, str(k)))] for k, v in value.items()]}

    def plain_tensors(self, value: dict[Any, Any], path: tuple[str, ...], add_plain_tensors: AddPlainTensors) -> Any:
        """What `mapping` makes of `value` (non-empty, of string keys), made for all its tensors at
        once (add_plain_tensors) when its values are plain tensors alone, or dicts of string keys
        and plain tensors alone (an optimizer's state: {param: {field: tensor}}); None otherwise.

        The names and the order are value()'s: where((*path, k)) is where(path) + "/" + k. An inner
        dict holds only tensors, so it cannot hold `value` (no cycle); it is one level deeper, so
        the depth is checked as container() would. Checked and named by C-level maps over all
        keys and values: no Python per tensor but the leaf {TENSOR: name} itself."""
        items = list(value.values())
        base = self.where(path) + "/"
        if _PLAIN_TENSORS.issuperset(map(type, items)):
            names = list(map(base.__add__, value))
            add_plain_tensors(names, items)
            return {k: {TENSOR: name} for k, name in zip(value, names)}
        if not {dict}.issuperset(map(type, items)) or len(self.open) >= MAX_EXTRAS_DEPTH:
            return None
        fields = list(chain.from_iterable(items))  # the inner dicts' keys, in order
        tensors = list(chain.from_iterable(map(dict.values, items)))
        # an inner key in TAGS might be a tag-like dict's (encoded in the MAPPING form): left to mapping()
        if not all(map(isinstance, fields, repeat(str))) or not TAGS.isdisjoint(fields) or not _PLAIN_TENSORS.issuperset(map(type, tensors)):
            return None
        outer = chain.from_iterable(map(repeat, value, map(len, items)))  # each outer key once per field of its dict
        names = list(map("{}{}/{}".format, repeat(base), outer, fields))
        add_plain_tensors(names, tensors)
        leaves = iter([{TENSOR: name} for name in names])
        # zip stops at the end of `inner` before taking from `leaves`: each inner dict takes its own
        return {key: dict(zip(inner, leaves)) for key, inner in value.items()}

    def array(self, array: np.ndarray, path: tuple[str, ...]) -> dict[str, Any]:
        if array.dtype.kind not in _NUMPY_KINDS:
            raise TypeError(
                f"cannot checkpoint {self.where(path)!r}: NumPy dtype {array.dtype} is not supported; "
                "use a bool, integer, float or complex dtype (or a list of plain values)"
            )
        data = np.ascontiguousarray(array).tobytes()
        return {"dtype": array.dtype.str, "shape": list(array.shape), "data": base64.b64encode(data).decode("ascii")}


def _plain_keys(value: dict[Any, Any]) -> bool:
    """Whether a dict is encoded as a JSON object of its own keys (else the MAPPING form)."""
    return all(map(isinstance, value, repeat(str))) and not (len(value) == 1 and next(iter(value)) in TAGS)


# Leaves that `TreeIdentity` takes as unchanged while they are the same object: immutable values,
# and plain tensors (their metadata is checked apart: ckptd.client.structure).
_SAME_WHILE_SAME_OBJECT = frozenset({type(None), bool, int, float, str, bytes, torch.Tensor, torch.nn.Parameter})


class TreeIdentity:
    """Every container, key and value of a tree of plain values, held, so that `holds` can tell at
    C speed (a few list comparisons per nesting level, none per value in Python) whether a tree
    is still the very same: the same dict, list and tuple objects with the same keys and values,
    in the same order. Such a tree encodes exactly as it did (tensors' metadata aside: a tensor is
    checked only for being the same object).

    Only trees of exact dicts, lists and tuples with immutable leaves (None, bool, int, float, str,
    bytes, NumPy scalars) and plain tensors (torch.Tensor, nn.Parameter) can be taken: `of`
    returns None for any other (a NumPy array, whose values change in place, a subclass such as
    an OrderedDict, a LocalShard, a DTensor). Holding the objects keeps their ids theirs, so equal
    ids mean the same objects.
    """

    def __init__(self, root: Any, levels: list[tuple[list[Any], ...]]) -> None:
        self._root = root
        # per nesting level: (dicts, their lengths, their keys, the keys' ids, their values, the
        # values' ids, lists, their lengths, their items, the items' ids); tuples cannot change
        self._levels = levels

    @classmethod
    def of(cls, value: Any) -> "TreeIdentity | None":
        """The identity of tree `value`, or None when it holds what `holds` cannot vouch for."""
        levels: list[tuple[list[Any], ...]] = []
        level = [value]
        while level:
            dicts: list[dict[Any, Any]] = []
            lists: list[list[Any]] = []
            tuples: list[tuple[Any, ...]] = []
            for item in level:
                kind = type(item)
                if kind is dict:
                    dicts.append(item)
                elif kind is list:
                    lists.append(item)
                elif kind is tuple:
                    tuples.append(item)
                elif kind not in _SAME_WHILE_SAME_OBJECT and not isinstance(item, np.generic):
                    return None
            keys = list(chain.from_iterable(dicts))
            values = list(chain.from_iterable(map(dict.values, dicts)))
            items = list(chain.from_iterable(lists))
            levels.append((
                dicts, list(map(len, dicts)), keys, list(map(id, keys)), values, list(map(id, values)),
                lists, list(map(len, lists)), items, list(map(id, items)),
            ))
            level = [*values, *items, *chain.from_iterable(tuples)]
        return cls(value, levels)

    def holds(self, value: Any) -> bool:
        """Whether `value` is the recorded tree, unchanged (see the class docstring)."""
        if value is not self._root:
            return False
        for dicts, dict_lens, _, key_ids, _, value_ids, lists, list_lens, _, item_ids in self._levels:
            if dicts and (
                list(map(len, dicts)) != dict_lens
                or list(map(id, chain.from_iterable(dicts))) != key_ids
                or list(map(id, chain.from_iterable(map(dict.values, dicts)))) != value_ids
            ):
                return False
            if lists and (list(map(len, lists)) != list_lens or list(map(id, chain.from_iterable(lists))) != item_ids):
                return False
        return True


def _decode_tag(tag: str, payload: Any, get_tensor: GetTensor) -> Any:
    if tag == TENSOR and isinstance(payload, str):
        return get_tensor(payload)
    if tag == TUPLE and isinstance(payload, list):
        return tuple(decode(v, get_tensor) for v in payload)
    if tag == FLOAT and payload in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[payload]
    if tag == BYTES and isinstance(payload, str):
        return base64.b64decode(payload.encode("ascii"), validate=True)
    if tag == NDARRAY:
        return _decode_array(payload)
    if tag == NPSCALAR:
        return _decode_array(payload)[()]
    if tag == MAPPING and isinstance(payload, list) and all(isinstance(p, list) and len(p) == 2 for p in payload):
        return {decode(k, get_tensor): decode(v, get_tensor) for k, v in payload}
    raise ValueError(f"malformed {tag} tag in an encoded tree: {str(payload)[:200]}")


def _decode_array(payload: Any) -> np.ndarray:
    try:
        dtype = np.dtype(payload["dtype"])
        shape = tuple(int(n) for n in payload["shape"])
        data = base64.b64decode(payload["data"].encode("ascii"), validate=True)
        if dtype.kind not in _NUMPY_KINDS:
            raise ValueError(f"dtype {dtype} is not one encode writes")
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed NumPy array in an encoded tree ({exc}): {str(payload)[:200]}") from None


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
