"""Validation of the names that reach the file system or the index, and the nesting limit of
the extras a save sends (checked by the client before sending and by the daemon on arrival)."""

from __future__ import annotations

import re
from itertools import chain, compress, repeat
from typing import Final, cast

JOB_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_TENSOR_NAME: Final = 1024
KINDS: Final = ("model", "master", "optimizer", "extra")
# What a module does not train (TensorMeta.frozen): "" trained (or not a module's tensor),
# "param" a parameter with requires_grad=False, "buffer" a module buffer.
FROZEN_CLASSES: Final = ("", "param", "buffer")
# safetensors reserves this key of a file's header for the file's metadata: no tensor may be
# stored under it. A logical name becomes a key whole or, in model files, without its first
# "/"-part (daemon format.file_key), so both "__metadata__" and "model/__metadata__" are refused.
RESERVED_FILE_KEY: Final = "__metadata__"

# Extras (the non-tensor values of a state: configs, counters, RNG states) may nest at most this
# many containers (dicts, lists, tuples) deep, counted from a top-level state key's value.
MAX_EXTRAS_DEPTH: Final = 64
# The JSON a client sends for a rank's extras may nest at most this deep (the daemon's check):
# encoding a container takes at most 3 JSON levels (a dict with non-string keys is
# {"__dict__": [[key, value], ...]}), a leaf at most 3 more (a NumPy array), plus 1 for the
# top-level keys: 3 * 64 + 4 = 196 < 256, so every tree within MAX_EXTRAS_DEPTH fits.
MAX_EXTRAS_JSON_DEPTH: Final = 4 * MAX_EXTRAS_DEPTH


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


MAX_STEP = 2**63 - 1  # steps travel as int64 (the wire) and name directories step-NNNNNNNN


def check_step(step: int) -> int:
    """Return `step` if it is a step number (an int, not a bool, 0 to MAX_STEP), else raise ValueError."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer from 0 to 2**63 - 1, got {step!r}")
    return step


def decimal(text: str, max_digits: int = 19) -> int | None:
    """The integer `text` writes in ASCII decimal digits alone (no sign, space or underscore, none
    of another script's digits: str.isdigit takes '²', which int() refuses), at most `max_digits`
    of them (19 hold any int64); else None. For numbers read from names nobody checked: files
    and directories under the storage root or the shared-memory directory, flags."""
    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None


def check_run_id(run_id: str) -> str:
    """Return `run_id` if it is a valid run id (the job id's alphabet: client/ckptd/client/run_id.py),
    else raise InvalidNameError saying why."""
    if not isinstance(run_id, str) or not JOB_ID_PATTERN.fullmatch(run_id):
        raise InvalidNameError(
            f"invalid run id {run_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit, "
            "the same on every rank of the run and new for every start of it (e.g. the launcher's job id and attempt)"
        )
    return run_id


_CONTROL = re.compile("[\x00-\x1f]")


def check_tensor_name(name: str) -> str:
    """Return `name` if it can be a logical tensor name, else raise InvalidNameError."""
    if not isinstance(name, str) or not name:
        raise InvalidNameError("tensor names must be non-empty strings")
    if len(name) > MAX_TENSOR_NAME:
        raise InvalidNameError(f"tensor name {name[:64]!r}... is longer than {MAX_TENSOR_NAME} characters")
    if _CONTROL.search(name):
        raise InvalidNameError(f"tensor name {name!r} contains control characters")
    if RESERVED_FILE_KEY in (name, name.partition("/")[2]):
        raise InvalidNameError(
            f"tensor name {name!r} is refused: its safetensors key (the name, or in model files the part after the "
            f"first '/') would be {RESERVED_FILE_KEY!r}, which safetensors reserves for a file's metadata; "
            "rename the tensor (or the state key holding it)"
        )
    return name


def tensor_names_valid(names: list[str]) -> bool:
    """Whether `check_tensor_name` passes every one of `names`, told by checks over the whole list
    at C speed (no Python per name). False means "check them one by one": it is also the answer
    for some valid lists (a name that is a str subclass, or two names whose concatenation holds
    RESERVED_FILE_KEY), never True for an invalid one."""
    if not names:
        return True
    if not {str}.issuperset(map(type, names)) or min(map(len, names)) == 0 or max(map(len, names)) > MAX_TENSOR_NAME:
        return False
    joined = "".join(names)  # a control character, or the reserved key, in no name is in none of them
    return _CONTROL.search(joined) is None and RESERVED_FILE_KEY not in joined


def json_depth(value: object) -> int:
    """How deep a parsed JSON value nests (a scalar 0, [] or {} 1, [[1]] 2); level by level, so
    any depth that json.loads accepted is measured without recursion, and with C-level maps over
    each level's values (no Python per value: a save's extras hold one object per tensor)."""
    depth = 0
    level: list[object] = [value]
    while True:
        dicts = cast("list[dict[object, object]]", list(compress(level, map(isinstance, level, repeat(dict)))))
        lists = cast("list[list[object]]", list(compress(level, map(isinstance, level, repeat(list)))))
        if not dicts and not lists:
            return depth
        depth += 1
        level = list(chain(chain.from_iterable(map(dict.values, dicts)), chain.from_iterable(lists)))


def kind_of(top_level_key: str) -> str:
    """The kind of a top-level state key: model, master and optimizer are themselves; all else is extra."""
    return top_level_key if top_level_key in ("model", "master", "optimizer") else "extra"


def per_rank_name(name: str, rank: int) -> str:
    """The logical name of rank `rank`'s own copy of extras tensor `name`: the rank as a path
    part right after the state key ("extra/t" -> "extra/rank1/t", a top-level "t" -> "t/rank1"),
    as the RNG states are named ("rng/rank1/torch_cpu"). Every rank stores its own copy of an
    extras tensor without a declared layout (docs/usage.md: extras)."""
    key, sep, rest = name.partition("/")
    return f"{key}/rank{rank}{sep}{rest}"


def shared_name(name: str, rank: int) -> str | None:
    """The extras tensor name that `per_rank_name(..., rank)` made `name` of; None when `name`
    does not carry rank `rank` right after its state key."""
    key, _, rest = name.partition("/")
    mark = f"rank{rank}"
    if rest == mark:
        return key
    if rest.startswith(mark + "/"):
        return f"{key}/{rest[len(mark) + 1:]}"
    return None
