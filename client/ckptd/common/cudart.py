"""The few CUDA runtime calls that torch does not expose, through ctypes.

Used by the client (page-lock its arena mappings; allocate and export a device staging buffer
for mode "ipc") and by the daemon (page-lock its arena mappings; open the staging buffer and
copy it to host memory) — the daemon needs no CUDA build of torch for that, only the CUDA
runtime library. Nothing is loaded at import: `CudaRuntime.load()` finds the library on first
use and raises CudaRuntimeError with the reason when there is none (a CPU-only machine).

Every call checks its cudaError_t and raises CudaRuntimeError naming the call, the error code
and CUDA's own description.

Two rules of CUDA that this module is the one place to get right (both broke on an H100):

- `register_host` page-locks a mapping in ONE cudaHostRegister call. An asynchronous copy (and
  a cudaMemcpy into registered memory) may not span two registrations: CUDA answers
  `invalid argument`. So never register in pieces, and register once per mapping (it is slow,
  about 0.1 s/GiB, and blocks the other CUDA calls of the process while it runs).
- A cudaIpcMemHandle_t is 64 raw bytes that often contain zero bytes: it is copied out whole
  (`ctypes.string_at`), never as a C string, and its length is checked at both ends
  (`ipc_handle_problem`).

tests/fakecuda.py is a strict stand-in for the library under this wrapper (CPU tests).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
UUID_OFFSET = 256  # cudaDeviceProp: char name[256]; cudaUUID_t uuid; ...
PROPS_BYTES = 8192  # larger than any cudaDeviceProp so far (about 1 KiB)
MEMCPY_DEVICE_TO_HOST = 2
IPC_LAZY_ENABLE_PEER_ACCESS = 1
HOST_REGISTER_PORTABLE = 1
ERROR_INVALID_VALUE = 1  # cudaErrorInvalidValue: "invalid argument"
ERROR_MEMORY_ALLOCATION = 2
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
ERROR_HOST_MEMORY_NOT_REGISTERED = 713


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call failed, or there is no CUDA runtime. `code` is the cudaError_t (-1: no runtime)."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t. Bytes, not chars: a `c_char` array reads as a C string and stops at
    the first zero byte, which a handle usually contains."""

    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


def ipc_handle_problem(handle: bytes) -> str | None:
    """What is wrong with `handle` as a cudaIpcMemHandle_t, or None when it has its 64 bytes.
    Checked where a handle is made (client, before sending it) and where it arrives (daemon)."""
    if len(handle) == IPC_HANDLE_BYTES:
        return None
    return (
        f"ipc_handle must be the {IPC_HANDLE_BYTES} bytes of a cudaIpcMemHandle_t, got {len(handle)} "
        "(copied as a C string, which stops at the first zero byte? copy all 64 bytes)"
    )


def _candidates() -> list[str]:
    """Where libcudart may be: the copy this process already loaded (torch's), the one of the
    nvidia-cuda-runtime wheel, then the loader's search path."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass  # not Linux: fall through to the search path
    spec = importlib.util.find_spec("nvidia.cuda_runtime") if importlib.util.find_spec("nvidia") else None
    for location in (spec.submodule_search_locations or []) if spec else []:
        found += sorted(glob.glob(os.path.join(location, "lib", "libcudart.so*")), reverse=True)
    by_name = ctypes.util.find_library("cudart")
    if by_name:
        found.append(by_name)
    found += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    return found


@dataclass(frozen=True)
class CudaRuntime:
    """A loaded libcudart. Methods are thin and synchronous; call them from one thread per device."""

    lib: ctypes.CDLL
    path: str

    @staticmethod
    def load(candidates: Callable[[], list[str]] = _candidates) -> "CudaRuntime":
        """Load the CUDA runtime library; raises CudaRuntimeError listing what was tried."""
        tried = []
        for path in candidates():
            try:
                lib = ctypes.CDLL(path)
            except OSError as exc:
                tried.append(f"{path} ({exc})")
                continue
            runtime = CudaRuntime(lib, path)
            runtime._declare()
            return runtime
        raise CudaRuntimeError("no CUDA runtime library (libcudart) could be loaded; tried: " + "; ".join(tried[:6]))

    def _declare(self) -> None:
        lib = self.lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcMemHandle, ctypes.c_uint]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcMemHandle), ctypes.c_void_p]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]

    def _check(self, name: str, code: int) -> None:
        if code != 0:
            text = self.lib.cudaGetErrorString(code)
            raise CudaRuntimeError(f"{name} failed: error {code} ({text.decode() if text else 'unknown'})", code)

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self._check("cudaGetDeviceCount", self.lib.cudaGetDeviceCount(ctypes.byref(count)))
        return count.value

    def set_device(self, index: int) -> None:
        self._check("cudaSetDevice", self.lib.cudaSetDevice(index))

    def device_uuid(self, index: int) -> str:
        """The UUID of visible device `index` as 32 lowercase hex digits."""
        props = ctypes.create_string_buffer(PROPS_BYTES)
        getter = getattr(self.lib, "cudaGetDeviceProperties_v2", None) or self.lib.cudaGetDeviceProperties
        getter.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._check("cudaGetDeviceProperties", getter(props, index))
        return props.raw[UUID_OFFSET : UUID_OFFSET + 16].hex()

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check("cudaMalloc", self.lib.cudaMalloc(ctypes.byref(ptr), nbytes))
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self.lib.cudaFree(ctypes.c_void_p(ptr)))

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        """The CUDA IPC handle of device allocation `ptr`: its 64 raw bytes, zero bytes included."""
        handle = IpcMemHandle()
        self._check("cudaIpcGetMemHandle", self.lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)))
        raw = ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)
        problem = ipc_handle_problem(raw)
        if problem is not None:  # cannot happen with string_at; kept as the contract's check
            raise CudaRuntimeError(problem)
        return raw

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        """Map another process's device allocation; returns its address in this process."""
        problem = ipc_handle_problem(handle)
        if problem is not None:
            raise CudaRuntimeError(problem, ERROR_INVALID_VALUE)
        raw = IpcMemHandle()
        ctypes.memmove(ctypes.byref(raw), handle, IPC_HANDLE_BYTES)
        ptr = ctypes.c_void_p()
        self._check("cudaIpcOpenMemHandle", self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, IPC_LAZY_ENABLE_PEER_ACCESS))
        return int(ptr.value or 0)

    def ipc_close_mem_handle(self, ptr: int) -> None:
        self._check("cudaIpcCloseMemHandle", self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)))

    def memcpy_d2h(self, dst: int, src: int, nbytes: int) -> None:
        """Synchronous device-to-host copy (returns when the bytes are in host memory)."""
        self._check("cudaMemcpy", self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes, MEMCPY_DEVICE_TO_HOST))

    def host_register(self, ptr: int, nbytes: int) -> bool:
        """Page-lock `nbytes` of host memory at `ptr` in one cudaHostRegister call (portable: for
        every context of the process); False if (part of) it already was registered. Use
        `register_host`, which also times and logs it."""
        code = self.lib.cudaHostRegister(ctypes.c_void_p(ptr), nbytes, HOST_REGISTER_PORTABLE)
        if code != 0:
            self.lib.cudaGetLastError()  # reset this thread's last error, or torch's next launch check reports it
        if code == ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            return False
        self._check("cudaHostRegister", code)
        return True

    def host_unregister(self, ptr: int) -> None:
        """Unlock memory page-locked by `host_register(ptr, ...)` (the same `ptr`)."""
        code = self.lib.cudaHostUnregister(ctypes.c_void_p(ptr))
        if code != 0:
            self.lib.cudaGetLastError()
        self._check("cudaHostUnregister", code)


@dataclass
class HostRegistration:
    """Host memory page-locked by `register_host`: `nbytes` at `ptr`, in one registration.

    owned: this registration made it (and `close` undoes it); False when the memory was already
    registered by other code of the process (then it is left alone) or `nbytes` is 0.
    seconds: how long cudaHostRegister took.
    """

    runtime: CudaRuntime
    ptr: int
    nbytes: int
    owned: bool
    seconds: float = 0.0

    def close(self) -> None:
        """Unregister (once; a no-op when not owned). Call it before the memory is unmapped.
        Raises CudaRuntimeError when CUDA refuses."""
        if self.owned:
            self.owned = False
            self.runtime.host_unregister(self.ptr)


def register_host(runtime: CudaRuntime, ptr: int, nbytes: int, what: str) -> HostRegistration:
    """Page-lock the whole mapping of `nbytes` at `ptr` in ONE cudaHostRegister call.

    Call it once per mapping, when the mapping is made, never per save. Never register a mapping
    in pieces: one asynchronous copy may not span two registrations (CUDA: `invalid argument`).
    `what` names the memory in messages (e.g. "arena /dev/shm/ckptd-..."). Raises
    CudaRuntimeError saying what could not be page-locked.
    """
    if nbytes <= 0:
        return HostRegistration(runtime, ptr, 0, False)
    started = time.perf_counter()
    try:
        owned = runtime.host_register(ptr, nbytes)
    except CudaRuntimeError as exc:
        raise CudaRuntimeError(
            f"cannot page-lock {what} ({nbytes} bytes in one cudaHostRegister call): {exc}. "
            "Is host memory short, or is the process limited by its container (memory limit, locked memory)?",
            exc.code,
        ) from None
    seconds = time.perf_counter() - started
    if not owned:
        log.warning(
            "%s was already page-locked by other code of this process: using that registration (device copies "
            "into it fail with 'invalid argument' unless one registration covers each of them)", what,
        )
    else:
        log.debug("page-locked %s: %.2f GiB in %.3f s", what, nbytes / 2**30, seconds)
    return HostRegistration(runtime, ptr, nbytes, owned, seconds)
