"""Which staged pieces a rank copies without checking them again (engine/staging.py, issue 34):
only ranges a tier marked checked, while the marks last (a range staged again, or its file
removed, is unmarked), and never a decoded piece or one that is not a staged file's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.common.boxes import Box
from ckptd.daemon.engine.staging import StagingFiles
from ckptd.format.file_plan import CHECKED_SOURCE, FILE_SOURCE, SHM_SOURCE, DecodeInfo, PieceInfo

FILE = "model-00001-of-00002.safetensors"


def piece(path: str, offset: int, source: str = FILE_SOURCE, decode: DecodeInfo | None = None) -> PieceInfo:
    return PieceInfo("w", source, path, offset, 64, Box((0,), (16,)), "F32", "xxh3-64:0", decode=decode)


@pytest.fixture
def staging(tmp_path: Path) -> StagingFiles:
    files = StagingFiles(tmp_path)
    os.close(files.open(str(files.path("job", 1, FILE))))
    return files


@pytest.mark.parametrize(
    ("marked", "asked", "expected"),
    [
        ([], piece("S", 100), FILE_SOURCE),  # nothing marked: the rank checks
        ([100], piece("S", 100), CHECKED_SOURCE),
        ([100], piece("S", 164), FILE_SOURCE),  # another range of the same file
        ([100], piece("other", 100), FILE_SOURCE),  # another file (the root's, read in place)
        ([100], piece("S", 100, SHM_SOURCE), SHM_SOURCE),  # an arena's: as it was
        ([100], piece("S", 100, decode=DecodeInfo("int8", 64, None, None)), FILE_SOURCE),  # decoded: the rank reads it as a file
    ],
)
def test_a_piece_is_handed_as_checked_only_where_its_staged_range_was_marked(
    staging: StagingFiles, marked: list[int], asked: PieceInfo, expected: str
) -> None:
    path = str(staging.path("job", 1, FILE))
    for offset in marked:
        staging.mark_checked(path, offset)
    asked = asked._replace(path=path if asked.path == "S" else asked.path)
    (got,) = staging.checked_pieces([asked])
    assert got.source == expected and got._replace(source=asked.source) == asked


def test_a_mark_ends_when_the_range_is_staged_again_or_the_file_is_removed(staging: StagingFiles) -> None:
    path = str(staging.path("job", 1, FILE))
    staging.mark_checked(path, 100)
    staging.unmark(path, 100)  # staged again (a disk fallback writes it unchecked)
    assert staging.checked_pieces([piece(path, 100)])[0].source == FILE_SOURCE
    staging.mark_checked(path, 100)
    detached = staging.detach(Path(path))  # released: renamed at once, freed later
    assert detached is not None
    staging.free(detached)
    os.close(staging.open(path))  # the same name made again: its ranges are new
    assert staging.checked_pieces([piece(path, 100)])[0].source == FILE_SOURCE


def test_a_file_staged_whole_hands_every_range_checked_until_a_range_is_staged_again(staging: StagingFiles) -> None:
    path = str(staging.path("job", 1, FILE))
    staging.mark_whole(path)  # a prefetch staged the file whole, every byte checked (engine/loads.py)
    assert [p.source for p in staging.checked_pieces([piece(path, 0), piece(path, 4096)])] == [CHECKED_SOURCE, CHECKED_SOURCE]
    staging.unmark(path, 4096)  # a load stages a range again (the prefetch failed): the rank checks the file
    assert [p.source for p in staging.checked_pieces([piece(path, 0), piece(path, 4096)])] == [FILE_SOURCE, FILE_SOURCE]
    staging.mark_whole(path)
    staging.detach(Path(path))
    os.close(staging.open(path))
    assert staging.checked_pieces([piece(path, 0)])[0].source == FILE_SOURCE
    other = str(staging.path("job", 2, FILE))  # never made here: never whole
    staging.mark_whole(other)
    assert staging.checked_pieces([piece(other, 0)])[0].source == FILE_SOURCE


def test_a_file_this_daemon_did_not_make_is_never_marked(staging: StagingFiles) -> None:
    other = str(staging.path("job", 2, FILE))
    staging.mark_checked(other, 0)
    assert staging.checked_pieces([piece(other, 0)])[0].source == FILE_SOURCE


def test_a_detached_staging_file_frees_its_name_at_once_and_is_unlinked_later(staging: StagingFiles, tmp_path: Path) -> None:
    path = staging.path("job", 1, FILE)
    staging.mark_checked(str(path), 100)
    detached = staging.detach(path)
    assert detached is not None and detached.exists() and not path.exists()
    assert detached.name.startswith(path.name.split("-fetch-")[0])  # the daemon's pid: removed after a crash
    os.close(staging.open(str(path)))  # a next load makes the name again, unmarked
    assert staging.checked_pieces([piece(str(path), 100)])[0].source == FILE_SOURCE
    staging.free(detached)  # (off the event loop: freeing the pages takes time)
    assert not detached.exists() and path.exists()
    again = staging.detach(path)
    assert again is not None and again != detached
    staging.close()  # shutdown: detached files not yet freed go too
    assert sorted(tmp_path.iterdir()) == []


def test_detach_leaves_alone_what_this_daemon_did_not_make(staging: StagingFiles, tmp_path: Path) -> None:
    path = staging.path("job", 1, FILE)
    planted = tmp_path / "planted"
    planted.write_text("planted")
    planted.rename(path)  # swapped after it was made
    assert staging.detach(path) is None and path.read_text() == "planted"
    assert staging.detach(tmp_path / "never-made") is None
