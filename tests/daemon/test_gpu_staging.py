"""The daemon's side of mode "ipc" (ckptd.daemon.gpu) with a CPU stand-in for the CUDA runtime."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from ckptd.common.cudart import CudaRuntimeError
from ckptd.daemon.arena import Arena
from ckptd.daemon.errors import InvalidRequest, NotFound
from ckptd.daemon import gpu
from ckptd.daemon.gpu import REGISTER_CHUNK, GpuStaging, StagedRange

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


def test_registration_chunks_are_at_most_one_gib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An arena is page-locked in pieces of REGISTER_CHUNK (1 GiB: larger single registrations
    fail on some drivers), and every piece is unlocked when the arena closes."""
    assert REGISTER_CHUNK == 1 << 30
    monkeypatch.setattr(gpu, "REGISTER_CHUNK", 4096)
    rt = FakeRuntime()
    rt.buffers[b"h" * 64] = (ctypes.c_char * 8192)()
    staging = GpuStaging(lambda: rt)  # type: ignore[arg-type, return-value]
    arena = Arena(tmp_path / "ckptd-1-job-s0-g1-r0", 4096 * 3 + 100)

    async def scenario() -> None:
        staging_id, _ = await staging.open("job", 0, UUID_A, b"h" * 64, 8192, os.getpid())
        await staging.drain("job", 0, staging_id, arena, [StagedRange(0, 0, 100)])
        await staging.close("job", 0, staging_id)

    run(scenario())
    assert [c for c in rt.calls if c[0] == "register"] == [("register", 4096)] * 3 + [("register", 100)]
    arena.close()
    assert len([c for c in rt.calls if c[0] == "unregister"]) == 4
    staging.shutdown()
