"""storage.py: the write-back hint and the staging copy (the rest of Storage is exercised
through the pipeline and retention tests)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from ckptd.daemon.format import FormatError
from ckptd.daemon.storage import Storage, start_writeback


def test_start_writeback_is_taken_and_leaves_the_bytes_as_written(tmp_path: Path) -> None:
    path = tmp_path / "data"
    data = os.urandom(3 * 4096 + 17)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        os.pwrite(fd, data, 0)
        taken = [start_writeback(fd, 0, len(data)), start_writeback(fd, 4096, 100)]  # the second: inside, not page aligned
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    if sys.platform == "linux":  # the hint exists here: a broken binding would silently do nothing
        assert taken == [True, True]


def test_start_writeback_refused_is_a_debug_message_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    read_end, write_end = os.pipe()  # sync_file_range refuses pipes (ESPIPE)
    try:
        with caplog.at_level(logging.DEBUG, logger="ckptd.daemon.storage"):
            assert start_writeback(write_end, 0, 10) is False
    finally:
        os.close(read_end)
        os.close(write_end)
    assert any("sync_file_range" in r.getMessage() and "fsync" in r.getMessage() for r in caplog.records)


def _step_file(root: Path, data: bytes) -> Storage:
    storage = Storage(root)
    step_dir = storage.step_dir("job", 1)
    step_dir.mkdir(parents=True)
    (step_dir / "data.safetensors").write_bytes(data)
    return storage


def test_copy_range_copies_to_the_same_offset(tmp_path: Path) -> None:
    data = os.urandom(3 * 2**20 + 5)
    storage = _step_file(tmp_path / "root", data)
    out = tmp_path / "staging"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        storage.copy_range("job", 1, "data.safetensors", fd, 1000, 2**20 + 3)
        storage.copy_range("job", 1, "data.safetensors", fd, 2 * 2**20, 2**20 + 5)  # a second range, to the end
    finally:
        os.close(fd)
    staged = out.read_bytes()
    assert staged[1000 : 1000 + 2**20 + 3] == data[1000 : 1000 + 2**20 + 3]
    assert staged[2 * 2**20 :] == data[2 * 2**20 :]
    assert staged[:1000] == bytes(1000)  # nothing outside the ranges


def test_copy_range_of_a_short_file_says_where_it_ends(tmp_path: Path) -> None:
    storage = _step_file(tmp_path / "root", b"x" * 100)
    fd = os.open(tmp_path / "staging", os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        with pytest.raises(FormatError, match="ends at byte 100, before the 50 bytes its index gives from 80"):
            storage.copy_range("job", 1, "data.safetensors", fd, 80, 50)
    finally:
        os.close(fd)
