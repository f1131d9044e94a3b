"""Restores onto CUDA devices: host-to-device copies queued as soon as their bytes are in pinned
memory, merged into large transfers, from a pinned staging pool reused from load to load.

Imported only by ckptd.client._handoff.cuda.CudaBackend (lazily), so a CPU-only client never
touches CUDA. Nothing happens at import. tests/fakecuda.py runs all of this on CPU, strictly.

Rules it keeps (each enforced by the stand-in, tests/client/test_cuda_restore.py):
- A copy is asynchronous (`non_blocking=True`) only from pinned memory (an arena, which the
  process registered whole, or a staging slot); a pageable source is copied synchronously.
- A merged copy never spans two host allocations: pairs merge only within one host storage
  (one registration: an arena mapping or one pinned allocation) and one device storage (one
  allocation), where both sides are exactly adjacent.
- Ordering: each device's copy stream first waits for the device's current stream (a kernel
  queued before the load may still read a target); `finish` blocks until the copies are done
  (the arenas go back to the daemon after the load) and makes each current stream wait for them.
- A staging slot is handed out again only after the copies reading it are done (its events).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ckptd.client.devcopy import storage_bytes

MIB = 2**20
SLOT_BYTES = 64 * MIB  # a staging slot: what one wave of reads fills while the previous wave is copied
SLOTS = 2  # double buffering: the reads of one slot overlap the copies out of the other


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor of `nbytes` bytes of pinned (page-locked) host memory."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass(frozen=True)
class Upload:
    """One host-to-device copy: `host` into `target` (byte views when merged from several pairs)."""

    host: torch.Tensor
    target: torch.Tensor
    pairs: int  # how many (host, target) pairs it carries


def merge_uploads(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Upload]:
    """The copies of `pairs` ((host tensor, device target)), with pairs that are exactly adjacent
    on both sides, in one host storage and one device storage, merged into one byte copy. A pair
    with other dtypes, shapes or strides on its two sides is copied as it is (torch converts)."""
    out: list[Upload] = []
    mergeable: dict[tuple[torch.device, int, int], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for host, target in pairs:
        n = target.numel() * target.element_size()
        if n == 0:
            continue
        if (host.dtype != target.dtype or host.shape != target.shape or not host.is_contiguous()
                or not target.is_contiguous()):
            out.append(Upload(host, target, 1))
            continue
        key = (target.device, host.untyped_storage().data_ptr(), target.untyped_storage().data_ptr())
        mergeable.setdefault(key, []).append((host.data_ptr(), target.data_ptr(), host, target))
    for group in mergeable.values():
        group.sort(key=lambda g: g[0])
        start = 0
        for i in range(1, len(group) + 1):
            if i < len(group):
                h_prev, d_prev, host_prev, _ = group[i - 1]
                n_prev = host_prev.numel() * host_prev.element_size()
                if group[i][0] == h_prev + n_prev and group[i][1] == d_prev + n_prev:
                    continue
            run = group[start:i]
            if len(run) == 1:
                out.append(Upload(run[0][2], run[0][3], 1))
            else:
                nbytes = sum(h.numel() * h.element_size() for _, _, h, _ in run)
                out.append(Upload(storage_bytes(run[0][2], nbytes), storage_bytes(run[0][3], nbytes), len(run)))
            start = i
    return out


@dataclass
class _Slot:
    """A pinned staging buffer and the copy-done events of the copies that read it last."""

    buffer: torch.Tensor
    readers: list[torch.cuda.Event] = field(default_factory=list)

    def wait_free(self) -> None:
        """Block until no copy reads this slot any more."""
        for event in self.readers:
            event.synchronize()
        self.readers = []


class StagingPool:
    """Pinned staging slots reused from load to load (allocated on first use, grown when a single
    tensor is larger than a slot); `take` hands them out in turn, each only once the copies that
    read it are done. allocate: makes a pinned flat uint8 buffer (default `pinned_buffer`)."""

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES,
                 allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.slot_bytes = slot_bytes
        self._allocate = allocate if allocate is not None else pinned_buffer
        self._slots: list[_Slot | None] = [None] * slots
        self._next = 0
        self.allocations = 0  # pinned buffers made (cudaHostAlloc calls)

    def take(self, nbytes: int) -> _Slot:
        """The next slot, at least `nbytes` bytes, free of readers."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot = self._slots[i]
        if slot is not None:
            slot.wait_free()
        if slot is None or slot.buffer.numel() < nbytes:
            slot = self._slots[i] = _Slot(self._allocate(max(nbytes, self.slot_bytes)))
            self.allocations += 1
        return slot

    def close(self) -> None:
        for slot in self._slots:
            if slot is not None:
                slot.wait_free()
        self._slots = [None] * len(self._slots)


class CudaRestore:
    """One load's host-to-device copies (the DeviceRestore of ckptd.client._handoff.base): a copy
    stream per device, ordered after the device's current stream; `upload` queues without
    waiting, `finish` waits. uploads: copies queued; pairs: (host, target) pairs they carry."""

    def __init__(self, pool: StagingPool, streams: dict[torch.device, torch.cuda.Stream]) -> None:
        self._pool = pool
        self._streams = streams
        self._ordered: set[torch.device] = set()
        self._slot: _Slot | None = None
        self.uploads = 0
        self.pairs = 0

    def staging(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 pinned buffer of at least `nbytes` bytes to assemble targets in before
        `upload`; valid until the next `staging` call of this load (double-buffered: it may wait
        for the copies out of the slot used two calls ago)."""
        self._slot = self._pool.take(nbytes)
        return self._slot.buffer

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        if device not in self._ordered:  # kernels queued before the load may still use the targets
            stream.wait_stream(torch.cuda.current_stream(device))
            self._ordered.add(device)
        return stream

    def upload(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue the copies of `pairs` (host tensor, device target), merged where they are adjacent
        on both sides; returns without waiting. The hosts must not change until `finish` (a
        staging buffer: until the slot is taken again, which waits)."""
        devices: set[torch.device] = set()
        for up in merge_uploads(pairs):
            device = up.target.device
            with torch.cuda.stream(self._stream(device)):
                up.target.copy_(up.host, non_blocking=up.host.is_pinned())
            devices.add(device)
            self.uploads += 1
            self.pairs += up.pairs
        if self._slot is not None and devices:
            for device in devices:
                event = torch.cuda.Event()
                event.record(self._streams[device])
                self._slot.readers.append(event)

    def finish(self) -> None:
        """Block until every copy is done; each device's current stream then waits for them too."""
        for device in self._ordered:
            stream = self._streams[device]
            stream.synchronize()
            torch.cuda.current_stream(device).wait_stream(stream)


class CudaRestorer:
    """What restores keep between loads: the staging pool and the copy streams."""

    def __init__(self, pool: StagingPool | None = None) -> None:
        self.pool = pool if pool is not None else StagingPool()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def begin(self) -> CudaRestore:
        return CudaRestore(self.pool, self._streams)

    def close(self) -> None:
        self.pool.close()
        self._streams.clear()
