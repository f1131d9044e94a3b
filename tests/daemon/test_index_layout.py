"""The index's layout (daemon/ckptd/daemon/plan/index_layout.py), pure: the text and records it
makes are those CheckpointIndex makes of the same fragments, and it is reused only while every
field but the checksums is the same."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ckptd.common.boxes import Box
from ckptd.format.index import INDEX_NAME, CheckpointIndex, FileRecord, FragmentRecord, QuantRecord, SideRecord
from ckptd.daemon.plan.files import IncompleteStep, NodeManifest, step_files
from ckptd.daemon.plan.index_layout import IndexLayout, IndexLayouts
from ckptd.daemon.plan.save_plan import SavePlan, TensorSpec, make_save_plan


def _plan() -> SavePlan:
    """Two nodes: w sharded by rows over four ranks, b and an empty tensor whole, aliases."""
    specs = [
        [
            TensorSpec("model/w", "model", "F32", (8, 4), Box((2 * r, 0), (2, 4)), aliases=("model/tied",)),
            TensorSpec("optimizer/state/w/exp_avg", "optimizer", "F32", (8, 4), Box((2 * r, 0), (2, 4))),
            TensorSpec('model/b"\\é', "model", "BF16", (6,), Box.full((6,))),
            TensorSpec("model/empty", "model", "F32", (0,), Box.full((0,))),
        ]
        for r in range(4)
    ]
    return make_save_plan(specs, node_of_rank=[0, 0, 1, 1])


def _manifests(plan: SavePlan, salt: str = "0", offset: int = 0) -> list[NodeManifest]:
    """Fragments as two nodes would report them (node 1 lists its rows first, in reverse, to
    show the index orders them by box), checksums made of `salt`."""
    by_node: dict[int, list[tuple[str, FragmentRecord]]] = {0: [], 1: []}
    at = 100 + offset
    for part in plan.parts:
        t = next(t for t in plan.tensors if t.name == part.name)
        nbytes = part.box.numel * (2 if t.dtype == "BF16" else 4)
        chunked = nbytes >= 32
        record = FragmentRecord(
            f"{t.kind}-{part.node}.safetensors", f"{part.name.rsplit('/', 1)[-1]}@{part.box.offsets}", part.box, t.dtype, at, nbytes,
            f"xxh3-64:{salt * 16}", 16 if chunked else 0, (salt * 16) * (nbytes // 16) if chunked else "",
        )
        by_node[part.node].append((part.name, record))
        at += nbytes
    return [NodeManifest(node, _files_of(by_node[node]), tuple(by_node[node] if node == 0 else reversed(by_node[node]))) for node in (0, 1)]


def _files_of(fragments: list[tuple[str, FragmentRecord]]) -> tuple[FileRecord, ...]:
    """The data files the fragments are in (a manifest lists every file its fragments name)."""
    return tuple(FileRecord(name, 1, "xxh3-64:" + "0" * 16) for name in sorted({record.file for _, record in fragments}))


def _general_index_bytes(index: CheckpointIndex) -> bytes:
    """The index's bytes as CheckpointIndex makes them from its records alone, whose tensors
    are also what json's encoder makes of each record's to_json (the layout's text shares
    json_text with to_json_bytes; this side does not)."""
    data = index.to_json_bytes()
    assert json.loads(data)["tensors"] == {t.name: t.to_json() for t in index.tensors}
    return data


def test_the_index_made_from_a_layout_is_the_one_its_records_encode_to() -> None:
    plan = _plan()
    index, files = step_files("job", 3, plan, _manifests(plan), {0: {}}, {}, None, lambda: 1.5)
    assert files[INDEX_NAME] == _general_index_bytes(index)
    parsed = CheckpointIndex.from_json_bytes(files[INDEX_NAME])
    assert parsed.tensors == index.tensors
    w = index.by_name()["model/tied"]
    assert [f.box.offsets for f in w.fragments] == [(0, 0), (2, 0), (4, 0), (6, 0)]  # by box, whatever the nodes' order
    assert index.by_name()["model/empty"].fragments[0].nbytes == 0


def test_a_repeated_layout_is_reused_and_gives_the_new_checksums() -> None:
    plan, layouts = _plan(), IndexLayouts()
    step_files("job", 1, plan, _manifests(plan, "a"), {0: {}}, {}, None, lambda: 1.0, layouts=layouts)
    kept = layouts.of(plan, [n for m in _manifests(plan, "a") for n in m.fragments])
    second, files = step_files("job", 2, plan, _manifests(plan, "b"), {0: {}}, {}, None, lambda: 2.0, layouts=layouts)
    assert layouts.of(plan, [n for m in _manifests(plan, "c") for n in m.fragments]) is kept  # reused
    assert files[INDEX_NAME] == _general_index_bytes(second)
    assert all(f.checksum == "xxh3-64:" + "b" * 16 for t in second.tensors for f in t.fragments)
    assert b"a" * 16 not in files[INDEX_NAME]  # no checksum of the first save is left in the text


@pytest.mark.parametrize(
    "change",
    [
        lambda f: replace(f, offset=f.offset + 8),
        lambda f: replace(f, file="other.safetensors"),
        lambda f: replace(f, key="renamed"),
        lambda f: replace(f, dtype="F16"),
        lambda f: replace(f, chunk_bytes=0, chunk_xxh3=""),
        lambda f: replace(f, quant=QuantRecord("lin-i4", 128, scales=SideRecord("s.safetensors", "s", "F32", (1,), 0, 4, "xxh3-64:01"))),
    ],
    ids=["offset", "file", "key", "dtype", "chunks", "quant"],
)
def test_a_layout_is_made_anew_when_any_field_but_the_checksums_changes(change) -> None:
    plan, layouts = _plan(), IndexLayouts()
    step_files("job", 1, plan, _manifests(plan), {0: {}}, {}, None, layouts=layouts)
    manifests = _manifests(plan, "9")
    at = [name for name, _ in manifests[0].fragments].index("model/w")
    name, first = manifests[0].fragments[at]
    changed = list(manifests[0].fragments)
    changed[at] = (name, change(first))
    manifests[0] = replace(manifests[0], fragments=tuple(changed))
    before = layouts.of(plan, [n for m in _manifests(plan) for n in m.fragments])
    assert not before.fits(plan, [n for m in manifests for n in m.fragments])
    index, files = step_files("job", 2, plan, manifests, {0: {}}, {}, None, layouts=layouts)
    assert files[INDEX_NAME] == _general_index_bytes(index)
    assert change(first) in index.by_name()[name].fragments


def test_a_layout_is_made_anew_for_another_plan_object_or_other_fragments() -> None:
    plan = _plan()
    fragments = [n for m in _manifests(plan) for n in m.fragments]
    layout = IndexLayout.of(plan, fragments)
    assert layout.fits(plan, fragments)
    assert not layout.fits(_plan(), fragments)  # equal, but not the plan the layout was made for
    assert not layout.fits(plan, fragments[1:] + fragments[:1])  # other order
    assert not layout.fits(plan, fragments[:-1])


def test_fragments_that_miss_or_overlap_a_tensor_or_name_an_unknown_one_are_refused() -> None:
    plan = _plan()
    fragments = [n for m in _manifests(plan) for n in m.fragments]
    with pytest.raises(IncompleteStep, match="model/w"):
        IndexLayout.of(plan, [n for n in fragments if not (n[0] == "model/w" and n[1].box.offsets == (2, 0))])
    with pytest.raises(IncompleteStep, match="model/w"):
        IndexLayout.of(plan, fragments + [n for n in fragments if n[0] == "model/w"][:1])
    with pytest.raises(IncompleteStep, match="does not have: model/ghost"):
        IndexLayout.of(plan, fragments + [("model/ghost", fragments[0][1])])


def test_the_hugging_face_index_files_come_from_the_layout() -> None:
    plan = _plan()
    _, files = step_files("job", 1, plan, _manifests(plan), {0: {}}, {}, None)
    assert "model.safetensors.index.json" not in files  # model tensors in fragments: `ckptd export` makes it
    optimizer = json.loads(files["optimizer.safetensors.index.json"])
    assert set(optimizer["weight_map"].values()) == {"optimizer-0.safetensors", "optimizer-1.safetensors"}


def test_the_extras_text_of_an_unchanged_ranks_extras_is_not_encoded_again() -> None:
    from ckptd.daemon.plan.files import CompactExtras
    from ckptd.format.json_text import compact_json

    texts = CompactExtras(max_bytes=40)
    same, changed = {"names": ["a", "b"]}, {"names": ["a"]}
    first = texts.texts({0: same, 1: changed})
    assert first == {0: compact_json(same), 1: compact_json(changed)}
    other = {"names": ["a"]}  # equal to rank 1's, another object: encoded anew
    second = texts.texts({0: same, 1: other})
    assert second[0] is first[0] and second[1] == first[1] and second[1] is not first[1]
    assert texts.texts({1: other})[1] is second[1]  # rank 0 left: forgotten
    assert texts.texts({0: same, 1: other})[0] is not first[0]
    big = {"names": ["x" * 50]}  # over max_bytes: encoded each time, never kept
    assert texts.texts({0: big})[0] is not texts.texts({0: big})[0]


def test_step_files_with_the_extras_texts_writes_the_extra_json_it_writes_without() -> None:
    from ckptd.daemon.plan.files import CompactExtras
    from ckptd.format.index import EXTRA_JSON

    plan, texts = _plan(), CompactExtras()
    extras = {0: {"sched": {"lr": 0.1}}, 2: {"rng": [1, 2]}}
    _, plain = step_files("job", 3, plan, _manifests(plan), extras, {}, None, lambda: 1.5)
    for _ in range(2):
        _, files = step_files("job", 3, plan, _manifests(plan), extras, {}, None, lambda: 1.5, extras_texts=texts)
        assert files[EXTRA_JSON] == plain[EXTRA_JSON]
