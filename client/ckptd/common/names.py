"""Validation of the names that reach the file system or the index."""

from __future__ import annotations

import re
from typing import Final

JOB_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_TENSOR_NAME: Final = 1024
KINDS: Final = ("model", "master", "optimizer", "extra")


class InvalidNameError(ValueError):
    """A job id or tensor name that ckptd refuses, with the reason and the fix."""


def check_job_id(job: str) -> str:
    """Return `job` if it is a valid job id, else raise InvalidNameError saying why."""
    if not isinstance(job, str) or not JOB_ID_PATTERN.fullmatch(job):
        raise InvalidNameError(
            f"invalid job id {job!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit (e.g. 'run-42')"
        )
    return job


_CONTROL = re.compile("[\x00-\x1f]")


def check_tensor_name(name: str) -> str:
    """Return `name` if it can be a logical tensor name, else raise InvalidNameError."""
    if not isinstance(name, str) or not name:
        raise InvalidNameError("tensor names must be non-empty strings")
    if len(name) > MAX_TENSOR_NAME:
        raise InvalidNameError(f"tensor name {name[:64]!r}... is longer than {MAX_TENSOR_NAME} characters")
    if _CONTROL.search(name):
        raise InvalidNameError(f"tensor name {name!r} contains control characters")
    return name


def kind_of(top_level_key: str) -> str:
    """The kind of a top-level state key: model, master and optimizer are themselves; all else is extra."""
    return top_level_key if top_level_key in ("model", "master", "optimizer") else "extra"
