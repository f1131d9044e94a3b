"""The daemon's side of mode "ipc": open each rank's device staging buffer once, drain it to the arena.

A rank sends the CUDA IPC handle of its staging buffer (64 raw bytes, never a pickle; a handle of
any other length is refused on receipt, see ckptd.common.cudart.ipc_handle_problem) and its
GPU's UUID once (OpenStaging). The daemon finds the GPU with that UUID among the ones it sees
(device indices differ between processes with different CUDA_VISIBLE_DEVICES), opens the
handle once with cudaIpcOpenMemHandle and keeps the mapping until the rank closes it, opens a
new one, its client ends (its Attach call ends: a trainer killed never closes it, and the
mapping keeps the dead trainer's GPU memory allocated), or the daemon exits. At each commit it copies the staged ranges to the rank's arena
with cudaMemcpy, after page-locking the arena once, in ONE cudaHostRegister call of the whole
mapping (ckptd.common.cudart.register_host: a copy may not span two registrations, CUDA
refuses it with `invalid argument`); unlocked before the arena is unmapped.

All CUDA calls run on one thread per GPU, never on the event loop. The CUDA runtime is loaded
on the first OpenStaging; a daemon that never gets one never touches CUDA (and so never takes
the ~0.5 GiB of GPU memory a CUDA context costs). When the buffer cannot be opened the answer
carries the reason and the rank falls back to mode "overlap".
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid as uuidlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from ckptd.common.cudart import CudaRuntime, CudaRuntimeError, HostRegistration, ipc_handle_problem, register_host
from ckptd.daemon.errors import Aborted, InvalidRequest, NotFound
from ckptd.daemon.handoff.arena import Arena, pid_alive

log = logging.getLogger(__name__)

MAX_STAGING_BYTES = 1 << 40
UUID_RE = re.compile(r"[0-9a-f]{32}")
NAMESPACE_HINT = (
    "the trainer and the daemon must share the PID and IPC namespaces and see the same GPU "
    "(Kubernetes: hostPID and hostIPC, or one pod with shareProcessNamespace; Docker: --pid=container:<daemon> "
    "--ipc=container:<daemon>)"
)
T = TypeVar("T")


@dataclass(frozen=True)
class StagedRange:
    """`nbytes` at `staging_offset` of the staging buffer go to `arena_offset` of the arena."""

    staging_offset: int
    arena_offset: int
    nbytes: int


@dataclass(frozen=True)
class OpenBuffer:
    staging_id: str
    job: str
    rank: int
    device: int  # the daemon's index of the GPU
    ptr: int  # the daemon's address of the buffer
    nbytes: int
    pid: int
    client: str = ""  # the client id of the rank that opened it ("": a client older than client ids)


class GpuStaging:
    name = "ipc"  # a handoffs.DaemonTransport
    """The staging buffers this daemon has open, and the arenas it has page-locked."""

    def __init__(self, load_runtime: Callable[[], CudaRuntime] = CudaRuntime.load) -> None:
        self._load_runtime = load_runtime
        self._runtime: CudaRuntime | None = None
        self._devices: dict[str, int] | None = None  # uuid -> index
        self._threads: dict[int, ThreadPoolExecutor] = {}
        self.buffers: dict[str, OpenBuffer] = {}
        self._pinned: dict[int, tuple[Arena, HostRegistration]] = {}  # id(arena) -> (that arena, its registration)
        self.registrations = 0  # cudaHostRegister calls made: one per arena mapping

    def _thread(self, device: int) -> ThreadPoolExecutor:
        pool = self._threads.get(device)
        if pool is None:
            pool = self._threads[device] = ThreadPoolExecutor(1, thread_name_prefix=f"ckptd-gpu{device}")
        return pool

    async def _on(self, device: int, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread(device), fn)

    def _runtime_and_devices(self) -> tuple[CudaRuntime, dict[str, int]]:
        """Load the CUDA runtime and list the visible GPUs by UUID (once); raises CudaRuntimeError."""
        if self._runtime is None:
            runtime = self._load_runtime()
            devices = {runtime.device_uuid(i): i for i in range(runtime.device_count())}
            self._runtime, self._devices = runtime, devices
            log.info("CUDA runtime %s: GPUs %s", runtime.path, ", ".join(f"{i}={u}" for u, i in devices.items()) or "none")
        assert self._devices is not None
        return self._runtime, self._devices

    async def open(self, job: str, rank: int, gpu_uuid: str, handle: bytes, nbytes: int, pid: int, client: str = "") -> tuple[str, str]:
        """Open a rank's staging buffer (`client`: the id of the client that asks); returns
        (staging_id, "") or ("", the reason it cannot).

        Raises InvalidRequest for malformed fields (a handle that is not exactly 64 bytes among
        them: checked here, on receipt). The rank's previous buffer is closed first.
        """
        problem = ipc_handle_problem(handle)
        if problem is not None:
            raise InvalidRequest(problem)
        if not UUID_RE.fullmatch(gpu_uuid):
            raise InvalidRequest(f"gpu_uuid {gpu_uuid[:80]!r} must be 32 lowercase hex digits")
        if not 0 < nbytes <= MAX_STAGING_BYTES:
            raise InvalidRequest(f"a staging buffer of {nbytes} bytes: it must be between 1 byte and 1 TiB")
        await self.close_rank(job, rank)
        await self.reap_dead()
        try:
            runtime, devices = await asyncio.to_thread(self._runtime_and_devices)
        except CudaRuntimeError as exc:
            return "", f"the daemon cannot use CUDA: {exc}"
        device = devices.get(gpu_uuid)
        if device is None:
            return "", (
                f"the daemon does not see the trainer's GPU {gpu_uuid} (it sees {sorted(devices) or 'no GPU'}): give the daemon "
                "the same GPUs (CUDA_VISIBLE_DEVICES, the container's device list)"
            )

        def open_handle() -> int:
            runtime.set_device(device)
            return runtime.ipc_open_mem_handle(handle)

        try:
            ptr = await self._on(device, open_handle)
        except CudaRuntimeError as exc:
            return "", f"{exc}; {NAMESPACE_HINT}"
        staging_id = uuidlib.uuid4().hex
        self.buffers[staging_id] = OpenBuffer(staging_id, job, rank, device, ptr, nbytes, pid, client)
        log.info("opened the staging buffer of job %s rank %s (pid %s): %.2f GiB on GPU %s", job, rank, pid, nbytes / 2**30, device)
        return staging_id, ""

    def buffer(self, job: str, rank: int, staging_id: str) -> OpenBuffer:
        found = self.buffers.get(staging_id)
        if found is None or found.job != job or found.rank != rank:
            raise NotFound(f"rank {rank} of job {job!r} has no open staging buffer {staging_id!r} (the daemon restarted?)")
        return found

    async def drain(self, job: str, rank: int, staging_id: str, arena: Arena | None, ranges: Sequence[StagedRange]) -> None:
        """Copy `ranges` of the rank's staging buffer into `arena`. Raises InvalidRequest for
        ranges outside either, NotFound for an unknown buffer, Aborted when CUDA fails."""
        buf = self.buffer(job, rank, staging_id)
        if arena is None:
            raise InvalidRequest(f"rank {rank} has no arena in this save, so nothing can be staged")
        for r in ranges:
            if r.nbytes < 0 or r.staging_offset < 0 or r.arena_offset < 0:
                raise InvalidRequest(f"staged range {r}: offsets and sizes must be >= 0")
            if r.staging_offset + r.nbytes > buf.nbytes or r.arena_offset + r.nbytes > arena.size:
                raise InvalidRequest(
                    f"staged range {r} lies outside the staging buffer ({buf.nbytes} bytes) or the arena ({arena.size} bytes)"
                )
        assert self._runtime is not None
        runtime = self._runtime

        def copy() -> None:
            runtime.set_device(buf.device)
            base = self._pin(runtime, arena)
            for r in ranges:
                if r.nbytes:
                    runtime.memcpy_d2h(base + r.arena_offset, buf.ptr + r.staging_offset, r.nbytes)

        try:
            await self._on(buf.device, copy)
        except CudaRuntimeError as exc:
            raise Aborted(f"copying rank {rank}'s staging buffer to host memory failed: {exc}") from None

    def _pin(self, runtime: CudaRuntime, arena: Arena) -> int:
        """Page-lock the whole of `arena` in one call, the first time it is drained into (unlocked
        when it closes); returns its address. Raises CudaRuntimeError."""
        base = arena.address()
        pinned = self._pinned.get(id(arena))
        if pinned is None or pinned[0] is not arena:
            registration = register_host(runtime, base, arena.size, f"arena {arena.path}")
            self._pinned[id(arena)] = (arena, registration)
            self.registrations += 1 if registration.owned else 0
            arena.on_close.append(lambda: self._unpin(arena))
        return base

    def _unpin(self, arena: Arena) -> None:
        pinned = self._pinned.get(id(arena))
        if pinned is None or pinned[0] is not arena:
            return
        del self._pinned[id(arena)]
        try:
            pinned[1].close()
        except CudaRuntimeError as exc:
            log.warning("could not unlock arena %s: %s", arena.path, exc)

    async def before_save(self) -> None:
        """A restarted trainer needs the GPU memory its dead predecessor's buffers hold."""
        if self.buffers:
            await self.reap_dead()

    async def reap_dead(self) -> None:
        """Close the buffers of trainers that died without closing them: the mapping would keep
        their GPU memory allocated, and a restarted trainer needs room for its new buffer."""
        for buf in list(self.buffers.values()):
            if not _alive(buf.pid):
                log.info("closing the staging buffer of job %s rank %s: its process %s is gone", buf.job, buf.rank, buf.pid)
                await self._close(buf)

    async def client_gone(self, job: str, client: str) -> None:
        """A client of `job` ended (Detach, or its process exited): close the buffers it opened.
        A killed trainer never closes its own, and its GPU memory stays allocated while open here."""
        for buf in [b for b in self.buffers.values() if client and b.client == client and b.job == job]:
            log.info("closing the staging buffer of job %s rank %s: its client ended", buf.job, buf.rank)
            await self._close(buf)

    async def close(self, job: str, rank: int, staging_id: str) -> None:
        buf = self.buffer(job, rank, staging_id)
        await self._close(buf)

    async def close_rank(self, job: str, rank: int) -> None:
        for buf in [b for b in self.buffers.values() if b.job == job and b.rank == rank]:
            await self._close(buf)

    async def _close(self, buf: OpenBuffer) -> None:
        self.buffers.pop(buf.staging_id, None)
        runtime = self._runtime
        if runtime is None:
            return
        try:
            await self._on(buf.device, lambda: runtime.ipc_close_mem_handle(buf.ptr))
        except CudaRuntimeError as exc:
            log.warning("closing the staging buffer of job %s rank %s failed: %s", buf.job, buf.rank, exc)

    def shutdown(self) -> None:
        """Close every buffer (synchronously; at daemon exit, after the last save)."""
        runtime = self._runtime
        for buf in list(self.buffers.values()):
            self.buffers.pop(buf.staging_id, None)
            if runtime is not None:
                try:
                    self._thread(buf.device).submit(runtime.ipc_close_mem_handle, buf.ptr).result()
                except CudaRuntimeError as exc:
                    log.warning("closing a staging buffer at exit failed: %s", exc)
        for pool in self._threads.values():
            pool.shutdown(wait=True)
        self._threads.clear()


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (0: unknown, taken as alive)."""
    return pid <= 0 or pid_alive(pid)
