"""Export assembles tensors stored as fragments (as several nodes write them) into whole ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import load_file

from ckptd.common.boxes import Box
from ckptd.daemon.export import ExportError, export_model
from ckptd.daemon.format import INDEX_NAME, CheckpointIndex, FileRecord, FragmentRecord, TensorRecord, safetensors_header
from ckptd.daemon.pipeline import checksum_name


def _write_fragments(step_dir: Path, name: str, full: np.ndarray, boxes: list[Box]) -> TensorRecord:
    """Each box in its own file, under a fragment key, as node-local writers would store them."""
    frags = []
    for i, box in enumerate(boxes):
        part = np.ascontiguousarray(full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))])
        key = f"{name}@{i}"
        header, _ = safetensors_header([(key, "F32", part.shape)])
        file = f"model-{i + 1:05d}-of-{len(boxes):05d}.safetensors"
        (step_dir / file).write_bytes(header + part.tobytes())
        frags.append(FragmentRecord(file, key, box, "F32", len(header), part.nbytes, checksum_name(xxhash.xxh3_64_intdigest(part.tobytes()))))
    return TensorRecord(f"model/{name}", "model", "F32", full.shape, tuple(frags))


def test_fragments_over_files_become_whole_tensors(tmp_path: Path) -> None:
    step_dir = tmp_path / "step-00000001"
    step_dir.mkdir()
    full = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    record = _write_fragments(step_dir, "w", full, [Box((0, 0), (3, 5)), Box((3, 0), (4, 2)), Box((3, 2), (4, 3))])
    index = CheckpointIndex("j", 1, 0.0, 3, (record,), tuple(FileRecord(f.file, 0, "") for f in record.fragments))
    (step_dir / INDEX_NAME).write_bytes(index.to_json_bytes())
    export_model(step_dir, tmp_path / "out")
    assert torch.equal(load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")["w"], torch.from_numpy(full))

    (step_dir / record.fragments[1].file).write_bytes(b"\0" * 200)  # damaged
    with pytest.raises(ExportError, match="checksum mismatch for tensor 'model/w'"):
        export_model(step_dir, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
