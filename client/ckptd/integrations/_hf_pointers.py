"""Pointer directories: `output_dir/checkpoint-<step>` that lead the Trainer's own resume path
to a ckptd step (`trainer.train(resume_from_checkpoint=True)`, or the directory's path).

A pointer holds no weights and nothing pickled, only what the Trainer reads before any
callback can act (transformers 5.x `Trainer.train`, `_init_training_state`, `_load_from_checkpoint`):

    trainer_state.json             the step's TrainerState (JSON, as the Trainer writes it), with
                                   the marker {"args": {}, "attributes": {"job", "step"}} under
                                   stateful_callbacks[MARKER_KEY]: how CkptdCallback.on_train_begin
                                   knows which ckptd step the Trainer resumes
    model.safetensors.index.json   a weights index that maps every model key to EMPTY_SHARD_NAME
    EMPTY_SHARD_NAME               a safetensors file holding no tensor (the Trainer requires
                                   weights and loads them before the optimizer exists: it loads
                                   nothing; the callback loads the real ones with the optimizer)
    POINTER_FILE                   {"job", "step"}: this directory is a ckptd pointer

There is no optimizer.pt, scheduler.pt, scaler.pt or rng_state.pth, so the Trainer loads none
of them. A pointer is made whole in a temporary directory and renamed into place, so a reader
never sees half of one; a `checkpoint-<step>` that is not a ckptd pointer is never touched.
The callback publishes a pointer only for a committed step and removes those of steps the
daemon no longer lists (retention), so a pointer never names a step that is not durable.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from typing import Any, Iterable, Mapping

import safetensors.torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME
from ckptd.common import json_read

__all__ = ["EMPTY_SHARD_NAME", "MARKER_KEY", "POINTER_FILE", "marked_step", "pointer_steps", "prune", "publish", "write_resume_dir"]

log = logging.getLogger("ckptd.integrations.transformers")

EMPTY_SHARD_NAME = "ckptd-weights-come-from-ckptd.safetensors"  # a resume directory's tensorless shard
POINTER_FILE = "ckptd-pointer.json"
MARKER_KEY = "ckptd"  # trainer_state.json's stateful_callbacks entry: no callback class has this name
_POINTER_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-([1-9][0-9]*|0)$")  # as the Trainer names it: ASCII digits, no padding


def write_resume_dir(directory: str, job: str, step: int, trainer_state: Mapping[str, Any], model_keys: Iterable[str]) -> None:
    """Make `directory` (anew) a directory the Trainer resumes from: the files listed in the
    module docstring for ckptd step `step` of `job`. The caller owns `directory`'s name: it is
    removed first if it exists."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    state = dict(trainer_state)
    state["stateful_callbacks"] = {**(state.get("stateful_callbacks") or {}), MARKER_KEY: {"args": {}, "attributes": {"job": job, "step": step}}}
    with open(os.path.join(directory, TRAINER_STATE_NAME), "w", encoding="utf-8") as out:
        out.write(json.dumps(state, indent=2, sort_keys=True) + "\n")  # as TrainerState.save_to_json writes it
    note = f"the weights of ckptd step {step} of job {job} are loaded by CkptdCallback.on_train_begin; this shard holds no tensor"
    safetensors.torch.save_file({}, os.path.join(directory, EMPTY_SHARD_NAME), metadata={"format": "pt", "ckptd": note})
    index = {"metadata": {"ckptd_step": step, "note": note}, "weight_map": {key: EMPTY_SHARD_NAME for key in model_keys}}
    with open(os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as out:
        json.dump(index, out, indent=2)
    with open(os.path.join(directory, POINTER_FILE), "w", encoding="utf-8") as out:
        json.dump({"job": job, "step": step}, out)


def publish(output_dir: str, job: str, step: int, trainer_state: Mapping[str, Any], model_keys: Iterable[str]) -> bool:
    """Make output_dir/checkpoint-<step> a pointer to committed step `step` of `job`, atomically.
    Returns False, with a warning, when a directory of that name that is not this job's pointer
    is there (a Trainer checkpoint of its own: left alone); True when the pointer is there."""
    final = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    if os.path.lexists(final):
        if _pointer_of(final) == (job, step):
            return True  # made before (by this run, or by another node's process on a shared output_dir)
        log.warning("%s is not a pointer of ckptd job %s, so it is left alone; resume_from_checkpoint=True may pick it", final, job)
        return False
    os.makedirs(output_dir, exist_ok=True)
    temporary = os.path.join(output_dir, f".{PREFIX_CHECKPOINT_DIR}-{step}.ckptd-{uuid.uuid4().hex[:8]}")
    write_resume_dir(temporary, job, step, trainer_state, model_keys)
    try:
        os.rename(temporary, final)
    except OSError:  # made meanwhile by another process (a shared output_dir): the same step's pointer
        shutil.rmtree(temporary, ignore_errors=True)
        return _pointer_of(final) == (job, step)
    return True


def pointer_steps(output_dir: str, job: str) -> dict[int, str]:
    """step -> directory of the pointers of `job` in output_dir (other directories are not listed)."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        match = _POINTER_NAME.match(name)
        path = os.path.join(output_dir, name)
        if match is not None and _pointer_of(path) == (job, int(match.group(1))):
            found[int(match.group(1))] = path
    return found


def prune(output_dir: str, job: str, committed: Iterable[int]) -> list[int]:
    """Remove the pointers of `job` whose step is not among `committed` (retention removed it);
    returns their steps. The directory is renamed away first, so it stops being a checkpoint at once."""
    keep = set(committed)
    removed = []
    for step, path in sorted(pointer_steps(output_dir, job).items()):
        if step in keep:
            continue
        doomed = os.path.join(output_dir, f".{os.path.basename(path)}.ckptd-removed-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            continue  # pruned meanwhile by another process
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(step)
    return removed


def marked_step(stateful_callbacks: Mapping[str, Any] | None, job: str) -> int | None:
    """The ckptd step a TrainerState loaded from a pointer's trainer_state.json names, or None
    when it was not loaded from one. Raises ValueError when the pointer is another job's."""
    marker = (stateful_callbacks or {}).get(MARKER_KEY)
    if not isinstance(marker, Mapping):
        return None
    attributes = marker.get("attributes") or {}
    step, marked_job = attributes.get("step"), attributes.get("job")
    if isinstance(step, bool) or not isinstance(step, int) or not isinstance(marked_job, str):
        raise ValueError(f"the Trainer resumed from a ckptd pointer whose trainer_state.json has a damaged {MARKER_KEY!r} entry: {marker!r}")
    if marked_job != job:
        raise ValueError(f"the Trainer resumed from a pointer to ckptd job {marked_job!r}, but this CkptdCallback is job {job!r}: "
                         f"pass CkptdCallback(job={marked_job!r}), or another resume_from_checkpoint")
    return step


def _pointer_of(path: str) -> tuple[str, int] | None:
    """(job, step) of the pointer at `path`, or None when `path` is not a readable pointer directory."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, POINTER_FILE), encoding="utf-8") as src:
            doc = json_read.loads(src.read())
    except (OSError, ValueError):
        return None
    job, step = doc.get("job") if isinstance(doc, dict) else None, doc.get("step") if isinstance(doc, dict) else None
    if not isinstance(job, str) or isinstance(step, bool) or not isinstance(step, int):
        return None
    return job, step
