"""ckptd.client.cuda_restore and reader.fill.fill_onto_devices on the strict CPU stand-in for CUDA
(tests/fakecuda.py, with the in-flight rules of fakecuda.InFlightCuda).

Each GPU rule the restore relies on is enforced by the stand-in, and each has a test here that
breaks it on purpose and sees the stand-in refuse: a non-blocking copy only from pinned memory,
a copy never across two registrations, targets used only after their copies (stream order), and
a staging buffer refilled only after the copies reading it are done.
"""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fakecuda  # tests/fakecuda.py (tests/conftest.py puts tests/ on the import path)
from ckptd.client.arenas import ArenaMaps
from ckptd.client.cuda_restore import CudaRestore, CudaRestorer, StagingPool, merge_uploads
from ckptd.client.reader.fill import Fill, _waves, fill_onto_devices
from ckptd.client.reader.pieces import Source
from ckptd.common.boxes import Box

KB = 1024


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> fakecuda.InFlightCuda:
    return fakecuda.InFlightCuda().install(monkeypatch)  # type: ignore[return-value]


class Pinned:
    """Pinned host buffers on the stand-in: ctypes memory, registered with its library."""

    def __init__(self, cuda: fakecuda.FakeCuda) -> None:
        self.cuda = cuda
        self.keep: list[Any] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        raw = (ctypes.c_ubyte * nbytes)()
        self.keep.append(raw)
        assert self.cuda.lib.cudaHostRegister(ctypes.addressof(raw), nbytes, 0) == 0
        return torch.frombuffer(raw, dtype=torch.uint8)


def _pinned_pair(cuda: fakecuda.FakeCuda, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two pinned buffers of `nbytes` back to back in memory, each its own storage and registration."""
    raw = (ctypes.c_ubyte * (2 * nbytes))()
    base = ctypes.addressof(raw)
    halves = []
    for i in range(2):
        assert cuda.lib.cudaHostRegister(base + i * nbytes, nbytes, 0) == 0
        halves.append(torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(base + i * nbytes), dtype=torch.uint8))
    halves[0]._keep = raw  # type: ignore[attr-defined]
    return halves[0], halves[1]


# ------------------------------------------------------------------ the stand-in's rules


def test_an_asynchronous_copy_reads_its_host_bytes_when_it_runs_so_a_refilled_buffer_is_a_fault(cuda) -> None:  # noqa: ANN001
    pinned = Pinned(cuda)
    host = pinned(64)
    host.fill_(1)
    target = cuda.to_device(torch.zeros(64, dtype=torch.uint8))
    side = torch.cuda.Stream()
    gate = cuda.block(side)
    with torch.cuda.stream(side):
        target.copy_(host, non_blocking=True)
    host.fill_(2)  # reused before the copy ran
    gate.open()
    with pytest.raises(RuntimeError, match="changed after an asynchronous copy"):
        side.synchronize()


def test_an_asynchronous_copy_from_pageable_memory_is_refused(cuda) -> None:  # noqa: ANN001
    target = cuda.to_device(torch.zeros(8))
    with pytest.raises(RuntimeError, match="invalid argument"):
        target.copy_(torch.ones(8), non_blocking=True)


def test_a_target_read_before_the_copy_that_writes_it_ran_is_refused(cuda) -> None:  # noqa: ANN001
    host = Pinned(cuda)(32)
    target = cuda.to_device(torch.zeros(32, dtype=torch.uint8))
    side = torch.cuda.Stream()
    gate = cuda.block(side)
    with torch.cuda.stream(side):
        target.copy_(host, non_blocking=True)
    with pytest.raises(RuntimeError, match="read before the copy"):
        cuda.use(target)  # a kernel on the compute stream, not ordered after the copy
    with pytest.raises(RuntimeError, match="read before the copy"):
        torch.empty(32, dtype=torch.uint8).copy_(target)
    gate.open()
    torch.cuda.current_stream().wait_stream(side)  # the order: now the read is safe
    cuda.use(target)


def test_a_merged_copy_across_two_registrations_is_refused(cuda) -> None:  # noqa: ANN001
    first, second = _pinned_pair(cuda, 4 * KB)
    target = cuda.to_device(torch.zeros(8 * KB, dtype=torch.uint8))
    across = torch.frombuffer((ctypes.c_ubyte * (8 * KB)).from_address(first.data_ptr()), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="not inside one registered range"):
        target.copy_(across, non_blocking=True)


# ------------------------------------------------------------------ merging


def test_pairs_adjacent_in_one_arena_and_one_flat_device_buffer_go_as_one_copy(cuda) -> None:  # noqa: ANN001
    arena = Pinned(cuda)(64 * KB)
    arena.copy_(torch.randint(0, 255, (64 * KB,), dtype=torch.uint8))
    flat = cuda.to_device(torch.zeros(16 * KB))  # a flat parameter buffer: 64 KiB of fp32
    params = [flat[: 4 * KB], flat[4 * KB : 12 * KB], flat[12 * KB :]]
    pairs = [(arena[0 : 16 * KB].view(torch.float32), params[0]),
             (arena[16 * KB : 48 * KB].view(torch.float32), params[1]),
             (arena[48 * KB :].view(torch.float32), params[2])]
    ups = merge_uploads(list(reversed(pairs)))  # order does not matter
    assert [(u.pairs, u.host.numel()) for u in ups] == [(3, 64 * KB)]
    restore = CudaRestorer(StagingPool(allocate=Pinned(cuda))).begin()
    restore.upload(pairs)
    restore.finish()
    assert [(c.kind, c.nbytes, c.non_blocking) for c in cuda.copies] == [("H2D", 64 * KB, True)]
    assert torch.equal(flat.view(torch.uint8), arena)


@pytest.mark.parametrize("case", ["two host storages", "device gap", "host gap", "two device storages", "dtype"])
def test_pairs_that_are_not_adjacent_on_both_sides_in_one_storage_each_are_not_merged(cuda, case: str) -> None:  # noqa: ANN001
    first, second = _pinned_pair(cuda, 4 * KB)  # adjacent in memory, two registrations
    one = Pinned(cuda)(8 * KB + 64)
    flat = cuda.to_device(torch.zeros(2 * KB + 16))
    other = cuda.to_device(torch.zeros(KB))
    if case == "two host storages":
        pairs = [(first.view(torch.float32), flat[:KB]), (second.view(torch.float32), flat[KB : 2 * KB])]
    elif case == "device gap":
        pairs = [(one[: 4 * KB].view(torch.float32), flat[:KB]), (one[4 * KB : 8 * KB].view(torch.float32), flat[KB + 16 :])]
    elif case == "host gap":
        pairs = [(one[: 4 * KB].view(torch.float32), flat[:KB]), (one[4 * KB + 64 :].view(torch.float32), flat[KB : 2 * KB])]
    elif case == "two device storages":
        pairs = [(one[: 4 * KB].view(torch.float32), flat[:KB]), (one[4 * KB : 8 * KB].view(torch.float32), other)]
    else:
        pairs = [(one[: 4 * KB].view(torch.float32), flat[:KB]), (one[4 * KB : 8 * KB].view(torch.int32), flat[KB : 2 * KB])]
    assert [u.pairs for u in merge_uploads(pairs)] == [1, 1]
    restore = CudaRestorer(StagingPool(allocate=Pinned(cuda))).begin()
    restore.upload(pairs)  # the stand-in would refuse a copy across the two registrations
    restore.finish()
    for host, target in pairs:
        assert torch.equal(target, host.to(target.dtype))


def test_a_pageable_host_tensor_is_copied_synchronously(cuda) -> None:  # noqa: ANN001
    target = cuda.to_device(torch.zeros(6))
    restore = CudaRestorer(StagingPool(allocate=Pinned(cuda))).begin()
    restore.upload([(torch.arange(6.0), target)])
    restore.finish()
    assert torch.equal(target, torch.arange(6.0))
    assert [c.non_blocking for c in cuda.copies] == [False]


# ------------------------------------------------------------------ ordering and the staging pool


def _open_later(gate: fakecuda.Gate, seconds: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), gate.open()), daemon=True)
    thread.start()
    return thread


def test_the_copies_wait_for_the_compute_stream_and_finish_orders_it_after_them(cuda) -> None:  # noqa: ANN001
    host = Pinned(cuda)(64)
    host.fill_(5)
    target = cuda.to_device(torch.zeros(64, dtype=torch.uint8))
    compute = torch.cuda.Stream()
    gate = cuda.block(compute)  # a kernel queued before the load, still running
    cuda.launch(compute, lambda: None, "kernel reading the old values")
    with torch.cuda.stream(compute):
        restore = CudaRestorer(StagingPool(allocate=Pinned(cuda))).begin()
        restore.upload([(host, target)])
        assert torch.equal(target, torch.zeros(64, dtype=torch.uint8))  # held behind the kernel
        _open_later(gate, 0.1)
        restore.finish()
        cuda.use(target)  # on the compute stream: ordered after the copy
    torch.cuda.synchronize()
    order = [what for _, what in cuda.log]
    assert order.index("kernel reading the old values") < order.index("H2D copy of 64 bytes")
    assert torch.equal(target, host)


def test_without_finish_the_targets_are_not_safe_to_use(cuda) -> None:  # noqa: ANN001
    """The stand-in catches a restore that returns before its copies are ordered."""
    host = Pinned(cuda)(64)
    target = cuda.to_device(torch.zeros(64, dtype=torch.uint8))
    streams: dict[Any, Any] = {}
    restore = CudaRestore(StagingPool(allocate=Pinned(cuda)), streams)
    stream = streams[torch.device("cpu")] = torch.cuda.Stream()
    gate = cuda.block(stream)
    restore.upload([(host, target)])
    with pytest.raises(RuntimeError, match="read before the copy"):
        cuda.use(target)
    gate.open()
    restore.finish()
    cuda.use(target)


def test_a_staging_slot_is_reused_only_after_the_copies_reading_it_are_done(cuda) -> None:  # noqa: ANN001
    targets = [cuda.to_device(torch.zeros(256, dtype=torch.uint8)) for _ in range(3)]
    pool = StagingPool(slots=1, slot_bytes=256, allocate=Pinned(cuda))
    streams: dict[Any, Any] = {}
    restore = CudaRestore(pool, streams)
    buffer = restore.staging(256)
    stream = streams[torch.device("cpu")] = torch.cuda.Stream()
    gate = cuda.block(stream)
    for i, target in enumerate(targets):
        if i:
            buffer = restore.staging(256)  # the one slot: waits for the copy out of it
            assert gate.is_open()
        buffer.fill_(i + 1)
        restore.upload([(buffer, target)])
        if i == 0:
            _open_later(gate, 0.1)
    restore.finish()
    assert [int(t[0]) for t in targets] == [1, 2, 3]
    assert pool.allocations == 1


def test_a_pool_that_hands_out_a_slot_still_read_is_caught(cuda, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from ckptd.client import cuda_restore

    monkeypatch.setattr(cuda_restore._Slot, "wait_free", lambda self: None)  # the bug: no wait
    target = cuda.to_device(torch.zeros(256, dtype=torch.uint8))
    pool = StagingPool(slots=1, slot_bytes=256, allocate=Pinned(cuda))
    streams: dict[Any, Any] = {}
    restore = CudaRestore(pool, streams)
    buffer = restore.staging(256)
    stream = streams[torch.device("cpu")] = torch.cuda.Stream()
    gate = cuda.block(stream)
    buffer.fill_(1)
    restore.upload([(buffer, target)])
    restore.staging(256).fill_(2)  # refilled while the copy still waits
    gate.open()
    with pytest.raises(RuntimeError, match="changed after an asynchronous copy"):
        restore.finish()


# ------------------------------------------------------------------ fill_onto_devices


def test_waves_pack_in_order_aligned_and_a_large_fill_goes_alone() -> None:
    def fill(n: int, dtype: torch.dtype = torch.float32) -> Fill:
        return Fill(torch.zeros(n, dtype=dtype), Box.full((n,)), ())

    fills = [fill(10), fill(3, torch.uint8), fill(2), fill(100), fill(1)]
    waves = _waves(fills, 64)
    assert [[off for _, off in w] for w, _ in waves] == [[0, 40, 44], [0], [0]]
    assert [total for _, total in waves] == [52, 400, 4]


class RestoreBackend:
    """A DeviceBackend's restore side over the real CudaRestorer on the stand-in."""

    def __init__(self, cuda: fakecuda.FakeCuda, device: set[int], slot_bytes: int) -> None:
        self.cuda = cuda
        self.pinned = Pinned(cuda)
        self.restorer = CudaRestorer(StagingPool(slot_bytes=slot_bytes, allocate=self.pinned))
        self.device = device
        self.arenas: dict[str, torch.Tensor] = {}
        self.restores: list[CudaRestore] = []

    def owns(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.data_ptr() in self.device

    def host_view(self, path: str, size: int) -> torch.Tensor:
        if path not in self.arenas:
            data = Path(path).read_bytes()
            view = self.arenas[path] = self.pinned(len(data))
            view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return self.arenas[path]

    def restore(self) -> CudaRestore:
        self.restores.append(self.restorer.begin())
        return self.restores[-1]


def test_fill_onto_devices_copies_arena_pieces_directly_and_stages_the_rest_in_waves(cuda, tmp_path: Path) -> None:  # noqa: ANN001
    from concurrent.futures import ThreadPoolExecutor

    values = [torch.randn(256) for _ in range(6)]  # 1 KiB each
    arena = tmp_path / "arena"
    arena.write_bytes(b"".join(v.numpy().tobytes() for v in values))

    def source(i: int, dtype: str = "F32") -> Source:
        return Source(f"t{i}", "shm", str(arena), i * 1024, 1024, Box.full((256,)), dtype, "")

    direct = [cuda.to_device(torch.zeros(256)) for _ in range(2)]  # whole pieces, same dtype: from the arena
    flat = cuda.to_device(torch.zeros(3 * 256, dtype=torch.float64))  # staged (converted), one flat buffer
    converted = [flat[i * 256 : (i + 1) * 256] for i in range(3)]
    on_cpu = torch.zeros(256)
    fills = [Fill(direct[0], Box.full((256,)), (source(0),)), Fill(direct[1], Box.full((256,)), (source(1),)),
             Fill(on_cpu, Box.full((256,)), (source(5),))]
    fills += [Fill(t, Box.full((256,)), (source(2 + i),)) for i, t in enumerate(converted)]
    backend = RestoreBackend(cuda, {t.data_ptr() for t in direct + converted}, slot_bytes=2048)
    with ThreadPoolExecutor(2) as pool:
        fill_onto_devices(pool, ArenaMaps(), fills, backend, backend.owns, wave_bytes=4096)
    for t, v in zip(direct + converted + [on_cpu], values[:2] + values[2:5] + [values[5]]):
        assert torch.equal(t, v.to(t.dtype))
    restore = backend.restores[0]
    # the arena pieces: two device storages, two copies; the staged ones: waves of 4 KiB, the
    # first wave's two adjacent pieces (adjacent in the flat buffer too) merged into one copy
    assert restore.pairs == 5 and restore.uploads == 4
    assert [(c.nbytes, c.non_blocking) for c in cuda.copies] == [(1024, True), (1024, True), (4096, True), (2048, True)]
    assert backend.restorer.pool.allocations == 2  # one slot per wave, both slots used
    for t in direct + converted:
        cuda.use(t)


def test_finish_blocks_the_host_until_the_copies_are_done_even_under_a_side_compute_stream(cuda) -> None:  # noqa: ANN001
    """The arenas go back to the daemon when the load returns: nothing may still read them."""
    arena = Pinned(cuda)(64)
    arena.fill_(3)
    target = cuda.to_device(torch.zeros(64, dtype=torch.uint8))
    streams: dict[Any, Any] = {}
    restore = CudaRestore(StagingPool(allocate=Pinned(cuda)), streams)
    stream = streams[torch.device("cpu")] = torch.cuda.Stream()
    gate = cuda.block(stream)
    with torch.cuda.stream(torch.cuda.Stream()):  # a trainer computing on a stream of its own
        restore.upload([(arena, target)])
        _open_later(gate, 0.1)
        restore.finish()
    arena.fill_(9)  # the daemon's next save into the arena
    torch.cuda.synchronize()
    assert torch.equal(target, torch.full((64,), 3, dtype=torch.uint8))


def test_a_client_restores_onto_devices_from_the_daemons_memory_and_from_files(daemons, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """End to end on the stand-in: a real daemon, the real CudaBackend; the first load copies from
    the arenas, the one after a daemon restart reads the files through the staging pool."""
    from torch import nn

    from ckptd.client import CheckpointClient, cuda_restore

    cuda = fakecuda.InFlightCuda().install(monkeypatch)
    monkeypatch.setattr(cuda_restore, "pinned_buffer", Pinned(cuda))

    def model() -> nn.Module:
        m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
        for p in m.parameters():
            cuda.to_device(p)
        return m

    saved = model()
    daemon = daemons.start()
    with CheckpointClient("rst", address=daemon.address, rank=0, world_size=1, mode="copy", on_error="raise") as ckpt:
        ckpt.save(3, {"model": saved}).wait_durable(timeout=60)
        for source in ("memory", "files"):
            if source == "files":
                daemon.stop()
                daemon = daemons.start()
            fresh = model()
            before = len(cuda.copies)
            with CheckpointClient("rst", address=daemon.address, rank=0, world_size=1, on_error="raise") as reader:
                assert {c.step: c.in_memory for c in reader.list()}[3] == (source == "memory")
                assert reader.load({"model": fresh}) == 3
                restorer = reader._handoff.backend.restorer
                assert restorer.pool.allocations == (0 if source == "memory" else 1)  # files: one wave, one slot
            for a, b in zip(saved.parameters(), fresh.parameters()):
                cuda.use(b)
                assert torch.equal(a, b)
            uploads = [c for c in cuda.copies[before:] if c.kind == "H2D"]
            assert uploads and all(c.non_blocking for c in uploads), (source, uploads)
