"""storage/step_commit.py: the commit rule of a step, in the order of the calls it makes."""

from __future__ import annotations

import pytest

from ckptd.format.index import INDEX_NAME
from ckptd.daemon.storage.base import FreeSpace, PartWriter, RecycledFile
from ckptd.daemon.storage.step_commit import DATA, INDEX, SMALL, Latest, StepCommit, publish_rank


class Recorder:
    """The StepWriting and StepCatalog calls a StepCommit makes, in order (only those it may make)."""

    def __init__(self, newest: int | None) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.newest = newest

    def ensure_step(self, job: str, step: int) -> None:
        self.calls.append(("ensure", step))

    def sync_step(self, job: str, step: int) -> None:
        self.calls.append(("sync", step))

    def write_small(self, job: str, step: int, name: str, data: bytes, atomic: bool = True) -> None:
        self.calls.append(("small", name, atomic))

    def write_latest(self, job: str, step: int) -> None:
        self.calls.append(("latest", step))

    def latest_step(self, job: str) -> int | None:
        return self.newest

    # the rest of the two protocols: never called by a commit
    def prepare_step(self, job: str, step: int, fresh: bool = True) -> None:
        raise AssertionError("not a commit's")

    def take_recycled(self, job: str) -> list[RecycledFile]:
        raise AssertionError("not a commit's")

    def open_part(self, job: str, step: int, name: str, size: int, recycled: RecycledFile | None = None) -> PartWriter:
        raise AssertionError("not a commit's")

    def link_file(self, job: str, from_step: int, name: str, to_step: int, to_name: str, size: int) -> bool:
        raise AssertionError("not a commit's")

    def free_bytes(self, job: str) -> FreeSpace | None:
        raise AssertionError("not a commit's")

    def allocated_in_step(self, job: str, step: int) -> dict[str, int]:
        raise AssertionError("not a commit's")

    def step_location(self, job: str, step: int) -> str:
        raise AssertionError("not a commit's")

    def jobs(self) -> list[str]:
        raise AssertionError("not a commit's")

    def root_id(self) -> str:
        raise AssertionError("not a commit's")

    def is_committed(self, job: str, step: int) -> bool:
        raise AssertionError("not a commit's")

    def committed_steps(self, job: str) -> list[int]:
        raise AssertionError("not a commit's")

    def commit_order(self, job: str) -> list[int]:
        raise AssertionError("not a commit's")

    def latest_named(self, job: str) -> int | None:
        raise AssertionError("not a commit's")

    def step_bytes(self, job: str, step: int) -> int:
        raise AssertionError("not a commit's")


@pytest.mark.parametrize(
    ("name", "rank"),
    [("model-00001-of-00002.safetensors", DATA), ("adapter_model.safetensors", DATA), ("extra.json", SMALL),
     ("adapter_config.json", SMALL), (INDEX_NAME, INDEX)],
)
def test_publish_rank_puts_data_files_first_and_the_index_last(name: str, rank: int) -> None:
    assert publish_rank(name) == rank


@pytest.mark.parametrize(
    ("latest", "newest", "named"),
    [("this", None, 5), ("this", 9, 5), ("newest", 9, 9), ("newest", None, 5)],
)
def test_a_commit_writes_small_files_syncs_then_the_index_then_latest(latest: Latest, newest: int | None, named: int) -> None:
    storage = Recorder(newest)
    files = {INDEX_NAME: b"{}", "extra.json": b"{}", "config.json": b"{}"}  # the index first in the mapping: still last
    StepCommit(storage, storage, "job", 5).commit(files, latest)
    assert storage.calls == [
        ("ensure", 5), ("small", "extra.json", False), ("small", "config.json", False), ("sync", 5), ("small", INDEX_NAME, True), ("latest", named),
    ]


def test_publish_alone_leaves_latest_and_parts_published_is_one_sync() -> None:
    storage = Recorder(None)
    commit = StepCommit(storage, storage, "job", 2)
    commit.parts_published()
    commit.publish({INDEX_NAME: b"{}"})
    assert storage.calls == [("sync", 2), ("ensure", 2), ("sync", 2), ("small", INDEX_NAME, True)]


def test_a_commit_without_an_index_writes_nothing() -> None:
    storage = Recorder(None)
    with pytest.raises(KeyError):
        StepCommit(storage, storage, "job", 2).commit({"extra.json": b"{}"})
    assert storage.calls == []
