"""Export assembles tensors stored as fragments (as several nodes write them) into whole ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import load_file

from ckptd.common.boxes import Box
from ckptd.daemon.tools.export import ExportError, export_model
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FileRecord, FragmentRecord, TensorRecord
from ckptd.format.safetensors_header import safetensors_header
from ckptd.common.chunks import checksum_name


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


def test_config_json_is_checked_against_the_index_and_links_are_not_followed(tmp_path: Path) -> None:
    """Issue 20: export copied config.json without checking it against the index checksum."""
    from ckptd.format.index import small_file_checksum

    step_dir = tmp_path / "step-00000001"
    step_dir.mkdir()
    full = np.arange(6, dtype=np.float32).reshape(2, 3)
    record = _write_fragments(step_dir, "w", full, [Box((0, 0), (2, 3))])
    config = b'{"model_type": "llama"}\n'
    (step_dir / "config.json").write_bytes(config)
    files = tuple(FileRecord(f.file, 0, "") for f in record.fragments) + (FileRecord("config.json", len(config), small_file_checksum(config)),)
    (step_dir / INDEX_NAME).write_bytes(CheckpointIndex("j", 1, 0.0, 1, (record,), files).to_json_bytes())
    export_model(step_dir, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_bytes() == config

    (step_dir / "config.json").write_bytes(b'{"model_type": "gpt2"}\n')  # edited after the save
    with pytest.raises(ExportError, match="config.json cannot be exported: config.json"):
        export_model(step_dir, tmp_path / "out2")
    (step_dir / "config.json").unlink()
    secret = tmp_path / "secret"
    secret.write_bytes(config)
    (step_dir / "config.json").symlink_to(secret)  # the right bytes, through a link
    with pytest.raises(ExportError, match="is a symbolic link"):
        export_model(step_dir, tmp_path / "out3")
    (step_dir / "generation_config.json").write_text("{}")  # not in the index
    (step_dir / "config.json").unlink()
    (step_dir / "config.json").write_bytes(config)
    with pytest.raises(ExportError, match="generation_config.json is not listed in the step's index"):
        export_model(step_dir, tmp_path / "out4")
    assert not any((tmp_path / f"out{i}").exists() for i in (2, 3, 4))
