#!/usr/bin/env bash
# issue 31 item 7: torchtitan 0.3.0's own Trainer (llama3 debug model, FSDP2 over 2 GPUs, NCCL)
# checkpointing through ckptd.integrations.torchtitan. On CPU the Trainer does not run
# (docs/integrations/torchtitan.md says where it refuses); tests/integrations/test_torchtitan.py
# drives the same CheckpointManager with torchtitan's components on gloo.
# Needs 2 CUDA GPUs, torchtitan==0.3.0 with its dependencies (datasets, tokenizers, ...) and a
# checkout of torchtitan v0.3.0 for its test assets (tests/assets/tokenizer, tests/assets/c4_test).
# From this repository's root:  bash tests/gpu/torchtitan_trainer.sh /path/to/torchtitan-v0.3.0
# Run "ref" trains steps 1-10; run "cut" trains 1-5 (its last step, 5, saved whole), a new run of
# the same job resumes from step 5 (load_step=-1) and trains 6-10: the losses of steps 6-10 must
# equal the reference run's.
set -euo pipefail
titan=${1:?usage: bash tests/gpu/torchtitan_trainer.sh TORCHTITAN_CHECKOUT}
here=$(cd "$(dirname "$0")" && pwd)
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "torchtitan_trainer.sh: needs 2 CUDA GPUs, found $gpus" >&2
  exit 2
fi
work=$(mktemp -d)
shm=$(mktemp -d -p /dev/shm ckptd-titan-XXXX)
ckptd serve --root "$work/root" --socket "$work/d.sock" --shm-dir "$shm" >"$work/daemon.log" 2>&1 &
daemon=$!
trap 'kill "$daemon"; rm -rf "$shm"' EXIT
for _ in $(seq 100); do [ -S "$work/d.sock" ] && break; sleep 0.1; done
export CKPTD_ADDRESS="$work/d.sock" PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

train() {  # job, log file, extra arguments
  (cd "$titan" && CKPTD_TITAN_JOB="$1" torchrun --nproc-per-node 2 -m torchtitan.train \
     --module titan_ckptd_config --config llama3_debugmodel_ckptd --debug.seed 42 --debug.deterministic \
     --dump_folder "$work/dump-$1" "${@:3}") >"$2" 2>&1 || { tail -50 "$2"; exit 1; }
}
losses() { grep -oE "step: +[0-9]+  loss: +[0-9.]+" "$1" | awk '$2 > 5 {print $2, $4}' | sort -u; }

train ref "$work/ref.log"
train cut "$work/cut.log" --training.steps 5
train cut "$work/resumed.log"
grep -q "Loading the checkpoint from .*cut/step-00000005" "$work/resumed.log" || { echo "the resumed run did not load step 5" >&2; exit 1; }
if [ "$(losses "$work/ref.log")" != "$(losses "$work/resumed.log")" ] || [ -z "$(losses "$work/ref.log")" ]; then
  echo "losses of steps 6-10 differ:" >&2; paste <(losses "$work/ref.log") <(losses "$work/resumed.log") >&2; exit 1
fi
echo "torchtitan_trainer.sh: resumed from ckptd step 5, losses of steps 6-10 equal the uninterrupted run's"
losses "$work/resumed.log"
