"""Who called CkptdCheckpointIO, and in what state Lightning is (for ckptd.integrations.lightning).

A CheckpointIO is not told which strategy uses it, nor why it is called: Lightning's
Strategy.save_checkpoint / load_checkpoint and the multiprocessing launcher's hand-back of the
trained weights call it directly, so the calling frame is the only place that says. Here: the
caller, whether a save from it can be loaded back, whether a load resumes a fit, whether a path
is a last checkpoint, and this process's rank.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn

from ckptd.client import rank_and_world


def is_last_checkpoint(path: Any, strategy: Strategy | None) -> bool:
    """Whether `path` is a last checkpoint of the trainer's ModelCheckpoint callbacks (of a
    default ModelCheckpoint without a trainer), matched as Lightning's ckpt_path="last" finds
    them: CHECKPOINT_NAME_LAST, an optional version "-N", then FILE_EXTENSION."""
    callbacks: list[Any] = [ModelCheckpoint]
    try:
        trainer = strategy.lightning_module.trainer if strategy is not None and strategy.lightning_module is not None else None
    except RuntimeError:  # the module is not attached to a trainer
        trainer = None
    if trainer is not None:
        callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)] or callbacks
    stem, extension = os.path.splitext(os.path.basename(os.fsdecode(os.fspath(path))))
    for callback in callbacks:
        try:
            if extension == callback.FILE_EXTENSION and re.match(rf"^{callback.CHECKPOINT_NAME_LAST}(-(\d+))?", stem):
                return True
        except re.error:  # a name Lightning could not match either
            continue
    return False


def resuming_fit(caller: Strategy | _MultiProcessingLauncher | None) -> bool:
    """Whether a load is a fit's resume (Lightning's strategy loading for Trainer.fit), the one
    load that restores the random generators: a validate, test or a direct call leaves them."""
    try:
        module = caller.lightning_module if isinstance(caller, Strategy) else None
        return module is not None and module.trainer.state.fn == TrainerFn.FITTING
    except RuntimeError:  # the module is not attached to a trainer
        return False


# Strategies that shard the model: they save without the CheckpointIO or load the checkpoint
# file with torch themselves (FSDP's and ModelParallel's full state dicts), never through it.
_SHARDING = (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy)
# Frames searched for the caller: the plugin's method, overrides of it in subclasses that call
# super(), then Lightning's Strategy.save_checkpoint (or the launcher's hand-back).
_FRAMES_SEARCHED = 5


def find_caller() -> Strategy | _MultiProcessingLauncher | None:
    """The Lightning Strategy, or multiprocessing launcher, whose method called into this plugin
    (the `self` of one of the nearest calling frames), or None (a call from user code or a
    wrapping CheckpointIO).

    A CheckpointIO is not told who uses it; Lightning's Strategy.save_checkpoint and the
    launcher's hand-back of the trained weights call it directly, so the caller is the only
    place that says.
    """
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None
    try:
        for _ in range(_FRAMES_SEARCHED):
            if frame is None:
                return None
            found = frame.f_locals.get("self")
            if isinstance(found, (Strategy, _MultiProcessingLauncher)):
                return found
            frame = frame.f_back
        return None
    finally:
        del here, frame  # frames refer to their locals: no reference cycle kept


def check_saver(strategy: Strategy | None) -> None:
    """Raise RuntimeError unless this save can be loaded back: not from a sharding strategy
    (but its Ckptd subclasses call save_shards), and from global rank 0 (which holds the whole
    replicated state under DDP)."""
    if isinstance(strategy, _SHARDING):
        raise RuntimeError(
            f"CkptdCheckpointIO does not work with {type(strategy).__name__}: that strategy shards the model and loads "
            "checkpoints without the CheckpointIO (a resume could not read the pointer file). Use "
            "strategy=CkptdModelParallelStrategy(...) (FSDP2, TP), CkptdFSDPStrategy(...) or CkptdDeepSpeedStrategy(...) from "
            "ckptd.integrations.lightning, which save each rank's shards through this plugin, or strategy='ddp'"
        )
    rank, world_size = rank_and_world()
    if rank != 0:
        raise RuntimeError(
            f"CkptdCheckpointIO.save_checkpoint was called on global rank {rank} of {world_size}; it saves the whole "
            "checkpoint from global rank 0, as Lightning's DDP strategy calls it (Strategy.save_checkpoint). With a "
            "strategy that saves from every rank, save through ckptd.client.CheckpointClient from every rank instead"
        )
