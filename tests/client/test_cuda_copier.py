"""The CUDA paths of the hand-off on a real GPU (marked gpu: skipped where torch sees none).

Run on a GPU machine with:  python -m pytest -q -m gpu tests
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch import nn

from ckptd.client import CheckpointClient

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MB = 1 << 20


@pytest.fixture
def arena_file():
    """A file in /dev/shm that plays an arena (the daemon's are files there too)."""
    fd, path = tempfile.mkstemp(prefix="ckptd-gpu-test-", dir="/dev/shm")
    os.close(fd)
    yield path
    os.unlink(path)


def _sized(path: str, nbytes: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(nbytes)


def test_an_arena_is_page_locked_once_in_one_call_and_unlocked_on_close(arena_file: str) -> None:
    from ckptd.client.cuda_copier import PinnedArenas

    _sized(arena_file, 3 * MB)
    arenas = PinnedArenas()
    first = arenas.get(arena_file, 3 * MB)
    assert first.host.is_pinned()
    assert arenas.get(arena_file, 3 * MB) is first and arenas.registrations == 1
    arenas.close()  # unregistered, then unmapped
    again = PinnedArenas()  # registering the same file anew works
    assert again.get(arena_file, 3 * MB).host.is_pinned() and again.registrations == 1
    again.close()


def test_a_copy_run_across_the_first_gib_of_an_arena_succeeds(arena_file: str) -> None:
    """Two tensors back to back in one storage, on either side of the arena's first GiB: one
    coalesced copy (it failed with "invalid argument" when arenas were registered per GiB)."""
    from ckptd.client.cuda_copier import CudaCopier, PinnedArenas

    gib = 1 << 30
    _sized(arena_file, gib + 4 * MB)
    arenas = PinnedArenas()
    dst = arenas.get(arena_file, gib + 4 * MB).host
    flat = torch.randn(MB // 2, device="cuda")
    copy = CudaCopier().copy([(flat[: MB // 4], gib - MB, MB), (flat[MB // 4 :], gib, MB)], dst)
    assert copy.operations == 1
    copy.wait()
    assert torch.equal(dst[gib - MB : gib + MB], flat.view(torch.uint8).cpu())
    assert arenas.registrations == 1
    arenas.close()


def _mixed_tensors(device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    flat = torch.randn(6 * MB // 4, device=device)
    return [
        flat[: MB // 4 * 2].view(512, -1),  # 2 MiB, followed in storage by the next: merged
        flat[MB // 4 * 2 :].view(1024, -1),  # 4 MiB
        *(torch.randn(n, device=device) for n in (1, 17, 1000, 4096)),  # small: gathered
        torch.randn(300, 200, device=device).t(),  # not contiguous
        torch.randn(123, dtype=torch.bfloat16, device=device),
        torch.arange(10, dtype=torch.int64, device=device),
    ]


def _layout(tensors: list[torch.Tensor], merge_first: bool = True) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for i, t in enumerate(tensors):
        offsets.append(cursor)
        cursor += t.numel() * t.element_size()
        if not (merge_first and i == 0):
            cursor = -(-cursor // 4096) * 4096
    return offsets, cursor


@pytest.mark.parametrize("into", ["pinned host", "device staging"])
def test_cuda_copier_places_every_byte(arena_file: str, into: str) -> None:
    from ckptd.client.cuda_copier import CudaCopier, PinnedArenas

    tensors = _mixed_tensors("cuda")
    offsets, size = _layout(tensors)
    arenas = PinnedArenas()
    if into == "pinned host":
        _sized(arena_file, size)
        dst = arenas.get(arena_file, size).host
    else:
        dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    copier = CudaCopier()
    copy = copier.copy([(t, off, t.numel() * t.element_size()) for t, off in zip(tensors, offsets)], dst)
    assert copy.operations <= 6  # 1 merged run, 1 gather (2 ops), 3 others
    copy.wait()
    host = dst.cpu()
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        assert torch.equal(host[off : off + n], t.contiguous().reshape(-1).view(torch.uint8).cpu()), t.shape
    arenas.close()


def test_the_fence_keeps_later_kernels_from_changing_what_is_being_copied(arena_file: str) -> None:
    from ckptd.client.cuda_copier import CudaCopier, PinnedArenas

    big = torch.full((512 * MB // 4,), 1.0, device="cuda")  # 512 MiB: the copy takes a while
    _sized(arena_file, 512 * MB)
    arenas = PinnedArenas()
    dst = arenas.get(arena_file, 512 * MB).host
    copy = CudaCopier().copy([(big, 0, 512 * MB)], dst)
    copy.fence()  # the compute stream waits for the copy-done event
    big.add_(1.0)  # queued after the fence: runs after the copy
    copy.wait()
    torch.cuda.synchronize()
    assert torch.all(dst.view(torch.float32) == 1.0)
    assert torch.all(big == 2.0)
    arenas.close()


def test_gpu_uuid_is_what_the_daemon_runtime_reports() -> None:
    from ckptd.client.staging_buffer import gpu_uuid
    from ckptd.common.cudart import CudaRuntime

    runtime = CudaRuntime.load()
    assert runtime.device_count() == torch.cuda.device_count()
    for i in range(torch.cuda.device_count()):
        assert gpu_uuid(torch.device("cuda", i)) == runtime.device_uuid(i)


def test_staging_buffer_allocates_outside_the_caching_allocator_and_exports() -> None:
    from ckptd.client.staging_buffer import DeviceStaging

    before = torch.cuda.memory_allocated()
    staging = DeviceStaging.allocate(torch.device("cuda", 0), 64 * MB)
    assert len(staging.handle) == 64 and staging.tensor.numel() == 64 * MB and staging.tensor.is_cuda
    staging.tensor.fill_(7)
    assert int(staging.tensor[12345].item()) == 7
    assert torch.cuda.memory_allocated() == before  # not in torch's allocator
    staging.free()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(1000, 256)
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
        self.norm = nn.BatchNorm1d(256)
        self.head = nn.Linear(256, 1000, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(tokens))))


def _train(model: Model, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, 1000, (64,), device="cuda", generator=g)
    loss = nn.functional.cross_entropy(model(tokens), tokens)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _snapshot(model: Model, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [v.detach().clone() for v in model.state_dict().values()]
    for st in opt.state.values():
        out += [st["exp_avg"].clone(), st["exp_avg_sq"].clone()]
    return out


@pytest.mark.parametrize("mode", ["copy", "overlap", "ipc"])
def test_save_train_and_restore_onto_the_gpu_in_each_mode(daemons, mode: str) -> None:
    daemon = daemons.start()
    model = Model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    _train(model, opt, 0)
    job = f"gpu-{mode}"
    with CheckpointClient(job, address=daemon.address, rank=0, world_size=1, mode=mode, on_error="raise") as ckpt:
        for s in range(1, 4):  # the first saves map and page-lock the arenas; later ones reuse them
            ckpt.save(s, {"model": model, "optimizer": opt})
            _train(model, opt, s)
        expected = _snapshot(model, opt)
        handle = ckpt.save(4, {"model": model, "optimizer": opt})
        assert ckpt.mode_in_use == mode, ckpt.mode_reason
        _train(model, opt, 4)  # the pre-hook fences: the snapshot keeps the values at save(4)
        assert handle.wait_durable(timeout=120) is not None
        assert len(opt._optimizer_step_pre_hooks) == (0 if mode == "copy" else 1)
    for where in ("memory", "disk"):
        if where == "disk":  # a new daemon: the snapshot is read from the files
            daemon.stop()
            daemon = daemons.start()
        fresh = Model().cuda()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, fused=True)
        _train(fresh, fresh_opt, 99)
        with CheckpointClient(job, address=daemon.address, rank=0, world_size=1, mode=mode, on_error="raise") as ckpt:
            assert ckpt.load({"model": fresh, "optimizer": fresh_opt}) == 4
        got = _snapshot(fresh, fresh_opt)
        assert all(a.is_cuda for a in got)
        for a, b in zip(got, expected):
            assert torch.equal(a, b), where


def test_overlap_save_returns_before_the_copy_and_stalls_less_than_copy(daemon) -> None:
    """The hand-off itself: each save finds a free, already page-locked arena (the previous one
    is durable before the next starts), so the stall is the copy (mode "copy") or its issue
    ("overlap"), never the wait for an arena (back-pressure, a different matter)."""
    state = {"model": {f"w{i}": torch.randn(64 * MB, device="cuda") for i in range(8)}}  # 2 GiB

    def hand_offs(job: str, mode: str) -> list[tuple[float, float | None]]:
        out = []
        with CheckpointClient(job, address=daemon.address, rank=0, world_size=1, mode=mode, on_error="raise") as ckpt:
            for s in range(1, 5):
                handle = ckpt.save(s, state)
                out.append((handle.stall_s, handle.copy_s))
                torch.cuda._sleep(int(2e9))  # about a second of "forward and backward" on the compute stream
                assert handle.wait_durable(timeout=120) is not None
        return out[2:]  # the first two saves map and page-lock the two arenas

    copies = hand_offs("gpu-stall", "copy")
    overlaps = hand_offs("gpu-stall2", "overlap")
    copy_s = min(c for _, c in copies if c is not None)
    stall = max(s for s, _ in overlaps)
    assert stall < copy_s / 2, (overlaps, copies)  # returns well before the copy could be done


def test_a_restore_merges_stages_in_waves_and_is_bit_exact(arena_file: str) -> None:
    """ckptd.client.cuda_restore on the GPU: adjacent pieces of an arena into a flat parameter
    buffer in one copy, converted pieces through the double-buffered staging pool, every byte
    exact once `finish` returns, and the compute stream ordered after the copies."""
    from ckptd.client.cuda_copier import PinnedArenas
    from ckptd.client.cuda_restore import CudaRestorer, StagingPool

    device = torch.device("cuda", torch.cuda.current_device())
    _sized(arena_file, 16 * MB)
    arenas = PinnedArenas()
    arena = arenas.get(arena_file, 16 * MB).host
    arena.copy_(torch.randint(0, 255, (16 * MB,), dtype=torch.uint8))
    flat = torch.zeros(4 * MB, device=device)  # 16 MiB of fp32: two 8 MiB parameters
    pairs = [(arena[: 8 * MB].view(torch.float32), flat[: 2 * MB]), (arena[8 * MB :].view(torch.float32), flat[2 * MB :])]
    restorer = CudaRestorer(StagingPool(slot_bytes=4 * MB))
    restore = restorer.begin()
    restore.upload(pairs)
    targets = [torch.empty(4 * MB, dtype=torch.uint8, device=device) for _ in range(4)]
    for i, target in enumerate(targets):  # four waves through two slots: the third waits for the first's copy
        staged = restore.staging(4 * MB)
        staged.fill_(i + 1)
        restore.upload([(staged[: 4 * MB], target)])
    restore.finish()
    assert restore.uploads == 5 and restore.pairs == 6
    assert torch.equal(flat.view(torch.uint8).cpu(), arena)
    assert [bool((t == i + 1).all().item()) for i, t in enumerate(targets)] == [True] * 4
    restorer.close()
    arenas.close()
