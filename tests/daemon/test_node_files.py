"""One node's write plan (daemon/ckptd/daemon/plan/node_files.py), pure: files, headers and
offsets, arena runs, codings, the bytes the free-space check counts, and which files may be
linked from the previous step; no arenas, no storage."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ckptd.common.boxes import Box
from ckptd.format.index import CheckpointIndex, FragmentRecord, QuantRecord, layout_files
from ckptd.format.safetensors_header import safetensors_header
from ckptd.common.chunks import checksum_name
from ckptd.daemon.plan.files import NodeManifest, PlacedTensor, fragment_records, step_files, stored_tensors
from ckptd.daemon.plan.node_files import (
    ArenaRun,
    NodeFilePlan,
    NodeFilePlans,
    TensorBytes,
    compressed_tensors,
    file_bytes_bound,
    frozen_names,
    header_room,
    plan_node_files,
)
from ckptd.daemon.plan.save_plan import SavePlan, TensorSpec, make_save_plan

def _full(name: str, kind: str, dtype: str, shape: tuple[int, ...], frozen: str = "") -> TensorSpec:
    return TensorSpec(name, kind, dtype, shape, Box.full(shape), frozen=frozen)


def _plan(specs: list[TensorSpec]) -> SavePlan:
    return make_save_plan([specs])


# ------------------------------------------------------------------ lossless files


def test_a_lossless_file_is_its_header_and_its_tensors_back_to_back() -> None:
    plan = _plan([_full("model/a", "model", "F32", (8, 8)), _full("model/b", "model", "BF16", (4,)), _full("optimizer/state/a/step", "optimizer", "F32", ())])
    files = plan_node_files(plan, 0, 1 << 30)
    assert [f.name for f in files.files] == ["model-00001-of-00001.safetensors", "optimizer-00001-of-00001.safetensors"]  # largest first
    model = files.files[0]
    header, entries = safetensors_header([("a", "F32", (8, 8)), ("b", "BF16", (4,))])
    assert model.header == header and model.room == len(header) and not model.appended
    assert [(i.tensor.key, i.offset) for i in model.fixed] == [("a", len(header) + entries[0].begin), ("b", len(header) + entries[1].begin)]
    assert model.record is not None and model.record.size == len(header) + 8 * 8 * 4 + 4 * 2 == model.bound
    assert model.record.checksum.startswith("xxh3-64:")
    assert [(s.name, s.bound) for s in files.space] == [(f.name, f.bound) for f in files.files]
    assert files.candidates == () and files.codings == {} and files.cast == {} and files.dropped_bytes == 0


# max_file_bytes, expected files (name, tensor keys), largest first
SPLITS = [
    (1 << 30, [("model-00001-of-00001.safetensors", ["a", "b", "c"])]),
    (300, [("model-00001-of-00002.safetensors", ["a", "b"]), ("model-00002-of-00002.safetensors", ["c"])]),
    (200, [("model-00001-of-00003.safetensors", ["a"]), ("model-00002-of-00003.safetensors", ["b"]), ("model-00003-of-00003.safetensors", ["c"])]),
]


@pytest.mark.parametrize(("max_file_bytes", "expected"), SPLITS)
def test_files_are_split_at_max_file_bytes_and_listed_largest_first(max_file_bytes: int, expected: list[tuple[str, list[str]]]) -> None:
    plan = _plan([_full("model/a", "model", "F32", (50,)), _full("model/b", "model", "F32", (25,)), _full("model/c", "model", "F32", (60,))])
    files = plan_node_files(plan, 0, max_file_bytes)
    got = [(f.name, [i.tensor.key for i in f.fixed]) for f in files.files]
    assert sorted(got) == sorted(expected)
    assert [f.nbytes for f in files.files] == sorted((f.nbytes for f in files.files), reverse=True)


def test_a_tensor_held_by_two_ranks_is_assembled_from_both_slots_in_value_order() -> None:
    shape = (4, 6)
    top, bottom = Box((0, 0), (2, 6)), Box((2, 0), (2, 6))
    plan = make_save_plan([[TensorSpec("model/w", "model", "F32", shape, top)], [TensorSpec("model/w", "model", "F32", shape, bottom)]])
    (file,) = plan_node_files(plan, 0, 1 << 30).files
    (item,) = file.fixed
    slot = {s.box: s for s in plan.slots}
    assert item.values == TensorBytes("F32", shape, (ArenaRun(slot[top].rank, slot[top].offset, 0, 48), ArenaRun(slot[bottom].rank, slot[bottom].offset, 48, 48)))
    assert item.values.nbytes == 96 == file.snapshot_bytes


# ------------------------------------------------------------------ compression


def _adam(rows: int = 128, cols: int = 64) -> list[TensorSpec]:
    return [
        _full("model/w", "model", "BF16", (rows, cols)),
        _full("master/w", "master", "F32", (rows, cols)),
        _full("optimizer/state/w/exp_avg", "optimizer", "F32", (rows, cols)),
        _full("optimizer/state/w/step", "optimizer", "F32", ()),
    ]


def test_quantized_codes_are_appended_into_room_reserved_for_the_header() -> None:
    plan = _plan(_adam())
    tensors = {t.name: t for t in plan.tensors}
    files = plan_node_files(plan, 0, 1 << 30, quantize="O1")
    optimizer = next(f for f in files.files if f.name.startswith("optimizer"))
    assert [i.tensor.key for i in optimizer.fixed] == ["optimizer/state/w/step"]
    (late,) = optimizer.appended
    assert late.tensor.key == "optimizer/state/w/exp_avg" and late.coding.codec is not None
    assert late.values.dtype == "F32" and late.values.nbytes == 128 * 64 * 4
    assert optimizer.record is None  # size and checksum known once coded
    stored, _, _ = compressed_tensors(stored_tensors(plan), tensors, 0, "O1", "keep")
    (layout,) = [f for f in layout_files(stored, {t.name: t.kind for t in plan.tensors}, 1 << 30) if f.name == optimizer.name]
    (scales,) = [t for t in layout.tensors if t.role == "scales"]
    assert optimizer.room == header_room([i.tensor for i in optimizer.fixed], [late.tensor], tensors, {(late.tensor.name, late.tensor.box): scales.shape})
    assert optimizer.room > len(optimizer.header) and optimizer.appended_from == optimizer.room + 4
    # the bound counts the values as they are (a fallback) plus their scales
    assert optimizer.bound == file_bytes_bound(layout, tensors) >= optimizer.room + 4 + late.values.nbytes + scales.nbytes
    assert set(files.codings) == {(late.tensor.name, late.tensor.box)}


def test_master_weights_as_residuals_of_their_model_twins() -> None:
    plan = _plan(_adam())
    files = plan_node_files(plan, 0, 1 << 30, master_weights="residual")
    master = next(f for f in files.files if f.name.startswith("master_weights"))
    (item,) = master.fixed
    assert item.tensor.dtype == "BF16" and item.coding is not None and item.coding.model is not None
    assert item.coding.model.name == "model/w" and item.twin is not None and item.twin.dtype == "BF16"
    assert item.values.dtype == "F32" and master.record is not None  # a residual's size is known: its header too
    assert files.cast == {} and files.dropped_bytes == 0


def test_dropped_master_weights_are_cast_and_counted_as_written() -> None:
    plan = _plan(_adam())
    files = plan_node_files(plan, 0, 1 << 30, master_weights="drop")
    assert not any(f.name.startswith("master_weights") for f in files.files)
    assert set(files.cast) == {"master/w"} and files.cast["master/w"].name == "model/w"
    assert files.dropped_bytes == 128 * 64 * 4


def test_small_moments_stay_lossless() -> None:
    plan = _plan(_adam(rows=8, cols=8))
    files = plan_node_files(plan, 0, 1 << 30, quantize="O1")
    assert files.codings == {} and all(f.record is not None and f.bound == f.record.size for f in files.files)


# ------------------------------------------------------------------ the space check's files


def _two_nodes() -> SavePlan:
    return make_save_plan(
        [[_full("model/a", "model", "F32", (64,))], [_full("model/b", "model", "F32", (32,))]], node_of_rank=[0, 1]
    )


@pytest.mark.parametrize(("node", "shared_dir", "writes", "counted"), [
    (0, False, ["model-00001-of-00002.safetensors"], ["model-00001-of-00002.safetensors"]),
    (1, False, ["model-00002-of-00002.safetensors"], ["model-00002-of-00002.safetensors"]),
    (1, True, ["model-00002-of-00002.safetensors"], ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
])
def test_a_shared_directory_counts_every_nodes_files(node: int, shared_dir: bool, writes: list[str], counted: list[str]) -> None:
    files = plan_node_files(_two_nodes(), node, 1 << 30, shared_dir=shared_dir)
    assert [f.name for f in files.files] == writes
    assert [s.name for s in files.space] == counted
    assert all(s.bound == len(safetensors_header([("a" if s.nbytes == 256 else "b", "F32", (s.nbytes // 4,))])[0]) + s.nbytes for s in files.space)


# ------------------------------------------------------------------ link candidates


def _frozen_specs(buffer_frozen: str = "buffer", param_frozen: str = "param") -> list[TensorSpec]:
    return [
        _full("model/base", "model", "F32", (32, 32), frozen=param_frozen),
        _full("model/lora", "model", "F32", (4, 32)),
        _full("model/norm.running_mean", "model", "F32", (32,), frozen=buffer_frozen),
    ]


def _committed(plan: SavePlan, files: NodeFilePlan) -> CheckpointIndex:
    """The index a step written as `files` plans would have (made-up digests)."""
    placed = [PlacedTensor(i.tensor, f.name, i.offset, 7, "") for f in files.files for i in f.fixed]
    records = tuple(f.record for f in files.files if f.record is not None)
    manifest = NodeManifest(files.node, records, fragment_records(placed, files.codings, {}, files.cast))
    index, _ = step_files("job", 1, plan, [manifest], {}, {}, None, lambda: 0.0)
    return index


def _edit(index: CheckpointIndex, which: str, **changes: object) -> CheckpointIndex:
    """`index` with the fragment under key `which` changed."""
    tensors = tuple(replace(t, fragments=tuple(replace(f, **changes) if f.key == which else f for f in t.fragments)) for t in index.tensors)
    return replace(index, tensors=tensors)


def _candidates(previous: CheckpointIndex, plan: SavePlan, **options: object) -> list[str]:
    files = plan_node_files(plan, 0, 1 << 30, previous=previous, **options)  # type: ignore[arg-type]
    return sorted(c.file.name for c in files.candidates)


FROZEN_FILES = ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]  # the buffer's, the frozen parameter's


def test_files_of_frozen_tensors_with_the_previous_header_and_places_are_candidates() -> None:
    plan = _plan(_frozen_specs())
    previous = _committed(plan, plan_node_files(plan, 0, 1 << 30))
    files = plan_node_files(plan, 0, 1 << 30, previous=previous)
    assert sorted(c.file.name for c in files.candidates) == FROZEN_FILES
    for c in files.candidates:
        assert c.previous.name == c.file.name and c.file.record is not None and (c.previous.size, c.previous.checksum) == (c.file.record.size, c.file.record.checksum)
        assert [e.key for e in c.expected] == [i.tensor.key for i in c.file.fixed]


# (what changed in the previous step, the candidates left)
CHANGES = [
    ("nothing", FROZEN_FILES),
    ("another offset", [FROZEN_FILES[1]]),
    ("a quantized fragment", [FROZEN_FILES[1]]),
    ("another dtype", [FROZEN_FILES[1]]),
    ("no fragment there", [FROZEN_FILES[1]]),
    ("another header", [FROZEN_FILES[1]]),
    ("written by another node", [FROZEN_FILES[1]]),
]


@pytest.mark.parametrize(("change", "left"), CHANGES)
def test_a_file_is_a_candidate_only_when_nothing_about_its_places_changed(change: str, left: list[str]) -> None:
    plan = _plan(_frozen_specs())
    previous = _committed(plan, plan_node_files(plan, 0, 1 << 30))
    buffer = "norm.running_mean"
    if change == "another offset":
        previous = _edit(previous, buffer, offset=9)
    elif change == "a quantized fragment":
        previous = _edit(previous, buffer, quant=QuantRecord("cast"))
    elif change == "another dtype":
        previous = _edit(previous, buffer, dtype="I32")
    elif change == "no fragment there":
        previous = _edit(previous, buffer, key="elsewhere")
    elif change == "another header":
        previous = replace(previous, files=tuple(replace(f, checksum=checksum_name(1)) if f.name == FROZEN_FILES[0] else f for f in previous.files))
    elif change == "written by another node":
        previous = replace(previous, files=tuple(replace(f, node=1) if f.name == FROZEN_FILES[0] else f for f in previous.files))
    assert _candidates(previous, plan) == left


def test_a_file_another_node_wrote_into_a_shared_directory_is_a_candidate() -> None:
    plan = _plan(_frozen_specs())
    previous = _committed(plan, plan_node_files(plan, 0, 1 << 30))
    previous = replace(previous, files=tuple(replace(f, node=1) for f in previous.files))
    assert _candidates(previous, plan) == []
    assert _candidates(previous, plan, shared_dir=True) == FROZEN_FILES


def test_without_frozen_parameters_nothing_is_a_candidate() -> None:
    """Frozen buffers alone keep the layout a fully trained model always had: nothing is linked."""
    plan = _plan(_frozen_specs(param_frozen=""))
    assert frozen_names(plan.tensors) == {}
    previous = _committed(plan, plan_node_files(plan, 0, 1 << 30))
    assert _candidates(previous, plan) == []


def test_a_fragment_record_kept_as_it_was_written_matches() -> None:
    """The plan's expected fragments are the previous index's records, unchanged."""
    plan = _plan(_frozen_specs())
    previous = _committed(plan, plan_node_files(plan, 0, 1 << 30))
    files = plan_node_files(plan, 0, 1 << 30, previous=previous)
    recorded = {(f.file, f.key): f for t in previous.tensors for f in t.fragments}
    for c in files.candidates:
        assert all(isinstance(e, FragmentRecord) and recorded[(c.previous.name, e.key)] == e for e in c.expected)


# ------------------------------------------------------------------ the files of a job's last save, reused


def test_a_jobs_files_are_planned_once_per_save_plan_and_inputs() -> None:
    plan = _plan([_full("model/a", "model", "F32", (8, 8)), _full("optimizer/state/a/exp_avg", "optimizer", "F32", (8, 8))])
    plans = NodeFilePlans()
    first = plans.plan("job", plan, 0, 1 << 30)
    assert first == plan_node_files(plan, 0, 1 << 30)
    assert plans.plan("job", plan, 0, 1 << 30).files is first.files  # the same plan again: not planned again
    assert plans.plan("other", plan, 0, 1 << 30).files is not first.files  # each job its own
    again = make_save_plan([[_full("model/a", "model", "F32", (8, 8)), _full("optimizer/state/a/exp_avg", "optimizer", "F32", (8, 8))]])
    assert plans.plan("job", again, 0, 1 << 30).files is not first.files  # another plan object (the cache only keeps what it planned)
    for inputs in ({"quantize": "O1"}, {"shared_dir": True}):
        assert plans.plan("job", again, 0, 1 << 30, **inputs) == plan_node_files(again, 0, 1 << 30, **inputs)  # type: ignore[arg-type]
    assert plans.plan("job", again, 0, 1 << 20) == plan_node_files(again, 0, 1 << 20)


def test_reused_files_find_their_link_candidates_in_each_previous_step() -> None:
    plan = _plan(_frozen_specs())
    plans = NodeFilePlans()
    assert plans.plan("job", plan, 0, 1 << 30).candidates == ()
    previous = _committed(plan, plan_node_files(plan, 0, 1 << 30))
    assert plans.plan("job", plan, 0, 1 << 30, previous=previous) == plan_node_files(plan, 0, 1 << 30, previous=previous)
    assert sorted(c.file.name for c in plans.plan("job", plan, 0, 1 << 30, previous=previous).candidates) == FROZEN_FILES
    changed = _edit(previous, "base", offset=9)
    assert plans.plan("job", plan, 0, 1 << 30, previous=changed).candidates == plan_node_files(plan, 0, 1 << 30, previous=changed).candidates


def test_the_plans_of_the_jobs_planned_last_are_kept() -> None:
    plan = _plan([_full("model/a", "model", "F32", (4,))])
    plans = NodeFilePlans(jobs=2)
    kept = {job: plans.plan(job, plan, 0, 1 << 30).files for job in ("a", "b")}
    plans.plan("a", plan, 0, 1 << 30)  # a used last: b is the oldest
    plans.plan("c", plan, 0, 1 << 30)
    assert plans.plan("a", plan, 0, 1 << 30).files is kept["a"]
    assert plans.plan("b", plan, 0, 1 << 30).files is not kept["b"]


@pytest.mark.parametrize(
    ("boxes", "problem"),
    [
        ([Box((0, 0), (4, 6))], ""),  # whole, once
        ([Box((0, 0), (2, 6)), Box((2, 0), (2, 6))], ""),  # two fragments that tile it
        ([Box((1, 0), (4, 6))], "outside"),  # the tensor's lengths, but not at its origin
        ([Box((0, 0), (2, 6))], "cover"),
        ([Box((0, 0), (4, 6)), Box((0, 0), (2, 6))], "overlap"),
        ([], "cover"),
    ],
)
def test_the_commit_takes_only_fragments_that_tile_each_tensor_exactly(boxes: list[Box], problem: str) -> None:
    from ckptd.daemon.plan.files import IncompleteStep

    plan = _plan([_full("model/w", "model", "F32", (4, 6))])
    fragments = tuple(("model/w", FragmentRecord("m.safetensors", f"w{i}", b, "F32", 0, b.numel * 4, "xxh3-64:0")) for i, b in enumerate(boxes))
    manifest = NodeManifest(0, (), fragments)
    if not problem:
        index, _ = step_files("job", 1, plan, [manifest], {}, {}, None, lambda: 0.0)
        assert [f.box for f in index.tensors[0].fragments] == sorted(boxes)
        return
    with pytest.raises(IncompleteStep, match=f"model/w: .*{problem}"):
        step_files("job", 1, plan, [manifest], {}, {}, None, lambda: 0.0)
