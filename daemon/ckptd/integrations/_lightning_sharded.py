"""Lightning's FSDP2 + tensor-parallel strategy saving through ckptd: `CkptdModelParallelStrategy`.

Lightning's ModelParallelStrategy (FSDP2 and TP, applied in `LightningModule.configure_model`)
saves and loads without the CheckpointIO: its save_checkpoint writes a torch.distributed.checkpoint
directory from every rank, its load_checkpoint reads one (lightning/pytorch/strategies/
model_parallel.py, `save_checkpoint` and `load_checkpoint`). This subclass keeps everything else
of it and replaces those two with CkptdCheckpointIO's sharded calls:

- save: every rank hands its own shards (the DTensors of the model's and the optimizers'
  sharded state dicts) to its node's daemon as its rank of a job of world_size ranks
  (`CkptdCheckpointIO.save_shards`); nothing is gathered, and no collective is added to
  Lightning's own (the Trainer's barrier after a save);
- load: every rank fills the sharded state dicts of the model and optimizers as they are laid
  out now, from any layout and world size the step was saved in (`CkptdCheckpointIO.load_shards`),
  then sets them into the model and optimizers with torch's set_*_state_dict.

The state dicts are taken without CPU offload: ckptd copies from the device itself (hand-off
mode "copy"), so offloading first would copy every byte twice. Needs the `lightning` package.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["CkptdModelParallelStrategy"]

_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)


class ShardedCheckpointIO(Protocol):
    """What the strategy needs of its CheckpointIO (CkptdCheckpointIO has it)."""

    def save_shards(self, checkpoint: dict[str, Any], path: Any, rank: int, world_size: int, storage_options: Any | None = None) -> None: ...

    def load_shards(self, path: Any, targets: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]: ...


class CkptdModelParallelStrategy(ModelParallelStrategy):
    """ModelParallelStrategy (FSDP2 + TP) whose checkpoints go through CkptdCheckpointIO, sharded.

        trainer = L.Trainer(strategy=CkptdModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                            plugins=[CkptdCheckpointIO(job="run-42")], ...)

    Takes ModelParallelStrategy's arguments except save_distributed_checkpoint (always sharded).
    A resume may use another data- or tensor-parallel size: each rank loads its own boxes.
    Raises TypeError at the first save or load when the Trainer's CheckpointIO is not a
    CkptdCheckpointIO.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "save_distributed_checkpoint" in kwargs:
            raise TypeError(f"{type(self).__name__} always saves each rank's shards through ckptd: leave out save_distributed_checkpoint")
        super().__init__(*args, save_distributed_checkpoint=True, **kwargs)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict (DTensors on the model's device)."""
        assert self.model is not None
        return get_model_state_dict(self.model, options=_SHARDED)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's sharded state dict, its state keyed by parameter name."""
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer, options=_SHARDED)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank hands its shards to ckptd (see the module docstring)."""
        self._ckptd_io().save_shards(checkpoint, filepath, self.global_rank, self.world_size, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model (and, when fitting, the optimizers) from ckptd in this run's layout;
        returns Lightning's checkpoint dict (loops, schedulers, callbacks: Lightning restores them)."""
        assert self.model is not None and self.lightning_module is not None
        model = self.model
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING and bool(optimizers)
        targets: dict[str, Any] = {"model": get_model_state_dict(model, options=_SHARDED)}
        if fitting:
            targets["optimizer"] = {str(i): get_optimizer_state_dict(model, o, options=_SHARDED) for i, o in enumerate(optimizers)}
        checkpoint = self._ckptd_io().load_shards(checkpoint_path, targets, self.global_rank, self.world_size)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(model, checkpoint["state_dict"], options=StateDictOptions(full_state_dict=False, strict=strict))
        if fitting:
            states = checkpoint["optimizer_states"]
            if len(states) != len(optimizers):
                raise RuntimeError(
                    f"the checkpoint holds {len(states)} optimizer states and the LightningModule configures {len(optimizers)}: "
                    "resume with the same optimizers"
                )
            for optimizer, state in zip(optimizers, states):
                set_optimizer_state_dict(model, optimizer, state, options=_SHARDED)
        return checkpoint

    def _ckptd_io(self) -> ShardedCheckpointIO:
        io = self.checkpoint_io
        if not (hasattr(io, "save_shards") and hasattr(io, "load_shards")):
            raise TypeError(
                f"{type(self).__name__} saves through ckptd: pass plugins=[CkptdCheckpointIO(job=...)] to the Trainer "
                f"(its CheckpointIO is a {type(io).__name__})"
            )
        return io  # type: ignore[return-value]
