"""The free-space check before a step is written (issue 19, item 6): the pure decision, the
bytes a step's files take, recycled files counted as room, and the pipeline refusing a step
before it creates anything of it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from ckptd.common.boxes import Box
from ckptd.common.sizes import human_bytes
from ckptd.daemon.write import writer
from ckptd.daemon.handoff.arena import ArenaPool
from ckptd.daemon.config import GiB, DaemonConfig, load_config
from ckptd.daemon.errors import Exhausted, NoSpace
from ckptd.daemon.plan.files import file_bytes_bound
from ckptd.daemon.write.writer import PersistRequest, Progress, persist, write_node_files
from ckptd.daemon.plan.save_plan import SavePlan, TensorSpec, make_save_plan
from ckptd.daemon.storage import FreeSpace, Storage, reused_bytes, space_problem
from ckptd.daemon.storage.posix_writing import PosixWriting
from arena_rig import take_arenas  # tests/arena_rig.py

KiB, MiB = 1 << 10, 1 << 20


# ------------------------------------------------------------------ the pure decision

# write_bytes, reused, reserve, free -> None (fits) or phrases the refusal must hold
DECISIONS: list[tuple[int, int, int, int, list[str] | None]] = [
    (10 * MiB, 0, 1 * MiB, 11 * MiB, None),  # exactly enough
    (10 * MiB, 0, 1 * MiB, 11 * MiB - 1, ["needs 11 MiB (10 MiB of data + 1 MiB reserve), 11 MiB free on /data/ckpt", "lower --disk-reserve"]),
    (20 * GiB, 0, 1 * GiB, 3 * GiB, ["needs 21 GiB (20 GiB of data + 1 GiB reserve), 3 GiB free on /data/ckpt", "free space there", "--keep-last"]),
    (10 * GiB, 10 * GiB, 1 * GiB, 1 * GiB, None),  # the recycled files take the whole step
    (10 * GiB, 4 * GiB, 1 * GiB, 7 * GiB, None),
    (10 * GiB, 4 * GiB, 1 * GiB, 6 * GiB, ["needs 7 GiB (6 GiB of data + 1 GiB reserve; another 4 GiB reuse recycled files)", "6 GiB free"]),
    (5 * MiB, 10 * MiB, 0, 0, None),  # recycled files larger than the step: nothing new
    (1 * KiB, 0, 0, 1023, ["needs 1 KiB (1 KiB of data + 0 B reserve), 1023 B free", "free space there"]),
    (0, 0, 1 * GiB, 512 * MiB, ["needs 1 GiB (0 B of data + 1 GiB reserve), 512 MiB free", "lower --disk-reserve"]),
]


@pytest.mark.parametrize(("write_bytes", "reused", "reserve", "free", "phrases"), DECISIONS)
def test_space_decision(write_bytes: int, reused: int, reserve: int, free: int, phrases: list[str] | None) -> None:
    problem = space_problem(write_bytes, reused, reserve, free, Path("/data/ckpt"))
    if phrases is None:
        assert problem is None
        return
    assert problem is not None and problem.startswith("not enough disk space: ")
    for phrase in phrases:
        assert phrase in problem, problem
    if "free space there" in phrases:  # lowering the reserve would not help: not suggested
        assert "--disk-reserve" not in problem


@pytest.mark.parametrize(
    ("sizes", "recycled", "reused"),
    [
        ([], [5], 0),
        ([10], [], 0),
        ([10, 4], [8, 8], 12),  # the largest file gets the largest recycled one, and so on
        ([10, 4, 2], [20], 10),  # a larger recycled file is cut, only the file's bytes count
        ([10, 4], [3, 3, 3], 6),
    ],
)
def test_reused_bytes_pair_files_as_the_pipeline_does(sizes: list[int], recycled: list[int], reused: int) -> None:
    assert reused_bytes(sizes, recycled) == reused


def test_no_space_is_resource_exhausted() -> None:
    assert issubclass(NoSpace, Exhausted)  # RESOURCE_EXHAUSTED on the wire (servicer._STATUS)


def test_disk_reserve_defaults_to_one_gib_and_parses_sizes(tmp_path: Path) -> None:
    assert DaemonConfig(root=tmp_path, socket=tmp_path / "s").disk_reserve == GiB
    env = {"XDG_RUNTIME_DIR": "/run/user/1000", "XDG_DATA_HOME": "/d"}
    assert load_config({"disk_reserve": "200MiB"}, env, None).disk_reserve == 200 * MiB
    assert load_config({"disk_reserve": "0"}, env, None).disk_reserve == 0


# ------------------------------------------------------------------ the storage helpers


def test_free_bytes_is_statvfs_of_the_job_directory_or_the_root(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    measured = storage.writing.free_bytes("job")
    assert measured is not None and measured.where == str(tmp_path.resolve())  # no job directory yet: the root
    st = os.statvfs(tmp_path)
    assert abs(measured.nbytes - st.f_bavail * st.f_frsize) < 64 * MiB  # others write to the same disk meanwhile
    (tmp_path / "job").mkdir()
    in_job = storage.writing.free_bytes("job")
    assert in_job is not None and in_job.where == str(tmp_path.resolve() / "job")


def test_allocated_in_step_counts_files_and_temporary_names(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    assert storage.writing.allocated_in_step("job", 1) == {}
    step_dir = tmp_path / "job" / "step-00000001"
    step_dir.mkdir(parents=True)
    (step_dir / "model-00001-of-00002.safetensors").write_bytes(b"x" * 100_000)
    (step_dir / ".tmp-model-00002-of-00002.safetensors.4242").write_bytes(b"y" * 10_000)
    found = storage.writing.allocated_in_step("job", 1)
    assert set(found) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert found["model-00001-of-00002.safetensors"] >= 100_000 and found["model-00002-of-00002.safetensors"] >= 10_000


# ------------------------------------------------------------------ the pipeline


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ckptd-test-", dir="/dev/shm") as d:
        yield Path(d)


def _fill(arenas: Any, plan: SavePlan, tensors: dict[str, torch.Tensor], node: int | None = None) -> None:
    for slot in plan.slots:
        if node is not None and plan.node(slot.rank) != node:
            continue
        data = tensors[slot.name][tuple(slice(o, o + n) for o, n in zip(slot.box.offsets, slot.box.lengths))]
        view = arenas.arenas[slot.rank].view(slot.offset, slot.nbytes)
        np.frombuffer(view, dtype=np.uint8)[:] = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        view.release()


DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16"}


def _state() -> dict[str, torch.Tensor]:
    return {
        "model/w": torch.randn(64, 128).to(torch.bfloat16),
        "model/b": torch.randn(128),
        "master/w": torch.randn(64, 128),
        "optimizer/state/w/exp_avg": torch.randn(64, 128),
        "optimizer/state/w/exp_avg_sq": torch.rand(64, 128),
        "optimizer/state/v/exp_avg": torch.randn(96, 64),
        "optimizer/state/u/exp_avg_sq": torch.rand(8, 8),  # small: stays lossless
    }


def _plan(tensors: dict[str, torch.Tensor]) -> SavePlan:
    specs = [TensorSpec(n, n.split("/")[0], DTYPE[t.dtype], tuple(t.shape), Box.full(tuple(t.shape))) for n, t in tensors.items()]
    return make_save_plan([specs])


class _Spy:
    """Wraps writer.check_space: records the bytes it counted for each call."""

    def __init__(self) -> None:
        self.real = writer.check_space
        self.bounds: list[int] = []

    def __call__(self, storage: Storage, req: PersistRequest, layouts: Any, tensors: Any, recycled: Any) -> None:
        self.bounds.append(sum(file_bytes_bound(f, tensors) for f in layouts))
        self.real(storage, req, layouts, tensors, recycled)


def _data_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.glob("*.safetensors"))


@pytest.mark.parametrize(
    ("quantize", "master_weights", "nan"),
    [(None, "keep", False), ("O1", "keep", False), ("O2", "residual", False), ("O2", "drop", False), ("O1", "keep", True)],
)
def test_the_bytes_counted_bound_the_files_written(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, quantize: str | None, master_weights: str, nan: bool
) -> None:
    """Lossless files are counted exactly; quantized ones (sizes known only once coded, or values
    that fall back to lossless: a nan) are never counted short."""
    tensors = _state()
    if nan:
        tensors["optimizer/state/w/exp_avg"][1, 1] = float("nan")
    plan = _plan(tensors)
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    _fill(arenas, plan, tensors)
    spy = _Spy()
    monkeypatch.setattr(writer, "check_space", spy)
    request = PersistRequest("job", 1, plan, arenas, {}, {}, None, 40_000, 2, quantize=quantize, master_weights=master_weights)
    persist(Storage(tmp_path), request, Progress(plan.total_bytes))
    pool.close()
    written = _data_bytes(tmp_path / "job" / "step-00000001")
    if quantize is None:
        assert spy.bounds == [written]
    else:
        assert spy.bounds[0] >= written and spy.bounds[0] < plan.total_bytes + 64 * KiB


def test_a_step_that_does_not_fit_is_refused_before_anything_is_written(tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _state()
    plan = _plan(tensors)
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    _fill(arenas, plan, tensors)
    storage = Storage(tmp_path)
    reserve = 3 * MiB

    def save(step: int) -> None:
        persist(storage, PersistRequest("job", step, plan, arenas, {0: {}}, {}, None, 40_000, 2, disk_reserve=reserve), Progress(plan.total_bytes))

    save(1)
    needed = _data_bytes(tmp_path / "job" / "step-00000001")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    free = {"bytes": needed + reserve - 1}
    monkeypatch.setattr(PosixWriting, "free_bytes", lambda self, job: FreeSpace(free["bytes"], str(self.tree.root)))
    with pytest.raises(NoSpace) as refused:
        save(2)
    message = str(refused.value)
    assert message.startswith("step 2 of job 'job' refused: not enough disk space: needs ")
    assert f"+ 3 MiB reserve), {human_bytes(needed + reserve - 1)} free on {tmp_path.resolve()}" in message
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing created, nothing removed
    assert (tmp_path / "job" / "latest").read_text() == "step-00000001\n"

    free["bytes"] = needed + reserve  # exactly enough
    save(2)
    assert storage.catalog.committed_steps("job") == [1, 2]

    # step 1's files go to the recycle bin: a step of the same files takes (almost) no new space
    # (files of the same tensors but another header may trade places and grow by a few bytes)
    storage.janitor.remove_step("job", 1, recycle=True)
    free["bytes"] = reserve + 4 * KiB
    assert needed > 100 * KiB
    save(3)
    assert storage.catalog.committed_steps("job") == [2, 3]
    storage.janitor.remove_step("job", 2, recycle=True)
    free["bytes"] = reserve - 1
    with pytest.raises(NoSpace, match=r"needs 3 MiB \(\d+ B of data \+ 3 MiB reserve; another 1\d\d(\.\d)? KiB reuse recycled files\)"):
        save(4)
    assert len(storage.writing.take_recycled("job")) == len(list((tmp_path / "job" / "step-00000003").glob("*.safetensors")))  # the bin is untouched
    assert not (tmp_path / "job" / "step-00000004").exists()
    pool.close()


def test_a_shared_root_counts_every_nodes_files(tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several nodes writing into one root take the same free space: each counts every node's
    files, less what the nodes that started first have written already."""
    w = torch.randn(64, 256)
    specs = [[TensorSpec("model/w", "model", "F32", (64, 256), Box((16 * r, 0), (16, 256)))] for r in range(4)]
    plan = make_save_plan(specs, node_of_rank=[0, 0, 1, 1])
    storage = Storage(tmp_path)
    node_bytes = 32 * 256 * 4  # each node's half of w
    monkeypatch.setattr(PosixWriting, "free_bytes", lambda self, job: FreeSpace(node_bytes + 4 * KiB, str(self.tree.root)))  # one half fits, not both

    def write(node: int, shared: bool) -> None:
        (shm_dir / f"n{node}").mkdir(exist_ok=True)
        pool = ArenaPool(shm_dir / f"n{node}", "job", max_inflight=1)
        arenas = take_arenas(pool, plan.arena_bytes_of(node))
        _fill(arenas, plan, {"model/w": w}, node)
        try:
            request = PersistRequest("job", 7, plan, arenas, {}, {}, None, 2**30, 2, node=node, shared_dir=shared)
            write_node_files(storage, request, Progress(plan.node_bytes(node)))
        finally:
            pool.close()

    with pytest.raises(NoSpace):
        write(1, shared=True)
    assert not (tmp_path / "job" / "step-00000007").exists()
    write(0, shared=False)  # a root of its own: only node 0's file counts
    write(1, shared=True)  # node 0's file is there already: only node 1's counts now
    assert len(list((tmp_path / "job" / "step-00000007").glob("*.safetensors"))) == 2
