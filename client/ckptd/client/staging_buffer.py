"""Mode "ipc": a rank's long-lived device staging buffer, exported once to the daemon.

The buffer is allocated with cudaMalloc directly, outside torch's caching allocator, and its
CUDA IPC handle (the 64 raw bytes of cudaIpcMemHandle_t, zero bytes included; its length is
checked here before it is sent, and again by the daemon on receipt) is sent to the daemon once
(OpenStaging); the daemon opens it once and keeps it open. That avoids the traps of per-tensor handles
(research/ipc.md section 1): no ref-count files in /dev/shm, no interprocess event per share (and
the stream synchronization beyond 1000 of them), no blocks kept in limbo, no exposure of the
allocator's neighbouring blocks, and `expandable_segments:True` does not matter (its handles
would need pidfd_getfd, i.e. ptrace permission, in the daemon).

A save copies the rank's CUDA tensors device-to-device into the buffer, laid out exactly like
the rank's arena, and returns; the client tells the daemon which ranges to copy to the arena
once the copy-done event has fired, and the daemon does so in the background.

Imported lazily by the client; nothing happens at import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.common.cudart import ERROR_MEMORY_ALLOCATION, CudaRuntime, CudaRuntimeError, ipc_handle_problem

log = logging.getLogger("ckptd.client")


class IpcUnavailable(Exception):
    """Mode "ipc" cannot work here; `str(exc)` says why (the client falls back to "overlap")."""


def gpu_uuid(device: torch.device) -> str:
    """The UUID of `device` as 32 lowercase hex digits (how the daemon finds the same GPU,
    whatever CUDA_VISIBLE_DEVICES numbers it as on either side)."""
    uuid: Any = torch.cuda.get_device_properties(device).uuid
    raw = getattr(uuid, "bytes", None)
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        return bytes(raw).hex()
    text = str(uuid).lower().removeprefix("gpu-").replace("-", "")
    if len(text) != 32:
        raise IpcUnavailable(f"cannot read the UUID of {device} (torch reports {uuid!r})")
    return text


class _CudaArray:
    """Just enough of __cuda_array_interface__ for torch.as_tensor to view raw device memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2, "strides": None}


@dataclass
class DeviceStaging:
    """A device buffer of `nbytes` on `device`, exported as `handle` (exactly 64 raw bytes).

    tensor: a flat uint8 view of the buffer (the destination of the save's copies).
    staging_id: the daemon's id for it, once it has opened it (set by the client).
    """

    device: torch.device
    nbytes: int
    ptr: int
    handle: bytes
    uuid: str
    tensor: torch.Tensor
    runtime: CudaRuntime
    staging_id: str = ""

    @staticmethod
    def allocate(device: torch.device, nbytes: int, runtime: CudaRuntime | None = None) -> "DeviceStaging":
        """cudaMalloc `nbytes` on `device` and export it. Raises IpcUnavailable with the reason
        (no CUDA runtime library, no GPU memory left, export refused)."""
        if nbytes <= 0:
            raise ValueError(f"a staging buffer needs a positive size, got {nbytes}")
        try:
            rt = runtime or CudaRuntime.load()
        except CudaRuntimeError as exc:
            raise IpcUnavailable(str(exc)) from None
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            torch.cuda.init()
            try:
                rt.set_device(index)  # the same device in the runtime we call (torch's, or another copy)
                ptr = rt.malloc(nbytes)
            except CudaRuntimeError as exc:
                if exc.code == ERROR_MEMORY_ALLOCATION:
                    free, total = torch.cuda.mem_get_info(device)
                    raise IpcUnavailable(
                        f"no GPU memory left for a {nbytes / 2**30:.2f} GiB staging buffer on {device} "
                        f"({free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB)"
                    ) from None
                raise IpcUnavailable(f"cannot allocate the staging buffer: {exc}") from None
            try:
                handle = rt.ipc_get_mem_handle(ptr)
                problem = ipc_handle_problem(handle)  # before it is sent: the daemon would refuse it
                if problem is not None:
                    raise CudaRuntimeError(problem)
                tensor = torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
            except (CudaRuntimeError, RuntimeError, TypeError) as exc:
                rt.free(ptr)
                raise IpcUnavailable(f"cannot export the staging buffer: {exc}") from None
        return DeviceStaging(device, nbytes, ptr, handle, gpu_uuid(device), tensor, rt)

    def free(self) -> None:
        """Release the buffer. The daemon must have closed its mapping first (CloseStaging),
        or it goes when the daemon closes it."""
        if self.ptr:
            torch.cuda.synchronize(self.device)  # no copy into it may still be running
            self.tensor = torch.empty(0, dtype=torch.uint8)
            try:
                self.runtime.free(self.ptr)
            except CudaRuntimeError as exc:
                log.warning("could not free the staging buffer on %s: %s", self.device, exc)
            self.ptr = 0
