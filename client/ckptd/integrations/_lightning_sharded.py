"""Lightning's sharding strategies saving through ckptd: `CkptdModelParallelStrategy` (FSDP2 + TP)
and `CkptdFSDPStrategy` (FSDP1).

Lightning's ModelParallelStrategy (FSDP2 and TP, applied in `LightningModule.configure_model`)
and FSDPStrategy save and load without the CheckpointIO: with sharded state dicts their
save_checkpoint writes a torch.distributed.checkpoint directory from every rank and their
load_checkpoint reads one (lightning/pytorch/strategies/model_parallel.py and fsdp.py,
`save_checkpoint` and `load_checkpoint`); with full state dicts they gather the whole model on
rank 0 and read the file with torch. These subclasses keep everything else of them and replace
those two with CkptdCheckpointIO's sharded calls:

- save: every rank hands its own shards (the DTensors of the model's and the optimizers'
  sharded state dicts, torch.distributed.checkpoint.state_dict's) to its node's daemon as its
  rank of a job of world_size ranks (`CkptdCheckpointIO.save_shards`); nothing is gathered, and
  no collective is added to Lightning's own (the Trainer's barrier after a save);
- load: every rank fills the sharded state dicts of the model and optimizers as they are laid
  out now, from whatever layout and world size the step was saved in
  (`CkptdCheckpointIO.load_shards`), then sets them into the model and optimizers with torch's
  set_model_state_dict / set_optimizer_state_dict.

The state dicts are taken without CPU offload: ckptd copies from the device itself (hand-off
mode "copy"), so offloading first would copy every byte twice. Needs the `lightning` package.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["CkptdFSDPStrategy", "CkptdModelParallelStrategy", "ckptd_io"]

_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)


class ShardedCheckpointIO(Protocol):
    """What the strategy needs of its CheckpointIO (CkptdCheckpointIO has it)."""

    def save_shards(self, checkpoint: dict[str, Any], path: Any, rank: int, world_size: int, storage_options: Any | None = None) -> None: ...

    def load_shards(self, path: Any, targets: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]: ...


class _ShardedThroughCkptd:
    """The checkpoint methods both strategies share (mixed in before Lightning's strategy class)."""

    model: torch.nn.Module | None
    lightning_module: Any
    optimizers: list[Any]
    checkpoint_io: Any
    global_rank: int
    world_size: int

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

    def teardown(self) -> None:
        """Lightning's, then the CheckpointIO's (FSDPStrategy's and ModelParallelStrategy's
        teardown skip it): it waits for the pointers still being written."""
        super().teardown()  # type: ignore[misc]
        self.checkpoint_io.teardown()

    def _ckptd_io(self) -> ShardedCheckpointIO:
        return ckptd_io(self, "save_shards", "load_shards")  # type: ignore[no-any-return]


def ckptd_io(strategy: Any, *methods: str) -> Any:
    """The strategy's CheckpointIO, once it has `methods` (CkptdCheckpointIO has them); raises
    TypeError saying to pass CkptdCheckpointIO to the Trainer otherwise."""
    io = strategy.checkpoint_io
    if not all(hasattr(io, method) for method in methods):
        raise TypeError(
            f"{type(strategy).__name__} saves through ckptd: pass plugins=[CkptdCheckpointIO(job=...)] to the Trainer "
            f"(its CheckpointIO is a {type(io).__name__})"
        )
    return io


class CkptdModelParallelStrategy(_ShardedThroughCkptd, ModelParallelStrategy):
    """ModelParallelStrategy (FSDP2 + TP) whose checkpoints go through CkptdCheckpointIO, sharded.

        trainer = L.Trainer(strategy=CkptdModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                            plugins=[CkptdCheckpointIO(job="run-42")], ...)

    Takes ModelParallelStrategy's arguments (by keyword) except save_distributed_checkpoint (always sharded).
    A resume may use another data- or tensor-parallel size: each rank loads its own boxes.
    Raises TypeError at the first save or load when the Trainer's CheckpointIO is not a
    CkptdCheckpointIO.
    """

    def __init__(self, **kwargs: Any) -> None:
        if "save_distributed_checkpoint" in kwargs:
            raise TypeError(f"{type(self).__name__} always saves each rank's shards through ckptd: leave out save_distributed_checkpoint")
        super().__init__(**{**kwargs, "save_distributed_checkpoint": True})


class CkptdFSDPStrategy(_ShardedThroughCkptd, FSDPStrategy):
    """FSDPStrategy (torch's FullyShardedDataParallel, "FSDP1") whose checkpoints go through
    CkptdCheckpointIO, sharded: `L.Trainer(strategy=CkptdFSDPStrategy(...), plugins=[CkptdCheckpointIO(job=...)])`.

    Takes FSDPStrategy's arguments (by keyword) except state_dict_type (always sharded). Without a
    device_mesh argument it gives FSDP a one-dimensional mesh of all ranks, so that FSDP's
    sharded state dicts are DTensors (with none, FSDP1 gives ShardedTensors, which ckptd does
    not take). FSDP1 needs an accelerator: torch refuses CPU modules
    (torch/distributed/fsdp/_init_utils.py, `_init_device_handle`: "FSDP needs a non-CPU
    accelerator device"); for CPU training use CkptdModelParallelStrategy (FSDP2).
    """

    def __init__(self, **kwargs: Any) -> None:
        if "state_dict_type" in kwargs:
            raise TypeError(f"{type(self).__name__} always saves each rank's shards through ckptd: leave out state_dict_type")
        super().__init__(**{**kwargs, "state_dict_type": "sharded"})

    def setup_environment(self) -> None:
        """FSDPStrategy's, then a device mesh of all ranks on the strategy's device type (FSDPStrategy
        makes a tuple of sizes into a CUDA mesh itself)."""
        super().setup_environment()
        if self.kwargs.get("device_mesh") is None:
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, (self.world_size,))
