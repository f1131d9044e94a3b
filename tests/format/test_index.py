"""The on-disk format: index round trip, golden records, file layout (the safetensors header: test_safetensors_header.py)."""

import json
from typing import Any

import pytest

from ckptd.common.boxes import Box
from ckptd.format.index import (
    INDEX_HEAD_BYTES,
    CheckpointIndex,
    FileRecord,
    FormatError,
    FragmentRecord,
    QuantRecord,
    SideRecord,
    StoredTensor,
    TensorRecord,
    file_key,
    layout_files,
    parse_step_dir_name,
    step_dir_name,
)


def test_index_round_trip() -> None:
    frag = FragmentRecord("model-00001-of-00001.safetensors", "w", Box((0,), (4,)), "F32", 128, 16, "xxh3-64:00ff")
    index = CheckpointIndex(
        job="j", step=7, created_at=1.5, world_size=2,
        tensors=(TensorRecord("model/w", "model", "F32", (4,), (frag,), ("model/v",)),),
        files=(FileRecord("model-00001-of-00001.safetensors", 144, "xxh3-64:1"),), metric=0.25,
    )
    again = CheckpointIndex.from_json_bytes(index.to_json_bytes())
    assert again == index
    assert again.by_name()["model/v"].name == "model/w"
    doc = json.loads(index.to_json_bytes())
    assert doc["format"] == "ckptd/1" and doc["tensors"]["model/w"]["fragments"][0]["offset"] == 128


def _records_of_every_shape() -> list[TensorRecord]:
    """Tensor records with every optional field set and unset, names that need escaping."""
    scales = SideRecord("o.safetensors", "w@scales", "F32", (4, 1), 208, 16, "xxh3-64:02", 65536, "ab" * 8)
    plain = FragmentRecord("m.safetensors", 'w"\\é\n', Box((0, 0), (4, 6)), "F32", 128, 96, "xxh3-64:00ff")
    chunked = FragmentRecord("m.safetensors", "w", Box((2, 0), (2, 6)), "F32", 0, 48, "xxh3-64:01", 65536, "cd" * 8)
    coded = FragmentRecord("o.safetensors", "w", Box((0, 0), (2, 6)), "U8", 192, 12, "xxh3-64:03", quant=QuantRecord("lin-i4", 128, scales=scales))
    return [
        TensorRecord('model/w"\\é', "model", "F32", (4, 6), (plain,), ("model/v", "ü")),
        TensorRecord("model/s", "model", "F32", (4, 6), (chunked, coded), (), rank=3),
        TensorRecord("model/e", "model", "F32", (0,), ()),
    ]


@pytest.mark.parametrize("record", _records_of_every_shape(), ids=["aliases", "rank-quant-chunks", "empty"])
def test_a_records_json_text_is_what_jsons_encoder_makes_of_it(record: TensorRecord) -> None:
    encode = json.JSONEncoder(separators=(",", ":")).encode
    from ckptd.format.json_text import fragment_json, tensor_json

    assert tensor_json(record) == encode(record.to_json())
    assert all(fragment_json(f) == encode(f.to_json()) for f in record.fragments)


def test_an_index_is_its_records_encoded_one_at_a_time() -> None:
    encode = json.JSONEncoder(separators=(",", ":")).encode
    tensors = tuple(_records_of_every_shape())
    sides = [side for t in tensors for f in t.fragments if f.quant is not None for side in (f.quant.scales, f.quant.base) if side is not None]
    used = sorted({f.file for t in tensors for f in t.fragments} | {side.file for side in sides})
    index = CheckpointIndex(job="j", step=1, created_at=1.5, world_size=1, tensors=tensors, files=tuple(FileRecord(name, 9, "xxh3-64:1") for name in used))
    data = index.to_json_bytes()
    one_at_a_time = ",".join(f"{encode(t.name)}:{encode(t.to_json())}" for t in tensors)
    assert data.endswith(f',"tensors":{{{one_at_a_time}}}}}\n'.encode())
    assert CheckpointIndex.from_json_bytes(data) == index
    empty = CheckpointIndex(job="j", step=1, created_at=1.5, world_size=1, tensors=(), files=())
    assert json.loads(empty.to_json_bytes())["tensors"] == {}


@pytest.mark.parametrize("weight_map", [{}, {"b": "m-2.safetensors", "a": "m-1.safetensors"}, {'k"\\é\n': "ü.safetensors"}])
def test_the_hf_index_is_what_json_writes_with_an_indent_of_two(weight_map: dict[str, str]) -> None:
    from ckptd.format.json_text import hf_index_json

    doc = {"metadata": {"total_size": 1234}, "weight_map": dict(sorted(weight_map.items()))}
    assert hf_index_json(1234, weight_map) == json.dumps(doc, indent=2).encode() + b"\n"


@pytest.mark.parametrize("ranks", [{}, {0: {}}, {3: {"a": [1, 2.5, None, 'k"\\é\u2028'], "b": {"x": float("inf")}}, 0: {"s": 1}, 12: {"__tensor__": "m/x"}}])
def test_extra_json_is_what_jsons_compact_encoder_writes_with_or_without_the_ranks_texts(ranks: dict[int, Any]) -> None:
    from ckptd.format.index import EXTRA_FORMAT, extra_json
    from ckptd.format.json_text import compact_json

    doc = {"format": EXTRA_FORMAT, "step": 7, "ranks": {str(r): ranks[r] for r in sorted(ranks)}}
    expected = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
    assert extra_json(7, ranks) == expected
    assert extra_json(7, ranks, {r: compact_json(v) for r, v in ranks.items()}) == expected
    some = dict(list(ranks.items())[:1])  # some ranks' texts known, the others encoded
    assert extra_json(7, ranks, {r: compact_json(v) for r, v in some.items()}) == expected


def test_compressed_index_round_trip_and_golden_records() -> None:
    """A quantized fragment, a residual and a dropped master weight: `ckptd/2`, the records as
    they appear in the JSON, and the same index back."""
    scales = SideRecord("optimizer-00001-of-00001.safetensors", "optimizer/state/w/exp_avg@scales", "F32", (4, 1, 1), 208, 16, "xxh3-64:02")
    quantized = FragmentRecord(
        "optimizer-00001-of-00001.safetensors", "optimizer/state/w/exp_avg", Box((0, 0), (4, 6)), "U8", 192, 12, "xxh3-64:01",
        quant=QuantRecord("lin-i4", 128, scales=scales),
    )
    model = FragmentRecord("model-00001-of-00001.safetensors", "w", Box((0, 0), (4, 6)), "BF16", 96, 48, "xxh3-64:03")
    base = SideRecord(model.file, model.key, "BF16", (4, 6), 96, 48, "xxh3-64:03")
    residual = FragmentRecord("master_weights-00001-of-00001.safetensors", "master/w", model.box, "BF16", 80, 48, "xxh3-64:04", quant=QuantRecord("residual-bf16", base=base))
    cast = FragmentRecord(model.file, model.key, model.box, "BF16", 96, 48, "xxh3-64:03", quant=QuantRecord("cast"))
    index = CheckpointIndex(
        job="j", step=3, created_at=2.0, world_size=1,
        tensors=(
            TensorRecord("model/w", "model", "BF16", (4, 6), (model,)),
            TensorRecord("master/w", "master", "F32", (4, 6), (residual,)),
            TensorRecord("master/v", "master", "F32", (4, 6), (cast,)),
            TensorRecord("optimizer/state/w/exp_avg", "optimizer", "F32", (4, 6), (quantized,)),
        ),
        files=tuple(FileRecord(name, 1, "xxh3-64:01") for name in (model.file, residual.file, quantized.file)),
        quantization={"generation": 1, "quantize": "O2", "master_weights": "residual"},
    )
    data = index.to_json_bytes()
    again = CheckpointIndex.from_json_bytes(data)
    assert again == index and again.generation == 1 and again.compressed
    doc = json.loads(data)
    assert doc["format"] == "ckptd/2"
    assert doc["quantization"] == {"generation": 1, "quantize": "O2", "master_weights": "residual"}
    assert doc["tensors"]["optimizer/state/w/exp_avg"]["fragments"][0]["quant"] == {
        "codec": "lin-i4", "block": 128,
        "scales": {"file": "optimizer-00001-of-00001.safetensors", "key": "optimizer/state/w/exp_avg@scales", "dtype": "F32",
                   "shape": [4, 1, 1], "offset": 208, "nbytes": 16, "checksum": "xxh3-64:02"},
    }
    assert doc["tensors"]["master/v"]["fragments"][0]["quant"] == {"codec": "cast"}
    assert doc["tensors"]["master/w"]["fragments"][0]["quant"]["base"]["key"] == "w"
    assert "quant" not in doc["tensors"]["model/w"]["fragments"][0]
    # a lossless index stays ckptd/1, without a quantization record
    plain = CheckpointIndex("j", 1, 0.0, 1, (TensorRecord("model/w", "model", "BF16", (4, 6), (model,)),), (FileRecord(model.file, 1, "xxh3-64:01"),))
    assert json.loads(plain.to_json_bytes())["format"] == "ckptd/1" and "quantization" not in json.loads(plain.to_json_bytes())
    assert CheckpointIndex.from_json_bytes(plain.to_json_bytes()).generation == 0
    # issue 30 finding 5: encoded tensor by tensor, the same text as the whole document compact
    for one in (index, plain):
        assert one.to_json_bytes() == json.dumps(json.loads(one.to_json_bytes()), separators=(",", ":")).encode() + b"\n"
        assert list(json.loads(one.to_json_bytes())) == ["format", "job", "step", "created_at", "world_size", "metric", "writer", "files", "tensors"] + (
            ["quantization"] if one.quantization else []
        )


# issue 30 finding 5: the commit order reads each index's commit time from its head, not the whole index
def test_the_commit_time_is_read_from_the_head_of_an_index() -> None:
    frag = FragmentRecord("model-00001-of-00001.safetensors", "w", Box((0,), (4,)), "F32", 128, 16, "xxh3-64:00ff")
    index = CheckpointIndex("run-1.a", 7, 1732294567.25, 2, (TensorRecord("model/w", "model", "F32", (4,), (frag,)),), ())
    data = index.to_json_bytes()
    assert CheckpointIndex.created_at_of(data[:INDEX_HEAD_BYTES]) == 1732294567.25
    assert CheckpointIndex.created_at_of(json.dumps(json.loads(data), indent=1).encode()[:INDEX_HEAD_BYTES]) is None  # an older daemon's
    assert CheckpointIndex.created_at_of(b'{"format":"ckptd/1","job":"a","step":1,"created_at":NaN,') is None


@pytest.mark.parametrize("blob", [b"{}", b"[]", b'{"format": "ckptd/1"}', b"\xff", b'{"format": "other/9"}', b'{"format": "ckptd/3"}'])
def test_bad_index_is_a_format_error(blob: bytes) -> None:
    with pytest.raises(FormatError):
        CheckpointIndex.from_json_bytes(blob)


def test_layout_groups_kinds_and_splits_files() -> None:
    def t(name: str, n: int) -> StoredTensor:
        return StoredTensor(name, name.split("/", 1)[1], "F32", (n,), Box.full((n,)))

    tensors = [t("model/a", 10), t("model/b", 10), t("model/c", 10), t("optimizer/x", 4), t("rng/r", 2)]
    kinds = {"model/a": "model", "model/b": "model", "model/c": "model", "optimizer/x": "optimizer", "rng/r": "extra"}
    files = layout_files(tensors, kinds, max_file_bytes=80)
    assert [(f.name, [x.name for x in f.tensors]) for f in files] == [
        ("model-00001-of-00002.safetensors", ["model/a", "model/b"]),
        ("model-00002-of-00002.safetensors", ["model/c"]),
        ("optimizer-00001-of-00001.safetensors", ["optimizer/x"]),
        ("extra.safetensors", ["rng/r"]),
    ]


def test_layout_keeps_scales_in_the_file_of_their_codes() -> None:
    """The writer puts a quantized tensor's scales beside its codes: a split never falls between them."""
    box = Box.full((8, 8))
    codes = [StoredTensor(f"optimizer/{n}", n, "I8", (8, 8), box) for n in "xy"]
    scales = [StoredTensor(c.name, c.key + "@scales", "F32", (8, 1, 1), box, role="scales") for c in codes]
    tensors = [codes[0], scales[0], codes[1], scales[1]]
    files = layout_files(tensors, {"optimizer/x": "optimizer", "optimizer/y": "optimizer"}, max_file_bytes=64)
    assert [[(x.key, x.role) for x in f.tensors] for f in files] == [
        [("x", "data"), ("x@scales", "scales")],
        [("y", "data"), ("y@scales", "scales")],
    ]


def test_names() -> None:
    assert file_key("model/layers.0.weight", "model") == "layers.0.weight"
    assert file_key("optimizer/state/w/exp_avg", "optimizer") == "optimizer/state/w/exp_avg"
    assert step_dir_name(42) == "step-00000042"
    assert parse_step_dir_name("step-00000042") == 42
    assert parse_step_dir_name("step-42") is None and parse_step_dir_name("latest") is None


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-00000003", 3), ("step-123456789", 123456789), ("step-9223372036854775807", 2**63 - 1),
        ("step-000000003", None),  # a padded copy of step 3 would list it twice (retention refused the listing)
        ("step-0000003", None), ("step-9223372036854775808", None), ("step-²²²²²²²²", None), ("step-0000000٣", None),
        ("step-00000003 ", None), ("step--0000003", None), ("Step-00000003", None), (".step-00000003", None),
    ],
)
def test_a_step_directory_is_known_by_its_canonical_name_alone(name: str, step: int | None) -> None:
    assert parse_step_dir_name(name) == step
    if step is not None:
        assert step_dir_name(step) == name


def test_a_file_record_is_found_by_name_and_an_unknown_name_is_none() -> None:
    files = tuple(FileRecord(f"model-{i:05d}-of-10000.safetensors", i, "xxh3-64:0", i) for i in range(10000))
    index = CheckpointIndex("j", 1, 0.0, 1, (), files)
    assert index.file("model-04321-of-10000.safetensors") is files[4321]
    assert index.file("extra.json") is None and index.file("") is None


@pytest.mark.parametrize(
    "change",
    [
        {"chunks": None}, {"chunks": {"bytes": 64}}, {"offsets": ["x"]}, {"offsets": None}, {"lengths": [-1]},
        {"offsets": [0, 0]}, {"nbytes": "many"}, {"quant": None}, {"lengths": [4, 4]},
    ],
)
def test_a_malformed_fragment_record_is_a_format_error(change: dict[str, Any]) -> None:
    """Every field of a fragment is read as the type it must have; a wrong one names the index."""
    frag = FragmentRecord("model-00001-of-00001.safetensors", "w", Box((0,), (4,)), "F32", 128, 16, "xxh3-64:00ff", 16, "00ff")
    doc = json.loads(CheckpointIndex("j", 1, 1.5, 1, (TensorRecord("model/w", "model", "F32", (4,), (frag,)),), ()).to_json_bytes())
    doc["tensors"]["model/w"]["fragments"][0].update(change)
    with pytest.raises(FormatError, match="ckptd.index.json is malformed"):
        CheckpointIndex.from_json_bytes(json.dumps(doc).encode())


@pytest.mark.parametrize("name", ["../../secret.safetensors", "a/b.safetensors", "/etc/passwd", "", ".", "..", "x\n.safetensors", "é" * 200])
def test_an_index_naming_a_file_outside_its_step_directory_is_a_format_error(name: str) -> None:
    """File names are read as names in the step directory: one with '/' or '..' would lead a reader
    (the daemon's load, verify, a rank reading the file itself) out of the step or the root."""
    fragment = FragmentRecord(name, "w", Box((0,), (2,)), "F32", 8, 8, "xxh3-64:01")
    index = CheckpointIndex("j", 1, 0.0, 1, (TensorRecord("model/w", "model", "F32", (2,), (fragment,)),), (FileRecord(name, 16, "xxh3-64:02"),))
    with pytest.raises(FormatError, match="not a plain file name of a step directory"):
        CheckpointIndex.from_json_bytes(index.to_json_bytes())


def test_an_index_whose_tensor_is_in_a_file_it_does_not_list_is_a_format_error() -> None:
    fragment = FragmentRecord("other.safetensors", "w", Box((0,), (2,)), "F32", 8, 8, "xxh3-64:01")
    index = CheckpointIndex("j", 1, 0.0, 1, (TensorRecord("model/w", "model", "F32", (2,), (fragment,)),), (FileRecord("model.safetensors", 16, "xxh3-64:02"),))
    with pytest.raises(FormatError, match="tensor 'model/w' is stored in 'other.safetensors', a file the index does not list"):
        CheckpointIndex.from_json_bytes(index.to_json_bytes())


@pytest.mark.parametrize("name, plain", [("model-00001-of-00002.safetensors", True), ("extra.json", True), ("é" * 127, True), ("é" * 128, False),
                                         ("", False), (".", False), ("..", False), ("a/b", False), ("/x", False), ("x\n", False), ("x\x00", False)])
def test_a_plain_file_name_names_a_file_of_the_step_directory_and_nothing_elsewhere(name: str, plain: bool) -> None:
    from ckptd.format.index import is_plain_file_name

    assert is_plain_file_name(name) is plain
