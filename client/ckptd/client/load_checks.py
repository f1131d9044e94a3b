"""What a load checks once the daemon's plan is known, before the fill writes a byte
(CheckpointClient.load): the strict refusals, and the fresh optimizer's state of parameters
that were not stepped yet when the step was saved, which a strict load excuses."""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Literal, Mapping

from ckptd.client._rpc import LoadPlan
from ckptd.client.errors import CheckpointError, InvalidState
from ckptd.client.restore import keys_without_values
from ckptd.client.state import FlatState, optimizer_state_name
from ckptd.format.file_plan import mismatch_text

log = logging.getLogger("ckptd.client")


def daemon_strict(strict: bool | Literal["missing"], flat: FlatState) -> bool:
    """Whether a load's PlanLoad asks the daemon to refuse missing and unexpected tensors: for
    strict=True, unless the state has a fresh optimizer, whose state the load initialized for
    every parameter while the step may hold none for some (never stepped: no gradient yet), which
    `_strict_refusal` excuses; the daemon then reports both, and the client refuses the rest."""
    return strict is True and not flat.fresh


def checked_plan(
    plan: LoadPlan, state: Mapping[str, Any], flat: FlatState, strict: bool | Literal["missing"], load_done: Callable[[str], None]
) -> tuple[dict[str, Any], set[str]]:
    """The checkpoint's extras of this rank and the plan's never-stepped tensors (`_never_stepped`),
    once the plan passes `_strict_refusal`; else the load is ended (`load_done`) and refused."""
    extras = _checkpoint_extras(plan.extras_json, flat)
    unstepped = _never_stepped(plan, flat, extras)
    refused = _strict_refusal(plan, state, flat, extras, strict, unstepped)
    if refused is not None:
        load_done(plan.load_id)
        raise refused
    return extras, unstepped


def _strict_refusal(
    plan: LoadPlan, state: Mapping[str, Any], flat: FlatState, extras: dict[str, Any], strict: bool | Literal["missing"], unstepped: set[str]
) -> CheckpointError | None:
    """What a strict load refuses once the daemon's plan is known, before the fill writes a
    byte: tensors of the state that the step lacks (strict="missing", or strict=True when the
    daemon did not check: `daemon_strict`) but the `unstepped` ones (`_never_stepped`);
    tensors of the step the state lacks (strict=True); and keys of the state that the step has
    no value for (both)."""
    missing = [name for name in plan.missing if name not in unstepped] if strict else []
    unexpected = list(plan.unexpected) if strict is True else []
    if missing or unexpected:
        return CheckpointError(mismatch_text(plan.step, sorted(missing), sorted(unexpected)))
    if strict and (absent := keys_without_values(state, flat, extras)):
        them, as_is = ("it", "it is") if len(absent) == 1 else ("them", "they are")
        return InvalidState(
            f"step {plan.step} has no value for {', '.join(map(repr, absent))}, and nothing was loaded: leave {them} out of "
            f"the state you load (and set {them} up yourself), or load with strict=False to keep {them} as {as_is}"
        )
    return None


def warn_missing(plan: LoadPlan, unstepped: set[str]) -> None:
    """Name each tensor of a non-strict load that the step lacks and that was left as it was
    (not the `unstepped` ones: their state was dropped, as the step has it)."""
    for name in plan.missing:
        if name not in unstepped:
            log.warning("not in step %s, left as it was: %s", plan.step, name)


def _never_stepped(plan: LoadPlan, flat: FlatState, extras: dict[str, Any]) -> set[str]:
    """The tensors of the plan's missing ones that are a fresh optimizer's state of a parameter
    for which the step's optimizer holds no state at all ("<key>/state/<fqn>/<field>"): the
    parameter had no gradient when the step was saved (restore_state drops that state again)."""
    unstepped = set()
    for name in plan.missing:
        parsed = optimizer_state_name(name)
        if parsed is None or parsed[0] not in flat.fresh:
            continue
        saved = extras.get(parsed[0])
        if isinstance(saved, dict) and isinstance(saved.get("state"), dict) and parsed[1] not in saved["state"]:
            unstepped.add(name)
    return unstepped


def _checkpoint_extras(text: str, targets: FlatState) -> dict[str, Any]:
    """The checkpoint's extras {top key: tree} of this rank from their JSON `text`: the targets'
    own extras object when the text is theirs to the byte (the state holds the checkpoint's
    values already: restore_state puts back none of its plain trees), else the parsed text."""
    if text and text == targets.extras_json:
        return targets.extras
    return json.loads(text) if text else {}
