"""`ckptd import`: a torch.save file, a Hugging Face model directory or a
torch.distributed.checkpoint (DCP) directory into a committed ckptd step, without a running
daemon (docs/integrations/import.md).

    from ckptd.daemon.importer.importing import import_checkpoint
    report = import_checkpoint("model.pt", root="/var/lib/ckptd", job="run-42", step=1000)

The sources (`source_format`, "auto" detects it):
- "torch": a torch.save file (.pt/.bin), read with torch.load(weights_only=True, mmap=True):
  the tensors stay views of the file (a legacy, non-zip file is read into memory). What
  weights_only refuses (objects of other classes) is refused, never unpickled. A dict of
  tensors is the model weights; so is the entry "model", "state_dict" or "module" of a bigger
  dict, whose other entries map as importer/state.py says.
- "hf": a Hugging Face model directory: model.safetensors(.index.json) (mapped, no copy), else
  pytorch_model.bin(.index.json) (as "torch"); config.json and generation_config.json are
  carried into the step, so `from_pretrained(step_dir)` works as for a native step.
- "safetensors": one .safetensors file: its tensors are the model weights.
- "dcp": a DCP directory written by dcp.save with a FileSystemWriter, any number of ranks,
  DTensor shards included (importer/dcp.py: read without unpickling untrusted data).

Only regular files are read, each checked first (importer/source.py): a link out of a source
directory (but a Hugging Face cache's into its blobs/), a FIFO or a device is refused, never read.

The step is written by the daemon's own writer (importer/direct_write.py): the same files, index and
`latest` as a save by one rank; it becomes the job's newest step. A step that exists is never
overwritten, and a failure leaves no visible step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch._weights_only_unpickler import UnpicklingError  # type: ignore[attr-defined]  # pickle's, re-exported

from ckptd.common import dtypes, json_read
from ckptd.daemon import errors
from ckptd.format.index import MODEL_FILES, FormatError
from ckptd.format.safetensors_header import MAX_HEADER_BYTES, parse_safetensors_header
from ckptd.daemon.importer.direct_write import DirectTensor, ImportRefused, check_target, write_step
from ckptd.daemon.importer.refusals import refused_global, short_reason, weights_only_refusal
from ckptd.daemon.importer.source import check_source, has_entry, open_source, read_source, source_file
from ckptd.daemon.importer.state import Mapped, add_model, map_state
from ckptd.daemon.rpc.validate import MAX_MODEL_FILE_BYTES, check_model_files

__all__ = ["FORMATS", "ImportRefused", "ImportReport", "detect_format", "import_checkpoint"]

log = logging.getLogger(__name__)

# Source formats, by the name --format takes, and how a report names them.
FORMATS = {"torch": "torch.save file", "hf": "Hugging Face model directory", "safetensors": "safetensors file", "dcp": "torch.distributed.checkpoint directory"}
HF_SAFETENSORS, HF_SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
HF_BIN, HF_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
MAX_INDEX_BYTES = 64 * 2**20  # a Hugging Face weight-map file; real ones are well under 1 MiB
# What marks a DCP directory: import_dcp.METADATA_NAME, named here because import_dcp imports
# torch.distributed.checkpoint (seconds), which only a DCP import needs (tests check they agree).
DCP_METADATA_NAME = ".metadata"


@dataclass(frozen=True)
class ImportReport:
    """What an import wrote: the step (`step_dir`), its tensors (count per kind, and `nbytes`
    of tensor data), the extras' top-level keys, the model files, how names were mapped
    (`notes`) and what was not imported, each with the reason (`skipped`)."""

    source: Path
    source_format: str
    job: str
    step: int
    step_dir: Path
    tensors: dict[str, int]
    nbytes: int
    extras: tuple[str, ...]
    model_files: tuple[str, ...]
    notes: tuple[str, ...]
    skipped: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able values (`ckptd import --json`; stable keys)."""
        return {
            "source": str(self.source), "format": self.source_format, "job": self.job, "step": self.step,
            "step_dir": str(self.step_dir), "tensors": self.tensors, "bytes": self.nbytes, "extras": list(self.extras),
            "model_files": list(self.model_files), "notes": list(self.notes), "skipped": list(self.skipped),
        }

    def describe(self) -> str:
        """The report for a person, one fact per line."""
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(self.tensors.items()))
        lines = [
            f"imported {self.source} ({FORMATS[self.source_format]}) as step {self.step} of job {self.job!r}",
            f"  step directory: {self.step_dir}",
            f"  tensors: {counts} ({self.nbytes / 2**20:.1f} MiB)",
        ]
        if self.extras:
            lines.append(f"  extras: {', '.join(self.extras)}")
        if self.model_files:
            lines.append(f"  model files: {', '.join(self.model_files)}")
        lines += [f"  note: {note}" for note in self.notes]
        if self.skipped:
            lines.append("  not imported:")
            lines += [f"    - {what}" for what in self.skipped]
        return "\n".join(lines)


def import_checkpoint(
    source: str | os.PathLike[str],
    root: str | os.PathLike[str],
    job: str,
    step: int,
    *,
    source_format: str = "auto",
    max_file_bytes: int | None = None,
    write_threads: int | None = None,
) -> ImportReport:
    """Import `source` as committed step `step` of `job` under storage root `root` (see the
    module docstring); returns what was written and what was not (also logged as warnings).

    max_file_bytes / write_threads: as `ckptd serve`'s (None: its defaults). Raises
    ImportRefused, with what was wrong and how to fix it, for a source that is not understood or
    not safe to read, a root that is not a ckptd root (nor new or empty), a step that exists, a
    bad job id; errors.NoSpace, before anything is written, when the step would not fit;
    OSError from writing (I/O errors, a full disk), the step then removed again.
    """
    source, root = Path(source), Path(root)
    path = check_source(source)
    fmt = detect_format(path) if source_format == "auto" else source_format
    if fmt not in FORMATS:
        raise ImportRefused(f"unknown source format {source_format!r}; use one of auto, {', '.join(FORMATS)}")
    if (fmt in ("hf", "dcp")) != path.is_dir():
        raise ImportRefused(f"--format {fmt} reads a {FORMATS[fmt]}, and {source} is {'a directory' if path.is_dir() else 'a file'}")
    check_target(root, job, step)  # before reading the source: a DCP read allocates the whole state
    with contextlib.ExitStack() as resources:
        mapped = _READERS[fmt](path, resources)
        _, step_dir = write_step(
            root, job, step, mapped.tensors, mapped.extras, mapped.model_files, max_file_bytes=max_file_bytes, write_threads=write_threads,
        )
        tensors: dict[str, int] = {}
        for t in mapped.tensors:
            tensors[t.kind] = tensors.get(t.kind, 0) + 1
        nbytes = sum(len(t.data) for t in mapped.tensors)
        mapped.tensors.clear()  # the views go before the mapped files are closed
    for what in mapped.skipped:
        log.warning("not imported from %s: %s", source, what)
    return ImportReport(
        source, fmt, job, step, step_dir, tensors, nbytes, tuple(mapped.extras), tuple(mapped.model_files),
        tuple(mapped.notes), tuple(mapped.skipped),
    )


def detect_format(source: Path) -> str:
    """The format of `source` (a key of FORMATS): a file is a torch.save file unless it ends in
    .safetensors; a directory with `.metadata` is DCP, one with HF weight files is "hf" (an
    entry of any kind counts: reading it says what is wrong with it)."""
    if source.is_file():
        return "safetensors" if source.suffix == ".safetensors" else "torch"
    if source.is_dir():
        if has_entry(source, DCP_METADATA_NAME):
            return "dcp"
        if any(has_entry(source, name) for name in (HF_SAFETENSORS_INDEX, HF_SAFETENSORS, HF_BIN_INDEX, HF_BIN)):
            return "hf"
        raise ImportRefused(
            f"{source} is neither a Hugging Face model directory ({HF_SAFETENSORS}, {HF_SAFETENSORS_INDEX}, {HF_BIN} "
            f"or {HF_BIN_INDEX}) nor a torch.distributed.checkpoint directory ({DCP_METADATA_NAME}); pass --format if it is one"
        )
    raise ImportRefused(f"{source} is neither a file nor a directory")


# ------------------------------------------------------------------ torch.save files


def load_torch_file(path: Path) -> tuple[Any, list[str]]:
    """The object in a torch.save file, read with torch.load(weights_only=True), its tensors
    mapped from the file (mmap) when it is in the zip format; and notes. ImportRefused, with the
    fix, when weights_only refuses it (a custom class) or it is not a torch.save file."""
    if path.stat().st_size == 0:
        raise ImportRefused(f"{path} is empty: not a torch.save file")
    zipped = zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except UnpicklingError as exc:
        raise ImportRefused(_weights_only_refusal(path, exc)) from None
    except Exception as exc:  # noqa: BLE001 - a damaged file makes the unpickler fail in any way (IndexError, KeyError ...)
        raise ImportRefused(f"{path} is not a torch.save file ckptd can read ({type(exc).__name__}: {short_reason(exc)})") from None
    notes = [] if zipped else [f"{path.name} is in the legacy torch.save format: read into memory (only the zip format can be mapped)"]
    return state, notes


def _weights_only_refusal(path: Path, exc: BaseException) -> str:
    if refused_global(exc) is None:
        return f"{path} is not a torch.save file that ckptd can read safely: {short_reason(exc)}"
    return (
        f"{path} cannot be imported: {weights_only_refusal(exc)}. Where you trust the file, load it, save only its "
        "tensors and plain values with torch.save: model.state_dict(), or {'model': model.state_dict(), 'step': step}, "
        "and import that file"
    )


def _read_torch(path: Path, resources: contextlib.ExitStack) -> Mapped:
    state, notes = load_torch_file(path)
    mapped = map_state(state, str(path))
    mapped.notes[:0] = notes
    return mapped


# ------------------------------------------------------------------ safetensors and Hugging Face


class _MappedFile:
    """A source file mapped read-only; the slices handed out are released before it is unmapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(open_source(path), "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            if self.size < 8:
                raise ImportRefused(f"{path} is {self.size} bytes: not a safetensors file")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._base = memoryview(self._map)
        self._slices: list[memoryview] = []

    def tensors(self) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
        """{key: (dtype, shape, bytes)} of the file's tensors, views of the mapping."""
        (length,) = struct.unpack("<Q", self._map[:8])
        try:
            data_start, entries = parse_safetensors_header(self._map[: 8 + min(length, MAX_HEADER_BYTES)], self.size)
        except (FormatError, dtypes.UnknownDtypeError) as exc:
            raise ImportRefused(f"{self.path} is not a safetensors file ckptd can import: {exc}") from None
        out = {}
        for key, entry in entries.items():
            view = self._base[data_start + entry.begin : data_start + entry.end]
            self._slices.append(view)
            out[key] = (entry.dtype, entry.shape, view)
        return out

    def close(self) -> None:
        """Release the slices and unmap the file; a mapping that a view still holds (a traceback
        of a failed write keeps the writer's views) is unmapped when that view is collected."""
        for view in self._slices:
            view.release()
        self._base.release()
        try:
            self._map.close()
        except BufferError:
            log.debug("%s stays mapped until the last view of it is collected", self.path)


def _safetensors_weights(path: Path, resources: contextlib.ExitStack, out: Mapped, names: set[str]) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
    """Add the tensors of a safetensors file to `out` as model weights "model/<key>"; returns
    them by key. ImportRefused for a key already taken (`names`: keys added before)."""
    mapped = _MappedFile(path)
    resources.callback(mapped.close)
    tensors = mapped.tensors()
    for key, (dtype, shape, data) in tensors.items():
        if key in names:
            raise ImportRefused(f"tensor {key!r} is in more than one weight file (again in {path.name}); which one to import is not clear")
        names.add(key)
        out.tensors.append(DirectTensor("model/" + key, "model", dtype, shape, data))
    return tensors


def _read_safetensors(path: Path, resources: contextlib.ExitStack) -> Mapped:
    out = Mapped()
    _safetensors_weights(path, resources, out, set())
    return out


def _read_hf(directory: Path, resources: contextlib.ExitStack) -> Mapped:
    """The weights of a Hugging Face model directory (safetensors first, as from_pretrained
    prefers them) and its config.json / generation_config.json."""
    out = Mapped()
    if has_entry(directory, HF_SAFETENSORS_INDEX) or has_entry(directory, HF_SAFETENSORS):
        index = HF_SAFETENSORS_INDEX if has_entry(directory, HF_SAFETENSORS_INDEX) else None
        files = _weight_files(directory, index) if index else {HF_SAFETENSORS: None}
        names: set[str] = set()
        for name, keys in files.items():
            found = _safetensors_weights(source_file(directory, name), resources, out, names)
            _check_weight_map(directory / name, keys, found)
    else:
        index = HF_BIN_INDEX if has_entry(directory, HF_BIN_INDEX) else None
        files = _weight_files(directory, index) if index else {HF_BIN: None}
        seen: dict[str, str] = {}
        for name, keys in files.items():
            state, notes = load_torch_file(source_file(directory, name))
            if not isinstance(state, dict):
                raise ImportRefused(f"{directory / name} holds a {type(state).__name__}, not a state_dict")
            _check_weight_map(directory / name, keys, state)
            for key in state:
                if key in seen:
                    raise ImportRefused(f"tensor {key!r} is in both {seen[key]} and {name}; which one to import is not clear")
                seen[key] = name
            out.notes += notes
            add_model(state, out)
    if index:
        out.notes.append(f"weights from the {len(files)} files {index} names")
    out.model_files = _model_files(directory, out)
    return out


def _weight_files(directory: Path, index_name: str) -> dict[str, set[str]]:
    """{weight file: the keys the index maps to it} from a Hugging Face index; ImportRefused
    for an index that is malformed or names a file that is not a plain name of the directory."""
    path = directory / index_name
    try:
        doc = json_read.loads(read_source(source_file(directory, index_name), MAX_INDEX_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ImportRefused(f"{path} is not JSON: {exc}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ImportRefused(f"{path} has no weight_map of tensor names to file names")
    files: dict[str, set[str]] = {}
    for key, name in weight_map.items():
        if "/" in name or "\\" in name or name.startswith(".") or not has_entry(directory, name):
            raise ImportRefused(f"{path} maps {key!r} to {name!r}, which is not a file of {directory}")
        files.setdefault(name, set()).add(key)
    return dict(sorted(files.items()))


def _check_weight_map(path: Path, keys: set[str] | None, found: dict[Any, Any]) -> None:
    missing = sorted(keys - set(found)) if keys is not None else []
    if missing:
        raise ImportRefused(f"the index puts {len(missing)} tensors in {path} that it does not hold (e.g. {missing[0]!r}): the model directory is incomplete")


def _model_files(directory: Path, out: Mapped) -> dict[str, bytes]:
    """config.json and generation_config.json, checked as a save's model files are; notes on
    what a from_pretrained of the step will lack."""
    texts = {}
    for name in MODEL_FILES:
        if has_entry(directory, name):
            try:
                texts[name] = read_source(source_file(directory, name), MAX_MODEL_FILE_BYTES).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ImportRefused(f"{directory / name} is not UTF-8 text: {exc}") from None
    if "config.json" not in texts:
        out.notes.append("no config.json: the step's model files load with safetensors, but from_pretrained needs a config")
    others = sorted(p.name for p in directory.iterdir() if p.is_file() and p.suffix not in (".safetensors", ".bin") and p.name not in (*MODEL_FILES, HF_SAFETENSORS_INDEX, HF_BIN_INDEX))
    if others:
        out.notes.append(f"other files of the model directory are not part of a ckptd step (tokenizer, README ...): {', '.join(others[:8])}")
    try:
        return check_model_files(texts)
    except errors.InvalidRequest as exc:
        raise ImportRefused(f"{directory}: {exc}") from None


# ------------------------------------------------------------------ DCP


def _read_dcp(directory: Path, resources: contextlib.ExitStack) -> Mapped:
    from ckptd.daemon.importer.dcp import read_dcp

    state, skipped = read_dcp(directory)
    mapped = map_state(state, str(directory))
    mapped.notes.insert(0, "tensors read whole from the ranks' shards into memory (a DCP directory holds torch.save archives, not raw bytes)")
    mapped.skipped[:0] = skipped
    return mapped


_READERS: dict[str, Callable[[Path, contextlib.ExitStack], Mapped]] = {
    "torch": _read_torch, "hf": _read_hf, "safetensors": _read_safetensors, "dcp": _read_dcp,
}
