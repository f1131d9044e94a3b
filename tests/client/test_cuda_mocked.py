"""ckptd.client.cuda with stand-ins for the CUDA calls: the control flow runs on CPU.

The real thing is tested in test_cuda.py (marked gpu). Here torch.cuda's streams, events and
cudart are replaced by recorders and CPU tensors pretend to be CUDA tensors, so every line of
the registration, copy and fence logic runs without a GPU: call order, chunking, once-only
registration, unregistering before unmapping, bytes in place.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import pytest
import torch

from ckptd.client import cuda

PAGE = 4096


class FakeCudart:
    def __init__(self, codes: list[int] | None = None) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.codes = list(codes or [])

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, n))
        return self.codes.pop(0) if self.codes else 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, 0))
        return 0


@pytest.fixture
def arena(tmp_path: Path) -> str:
    path = tmp_path / "ckptd-1-job-s0-g1-r0"
    with open(path, "wb") as f:
        f.truncate(5 * PAGE)
    return str(path)


def test_an_arena_is_registered_once_in_chunks_and_unregistered_before_unmapping(monkeypatch: pytest.MonkeyPatch, arena: str) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(cuda, "REGISTER_CHUNK", 2 * PAGE)
    arenas = cuda.PinnedArenas()
    mapping = arenas.get(arena, 5 * PAGE)
    assert arenas.get(arena, 5 * PAGE) is mapping and arenas.registrations == 1
    base = mapping.host.data_ptr()
    assert fake.calls == [("register", base, 2 * PAGE), ("register", base + 2 * PAGE, 2 * PAGE), ("register", base + 4 * PAGE, PAGE)]
    arenas.close()
    assert [c for c in fake.calls if c[0] == "unregister"] == [("unregister", base + i * PAGE, 0) for i in (0, 2, 4)]


def test_already_registered_chunks_are_not_unregistered_and_errors_are_clear(monkeypatch: pytest.MonkeyPatch, arena: str) -> None:
    fake = FakeCudart([cuda.ERROR_ALREADY_REGISTERED, 0, 0])
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(cuda, "REGISTER_CHUNK", 2 * PAGE)
    mapping = cuda.PinnedMapping(arena, 5 * PAGE)
    mapping.close()
    assert sum(c[0] == "unregister" for c in fake.calls) == 2  # not the chunk someone else registered
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart([2]))
    with pytest.raises(cuda.CheckpointError, match="cudaHostRegister of 8192 bytes .* failed with CUDA error 2"):
        cuda.PinnedMapping(arena, 5 * PAGE)
    with pytest.raises(cuda.CheckpointError, match="it was replaced"):
        cuda.PinnedMapping(arena, 6 * PAGE)


def test_arenas_the_daemon_deleted_are_released(monkeypatch: pytest.MonkeyPatch, arena: str, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    arenas = cuda.PinnedArenas()
    arenas.get(arena)
    os.unlink(arena)
    other = tmp_path / "ckptd-1-job-s1-g2-r0"
    with open(other, "wb") as f:
        f.truncate(PAGE)
    arenas.get(str(other))
    assert list(arenas._maps) == [str(other)]
    arenas.close()


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple] = []


class FakeStream:
    def __init__(self, rec: Recorder, name: str) -> None:
        self.rec, self.name = rec, name

    def wait_stream(self, other: "FakeStream") -> None:
        self.rec.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "FakeEvent") -> None:
        self.rec.log.append(("wait_event", self.name, event.name))

    def synchronize(self) -> None:
        self.rec.log.append(("synchronize", self.name))


class FakeEvent:
    count = 0

    def __init__(self, rec: Recorder, blocking: bool) -> None:
        FakeEvent.count += 1
        self.rec, self.name, self.blocking = rec, f"event{FakeEvent.count}", blocking

    def record(self, stream: FakeStream) -> None:
        self.rec.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.rec.log.append(("event_synchronize", self.name))

    def query(self) -> bool:
        return True


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    current = FakeStream(rec, "compute")
    state = {"stream": current}

    @contextlib.contextmanager
    def stream_ctx(s: FakeStream) -> Iterator[None]:
        previous, state["stream"] = state["stream"], s
        rec.log.append(("enter", s.name))
        yield
        state["stream"] = previous

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(rec, "side"))
    monkeypatch.setattr(torch.cuda, "Event", lambda blocking=False: FakeEvent(rec, blocking))
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["stream"])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: rec.log.append(("record_stream", tuple(self.shape), s.name)))
    yield rec


def test_copier_orders_the_side_stream_after_compute_and_places_every_byte(fake_cuda: Recorder) -> None:
    big = torch.arange(2 * 2**20 // 4, dtype=torch.float32)  # large: its own copy
    small = [torch.full((n,), float(n)) for n in (3, 5)]  # gathered
    strided = torch.arange(12.0).view(3, 4).t()  # not contiguous: a temporary
    tensors = [big, *small, strided]
    offsets = [0, 2 * 2**20, 2 * 2**20 + 64, 2 * 2**20 + PAGE]
    dst = torch.zeros(2 * 2**20 + 2 * PAGE, dtype=torch.uint8)
    copy = cuda.CudaCopier().copy([(t, o, t.numel() * 4) for t, o in zip(tensors, offsets)], dst)
    log = fake_cuda.log
    assert log[0] == ("wait_stream", "side", "compute") and log[1] == ("enter", "side")
    event = next(e for e in log if e[0] == "record")
    assert event[2] == "side" and copy.operations == 4  # a run, a gather (2), a run
    recorded = {e[1] for e in log if e[0] == "record_stream"}
    assert {tuple(t.shape) for t in tensors} <= recorded
    for t, o in zip(tensors, offsets):
        n = t.numel() * 4
        assert torch.equal(dst[o : o + n], t.contiguous().reshape(-1).view(torch.uint8))
    copy.fence()
    assert log[-1] == ("wait_event", "compute", event[1])
    copy.fence(host=True)
    assert log[-1] == ("event_synchronize", event[1]) and copy.keep == []


def test_restores_wait_for_their_side_stream(fake_cuda: Recorder) -> None:
    host = torch.arange(6.0)
    target = torch.zeros(6)
    cuda.copy_to_devices([(host, target)])
    assert torch.equal(target, host)
    assert fake_cuda.log[-2:] == [("synchronize", "side"), ("wait_stream", "compute", "side")]


def test_cuda_problem_on_a_cpu_build() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert "CUDA is not available" in (cuda.cuda_problem() or "")


class FakeRuntime:
    """The ctypes CUDA runtime as DeviceStaging uses it."""

    def __init__(self, malloc_error: int = 0) -> None:
        self.malloc_error = malloc_error
        self.calls: list[tuple] = []

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def malloc(self, nbytes: int) -> int:
        from ckptd.common.cudart import CudaRuntimeError

        if self.malloc_error:
            raise CudaRuntimeError(f"cudaMalloc failed: error {self.malloc_error} (out of memory)", self.malloc_error)
        self.calls.append(("malloc", nbytes))
        return 0x7000_0000

    def ipc_get_mem_handle(self, ptr: int) -> bytes:
        return b"\x07" * 64

    def free(self, ptr: int) -> None:
        self.calls.append(("free", ptr))


@pytest.fixture
def fake_device_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        uuid = "GPU-01234567-89ab-cdef-0123-456789abcdef"

    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(torch, "as_tensor", lambda obj, device=None: torch.zeros(obj.__cuda_array_interface__["shape"], dtype=torch.uint8))


def test_staging_buffer_is_allocated_on_its_device_exported_and_freed(fake_device_calls: None) -> None:
    from ckptd.client.ipc import DeviceStaging

    rt = FakeRuntime()
    staging = DeviceStaging.allocate(torch.device("cuda", 3), 4096, runtime=rt)  # type: ignore[arg-type]
    assert rt.calls[:2] == [("set_device", 3), ("malloc", 4096)]
    assert staging.handle == b"\x07" * 64 and staging.uuid == "0123456789abcdef0123456789abcdef"
    assert staging.tensor.numel() == 4096
    staging.free()
    staging.free()  # twice is harmless
    assert rt.calls.count(("free", 0x7000_0000)) == 1


def test_no_gpu_memory_for_the_staging_buffer_is_a_fallback_reason(fake_device_calls: None) -> None:
    from ckptd.client.ipc import DeviceStaging, IpcUnavailable

    with pytest.raises(IpcUnavailable, match=r"no GPU memory left for a 2.00 GiB staging buffer on cuda:0 \(1.00 GiB free of 80.00 GiB\)"):
        DeviceStaging.allocate(torch.device("cuda", 0), 2 * 2**30, runtime=FakeRuntime(malloc_error=2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive size"):
        DeviceStaging.allocate(torch.device("cuda", 0), 0, runtime=FakeRuntime())  # type: ignore[arg-type]


def test_without_a_usable_cuda_runtime_ipc_is_unavailable_with_the_reason(fake_device_calls: None) -> None:
    from ckptd.client.ipc import DeviceStaging, IpcUnavailable
    from ckptd.common.cudart import CudaRuntime

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    # no libcudart at all, or one without a driver (error 35): either way a reason, not a crash
    with pytest.raises(IpcUnavailable, match="libcudart|cudaSetDevice failed"):
        DeviceStaging.allocate(torch.device("cuda", 0), 4096)
    with pytest.raises(Exception, match="tried"):
        CudaRuntime.load(lambda: ["/nonexistent/libcudart.so.12"])
