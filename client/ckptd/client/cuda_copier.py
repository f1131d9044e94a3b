"""The CUDA side of a rank's hand-off (docs/architecture.md section 6): pinned arenas, side streams, events.

Imported only when a state holds CUDA tensors (ckptd.client._handoff.cuda.CudaBackend imports it lazily), so a
CPU-only client never touches CUDA. Nothing happens at import.

- `PinnedArenas`: the arenas this process copies CUDA tensors into, each mapped once and
  page-locked once, in ONE cudaHostRegister call of the whole mapping
  (ckptd.common.cudart.register_host). Registration is slow (~0.1 s/GiB) and blocks other CUDA
  calls of the process while it runs, so it is never per save: the daemon reuses the same
  arenas from save to save, so only the first save into each arena pays. One registration per
  mapping also keeps every copy inside one registration, which CUDA requires (a copy spanning
  two fails with `invalid argument`). Unregistered before unmapping.
- `CudaCopier`: queues a rank's device-to-host (or, for mode "ipc", device-to-device) copies
  as planned by ckptd.client.devcopy on one side stream per device. The side stream first waits
  for the device's current stream, so the copies see every update queued before `save`. The
  plan and the views it copies through are built once and reused while the caller passes the
  same placements object (see `CudaCopier.copy`), so a save's host work is one copy per run and
  one pack per group of small tensors. Sources, temporaries and the bounce buffer are kept
  alive by the returned `DeviceCopy` until its copies are done (instead of record_stream on each
  tensor), so the caching allocator never hands their memory out while a copy still reads it.
- `DeviceCopy.fence()`: the current stream waits on the copy-done events (GPU-side: the host
  never blocks; the GPU waits only if the copy is not done yet); `fence(host=True)` blocks the
  host instead, for code that changes the state outside the stream order.

tests/fakecuda.py runs all of this on CPU against a strict stand-in for CUDA.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ckptd.client.arenas import file_id
from ckptd.client.devcopy import MAX_GATHER_BYTES, SMALL_BYTES, BoundCopies, DeviceCopyPlan, bind_copies, issue_copies, item_of, plan_copies
from ckptd.client.errors import CheckpointError
from ckptd.common.cudart import CudaRuntime, CudaRuntimeError, HostRegistration, register_host

log = logging.getLogger("ckptd.client")

MAX_MAPPINGS = 8
MAX_CACHED_PLANS = 8  # (only, dst) pairs kept for one placements object: 2 arenas x 2 fence groups, and room


class PinnedMapping:
    """An arena file mapped read-write by this process and page-locked for CUDA in one call.

    host: a flat uint8 CPU tensor over the whole mapping (the destination of copies).
    registration: the one cudaHostRegister of the mapping (ckptd.common.cudart.HostRegistration).
    register_s: seconds cudaHostRegister took.
    """

    def __init__(self, path: str, runtime: CudaRuntime, size: int | None = None) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            length = st.st_size
            self.file_id = (st.st_dev, st.st_ino)  # the file mapped (ckptd.client.arenas.file_id)
            if size is not None and length < size:
                raise CheckpointError(f"arena {path} has {length} bytes, the daemon said {size}: it was replaced; save again")
            self._mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.size = length
        self.host = torch.frombuffer(self._mm, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        self.registration: HostRegistration | None = None
        try:
            self.registration = register_host(runtime, self.host.data_ptr(), self.size, f"arena {path}")
        except CudaRuntimeError as exc:
            self.close()
            raise CheckpointError(f"the trainer cannot page-lock the daemon's shared memory: {exc}") from None
        self.register_s = self.registration.seconds

    def close(self) -> None:
        """Unregister, then unmap (a mapping must never be unmapped while registered)."""
        if self.registration is not None:
            try:
                self.registration.close()
            except CudaRuntimeError as exc:
                log.warning("could not unlock arena %s: %s", self.path, exc)
            self.registration = None
        self.host = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:
            log.warning("arena %s is still viewed by a tensor; it is unmapped when that tensor goes", self.path)


class PinnedArenas:
    """The pinned arena mappings of this process, by path; each registered once and reused.

    runtime: the CUDA runtime to page-lock with (default: the libcudart this process loaded,
    torch's, found on first use). registrations: cudaHostRegister calls made, one per mapping.
    """

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        self._runtime = runtime
        self._maps: dict[str, PinnedMapping] = {}
        self.register_s = 0.0  # total seconds spent in cudaHostRegister
        self.registrations = 0

    def runtime(self) -> CudaRuntime:
        if self._runtime is None:
            try:
                self._runtime = CudaRuntime.load()
            except CudaRuntimeError as exc:
                raise CheckpointError(f"cannot page-lock arenas for CUDA copies: {exc}") from None
        return self._runtime

    def get(self, path: str, size: int | None = None) -> PinnedMapping:
        """The mapping of the arena at `path` (at least `size` bytes), mapped and registered on
        first use. Raises CheckpointError when it cannot be mapped or page-locked."""
        mapping = self._maps.get(path)
        if mapping is not None and (size is None or mapping.size >= size) and file_id(path) == mapping.file_id:
            return mapping
        if mapping is not None:  # a new file under the same name: the daemon grew the arena, or restarted (ArenaMaps.get)
            self._maps.pop(path).close()
        for stale in [p for p in self._maps if not os.path.exists(p)]:  # arenas the daemon deleted
            self._maps.pop(stale).close()
        mapping = PinnedMapping(path, self.runtime(), size)
        self.register_s += mapping.register_s
        self.registrations += 1 if mapping.registration is not None and mapping.registration.owned else 0
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

    keep: what must live until the copies are done (the prepared plan with its sources and
    views, temporaries, the bounce buffer); released by `wait`.
    """

    events: dict[torch.device, torch.cuda.Event]
    keep: list[Any] = field(default_factory=list)
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


@dataclass
class _DeviceWork:
    device: torch.device
    bound: BoundCopies
    keep: list[torch.Tensor]  # the bounce buffer, if any


@dataclass
class _Prepared:
    """One `copy` call's plan, bound to its tensors, for reuse while nothing changed.

    placements is held (never only its id, which a new object may reuse) and compared with
    `is`; ptrs are the sources' data pointers when it was made: a storage swapped under the same
    tensor object since (`p.data = ...`) makes it stale.
    """

    placements: Sequence[tuple[torch.Tensor, int, int]]
    only: frozenset[int] | None
    dst: torch.Tensor
    boundaries: tuple[int, ...]
    sources: list[torch.Tensor]
    ptrs: list[int]
    work: list[_DeviceWork]
    operations: int

    def fits(self, dst: torch.Tensor, only: set[int] | frozenset[int] | None, boundaries: tuple[int, ...]) -> bool:
        return (
            self.dst is dst
            and self.boundaries == boundaries
            and (self.only is None if only is None else self.only == only)
            and list(map(torch.Tensor.data_ptr, self.sources)) == self.ptrs
        )


class CudaCopier:
    """Queues a rank's copies of CUDA tensors on one side stream per device (see module docstring).

    plans_built: how many copy plans were made (a save whose placements object, `only` and
    `dst` are those of an earlier one reuses that plan: see `copy`).
    """

    def __init__(self, small_bytes: int = SMALL_BYTES, max_gather_bytes: int = MAX_GATHER_BYTES) -> None:
        self.small_bytes = small_bytes
        self.max_gather_bytes = max_gather_bytes
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._bounce: dict[torch.device, torch.Tensor] = {}
        self._placements: Sequence[tuple[torch.Tensor, int, int]] | None = None
        self._plans: list[_Prepared] = []
        self.plans_built = 0

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def copy(
        self,
        placements: Sequence[tuple[torch.Tensor, int, int]],
        dst: torch.Tensor,
        only: set[int] | frozenset[int] | None = None,
        boundaries: Sequence[int] = (),
    ) -> DeviceCopy:
        """Queue the copies of the CUDA tensors among `placements` ((tensor, offset, nbytes), all
        of the arena's slots: the others bound the gathers) into `dst`, a flat uint8 tensor
        (pinned host memory or a device staging buffer); `only`: just these indices.
        `boundaries`: offsets of `dst` no copy may cross (registration pieces; none for arenas,
        which are registered whole). Returns without waiting.

        Cached: the plan and its views are reused when `placements` is the very object of an
        earlier call (`is`) with an equal `only`, the same `dst` object and the same boundaries.
        The caller passes the same object only while every tensor in it keeps its shape, dtype
        and strides; a storage swapped under the same tensor object is detected here (data
        pointers) and rebuilds the plan. Any other placements object drops the cache.
        """
        prepared = self._prepared(placements, dst, only, tuple(boundaries))
        copy = DeviceCopy(events={}, keep=[prepared], operations=prepared.operations)
        for work in prepared.work:
            stream = self.stream(work.device)
            stream.wait_stream(torch.cuda.current_stream(work.device))
            with torch.cuda.stream(stream):
                copy.keep += issue_copies(work.bound)
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
            copy.events[work.device] = event
        return copy

    def _prepared(
        self,
        placements: Sequence[tuple[torch.Tensor, int, int]],
        dst: torch.Tensor,
        only: set[int] | frozenset[int] | None,
        boundaries: tuple[int, ...],
    ) -> _Prepared:
        if placements is not self._placements:
            self._placements, self._plans = placements, []
        for i, prepared in enumerate(self._plans):
            if prepared.fits(dst, only, boundaries):
                return prepared
            if prepared.dst is dst and prepared.only == only and prepared.boundaries == boundaries:
                del self._plans[i]  # stale (a storage was swapped): rebuilt below
                break
        prepared = self._build(placements, dst, only, boundaries)
        self._plans.append(prepared)
        if len(self._plans) > MAX_CACHED_PLANS:
            self._plans.pop(0)
        return prepared

    def _build(
        self,
        placements: Sequence[tuple[torch.Tensor, int, int]],
        dst: torch.Tensor,
        only: set[int] | frozenset[int] | None,
        boundaries: tuple[int, ...],
    ) -> _Prepared:
        self.plans_built += 1
        items = [
            item_of(t, off, n, t.device if t.is_cuda and (only is None or i in only) else None)
            for i, (t, off, n) in enumerate(placements)
        ]
        plan = plan_copies(items, self.small_bytes, self.max_gather_bytes, boundaries)
        tensors = [t for t, _, _ in placements]
        copied = sorted({i for r in plan.runs for i in r.items} | {i for g in plan.gathers for i, _ in g.members})
        devices = sorted({items[i].device for i in copied}, key=str)
        work = []
        for device in devices:
            runs = tuple(r for r in plan.runs if items[r.items[0]].device == device)
            gathers = tuple(g for g in plan.gathers if items[g.members[0][0]].device == device)
            sub = DeviceCopyPlan(runs, gathers)
            bounce = self._bounce_for(device, sub.max_span) if dst.device != device and gathers else None
            work.append(_DeviceWork(device, bind_copies(sub, tensors, dst, bounce), [bounce] if bounce is not None else []))
        sources = [tensors[i] for i in copied]
        return _Prepared(
            placements, None if only is None else frozenset(only), dst, boundaries,
            sources, [t.data_ptr() for t in sources], work, plan.operations,
        )

    def _bounce_for(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """The device's bounce buffer for gathers, grown to `nbytes`; allocated once, on the
        device's side stream (so only work ordered after the copies can reuse its memory)."""
        bounce = self._bounce.get(device)
        if bounce is None or bounce.numel() < nbytes:
            with torch.cuda.stream(self.stream(device)):
                bounce = self._bounce[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return bounce

    def close(self) -> None:
        self._plans = []
        self._placements = None
        self._bounce.clear()
        self._streams.clear()


def cuda_problem() -> str | None:
    """Why CUDA cannot be used in this process, or None when it can."""
    if not torch.cuda.is_available():
        return "CUDA is not available in this process (a CPU build of torch, or no GPU visible)"
    return None
