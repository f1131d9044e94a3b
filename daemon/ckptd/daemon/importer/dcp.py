"""Reading a torch.distributed.checkpoint (DCP) directory for `ckptd import`, without
unpickling untrusted data.

A DCP directory written by `dcp.save` with a FileSystemWriter (by any number of ranks, DTensor
shards included) holds `.metadata` (a pickle of torch.distributed.checkpoint.metadata.Metadata)
and `__<rank>_<n>.distcp` data files of torch.save'd tensors and objects. torch 2.13's own
FileSystemReader.read_metadata reads `.metadata` with Python's unrestricted unpickler: a crafted
file would run code. Here:

- `.metadata` is read by torch's restricted weights-only unpickler
  (torch._weights_only_unpickler) with only the DCP metadata classes allow-listed
  (torch.serialization.safe_globals: Metadata, TensorStorageMetadata, BytesStorageMetadata,
  ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING,
  filesystem._StorageInfo, pathlib paths, torch.Size) besides what it allows anyway (dtypes,
  layouts). That unpickler reads only pickle protocol 2, and DCP writes protocol 4 or 5, so the
  stream is first rewritten as protocol 2 (`as_protocol_2`: it is parsed with pickletools, never
  run; opcodes outside a fixed set are refused). The result is checked: every field has the
  type the reader relies on, and every data file named is a plain file name in the directory.
- tensors are read by torch's FileSystemReader.read_data, which loads each with
  torch.load(weights_only=True), into tensors allocated here from the metadata (the one copy of
  the data an import of DCP makes: its files hold torch.save archives, not raw bytes);
- "bytes" entries (non-tensor values DCP torch.save'd: param_groups, counters, data-loader
  states) are loaded with torch.load(weights_only=True); what that refuses (custom classes) is
  skipped and reported, never unpickled.

What is trusted: torch's weights-only unpickler and the allow-listed classes' constructors;
nothing from the directory is executed.
"""

from __future__ import annotations

import io
import math
import pathlib
import pickletools
import re
import struct
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ckptd.common.names import decimal
from ckptd.common.boxes import Box, coverage_problems
from ckptd.daemon.importer.direct_write import ImportRefused
from ckptd.daemon.importer.refusals import short_reason, weights_only_refusal
from ckptd.daemon.importer.source import read_source, source_file

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 30

# What `.metadata` may construct (besides dtypes, layouts and torch.Size, which the weights-only
# unpickler allows by default). Paths: StorageMeta.checkpoint_id, under the names Python versions
# pickle them by; a Windows path is read as a pure path (it is only a label).
SAFE_GLOBALS: tuple[Any, ...] = (
    Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex,
    StorageMeta, _MEM_FORMAT_ENCODING, _StorageInfo, torch.Size,
    (pathlib.PosixPath, "pathlib.PosixPath"), (pathlib.PosixPath, "pathlib._local.PosixPath"),
    (pathlib.PurePosixPath, "pathlib.PurePosixPath"), (pathlib.PureWindowsPath, "pathlib.WindowsPath"),
    (pathlib.PureWindowsPath, "pathlib._local.WindowsPath"), (pathlib.PureWindowsPath, "pathlib.PureWindowsPath"),
)

# Protocol-2 opcodes copied as they are (torch's weights-only unpickler runs each of them with
# its own checks); the protocol-4 ones are rewritten by as_protocol_2; anything else is refused.
_COPIED = frozenset({
    "MARK", "STOP", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "NONE", "NEWTRUE", "NEWFALSE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
    "NEWOBJ", "REDUCE", "BUILD", "GLOBAL",
})
_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})
_PLAIN_NAME = re.compile(r"[^/\\\x00]+")
_INCOMPLETE = " (the checkpoint is incomplete: copy the whole directory that dcp.save wrote, every rank's files and .metadata)"


class _Refused:
    """The value of a "bytes" entry that torch.load(weights_only=True) refused."""


def read_dcp(directory: Path) -> tuple[Any, list[str]]:
    """The state saved in a DCP directory, nested as it was given to dcp.save (tensors whole,
    whatever the ranks' shards were), and what was not imported (each with the reason).
    Raises ImportRefused for metadata that is not a DCP checkpoint's or cannot be read safely."""
    metadata = read_metadata(directory)
    for name in sorted({info.relative_path for info in metadata.storage_data.values()}):
        source_file(directory, name)  # a regular file of the directory: never a FIFO, a device or a link out
    paths = _paths(metadata)
    skipped: list[str] = []
    flat = _allocate(metadata, directory)
    planner = _WeightsOnlyPlanner()
    try:
        with warnings.catch_warnings():  # one process, on purpose: not a problem to warn about
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(flat, storage_reader=_CheckedReader(directory, metadata), planner=planner, no_dist=True)
    except CheckpointException as exc:  # what a rank's read raised, wrapped (a BaseException)
        causes = [failure[0] for failure in exc.failures.values()]
        detail = f"{type(causes[0]).__name__}: {short_reason(causes[0])}" if causes else str(exc)
        raise ImportRefused(f"cannot read the DCP checkpoint {directory}: {detail}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged or crafted file makes the reader fail in any way
        raise ImportRefused(f"cannot read the DCP checkpoint {directory}: {type(exc).__name__}: {short_reason(exc)}") from None
    values = {}
    for fqn, value in planner.state_dict.items():
        if isinstance(value, _Refused):
            skipped.append(f"{fqn!r}: {planner.refused[fqn]}; not imported")
        else:
            values[paths[fqn]] = value
    return _nest(values), skipped


def _allocate(metadata: Metadata, directory: Path) -> dict[str, Any]:
    """The flat state dcp.load fills: an empty whole tensor per tensor entry, None per "bytes"
    entry. ImportRefused when the tensors would not fit in the memory available."""
    sizes = {fqn: (tuple(m.size), m.properties.dtype) for fqn, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in sizes.values())
    available = _memory_available()
    if available is not None and total > available:
        raise ImportRefused(
            f"the DCP checkpoint {directory} holds {total / 2**30:.1f} GiB of tensors and this machine has "
            f"{available / 2**30:.1f} GiB of memory available; ckptd import reads a DCP checkpoint's tensors into "
            "memory (its files hold torch.save archives): run it where that much memory is free"
        )
    try:
        return {fqn: torch.empty(sizes[fqn][0], dtype=sizes[fqn][1]) if fqn in sizes else None for fqn in metadata.state_dict_metadata}
    except RuntimeError as exc:  # the allocator's "not enough memory"
        raise ImportRefused(f"cannot allocate the tensors of the DCP checkpoint {directory}: {short_reason(exc)}") from None


def _memory_available() -> int | None:
    """Bytes of memory available for new allocations (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_metadata(directory: Path) -> Metadata:
    """The directory's `.metadata`, read by torch's weights-only unpickler (module docstring)
    and checked; ImportRefused when it is missing, not a DCP metadata file, or not safe."""
    path = directory / METADATA_NAME
    try:
        data = read_source(source_file(directory, METADATA_NAME), MAX_METADATA_BYTES)
    except OSError as exc:
        raise ImportRefused(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        stream = as_protocol_2(data)
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            metadata = torch._weights_only_unpickler.load(io.BytesIO(stream), encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - a crafted or damaged file makes the unpickler fail in any way
        raise ImportRefused(
            f"{path} is not DCP metadata that ckptd can read without running code from it ({type(exc).__name__}: "
            f"{short_reason(exc)}); ckptd reads only the classes of torch.distributed.checkpoint.metadata"
        ) from None
    return _checked(metadata, path)


def as_protocol_2(data: bytes) -> bytes:
    """The pickle in `data` rewritten with protocol-2 opcodes only, which torch's weights-only
    unpickler reads: frames dropped, protocol-4 strings as BINUNICODE, MEMOIZE as LONG_BINPUT
    with the index it stands for, STACK_GLOBAL as GLOBAL of the two strings pushed before it
    (as Python's pickler writes it). `data` is parsed (pickletools.genops), never run; ValueError
    for opcodes outside the known set or another layout of them."""
    ops = []
    for op, arg, pos in pickletools.genops(data):
        if pos is None:
            raise ValueError("an opcode without a position")
        ops.append((op, arg, pos))
    out = bytearray(b"\x80\x02")
    pending: list[tuple[str, list[int]]] = []  # strings pushed but not written yet, with their memo indices
    memo: dict[int, tuple[str, Any]] = {}  # index in the original -> ("str", text) | ("slot", index written)
    slots = 0

    def put() -> int:
        nonlocal slots
        out.extend(b"r" + struct.pack("<I", slots))
        slots += 1
        return slots - 1

    def flush() -> None:
        for text, indices in pending:
            raw = text.encode("utf-8", "surrogatepass")
            out.extend(b"X" + struct.pack("<I", len(raw)) + raw)
            if indices:
                slot = put()
                for index in indices:
                    memo[index] = ("slot", slot)
        pending.clear()

    for k, (op, arg, pos) in enumerate(ops):
        name = op.name
        end = ops[k + 1][2] if k + 1 < len(ops) else pos + 1
        if (name == "PROTO" and k == 0) or name == "FRAME":
            continue
        if name in _STRINGS:
            pending.append((str(arg), []))
        elif name in ("MEMOIZE", "BINPUT", "LONG_BINPUT"):
            index = len(memo) if name == "MEMOIZE" else arg
            if not isinstance(index, int):
                raise ValueError(f"{name} without a memo index")
            if pending:
                pending[-1][1].append(index)
                memo[index] = ("str", pending[-1][0])
            else:
                memo[index] = ("slot", put())
        elif name in ("BINGET", "LONG_BINGET"):
            if arg not in memo:
                raise ValueError(f"memo index {arg} used before it is set")
            what, value = memo[arg]
            if what == "str":
                pending.append((value, []))
            else:
                flush()
                out.extend(b"j" + struct.pack("<I", value))
        elif name == "STACK_GLOBAL":
            if len(pending) < 2:
                raise ValueError("STACK_GLOBAL without the module and name strings before it")
            (module, _), (qualname, _) = pending[-2], pending[-1]
            del pending[-2:]
            flush()
            if "\n" in module or "\n" in qualname:
                raise ValueError("a global name with a line break")
            out.extend(b"c" + f"{module}\n{qualname}\n".encode("utf-8", "surrogatepass"))
        elif name in _COPIED:
            flush()
            out.extend(data[pos:end])
        else:
            raise ValueError(f"pickle opcode {name}, which DCP metadata does not use")
    return bytes(out)


def _checked(metadata: Any, path: Path) -> Metadata:
    """`metadata`, once every field the reader uses has its type (a crafted file gives objects
    of the allowed classes with any attributes); ImportRefused naming the field otherwise."""

    def bad(what: str) -> ImportRefused:
        return ImportRefused(f"{path} is not valid DCP metadata: {what}")

    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict):
        raise bad(f"it holds a {type(metadata).__name__}, not torch.distributed.checkpoint.metadata.Metadata")
    if not isinstance(metadata.storage_data, dict):
        raise bad("no storage_data (where each entry's bytes are)")
    stored: set[tuple[str, tuple[int, ...] | None]] = set()  # (fqn, chunk offsets or None): what storage_data locates
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str) or type(info) is not _StorageInfo:
            raise bad(f"a storage_data entry {index!r}: {info!r}")
        offset = index.__dict__.get("offset")
        if offset is not None and _dims(offset) is None:
            raise bad(f"entry {index.fqn!r} has a storage_data key with bad offsets {offset!r}")
        stored.add((index.fqn, None if offset is None else tuple(offset)))
        relative = info.__dict__.get("relative_path")
        if not isinstance(relative, str) or not _PLAIN_NAME.fullmatch(relative) or relative in (".", ".."):
            raise bad(f"entry {index.fqn!r} names the data file {relative!r}, which is not a plain file name of the directory")
        if any(not isinstance(info.__dict__.get(k), int) or info.__dict__[k] < 0 for k in ("offset", "length")):
            raise bad(f"entry {index.fqn!r} has a bad byte range")
        transforms = info.__dict__.get("transform_descriptors")
        if transforms is not None and not (isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)):
            raise bad(f"entry {index.fqn!r} has bad transform descriptors")
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"an entry named {fqn!r}")
        if type(meta) is TensorStorageMetadata:
            _check_tensor_meta(fqn, meta, stored, bad)
        elif type(meta) is not BytesStorageMetadata:
            raise bad(f"entry {fqn!r} is a {type(meta).__name__}")
        elif (fqn, None) not in stored:
            raise bad(f"entry {fqn!r} has no storage_data entry: no data file holds its value{_INCOMPLETE}")
    planner_data = metadata.__dict__.get("planner_data")
    if planner_data is not None and not (
        isinstance(planner_data, dict)
        and all(isinstance(p, (tuple, list)) and p and all(isinstance(x, (str, int)) for x in p) for p in planner_data.values())
    ):
        raise bad("planner_data is not a table of key paths")
    if metadata.__dict__.get("storage_meta") is not None and type(metadata.storage_meta) is not StorageMeta:
        raise bad("storage_meta is not a StorageMeta")
    return metadata


def _check_tensor_meta(fqn: str, meta: TensorStorageMetadata, stored: set[tuple[str, tuple[int, ...] | None]], bad: Callable[[str], ImportRefused]) -> None:
    properties = meta.__dict__.get("properties")
    size = _dims(meta.__dict__.get("size"))
    chunks = meta.__dict__.get("chunks")
    if type(properties) is not TensorProperties or not isinstance(properties.__dict__.get("dtype"), torch.dtype):
        raise bad(f"tensor {fqn!r} has no dtype")
    if size is None or not isinstance(chunks, list):
        raise bad(f"tensor {fqn!r} has a bad size or chunk list")
    boxes = []
    for chunk in chunks:
        offsets = _dims(chunk.__dict__.get("offsets")) if type(chunk) is ChunkStorageMetadata else None
        lengths = _dims(chunk.__dict__.get("sizes")) if type(chunk) is ChunkStorageMetadata else None
        if offsets is None or lengths is None or len(offsets) != len(lengths):
            raise bad(f"tensor {fqn!r} has a bad chunk {chunk!r}")
        boxes.append(Box(offsets, lengths))
        if (fqn, offsets) not in stored:
            raise bad(f"chunk {boxes[-1]} of tensor {fqn!r} has no storage_data entry: no data file holds it{_INCOMPLETE}")
    problems = coverage_problems(size, boxes)  # else parts of the tensor would be memory never written
    if problems:
        raise bad(f"the chunks of tensor {fqn!r} do not tile its size {list(size)}: {problems[0]}")


def _dims(value: Any) -> tuple[int, ...] | None:
    """`value` as dimensions (non-negative ints), or None when it is not that."""
    if isinstance(value, (torch.Size, tuple, list)) and all(type(d) is int and d >= 0 for d in value):
        return tuple(value)
    return None


def _paths(metadata: Metadata) -> dict[str, tuple[Any, ...]]:
    """Each entry's key path in the state dcp.save was given: planner_data when the save
    recorded it (a flattened state: the default), else the dotted name read as DCP flattens
    ("model.<fqn>", "optimizer.state.<fqn>.<field>", "optimizer.param_groups.<i>.<key>",
    "<key>.<rest>")."""
    recorded = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    out: dict[str, tuple[Any, ...]] = {}
    for fqn in metadata.state_dict_metadata:
        path = recorded.get(fqn)
        out[fqn] = tuple(path) if path else _dotted_path(fqn)
    return out


def _dotted_path(fqn: str) -> tuple[Any, ...]:
    top, _, rest = fqn.partition(".")
    if not rest:
        return (fqn,)
    if top == "optimizer":
        part, _, tail = rest.partition(".")
        if part == "state" and "." in tail:
            param, _, field = tail.rpartition(".")
            return (top, part, param, field)
        index, _, key = tail.partition(".")
        number = decimal(index)
        if part == "param_groups" and number is not None and key:
            return (top, part, number, key)
    return (top, rest)


def _nest(values: dict[tuple[Any, ...], Any]) -> Any:
    """Nested dicts from key paths; a dict keyed 0..n-1 becomes a list (DCP flattens lists so)."""
    root: dict[Any, Any] = {}
    for path, value in values.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ImportRefused(f"DCP entry {'.'.join(map(str, path))} lies under a value, not a dict: the metadata's key paths disagree")
        if path[-1] in node:
            raise ImportRefused(f"DCP entry {'.'.join(map(str, path))} appears twice in the metadata's key paths")
        node[path[-1]] = value
    return _as_lists(root)


def _as_lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _as_lists(v) for k, v in node.items()}
    if items and all(type(k) is int for k in items) and sorted(items) == list(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items


class _CheckedReader(FileSystemReader):
    """torch's FileSystemReader with metadata read by read_metadata (above), not by an unrestricted unpickler."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """The default load plan over the flat state given to dcp.load, but "bytes" entries are
    loaded with torch.load(weights_only=True) (the default planner unpickles them without
    restriction); what that refuses becomes a _Refused value, its reason in `refused`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.refused: dict[str, str] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - refused or damaged: either way not imported, and reported
            self.refused[fqn] = f"torch.load(weights_only=True) refuses it: {weights_only_refusal(exc)}"
            self.state_dict[fqn] = _Refused()
