"""A torchtitan config module for tests/gpu/torchtitan_trainer.sh: torchtitan 0.3.0's llama3 debug
model checkpointing through ckptd (`--module titan_ckptd_config --config llama3_debugmodel_ckptd`).
The job id is $CKPTD_TITAN_JOB; the daemon's socket $CKPTD_ADDRESS (CheckpointClient's default)."""

from __future__ import annotations

import os
from typing import Any


def llama3_debugmodel_ckptd() -> Any:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from ckptd.integrations.torchtitan import CkptdCheckpointManager

    config = llama3_debugmodel()
    config.checkpoint = CkptdCheckpointManager.Config(
        enable=True, job=os.environ["CKPTD_TITAN_JOB"], interval=5, async_mode="async", last_save_model_only=False
    )
    config.lr_scheduler.total_steps = 10  # the same schedule in a run stopped at step 5 and in the full one
    config.validator.enable = False
    config.metrics.disable_color_printing = True
    return config
