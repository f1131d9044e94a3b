"""Load broadcast, the reading side: a step's data files read from this node's root once for
all the nodes that load them (docs/architecture.md §13, "Load broadcast").

A file a load needs is read from storage by one node, its writer (the index's `FileRecord.node`);
the other nodes fetch its ranges from that node (the Peer service's Fetch), which answers from
the blocks it read, and so do the writer's own ranks (their ranges are staged from the same
blocks). Bytes are kept in aligned blocks of BLOCK bytes: concurrent requests for one block wait
for one read, and a block stays in memory until LINGER_S seconds after its last use or until the
budget needs its room (least recently used first). A block evicted too early is read again:
more storage reads, never a wrong or missing byte. The bytes are checked where they are used:
the ranks verify every fragment's checksum, as for any other source.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from ckptd.format.index import CheckpointIndex, FileRecord

BLOCK = 1 << 20  # bytes per block (aligned to file offsets)
BUDGET = 1 << 30  # bytes of blocks kept at most
LINGER_S = 60.0  # seconds a block stays after its last use

# job, step, the index's created_at and the file's checksum (a step saved again under its number
# is other bytes), file, block number
_Key = tuple[str, int, float, str, str, int]
ReadRange = Callable[[str, int, str, int, int], bytes]  # (thread) job, step, file, offset, nbytes -> the bytes; raises when short


@dataclass
class _Block:
    ready: asyncio.Future[bytes]
    used: float  # the clock's seconds at its last use


@dataclass
class ReadCounts:
    """Bytes this node's root gave (`read`) and bytes answered from blocks already held (`reused`)."""

    read: int = 0
    reused: int = 0


class ReadOnce:
    """Blocks of the root's data files, read once for this node's loads and the peers' fetches."""

    def __init__(
        self, read_range: ReadRange, budget: int = BUDGET, linger_s: float = LINGER_S, clock: Callable[[], float] = time.monotonic,
        on_read: Callable[[int], None] | None = None,
    ) -> None:
        """read_range: how the root's bytes are read (a thread calls it); on_read(n): n bytes were read from it."""
        self._read_range = read_range
        self._on_read = on_read
        self._budget = budget
        self._linger_s = linger_s
        self._clock = clock
        self._blocks: OrderedDict[_Key, _Block] = OrderedDict()  # oldest use first
        self._held = 0  # bytes of the blocks read
        self._tasks: set[asyncio.Task[None]] = set()  # reads under way (kept referenced until done)
        self.counts = ReadCounts()

    async def read(self, index: CheckpointIndex, file: FileRecord, offset: int, nbytes: int) -> bytes:
        """Bytes [offset, offset + nbytes) of the step's `file` (its record in `index`), from blocks
        held or read now (the missing blocks of the range in one read per run of them). Raises
        what the storage raises (a short file: FormatError)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > file.size:
            raise ValueError(f"bytes [{offset}, +{nbytes}) of {file.name} ({file.size} bytes)")
        if nbytes == 0:
            return b""
        self._expire()
        first, last = offset // BLOCK, (offset + nbytes - 1) // BLOCK
        missing = {b for b in range(first, last + 1) if self._key(index, file, b) not in self._blocks}
        runs: list[list[int]] = []
        for b in missing:
            if runs and runs[-1][-1] == b - 1:
                runs[-1].append(b)
            else:
                runs.append([b])
        loop = asyncio.get_running_loop()
        for run in runs:
            for b in run:
                self._blocks[self._key(index, file, b)] = _Block(loop.create_future(), self._clock())
            self._spawn(self._fill(index, file, run))
        parts = []
        for b in range(first, last + 1):
            key = self._key(index, file, b)
            block = self._blocks.get(key)
            if block is None:  # evicted by a concurrent read while this one waited: read it alone
                block = self._blocks[key] = _Block(loop.create_future(), self._clock())
                self._spawn(self._fill(index, file, [b]))
            data = await asyncio.shield(block.ready)
            if b not in missing:
                self.counts.reused += len(data)
            block.used = self._clock()
            if key in self._blocks:
                self._blocks.move_to_end(key)
            parts.append(data)
        joined = b"".join(parts) if len(parts) > 1 else parts[0]
        start = offset - first * BLOCK
        return joined[start : start + nbytes]

    async def stage(self, index: CheckpointIndex, file: FileRecord, offset: int, nbytes: int, out_fd: int) -> None:
        """Bytes [offset, offset + nbytes) of `file` written at the same offset of `out_fd` (a
        staging file), a block at a time."""
        done = 0
        while done < nbytes:
            n = min(BLOCK - (offset + done) % BLOCK, nbytes - done)
            data = await self.read(index, file, offset + done, n)
            await asyncio.to_thread(os.pwrite, out_fd, data, offset + done)
            done += n

    def _spawn(self, fill: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(fill)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _key(index: CheckpointIndex, file: FileRecord, block: int) -> _Key:
        return (index.job, index.step, index.created_at, file.checksum, file.name, block)

    async def _fill(self, index: CheckpointIndex, file: FileRecord, run: list[int]) -> None:
        """Read the consecutive blocks `run` in one storage read and hand each to its waiters."""
        begin, end = run[0] * BLOCK, min((run[-1] + 1) * BLOCK, file.size)
        keys = [self._key(index, file, b) for b in run]
        try:
            data = await asyncio.to_thread(self._read_range, index.job, index.step, file.name, begin, end - begin)
        except Exception as exc:
            for key in keys:
                block = self._blocks.pop(key, None)
                if block is not None and not block.ready.done():
                    block.ready.set_exception(exc)
                    block.ready.exception()  # marked retrieved: its waiters may have gone
            return
        except BaseException:
            for key in keys:
                block = self._blocks.pop(key, None)
                if block is not None:
                    block.ready.cancel()
            raise
        self.counts.read += len(data)
        if self._on_read is not None:
            self._on_read(len(data))
        for i, key in enumerate(keys):
            piece = data[i * BLOCK : (i + 1) * BLOCK]
            block = self._blocks.get(key)
            if block is None:
                continue
            self._held += len(piece)
            block.ready.set_result(piece)
        self._trim()

    def _expire(self) -> None:
        """Drop blocks unused for LINGER_S (those being read stay)."""
        horizon = self._clock() - self._linger_s
        for key in [k for k, b in self._blocks.items() if b.used < horizon and b.ready.done()]:
            self._drop(key)

    def _trim(self) -> None:
        """Drop the least recently used blocks read while over the budget."""
        for key in list(self._blocks):
            if self._held <= self._budget:
                return
            if self._blocks[key].ready.done():
                self._drop(key)

    def _drop(self, key: _Key) -> None:
        block = self._blocks.pop(key)
        if not block.ready.cancelled() and block.ready.exception() is None:
            self._held -= len(block.ready.result())

    @property
    def held_bytes(self) -> int:
        return self._held
