"""ClientOptions: every setting of a CheckpointClient checked once, with a message that says what to pass."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ckptd.client import ClientOptions, JobRetention
from ckptd.client.layout import LayoutRules, RankCoords
from ckptd.client.options import options_from_keywords


def test_the_defaults_are_the_clients() -> None:
    options = ClientOptions()
    assert (options.mode, options.on_error, options.timeout_s, options.read_files, options.address) == ("auto", "warn", 600.0, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.on_error = "raise"  # type: ignore[misc]


@pytest.mark.parametrize(
    "fields",
    [
        {"mode": "ipc"}, {"on_error": "raise"}, {"timeout_s": 5}, {"timeout_s": 0.5}, {"copy_threads": 0}, {"copy_threads": 8},
        {"read_files": False}, {"address": "/run/ckptd/ckptd.sock"}, {"address": ""}, {"rank": 3, "world_size": 4},
        {"local_world_size": 2}, {"run_config": {"lr": 0.1}}, {"run_id": "run-1"}, {"retention": JobRetention(keep_last=2)},
        {"layout": LayoutRules([]), "coords": RankCoords(0, 2)},
    ],
)
def test_values_that_work_are_taken_as_given(fields: dict[str, Any]) -> None:
    options = ClientOptions(**fields)
    assert {name: getattr(options, name) for name in fields} == fields


@pytest.mark.parametrize(
    "fields, error, words",
    [
        ({"mode": "fast"}, ValueError, "mode='fast': use one of auto, copy, overlap, ipc"),
        ({"on_error": "ignore"}, ValueError, "on_error='ignore': use 'warn'"),
        ({"timeout_s": 0}, ValueError, "timeout_s=0: pass the seconds"),
        ({"timeout_s": -1.0}, ValueError, "timeout_s=-1.0"),
        ({"timeout_s": float("inf")}, ValueError, "timeout_s=inf"),
        ({"timeout_s": "5"}, ValueError, "timeout_s='5'"),
        ({"timeout_s": True}, ValueError, "timeout_s=True"),
        ({"copy_threads": -1}, ValueError, "copy_threads=-1"),
        ({"copy_threads": 2.0}, TypeError, "copy_threads=2.0: pass an integer"),
        ({"rank": "0"}, TypeError, "rank='0'"),
        ({"world_size": True}, TypeError, "world_size=True"),
        ({"local_world_size": 1.5}, TypeError, "local_world_size=1.5"),
        ({"read_files": "yes"}, ValueError, "read_files='yes'"),
        ({"address": "localhost:50051"}, ValueError, "is not a Unix socket"),
        ({"layout": LayoutRules([])}, ValueError, "layout rules need coords=RankCoords"),
        ({"run_config": [1]}, TypeError, "run_config must be a dict"),
        ({"run_id": "no spaces here"}, ValueError, "run id"),
        ({"retention": {"keep_last": 2}}, TypeError, "retention={'keep_last': 2}: pass ckptd.client.JobRetention"),
        ({"world_size": 2**40}, ValueError, "world_size=1099511627776: pass a number from 0 to 2147483647"),  # was protobuf's "Value out of range"
        ({"rank": -1}, ValueError, "rank=-1: pass a number from 0"),
    ],
)
def test_values_that_cannot_work_are_refused_at_once(fields: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as raised:
        ClientOptions(**fields)
    assert words in str(raised.value)


def test_an_integration_s_keywords_become_options() -> None:
    options = options_from_keywords("Caller", {"timeout_s": 5.0}, ("rank",), on_error="raise")
    assert options == ClientOptions(on_error="raise", timeout_s=5.0)
    with pytest.raises(TypeError, match=r"Caller got unknown keyword arguments \['timeout'\]; CheckpointClient options are \[.*'timeout_s'"):
        options_from_keywords("Caller", {"timeout": 5})
    with pytest.raises(TypeError, match=r"unknown keyword arguments \['rank'\]"):
        options_from_keywords("Caller", {"rank": 1}, ("rank",))
