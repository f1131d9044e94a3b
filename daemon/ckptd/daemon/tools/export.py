"""`ckptd export STEP_DIR OUT`: a consolidated, Hugging Face-loadable copy of a step's model weights.

Every model tensor is assembled whole from its fragments (whatever layout wrote them), checked
against the index's checksums, and written under its state_dict name into
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`; `config.json` and
`generation_config.json` are copied when the step has them, each checked against the size and
checksum the index records (a config the index does not list is not part of the step and is
not copied). OUT is built under a temporary name and renamed into place at the end, so it is
either complete or absent. The step is read through a StepReader of the storage backend
(storage/base.py): on POSIX no file of it is read through a link or waited on as a FIFO, and
export fails naming it. OUT is the operator's directory, not the storage root: export writes
it itself.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import xxhash

from ckptd.common import dtypes
from ckptd.common.boxes import Box, contiguous_runs
from ckptd.common.chunks import checksum_name
from ckptd.common.paths import new_directory_problem
from ckptd.format.index import (
    INDEX_NAME,
    MODEL_FILES,
    CheckpointIndex,
    FormatError,
    StoredTensor,
    TensorRecord,
    check_small_file,
    file_key,
    layout_files,
)
from ckptd.format.safetensors_header import safetensors_header
from ckptd.format.json_text import hf_index_json
from ckptd.daemon.remote.bucket_step import BucketStepError
from ckptd.daemon.storage import StepReader, fsync_dir
from ckptd.daemon.tools.locate import open_step_reader


class ExportError(RuntimeError):
    """The step cannot be exported; the message says why."""


def export_model(location: str | os.PathLike[str], out: Path, max_file_bytes: int = 4 * 2**30) -> list[Path]:
    """Write the consolidated model of the step at `location` (a step directory, or
    s3://BUCKET/PREFIX/JOB/step-N) to the new directory `out`; returns its files."""
    try:
        step = open_step_reader(location)
    except BucketStepError as exc:
        raise ExportError(str(exc)) from None
    return export_files(step, out, max_file_bytes)


def export_files(step: StepReader, out: Path, max_file_bytes: int = 4 * 2**30) -> list[Path]:
    """As export_model, for the step that `step` reads (any backend)."""
    step_dir = step.where
    index_path = f"{step_dir}/{INDEX_NAME}"
    if not step.exists(INDEX_NAME):
        raise ExportError(f"{step_dir} is not a committed checkpoint (no {INDEX_NAME})")
    problem = new_directory_problem(out)
    if problem is not None:
        raise ExportError(problem)
    try:
        index = CheckpointIndex.from_json_bytes(step.read_small(INDEX_NAME), where=index_path)
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
                    f.write(_assemble(step, records[tensor.name]))
                    weight_map[tensor.key] = layout.name
                f.flush()
                os.fsync(f.fileno())
        total = sum(layout.nbytes for layout in layouts)
        (tmp / "model.safetensors.index.json").write_bytes(hf_index_json(total, weight_map))
        for name, data in _model_files(step, index).items():
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


def _model_files(step: StepReader, index: CheckpointIndex) -> dict[str, bytes]:
    """The step's config files (MODEL_FILES) that its index lists, each read without following a
    link and checked against its recorded size and checksum (format.check_small_file). One
    that is listed but missing, unreadable or changed raises ExportError naming it."""
    out = {}
    step_dir = step.where
    records = {f.name: f for f in index.files}
    for name in MODEL_FILES:
        record = records.get(name)
        if record is None:
            if step.exists(name):
                raise ExportError(f"{step_dir}/{name} is not listed in the step's index (placed there after the save?): remove it, or export another step")
            continue
        try:
            data = step.read_small(name, max(record.size, 1))
            check_small_file(record, data)
        except (OSError, FormatError) as exc:
            raise ExportError(f"{step_dir}/{name} cannot be exported: {exc}; `ckptd verify {step_dir}` shows what else is damaged") from None
        out[name] = data
    return out


def _assemble(step: StepReader, record: TensorRecord) -> bytes:
    """The whole tensor's bytes in row-major order, from its fragments (each checksum-verified)."""
    itemsize = dtypes.itemsize(record.dtype)
    whole = np.empty(dtypes.nbytes(record.dtype, record.shape), dtype=np.uint8)
    for frag in record.fragments:
        if frag.dtype != record.dtype:
            raise ExportError(f"tensor {record.name!r} is stored as {frag.dtype} (quantized); export needs it lossless")
        data = _read(step, frag.file, frag.offset, frag.nbytes)
        actual = checksum_name(xxhash.xxh3_64_intdigest(data))
        if actual != frag.checksum:
            raise ExportError(f"checksum mismatch for tensor {record.name!r} in {frag.file}: the file is damaged")
        src = np.frombuffer(data, dtype=np.uint8)
        for dst, at, n in contiguous_runs(frag.box, record.shape):
            whole[dst * itemsize : (dst + n) * itemsize] = src[at * itemsize : (at + n) * itemsize]
    return whole.tobytes()


def _read(step: StepReader, name: str, offset: int, nbytes: int) -> bytes:
    """`nbytes` bytes at `offset` of data file `name` of the step."""
    try:
        f = step.open(name)
    except OSError as exc:
        raise ExportError(f"cannot read {step.where}/{name}: {exc}") from None
    with f:
        data = f.pread(nbytes, offset)
    if len(data) != nbytes:
        raise ExportError(f"{name} is truncated: {nbytes} bytes expected at offset {offset}, {len(data)} found")
    return data
