"""DeepSpeed on CPU in the test processes (ZeRO over gloo), without its shared-memory kernel.

DeepSpeed's comm backend builds its CPU shared-memory all-reduce op (deepspeed_shm_comm) when it
starts (deepspeed/comm/torch.py, TorchBackend.__init__ -> build_shm_op): a C++ JIT build of about
half a minute on 2 cores, cached in ~/.cache/torch_extensions but built again for every new venv
path (the fresh venv of .ci/run). Only `inference_all_reduce` uses that op; ZeRO training's
collectives are torch.distributed's over gloo with or without it, so the tests mark the op as not
buildable (DeepSpeed's own switch, deepspeed.ops.__compatible_ops__) and never pay the build."""

from __future__ import annotations

import os


def without_shm_kernel() -> None:
    """Call once DS_ACCELERATOR is set, before DeepSpeed's comm backend starts; nothing on GPUs."""
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return
    import deepspeed.ops  # type: ignore[import-untyped]

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
