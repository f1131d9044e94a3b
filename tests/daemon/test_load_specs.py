"""PlanLoad's tensor specs by (job, rank, fingerprint) (rpc/checkpoint.py _LoadSpecs): metadata
sent again equal to what was validated gives the very same specs without validating again
(the daemon's memory plans key on that object); anything else is validated as it is now. And
the ranks' extras texts (engine/context.ExtrasTexts), parsed once at a hand-over and encoded
once for a load while they do not change."""

from __future__ import annotations

from typing import Any

import json
import pytest

from ckptd.daemon import errors
from ckptd.daemon.rpc import checkpoint
from ckptd.daemon.rpc import validate as checks
from ckptd.wire.v1 import checkpoint_pb2 as pb

FP = "ab" * 32


def _metas(dtype: str = "F32", count: int = 3) -> Any:
    request = pb.PlanLoadRequest()
    for i in range(count):
        request.tensors.add(name=f"model/t{i}", kind="model", dtype=dtype, shape=[4, i + 1])
    return request.tensors


@pytest.fixture
def validated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counts: list[int] = []
    real = checks.tensor_specs

    def counted(metas: Any) -> Any:
        counts.append(len(metas))
        return real(metas)

    monkeypatch.setattr(checks, "tensor_specs", counted)
    return counts


def test_equal_metadata_sent_again_resolves_to_the_same_specs_unvalidated(validated: list[int]) -> None:
    specs = checkpoint._LoadSpecs()
    first = specs.resolve("job", 0, FP, _metas())
    assert specs.resolve("job", 0, FP, _metas()) is first  # a new process of the rank, same metadata
    assert specs.resolve("job", 0, FP, []) is first  # the fingerprint alone
    assert validated == [3]


@pytest.mark.parametrize("other", [_metas(dtype="BF16"), _metas(count=2), _metas(count=4)])
def test_other_metadata_under_a_known_fingerprint_is_validated_and_replaces_it(validated: list[int], other: Any) -> None:
    specs = checkpoint._LoadSpecs()
    first = specs.resolve("job", 0, FP, _metas())
    second = specs.resolve("job", 0, FP, other)
    assert second is not first and len(second) == len(other) and second[0].dtype == other[0].dtype
    assert specs.resolve("job", 0, FP, []) is second
    assert validated == [3, len(other)]


def test_invalid_metadata_is_refused_even_under_a_known_fingerprint() -> None:
    specs = checkpoint._LoadSpecs()
    specs.resolve("job", 0, FP, _metas())
    bad = _metas()
    bad[1].dtype = "NOPE"
    with pytest.raises(errors.InvalidRequest, match="NOPE"):
        specs.resolve("job", 0, FP, bad)


def test_specs_are_per_job_and_rank_and_unknown_fingerprints_are_asked_for() -> None:
    specs = checkpoint._LoadSpecs()
    first = specs.resolve("job", 0, FP, _metas())
    assert specs.resolve("job", 1, FP, _metas()) is not first
    assert specs.resolve("other", 0, FP, _metas()) is not first
    with pytest.raises(errors.UnknownFingerprint):
        specs.resolve("job", 2, FP, [])


def test_a_fingerprint_a_save_named_resolves_to_that_saves_specs_without_metadata(validated: list[int]) -> None:
    """A restarted trainer's first load of the structure it saved sends the fingerprint alone:
    the specs its save's BeginSave validated under that fingerprint, for that job and rank only."""
    saved = tuple(checks.tensor_specs(_metas()))
    asked: list[tuple[str, int, str]] = []

    def saved_specs(job: str, rank: int, fingerprint: str) -> Any:
        asked.append((job, rank, fingerprint))
        return saved if (job, rank, fingerprint) == ("job", 0, FP) else None

    specs = checkpoint._LoadSpecs(saved_specs)
    first = specs.resolve("job", 0, FP, [])
    assert first == list(saved) and specs.resolve("job", 0, FP, []) is first  # kept: the same object next time
    assert asked == [("job", 0, FP)]
    for job, rank in (("job", 1), ("other", 0)):
        with pytest.raises(errors.UnknownFingerprint):
            specs.resolve(job, rank, FP, [])
    again = specs.resolve("job", 0, FP, _metas())  # metadata sent anyway: validated, as any
    assert again == first and validated == [3, 3]


def test_extras_text_is_encoded_once_per_object_and_again_for_another() -> None:
    from ckptd.daemon.engine.context import ExtrasTexts

    texts = ExtrasTexts(size=2)
    extras = {"step": 3, "names": ["a", "b"]}
    first = texts.text(("job", 3, 0), extras)
    assert first == json.dumps(extras)
    assert texts.text(("job", 3, 0), extras) is first  # the same object: the text kept
    other = {"step": 3, "names": ["a", "c"]}  # equal key, another object (e.g. read from extra.json again)
    assert texts.text(("job", 3, 0), other) == json.dumps(other)
    kept = texts.text(("job", 3, 0), other)
    assert texts.text(("job", 3, 0), other) is kept
    texts.text(("job", 4, 0), extras)
    texts.text(("job", 5, 0), extras)  # beyond `size`: the oldest, (job, 3, 0), goes
    again = texts.text(("job", 3, 0), other)
    assert again == kept and again is not kept  # encoded anew


def test_extras_text_remembered_from_the_save_is_sent_as_it_came_for_the_same_object() -> None:
    from ckptd.daemon.engine.context import ExtrasTexts

    texts = ExtrasTexts(size=2)
    text = '{"step": 3, "names": ["a", "b"]}'
    extras = json.loads(text)
    texts.remember(("job", 3, 0), extras, text)
    assert texts.text(("job", 3, 0), extras) is text  # not encoded again
    again = texts.text(("job", 3, 0), dict(extras))
    assert again == text  # another object: encoded (the same here)
    assert again is not text  # encoded anew, not the remembered text of another object


def _parse(text: str) -> Any:
    from ckptd.daemon.engine.saves import parse_extras

    return parse_extras(0, text)


def test_an_unchanged_extras_text_gives_the_same_object_without_parsing_it_again() -> None:
    from ckptd.daemon.engine.context import ExtrasTexts

    texts = ExtrasTexts()
    text = json.dumps({"model": {"w": {"__tensor__": "model/w"}}, "step": 3})
    extras = texts.parse(("job", 3, 0), text, _parse)
    assert extras == json.loads(text) and texts.text(("job", 3, 0), extras) is text  # remembered for loads as it came
    again = texts.parse(("job", 4, 0), "".join(text), _parse)  # an equal text, another str: as from the next request
    assert again is extras and texts.text(("job", 4, 0), again) is text  # the first text kept, not a second copy
    assert texts.parse(("job", 4, 1), text, _parse) is not extras  # another rank: its own
    assert texts.parse(("other", 4, 0), text, _parse) is not extras  # another job: its own
    changed = texts.parse(("job", 5, 0), json.dumps({"step": 4}), _parse)
    assert changed == {"step": 4}
    assert texts.parse(("job", 6, 0), text, _parse) is not extras  # changed in between: parsed anew


def test_bad_extras_are_refused_every_time_and_forget_the_last_good_ones() -> None:
    from ckptd.daemon.engine.context import ExtrasTexts

    texts = ExtrasTexts()
    good = texts.parse(("job", 1, 0), '{"a": 1}', _parse)
    for step in (2, 3):
        with pytest.raises(errors.InvalidRequest, match="not valid JSON"):
            texts.parse(("job", step, 0), '{"a": ', _parse)
    assert texts.parse(("job", 4, 0), '{"a": 1}', _parse) is not good
    assert texts.parse(("job", 5, 0), "", _parse) == {}


def test_the_handed_over_texts_kept_stay_within_max_bytes_least_recent_first() -> None:
    from ckptd.daemon.engine.context import ExtrasTexts

    texts = ExtrasTexts(max_bytes=20)
    a = texts.parse(("job", 1, 0), '{"a": 1}', _parse)  # 8 bytes
    b = texts.parse(("job", 1, 1), '{"b": 2}', _parse)
    assert texts.parse(("job", 2, 0), '{"a": 1}', _parse) is a  # now the most recent
    texts.parse(("job", 1, 2), '{"c": 3}', _parse)  # 24 bytes: rank 1's goes
    assert texts.parse(("job", 3, 0), '{"a": 1}', _parse) is a
    assert texts.parse(("job", 2, 1), '{"b": 2}', _parse) is not b
    big = json.dumps({"x": "y" * 30})
    assert texts.parse(("job", 1, 3), big, _parse) is not texts.parse(("job", 2, 3), big, _parse)  # over max_bytes: never kept
