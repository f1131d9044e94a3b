"""Lightning's DeepSpeedStrategy saving through ckptd: `CkptdDeepSpeedStrategy` (ZeRO-1, 2, 3).

Lightning's DeepSpeedStrategy saves and loads without the CheckpointIO: its save_checkpoint calls
`engine.save_checkpoint(dir)` on every rank and its load_checkpoint `engine.load_checkpoint(dir)`
(lightning/pytorch/strategies/deepspeed.py, `save_checkpoint` and `load_checkpoint`), so a
CkptdCheckpointIO given to the Trainer is never called. This subclass keeps everything else of it
and replaces those two with CkptdCheckpointIO's engine calls:

- save: every rank hands its ZeRO partitions (fp32 master weights, optimizer state, the engine's
  counters and scheduler) through ckptd.integrations.deepspeed, with Lightning's other keys
  (loops, callbacks, lr_schedulers, hyper-parameters, ...) as that module's extra
  (`CkptdCheckpointIO.save_engine`); rank 0 writes the pointer file once the step is durable.
  Nothing is gathered, and the state_dict and optimizer_states Lightning builds are not saved
  (the engine holds them), as DeepSpeedStrategy itself leaves them out;
- load: every rank fills its engine's partitions, in whatever data-parallel size and ZeRO stage
  the step was saved in (`CkptdCheckpointIO.load_engine`), and the random generators are
  restored; Lightning then restores its loops, callbacks and schedulers from the returned dict.

Needs the `lightning` and `deepspeed` packages.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy

from ckptd.integrations._lightning_sharded import ckptd_io

__all__ = ["CkptdDeepSpeedStrategy"]


class CkptdDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy whose checkpoints go through CkptdCheckpointIO, each rank its own ZeRO partitions.

        trainer = L.Trainer(strategy=CkptdDeepSpeedStrategy(stage=2), plugins=[CkptdCheckpointIO(job="run-42")], ...)

    Takes DeepSpeedStrategy's arguments (by keyword) except load_full_weights (a ckptd checkpoint
    is never one file). A resume may use another number of processes and another ZeRO stage.
    Raises TypeError at the first save or load when the Trainer's CheckpointIO is not a
    CkptdCheckpointIO; ValueError (from ckptd.integrations.deepspeed) for engines it does not
    serve (ZeRO stage 0, pipeline or tensor parallel, MoE, NVMe offload).
    """

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("load_full_weights"):
            raise TypeError(f"{type(self).__name__} loads each rank's partitions from ckptd: leave out load_full_weights")
        super().__init__(**kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank hands its partitions to ckptd (see the module docstring)."""
        filepath = self.broadcast(filepath)  # one pointer path on every rank, as DeepSpeedStrategy does
        ckptd_io(self, "save_engine").save_engine(self.deepspeed_engine, checkpoint, filepath, self.global_rank, self.world_size, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the engine from ckptd in this run's layout; returns Lightning's checkpoint dict
        (loops, callbacks, schedulers: Lightning restores them) without state_dict and
        optimizer_states. Raises ValueError for a validate or test run (no ZeRO optimizer to
        fill): load the weights with ckptd.integrations.deepspeed.load_consolidated instead."""
        engine = self.deepspeed_engine
        if engine.optimizer is None:
            raise ValueError(
                f"{type(self).__name__} restores a ZeRO engine's training state, and this run's engine has no optimizer "
                "(validate, test or predict): put the weights into the LightningModule with "
                "ckptd.integrations.deepspeed.load_consolidated(module, CheckpointClient(job, rank=0, world_size=1)) instead"
            )
        return ckptd_io(self, "load_engine").load_engine(engine, checkpoint_path, self.global_rank, self.world_size)  # type: ignore[no-any-return]
