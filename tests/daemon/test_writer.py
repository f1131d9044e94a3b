"""The writer: a snapshot from real shared-memory arenas to a storage backend, without a server.

The writer tests run against both backends: POSIX (Storage, real files) and the in-memory test
double (tests/memory_backend.py), which enforces the protocol's rules (a part invisible until
published, every byte up to its final size written, ranges checked)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_bytes

from ckptd.common.boxes import Box
from ckptd.daemon.handoff.arena import ArenaPool
from ckptd.format.index import INDEX_NAME
from ckptd.daemon.plan.files import commit_time
from ckptd.daemon.plan.save_plan import TensorSpec, make_save_plan
from ckptd.daemon.storage import Storage, StorageBackend
from ckptd.daemon.tools.verify import verify_files
from ckptd.daemon.write.request import PersistRequest, Progress
from ckptd.daemon.write.writer import persist
from arena_rig import take_arenas  # tests/arena_rig.py
from memory_backend import MemoryStorage


@pytest.fixture(params=["posix", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> StorageBackend:
    """A fresh storage: POSIX under tmp_path, or in memory."""
    return Storage(tmp_path) if request.param == "posix" else MemoryStorage()


def _load(storage: StorageBackend, job: str, step: int, name: str) -> dict[str, torch.Tensor]:
    """A stored safetensors file's tensors, read through the backend."""
    return load_bytes(storage.files.read_small(job, step, name))


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ckptd-test-", dir="/dev/shm") as d:
        yield Path(d)


def _fill(pool_set, plan, tensors: dict[str, torch.Tensor]) -> None:
    for slot in plan.slots:
        data = tensors[slot.name][tuple(slice(o, o + n) for o, n in zip(slot.box.offsets, slot.box.lengths))]
        raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        view = pool_set.arenas[slot.rank].view(slot.offset, slot.nbytes)
        np.frombuffer(view, dtype=np.uint8)[:] = raw
        view.release()


def test_fragments_of_two_ranks_are_written_whole_and_loadable(backend: StorageBackend, shm_dir: Path) -> None:
    w = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    b = torch.arange(8, dtype=torch.bfloat16)
    col = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    tensors = {"model/w": w, "model/b": b, "optimizer/state/w/exp_avg": col}
    rank0 = [
        TensorSpec("model/w", "model", "F32", (6, 8), Box((0, 0), (3, 8))),
        TensorSpec("model/b", "model", "BF16", (8,), Box.full((8,))),
        TensorSpec("optimizer/state/w/exp_avg", "optimizer", "I64", (3, 4), Box((0, 0), (3, 2))),
    ]
    rank1 = [
        TensorSpec("model/w", "model", "F32", (6, 8), Box((3, 0), (3, 8))),
        TensorSpec("model/b", "model", "BF16", (8,), Box.full((8,))),
        TensorSpec("optimizer/state/w/exp_avg", "optimizer", "I64", (3, 4), Box((0, 2), (3, 2))),
    ]
    plan = make_save_plan([rank0, rank1])
    pool = ArenaPool(shm_dir, "job", max_inflight=2)
    arenas = take_arenas(pool, plan.arena_bytes)
    assert arenas is not None
    _fill(arenas, plan, tensors)
    storage = backend
    progress = Progress(plan.total_bytes)
    request = PersistRequest("job", 3, plan, arenas, {0: {"a": 1}, 1: {"a": 2}}, {"config.json": b"{}"}, None, 2**30, 2)
    index = persist(storage, request, progress)
    pool.close()

    model = _load(storage, "job", 3, "model-00001-of-00001.safetensors")
    assert torch.equal(model["w"], w) and torch.equal(model["b"], b)
    optim = _load(storage, "job", 3, "optimizer-00001-of-00001.safetensors")
    assert torch.equal(optim["optimizer/state/w/exp_avg"], col)
    assert progress.written == plan.total_bytes
    assert storage.files.read_index("job", 3) == index
    assert json.loads(storage.files.read_small("job", 3, "extra.json"))["ranks"] == {"0": {"a": 1}, "1": {"a": 2}}
    assert storage.catalog.latest_named("job") == 3
    assert storage.files.read_small("job", 3, "config.json") == b"{}"
    assert sorted(storage.files.step_file_sizes("job", 3)) == sorted([f.name for f in index.files] + [INDEX_NAME])
    assert storage.catalog.committed_steps("job") == [3]
    report = verify_files(storage.files.step_reader("job", 3))  # the index read back through the backend, every byte checked
    assert report.ok and report.notes == (), report.problems


def test_a_failed_write_leaves_no_step(backend: StorageBackend, shm_dir: Path) -> None:
    plan = make_save_plan([[TensorSpec("model/w", "model", "F32", (4,), Box.full((4,)))]])
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    arenas.arenas[0].close()  # the data vanished: writing must fail
    storage = backend
    with pytest.raises(Exception):  # noqa: B017  any error will do: the point is that nothing is committed
        persist(storage, PersistRequest("job", 1, plan, arenas, {}, {}, None, 2**30, 1), Progress(16))
    assert storage.files.step_file_sizes("job", 1) == {} and storage.catalog.step_bytes("job", 1) == 0
    assert storage.catalog.committed_steps("job") == []


def test_a_failed_coded_write_leaves_no_step_and_no_open_file(
    backend: StorageBackend, tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills up while quantized codes are written: persist raises the OSError, every
    job has stopped and every descriptor is closed before it returns, and no step is left."""
    import errno

    from ckptd.daemon.write import writer

    specs = [TensorSpec(f"optimizer/state/w{i}/exp_avg", "optimizer", "F32", (64, 128), Box.full((64, 128))) for i in range(6)]
    specs.append(TensorSpec("model/w", "model", "F32", (64, 128), Box.full((64, 128))))
    plan = make_save_plan([specs])
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    _fill(arenas, plan, {s.name: torch.randn(64, 128) for s in specs})

    def full_disk(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "_write_bytes", full_disk)
    storage = backend
    with pytest.raises(OSError, match="No space left"):
        persist(storage, PersistRequest("job", 1, plan, arenas, {}, {}, None, 2**30, 3, quantize="O1"), Progress(plan.total_bytes))
    assert _open_files_under(tmp_path) == []  # (counting all fds is flaky: other tests' threads open and close theirs)
    assert storage.files.step_file_sizes("job", 1) == {}
    assert storage.catalog.committed_steps("job") == []
    pool.close()


@pytest.mark.parametrize("quantize, master_weights", [("O1", "residual"), ("O2", "drop")])
def test_progress_of_a_compressed_save_reaches_the_snapshot_bytes(
    backend: StorageBackend, shm_dir: Path, quantize: str, master_weights: str
) -> None:
    """Progress counts the snapshot's bytes (what WaitDurable reports against plan.total_bytes),
    not the smaller coded bytes: a compressed save ends at 100%, one whose tensor falls back to
    lossless (a nan) too."""
    tensors = {
        "model/w": torch.randn(64, 128).to(torch.bfloat16),
        "master/w": torch.randn(64, 128),
        "optimizer/state/w/exp_avg": torch.randn(64, 128),
        "optimizer/state/w/exp_avg_sq": torch.rand(64, 128),
        "optimizer/state/v/exp_avg": torch.randn(64, 128),
    }
    tensors["optimizer/state/v/exp_avg"][3, 3] = float("nan")
    dtype = {torch.float32: "F32", torch.bfloat16: "BF16"}
    specs = [TensorSpec(n, n.split("/")[0], dtype[t.dtype], tuple(t.shape), Box.full(tuple(t.shape))) for n, t in tensors.items()]
    plan = make_save_plan([specs])
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    _fill(arenas, plan, tensors)
    progress = Progress(plan.total_bytes)
    request = PersistRequest("job", 1, plan, arenas, {}, {}, None, 2**30, 2, quantize=quantize, master_weights=master_weights)
    index = persist(backend, request, progress)
    pool.close()
    assert verify_files(backend.files.step_reader("job", 1)).ok  # codes, scales, frames and residuals as the index records them
    assert {t.name: [f.quant.codec if f.quant else None for f in t.fragments] for t in index.tensors}["master/w"] == [
        "residual-bf16" if master_weights == "residual" else "cast"
    ]
    assert progress.written == plan.total_bytes


def test_clean_uncommitted_removes_crash_leftovers(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    half = tmp_path / "job" / "step-00000002"
    half.mkdir(parents=True)
    (half / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    done = tmp_path / "job" / "step-00000001"
    done.mkdir()
    (done / INDEX_NAME).write_text("{}")
    (done / ".tmp-x.1").write_text("")
    (tmp_path / "job" / "latest").write_text("step-00000002\n")
    removed = storage.janitor.clean_uncommitted()
    assert str(half) in [left.where for left in removed] and not half.exists() and not (done / ".tmp-x.1").exists()
    assert (tmp_path / "job" / "latest").read_text() == "step-00000001\n"


def test_arena_pool_reuses_and_bounds_sets(shm_dir: Path) -> None:
    pool = ArenaPool(shm_dir, "job", max_inflight=2)
    a = take_arenas(pool, (8192, 4096))
    b = take_arenas(pool, (8192, 4096))
    assert a is not b and take_arenas(pool, (8192, 4096)) is None  # both in use: the caller waits or skips
    pool.hold(a, 1, None, {})
    c = take_arenas(pool, (8192, 4096))
    assert c is a  # a committed snapshot in memory is given up before a new allocation is refused
    names = sorted(p.name for p in shm_dir.iterdir())
    assert len(names) == 4 and all(n.startswith(f"ckptd-{os.getpid()}-job-") for n in names)
    pool.release(b)
    d = take_arenas(pool, (2 * 8192, 4096))  # grows
    assert d is b and d.arenas[0].size == 2 * 8192
    pool.close()
    assert list(shm_dir.iterdir()) == []


def test_retention_recycles_data_files_into_the_next_save(backend: StorageBackend, tmp_path: Path, shm_dir: Path) -> None:
    specs = [TensorSpec(f"model/w{i}", "model", "F32", (1000 * (i + 1),), Box.full((1000 * (i + 1),))) for i in range(3)]
    plan = make_save_plan([specs])
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    tensors = {s.name: torch.randn(s.shape) for s in specs}
    _fill(arenas, plan, tensors)
    storage = backend

    def save(step: int, max_file_bytes: int) -> None:
        persist(storage, PersistRequest("job", step, plan, arenas, {}, {}, None, max_file_bytes, 2), Progress(plan.total_bytes))

    save(1, 8000)  # three model files
    old_inodes = {p.stat().st_ino for p in (tmp_path / "job" / "step-00000001").glob("*.safetensors")}
    storage.janitor.remove_step("job", 1, recycle=True)
    assert len(storage.writing.take_recycled("job")) == 3 and not storage.catalog.is_committed("job", 1) and storage.files.step_file_sizes("job", 1) == {}
    largest = storage.writing.take_recycled("job")[0].key
    save(2, 2**30)  # one bigger file: made from the largest recycled one
    if isinstance(storage, Storage):
        assert (tmp_path / "job" / "step-00000002" / "model-00001-of-00001.safetensors").stat().st_ino in old_inodes
    else:
        assert all(r.key != largest for r in storage.writing.take_recycled("job"))
    assert len(storage.writing.take_recycled("job")) == 2
    loaded = _load(storage, "job", 2, "model-00001-of-00001.safetensors")
    assert all(torch.equal(loaded[n.split("/", 1)[1]], t) for n, t in tensors.items())
    pool.close()


@pytest.mark.parametrize(
    ("now", "after", "expected"),
    [(100.0, None, 100.0), (100.0, 50.0, 100.0), (40.0, 50.0, 50.001), (50.0, 50.0, 50.001), (40.0, float("nan"), 40.0)],
)
def test_a_commit_time_is_after_the_jobs_newest_whatever_the_clock(now: float, after: float | None, expected: float) -> None:
    assert commit_time(now, after) == pytest.approx(expected, abs=1e-9)


def test_a_clock_stepped_back_commits_the_next_step_as_the_newest(backend: StorageBackend, shm_dir: Path) -> None:
    """NTP or a restored VM sets the clock back a minute between two saves: the step committed
    after it is still the newest (latest_step, the last of commit_order), never the one retention
    takes for the oldest."""
    specs = [TensorSpec("model/w", "model", "F32", (64,), Box.full((64,)))]
    plan = make_save_plan([specs])
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    _fill(arenas, plan, {"model/w": torch.randn(64)})
    for step, now in [(1, 1000.0), (2, 1001.0), (3, 1002.0), (4, 942.0), (5, 943.0)]:
        persist(backend, PersistRequest("job", step, plan, arenas, {}, {}, None, 2**30, 1), Progress(plan.total_bytes), clock=lambda: now)
    assert backend.catalog.commit_order("job") == [1, 2, 3, 4, 5]
    assert backend.catalog.latest_step("job") == 5
    created = [backend.files.read_index("job", step).created_at for step in (3, 4, 5)]
    assert created[0] < created[1] < created[2]
    pool.close()


def test_two_nodes_write_their_fragments_and_the_commit_covers_every_tensor(backend: StorageBackend, shm_dir: Path) -> None:
    from ckptd.daemon.plan.files import IncompleteStep, step_files
    from ckptd.daemon.storage.step_commit import StepCommit
    from ckptd.daemon.write.writer import write_node_files

    w = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    b = torch.arange(6, dtype=torch.float32)
    specs = [
        [TensorSpec("model/w", "model", "F32", (8, 4), Box((2 * r, 0), (2, 4))), TensorSpec("model/b", "model", "F32", (6,), Box.full((6,)))]
        for r in range(4)
    ]
    plan = make_save_plan(specs, node_of_rank=[0, 0, 1, 1])  # w sharded over both nodes (FSDP)
    storage = backend  # one root shared by both "nodes"
    manifests = []
    for node in (0, 1):
        pool = ArenaPool(shm_dir / f"n{node}", "job", max_inflight=1)
        (shm_dir / f"n{node}").mkdir()
        arenas = take_arenas(pool, plan.arena_bytes_of(node))
        assert arenas is not None
        _fill_node(arenas, plan, {"model/w": w, "model/b": b}, node)
        request = PersistRequest("job", 7, plan, arenas, {}, {}, None, 2**30, 2, node=node, shared_dir=True)
        manifests.append(write_node_files(storage, request, Progress(plan.node_bytes(node))))
        pool.close()
    assert not storage.catalog.is_committed("job", 7)  # data files alone commit nothing
    with pytest.raises(IncompleteStep, match="model/w"):
        step_files("job", 7, plan, manifests[:1], {}, {}, None)
    index, files = step_files("job", 7, plan, manifests, {0: {}}, {}, None)
    assert list(files)[-1] == INDEX_NAME
    StepCommit(storage.writing, storage.catalog, "job", 7).publish(files)
    assert storage.catalog.is_committed("job", 7)
    record = index.by_name()["model/w"]
    assert [f.file for f in record.fragments] == ["model-00001-of-00002.safetensors"] * 2 + ["model-00002-of-00002.safetensors"] * 2
    assert {f.node for f in index.files if f.name.startswith("model-")} == {0, 1}
    stored = {**_load(storage, "job", 7, "model-00001-of-00002.safetensors"), **_load(storage, "job", 7, "model-00002-of-00002.safetensors")}
    assert torch.equal(torch.cat([stored[f"w@{2 * r},0"] for r in range(4)]), w) and torch.equal(stored["b"], b)
    assert "model.safetensors.index.json" not in storage.files.step_file_sizes("job", 7)  # not HF-loadable until exported
    assert verify_files(storage.files.step_reader("job", 7)).ok


def _fill_node(arenas, plan, tensors: dict[str, torch.Tensor], node: int) -> None:
    for slot in plan.slots:
        if plan.node(slot.rank) != node:
            continue
        data = tensors[slot.name][tuple(slice(o, o + n) for o, n in zip(slot.box.offsets, slot.box.lengths))]
        view = arenas.arenas[slot.rank].view(slot.offset, slot.nbytes)
        np.frombuffer(view, dtype=np.uint8)[:] = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        view.release()


def test_every_tensor_byte_written_has_its_writeback_started(backend: StorageBackend, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, int, int]] = []
    real_open = backend.writing.open_part

    def open_part(*args: object, **kwargs: object) -> object:
        part = real_open(*args, **kwargs)  # type: ignore[arg-type]
        real_hint = part.start_writeback

        def hint(offset: int, nbytes: int) -> bool:
            started.append((part.name, offset, nbytes))
            return real_hint(offset, nbytes)

        part.start_writeback = hint  # type: ignore[method-assign]
        return part

    monkeypatch.setattr(backend.writing, "open_part", open_part)
    tensors = {"model/w": torch.randn(64, 1024), "optimizer/state/w/exp_avg": torch.randn(64, 1024), "model/b": torch.randn(8)}
    plan = make_save_plan([[TensorSpec(name, name.split("/")[0], "F32", tuple(t.shape), Box.full(tuple(t.shape))) for name, t in tensors.items()]])
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    _fill(arenas, plan, tensors)
    index = persist(backend, PersistRequest("job", 1, plan, arenas, {}, {}, None, 2**30, 2), Progress(plan.total_bytes))
    pool.close()
    assert {name for name, _, _ in started} == {f.name for f in index.files if f.name.endswith(".safetensors")}
    assert sum(n for _, _, n in started) == plan.total_bytes  # every tensor byte, once


def _open_files_under(root: Path) -> list[str]:
    """Paths under `root` that this process has open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith(str(root)):
            found.append(target)
    return found


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 65535, 65536, 65537, 3 * 65536 + 5, 5 << 20])
def test_tensor_digests_are_those_of_a_whole_hash_and_a_chunk_hasher(nbytes: int) -> None:
    """A tensor of one chunk is hashed once: its digests are still exactly what the index format
    says (xxh3-64 of the bytes, and of each chunk)."""
    import xxhash

    from ckptd.common.chunks import ChunkHasher, chunk_bytes_for
    from ckptd.daemon.write.digests import TensorDigests

    data = memoryview(np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    digest = TensorDigests(nbytes)
    chunks = ChunkHasher(chunk_bytes_for(nbytes))
    for begin in range(0, nbytes, 40_000):  # pieces that do not fall on chunk boundaries
        digest.update(data[begin : begin + 40_000])
        chunks.update(data[begin : begin + 40_000])
    assert digest.result() == (xxhash.xxh3_64_intdigest(data), chunks.hexdigests())


def _item(nbytes: int, residual: bool = False) -> object:
    from ckptd.daemon.plan.files import Coding
    from ckptd.daemon.plan.node_files import FileItem, TensorBytes
    from ckptd.format.index import StoredTensor

    t = StoredTensor("model/w", "w", "U8", (nbytes,), Box.full((nbytes,)), 0)
    return FileItem(t, 0, TensorBytes("U8", (nbytes,), ()), Coding(model=t) if residual else None)


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([], []),
        ([1, 2, 3], [[1, 2, 3]]),  # small tensors: one job
        ([5 << 20, 5 << 20, 1], [[5 << 20], [5 << 20, 1]]),  # a batch closes before it passes BATCH_BYTES
        ([1, 8 << 20, 1], [[1], [8 << 20], [1]]),  # a tensor of BATCH_BYTES alone
        ([20 << 20], [[20 << 20]]),
        ([1, "r", 2, 3], [[1], ["r"], [2, 3]]),  # a residual alone, where it is; the batch before it closed
    ],
)
def test_write_batches_group_consecutive_small_tensors(sizes: list, expected: list) -> None:
    from ckptd.daemon.write.writer import BATCH_BYTES, write_batches

    assert BATCH_BYTES == 8 << 20
    items = [_item(8, residual=True) if s == "r" else _item(s) for s in sizes]
    batches = write_batches(items)  # type: ignore[arg-type]
    assert [[("r" if i.coding is not None else i.tensor.nbytes) for i in b] for b in batches] == expected
    assert [i for b in batches for i in b] == items  # every tensor once, in file order


def test_pwritev_all_writes_every_byte_after_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.pwritev may write less than asked (here 5 bytes at a time): the rest is written again."""
    from ckptd.daemon.storage import fs

    real = os.pwritev
    monkeypatch.setattr(fs.os, "pwritev", lambda fd, views, offset: real(fd, [bytes(b"".join(bytes(v) for v in views)[:5])], offset))
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fs.pwritev_all(fd, [memoryview(b"abc"), memoryview(b""), memoryview(b"defghij"), memoryview(b"k")], 2)
        assert os.pread(fd, 100, 0) == b"\0\0abcdefghijk"
    finally:
        os.close(fd)


def test_many_small_tensors_are_written_in_few_writes_and_writeback_starts(
    backend: StorageBackend, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 tensors of 4 KiB in one file (arena order is not file order: keys sort as text):
    a handful of writes and writeback starts, every byte's writeback started once, the
    tensors' bytes and checksums those of the snapshot (verify_files reads every byte)."""
    calls: dict[str, int] = {"pwrite": 0, "pwritev": 0}
    started: list[tuple[int, int]] = []
    real_open = backend.writing.open_part

    def open_part(*args: object, **kwargs: object) -> object:
        part = real_open(*args, **kwargs)  # type: ignore[arg-type]
        real_pwrite, real_pwritev, real_hint = part.pwrite, part.pwritev, part.start_writeback

        def pwrite(offset: int, view: memoryview) -> None:
            calls["pwrite"] += 1
            real_pwrite(offset, view)

        def pwritev(offset: int, views: list[memoryview]) -> None:
            calls["pwritev"] += 1
            real_pwritev(offset, views)

        def hint(offset: int, nbytes: int) -> bool:
            started.append((offset, nbytes))
            return real_hint(offset, nbytes)

        part.pwrite, part.pwritev, part.start_writeback = pwrite, pwritev, hint  # type: ignore[method-assign]
        return part

    monkeypatch.setattr(backend.writing, "open_part", open_part)
    tensors = {f"model/t{i}": torch.randn(1024) for i in range(1000)}
    plan = make_save_plan([[TensorSpec(name, "model", "F32", (1024,), Box.full((1024,))) for name in tensors]])
    pool = ArenaPool(shm_dir, "job", max_inflight=1)
    arenas = take_arenas(pool, plan.arena_bytes)
    _fill(arenas, plan, tensors)
    index = persist(backend, PersistRequest("job", 1, plan, arenas, {}, {}, None, 2**30, 3), Progress(plan.total_bytes))
    pool.close()
    assert calls["pwrite"] + calls["pwritev"] <= 8  # the header, then 4 MiB in slices of 1 MiB
    assert len(started) == 1 and sum(n for _, n in started) == plan.total_bytes
    loaded = _load(backend, "job", 1, "model-00001-of-00001.safetensors")
    assert all(torch.equal(loaded[name.split("/", 1)[1]], t) for name, t in tensors.items())
    report = verify_files(backend.files.step_reader("job", 1))
    assert report.ok, report.problems
    assert len(index.tensors) == 1000


def test_a_settled_progress_counts_the_files_bytes_in_every_field() -> None:
    """Review of d77c003: once the files were written, `written` counted their bytes while `total`
    still counted the snapshot's: a compressed step's finished save read 47 KiB of 165 (the figures the probe reported)."""
    progress = Progress(165_128)
    progress.add(165_128)
    progress.settle(47_490, 1_024)
    assert (progress.written, progress.linked, progress.total) == (47_490, 1_024, 48_514)
