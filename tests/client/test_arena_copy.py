"""CopyPlan places every byte where the plan says, in a few groups, whatever the
mix of small, large, non-contiguous and odd-dtype tensors."""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest
import torch

from ckptd.client.arena_copy import CopyPlan


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(3) as p:
        yield p


def _layout(tensors: list[torch.Tensor], align: int = 64) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for t in tensors:
        cursor = -(-cursor // align) * align
        offsets.append(cursor)
        cursor += t.numel() * t.element_size()
    return offsets, max(cursor, 1)


def _check(arena: mmap.mmap, tensors: list[torch.Tensor], offsets: list[int]) -> None:
    flat = torch.frombuffer(arena, dtype=torch.uint8)
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        got = flat[off : off + n].view(t.dtype).view(t.shape)
        assert torch.equal(got, t.contiguous()), (t.shape, t.dtype, off)


def _state(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3 * 2**20, generator=g)  # 12 MiB: cut into chunks over the groups
    return [
        *(torch.randn(256, generator=g) for _ in range(300)),  # many small
        big,
        torch.randn(64, 48, generator=g).t(),  # small, non-contiguous
        torch.randn(1500, 1200, generator=g).t(),  # large (7 MB), non-contiguous
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.rand(33, generator=g) > 0.5,  # bool
        torch.zeros(0),  # empty: nothing to copy
        torch.tensor(3.5),  # 0-dim
        torch.randint(-5, 5, (5, 5, 5), generator=g, dtype=torch.int64),
        torch.randn(4, 100, generator=g)[2],  # small, contiguous, at an offset into its storage (issue 31 item 7)
    ]


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("cold", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_plan_copies_every_tensor_into_its_slot(pool: ThreadPoolExecutor, workers: int, cold: bool, streaming: bool) -> None:
    tensors = _state(0)
    offsets, size = _layout(tensors, align=8 if streaming else 64)  # streaming: destinations off 64-byte lines too
    arena = mmap.mmap(-1, size)
    plan = CopyPlan(arena, tensors, offsets, workers, streaming=streaming)
    assert 1 <= len(plan.groups) <= workers
    plan.run(pool, tensors, cold=cold)
    _check(arena, tensors, offsets)


def test_a_plan_runs_again_with_new_tensors_of_the_same_structure(pool: ThreadPoolExecutor) -> None:
    first, second = _state(1), _state(2)
    offsets, size = _layout(first)
    arena = mmap.mmap(-1, size)
    plan = CopyPlan(arena, first, offsets, 2)
    plan.run(pool, first)
    _check(arena, first, offsets)
    plan.run(pool, second)  # other tensors (memory), same shapes, dtypes and strides
    _check(arena, second, offsets)


def test_a_plan_streams_only_a_state_too_large_to_stay_in_the_cache() -> None:
    small, large = [torch.zeros(2**20)], [torch.zeros(2**24)]  # 4 MiB, 64 MiB
    assert not CopyPlan(mmap.mmap(-1, 4 * 2**20), small, [0], 2).streaming
    assert CopyPlan(mmap.mmap(-1, 64 * 2**20), large, [0], 2).streaming


def test_groups_hold_about_equal_bytes_and_many_small_tensors_are_not_one_task_each() -> None:
    tensors = [torch.zeros(256) for _ in range(4000)] + [torch.zeros(2**22)]
    offsets, size = _layout(tensors)
    plan = CopyPlan(mmap.mmap(-1, size), tensors, offsets, 2)
    assert len(plan.groups) == 2
    sizes = [g.nbytes for g in plan.groups]
    assert max(sizes) / min(sizes) < 1.5
    assert sum(len(g.small_index) for g in plan.groups) == 4000  # copied by one foreach call per group


def test_a_tiny_state_is_copied_on_the_calling_thread_alone() -> None:
    tensors = [torch.zeros(16) for _ in range(10)]
    offsets, size = _layout(tensors)
    assert len(CopyPlan(mmap.mmap(-1, size), tensors, offsets, 8).groups) == 1


def test_a_run_with_another_number_of_tensors_is_refused(pool: ThreadPoolExecutor) -> None:
    tensors = [torch.zeros(4), torch.zeros(4)]
    offsets, size = _layout(tensors)
    plan = CopyPlan(mmap.mmap(-1, size), tensors, offsets, 2)
    with pytest.raises(ValueError, match="copy plan for 2 tensors run with 1"):
        plan.run(pool, tensors[:1])


def test_an_error_in_one_group_surfaces_after_every_group_ended(pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [torch.zeros(2**20) for _ in range(8)]
    offsets, size = _layout(tensors)
    plan = CopyPlan(mmap.mmap(-1, size), tensors, offsets, 2)
    calls: list[int] = []
    real = CopyPlan._run_group

    def flaky(self: CopyPlan, group, sources, cold) -> None:  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise OSError("simulated")
        real(self, group, sources, cold)

    monkeypatch.setattr(CopyPlan, "_run_group", flaky)
    with pytest.raises(OSError, match="simulated"):
        plan.run(pool, tensors)
    assert len(calls) == len(plan.groups)
