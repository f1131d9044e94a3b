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
