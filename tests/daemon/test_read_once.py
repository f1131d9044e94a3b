"""Load broadcast's blocks read once (engine/read_once.py): each byte of a file read from the root
once however many loads and peers ask, concurrent asks waiting for one read; a failed read is
not kept; blocks leave after their linger and over the budget; another copy of a step (saved
again under its number) is other bytes."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading

import pytest

from ckptd.daemon.engine.read_once import BLOCK, ReadOnce
from ckptd.format.index import CheckpointIndex, FileRecord

SIZE = 3 * BLOCK + 123
DATA = os.urandom(SIZE)
FILE = FileRecord("f.safetensors", SIZE, "xxh3:1", node=0)


def _index(created_at: float = 1.0) -> CheckpointIndex:
    return CheckpointIndex("j", 7, created_at, 1, (), (FILE,))


class Root:
    """A root of one file whose reads are counted (bytes, calls); `fail` makes the next read raise."""

    def __init__(self, data: bytes = DATA) -> None:
        self.data, self.bytes, self.calls, self.fail = data, 0, 0, False
        self.lock = threading.Lock()

    def read_range(self, job: str, step: int, name: str, offset: int, nbytes: int) -> bytes:
        assert (job, step, name) == ("j", 7, FILE.name)
        with self.lock:
            self.calls += 1
            if self.fail:
                self.fail = False
                raise OSError("EIO")
            self.bytes += nbytes
        return self.data[offset : offset + nbytes]


@pytest.mark.parametrize("offset, nbytes", [(0, SIZE), (0, 1), (BLOCK - 5, 10), (SIZE - 7, 7), (BLOCK, 2 * BLOCK), (17, 0)])
def test_any_range_is_the_files_bytes_and_read_once(offset: int, nbytes: int) -> None:
    root = Root()
    cache = ReadOnce(root.read_range)

    async def go() -> list[bytes]:
        return await asyncio.gather(*(cache.read(_index(), FILE, offset, nbytes) for _ in range(5)))

    assert all(got == DATA[offset : offset + nbytes] for got in asyncio.run(go()))
    first, last = offset // BLOCK, (offset + max(nbytes, 1) - 1) // BLOCK
    assert root.bytes == (0 if nbytes == 0 else min((last + 1) * BLOCK, SIZE) - first * BLOCK)  # whole blocks, once
    assert root.calls == (0 if nbytes == 0 else 1)  # one read for the run of missing blocks, five askers


def test_stage_writes_the_range_at_its_offset() -> None:
    cache = ReadOnce(Root().read_range)
    with tempfile.TemporaryFile() as f:
        asyncio.run(cache.stage(_index(), FILE, 100, 2 * BLOCK, f.fileno()))
        assert os.pread(f.fileno(), 2 * BLOCK, 100) == DATA[100 : 100 + 2 * BLOCK]


def test_a_failed_read_is_raised_to_every_asker_and_not_kept() -> None:
    root = Root()
    root.fail = True
    cache = ReadOnce(root.read_range)

    async def go() -> list[object]:
        return await asyncio.gather(*(cache.read(_index(), FILE, 0, 10) for _ in range(3)), return_exceptions=True)

    assert all(isinstance(r, OSError) for r in asyncio.run(go()))
    assert asyncio.run(cache.read(_index(), FILE, 0, 10)) == DATA[:10]  # read again


def test_blocks_leave_after_their_linger_and_over_the_budget() -> None:
    now = [0.0]
    root = Root()
    cache = ReadOnce(root.read_range, budget=2 * BLOCK, linger_s=10.0, clock=lambda: now[0])
    asyncio.run(cache.read(_index(), FILE, 0, 3 * BLOCK))
    assert cache.held_bytes <= 2 * BLOCK  # the oldest block gave its room
    read = root.bytes
    asyncio.run(cache.read(_index(), FILE, 2 * BLOCK, 10))
    assert root.bytes == read  # the newest is kept
    now[0] = 11.0
    asyncio.run(cache.read(_index(), FILE, 2 * BLOCK, 10))
    assert root.bytes == read + BLOCK  # lingered too long: read again


def test_a_step_saved_again_under_its_number_is_read_again() -> None:
    root = Root()
    cache = ReadOnce(root.read_range)
    asyncio.run(cache.read(_index(1.0), FILE, 0, 10))
    root.data = bytes(SIZE)
    assert asyncio.run(cache.read(_index(2.0), FILE, 0, 10)) == bytes(10)
