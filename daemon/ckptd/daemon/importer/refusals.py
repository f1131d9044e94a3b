"""Why torch refused part of a `ckptd import` source, said without torch's advice.

torch.load(weights_only=True) wraps its restricted unpickler's refusal in paragraphs of advice:
load with weights_only=False, or allow-list the global (add_safe_globals). Neither applies to
`ckptd import`, which never unpickles what that unpickler refuses (it would run code from an
untrusted file), so the refusals here name what was refused (the Python global: a class or a
function) and leave the advice out; the callers say how to fix the source instead.
"""

from __future__ import annotations

import re

from torch._weights_only_unpickler import UnpicklingError  # type: ignore[attr-defined]  # pickle's, re-exported

# Sentences of torch's advice (torch/serialization.py: UNSAFE_MESSAGE and _get_wo_message; the
# unpickler's allow-list hint), by how they start or what they say.
_ADVICE = re.compile(
    r"^(?:Please use|Please file|In PyTorch \d|Re-running|Do it only|Weights only load failed|This file can still be loaded|"
    r"\(\d\)|Check the documentation)|weights_only`? set to `?False|weights_only=False"
)
_UNPICKLER_PREFIX = re.compile(r"^WeightsUnpickler error:\s*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n")
# What the restricted unpickler says when it refuses a global (torch/_weights_only_unpickler.py).
_REFUSED_GLOBAL = (
    re.compile(r"GLOBAL (\S+) was not an allowed global"),
    re.compile(r"unsupported GLOBAL (\S+) whose module \S+ is blocked"),
    re.compile(r"allowlisted via `add_safe_globals` but got <class '([^']+)'>"),
    re.compile(r"reduce for unrecognized function (.+?)(?: which belongs to|$)", re.M),
)
MAX_REASON = 300


def unpickler_message(exc: BaseException) -> str:
    """The unpickler's own message: torch.load raises a new UnpicklingError with the advice
    around it, from None; the refusal it wrapped is still its __context__."""
    inner = exc.__context__
    if isinstance(exc, UnpicklingError) and isinstance(inner, UnpicklingError):
        return str(inner)
    return str(exc)


def refused_global(exc: BaseException) -> str | None:
    """The Python global ("module.name", a class or a function) whose loading a weights-only
    refusal names; None when it names none."""
    text = unpickler_message(exc)
    for pattern in _REFUSED_GLOBAL:
        found = pattern.search(text)
        if found:
            return found.group(1)
    return None


def short_reason(exc: BaseException) -> str:
    """The reason of an error in its first sentence that is not torch's advice (at most
    MAX_REASON characters); for a weights-only refusal, the unpickler's own."""
    sentences = (_UNPICKLER_PREFIX.sub("", s.strip()) for s in _SENTENCE_END.split(unpickler_message(exc)))
    reason = next((s for s in sentences if s and not _ADVICE.search(s)), type(exc).__name__)
    return reason[:MAX_REASON]


def weights_only_refusal(exc: BaseException) -> str:
    """What a weights-only refusal refused, to end a sentence: the global it names ("it refers
    to the Python global ..."), else the unpickler's reason (short_reason)."""
    name = refused_global(exc)
    if name is None:
        return short_reason(exc)
    return f"it refers to the Python global {name} (a class or function), which ckptd does not load: unpickling it could run code from the file"
