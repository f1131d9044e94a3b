"""safetensors files' headers: made for the files ckptd writes, and read back strictly.

A file is an 8-byte little-endian header length, a JSON header ({key: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}) padded with spaces, then the tensors' bytes. What
ckptd writes puts them back to back in header order, the header padded to a multiple of 8
bytes. What it reads (its own files in `ckptd verify`, anyone's in `ckptd import`) must follow
the format as the safetensors library does: a JSON object naming each key once, every entry a
dtype, a shape of non-negative integers and data_offsets [begin, end], the entries' bytes
covering the data region exactly, without overlaps or holes (so no file is two things at once).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ckptd.common import dtypes, json_read
from ckptd.format.index import FormatError

HEADER_ALIGN = 8
MAX_HEADER_BYTES = 100 * 2**20
_SHOWN = 200  # characters of a malformed entry a message quotes


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset in the data region
    end: int


def safetensors_header(
    entries: Iterable[tuple[str, str, Sequence[int]]], metadata: dict[str, str] | None = None, size: int = 0
) -> tuple[bytes, list[HeaderEntry]]:
    """The header bytes (length prefix included) for tensors stored back to back in this order.

    Returns the bytes and each tensor's place; a tensor's absolute file offset is
    len(header) + entry.begin. `size` > 0: pad the header with spaces (which the format allows)
    to exactly `size` bytes, for a header written after data whose place was reserved for it;
    raises FormatError if it does not fit.
    """
    encode = json.JSONEncoder(separators=(",", ":")).encode
    parts = [f'{{"__metadata__":{encode({"format": "pt", **(metadata or {})})}']
    keys = {"__metadata__"}
    placed = []
    cursor = 0
    for key, dtype, shape in entries:  # encoded one at a time: no document of dicts (issue 30 finding 5)
        if key in keys:
            raise FormatError(f"key {key!r} appears twice in one safetensors file")
        keys.add(key)
        nbytes = dtypes.nbytes(dtype, shape)
        parts.append(f"{encode(key)}:{encode({'dtype': dtype, 'shape': list(shape), 'data_offsets': [cursor, cursor + nbytes]})}")
        placed.append(HeaderEntry(key, dtype, tuple(shape), cursor, cursor + nbytes))
        cursor += nbytes
    text = (",".join(parts) + "}").encode()
    if size:
        assert size % HEADER_ALIGN == 0, f"header room {size} is not a multiple of {HEADER_ALIGN}"
        if 8 + len(text) > size:
            raise FormatError(f"a safetensors header of {8 + len(text)} bytes does not fit the {size} bytes reserved for it")
        text += b" " * (size - 8 - len(text))
    else:
        text += b" " * (-(len(text) + 8) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text, placed


def read_header(pread: Callable[[int, int], bytes], size: int) -> bytes | None:
    """The safetensors header of a `size`-byte file read through pread(nbytes, offset): its
    8-byte length and JSON, as the index's file checksum covers them; None when the length is
    not a valid one (past the file's end, or over MAX_HEADER_BYTES)."""
    prefix = pread(8, 0)
    length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
    if not 0 <= length <= min(size - 8, MAX_HEADER_BYTES):
        return None
    return prefix + pread(length, 8)


def parse_safetensors_header(prefix: bytes, file_size: int | None = None) -> tuple[int, dict[str, HeaderEntry]]:
    """Parse a header from the first bytes of a file. Returns (data region offset, entries by key).

    `prefix` must hold at least the whole header; `file_size`: the whole file's, when known (the
    entries must then cover the data region to its end). Raises FormatError on anything that
    does not follow the format (see the module docstring), naming the key and the problem.
    """
    if len(prefix) < 8:
        raise FormatError("file too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES or 8 + length > len(prefix):
        raise FormatError(f"safetensors header of {length} bytes is larger than the file or the {MAX_HEADER_BYTES} limit")
    try:
        header = json_read.loads(prefix[8 : 8 + length], object_pairs_hook=_object_naming_each_key_once, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FormatError(f"safetensors header is a JSON {type(header).__name__}, not an object of tensors")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"safetensors header's __metadata__ must map strings to strings: {_shown(metadata)}")
    entries = {key: _entry(key, value) for key, value in header.items()}
    _check_coverage(entries, None if file_size is None else file_size - 8 - length)
    return 8 + length, entries


def _object_naming_each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise FormatError(f"safetensors header names {twice!r} twice (which one holds is not clear)")
    return obj


def _no_constant(name: str) -> Any:
    raise FormatError(f"safetensors header holds {name}, which is not JSON")


def _entry(key: str, value: Any) -> HeaderEntry:
    """The entry of `key`, its fields checked: a dtype string, a shape of non-negative integers,
    data_offsets [begin, end] with 0 <= begin <= end, and end - begin the bytes of that shape."""
    fields = value if isinstance(value, dict) else {}
    dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    if not (isinstance(dtype, str) and _naturals(shape) and _naturals(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise FormatError(
            f"safetensors header entry {key!r} is malformed: {_shown(value)} (it needs a dtype string, a shape of "
            "integers in [0, 2**63) and data_offsets [begin, end] with 0 <= begin <= end)"
        )
    begin, end = offsets
    entry = HeaderEntry(key, dtype, tuple(shape), begin, end)
    expected = dtypes.nbytes(entry.dtype, entry.shape)
    if end - begin != expected:
        raise FormatError(f"tensor {key!r}: {end - begin} bytes for {entry.dtype}{list(entry.shape)}")
    return entry


def _naturals(value: Any) -> bool:
    """A list of ints in [0, 2**63): what a dimension or byte offset can be (torch and numpy
    take sizes as int64; a shape [2**64, 0] holds no bytes and would be taken otherwise)."""
    return isinstance(value, list) and all(type(v) is int and 0 <= v < _INT64_END for v in value)


_INT64_END = 1 << 63


def _check_coverage(entries: dict[str, HeaderEntry], data_bytes: int | None) -> None:
    """The entries' bytes tile the data region from its start (to its end, `data_bytes`, when known)."""
    at, last = 0, ""
    for begin, end, key in sorted((e.begin, e.end, e.key) for e in entries.values()):
        if begin < at:
            raise FormatError(f"tensors {last!r} and {key!r} overlap (bytes {begin}-{min(at, end)} of the data)")
        if begin > at:
            raise FormatError(f"bytes {at}-{begin} of the data belong to no tensor (before {key!r}); the format has no holes")
        at, last = end, key
    if data_bytes is not None and at > data_bytes:
        raise FormatError(f"tensor {last!r} ends past the end of the file")
    if data_bytes is not None and at < data_bytes:
        raise FormatError(f"the last {data_bytes - at} bytes of the file belong to no tensor; the format has no holes")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
