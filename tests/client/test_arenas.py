"""ArenaMaps: an arena is mapped once while its path names the same file, and anew when the
path names another (a daemon restarted under the same pid reuses its earlier run's names)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from ckptd.client.arenas import ArenaMaps


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ckptd-test-", dir="/dev/shm") as d:
        yield Path(d)


def _arena(shm_dir: Path, fill: bytes, size: int = 8192) -> str:
    path = shm_dir / "ckptd-1-job-s0-g1-r0"
    path.write_bytes(fill * size)
    return str(path)


def test_the_same_file_keeps_its_mapping_and_a_new_file_under_its_name_gets_its_own(shm_dir: Path) -> None:
    maps = ArenaMaps()
    path = _arena(shm_dir, b"a")
    first = maps.get(path)
    assert maps.get(path, 8192) is first and maps.address(path) == maps.address(path)
    os.unlink(path)
    _arena(shm_dir, b"b")  # the restarted daemon's arena: same name, same size, another file
    second = maps.get(path, 8192)
    assert second is not first and second[:4] == b"bbbb"
    second[:4] = b"cccc"  # a save's copy lands in the file the daemon reads
    assert Path(path).read_bytes()[:4] == b"cccc"
    maps.close()


def test_an_arena_gone_is_not_served_from_its_old_mapping(shm_dir: Path) -> None:
    maps = ArenaMaps()
    path = _arena(shm_dir, b"a")
    maps.get(path)
    os.unlink(path)
    with pytest.raises(FileNotFoundError):
        maps.get(path)
    maps.close()


def test_the_arenas_of_sixteen_local_ranks_stay_mapped_and_removed_ones_are_dropped(shm_dir: Path) -> None:
    """A load from the held snapshot of 16 local ranks maps 16 arenas (and the rank's own): with
    at most 8 mappings kept, the copy plan's addresses never stayed valid and every such load
    fell back to the per-piece fill, mapping the arenas again each time. Up to MAX_MAPPINGS stay;
    the mapping of an arena the daemon removed goes when the next arena is mapped."""
    from ckptd.client.arenas import MAX_MAPPINGS

    maps = ArenaMaps()
    paths = []
    for rank in range(18):
        path = shm_dir / f"ckptd-1-job-s0-g1-r{rank}"
        path.write_bytes(bytes([rank]) * 8192)
        paths.append(str(path))
    addresses = [maps.address(p, 8192) for p in paths]
    assert [maps.address(p, 8192) for p in paths] == addresses  # none unmapped and mapped again
    gone = maps.get(paths[3])
    os.unlink(paths[3])
    extra = shm_dir / "ckptd-1-job-s1-g1-r0"
    extra.write_bytes(b"x" * 8192)
    maps.get(str(extra))
    assert gone.closed and maps.address(paths[4], 8192) == addresses[4]
    oldest = maps.get(paths[0])
    for i in range(MAX_MAPPINGS):  # beyond the bound: the oldest go
        more = shm_dir / f"ckptd-1-other-s0-g1-r{i}"
        more.write_bytes(b"y" * 4096)
        maps.get(str(more))
    assert oldest.closed
    maps.close()
