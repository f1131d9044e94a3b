"""A two-file step index for the load planners' table tests (tests/format/test_file_plan.py,
tests/daemon/test_load_plan.py): model/w (4, 2) with rows 0-1 in F1 and rows 2-3 in F2 (written
by nodes 0 and 1), model/b (2,) and optim/m (2,) whole in F1."""

from __future__ import annotations

from ckptd.common.boxes import Box
from ckptd.format.index import CheckpointIndex, FileRecord, FragmentRecord, QuantRecord, TensorRecord

F1, F2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def index_of(tensors: tuple[TensorRecord, ...] = ()) -> CheckpointIndex:
    """Step 7 of job "job", saved by 2 ranks, with F1 and F2 and these tensors."""
    files = (FileRecord(F1, 100, "xxh3:1", node=0), FileRecord(F2, 100, "xxh3:2", node=1))
    return CheckpointIndex(job="job", step=7, created_at=0.0, world_size=2, tensors=tensors, files=files)


def fragment(file: str, offset: int, box: Box, quant: QuantRecord | None = None) -> FragmentRecord:
    """An F32 fragment of `box` at `offset` of `file`."""
    return FragmentRecord(file=file, key=f"k{offset}", box=box, dtype="F32", offset=offset, nbytes=box.numel * 4, checksum="xxh3:0", quant=quant)


W = TensorRecord("model/w", "model", "F32", (4, 2), (fragment(F1, 0, Box((0, 0), (2, 2))), fragment(F2, 0, Box((2, 0), (2, 2)))))
B = TensorRecord("model/b", "model", "F32", (2,), (fragment(F1, 16, Box((0,), (2,))),))
OPT = TensorRecord("optim/m", "optimizer", "F32", (2,), (fragment(F1, 24, Box((0,), (2,))),))
