"""Planning few, large device copies (ckptd.client.devcopy): tables, then byte-exact runs on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from ckptd.client.devcopy import DeviceCopyPlan, Gather, Item, Run, coalesced_ranges, item_of, plan_copies, run_copies

D = "cuda:0"
MB = 1 << 20


def test_large_tensors_are_one_copy_each() -> None:
    items = [Item(0, 4 * MB, D, (1, 0)), Item(8 * MB, 2 * MB, D, (2, 0))]
    assert plan_copies(items) == DeviceCopyPlan((Run(0, 4 * MB, (0,)), Run(8 * MB, 2 * MB, (1,))), ())


def test_back_to_back_in_storage_and_destination_are_merged() -> None:
    # a flat parameter buffer: three views one after the other, slots one after the other
    items = [Item(0, 2 * MB, D, (7, 0)), Item(2 * MB, 2 * MB, D, (7, 2 * MB)), Item(4 * MB, 4 * MB, D, (7, 4 * MB))]
    assert plan_copies(items).runs == (Run(0, 8 * MB, (0, 1, 2)),)


@pytest.mark.parametrize(
    "second",
    [
        Item(2 * MB + 4096, 2 * MB, D, (7, 2 * MB)),  # a gap in the destination
        Item(2 * MB, 2 * MB, D, (7, 3 * MB)),  # a gap in the storage
        Item(2 * MB, 2 * MB, D, (8, 2 * MB)),  # another storage
        Item(2 * MB, 2 * MB, "cuda:1", (7, 2 * MB)),  # another device
        Item(2 * MB, 2 * MB, D, None),  # not contiguous
    ],
)
def test_not_merged_unless_adjacent_on_both_sides(second: Item) -> None:
    assert len(plan_copies([Item(0, 2 * MB, D, (7, 0)), second]).runs) == 2


def test_small_tensors_are_gathered_within_the_span_limit() -> None:
    items = [Item(i * 4096, 100, D, (i, 0)) for i in range(10)]
    plan = plan_copies(items, small_bytes=MB, max_gather_bytes=5 * 4096)
    assert plan.runs == ()
    assert [g.members for g in plan.gathers] == [
        tuple((i, (i % 5) * 4096) for i in range(5)),
        tuple((i, (i % 5) * 4096) for i in range(5, 10)),
    ]
    assert [(g.offset, g.span) for g in plan.gathers] == [(0, 4 * 4096 + 100), (5 * 4096, 4 * 4096 + 100)]
    assert plan.operations == 4 and plan.max_span == 4 * 4096 + 100


def test_gathers_never_span_over_bytes_written_by_others_or_large_tensors() -> None:
    items = [
        Item(0, 64, D, (1, 0)),
        Item(64, 64, D, (2, 0)),
        Item(128, 64, None, None),  # a CPU tensor's slot: the CPU path writes it
        Item(192, 64, D, (3, 0)),
        Item(256, 64, D, (4, 0)),
        Item(4096, 2 * MB, D, (5, 0)),  # large: its own copy
        Item(4096 + 2 * MB, 64, D, (6, 0)),  # alone after it: a plain run
    ]
    plan = plan_copies(items)
    assert plan.gathers == (Gather(0, 128, ((0, 0), (1, 64))), Gather(192, 128, ((3, 0), (4, 64))))
    assert plan.runs == (Run(4096, 2 * MB, (5,)), Run(4096 + 2 * MB, 64, (6,)))


def test_non_contiguous_and_empty_tensors() -> None:
    plan = plan_copies([Item(0, 64, D, None), Item(64, 0, D, (1, 0)), Item(128, 64, D, (2, 0))])
    assert plan.runs == (Run(0, 64, (0,)), Run(128, 64, (2,)))  # empty: nothing; non-contiguous: alone


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        plan_copies([Item(-1, 4, D, None)])
    with pytest.raises(ValueError, match="max_gather_bytes"):
        plan_copies([], max_gather_bytes=0)


def test_coalesced_ranges_stop_at_bytes_written_by_others() -> None:
    items = [Item(0, 100, D, None), Item(128, 100, D, None), Item(256, 64, None, None), Item(4096, 10, D, None)]
    assert coalesced_ranges(items) == [(0, 228), (4096, 10)]


def test_run_copies_places_every_byte() -> None:
    torch.manual_seed(0)
    flat = torch.randn(3 * 1024)  # a flat buffer whose views sit back to back
    a, b = flat[:1024].view(32, 32), flat[1024:3072].view(64, 32)
    small = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (3, 17, 64)]
    strided = torch.randn(40, 30).t()  # not contiguous
    half = torch.randn(7, dtype=torch.bfloat16)
    cpu_slot = torch.randn(16)  # written "by the CPU path": must survive
    tensors = [a, b, *small, strided, half, cpu_slot]
    offsets, cursor = [], 0
    for t in tensors:
        offsets.append(cursor)
        cursor += t.numel() * t.element_size()
        if t is a:
            continue  # b follows a directly: the two merge
        cursor = -(-cursor // 64) * 64
    dst = torch.full((cursor,), 0xAB, dtype=torch.uint8)
    cpu_at = offsets[-1]
    dst[cpu_at : cpu_at + 64] = cpu_slot.view(torch.uint8)
    items = [item_of(t, off, t.numel() * t.element_size(), None if t is cpu_slot else "cpu") for t, off in zip(tensors, offsets)]
    plan = plan_copies(items, small_bytes=256)
    assert Run(0, 3072 * 4, (0, 1)) in plan.runs and len(plan.gathers) == 1
    keep = run_copies(plan, tensors, dst)
    assert len(keep) == 1  # the contiguous copy of `strided`
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        assert torch.equal(dst[off : off + n], t.contiguous().reshape(-1).view(torch.uint8)), t.shape


def test_a_gather_into_another_device_needs_a_bounce_buffer() -> None:
    plan = DeviceCopyPlan((), (Gather(0, 8, ((0, 0), (1, 4))),))
    dst = torch.empty(8, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="bounce buffer"):
        run_copies(plan, [torch.zeros(1), torch.zeros(1)], dst)


# ------------------------------------------------------------------ registration boundaries
# ckptd registers every arena whole, in one call; should a destination ever be registered in
# pieces, no copy may cross from one into the next (CUDA: "invalid argument").


def test_runs_are_split_at_registration_boundaries() -> None:
    items = [
        Item(0, 2 * MB, D, (7, 0)),
        Item(2 * MB, 2 * MB, D, (7, 2 * MB)),  # follows item 0, but across a boundary: not merged
        Item(6 * MB, 4 * MB, D, (8, 0)),  # large, across a boundary: two pieces
        Item(12 * MB, 2 * MB, D, None),  # not contiguous, across a boundary: two pieces
    ]
    plan = plan_copies(items, boundaries=(MB, 2 * MB, 8 * MB, 13 * MB))
    assert plan.runs == (
        Run(0, MB, (0,), 0), Run(MB, MB, (0,), MB),
        Run(2 * MB, 2 * MB, (1,)),
        Run(6 * MB, 2 * MB, (2,), 0), Run(8 * MB, 2 * MB, (2,), 2 * MB),
        Run(12 * MB, MB, (3,), 0), Run(13 * MB, MB, (3,), MB),
    )
    merged = [Item(0, 2 * MB, D, (7, 0)), Item(2 * MB, 2 * MB, D, (7, 2 * MB))]
    assert plan_copies(merged, boundaries=(3 * MB,)).runs == (Run(0, 3 * MB, (0, 1), 0), Run(3 * MB, MB, (0, 1), 3 * MB))
    assert plan_copies(merged).runs == (Run(0, 4 * MB, (0, 1)),)  # registered whole: one copy


def test_gathers_never_cross_a_boundary() -> None:
    items = [Item(i * 1024, 100, D, (i, 0)) for i in range(8)]
    plan = plan_copies(items, boundaries=(4096,))
    assert [g.members for g in plan.gathers] == [tuple((i, i * 1024) for i in range(4)), tuple((i, (i - 4) * 1024) for i in range(4, 8))]
    small_across = plan_copies([Item(4000, 200, D, (1, 0))], boundaries=(4096,))
    assert small_across.gathers == () and small_across.runs == (Run(4000, 96, (0,), 0), Run(4096, 104, (0,), 96))


def test_split_runs_place_every_byte() -> None:
    torch.manual_seed(1)
    flat = torch.randn(3 * 1024)
    a, b = flat[:1024], flat[1024:]  # back to back in storage and destination: one run of 12 KiB
    strided = torch.randn(40, 30).t()  # 4800 bytes, not contiguous
    tensors, offsets = [a, b, strided], [0, 4096, 12288]
    dst = torch.zeros(12288 + 4800, dtype=torch.uint8)
    items = [item_of(t, off, t.numel() * t.element_size(), "cpu") for t, off in zip(tensors, offsets)]
    plan = plan_copies(items, small_bytes=0, boundaries=(1000, 6000, 14000))
    assert len(plan.runs) == 5 and all(not any(r.offset < c < r.offset + r.nbytes for c in (1000, 6000, 14000)) for r in plan.runs)
    run_copies(plan, tensors, dst)
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        assert torch.equal(dst[off : off + n], t.contiguous().reshape(-1).view(torch.uint8)), t.shape
