"""The CUDA side of a rank's hand-off (DESIGN.md section 6): pinned arenas, side streams, events.

Imported only when a state holds CUDA tensors (ckptd.client.client imports it lazily), so a
CPU-only client never touches CUDA. Nothing happens at import.

- `PinnedArenas`: the arenas this process copies CUDA tensors into, each mapped once and
  page-locked once with cudaHostRegister in chunks of at most 1 GiB (registration is slow,
  ~0.1 s/GiB, and blocks other CUDA calls of the process while it runs, so never per save; the
  daemon reuses the same arenas from save to save, so only the first save into each arena pays).
  Unregistered before unmapping.
- `CudaCopier`: queues a rank's device-to-host (or, for mode "ipc", device-to-device) copies
  as planned by ckptd.client.devcopy on one side stream per device. The side stream first waits
  for the device's current stream, so the copies see every update queued before `save`.
  Sources and temporaries are `record_stream`ed so the caching allocator does not hand their
  memory out while a copy still reads it. Returns a `DeviceCopy`: one event per device.
- `DeviceCopy.fence()`: the current stream waits on the copy-done events (GPU-side: the host
  never blocks; the GPU waits only if the copy is not done yet); `fence(host=True)` blocks the
  host instead, for code that changes the state outside the stream order.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ckptd.client.devcopy import MAX_GATHER_BYTES, SMALL_BYTES, CopyPlan, Gather, Run, item_of, plan_copies, run_copies
from ckptd.client.errors import CheckpointError

log = logging.getLogger("ckptd.client")

REGISTER_CHUNK = 1 << 30  # bytes per cudaHostRegister call
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
ERROR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
MAX_MAPPINGS = 8


class PinnedMapping:
    """An arena file mapped read-write by this process and page-locked for CUDA.

    host: a flat uint8 CPU tensor over the whole mapping (the destination of copies).
    register_s: seconds cudaHostRegister took (0 when it was already registered).
    """

    def __init__(self, path: str, size: int | None = None) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            length = os.fstat(fd).st_size
            if size is not None and length < size:
                raise CheckpointError(f"arena {path} has {length} bytes, the daemon said {size}: it was replaced; save again")
            self._mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.size = length
        self.host = torch.frombuffer(self._mm, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        self._chunks: list[int] = []
        started = time.perf_counter()
        try:
            self._register()
        except BaseException:
            self.close()
            raise
        self.register_s = time.perf_counter() - started

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        base = self.host.data_ptr()
        for offset in range(0, self.size, REGISTER_CHUNK):
            n = min(REGISTER_CHUNK, self.size - offset)
            code = int(cudart.cudaHostRegister(base + offset, n, HOST_REGISTER_PORTABLE))
            if code != 0:
                _clear_last_error()  # else torch's next kernel-launch check would report it
            if code == ERROR_ALREADY_REGISTERED:
                continue
            if code != 0:
                raise CheckpointError(
                    f"cudaHostRegister of {n} bytes of arena {self.path} failed with CUDA error {code}: the "
                    "trainer cannot page-lock the daemon's shared memory (host memory or container limits?)"
                )
            self._chunks.append(base + offset)

    def close(self) -> None:
        """Unregister, then unmap (a mapping must never be unmapped while registered)."""
        if self._chunks:
            cudart = torch.cuda.cudart()
            for ptr in self._chunks:
                code = int(cudart.cudaHostUnregister(ptr))
                if code != 0:
                    log.warning("cudaHostUnregister of arena %s failed with CUDA error %s", self.path, code)
            self._chunks = []
        self.host = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:
            log.warning("arena %s is still viewed by a tensor; it is unmapped when that tensor goes", self.path)


class PinnedArenas:
    """The pinned arena mappings of this process, by path; each registered once and reused."""

    def __init__(self) -> None:
        self._maps: dict[str, PinnedMapping] = {}
        self.register_s = 0.0  # total seconds spent in cudaHostRegister
        self.registrations = 0

    def get(self, path: str, size: int | None = None) -> PinnedMapping:
        mapping = self._maps.get(path)
        if mapping is not None and (size is None or mapping.size >= size):
            return mapping
        if mapping is not None:  # the daemon grew the arena: a new file under the same name
            self._maps.pop(path).close()
        for stale in [p for p in self._maps if not os.path.exists(p)]:  # arenas the daemon deleted
            self._maps.pop(stale).close()
        mapping = PinnedMapping(path, size)
        self.register_s += mapping.register_s
        self.registrations += 1
        self._maps[path] = mapping
        if len(self._maps) > MAX_MAPPINGS:  # arenas the daemon replaced: release the oldest
            self._maps.pop(next(iter(self._maps))).close()
        return mapping

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()


@dataclass
class DeviceCopy:
    """Copies queued on side streams: one event per device, recorded after the last copy.

    keep: tensors that must live until the copies are done (sources, temporaries, bounce).
    """

    events: dict[torch.device, torch.cuda.Event]
    keep: list[torch.Tensor] = field(default_factory=list)
    operations: int = 0  # copies queued

    def wait(self) -> None:
        """Block this thread until every copy is done (the event sleeps: it does not spin)."""
        for event in self.events.values():
            event.synchronize()
        self.keep = []

    def fence(self, host: bool = False) -> None:
        """Make each device's current stream wait for the copies (host=True: block the host)."""
        if host:
            self.wait()
            return
        for device, event in self.events.items():
            torch.cuda.current_stream(device).wait_event(event)


class CudaCopier:
    """Queues a rank's copies of CUDA tensors on one side stream per device (see module docstring)."""

    def __init__(self, small_bytes: int = SMALL_BYTES, max_gather_bytes: int = MAX_GATHER_BYTES) -> None:
        self.small_bytes = small_bytes
        self.max_gather_bytes = max_gather_bytes
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._bounce: dict[torch.device, torch.Tensor] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def copy(self, placements: Sequence[tuple[torch.Tensor, int, int]], dst: torch.Tensor, only: set[int] | None = None) -> DeviceCopy:
        """Queue the copies of the CUDA tensors among `placements` ((tensor, offset, nbytes), all
        of the arena's slots: the others bound the gathers) into `dst`, a flat uint8 tensor
        (pinned host memory or a device staging buffer); `only`: just these indices. Returns
        without waiting."""
        items = [
            item_of(t, off, n, t.device if t.is_cuda and (only is None or i in only) else None)
            for i, (t, off, n) in enumerate(placements)
        ]
        plan = plan_copies(items, self.small_bytes, self.max_gather_bytes)
        sources = [t for t, _, _ in placements]
        copy = DeviceCopy(events={})
        for device in sorted({items[r.items[0]].device for r in plan.runs} | {items[g.members[0][0]].device for g in plan.gathers}, key=str):
            sub = _for_device(plan, items, device)
            stream = self.stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            bounce = self._bounce_for(device, sub.max_span) if dst.device != device and sub.gathers else None
            with torch.cuda.stream(stream):
                temporaries = run_copies(sub, sources, dst, bounce)
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
            for i in {i for r in sub.runs for i in r.items} | {i for g in sub.gathers for i, _ in g.members}:
                sources[i].record_stream(stream)
            for t in temporaries + ([bounce] if bounce is not None else []):
                t.record_stream(stream)
            copy.events[device] = event
            copy.keep += temporaries + ([bounce] if bounce is not None else [])
            copy.operations += sub.operations
        return copy

    def _bounce_for(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """The device's bounce buffer for gathers, grown to `nbytes`; allocated once and reused
        (a save waits for the previous save's copies before it queues new ones)."""
        bounce = self._bounce.get(device)
        if bounce is None or bounce.numel() < nbytes:
            bounce = self._bounce[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return bounce

    def close(self) -> None:
        self._bounce.clear()
        self._streams.clear()


def _for_device(plan: CopyPlan, items: Sequence, device: torch.device) -> CopyPlan:
    runs: tuple[Run, ...] = tuple(r for r in plan.runs if items[r.items[0]].device == device)
    gathers: tuple[Gather, ...] = tuple(g for g in plan.gathers if items[g.members[0][0]].device == device)
    return CopyPlan(runs, gathers)


def copy_to_devices(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Restore: copy each (host tensor, CUDA target) pair host-to-device on a side stream per
    device and wait until done; the targets' current streams then see the values (they wait
    on the side streams too, so later kernels cannot read them early)."""
    streams: dict[torch.device, torch.cuda.Stream] = {}
    for host, target in pairs:
        stream = streams.get(target.device)
        if stream is None:
            stream = streams[target.device] = torch.cuda.Stream(device=target.device)
            stream.wait_stream(torch.cuda.current_stream(target.device))
        with torch.cuda.stream(stream):
            target.copy_(host, non_blocking=host.is_pinned())
    for device, stream in streams.items():
        stream.synchronize()
        torch.cuda.current_stream(device).wait_stream(stream)


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error of this thread (torch's cudart bindings lack
    cudaGetLastError; the library torch loaded is found through ckptd.common.cudart)."""
    from ckptd.common.cudart import CudaRuntime, CudaRuntimeError

    try:
        CudaRuntime.load().lib.cudaGetLastError()
    except CudaRuntimeError as exc:
        log.debug("cannot reset the CUDA error state: %s", exc)


def cuda_problem() -> str | None:
    """Why CUDA cannot be used in this process, or None when it can."""
    if not torch.cuda.is_available():
        return "CUDA is not available in this process (a CPU build of torch, or no GPU visible)"
    return None
