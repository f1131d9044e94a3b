"""The on-disk format (docs/architecture.md §7), as pure functions: no file system access here.

- safetensors files: ckptd.format.safetensors_header.
- `ckptd.index.json`: the full index, written last; its presence makes a step committed.
- `<group>.safetensors.index.json`: the Hugging Face index (metadata.total_size + weight_map).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import xxhash

from ckptd.common import chunks, dtypes, json_read
from ckptd.common.boxes import Box
from ckptd.common.frames import Frames
from ckptd.common.names import MAX_STEP, decimal
from ckptd.common.quant_options import CAST
from ckptd.format.index_checks import tensor_problem
from ckptd.format.json_text import compact_json, extra_json_text, json_str, tensor_json

INDEX_NAME = "ckptd.index.json"
# A node's part of a step across nodes is written and fsynced (node-local roots): kept at
# start-up until the coordinator says whether the step was committed.
PREPARED_NAME = "ckptd.prepared.json"
EXTRA_JSON = "extra.json"
# The environment record of a step: who wrote it (versions of Python, torch, ckptd), the layout
# (world size, nodes, meshes) and the user's run config (step_build.environment_json).
ENVIRONMENT_JSON = "environment.json"
# A model's own files a step may hold, from rank 0 (adapter_config.json: a PEFT adapter's;
# environment.json: the trainer's half of the environment record, completed by the daemon).
MODEL_FILES = ("config.json", "generation_config.json", "adapter_config.json", ENVIRONMENT_JSON)
# With adapter_config.json, a copy of the step's single model data file under the name PEFT's
# from_pretrained reads, so the step directory loads as an adapter as it is (step_build.adapter_source).
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LATEST = "latest"
INDEX_FORMAT = "ckptd/1"
# Written instead of INDEX_FORMAT when a step is compressed (quantized fragments, dropped or
# residual master weights, a quantization generation): a reader that does not know how to
# decode them must refuse the step rather than hand out codes as values. Both are read.
INDEX_FORMAT_QUANT = "ckptd/2"
READABLE_FORMATS = (INDEX_FORMAT, INDEX_FORMAT_QUANT)
EXTRA_FORMAT = "ckptd-extra/1"

# kind -> file name stem. Model files are what Hugging Face and safetensors users read.
GROUP_OF_KIND = {"model": "model", "master": "master_weights", "optimizer": "optimizer", "extra": "extra"}


class FormatError(ValueError):
    """A file or index that does not follow the format; the message names the file and the problem."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a directory named exactly as step_dir_name() names it, else None: a name is
    never trusted for less ('step-000000003', a copy under a padded name, would list step 3
    twice; 'step-²²²²²²²²' is no number)."""
    if not name.startswith("step-"):
        return None
    step = decimal(name[5:])
    return step if step is not None and step <= MAX_STEP and step_dir_name(step) == name else None


# ------------------------------------------------------------------ index


@dataclass(frozen=True, slots=True)
class SideRecord:
    """Bytes that decoding a fragment needs besides its own codes: its scale tensor, or (a master
    weight stored as a residual) the model weight it is a residual to."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]  # stored shape
    offset: int  # absolute byte offset in the file
    nbytes: int
    checksum: str
    chunk_bytes: int = 0  # chunk checksums as in FragmentRecord; 0 and "": not recorded
    chunk_xxh3: str = ""

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "file": self.file, "key": self.key, "dtype": self.dtype, "shape": list(self.shape),
            "offset": self.offset, "nbytes": self.nbytes, "checksum": self.checksum,
        }
        if self.chunk_bytes:
            doc["chunks"] = {"bytes": self.chunk_bytes, "xxh3": self.chunk_xxh3}
        return doc

    @staticmethod
    def from_json(d: dict[str, Any]) -> "SideRecord":
        chunks = d.get("chunks", {})
        return SideRecord(
            str(d["file"]), str(d["key"]), str(d["dtype"]), tuple(int(x) for x in d["shape"]),
            int(d["offset"]), int(d["nbytes"]), str(d["checksum"]), int(chunks.get("bytes", 0)), str(chunks.get("xxh3", "")),
        )


@dataclass(frozen=True, slots=True)
class QuantRecord:
    """How a fragment's stored bytes become its values (ckptd.common.quant).

    codec: "lin-i8" | "lin-i4" | "log-u8" | "log-u4" (blockwise codes, `block` elements per block
    along the last dim in logical coordinates, scales in `scales`; with `frames` the stored bytes
    are the codes' rows in zstd frames, ckptd.common.frames); "residual-bf16" (a master
    weight: float(base) + float(stored), `base` = the model weight); "cast" (a dropped master
    weight: the fragment is the model weight's bytes, upcast on load).
    """

    codec: str
    block: int = 0
    scales: SideRecord | None = None
    base: SideRecord | None = None
    frames: Frames | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"codec": self.codec}
        if self.block:
            doc["block"] = self.block
        if self.scales is not None:
            doc["scales"] = self.scales.to_json()
        if self.base is not None:
            doc["base"] = self.base.to_json()
        if self.frames is not None:
            doc["frames"] = self.frames.to_json()
        return doc

    @staticmethod
    def from_json(d: dict[str, Any]) -> "QuantRecord":
        return QuantRecord(
            codec=str(d["codec"]),
            block=int(d.get("block", 0)),
            scales=SideRecord.from_json(d["scales"]) if "scales" in d else None,
            base=SideRecord.from_json(d["base"]) if "base" in d else None,
            frames=Frames.from_json(d["frames"]) if "frames" in d else None,
        )


@dataclass(frozen=True, slots=True)
class FragmentRecord:
    """Where one fragment of a logical tensor is stored."""

    file: str  # file name inside the step directory
    key: str  # safetensors key
    box: Box
    dtype: str  # stored dtype (equals the tensor's unless quantized)
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    checksum: str  # "xxh3-64:<hex>" of the fragment's bytes
    # xxh3-64 of each chunk of chunk_bytes (ckptd.common.chunks), 16 hex characters each,
    # concatenated; verifies reads of part of the fragment. 0 and "": not recorded.
    chunk_bytes: int = 0
    chunk_xxh3: str = ""
    quant: QuantRecord | None = None  # None: the stored bytes are the values

    def stored_pieces(self) -> tuple["FragmentRecord | SideRecord", ...]:
        """The byte ranges this fragment adds to its step: itself and its scales. None for a
        dropped master weight ("cast"): its bytes are the model weight's, stored as that tensor."""
        if self.quant is None:
            return (self,)
        if self.quant.codec == CAST:
            return ()
        return (self,) if self.quant.scales is None else (self, self.quant.scales)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "file": self.file,
            "key": self.key,
            "offsets": list(self.box.offsets),
            "lengths": list(self.box.lengths),
            "dtype": self.dtype,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        }
        if self.chunk_bytes:
            doc["chunks"] = {"bytes": self.chunk_bytes, "xxh3": self.chunk_xxh3}
        if self.quant is not None:
            doc["quant"] = self.quant.to_json()
        return doc

    @staticmethod
    def from_json(d: dict[str, Any]) -> "FragmentRecord":
        return FragmentRecord(  # positional, map(int, ...): an index has thousands of fragments
            str(d["file"]),
            str(d["key"]),
            Box(tuple(map(int, d["offsets"])), tuple(map(int, d["lengths"]))),
            str(d["dtype"]),
            int(d["offset"]),
            int(d["nbytes"]),
            str(d["checksum"]),
            int(d["chunks"]["bytes"]) if "chunks" in d else 0,
            str(d["chunks"]["xxh3"]) if "chunks" in d else "",
            QuantRecord.from_json(d["quant"]) if "quant" in d else None,
        )


@dataclass(frozen=True, slots=True)
class TensorRecord:
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    fragments: tuple[FragmentRecord, ...]
    aliases: tuple[str, ...] = ()
    # A rank's own extras tensor (its name carries the rank: ckptd.common.names.per_rank_name):
    # that rank. None: one tensor for every rank (and every such tensor of a step saved before
    # issue 30, when extras tensors were not per rank).
    rank: int | None = None

    @property
    def lossy(self) -> bool:
        """Some fragment is stored coded (quantized, cast or a residual), not as its values."""
        return any(f.quant is not None for f in self.fragments)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "aliases": list(self.aliases),
            "fragments": [f.to_json() for f in self.fragments],
        }
        if self.rank is not None:
            doc["rank"] = self.rank
        return doc

    @staticmethod
    def from_json(name: str, d: dict[str, Any]) -> "TensorRecord":
        rank = d.get("rank")
        return TensorRecord(
            name=name,
            kind=str(d["kind"]),
            dtype=str(d["dtype"]),
            shape=tuple(map(int, d["shape"])),
            fragments=tuple(map(FragmentRecord.from_json, d["fragments"])),
            aliases=tuple(map(str, d.get("aliases", ()))),
            rank=None if rank is None else int(rank),
        )


@dataclass(frozen=True, slots=True)
class FileRecord:
    name: str
    size: int
    # "xxh3-64:<hex>" of a safetensors file's header (its data is covered by the fragments'
    # checksums), or of the whole file for the small JSON files
    checksum: str
    node: int = 0  # the node that wrote it (node-local roots: where to fetch it from)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "checksum": self.checksum, "node": self.node}


@dataclass(frozen=True)
class CheckpointIndex:
    """The content of ckptd.index.json (schema INDEX_FORMAT)."""

    job: str
    step: int
    created_at: float  # unix seconds
    world_size: int
    tensors: tuple[TensorRecord, ...]
    files: tuple[FileRecord, ...]
    metric: float | None = None
    writer: dict[str, Any] = field(default_factory=dict)
    # Compression of the step (None: lossless and no lossy ancestor):
    # {"generation": lossy quantize/restore cycles in the values' history (the compounding guard),
    #  "quantize": "O1" | "O2" | None, "master_weights": "keep" | "drop" | "residual"}
    quantization: dict[str, Any] | None = None
    retention: dict[str, Any] | None = None  # the job's own policy (retention.policy_record): every node prunes by the newest step's

    @property
    def compressed(self) -> bool:
        return self.quantization is not None or any(f.quant is not None for t in self.tensors for f in t.fragments)

    @property
    def generation(self) -> int:
        """How many lossy save/restore cycles the values of this step went through."""
        return int((self.quantization or {}).get("generation", 0))

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def of_step(cls, data: bytes, job: str | None, step: int, where: str) -> "CheckpointIndex":
        """An index's bytes (from a peer, a bucket, a step directory) -> the index; FormatError
        naming `where` unless it is valid and is the index of step `step` of `job`. job None:
        any job's (a root's own step directory: a job directory copied or renamed to fork a run
        stays loadable; a step directory copied under another step's name does not)."""
        index = cls.from_json_bytes(data, where=where)
        if index.step != step or (job is not None and index.job != job):
            raise FormatError(
                f"{where} is the index of job {index.job!r} step {index.step}, not of {'' if job is None else f'job {job!r} '}step {step}"
                " (a step directory copied or renamed by hand?)"
            )
        return index

    def by_name(self) -> dict[str, TensorRecord]:
        """Tensors by logical name and by every alias (built once per index; do not modify)."""
        return self._by_name

    def file(self, name: str) -> FileRecord | None:
        """The record of the step's file `name`, or None (by a table made once: 10,000+ files at 10,000 nodes)."""
        return self._files_by_name.get(name)

    _files_by_name = functools.cached_property(lambda self: {f.name: f for f in self.files})  # not a field: no annotation

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorRecord]:
        table = {}
        for t in self.tensors:
            table[t.name] = t
            for alias in t.aliases:
                table[alias] = t
        return table

    def to_json_bytes(self, tensors_json: str | None = None) -> bytes:
        """The index as compact JSON, one line: {format, job, step, created_at, world_size,
        metric, writer, files, tensors[, quantization][, retention]}. Compact, by json's C encoder (an indent takes its pure-Python one), and the tensors
        as text made one at a time (json_text.tensor_json) instead of as one document of
        dicts: for 1,000 tensors the indented document took 54 ms and a 4.7 MiB peak of objects
        (issue 30 finding 5); tensors_json: that text, when the caller has it (plan/index_layout.py).
        The index is read by programs; `ckptd inspect` shows it to people."""
        encode = json.JSONEncoder(separators=(",", ":")).encode
        head = {
            "format": INDEX_FORMAT_QUANT if self.compressed else INDEX_FORMAT,
            "job": self.job,
            "step": self.step,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "metric": self.metric,
            "writer": self.writer,
            "files": {f.name: f.to_json() for f in self.files},
        }
        tensors = ",".join(f"{json_str(t.name)}:{tensor_json(t)}" for t in self.tensors) if tensors_json is None else tensors_json
        tail = f',"quantization":{encode(self.quantization)}' if self.quantization is not None else ""
        tail += f',"retention":{encode(self.retention)}' if self.retention is not None else ""
        return f'{encode(head)[:-1]},"tensors":{{{tensors}}}{tail}}}\n'.encode()

    @staticmethod
    def created_at_of(head: bytes) -> float | None:
        """The commit time from the first INDEX_HEAD_BYTES of an index written by to_json_bytes
        (it comes first, after format, job and step); None when the head is not in that form
        (an index written indented by an older daemon: parse the whole file then). Reading the
        commit order of a job's steps then costs no parse of each index (issue 30 finding 5)."""
        match = _CREATED_AT.match(head)
        return float(match.group(1)) if match else None

    @staticmethod
    def from_json_bytes(data: bytes, where: str = INDEX_NAME) -> "CheckpointIndex":
        try:
            doc = json_read.loads(data)
            if doc.get("format") not in READABLE_FORMATS:
                raise FormatError(f"{where}: format {doc.get('format')!r}, this ckptd reads {' and '.join(map(repr, READABLE_FORMATS))}")
            for key in ("quantization", "retention"):
                if doc.get(key) is not None and not isinstance(doc[key], dict):
                    raise FormatError(f"{where}: {key!r} must be an object, got {doc[key]!r}")
            index = CheckpointIndex(
                job=str(doc["job"]),
                step=int(doc["step"]),
                created_at=float(doc["created_at"]),
                world_size=int(doc["world_size"]),
                metric=None if doc.get("metric") is None else float(doc["metric"]),
                writer=dict(doc.get("writer", {})),
                files=tuple(
                    FileRecord(n, int(f["size"]), str(f["checksum"]), int(f.get("node", 0))) for n, f in doc["files"].items()
                ),
                tensors=tuple(TensorRecord.from_json(n, t) for n, t in doc["tensors"].items()),
                quantization=doc.get("quantization"),
                retention=doc.get("retention"),
            )
            _check_file_names(index, where)
            for tensor in index.tensors:
                if (problem := tensor_problem(tensor)) is not None:
                    raise FormatError(f"{where}: tensor {tensor.name[:200]!r} cannot be read as recorded: {problem} (a damaged or altered index)")
            return index
        except FormatError:
            raise
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(f"{where} is malformed: {type(exc).__name__}: {exc}") from None


def _check_file_names(index: CheckpointIndex, where: str) -> None:
    """Every file an index lists is a plain name in its step directory, and every file its
    fragments are stored in is one it lists: an index names nothing elsewhere (a name with '/'
    or '..' would lead a reader out of the step, or out of the root)."""
    names = {f.name for f in index.files}
    for name in names:
        if not is_plain_file_name(name):
            raise FormatError(f"{where} lists a file {name[:80]!r}, which is not a plain file name of a step directory")
    for tensor in index.tensors:
        for fragment in tensor.fragments:
            sides = (fragment.quant.scales, fragment.quant.base) if fragment.quant is not None else ()
            for file in [fragment.file, *(side.file for side in sides if side is not None)]:
                if file not in names:
                    raise FormatError(f"{where}: tensor {tensor.name!r} is stored in {file[:80]!r}, a file the index does not list")


def is_plain_file_name(name: str) -> bool:
    """Whether `name` names a file in a step directory and nothing elsewhere: not empty, at most
    255 bytes, no '/', not '.' or '..', no control characters. Every reader of a step's files
    by name (the storage backends, the object-store keys, the offline root) checks it."""
    return bool(name) and len(name.encode()) <= 255 and "/" not in name and name not in (".", "..") and not _CONTROL_CHARS.search(name)


_CONTROL_CHARS = re.compile("[\x00-\x1f]")


INDEX_HEAD_BYTES = 512
_CREATED_AT = re.compile(rb'\{"format":"ckptd/[0-9]+","job":"[A-Za-z0-9._-]*","step":-?[0-9]+,"created_at":(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?),')


def extra_json(step: int, ranks: dict[int, Any], texts: Mapping[int, str] | None = None) -> bytes:
    """extra.json: the step and every rank's JSON-able extras (scheduler, RNG, user values);
    `texts`: ranks' extras already as json_text.compact_json text, used instead of encoding them."""
    known = texts or {}
    return extra_json_text(EXTRA_FORMAT, step, {r: known.get(r) or compact_json(ranks[r]) for r in sorted(ranks)})


def small_file_checksum(data: bytes) -> str:
    """The checksum an index records for a whole small file (extra.json, config.json, ...)."""
    return chunks.checksum_name(xxhash.xxh3_64_intdigest(data))


def check_small_file(record: FileRecord, data: bytes) -> None:
    """Raise FormatError unless `data` is the small file the index recorded: its size and checksum."""
    if len(data) != record.size:
        raise FormatError(f"{record.name} has {len(data)} bytes, the index says {record.size} (changed or damaged after the save)")
    digest = small_file_checksum(data)
    if digest != record.checksum:
        raise FormatError(f"{record.name} does not match its checksum ({digest}, the index says {record.checksum}): changed or damaged after the save")


def parse_extra_json(data: bytes, record: FileRecord) -> dict[int, Any]:
    """Every rank's extras from extra.json, once its bytes match `record` (its entry in the
    step's index); raises FormatError naming the file otherwise, or when it is malformed."""
    check_small_file(record, data)
    try:
        doc = json_read.loads(data)
        return {int(r): tree for r, tree in doc["ranks"].items()}
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"{EXTRA_JSON} is malformed: {exc}") from None


# ------------------------------------------------------------------ file layout


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor as it goes into a file: under `key`, whole or as one fragment (`box`)."""

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]  # the stored shape (the box's lengths)
    box: Box
    node: int = 0  # the node that writes it
    role: str = "data"  # "data" (the fragment's bytes or codes) | "scales" (the scales of the data under key[:-len("@scales")])

    @property
    def nbytes(self) -> int:
        return dtypes.nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class FileLayout:
    name: str
    group: str
    tensors: tuple[StoredTensor, ...]
    node: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def file_key(name: str, kind: str) -> str:
    """The safetensors key of a logical tensor: model files use the state_dict name (HF-loadable)."""
    if kind == "model":
        return name.split("/", 1)[1] if "/" in name else name
    return name


SCALES_SUFFIX = "@scales"


def scales_key(key: str) -> str:
    """The safetensors key of the scale tensor of quantized data stored under `key`."""
    return key + SCALES_SUFFIX


def fragment_key(key: str, box: Box) -> str:
    """The safetensors key of a fragment stored apart from the rest of its tensor (a tensor
    sharded across nodes): the whole tensor's key and the fragment's offsets."""
    return f"{key}@{','.join(str(o) for o in box.offsets)}"


def layout_files(
    tensors: Sequence[StoredTensor], kinds: dict[str, str], max_file_bytes: int, frozen: Mapping[str, str] | None = None
) -> list[FileLayout]:
    """Group stored tensors into files by kind and node, and split groups at `max_file_bytes`.

    Files are named `<group>-0000k-of-0000n.safetensors`, numbered across nodes in node order
    (each file is written by one node), except extras, which go to `extra.safetensors` when
    they fit in one file. Order inside a group is the given order; a quantized tensor's scales
    stay in the file of its codes (they are written side by side).

    `frozen` (logical name -> "param" | "buffer"; others train) puts a node's frozen tensors
    after its trained ones, each class in files of its own: a file of frozen tensors that did
    not change is then the same file as at the previous save (plan/node_files.link_candidates).
    """
    frozen = frozen or {}
    order = {"": 0, "buffer": 1, "param": 2}
    by_group: dict[str, dict[int, list[StoredTensor]]] = {}
    for t in tensors:
        by_group.setdefault(GROUP_OF_KIND[kinds[t.name]], {}).setdefault(t.node, []).append(t)
    files = []
    for group in GROUP_OF_KIND.values():
        chunks: list[tuple[int, list[StoredTensor]]] = []
        for node, members in sorted(by_group.get(group, {}).items()):
            if frozen:
                members = sorted(members, key=lambda t: order[frozen.get(t.name, "")])  # stable: given order within a class
            chunks.append((node, []))
            size = 0
            for t in members:
                new_class = bool(chunks[-1][1]) and frozen.get(chunks[-1][1][-1].name, "") != frozen.get(t.name, "")
                if chunks[-1][1] and (new_class or size + t.nbytes > max_file_bytes) and t.role != "scales":
                    chunks.append((node, []))
                    size = 0
                chunks[-1][1].append(t)
                size += t.nbytes
        n = len(chunks)
        for k, (node, chunk) in enumerate(chunks, start=1):
            name = "extra.safetensors" if group == "extra" and n == 1 else f"{group}-{k:05d}-of-{n:05d}.safetensors"
            files.append(FileLayout(name, group, tuple(chunk), node))
    return files
