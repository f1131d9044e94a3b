"""`ckptd export STEP_DIR OUT`: a consolidated, Hugging Face-loadable copy of a step's model weights.

Every model tensor is assembled whole from its fragments (whatever layout wrote them), checked
against the index's checksums, and written under its state_dict name into
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`; `config.json` and
`generation_config.json` are copied when the step has them. OUT is built under a temporary
name and renamed into place at the end, so it is either complete or absent.
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
    CheckpointIndex,
    FormatError,
    StoredTensor,
    TensorRecord,
    file_key,
    hf_index_json,
    layout_files,
    safetensors_header,
)
from ckptd.daemon.pipeline import checksum_name
from ckptd.daemon.storage import fsync_dir

MODEL_FILES = ("config.json", "generation_config.json")


class ExportError(RuntimeError):
    """The step cannot be exported; the message says why."""


def export_model(step_dir: Path, out: Path, max_file_bytes: int = 4 * 2**30) -> list[Path]:
    """Write the consolidated model of `step_dir` to the new directory `out`; returns its files."""
    index_path = step_dir / INDEX_NAME
    if not index_path.is_file():
        raise ExportError(f"{step_dir} is not a committed checkpoint (no {INDEX_NAME})")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new directory")
    try:
        index = CheckpointIndex.from_json_bytes(index_path.read_bytes(), where=str(index_path))
    except FormatError as exc:
        raise ExportError(str(exc)) from None
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
        for name in MODEL_FILES:
            if (step_dir / name).is_file():
                shutil.copyfile(step_dir / name, tmp / name)
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(out.iterdir())


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
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise ExportError(f"{path.name} is truncated: {nbytes} bytes expected at offset {offset}, {len(data)} found")
    return data
