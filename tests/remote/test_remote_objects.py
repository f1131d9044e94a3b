"""The object-store tier's pure parts: locations and keys, which node uploads which file, how each
file is verified (units tiling it), copy signatures, range grouping, and the upload's streaming
check of a local file against its index. No server."""

from __future__ import annotations

import dataclasses
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from ckptd.common.boxes import Box
from ckptd.daemon.handoff.arena import ArenaPool
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FileRecord, FormatError
from ckptd.daemon.plan.save_plan import TensorSpec, make_save_plan
from ckptd.daemon.remote.location import LocationError, RemoteLocation, location_setting, parse_location, parse_step_location
from ckptd.daemon.remote.objects import file_signature, small_files, uploads_of
from ckptd.daemon.remote.store import Stopped
from ckptd.daemon.remote.upload import VerifyingBody
from ckptd.format import units as units_module
from ckptd.daemon.storage import Storage
from ckptd.format.units import Unit, file_units, read_ranges
from ckptd.daemon.write.request import PersistRequest, Progress
from ckptd.daemon.write.writer import persist
from arena_rig import take_arenas  # tests/arena_rig.py

# ------------------------------------------------------------------ locations


@pytest.mark.parametrize(
    ("text", "bucket", "prefix", "url"),
    [
        ("s3://my-bucket", "my-bucket", "", "s3://my-bucket"),
        ("s3://my-bucket/", "my-bucket", "", "s3://my-bucket"),
        ("s3://b.k-t/a/b_c/", "b.k-t", "a/b_c", "s3://b.k-t/a/b_c"),
        ("  s3://bkt/ckpt  ", "bkt", "ckpt", "s3://bkt/ckpt"),
    ],
)
def test_locations_parse_and_normalize(text: str, bucket: str, prefix: str, url: str) -> None:
    location = parse_location(text)
    assert (location.bucket, location.prefix, location.url) == (bucket, prefix, url)
    assert location_setting(text) == url and location_setting("  ") == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("bkt/ckpt", "has no scheme"),
        ("gs://bkt/ckpt", "'gs://' is not supported"),
        ("s3://Bkt/x", "not a valid S3 bucket name"),
        ("s3://ab/x", "not a valid S3 bucket name"),
        ("s3://192.168.1.10/x", "not a valid S3 bucket name"),
        ("s3://bk..t/x", "not a valid S3 bucket name"),
        ("s3://bkt/a//b", "segment ''"),
        ("s3://bkt/a/../b", "segment '..'"),
        ("s3://bkt/a b", "segment 'a b'"),
    ],
)
def test_bad_locations_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(LocationError, match=message):
        parse_location(text)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("s3://bkt/ckpt/a/run-1/step-00000042", (RemoteLocation("bkt", "ckpt/a"), "run-1", 42)),
        ("s3://bkt/run-1/step-00000042/", (RemoteLocation("bkt", ""), "run-1", 42)),
        ("s3://bkt/ckpt/run-1", None),  # a job, not a step
        ("s3://bkt/step-00000042", None),  # no job
        ("s3://bkt/ckpt/-bad/step-00000042", None),  # not a job id
        ("s3://Bkt/run-1/step-00000042", None),  # not a bucket
        ("/root/run-1/step-00000042", None),  # a path
    ],
)
def test_a_step_location_is_the_url_ckptd_ls_shows(text: str, parsed: tuple[RemoteLocation, str, int] | None) -> None:
    if parsed is None:
        with pytest.raises(LocationError):
            parse_step_location(text)
    else:
        location, job, step = parse_step_location(text)
        assert (location, job, step) == parsed and location.url_of(job, step) == text.rstrip("/")


def test_keys_follow_the_on_disk_layout_and_parse_back() -> None:
    location = RemoteLocation("bkt", "ckpt/a")
    key = location.key("run-1", 42, "model-00001-of-00002.safetensors")
    assert key == "ckpt/a/run-1/step-00000042/model-00001-of-00002.safetensors"
    assert location.parse_key(key) == ("run-1", 42, "model-00001-of-00002.safetensors")
    assert location.url_of("run-1", 42) == "s3://bkt/ckpt/a/run-1/step-00000042"
    for foreign in ("ckpt/a/run-1/step-42/x", "ckpt/a/run-1/step-00000042/sub/x", "other/run-1/step-00000042/x", "ckpt/a/-bad/step-00000001/x"):
        assert location.parse_key(foreign) is None, foreign
    assert RemoteLocation("bkt").key("j", 1, INDEX_NAME) == "j/step-00000001/ckptd.index.json"
    with pytest.raises(ValueError):
        location.key("run-1", 1, "../x")
    with pytest.raises(ValueError):
        location.key("run 1", 1, "x")


# ------------------------------------------------------------------ a real step's index


@pytest.fixture
def step(tmp_path: Path) -> Iterator[tuple[Storage, CheckpointIndex]]:
    """A committed step written by the daemon's own writer: model and optimizer tensors, one of
    them sharded across two ranks."""
    tensors = {"model/w": torch.randn(64, 32), "model/b": torch.randn(32), "optimizer/state/w/exp_avg": torch.randn(256, 256)}
    ranks = [
        [TensorSpec(n, n.split("/")[0], "F32", tuple(t.shape), Box.full(tuple(t.shape))) for n, t in tensors.items() if n != "model/w"]
        + [TensorSpec("model/w", "model", "F32", (64, 32), Box((0, 0), (32, 32)))],
        [TensorSpec("model/w", "model", "F32", (64, 32), Box((32, 0), (32, 32)))],
    ]
    plan = make_save_plan(ranks)
    storage = Storage(tmp_path / "root")
    storage.janitor.clean_uncommitted()  # makes the root
    with tempfile.TemporaryDirectory(prefix="ckptd-test-", dir="/dev/shm") as shm:
        pool = ArenaPool(Path(shm), "job", max_inflight=1)
        arenas = take_arenas(pool, plan.arena_bytes)
        for slot in plan.slots:
            data = tensors[slot.name][tuple(slice(o, o + n) for o, n in zip(slot.box.offsets, slot.box.lengths))]
            view = arenas.arenas[slot.rank].view(slot.offset, slot.nbytes)
            np.frombuffer(view, dtype=np.uint8)[:] = data.contiguous().reshape(-1).view(torch.uint8).numpy()
            view.release()
        persist(storage, PersistRequest("job", 7, plan, arenas, {0: {"lr": 0.1}}, {"config.json": b"{}"}, None, 2**30, 2), Progress(plan.total_bytes))
        pool.close()
    yield storage, storage.files.read_index("job", 7)


def test_units_tile_every_data_file_and_match_its_bytes(step: tuple[Storage, CheckpointIndex]) -> None:
    storage, index = step
    units = file_units(index)
    data_files = [f for f in index.files if f.name.endswith(".safetensors")]
    assert data_files and set(units) == {f.name for f in data_files}
    import xxhash

    for record in data_files:
        body = storage.files.read_small("job", 7, record.name)
        assert units[record.name][0].offset == 0 and units[record.name][-1].end == record.size == len(body)
        for unit in units[record.name]:
            assert xxhash.xxh3_64_intdigest(body[unit.offset : unit.end]) == unit.xxh3
    assert {f.name for f in small_files(index, units)} == {f.name for f in index.files if not f.name.endswith(".safetensors")}


def test_large_pieces_are_verified_by_their_chunks(step: tuple[Storage, CheckpointIndex], monkeypatch: pytest.MonkeyPatch) -> None:
    storage, index = step
    monkeypatch.setattr(units_module, "SPLIT_PIECES_ABOVE", 1024)
    units = file_units(index)
    optimizer = next(n for n in units if n.startswith("optimizer-"))
    assert [u.nbytes for u in units[optimizer][1:]] == [64 << 10] * 4  # 256 KiB by its four 64 KiB chunks, still tiling
    import xxhash

    body = storage.files.read_small("job", 7, optimizer)
    assert all(xxhash.xxh3_64_intdigest(body[u.offset : u.end]) == u.xxh3 for u in units[optimizer])


def test_a_copy_of_a_data_file_is_verified_as_its_source(step: tuple[Storage, CheckpointIndex]) -> None:
    _, index = step
    model = next(f for f in index.files if f.name.startswith("model-"))
    with_copy = dataclasses.replace(index, files=index.files + (FileRecord("adapter_model.safetensors", model.size, model.checksum),))
    units = file_units(with_copy)
    assert units["adapter_model.safetensors"] == units[model.name]
    assert file_signature(with_copy.files[-1], units["adapter_model.safetensors"]) == file_signature(model, units[model.name])


def test_a_data_file_the_index_does_not_cover_is_refused(step: tuple[Storage, CheckpointIndex]) -> None:
    _, index = step
    model = next(f for f in index.files if f.name.startswith("model-"))
    longer = dataclasses.replace(index, files=tuple(dataclasses.replace(f, size=f.size + 8) if f is model else f for f in index.files))
    with pytest.raises(FormatError, match="cannot be verified"):
        file_units(longer)
    stranger = dataclasses.replace(index, files=index.files + (FileRecord("other.safetensors", 100, model.checksum),))
    with pytest.raises(FormatError, match="other.safetensors"):
        file_units(stranger)


def test_signatures_tell_identical_files_from_different_ones() -> None:
    record = FileRecord("m.safetensors", 300, "xxh3-64:" + "0" * 16)
    units = (Unit(0, 100, 1), Unit(100, 200, 2))
    assert file_signature(record, units) == file_signature(dataclasses.replace(record, name="other"), units)
    assert file_signature(record, units) != file_signature(record, (Unit(0, 100, 1), Unit(100, 200, 3)))
    assert file_signature(record, units) != file_signature(dataclasses.replace(record, size=301), units)


def test_who_uploads_what() -> None:
    files = (
        FileRecord("model-00001-of-00002.safetensors", 10, "c", 0), FileRecord("model-00002-of-00002.safetensors", 10, "c", 1),
        FileRecord("extra.json", 5, "c", 0), FileRecord("model.safetensors.index.json", 5, "c", 0),
    )
    index = CheckpointIndex("job", 1, 0.0, 2, (), files)
    names = lambda records: [f.name for f in records]  # noqa: E731
    assert names(uploads_of(index, 0, shared_root=False)) == ["model-00001-of-00002.safetensors", "extra.json", "model.safetensors.index.json"]
    assert names(uploads_of(index, 1, shared_root=False)) == ["model-00002-of-00002.safetensors"]
    assert names(uploads_of(index, 0, shared_root=True)) == [f.name for f in files if f.name.endswith(".safetensors")] + ["extra.json", "model.safetensors.index.json"]
    assert uploads_of(index, 1, shared_root=True) == []


def test_ranges_group_consecutive_units() -> None:
    units = [Unit(0, 10, 0), Unit(10, 50, 0), Unit(60, 100, 0), Unit(160, 5, 0)]
    assert [(a, b) for a, b, _ in read_ranges(units, 64)] == [(0, 60), (60, 160), (160, 165)]
    assert [(a, b) for a, b, _ in read_ranges(units, 1000)] == [(0, 165)]
    assert read_ranges([], 10) == []


# ------------------------------------------------------------------ the upload's streaming check


class _Handle:
    def __init__(self, data: bytes) -> None:
        self.data, self.size = data, len(data)

    def pread(self, nbytes: int, offset: int) -> bytes:
        return self.data[offset : offset + nbytes]

    def close(self) -> None: ...

    def __enter__(self) -> "_Handle":
        return self

    def __exit__(self, *exc: object) -> None: ...


def test_an_upload_checks_every_byte_it_reads(step: tuple[Storage, CheckpointIndex]) -> None:
    storage, index = step
    units = file_units(index)
    model = next(f for f in index.files if f.name.startswith("model-"))
    good = storage.files.read_small("job", 7, model.name)
    stop = threading.Event()

    def read_all(data: bytes, part: int = 1000) -> VerifyingBody:
        body = VerifyingBody(_Handle(data), len(data), units[model.name], model.name, stop)  # type: ignore[arg-type]
        body.seek(0, 2)
        body.seek(0)
        while body.read(part):
            pass
        return body

    assert read_all(good).problem() is None
    damaged = bytearray(good)
    damaged[-3] ^= 0x40
    problem = read_all(bytes(damaged)).problem()
    assert problem is not None and "do not match their checksum" in problem
    again = read_all(bytes(damaged))
    again.seek(0)  # read once more from the start (a retried body): checked afresh
    data = good
    again._handle = _Handle(data)  # type: ignore[attr-defined]
    while again.read(4096):
        pass
    assert again.problem() is None
    skipping = VerifyingBody(_Handle(good), len(good), units[model.name], model.name, stop)  # type: ignore[arg-type]
    skipping.seek(100)
    while skipping.read(1000):
        pass
    assert "not read in order" in (skipping.problem() or "")
    stop.set()
    with pytest.raises(Stopped, match="stopped"):
        read_all(good)
