"""The daemon's side of mode "ipc" (ckptd.daemon.handoff.gpu_ipc) on CPU.

Two stand-ins: `FakeRuntime` below replaces the whole CudaRuntime wrapper (call bookkeeping);
tests/fakecuda.py replaces only the CUDA runtime library under the REAL wrapper and enforces
CUDA's rules (a copy inside one registration, 64-byte handles with zero bytes). The tests
marked "(H100)" failed on the code before the fix of both GPU bugs (commit 658e943).
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

import fakecuda  # tests/fakecuda.py (tests/conftest.py puts tests/ on the import path)
from ckptd.common.cudart import CudaRuntime, CudaRuntimeError, IpcMemHandle
from ckptd.daemon.handoff.arena import Arena
from ckptd.daemon.errors import Aborted, InvalidRequest, NotFound
from ckptd.daemon.handoff.gpu_ipc import GpuStaging, StagedRange

UUID_A = "a" * 32
UUID_B = "b" * 32


class FakeRuntime:
    """Two GPUs; "device memory" is host memory; handles name buffers; every call is recorded."""

    path = "fake-libcudart"

    def __init__(self) -> None:
        self.buffers: dict[bytes, ctypes.Array] = {}
        self.calls: list[tuple] = []
        self.current = -1

    def device_count(self) -> int:
        return 2

    def device_uuid(self, index: int) -> str:
        return (UUID_A, UUID_B)[index]

    def set_device(self, index: int) -> None:
        self.current = index

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        self.calls.append(("open", self.current))
        if handle not in self.buffers:
            raise CudaRuntimeError("cudaIpcOpenMemHandle failed: error 201 (invalid device context)", 201)
        return ctypes.addressof(self.buffers[handle])

    def ipc_close_mem_handle(self, ptr: int) -> None:
        self.calls.append(("close", ptr))

    def memcpy_d2h(self, dst: int, src: int, nbytes: int) -> None:
        self.calls.append(("memcpy", nbytes))
        ctypes.memmove(dst, src, nbytes)

    def host_register(self, ptr: int, nbytes: int) -> bool:
        self.calls.append(("register", nbytes))
        return True

    def host_unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr))


def run(coro):  # noqa: ANN001, ANN201 - a tiny helper for async calls
    return asyncio.run(coro)


def test_open_matches_the_gpu_by_uuid_and_drains_ranges_into_the_arena(tmp_path: Path) -> None:
    rt = FakeRuntime()
    rt.buffers[b"h" * 64] = (ctypes.c_char * 8192).from_buffer_copy(bytes(range(256)) * 32)
    staging = GpuStaging(lambda: rt)  # type: ignore[arg-type, return-value]
    arena = Arena(tmp_path / "ckptd-1-job-s0-g1-r0", 16384)

    async def scenario() -> None:
        staging_id, reason = await staging.open("job", 0, UUID_B, b"h" * 64, 8192, os.getpid())
        assert reason == "" and staging_id
        assert ("open", 1) in rt.calls  # the daemon's index of GPU b, whatever the trainer calls it
        ranges = [StagedRange(0, 4096, 100), StagedRange(4096, 0, 256)]
        await staging.drain("job", 0, staging_id, arena, ranges)
        await staging.drain("job", 0, staging_id, arena, ranges)  # the arena is page-locked once
        assert bytes(arena.view(4096, 100)) == bytes(range(100))
        assert bytes(arena.view(0, 256)) == bytes(range(256))
        assert [c for c in rt.calls if c[0] == "register"] == [("register", 16384)]
        with pytest.raises(InvalidRequest, match="outside"):
            await staging.drain("job", 0, staging_id, arena, [StagedRange(8000, 0, 500)])
        with pytest.raises(NotFound, match="no open staging buffer"):
            await staging.drain("job", 1, staging_id, arena, ranges)  # another rank's id
        await staging.close("job", 0, staging_id)
        assert staging.buffers == {}

    run(scenario())
    arena.close()
    assert any(c[0] == "unregister" for c in rt.calls)  # unlocked before unmapping
    staging.shutdown()


def test_reasons_instead_of_errors_when_ipc_cannot_work() -> None:
    rt = FakeRuntime()

    def no_runtime():  # noqa: ANN202
        raise CudaRuntimeError("no CUDA runtime library (libcudart) could be loaded; tried: libcudart.so")

    async def scenario() -> None:
        _, reason = await GpuStaging(no_runtime).open("job", 0, UUID_A, b"h" * 64, 10, 1)
        assert "cannot use CUDA" in reason and "libcudart" in reason
        staging = GpuStaging(lambda: rt)  # type: ignore[arg-type, return-value]
        _, reason = await staging.open("job", 0, "c" * 32, b"h" * 64, 10, 1)
        assert "does not see the trainer's GPU" in reason and UUID_A in reason
        _, reason = await staging.open("job", 0, UUID_A, b"?" * 64, 10, 1)  # e.g. another PID namespace
        assert "invalid device context" in reason and "hostPID" in reason
        staging.shutdown()

    run(scenario())


def test_a_rank_that_opens_a_new_buffer_closes_its_old_one() -> None:
    rt = FakeRuntime()
    rt.buffers[b"1" * 64] = (ctypes.c_char * 64)()
    rt.buffers[b"2" * 64] = (ctypes.c_char * 128)()
    staging = GpuStaging(lambda: rt)  # type: ignore[arg-type, return-value]

    async def scenario() -> None:
        first, _ = await staging.open("job", 3, UUID_A, b"1" * 64, 64, 1)
        second, _ = await staging.open("job", 3, UUID_A, b"2" * 64, 128, 1)
        assert list(staging.buffers) == [second] and first != second
        assert sum(c[0] == "close" for c in rt.calls) == 1

    run(scenario())
    staging.shutdown()
    assert sum(c[0] == "close" for c in rt.calls) == 2  # and the rest at exit


def test_buffers_of_dead_trainers_are_closed() -> None:
    rt = FakeRuntime()
    rt.buffers[b"1" * 64] = (ctypes.c_char * 64)()
    rt.buffers[b"2" * 64] = (ctypes.c_char * 64)()
    dead = subprocess.Popen(["true"])
    dead.wait()
    staging = GpuStaging(lambda: rt)  # type: ignore[arg-type, return-value]

    async def scenario() -> None:
        await staging.open("job", 0, UUID_A, b"1" * 64, 64, dead.pid)
        alive, _ = await staging.open("job", 1, UUID_A, b"2" * 64, 64, os.getpid())  # reaps rank 0's
        assert list(staging.buffers) == [alive]

    run(scenario())
    staging.shutdown()


def test_the_buffers_a_client_opened_are_closed_when_it_ends_and_no_other() -> None:
    """A trainer killed never closes its buffer; the mapping keeps its GPU memory allocated
    until the daemon closes it: at the end of its client (its Attach call), not its next save."""
    rt = FakeRuntime()
    for handle in (b"1" * 64, b"2" * 64, b"3" * 64, b"4" * 64):
        rt.buffers[handle] = (ctypes.c_char * 64)()
    staging = GpuStaging(lambda: rt)  # type: ignore[arg-type, return-value]
    pid = os.getpid()  # alive: only the client's end closes its buffer

    async def scenario() -> None:
        gone, _ = await staging.open("job", 0, UUID_A, b"1" * 64, 64, pid, "client0a")
        other, _ = await staging.open("job", 1, UUID_A, b"2" * 64, 64, pid, "client1a")
        other_job, _ = await staging.open("job2", 0, UUID_A, b"3" * 64, 64, pid, "client0a")
        unnamed, _ = await staging.open("job", 2, UUID_A, b"4" * 64, 64, pid)  # a client older than client ids
        await staging.client_gone("job", "client0a")
        assert set(staging.buffers) == {other, other_job, unnamed} and gone not in staging.buffers
        assert [c for c in rt.calls if c[0] == "close"] == [("close", ctypes.addressof(rt.buffers[b"1" * 64]))]
        await staging.client_gone("job", "")  # an unnamed client's end closes nothing
        assert set(staging.buffers) == {other, other_job, unnamed}

    run(scenario())
    staging.shutdown()


GIB = 1 << 30
MB = 1 << 20


class SparseArena:
    """What GpuStaging uses of an Arena, over a sparse file: an arena of more than 1 GiB that
    costs only the pages a test writes (a real Arena reserves and pre-faults all of them)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self.on_close: list[Callable[[], None]] = []
        with open(path, "w+b") as f:
            f.truncate(size)
            self._mmap = mmap.mmap(f.fileno(), size)

    def address(self) -> int:
        window = (ctypes.c_char * self.size).from_buffer(self._mmap)
        try:
            return ctypes.addressof(window)
        finally:
            del window

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._mmap)[offset : offset + nbytes]

    def close(self) -> None:
        for callback in self.on_close:
            callback()
        self._mmap.close()


def _strict_runtime() -> tuple[CudaRuntime, object]:
    """The real CudaRuntime wrapper over fakecuda's library, and that library."""
    lib = fakecuda.FakeCudaLib()
    runtime = CudaRuntime(lib, "fakecuda")  # type: ignore[arg-type]
    runtime._declare()
    return runtime, lib


def _exported(runtime: CudaRuntime, lib: object, nbytes: int) -> tuple[int, bytes]:
    """A trainer's staging buffer filled with a pattern, and its handle (all 64 bytes, read
    from the library directly: this test is about registration, not the handle's copy)."""
    ptr = runtime.malloc(nbytes)
    pattern = bytes(range(251)) * (nbytes // 251 + 1)
    ctypes.memmove(ptr, pattern, nbytes)
    raw = IpcMemHandle()
    assert lib.cudaIpcGetMemHandle(ctypes.byref(raw), ptr) == 0  # type: ignore[attr-defined]
    return ptr, ctypes.string_at(ctypes.addressof(raw), 64)


def test_an_arena_over_one_gib_is_registered_once_in_one_call_and_drained_across_its_first_gib(tmp_path: Path) -> None:
    """(H100) Registered in 1 GiB pieces, a drain across the first GiB failed: cudaMemcpy error 1."""
    runtime, lib = _strict_runtime()
    ptr, handle = _exported(runtime, lib, 4 * MB)
    staging = GpuStaging(lambda: runtime)
    arena = SparseArena(tmp_path / "ckptd-1-job-s0-g1-r0", GIB + 4 * MB)

    async def scenario() -> None:
        staging_id, reason = await staging.open("job", 0, lib.uuids[0].hex(), handle, 4 * MB, os.getpid())  # type: ignore[attr-defined]
        assert reason == "", reason
        for _ in range(3):  # three saves: the arena is registered at the first only
            await staging.drain("job", 0, staging_id, arena, [StagedRange(0, GIB - 2 * MB, 4 * MB)])
        await staging.close("job", 0, staging_id)

    run(scenario())
    assert bytes(arena.view(GIB - 2 * MB, 4 * MB)) == ctypes.string_at(ptr, 4 * MB)
    base = arena.address()
    assert lib.register_calls == [(base, GIB + 4 * MB)] and staging.registrations == 1  # type: ignore[attr-defined]
    arena.close()
    assert lib.unregister_calls == [base] and lib.registered == {}  # type: ignore[attr-defined]
    staging.shutdown()


def test_the_handle_arrives_whole_through_the_runtime_wrapper(tmp_path: Path) -> None:
    """(H100) The wrapper copied the handle as a C string: "got 0" (or 4) bytes, never 64."""
    runtime, lib = _strict_runtime()
    ptr = runtime.malloc(8192)
    handle = runtime.ipc_get_mem_handle(ptr)  # what the trainer sends
    assert len(handle) == 64 and handle[0] == 0 and handle[-1] == 0
    staging = GpuStaging(lambda: runtime)
    arena = Arena(tmp_path / "ckptd-1-job-s0-g1-r0", 8192)

    async def scenario() -> None:
        staging_id, reason = await staging.open("job", 0, lib.uuids[0].hex(), handle, 8192, os.getpid())  # type: ignore[attr-defined]
        assert reason == "", reason
        assert staging.buffers[staging_id].ptr == ptr
        ctypes.memmove(ptr, b"\x00\x01\x02\x03", 4)
        await staging.drain("job", 0, staging_id, arena, [StagedRange(0, 4096, 4)])
        assert bytes(arena.view(4096, 4)) == b"\x00\x01\x02\x03"

    run(scenario())
    arena.close()
    staging.shutdown()


def test_a_handle_that_is_not_64_bytes_is_refused_on_receipt() -> None:
    runtime, lib = _strict_runtime()
    staging = GpuStaging(lambda: runtime)

    async def scenario() -> None:
        with pytest.raises(InvalidRequest, match="must be the 64 bytes of a cudaIpcMemHandle_t, got 4 .*first zero byte"):
            await staging.open("job", 0, lib.uuids[0].hex(), b"\x00ab\x00", 4096, os.getpid())  # type: ignore[attr-defined]
        _, reason = await staging.open("job", 0, lib.uuids[0].hex(), fakecuda.ipc_handle(99, 1), 4096, os.getpid())  # type: ignore[attr-defined]
        assert "invalid resource handle" in reason  # 64 bytes, but no buffer of this process's

    run(scenario())
    staging.shutdown()


def test_a_drain_that_cuda_refuses_aborts_the_save_with_the_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Part of the arena registered by other code: the daemon cannot register it whole (712,
    logged), and the copy across that registration's edge is refused as on a GPU."""
    runtime, lib = _strict_runtime()
    ptr, handle = _exported(runtime, lib, 8192)
    staging = GpuStaging(lambda: runtime)
    arena = SparseArena(tmp_path / "ckptd-1-job-s0-g1-r0", 3 * 4096)
    lib.registered[arena.address() + 4096] = 4096  # type: ignore[attr-defined]  # another registration of part of it

    async def scenario() -> None:
        staging_id, _ = await staging.open("job", 0, lib.uuids[0].hex(), handle, 8192, os.getpid())  # type: ignore[attr-defined]
        with pytest.raises(Aborted, match=r"staging buffer to host memory failed: cudaMemcpy failed: error 1 \(invalid argument\)"):
            await staging.drain("job", 0, staging_id, arena, [StagedRange(0, 0, 8192)])

    run(scenario())
    assert "was already page-locked by other code" in caplog.text and staging.registrations == 0
    staging.shutdown()
