"""The few CUDA runtime calls that torch does not expose, through ctypes (mode "ipc").

Used by the client (allocate and export a device staging buffer) and by the daemon (open it,
copy it to host memory) — the daemon needs no CUDA build of torch for that, only the CUDA
runtime library. Nothing is loaded at import: `CudaRuntime.load()` finds the library on first
use and raises CudaRuntimeError with the reason when there is none (a CPU-only machine).

Every call checks its cudaError_t and raises CudaRuntimeError naming the call, the error code
and CUDA's own description.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
UUID_OFFSET = 256  # cudaDeviceProp: char name[256]; cudaUUID_t uuid; ...
PROPS_BYTES = 8192  # larger than any cudaDeviceProp so far (about 1 KiB)
MEMCPY_DEVICE_TO_HOST = 2
IPC_LAZY_ENABLE_PEER_ACCESS = 1
HOST_REGISTER_PORTABLE = 1
ERROR_MEMORY_ALLOCATION = 2
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call failed, or there is no CUDA runtime. `code` is the cudaError_t (-1: no runtime)."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


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
        handle = IpcMemHandle()
        self._check("cudaIpcGetMemHandle", self.lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)))
        return bytes(handle.reserved)

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise CudaRuntimeError(f"an IPC memory handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
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
        """Page-lock host memory; False if it already was."""
        code = self.lib.cudaHostRegister(ctypes.c_void_p(ptr), nbytes, HOST_REGISTER_PORTABLE)
        if code == ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            self.lib.cudaGetLastError()  # clear the sticky-free error so the next call does not see it
            return False
        self._check("cudaHostRegister", code)
        return True

    def host_unregister(self, ptr: int) -> None:
        self._check("cudaHostUnregister", self.lib.cudaHostUnregister(ctypes.c_void_p(ptr)))
