"""What every reader checks of an index before trusting it (ckptd.format.index_checks): an
attacker's probe of 2026-12-01 flipped one bit of a fragment's offsets and every load returned
wrong values, saying nothing; a planted index nested 100,000 deep stopped the daemon."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from ckptd.common.boxes import Box
from ckptd.format.index import CheckpointIndex, FileRecord, FormatError, FragmentRecord, QuantRecord, SideRecord, TensorRecord

FILE = "model-00001-of-00001.safetensors"


def _index(*tensors: TensorRecord) -> bytes:
    return CheckpointIndex(job="j", step=3, created_at=1.5, world_size=1, tensors=tensors, files=(FileRecord(FILE, 999, "xxh3-64:1"),)).to_json_bytes()


def _halves() -> TensorRecord:
    """A (4, 6) F32 tensor stored as two row halves."""
    top = FragmentRecord(FILE, "w@0", Box((0, 0), (2, 6)), "F32", 100, 48, "xxh3-64:01")
    bottom = FragmentRecord(FILE, "w@1", Box((2, 0), (2, 6)), "F32", 148, 48, "xxh3-64:02")
    return TensorRecord("model/w", "model", "F32", (4, 6), (top, bottom))


def _edit(change: Callable[[dict[str, Any]], None]) -> bytes:
    doc = json.loads(_index(_halves()))
    change(doc["tensors"]["model/w"])
    return json.dumps(doc).encode()


def _fragment(i: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda t: t["fragments"][i].update(fields)


@pytest.mark.parametrize(
    "change, said",
    [
        (_fragment(0, offsets=[1, 0]), "boxes [1:3, 0:6] and [2:4, 0:6] overlap"),  # the probe's one flipped bit
        (_fragment(1, offsets=[3, 0]), "lies outside shape"),
        (lambda t: t.update(fragments=t["fragments"][:1]), "cover 12 of 24"),
        (lambda t: t.update(fragments=[]), "cover 0 of 24"),
        (lambda t: t.update(fragments=[t["fragments"][0]] * 2 + [t["fragments"][1]]), "listed twice"),
        (_fragment(0, offsets=[0]), "box has 1 offsets but 2 lengths"),
        (_fragment(0, offsets=[0], lengths=[12]), "another rank than its shape"),
        (_fragment(0, offsets=[-2, 0], lengths=[4, 6]), "box offsets and lengths must be >= 0"),
        (_fragment(0, offset=-100), "is stored at bytes [-100"),
        (_fragment(0, nbytes=1 << 62), "stored in 4611686018427387904 bytes, but its box holds 48"),
        (_fragment(0, dtype="BF16"), "stored as BF16 without a codec"),
        (_fragment(0, dtype="Q32", quant={"codec": "lin-i8", "block": 32}), "unknown dtype 'Q32'"),
        (lambda t: t.update(dtype="Q32"), "unknown dtype 'Q32'"),
        (lambda t: t.update(shape=[1 << 40, 1 << 40]), "more than 1152921504606846976 bytes"),
        (lambda t: t.update(shape=[-4, 6]), "negative dimension"),
    ],
)
def test_an_index_whose_records_no_save_writes_is_refused_naming_the_tensor(change: Callable[[dict[str, Any]], None], said: str) -> None:
    with pytest.raises(FormatError, match=r"^root/j/step-00000003/ckptd.index.json") as refused:
        CheckpointIndex.from_json_bytes(_edit(change), where="root/j/step-00000003/ckptd.index.json")
    assert said in str(refused.value), str(refused.value)
    assert "is malformed" in str(refused.value) or "tensor 'model/w' cannot be read as recorded" in str(refused.value)


def test_the_records_a_save_writes_are_taken() -> None:
    scales = SideRecord(FILE, "c@scales", "F32", (4, 1), 400, 16, "xxh3-64:03")
    coded = FragmentRecord(FILE, "c", Box((0, 0), (4, 6)), "I8", 300, 24, "xxh3-64:04", quant=QuantRecord("lin-i8", 32, scales=scales))
    empty = TensorRecord("model/e", "model", "F32", (0, 3), ())
    scalar = TensorRecord("model/s", "model", "F32", (), (FragmentRecord(FILE, "s", Box((), ()), "F32", 500, 4, "xxh3-64:05"),))
    tensors = (_halves(), TensorRecord("model/c", "model", "F32", (4, 6), (coded,)), empty, scalar)
    assert CheckpointIndex.from_json_bytes(_index(*tensors)).tensors == tensors


def test_a_grid_of_fragments_tiles_and_a_grid_missing_a_cell_does_not() -> None:
    cells = [FragmentRecord(FILE, f"g{r}{c}", Box((2 * r, 3 * c), (2, 3)), "F32", 24 * (2 * r + c), 24, "xxh3-64:01") for r in range(2) for c in range(2)]
    grid = TensorRecord("model/w", "model", "F32", (4, 6), tuple(cells))
    assert CheckpointIndex.from_json_bytes(_index(grid)).tensors == (grid,)
    with pytest.raises(FormatError, match="boxes cover 18 of 24 elements"):
        CheckpointIndex.from_json_bytes(_index(TensorRecord("model/w", "model", "F32", (4, 6), tuple(cells[:3]))))


def test_json_nested_too_deep_is_a_malformed_index_not_a_recursion_error() -> None:
    with pytest.raises(FormatError, match="is malformed: JSONDecodeError: nested too deep"):
        CheckpointIndex.from_json_bytes(b"[" * 100_000 + b"]" * 100_000, where="x/ckptd.index.json")


def test_a_step_directorys_index_must_be_of_its_step() -> None:
    data = _index(_halves())
    assert CheckpointIndex.of_step(data, None, 3, "root/j/step-00000003/ckptd.index.json").step == 3
    assert CheckpointIndex.of_step(data, None, 3, "root/renamed-job/step-00000003/ckptd.index.json").job == "j"  # a job copied or renamed
    with pytest.raises(FormatError, match=r"is the index of job 'j' step 3, not of step 4 \(a step directory copied or renamed by hand\?\)"):
        CheckpointIndex.of_step(data, None, 4, "root/j/step-00000004/ckptd.index.json")
