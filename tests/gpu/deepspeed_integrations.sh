#!/usr/bin/env bash
# issue 31 item 2: the DeepSpeed tests of ckptd.integrations.accelerate (DeepSpeedPlugin) and
# .lightning (CkptdDeepSpeedStrategy) on GPUs, NCCL, where neither library needs the CPU steps
# the tests take (Accelerate: InitProcessGroupKwargs(backend="gloo"), tests/integrations/accel_train.py;
# Lightning refuses DeepSpeed on CPU: lightning/pytorch/strategies/deepspeed.py:342-346, see
# tests/integrations/lightning_worker.py, CpuDeepSpeedStrategy). Needs 2 GPUs (one per process).
# From the repository root:  bash tests/gpu/deepspeed_integrations.sh
set -euo pipefail
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "deepspeed_integrations.sh: needs at least 2 CUDA GPUs (one per process, NCCL), found $gpus" >&2
  exit 2
fi
CKPTD_TEST_DEVICE=cuda exec python -m pytest -q -m "long or not long" \
  tests/integrations/test_accelerate_deepspeed.py tests/integrations/test_lightning_deepspeed.py
