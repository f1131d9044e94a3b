"""ckptd.client.cuda_copier and ckptd.client.staging_buffer on a strict CPU stand-in for CUDA (tests/fakecuda.py).

The real thing is tested in test_cuda_copier.py (marked gpu). Here the REAL registration, copy, fence
and export code runs against fakecuda, which enforces the CUDA rules that code depends on: an
asynchronous copy stays inside one host registration, a mapping is registered once, IPC handles
are 64 raw bytes with zero bytes in them, streams and events order work as on a GPU. The tests
marked "(H100)" failed on the code before the fix of both GPU bugs (commit 658e943).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from pathlib import Path

import pytest
import torch

import fakecuda  # tests/fakecuda.py (tests/conftest.py puts tests/ on the import path)
from ckptd.client import cuda_copier as cuda_module

GIB = 1 << 30
MB = 1 << 20
PAGE = 4096


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a fakecuda.FakeCuda
    return fakecuda.FakeCuda().install(monkeypatch)


def _arena(tmp_path: Path, nbytes: int, name: str = "ckptd-1-job-s0-g1-r0") -> str:
    """A sparse file that plays an arena: only the pages a test writes cost memory or disk."""
    path = tmp_path / name
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return str(path)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------ the stand-in's own rules


def test_the_stand_in_refuses_what_cuda_refuses(cuda) -> None:  # noqa: ANN001
    from ckptd.common.cudart import CudaRuntimeError, register_host

    host = torch.zeros(4 * PAGE, dtype=torch.uint8)
    base = host.data_ptr()
    device = cuda.to_device(torch.arange(4 * PAGE, dtype=torch.int32).view(torch.uint8)[: 4 * PAGE])
    first = register_host(cuda.runtime, base, 2 * PAGE, "test memory")
    assert first.owned and cuda.lib.register_calls == [(base, 2 * PAGE)]
    # a second registration of an overlapping range: cudaErrorHostMemoryAlreadyRegistered
    assert cuda.lib.cudaHostRegister(base + PAGE, 2 * PAGE, 1) == fakecuda.HOST_MEMORY_ALREADY_REGISTERED
    assert cuda.runtime.host_register(base + PAGE, 2 * PAGE) is False and cuda.lib.last_error == 0  # cleared
    with pytest.raises(CudaRuntimeError, match="cudaHostUnregister failed: error 713"):
        cuda.runtime.host_unregister(base + PAGE)
    # asynchronous copies: inside one registration, or "invalid argument"
    host[: 2 * PAGE].copy_(device[: 2 * PAGE], non_blocking=True)
    with pytest.raises(RuntimeError, match="CUDA error: invalid argument"):
        host[PAGE : 3 * PAGE].copy_(device[: 2 * PAGE], non_blocking=True)  # half registered, half not
    with pytest.raises(RuntimeError, match="CUDA error: invalid argument"):
        host[2 * PAGE :].copy_(device[: 2 * PAGE], non_blocking=True)  # pageable
    host[2 * PAGE :].copy_(device[: 2 * PAGE])  # synchronous through pageable memory: allowed
    second = register_host(cuda.runtime, base + 2 * PAGE, 2 * PAGE, "test memory")
    with pytest.raises(RuntimeError, match="CUDA error: invalid argument"):
        host[PAGE : 3 * PAGE].copy_(device[: 2 * PAGE], non_blocking=True)  # across two registrations
    torch.cuda.synchronize()
    assert torch.equal(host[: 2 * PAGE], device[: 2 * PAGE]) and torch.equal(host[2 * PAGE :], device[: 2 * PAGE])
    first.close()
    second.close()
    assert cuda.lib.registered == {} and len(cuda.lib.register_calls) == 2


def test_ipc_handles_of_the_stand_in_have_zero_bytes_at_both_ends_and_inside(cuda) -> None:  # noqa: ANN001
    from ckptd.common.cudart import IpcMemHandle

    ptr = cuda.runtime.malloc(4096)
    raw = IpcMemHandle()
    assert cuda.lib.cudaIpcGetMemHandle(ctypes.byref(raw), ptr) == 0
    whole = ctypes.string_at(ctypes.addressof(raw), 64)
    assert whole[0] == 0 and whole[-1] == 0 and 0 in whole[1:-1] and whole in cuda.lib.handles
    assert ctypes.string_at(ctypes.addressof(raw)) == b""  # what a C-string copy would send


def test_streams_and_events_order_copies_as_cuda_does(cuda) -> None:  # noqa: ANN001
    from ckptd.common.cudart import register_host

    values = cuda.to_device(torch.zeros(1024))
    dst = torch.zeros(4096, dtype=torch.uint8)
    register_host(cuda.runtime, dst.data_ptr(), dst.numel(), "test memory")
    producer, side = torch.cuda.Stream(), torch.cuda.Stream()
    never_recorded = torch.cuda.Event()
    assert never_recorded.query()  # as in CUDA: an event never recorded is done
    gate = cuda.block(producer)  # a long kernel on the producer stream
    cuda.launch(producer, lambda: values.fill_(7.0), "fill 7")
    side.wait_stream(producer)
    with torch.cuda.stream(side):
        dst.copy_(_bytes(values), non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record(side)
    assert not done.query() and not side.query()  # queued behind the producer's kernel
    assert torch.all(dst == 0)
    threading.Timer(0.1, gate.open).start()
    done.synchronize()
    assert torch.all(dst.view(torch.float32) == 7.0)
    ran = [what for _, what in cuda.log]
    assert ran.index("fill 7") < ran.index("D2H copy of 4096 bytes")
    # a wait captures the event's last record at the time of the call
    later = torch.cuda.Event()
    gate = cuda.block(producer)
    later.record(producer)
    side.wait_event(later)
    cuda.launch(side, lambda: None, "after the wait")
    later.record(torch.cuda.Stream())  # recorded again, elsewhere: the side stream still waits for the first
    assert not side.query()
    gate.open()
    assert side.query()


# ------------------------------------------------------------------ pinned arenas (H100)


def test_an_arena_over_one_gib_is_registered_in_one_call_once_across_saves(cuda, tmp_path: Path) -> None:  # noqa: ANN001
    """(H100) An arena registered in 1 GiB pieces made every save over 1 GiB fail."""
    from ckptd.client._handoff.cuda import CudaBackend

    size = GIB + 4 * PAGE
    backend = CudaBackend()
    first = backend.host_view(_arena(tmp_path, size), size)
    for _ in range(20):  # saves after the first reuse the mapping and its registration
        assert backend.host_view(str(tmp_path / "ckptd-1-job-s0-g1-r0"), size) is first
    base = first.data_ptr()
    assert cuda.lib.register_calls == [(base, size)]
    backend.close()
    assert cuda.lib.unregister_calls == [base] and cuda.lib.registered == {}  # unregistered before unmapping


def test_a_copy_run_across_the_first_gib_of_an_arena_lands_inside_its_one_registration(cuda, tmp_path: Path) -> None:  # noqa: ANN001
    """(H100) Two tensors back to back in one storage, on either side of the arena's first GiB:
    one coalesced copy, which CUDA refuses if that GiB ends a registration."""
    from ckptd.client._handoff.cuda import CudaBackend

    size = GIB + 4 * MB
    flat = cuda.to_device(torch.randn(MB // 2))  # 2 MiB: two 1 MiB views
    first, second = flat[: MB // 4], flat[MB // 4 :]
    placements = [(first, GIB - MB, MB), (second, GIB, MB)]
    backend = CudaBackend()
    dst = backend.host_view(_arena(tmp_path, size), size)
    backend.copy(placements, dst, {0, 1}).wait()
    assert torch.equal(dst[GIB - MB : GIB + MB], _bytes(flat))
    assert [(c.kind, c.nbytes) for c in cuda.copies] == [("D2H", 2 * MB)]  # one coalesced run
    backend.close()


def test_errors_of_registration_say_what_and_where(cuda, tmp_path: Path) -> None:  # noqa: ANN001
    from ckptd.client.errors import CheckpointError

    path = _arena(tmp_path, 5 * PAGE)
    arenas = cuda_module.PinnedArenas()
    with pytest.raises(CheckpointError, match="it was replaced"):
        arenas.get(path, 6 * PAGE)
    mapping = arenas.get(path, 5 * PAGE)
    assert cuda.lib.cudaHostUnregister(mapping.host.data_ptr()) == 0  # someone else unlocked it
    arenas.close()  # the refusal is logged, the arena unmapped anyway
    cuda.lib.cudaHostRegister = fakecuda._Fn(lambda ptr, n, flags: cuda.lib._fail(fakecuda.MEMORY_ALLOCATION))
    with pytest.raises(CheckpointError, match=r"cannot page-lock arena .*ckptd-1-job-s0-g1-r0 \(20480 bytes in one cudaHostRegister call\).*error 2"):
        cuda_module.PinnedArenas().get(path)


def test_arenas_the_daemon_deleted_are_released(cuda, tmp_path: Path) -> None:  # noqa: ANN001
    arenas = cuda_module.PinnedArenas()
    gone = arenas.get(_arena(tmp_path, PAGE))
    (tmp_path / "ckptd-1-job-s0-g1-r0").unlink()
    arenas.get(_arena(tmp_path, PAGE, "ckptd-1-job-s1-g2-r0"))
    assert list(arenas._maps) == [str(tmp_path / "ckptd-1-job-s1-g2-r0")] and gone.registration is None
    arenas.close()
    assert cuda.lib.registered == {}


def test_a_new_file_under_an_arenas_name_is_mapped_and_registered_anew(cuda, tmp_path: Path) -> None:  # noqa: ANN001
    """A daemon restarted under the same pid makes its arenas under the names its earlier run
    used: the earlier file's mapping (the same size) must not be taken for the new one."""
    arenas = cuda_module.PinnedArenas()
    old = arenas.get(_arena(tmp_path, PAGE))
    assert arenas.get(str(tmp_path / "ckptd-1-job-s0-g1-r0")) is old  # the same file: the same mapping
    (tmp_path / "ckptd-1-job-s0-g1-r0").unlink()
    new = arenas.get(_arena(tmp_path, PAGE))
    assert new is not old and old.registration is None and arenas.registrations == 2
    arenas.close()
    assert cuda.lib.registered == {}


def test_with_registration_pieces_the_copies_are_split_at_their_boundaries(cuda) -> None:  # noqa: ANN001
    """ckptd registers arenas whole; should a destination ever be registered in pieces, the
    planner keeps every copy inside one (runs split, a non-contiguous tensor in two pieces)."""
    from ckptd.common.cudart import register_host

    dst = torch.zeros(8 * MB, dtype=torch.uint8)
    base = dst.data_ptr()
    for start, end in ((0, 2 * MB), (2 * MB, 4 * MB), (4 * MB, 8 * MB)):
        register_host(cuda.runtime, base + start, end - start, "a piece")
    flat = cuda.to_device(torch.randn(3 * MB // 4))  # 3 MiB: two views back to back
    first, second = flat[: 3 * MB // 8], flat[3 * MB // 8 :]
    strided = cuda.to_device(torch.randn(512, 512)).t()  # 1 MiB, not contiguous
    placements = [(first, MB // 2, 3 * MB // 2), (second, 2 * MB, 3 * MB // 2), (strided, 7 * MB // 2, MB)]
    copier = cuda_module.CudaCopier()
    with pytest.raises(RuntimeError, match="CUDA error: invalid argument"):
        copier.copy(placements, dst)  # no boundaries given: the merged run crosses a piece
    torch.cuda.synchronize()
    copier.copy(placements, dst, boundaries=(2 * MB, 4 * MB)).wait()
    assert torch.equal(dst[MB // 2 : 7 * MB // 2], _bytes(flat))
    assert torch.equal(dst[7 * MB // 2 : 9 * MB // 2], _bytes(strided))
    split = [c.nbytes for c in cuda.copies if c.kind == "D2H"][-4:]
    assert split == [3 * MB // 2, 3 * MB // 2, MB // 2, MB // 2]


# ------------------------------------------------------------------ copies, fences, cached plans


def test_the_copier_orders_its_side_stream_after_the_compute_stream_and_places_every_byte(cuda, tmp_path: Path) -> None:  # noqa: ANN001
    big = cuda.to_device(torch.arange(2 * MB // 4, dtype=torch.float32))  # large: its own copy
    small = [cuda.to_device(torch.full((n,), float(n))) for n in (3, 5)]  # gathered
    strided = cuda.to_device(torch.arange(12.0)).view(3, 4).t()  # not contiguous: a temporary
    tensors = [big, *small, strided]
    offsets = [0, 2 * MB, 2 * MB + 64, 2 * MB + PAGE]
    arenas = cuda_module.PinnedArenas()
    dst = arenas.get(_arena(tmp_path, 2 * MB + 2 * PAGE)).host
    copy = cuda_module.CudaCopier().copy([(t, o, t.numel() * 4) for t, o in zip(tensors, offsets)], dst)
    assert copy.operations == 4  # a run, a gather (2), a run
    copy.wait()
    for t, o in zip(tensors, offsets):
        assert torch.equal(dst[o : o + t.numel() * 4], _bytes(t))
    assert {name for name, what in cuda.log if what.startswith("D2H")} == {"side1"}
    side = [what for name, what in cuda.log if name == "side1"]
    assert side[0].startswith("wait for") and side[-1].startswith("record")  # after compute; then done
    assert cuda.record_streams == []  # the DeviceCopy keeps the sources alive instead, until done
    arenas.close()


def test_the_fence_holds_later_work_until_the_copy_is_done(cuda, tmp_path: Path) -> None:  # noqa: ANN001
    weights = cuda.to_device(torch.ones(2 * MB // 4))
    arenas = cuda_module.PinnedArenas()
    dst = arenas.get(_arena(tmp_path, 2 * MB)).host
    copier = cuda_module.CudaCopier()
    gate = cuda.block(copier.stream(weights.device))  # the copy stream is busy
    copy = copier.copy([(weights, 0, 2 * MB)], dst)
    assert not copy.events[weights.device].query()  # in flight: "overlap" would return here
    threading.Timer(0.2, gate.open).start()
    started = time.monotonic()
    copy.fence()  # the compute stream waits (on the stand-in: the host, which plays it)
    assert time.monotonic() - started >= 0.15
    weights.add_(1.0)  # the optimizer step, after the fence
    copy.wait()
    assert torch.all(dst.view(torch.float32) == 1.0) and torch.all(weights == 2.0)
    arenas.close()


def test_the_copy_plan_is_built_once_for_the_same_placements_and_rebuilt_when_they_change(
    cuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    large = [cuda.to_device(torch.zeros(2 * MB // 4)) for _ in range(2)]
    small = [cuda.to_device(torch.zeros(256)) for _ in range(50)]
    tensors = large + small
    placements, cursor = [], 0
    for t in tensors:
        placements.append((t, cursor, t.numel() * 4))
        cursor += -(-t.numel() * 4 // PAGE) * PAGE
    arenas = cuda_module.PinnedArenas()
    dsts = [arenas.get(_arena(tmp_path, cursor, f"ckptd-1-job-s{i}-g1-r0")).host for i in range(2)]
    items_made: list[tuple] = []
    real_item_of = cuda_module.item_of
    monkeypatch.setattr(cuda_module, "item_of", lambda *a: items_made.append(a) or real_item_of(*a))
    copier = cuda_module.CudaCopier()
    everything = set(range(len(tensors)))
    for step in range(6):
        for t in tensors:
            t.fill_(float(step))  # the values change from save to save, the structure does not
        before = len(cuda.copies)
        copier.copy(placements, dsts[step % 2], set(everything)).wait()  # a new, equal `only` each time
        issued = cuda.copies[before:]
        assert sum(c.via == "copy_" for c in issued) == 2  # per save: one copy per run...
        assert sum(c.via == "foreach" for c in issued) == 50  # ...and one pack of the small ones
        for _t, off, n in placements:
            assert torch.all(dsts[step % 2][off : off + n].view(torch.float32) == float(step))
    assert copier.plans_built == 2  # one per arena
    assert len(items_made) == 2 * len(tensors)  # no per-tensor planning on the cached saves
    copier.copy(list(placements), dsts[0], everything).wait()  # another placements object
    assert copier.plans_built == 3
    copier.copy(placements, dsts[0], everything).wait()  # and back: the cache was dropped
    assert copier.plans_built == 4
    copier.copy(placements, dsts[0], {0}).wait()  # another `only`
    assert copier.plans_built == 5
    swapped = cuda.to_device(torch.full((2 * MB // 4,), 9.0))
    large[0].data = swapped  # a storage swapped under the same tensor object
    copier.copy(placements, dsts[0], everything).wait()
    assert copier.plans_built == 6 and torch.all(dsts[0][: 2 * MB].view(torch.float32) == 9.0)
    arenas.close()


def test_cuda_problem_on_a_cpu_build() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert "CUDA is not available" in (cuda_module.cuda_problem() or "")


# ------------------------------------------------------------------ staging buffers (mode "ipc")


def test_a_staging_buffer_exports_the_whole_64_byte_handle(cuda) -> None:  # noqa: ANN001
    """(H100) The handle was cut at its first zero byte, so "ipc" never worked."""
    from ckptd.client.staging_buffer import DeviceStaging

    staging = DeviceStaging.allocate(torch.device("cuda", 0), 4096)
    assert len(staging.handle) == 64 and staging.handle in cuda.lib.handles
    assert staging.handle[0] == 0 and staging.handle[-1] == 0
    assert staging.uuid == cuda.lib.uuids[0].hex()
    assert staging.tensor.is_cuda and staging.tensor.numel() == 4096
    staging.tensor.fill_(7)
    assert bytes(cuda.lib.allocations[staging.ptr])[:4] == b"\x07" * 4  # the view is of the exported memory
    staging.free()
    staging.free()  # twice is harmless
    assert cuda.lib.allocations == {}


def test_a_handle_that_is_not_64_bytes_is_never_sent(cuda, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from ckptd.client.staging_buffer import DeviceStaging, IpcUnavailable
    from ckptd.common.cudart import CudaRuntime

    monkeypatch.setattr(CudaRuntime, "ipc_get_mem_handle", lambda self, ptr: b"\x07" * 4)
    with pytest.raises(IpcUnavailable, match="must be the 64 bytes of a cudaIpcMemHandle_t, got 4"):
        DeviceStaging.allocate(torch.device("cuda", 0), 4096)
    assert cuda.lib.allocations == {}  # freed


def test_no_gpu_memory_for_the_staging_buffer_is_a_fallback_reason(cuda) -> None:  # noqa: ANN001
    from ckptd.client.staging_buffer import DeviceStaging, IpcUnavailable

    with pytest.raises(IpcUnavailable, match=r"no GPU memory left for a 2.00 GiB staging buffer on cuda:0 \(1.00 GiB free of 1.00 GiB\)"):
        DeviceStaging.allocate(torch.device("cuda", 0), 2 * GIB)
    with pytest.raises(ValueError, match="positive size"):
        DeviceStaging.allocate(torch.device("cuda", 0), 0)


def test_without_a_usable_cuda_runtime_ipc_is_unavailable_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.client.staging_buffer import DeviceStaging, IpcUnavailable
    from ckptd.common.cudart import CudaRuntime

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    # no libcudart at all, or one without a driver (error 35): either way a reason, not a crash
    with pytest.raises(IpcUnavailable, match="libcudart|cudaSetDevice failed"):
        DeviceStaging.allocate(torch.device("cuda", 0), 4096)
    with pytest.raises(Exception, match="tried"):
        CudaRuntime.load(lambda: ["/nonexistent/libcudart.so.12"])


# ------------------------------------------------------------------ device memory another process opens


def test_shared_device_memory_opens_in_another_library_only_by_the_whole_handle(tmp_path: Path) -> None:
    from ckptd.common.cudart import CudaRuntimeError

    exporter = fakecuda.FakeCuda(lib=fakecuda.SharedDeviceLib(str(tmp_path))).runtime  # the trainer
    importer = fakecuda.FakeCuda(lib=fakecuda.SharedDeviceLib(str(tmp_path))).runtime  # the daemon: another process
    ptr = exporter.malloc(8192)
    ctypes.memmove(ptr, bytes(range(256)) * 32, 8192)
    handle = exporter.ipc_get_mem_handle(ptr)
    assert len(handle) == 64 and handle[0] == 0 and handle[-1] == 0 and 0 in handle[1:-1]
    opened = importer.ipc_open_mem_handle(handle)
    assert opened != ptr and ctypes.string_at(opened, 8192) == bytes(range(256)) * 32  # the exporter's bytes
    ctypes.memmove(ptr, b"\x07" * 16, 16)
    assert ctypes.string_at(opened, 16) == b"\x07" * 16  # the same memory, not a copy
    host = torch.zeros(8192, dtype=torch.uint8)
    importer.memcpy_d2h(host.data_ptr(), opened, 8192)
    assert bytes(host[:16].tolist()) == b"\x07" * 16
    for cut in (handle.split(b"\x00")[0].ljust(64, b"\x00"), handle[:-1] + b"\x01", bytes(64)):  # a C-string copy, a changed byte, zeros
        with pytest.raises(CudaRuntimeError, match="error 400"):
            importer.ipc_open_mem_handle(cut)
    importer.ipc_close_mem_handle(opened)
    exporter.free(ptr)
    with pytest.raises(CudaRuntimeError, match="error 400"):  # freed by the exporter: its handle is dead
        importer.ipc_open_mem_handle(handle)
    assert list(tmp_path.iterdir()) == []
