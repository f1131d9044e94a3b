"""Saves' parts that need no daemon (daemon/ckptd/daemon/engine/saves.py): a rank's extras text
parsed once while it does not change."""

from __future__ import annotations

import json

import pytest

from ckptd.daemon.engine.saves import ParsedExtras
from ckptd.daemon.errors import InvalidRequest


def test_an_unchanged_extras_text_gives_the_same_object_without_parsing_it_again() -> None:
    parsed = ParsedExtras()
    text = json.dumps({"model": {"w": {"__tensor__": "model/w"}}, "step": 3})
    extras, kept = parsed.parse("job", 0, text)
    assert extras == json.loads(text) and kept is text
    again, kept_again = parsed.parse("job", 0, "".join(text))  # an equal text, another str: as from the next request
    assert again is extras and kept_again is text
    assert parsed.parse("job", 1, text)[0] is not extras  # another rank: its own
    assert parsed.parse("other", 0, text)[0] is not extras  # another job: its own
    changed, _ = parsed.parse("job", 0, json.dumps({"step": 4}))
    assert changed == {"step": 4}
    assert parsed.parse("job", 0, text)[0] is not extras  # changed in between: parsed anew


def test_bad_extras_are_refused_every_time_and_forget_the_last_good_ones() -> None:
    parsed = ParsedExtras()
    good, _ = parsed.parse("job", 0, '{"a": 1}')
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="not valid JSON"):
            parsed.parse("job", 0, '{"a": ')
    assert parsed.parse("job", 0, '{"a": 1}')[0] is not good
    assert parsed.parse("job", 0, "") == ({}, "")


def test_the_texts_kept_stay_within_max_bytes_least_recent_first() -> None:
    parsed = ParsedExtras(max_bytes=20)
    a, _ = parsed.parse("job", 0, '{"a": 1}')  # 8 bytes
    b, _ = parsed.parse("job", 1, '{"b": 2}')
    assert parsed.parse("job", 0, '{"a": 1}')[0] is a  # now the most recent
    parsed.parse("job", 2, '{"c": 3}')  # 24 bytes: rank 1's goes
    assert parsed.parse("job", 0, '{"a": 1}')[0] is a
    assert parsed.parse("job", 1, '{"b": 2}')[0] is not b
    big = json.dumps({"x": "y" * 30})
    assert parsed.parse("job", 3, big)[0] is not parsed.parse("job", 3, big)[0]  # over max_bytes: never kept
