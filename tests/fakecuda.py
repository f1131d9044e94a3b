"""A strict CPU stand-in for CUDA: the rules ckptd depends on, enforced, so tests catch on CPU
what would fail on a GPU. Test code. The tests run with --import-mode=importlib, so test files
import it by path, once per process, under the name "fakecuda" (see `_fakecuda()` in
tests/client/test_cuda_copier_mocked.py).

Two layers over one state:

- `FakeCudaLib`: the CUDA runtime library (libcudart) as ckptd.common.cudart.CudaRuntime calls it
  through ctypes: the same function names and arguments, cudaError_t codes for answers,
  out-parameters filled through ctypes. The REAL wrapper runs on it (`FakeCuda.runtime`, or
  `CudaRuntime.load()` once installed), the copying out of IPC handles included.
- `FakeCuda`: torch.cuda as ckptd.client.cuda_copier and ckptd.client.staging_buffer use it: streams, events, the
  current stream, `Tensor.copy_` and `torch._foreach_copy_` between "device" and host tensors,
  `Tensor.is_cuda`, `Tensor.is_pinned`, `torch.as_tensor` of raw device memory, and
  `torch.cuda.cudart()`. `FakeCuda.install(monkeypatch)` puts all of it in place for one test.
- `SharedDeviceLib`: FakeCudaLib with its device memory in files, so that a real daemon in
  another process (tests/fake_gpu_daemon.py) opens a staging buffer's IPC handle, whole or not
  at all, and drains it: mode "ipc" end to end on CPU.

Rules enforced, with the error CUDA gives:

1. An asynchronous copy between device and host memory lies inside ONE registered host range,
   else `RuntimeError("CUDA error: invalid argument")` (cudaErrorInvalidValue) when it is issued.
   A synchronous cudaMemcpy whose host range touches a registration must lie inside one, else
   error 1 (both measured on an H100, where arenas registered in 1 GiB pieces broke every save
   over 1 GiB). Stricter than CUDA in one way: an asynchronous copy into pageable memory is
   refused (CUDA silently makes it synchronous; ckptd relies on pinned destinations).
2. Registration: cudaHostRegister of a range that overlaps a registered one answers 712
   (cudaErrorHostMemoryAlreadyRegistered), of 0 bytes 1; cudaHostUnregister of anything but
   a registered base answers 713. Every call is counted (`FakeCudaLib.register_calls`).
3. IPC handles are 64 bytes with zero bytes in them: the first, the last and one inside, so
   a copy that stops at a zero byte (a C string) or strips them is caught; an unknown or cut
   handle answers 400 (cudaErrorInvalidResourceHandle) in cudaIpcOpenMemHandle.
4. Streams run their work in order. Work queued on a stream after `wait_event(e)` or
   `wait_stream(s)` runs only after the work `e` (or `s`, then) was recorded behind. An event is
   done when the work before its last `record` ran; `query()` says whether, without waiting;
   `synchronize()` waits. An event never recorded is done (as in CUDA).

Model of time. Device work runs as soon as nothing holds it back; a test holds a stream with
`block(stream)` (a kernel that does not end until its `Gate` opens) and puts work on streams
with `launch`. The default stream stands for the host's own torch operations, which run at
once: work queued on it runs at once, and a wait on it (the fence: `current_stream().
wait_event(e)`) blocks the host until `e` is done, as a kernel queued after the fence would wait.

Device memory: CPU tensors marked with `to_device`, and memory from cudaMalloc (what
`torch.as_tensor` of a `__cuda_array_interface__` views). `is_cuda` is True for them; their
`.device` stays "cpu", so gathers of small tensors pack straight into the destination
(their bounce buffer is not exercised on CPU). `.contiguous()` of a device tensor is device
memory too; it and other torch operations on device tensors run on the host at once. cudaIpcOpenMemHandle gives back the exporter's own
address (one process plays both). Device memory is not freed by the caching allocator, so
record_stream is recorded and does nothing else.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
import torch

from ckptd.common.cudart import IPC_HANDLE_BYTES, UUID_OFFSET, CudaRuntime

SUCCESS = 0
INVALID_VALUE = 1
MEMORY_ALLOCATION = 2
INVALID_DEVICE = 101
INVALID_RESOURCE_HANDLE = 400
HOST_MEMORY_ALREADY_REGISTERED = 712
HOST_MEMORY_NOT_REGISTERED = 713
ERROR_STRINGS = {
    SUCCESS: b"no error",
    INVALID_VALUE: b"invalid argument",
    MEMORY_ALLOCATION: b"out of memory",
    INVALID_DEVICE: b"invalid device ordinal",
    INVALID_RESOURCE_HANDLE: b"invalid resource handle",
    HOST_MEMORY_ALREADY_REGISTERED: b"part or all of the requested memory range is already mapped",
    HOST_MEMORY_NOT_REGISTERED: b"pointer does not correspond to a registered memory region",
}
MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_DEVICE_TO_DEVICE = 1, 2, 3
WAIT_S = 30.0  # how long a wait may last before the stand-in calls it a hang

# torch's own functions, whatever is patched when this module is imported
_ORIG_COPY = torch._C.TensorBase.copy_
_ORIG_FOREACH_COPY = torch._C._VariableFunctions._foreach_copy_
_ORIG_AS_TENSOR = torch._C._VariableFunctions.as_tensor
_ORIG_CONTIGUOUS = torch._C.TensorBase.contiguous


def ipc_handle(seq: int, ptr: int) -> bytes:
    """The 64-byte IPC handle of the `seq`-th export (of address `ptr`): zero bytes first, last
    and inside, as real handles have."""
    head = b"\x00fakecuda\x00" + seq.to_bytes(8, "little") + ptr.to_bytes(8, "little")
    raw = head + b"\xa5" * (IPC_HANDLE_BYTES - len(head) - 1) + b"\x00"
    assert len(raw) == IPC_HANDLE_BYTES
    return raw


class _Fn:
    """A library function: callable, with the argtypes/restype attributes ctypes code sets."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self.argtypes: Any = None
        self.restype: Any = None

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)


def _int(arg: Any) -> int:
    """An integer argument as ctypes would pass it (c_void_p(None) is 0)."""
    if isinstance(arg, ctypes._SimpleCData):  # type: ignore[attr-defined]
        return int(arg.value or 0)
    return int(arg)


def _target(ref: Any) -> Any:
    """The object behind `ctypes.byref(obj)` (or the object itself)."""
    return getattr(ref, "_obj", ref)


class FakeCudaLib:
    """libcudart, strictly (see the module docstring). Device memory is host memory from ctypes.

    register_calls: (ptr, nbytes) of every successful cudaHostRegister; registered: the live
    registrations, base -> nbytes; memcpy_calls: (dst, src, nbytes) of every cudaMemcpy.
    """

    FUNCTIONS = (
        "cudaGetErrorString", "cudaGetLastError", "cudaGetDeviceCount", "cudaSetDevice",
        "cudaGetDeviceProperties", "cudaGetDeviceProperties_v2", "cudaMalloc", "cudaFree", "cudaMemcpy",
        "cudaHostRegister", "cudaHostUnregister", "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle",
    )

    def __init__(self, devices: int = 1, memory_bytes: int = 1 << 30) -> None:
        self.uuids = [bytes([0xA0 + i]) * 16 for i in range(devices)]
        self.memory_bytes = memory_bytes
        self.current = 0
        self.last_error = SUCCESS
        self.registered: dict[int, int] = {}
        self.register_calls: list[tuple[int, int]] = []
        self.unregister_calls: list[int] = []
        self.allocations: dict[int, ctypes.Array] = {}
        self.handles: dict[bytes, int] = {}
        self.opened: dict[int, int] = {}
        self.memcpy_calls: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()
        for name in self.FUNCTIONS:
            setattr(self, name, _Fn(getattr(self, "_" + name)))

    # ---------------------------------------------------------------- ranges

    def registration_of(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """The registration (base, nbytes) that holds all of [ptr, ptr + nbytes), or None."""
        for base, size in self.registered.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return base, size
        return None

    def registrations_touching(self, ptr: int, nbytes: int) -> list[tuple[int, int]]:
        return sorted((b, s) for b, s in self.registered.items() if b < ptr + nbytes and ptr < b + s)

    def host_copy_problem(self, ptr: int, nbytes: int, asynchronous: bool) -> str | None:
        """Why CUDA would refuse a copy to or from host range [ptr, ptr + nbytes), or None."""
        if nbytes == 0 or self.registration_of(ptr, nbytes) is not None:
            return None
        touching = self.registrations_touching(ptr, nbytes)
        if not touching and not asynchronous:
            return None  # a synchronous copy through pageable memory
        where = ", ".join(f"[{b:#x}, +{s})" for b, s in touching) or "none: pageable memory"
        kind = "an asynchronous" if asynchronous else "a"
        return f"{kind} copy of host range [{ptr:#x}, +{nbytes}) is not inside one registered range (registrations it touches: {where})"

    def device_range(self, ptr: int, nbytes: int) -> bool:
        """[ptr, ptr + nbytes) lies inside one cudaMalloc allocation."""
        return any(a <= ptr and ptr + nbytes <= a + len(buf) for a, buf in self.allocations.items())

    def _fail(self, code: int) -> int:
        self.last_error = code
        return code

    # ---------------------------------------------------------------- the library

    def _cudaGetErrorString(self, code: Any) -> bytes:  # noqa: N802 - CUDA's names
        return ERROR_STRINGS.get(_int(code), b"unknown error")

    def _cudaGetLastError(self) -> int:  # noqa: N802
        code, self.last_error = self.last_error, SUCCESS
        return code

    def _cudaGetDeviceCount(self, count: Any) -> int:  # noqa: N802
        _target(count).value = len(self.uuids)
        return SUCCESS

    def _cudaSetDevice(self, index: Any) -> int:  # noqa: N802
        if not 0 <= _int(index) < len(self.uuids):
            return self._fail(INVALID_DEVICE)
        self.current = _int(index)
        return SUCCESS

    def _cudaGetDeviceProperties(self, props: Any, index: Any) -> int:  # noqa: N802
        if not 0 <= _int(index) < len(self.uuids):
            return self._fail(INVALID_DEVICE)
        ctypes.memmove(ctypes.addressof(_target(props)) + UUID_OFFSET, self.uuids[_int(index)], 16)
        return SUCCESS

    _cudaGetDeviceProperties_v2 = _cudaGetDeviceProperties

    def _cudaMalloc(self, out: Any, nbytes: Any) -> int:  # noqa: N802
        n = _int(nbytes)
        used = sum(len(b) for b in self.allocations.values())
        if n <= 0 or used + n > self.memory_bytes:
            return self._fail(MEMORY_ALLOCATION if n > 0 else INVALID_VALUE)
        buf = (ctypes.c_ubyte * n)()
        self.allocations[ctypes.addressof(buf)] = buf
        _target(out).value = ctypes.addressof(buf)
        return SUCCESS

    def _cudaFree(self, ptr: Any) -> int:  # noqa: N802
        p = _int(ptr)
        if p == 0:
            return SUCCESS
        if p not in self.allocations:
            return self._fail(INVALID_VALUE)
        del self.allocations[p]
        return SUCCESS

    def _cudaMemcpy(self, dst: Any, src: Any, nbytes: Any, kind: Any) -> int:  # noqa: N802
        d, s, n, k = _int(dst), _int(src), _int(nbytes), _int(kind)
        device_sides = {MEMCPY_HOST_TO_DEVICE: (d,), MEMCPY_DEVICE_TO_HOST: (s,), MEMCPY_DEVICE_TO_DEVICE: (d, s)}.get(k)
        if device_sides is None or not all(self.device_range(p, n) for p in device_sides):
            return self._fail(INVALID_VALUE)
        host = {MEMCPY_HOST_TO_DEVICE: s, MEMCPY_DEVICE_TO_HOST: d}.get(k)
        if host is not None and self.host_copy_problem(host, n, asynchronous=False) is not None:
            return self._fail(INVALID_VALUE)
        ctypes.memmove(d, s, n)
        self.memcpy_calls.append((d, s, n))
        return SUCCESS

    def _cudaHostRegister(self, ptr: Any, nbytes: Any, flags: Any) -> int:  # noqa: N802
        p, n = _int(ptr), _int(nbytes)
        with self._lock:
            if p == 0 or n <= 0:
                return self._fail(INVALID_VALUE)
            if self.registrations_touching(p, n):
                return self._fail(HOST_MEMORY_ALREADY_REGISTERED)
            self.registered[p] = n
            self.register_calls.append((p, n))
        return SUCCESS

    def _cudaHostUnregister(self, ptr: Any) -> int:  # noqa: N802
        p = _int(ptr)
        with self._lock:
            if p not in self.registered:
                return self._fail(HOST_MEMORY_NOT_REGISTERED)
            del self.registered[p]
            self.unregister_calls.append(p)
        return SUCCESS

    def _cudaIpcGetMemHandle(self, out: Any, ptr: Any) -> int:  # noqa: N802
        p = _int(ptr)
        if p not in self.allocations:
            return self._fail(INVALID_VALUE)
        raw = ipc_handle(len(self.handles) + 1, p)
        self.handles[raw] = p
        ctypes.memmove(ctypes.addressof(_target(out)), raw, IPC_HANDLE_BYTES)
        return SUCCESS

    def _cudaIpcOpenMemHandle(self, out: Any, handle: Any, flags: Any) -> int:  # noqa: N802
        raw = ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)
        p = self.handles.get(raw)
        if p is None or p not in self.allocations:
            return self._fail(INVALID_RESOURCE_HANDLE)
        self.opened[p] = self.opened.get(p, 0) + 1
        _target(out).value = p
        return SUCCESS

    def _cudaIpcCloseMemHandle(self, ptr: Any) -> int:  # noqa: N802
        p = _int(ptr)
        if not self.opened.get(p):
            return self._fail(INVALID_VALUE)
        self.opened[p] -= 1
        return SUCCESS


class SharedDeviceLib(FakeCudaLib):
    """FakeCudaLib whose device memory lives in files of `directory`, so that ANOTHER process
    (a real daemon started with it: tests/bench/fake_gpu_daemon.py) opens an IPC handle exported
    here and reads the exporter's memory, as CUDA IPC does across processes. The rules stay:
    handles are 64 bytes with zero bytes first, last and inside; a handle that is not byte for
    byte one this library exported (cut at a zero byte, stripped) answers 400; cudaMemcpy checks
    the device range and the host registration as FakeCudaLib does."""

    def __init__(self, directory: str, devices: int = 1, memory_bytes: int = 1 << 30) -> None:
        super().__init__(devices, memory_bytes)
        self.directory = directory
        self._maps: dict[int, Any] = {}  # address -> the mmap behind it
        self._files: dict[int, int] = {}  # address of an allocation made here -> its file's number
        self._seq = 0

    def _map(self, name: str, nbytes: int | None) -> int:
        import mmap
        import os

        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if nbytes is not None else 0), 0o600)
        try:
            if nbytes is not None:
                os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        buf = (ctypes.c_ubyte * len(mm)).from_buffer(mm)
        ptr = ctypes.addressof(buf)
        self.allocations[ptr] = buf
        self._maps[ptr] = mm
        return ptr

    def _cudaMalloc(self, out: Any, nbytes: Any) -> int:  # noqa: N802
        n = _int(nbytes)
        used = sum(len(b) for b in self.allocations.values())
        if n <= 0 or used + n > self.memory_bytes:
            return self._fail(MEMORY_ALLOCATION if n > 0 else INVALID_VALUE)
        with self._lock:
            self._seq += 1
            ptr = self._map(f"dev-{self._seq}", n)
            self._files[ptr] = self._seq
        _target(out).value = ptr
        return SUCCESS

    def _cudaFree(self, ptr: Any) -> int:  # noqa: N802
        import os

        p = _int(ptr)
        code = super()._cudaFree(ptr)
        seq = self._files.pop(p, None)
        if code == SUCCESS and seq is not None:
            self._maps.pop(p, None)
            os.unlink(os.path.join(self.directory, f"dev-{seq}"))
        return code

    def _cudaIpcGetMemHandle(self, out: Any, ptr: Any) -> int:  # noqa: N802
        p = _int(ptr)
        seq = self._files.get(p)
        if seq is None:
            return self._fail(INVALID_VALUE)
        raw = ipc_handle(seq, p)
        self.handles[raw] = p
        ctypes.memmove(ctypes.addressof(_target(out)), raw, IPC_HANDLE_BYTES)
        return SUCCESS

    def _cudaIpcOpenMemHandle(self, out: Any, handle: Any, flags: Any) -> int:  # noqa: N802
        import os

        raw = ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)
        seq, exported = int.from_bytes(raw[10:18], "little"), int.from_bytes(raw[18:26], "little")
        if raw != ipc_handle(seq, exported) or not os.path.exists(os.path.join(self.directory, f"dev-{seq}")):
            return self._fail(INVALID_RESOURCE_HANDLE)
        with self._lock:
            p = self._map(f"dev-{seq}", None)
        self.opened[p] = 1
        _target(out).value = p
        return SUCCESS

    def _cudaIpcCloseMemHandle(self, ptr: Any) -> int:  # noqa: N802
        p = _int(ptr)
        if not self.opened.pop(p, 0):
            return self._fail(INVALID_VALUE)
        del self.allocations[p]  # the mapping itself goes with the last view of it
        self._maps.pop(p, None)
        return SUCCESS


class _TorchCudart:
    """`torch.cuda.cudart()` over the same library (cudaHostRegister and friends take ints)."""

    def __init__(self, lib: FakeCudaLib) -> None:
        self._lib = lib

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        return self._lib.cudaHostRegister(ptr, nbytes, flags)

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return self._lib.cudaHostUnregister(ptr)


@dataclass
class _Op:
    kind: str  # "run" (a kernel or a copy), "record", "wait", "gate"
    what: str
    fn: Callable[[], Any] | None = None
    event: "FakeEvent | None" = None
    generation: int = 0
    gate: "Gate | None" = None


class Gate:
    """What holds a stream back (see FakeCuda.block); `open()` lets it go on."""

    def __init__(self, cuda: "FakeCuda") -> None:
        self._cuda = cuda
        self._open = threading.Event()

    def is_open(self) -> bool:
        return self._open.is_set()

    def open(self) -> None:
        self._open.set()
        self._cuda.progress()


class FakeStream:
    """torch.cuda.Stream: work runs in order (see the module docstring)."""

    def __init__(self, cuda: "FakeCuda", name: str, host: bool = False) -> None:
        self.cuda, self.name, self.host = cuda, name, host
        self.ops: deque[_Op] = deque()

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"

    def wait_event(self, event: "FakeEvent") -> None:
        self._enqueue(_Op("wait", f"wait for {event.name}", event=event, generation=event.generation))

    def wait_stream(self, other: "FakeStream") -> None:
        event = FakeEvent(self.cuda)
        event.record(other)
        self.wait_event(event)

    def record_event(self, event: "FakeEvent | None" = None) -> "FakeEvent":
        event = event or FakeEvent(self.cuda)
        event.record(self)
        return event

    def query(self) -> bool:
        self.cuda.progress()
        return not self.ops

    def synchronize(self) -> None:
        self.cuda.wait_until(lambda: not self.ops, f"stream {self.name}")

    def _enqueue(self, op: _Op) -> None:
        with self.cuda.cond:
            self.ops.append(op)
        self.cuda.progress()
        if self.host:  # the host's own stream: what is queued on it runs before the host goes on
            self.cuda.wait_until(lambda: not self.ops, f"the host waiting for {op.what}")


class FakeEvent:
    """torch.cuda.Event (see the module docstring)."""

    count = 0

    def __init__(self, cuda: "FakeCuda", enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        FakeEvent.count += 1
        self.cuda = cuda
        self.name = f"event{FakeEvent.count}"
        self.blocking = blocking
        self.generation = 0  # records issued
        self.ran: set[int] = set()  # the records that ran (by generation)

    def reached(self, generation: int) -> bool:
        """Whether the `generation`-th record ran (0: never recorded, which counts as done)."""
        return generation == 0 or generation in self.ran

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        with self.cuda.cond:
            self.generation += 1
            generation = self.generation
        stream._enqueue(_Op("record", f"record {self.name}", event=self, generation=generation))

    def query(self) -> bool:
        self.cuda.progress()
        return self.reached(self.generation)

    def synchronize(self) -> None:
        generation = self.generation
        self.cuda.wait_until(lambda: self.reached(generation), f"{self.name}.synchronize()")

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.cuda.current_stream()).wait_event(self)


@dataclass
class CopyRecord:
    """A copy issued through the stand-in: kind "D2H", "H2D" or "D2D"; via "copy_" or "foreach"."""

    kind: str
    stream: str
    nbytes: int
    non_blocking: bool
    via: str


@dataclass
class FakeCuda:
    """torch.cuda and libcudart on CPU, strictly (see the module docstring).

    copies: every device copy issued; log: (stream, what) of the device work, in the order it
    ran; record_streams: (stream, data_ptr) of record_stream calls.
    """

    lib: FakeCudaLib = field(default_factory=FakeCudaLib)
    copies: list[CopyRecord] = field(default_factory=list)
    log: list[tuple[str, str]] = field(default_factory=list)
    record_streams: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.default = FakeStream(self, "default", host=True)
        self.streams: list[FakeStream] = [self.default]
        self._marked: list[tuple[int, int]] = []
        self._local = threading.local()
        self.runtime = CudaRuntime(self.lib, "fakecuda")  # type: ignore[arg-type]
        self.runtime._declare()
        self.errors: list[BaseException] = []

    # ---------------------------------------------------------------- memory

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark `tensor`'s storage as device memory; returns `tensor`."""
        storage = tensor.untyped_storage()
        self._marked.append((storage.data_ptr(), storage.nbytes()))
        return tensor

    def is_device(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        if ptr == 0:
            return False
        return any(a <= ptr and ptr + n <= a + m for a, m in self._marked) or self.lib.device_range(ptr, n)

    def contiguous(self, tensor: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        """Tensor.contiguous: the copy of a device tensor is device memory too (until it is freed)."""
        out = _ORIG_CONTIGUOUS(tensor, memory_format=memory_format)
        if out is not tensor and self.is_device(tensor):
            storage = out.untyped_storage()
            span = (storage.data_ptr(), storage.nbytes())
            self._marked.append(span)
            weakref.finalize(out, self._marked.remove, span)
        return out

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        n = tensor.numel() * tensor.element_size()
        return n > 0 and not self.is_device(tensor) and self.lib.registration_of(tensor.data_ptr(), n) is not None

    # ---------------------------------------------------------------- streams

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default

    def new_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        stream = FakeStream(self, f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def new_event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> FakeEvent:
        return FakeEvent(self, enable_timing, blocking, interprocess)

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream | None) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        if stream is not None:
            self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def block(self, stream: FakeStream) -> Gate:
        """Hold `stream`: what is queued on it from now on waits until the gate opens."""
        gate = Gate(self)
        stream._enqueue(_Op("gate", "gate", gate=gate))
        return gate

    def launch(self, stream: FakeStream, fn: Callable[[], Any], what: str = "kernel") -> None:
        """Queue `fn` on `stream` as a kernel."""
        stream._enqueue(_Op("run", what, fn=fn))

    def synchronize(self, device: Any = None) -> None:
        self.wait_until(lambda: all(not s.ops for s in self.streams), "torch.cuda.synchronize()")

    def progress(self) -> None:
        """Run every piece of device work that nothing holds back."""
        with self.cond:
            moved = True
            while moved:
                moved = False
                for stream in self.streams:
                    while stream.ops and self._ready(stream.ops[0]):
                        op = stream.ops.popleft()
                        if op.kind == "run" and op.fn is not None:
                            try:
                                op.fn()
                            except Exception as exc:  # a device fault: reported by the next wait
                                self.errors.append(exc)
                        elif op.kind == "record" and op.event is not None:
                            op.event.ran.add(op.generation)
                        self.log.append((stream.name, op.what))
                        moved = True
            self.cond.notify_all()

    @staticmethod
    def _ready(op: _Op) -> bool:
        if op.kind == "wait":
            return op.event is not None and op.event.reached(op.generation)
        if op.kind == "gate":
            return op.gate is not None and op.gate.is_open()
        return True

    def wait_until(self, done: Callable[[], bool], what: str) -> None:
        """Run device work until `done()`; raises TimeoutError after WAIT_S (a hang on a GPU)."""
        deadline = time.monotonic() + WAIT_S
        with self.cond:
            while True:
                self.progress()
                if self.errors:
                    raise RuntimeError(f"fakecuda: device work failed: {self.errors[0]!r}")
                if done():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    held = {s.name: [op.what for op in s.ops][:3] for s in self.streams if s.ops}
                    raise TimeoutError(f"fakecuda: {what} never completes; work held back: {held}")
                self.cond.wait(min(left, 0.005))

    # ---------------------------------------------------------------- copies

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False, via: str = "copy_") -> torch.Tensor:
        """Tensor.copy_: device copies go on the current stream, checked (rule 1)."""
        to_device, from_device = self.is_device(dst), self.is_device(src)
        if not (to_device or from_device):
            return _ORIG_COPY(dst, src, non_blocking=non_blocking)
        kind = "D2D" if to_device and from_device else ("H2D" if to_device else "D2H")
        nbytes = dst.numel() * dst.element_size()
        if kind != "D2D":
            host = dst if kind == "D2H" else src
            problem = self.lib.host_copy_problem(host.data_ptr(), host.numel() * host.element_size(), asynchronous=non_blocking)
            if problem is not None:
                raise RuntimeError(f"CUDA error: invalid argument\n(fakecuda: {problem})")
        stream = self.current_stream()
        self.copies.append(CopyRecord(kind, stream.name, nbytes, non_blocking, via))
        stream._enqueue(_Op("run", f"{kind} copy of {nbytes} bytes", fn=lambda: _ORIG_COPY(dst, src)))
        if not non_blocking:
            stream.synchronize()
        return dst

    def foreach_copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> None:
        """torch._foreach_copy_: each pair as `copy`, when device memory is involved."""
        if not any(self.is_device(t) for t in (*dsts, *srcs)):
            _ORIG_FOREACH_COPY(dsts, srcs, non_blocking=non_blocking)
            return
        if len(dsts) != len(srcs):
            raise RuntimeError(f"_foreach_copy_: {len(dsts)} destinations for {len(srcs)} sources")
        for d, s in zip(dsts, srcs):
            self.copy(d, s, non_blocking, via="foreach")

    def as_tensor(self, data: Any, dtype: Any = None, device: Any = None) -> torch.Tensor:
        """torch.as_tensor; of a __cuda_array_interface__: a view of that cudaMalloc'd memory."""
        face = getattr(data, "__cuda_array_interface__", None)
        if face is None:
            return _ORIG_AS_TENSOR(data, dtype=dtype, device=device)
        ptr, nbytes = face["data"][0], face["shape"][0]
        if face["typestr"] != "|u1" or len(face["shape"]) != 1 or not self.lib.device_range(ptr, nbytes):
            raise RuntimeError(f"fakecuda: __cuda_array_interface__ {face} is not a flat uint8 view of memory from cudaMalloc")
        return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), dtype=torch.uint8)

    # ---------------------------------------------------------------- installing

    def install(self, monkeypatch: pytest.MonkeyPatch, available: bool = True) -> "FakeCuda":
        """Put the stand-in in place of torch.cuda and libcudart for one test (undone after it).
        available: torch.cuda.is_available() answers True (for ckptd.client.cuda_copier.cuda_problem)."""
        fake = self

        class Props:
            uuid = type("Uuid", (), {"bytes": self.lib.uuids[0]})()

        monkeypatch.setattr(CudaRuntime, "load", staticmethod(lambda *args, **kwargs: fake.runtime))
        monkeypatch.setattr(torch.cuda, "cudart", lambda: _TorchCudart(fake.lib))
        if available:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "Stream", self.new_stream)
        monkeypatch.setattr(torch.cuda, "Event", self.new_event)
        monkeypatch.setattr(torch.cuda, "stream", self.use_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "device", lambda index=None: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "init", lambda: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.lib.current)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (fake.lib.memory_bytes, fake.lib.memory_bytes))
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: fake.is_device(t)), raising=False)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, device=None: fake.is_pinned(t))
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: fake.record_streams.append((s.name, t.data_ptr())))
        monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, non_blocking=False: fake.copy(t, src, non_blocking))
        monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, memory_format=torch.contiguous_format: fake.contiguous(t, memory_format))
        monkeypatch.setattr(torch, "_foreach_copy_", self.foreach_copy)
        monkeypatch.setattr(torch, "as_tensor", self.as_tensor)
        return self


class InFlightCuda(FakeCuda):
    """FakeCuda with two rules more, on memory that copies in flight use (the restore tests'
    stand-in, tests/client/test_cuda_restore.py; numbered apart from the module's rules):

    In-flight A. An asynchronous copy out of host memory reads it when it runs, not when it is issued:
       host bytes changed in between (a staging buffer refilled while its copy waits) are a
       device fault, `RuntimeError("fakecuda: host memory ... changed ...")`, raised by the next
       wait, where CUDA would silently copy the new bytes.
    In-flight B. Device memory that a copy still queued on a stream will write must not be read before that
       copy ran: a copy out of it, or a kernel `use(tensor)`, that runs first (on the host's
       stream: one issued first) raises `RuntimeError("fakecuda: ... read before ...")` (the stream
       order that makes targets safe to use is missing).

    pending_writes: op id -> (address, bytes, stream name) of copies into device memory not yet run.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pending_writes: dict[int, tuple[int, int, str]] = {}
        self._ids = 0

    def _writes_over(self, ptr: int, nbytes: int) -> list[int]:
        return [k for k, (p, n, _) in self.pending_writes.items() if p < ptr + nbytes and ptr < p + n]

    def _read_problem(self, tensor: torch.Tensor, before: list[int], what: str) -> str | None:
        """Why a read of `tensor` that ran now came too early: writes pending before it still are."""
        storage = tensor.untyped_storage()
        early = [k for k in self._writes_over(storage.data_ptr(), storage.nbytes()) if k in before]
        if not early:
            return None
        p, n, stream = self.pending_writes[early[0]]
        return (f"fakecuda: {what} of device memory [{p:#x}, +{n}) read before the copy on stream {stream} that writes it "
                "ran: the reading stream is not ordered after the copy (wait_event / wait_stream, or synchronize)")

    def use(self, tensor: torch.Tensor, what: str = "a kernel") -> None:
        """A kernel on the current stream reads `tensor` (device memory): in-flight rule B."""
        storage = tensor.untyped_storage()
        before = self._writes_over(storage.data_ptr(), storage.nbytes())

        def run() -> None:
            problem = self._read_problem(tensor, before, what)
            if problem is not None:
                raise RuntimeError(problem)

        stream = self.current_stream()
        if stream.host:  # the host's own stream runs it now: fail here, as the wrong values would be used here
            run()
        else:
            self.launch(stream, run, what)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False, via: str = "copy_") -> torch.Tensor:
        to_device, from_device = self.is_device(dst), self.is_device(src)
        if not (to_device or from_device):
            return super().copy(dst, src, non_blocking, via)
        nbytes = src.numel() * src.element_size()
        snapshot = ctypes.string_at(src.data_ptr(), nbytes) if non_blocking and not from_device and nbytes else None
        before = self._writes_over(src.untyped_storage().data_ptr(), src.untyped_storage().nbytes()) if from_device else []
        stream = self.current_stream()
        with self.cond:
            queued = len(stream.ops)
            out = super().copy(dst, src, non_blocking, via)
            op = stream.ops[-1] if len(stream.ops) > queued and stream.ops[-1].kind == "run" else None
            if op is None:  # it ran already
                problem = self._read_problem(src, before, "a copy") if from_device else None
                if problem is not None:
                    raise RuntimeError(problem)
                return out
            self._ids += 1
            key, inner = self._ids, op.fn
            if to_device:
                self.pending_writes[key] = (dst.data_ptr(), dst.numel() * dst.element_size(), stream.name)

            def run() -> None:
                self.pending_writes.pop(key, None)
                problem = self._read_problem(src, before, "a copy") if from_device else None
                if problem is not None:
                    raise RuntimeError(problem)
                if snapshot is not None and ctypes.string_at(src.data_ptr(), nbytes) != snapshot:
                    raise RuntimeError(f"fakecuda: host memory [{src.data_ptr():#x}, +{nbytes}) changed after an asynchronous "
                                       "copy out of it was issued and before it ran (a buffer reused while a copy still reads it)")
                if inner is not None:
                    inner()

            op.fn = run
        return out
