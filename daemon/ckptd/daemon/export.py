"""`ckptd export STEP_DIR OUT`: a consolidated, Hugging Face-loadable copy of a step's model weights.

Every model tensor is assembled whole from its fragments (whatever layout wrote them), checked
against the index's checksums, and written under its state_dict name into
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`; `config.json` and
`generation_config.json` are copied when the step has them, each checked against the size and
checksum the index records (a config the index does not list is not part of the step and is
not copied). OUT is built under a temporary name and renamed into place at the end, so it is
either complete or absent. No file of the step is read through a link or waited on as a FIFO
(storage.open_for_reading): export fails naming it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import xxhash

from ckptd.common import dtypes
from ckptd.common.boxes import Box, contiguous_runs
from ckptd.daemon.format import (
    INDEX_NAME,
    MODEL_FILES,
    CheckpointIndex,
    FormatError,
    StoredTensor,
    TensorRecord,
    check_small_file,
    file_key,
    hf_index_json,
    layout_files,
    safetensors_header,
)
from ckptd.daemon.pipeline import checksum_name
from ckptd.daemon.storage import fsync_dir, open_for_reading, read_file



class ExportError(RuntimeError):
    """The step cannot be exported; the message says why."""


def export_model(step_dir: Path, out: Path, max_file_bytes: int = 4 * 2**30) -> list[Path]:
    """Write the consolidated model of `step_dir` to the new directory `out`; returns its files."""
    index_path = step_dir / INDEX_NAME
    if not os.path.lexists(index_path):
        raise ExportError(f"{step_dir} is not a committed checkpoint (no {INDEX_NAME})")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new directory")
    try:
        index = CheckpointIndex.from_json_bytes(read_file(index_path), where=str(index_path))
    except FormatError as exc:
        raise ExportError(str(exc)) from None
    except OSError as exc:  # ForeignEntry included: a link or FIFO in place of the index
        raise ExportError(f"cannot read the index of {step_dir}: {exc}") from None
    model = sorted((t for t in index.tensors if t.kind == "model"), key=lambda t: t.name)
    if not model:
        raise ExportError(f"{step_dir} holds no model tensors (nothing was saved under the 'model' key)")

    stored = [StoredTensor(t.name, file_key(t.name, t.kind), t.dtype, t.shape, Box.full(t.shape)) for t in model]
    layouts = layout_files(stored, {t.name: "model" for t in model}, max_file_bytes)
    records = {t.name: t for t in model}
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        weight_map = {}
        for layout in layouts:
            header, _ = safetensors_header((t.key, t.dtype, t.shape) for t in layout.tensors)
            with open(tmp / layout.name, "wb") as f:
                f.write(header)
                for tensor in layout.tensors:
                    f.write(_assemble(step_dir, records[tensor.name]))
                    weight_map[tensor.key] = layout.name
                f.flush()
                os.fsync(f.fileno())
        total = sum(layout.nbytes for layout in layouts)
        (tmp / "model.safetensors.index.json").write_bytes(hf_index_json(total, weight_map))
        for name, data in _model_files(step_dir, index).items():
            (tmp / name).write_bytes(data)
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(out.iterdir())


def _model_files(step_dir: Path, index: CheckpointIndex) -> dict[str, bytes]:
    """The step's config files (MODEL_FILES) that its index lists, each read without following a
    link and checked against its recorded size and checksum (format.check_small_file). One
    that is listed but missing, unreadable or changed raises ExportError naming it."""
    out = {}
    records = {f.name: f for f in index.files}
    for name in MODEL_FILES:
        record = records.get(name)
        if record is None:
            if os.path.lexists(step_dir / name):
                raise ExportError(f"{step_dir / name} is not listed in the step's index (placed there after the save?): remove it, or export another step")
            continue
        try:
            data = read_file(step_dir / name, max(record.size, 1))
            check_small_file(record, data)
        except (OSError, FormatError) as exc:
            raise ExportError(f"{step_dir / name} cannot be exported: {exc}; `ckptd verify {step_dir}` shows what else is damaged") from None
        out[name] = data
    return out


def _assemble(step_dir: Path, record: TensorRecord) -> bytes:
    """The whole tensor's bytes in row-major order, from its fragments (each checksum-verified)."""
    itemsize = dtypes.itemsize(record.dtype)
    whole = np.empty(dtypes.nbytes(record.dtype, record.shape), dtype=np.uint8)
    for frag in record.fragments:
        if frag.dtype != record.dtype:
            raise ExportError(f"tensor {record.name!r} is stored as {frag.dtype} (quantized); export needs it lossless")
        data = _read(step_dir / frag.file, frag.offset, frag.nbytes)
        actual = checksum_name(xxhash.xxh3_64_intdigest(data))
        if actual != frag.checksum:
            raise ExportError(f"checksum mismatch for tensor {record.name!r} in {frag.file}: the file is damaged")
        src = np.frombuffer(data, dtype=np.uint8)
        for dst, at, n in contiguous_runs(frag.box, record.shape):
            whole[dst * itemsize : (dst + n) * itemsize] = src[at * itemsize : (at + n) * itemsize]
    return whole.tobytes()


def _read(path: Path, offset: int, nbytes: int) -> bytes:
    """`nbytes` bytes at `offset` of data file `path`, not read through a link nor waited on as a FIFO."""
    try:
        fd = open_for_reading(path)
    except OSError as exc:
        raise ExportError(f"cannot read {path}: {exc}") from None
    with open(fd, "rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise ExportError(f"{path.name} is truncated: {nbytes} bytes expected at offset {offset}, {len(data)} found")
    return data
