"""Incremental saves (daemon/ckptd/daemon/write/reuse.py, writer.py, storage link_file): files of frozen
tensors unchanged since the previous step are linked, never assumed unchanged; retention and
recycling never take bytes a kept step still uses. Both backends (POSIX and the in-memory test
double), real shared-memory arenas, no server."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_bytes

from ckptd.common.boxes import Box
from ckptd.daemon.handoff.arena import ArenaPool, ArenaSet
from ckptd.format.index import INDEX_NAME, StoredTensor, layout_files
from ckptd.daemon.plan.save_plan import SavePlan, TensorSpec, make_save_plan
from ckptd.daemon.plan.files import NodeManifest, step_files
from ckptd.daemon.write.reuse import check_files
from ckptd.daemon.storage import ReadHandle, Storage, StorageBackend
from ckptd.format.units import file_units
from ckptd.daemon.tools.verify import verify_files
from ckptd.daemon.storage.step_commit import StepCommit
from ckptd.daemon.write.request import PersistRequest, Progress
from ckptd.daemon.write.writer import write_node_files
from arena_rig import take_arenas  # tests/arena_rig.py
from memory_backend import MemoryStorage


@pytest.fixture(params=["posix", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> StorageBackend:
    return Storage(tmp_path) if request.param == "posix" else MemoryStorage()


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ckptd-test-", dir="/dev/shm") as d:
        yield Path(d)


def _specs(frozen: str = "param") -> list[TensorSpec]:
    """A LoRA-like model: two frozen base weights, a buffer, two trained adapters, their Adam state."""
    return [
        TensorSpec("model/base.0", "model", "F32", (64, 64), Box.full((64, 64)), frozen=frozen),
        TensorSpec("model/lora.0", "model", "F32", (4, 64), Box.full((4, 64))),
        TensorSpec("model/base.1", "model", "BF16", (128, 32), Box.full((128, 32)), frozen=frozen),
        TensorSpec("model/lora.1", "model", "F32", (4, 32), Box.full((4, 32))),
        TensorSpec("model/norm.running_mean", "model", "F32", (64,), Box.full((64,)), frozen="buffer" if frozen else ""),
        TensorSpec("optimizer/state/lora.0/exp_avg", "optimizer", "F32", (4, 64), Box.full((4, 64))),
    ]


def _tensors(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16 if s.dtype == "BF16" else torch.float32) for s in specs}


def _fill(arenas: ArenaSet, plan: SavePlan, tensors: dict[str, torch.Tensor]) -> None:
    for slot in plan.slots:
        raw = tensors[slot.name].contiguous().reshape(-1).view(torch.uint8).numpy()
        view = arenas.arenas[slot.rank].view(slot.offset, slot.nbytes)
        np.frombuffer(view, dtype=np.uint8)[:] = raw
        view.release()


class _Saver:
    """Saves steps of one plan through write_node_files + the commit, as the daemon does."""

    def __init__(self, storage: StorageBackend, shm_dir: Path, specs: list[TensorSpec], max_file_bytes: int = 2**30) -> None:
        self.storage, self.plan, self.max_file_bytes = storage, make_save_plan([specs]), max_file_bytes
        self.pool = ArenaPool(shm_dir, "job", max_inflight=1)
        arenas = take_arenas(self.pool, self.plan.arena_bytes)
        assert arenas is not None
        self.arenas = arenas

    def save(self, step: int, tensors: dict[str, torch.Tensor], previous: int | None) -> NodeManifest:
        _fill(self.arenas, self.plan, tensors)
        index = self.storage.files.read_index("job", previous) if previous is not None else None
        req = PersistRequest("job", step, self.plan, self.arenas, {}, {}, None, self.max_file_bytes, 2, previous=index)
        manifest = write_node_files(self.storage, req, Progress(self.plan.total_bytes))
        _, files = step_files("job", step, self.plan, [manifest], {}, {}, None)
        StepCommit(self.storage.writing, self.storage.catalog, "job", step).publish(files)
        return manifest

    def loaded(self, step: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in self.storage.files.step_file_sizes("job", step):
            if name.endswith(".safetensors"):
                out.update(load_bytes(self.storage.files.read_small("job", step, name)))
        return out


def _same(loaded: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> bool:
    def key(name: str) -> str:
        return name.split("/", 1)[1] if name.startswith("model/") else name

    return all(torch.equal(loaded[key(n)], t) for n, t in tensors.items())


def test_layout_puts_each_frozen_class_in_files_of_its_own() -> None:
    kinds = {"a": "model", "b": "model", "c": "model", "d": "model", "o": "optimizer"}
    stored = [StoredTensor(n, n, "F32", (10,), Box.full((10,))) for n in ("a", "b", "c", "d", "o")]
    plain = layout_files(stored, kinds, 2**30)
    assert [[t.name for t in f.tensors] for f in plain] == [["a", "b", "c", "d"], ["o"]]  # nothing frozen: as before
    frozen = layout_files(stored, kinds, 2**30, {"a": "param", "c": "buffer", "d": "param"})
    assert [(f.name, [t.name for t in f.tensors]) for f in frozen] == [
        ("model-00001-of-00003.safetensors", ["b"]),
        ("model-00002-of-00003.safetensors", ["c"]),
        ("model-00003-of-00003.safetensors", ["a", "d"]),
        ("optimizer-00001-of-00001.safetensors", ["o"]),
    ]
    split = layout_files(stored, kinds, 40, {"a": "param", "c": "param", "d": "param"})  # 40 bytes: one tensor per file
    assert [[t.name for t in f.tensors] for f in split if f.group == "model"] == [["b"], ["a"], ["c"], ["d"]]


def test_unchanged_frozen_files_are_linked_and_every_step_stays_whole(backend: StorageBackend, shm_dir: Path) -> None:
    specs = _specs()
    saver = _Saver(backend, shm_dir, specs)
    tensors = _tensors(specs)
    first = saver.save(1, tensors, None)
    assert first.linked == ()
    trained = dict(tensors)
    trained["model/lora.0"] = tensors["model/lora.0"] + 1
    trained["optimizer/state/lora.0/exp_avg"] = tensors["optimizer/state/lora.0/exp_avg"] * 2
    second = saver.save(2, trained, 1)
    frozen_files = {f.name for f in first.files} - {"model-00001-of-00003.safetensors", "optimizer-00001-of-00001.safetensors"}
    assert set(second.linked) == frozen_files == {"model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"}
    assert _same(saver.loaded(1), tensors) and _same(saver.loaded(2), trained)
    for step in (1, 2):
        report = verify_files(backend.files.step_reader("job", step))
        assert report.ok, report.problems
    if isinstance(backend, Storage):
        for name in second.linked:
            one, two = (backend.tree.step_dir("job", s) / name for s in (1, 2))
            assert one.stat().st_ino == two.stat().st_ino and two.stat().st_nlink == 2
    # the first step deleted and recycled: the second keeps its linked files whole, and the
    # bin never takes a file that another step still names
    backend.janitor.remove_step("job", 1, recycle=True)
    assert len(backend.writing.take_recycled("job")) <= 2  # only the written files may be recycled
    third = saver.save(3, trained, 2)
    assert set(third.linked) == frozen_files
    assert _same(saver.loaded(2), trained) and _same(saver.loaded(3), trained)
    saver.pool.close()


def test_a_frozen_tensor_that_changed_is_written_not_linked(backend: StorageBackend, shm_dir: Path) -> None:
    specs = _specs()
    saver = _Saver(backend, shm_dir, specs)
    tensors = _tensors(specs)
    saver.save(1, tensors, None)
    moved = dict(tensors)
    moved["model/norm.running_mean"] = tensors["model/norm.running_mean"] + 0.5  # a buffer updated in place
    moved["model/base.1"] = tensors["model/base.1"].clone()
    moved["model/base.1"][-1, -1] += 1  # one value of a "frozen" weight changed: never trusted by the flag
    manifest = saver.save(2, moved, 1)
    assert manifest.linked == ()
    assert _same(saver.loaded(2), moved) and _same(saver.loaded(1), tensors)
    saver.pool.close()


def test_nothing_is_linked_without_frozen_tensors_or_a_previous_step(backend: StorageBackend, shm_dir: Path) -> None:
    specs = _specs(frozen="")
    saver = _Saver(backend, shm_dir, specs)
    tensors = _tensors(specs)
    saver.save(1, tensors, None)
    assert saver.save(2, tensors, 1).linked == ()
    saver.pool.close()
    frozen = _Saver(backend, shm_dir, _specs())
    same = _tensors(_specs())
    frozen.save(3, same, None)
    assert frozen.save(4, same, None).linked == ()  # unchanged, but no previous step given: written
    frozen.pool.close()


def test_a_previous_file_replaced_by_a_link_or_gone_is_written_instead(tmp_path: Path, shm_dir: Path) -> None:
    storage = Storage(tmp_path)
    specs = _specs()
    saver = _Saver(storage, shm_dir, specs)
    tensors = _tensors(specs)
    saver.save(1, tensors, None)
    step1 = storage.tree.step_dir("job", 1)
    bait = tmp_path / "bait.safetensors"
    os.replace(step1 / "model-00003-of-00003.safetensors", bait)
    (step1 / "model-00003-of-00003.safetensors").symlink_to(bait)  # planted: never linked through
    (step1 / "model-00002-of-00003.safetensors").unlink()
    manifest = saver.save(2, tensors, 1)
    assert manifest.linked == ()
    assert not (storage.tree.step_dir("job", 2) / "model-00003-of-00003.safetensors").is_symlink()
    assert _same(saver.loaded(2), tensors)
    saver.pool.close()


def test_link_file_refuses_an_uncommitted_source_and_another_size(tmp_path: Path, shm_dir: Path) -> None:
    storage = Storage(tmp_path)
    specs = _specs()
    saver = _Saver(storage, shm_dir, specs)
    saver.save(1, _tensors(specs), None)
    name = "model-00003-of-00003.safetensors"
    size = (storage.tree.step_dir("job", 1) / name).stat().st_size
    storage.writing.prepare_step("job", 2)
    assert not storage.writing.link_file("job", 1, name, 2, name, size + 1)
    assert storage.writing.link_file("job", 1, name, 2, name, size)
    (storage.tree.step_dir("job", 1) / INDEX_NAME).unlink()  # step 1 no longer committed
    storage.writing.prepare_step("job", 3)
    assert not storage.writing.link_file("job", 1, name, 3, name, size)
    assert not (storage.tree.step_dir("job", 3) / name).exists()
    with pytest.raises(ValueError):
        storage.writing.link_file("job", 1, "../x", 3, name, size)
    saver.pool.close()


def _damage(backend: StorageBackend, step: int, name: str, how: str, at: int) -> None:
    """Damage a committed data file: flip the byte at `at` in place (the same file, every link
    of it) or replace the file by another of the same size with that byte flipped."""
    if isinstance(backend, MemoryStorage):
        files = backend.state.steps[("job", step)].files
        data = bytearray(files[name])
        data[at] ^= 0xFF
        files[name] = bytes(data)  # a file of its own now: other steps keep the bytes they share
        return
    path = backend.tree.step_dir("job", step) / name
    if how == "in-place":
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0xFF]))
        return
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    other = path.with_name("replacement")
    other.write_bytes(bytes(data))
    os.replace(other, path)


# issue 30 finding 2: a file linked from the previous step is read back against its checksums
# before the step is reported written; one damaged on disk is written again from the snapshot.
@pytest.mark.parametrize(("how", "where"), [("in-place", "tensor"), ("replaced", "tensor"), ("in-place", "header")])
def test_a_previous_file_damaged_on_disk_is_written_again_not_linked(backend: StorageBackend, shm_dir: Path, how: str, where: str) -> None:
    specs = _specs()
    saver = _Saver(backend, shm_dir, specs)
    tensors = _tensors(specs)
    first = saver.save(1, tensors, None)
    index = backend.files.read_index("job", 1)
    fragment = next(t for t in index.tensors if t.name == "model/base.1").fragments[0]
    damaged = fragment.file
    _damage(backend, 1, damaged, how, fragment.offset + fragment.nbytes // 2 if where == "tensor" else 10)
    assert not verify_files(backend.files.step_reader("job", 1)).ok
    second = saver.save(2, tensors, 1)
    report = verify_files(backend.files.step_reader("job", 2))
    assert report.ok, report.problems
    assert _same(saver.loaded(2), tensors)
    frozen_files = {f.name for f in first.files} - {"model-00001-of-00003.safetensors", "optimizer-00001-of-00001.safetensors"}
    assert second.rewritten == (damaged,) and set(second.linked) == frozen_files - {damaged}
    if isinstance(backend, Storage):
        one, two = (backend.tree.step_dir("job", s) / damaged for s in (1, 2))
        assert two.stat().st_nlink == 1 and one.stat().st_ino != two.stat().st_ino  # the damaged inode is in step 1 only
    third = saver.save(3, tensors, 2)  # the next save links the good copy step 2 wrote
    assert set(third.linked) == frozen_files and third.rewritten == ()
    assert _same(saver.loaded(3), tensors)
    saver.pool.close()


# issue 30 finding 2
def test_check_linked_names_each_file_that_does_not_match(tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = Storage(tmp_path)
    specs = _specs()
    saver = _Saver(storage, shm_dir, specs)
    tensors = _tensors(specs)
    saver.save(1, tensors, None)
    path = storage.tree.step_dir("job", 1) / "model-00003-of-00003.safetensors"
    _damage(storage, 1, path.name, "in-place", path.stat().st_size - 1)  # the last byte of the last tensor
    with caplog.at_level("WARNING", logger="ckptd.daemon.write.writer"):
        manifest = saver.save(2, tensors, 1)
    assert verify_files(storage.files.step_reader("job", 2)).ok
    assert manifest.rewritten == (path.name,)
    (record,) = [r for r in caplog.records if path.name in r.getMessage()]
    message = record.getMessage()
    assert "step 2 of job job" in message and "linked from step 1" in message and "damaged on disk" in message
    assert "bytes [" in message and f"{path.stat().st_size})" in message and "ckptd verify" in message
    saver.pool.close()


# issue 30 review: the check of linked files reads through the opener it is given (a step
# reader's), one function that check_linked and tests/bench/bench_incremental.py both run
def test_check_files_reads_each_file_through_its_opener_and_names_those_that_do_not_match(backend: StorageBackend, shm_dir: Path) -> None:
    saver = _Saver(backend, shm_dir, _specs())
    saver.save(1, _tensors(_specs()), None)
    units = file_units(backend.files.read_index("job", 1))
    reader = backend.files.step_reader("job", 1)
    opened: list[str] = []

    def open_file(name: str) -> ReadHandle:
        opened.append(name)
        return reader.open(name)

    assert check_files(open_file, units, threads=3) == {} and set(opened) == set(units)
    damaged = sorted(units)[0]
    _damage(backend, 1, damaged, "in-place", 10)  # inside the header: unit 0
    problems = check_files(open_file, {**units, "gone.safetensors": units[damaged]}, threads=3)
    assert problems[damaged].startswith("bytes [0, ") and "do not match their checksum" in problems[damaged]
    assert problems["gone.safetensors"].startswith("it cannot be read back") and set(problems) == {damaged, "gone.safetensors"}
    saver.pool.close()
