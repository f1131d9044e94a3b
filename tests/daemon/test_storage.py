"""storage.py: the write-back hint (the rest of Storage is exercised through the pipeline and
retention tests)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ckptd.daemon.storage import start_writeback


def test_start_writeback_leaves_the_bytes_as_written(tmp_path: Path) -> None:
    path = tmp_path / "data"
    data = os.urandom(3 * 4096 + 17)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        os.pwrite(fd, data, 0)
        start_writeback(fd, 0, len(data))
        start_writeback(fd, 4096, 100)  # a range inside the file, not page aligned
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_start_writeback_refused_is_a_debug_message_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    read_end, write_end = os.pipe()  # sync_file_range refuses pipes (ESPIPE)
    try:
        with caplog.at_level(logging.DEBUG, logger="ckptd.daemon.storage"):
            start_writeback(write_end, 0, 10)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert any("sync_file_range" in r.getMessage() and "fsync" in r.getMessage() for r in caplog.records)
