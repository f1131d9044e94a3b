"""CkptdDeepSpeedStrategy (Lightning's DeepSpeedStrategy, ZeRO-1/2/3) with the real PyTorch
Lightning and DeepSpeed (its CPU accelerator, gloo rank processes) against a real daemon: every
rank hands its own ZeRO partitions to ckptd through ckptd.integrations.deepspeed, Lightning's
loops, callbacks and schedulers ride along, and a resume restores them (issue 31 item 2).

Lightning refuses DeepSpeed on anything but CUDA (lightning/pytorch/strategies/deepspeed.py:342-346,
setup_environment) and needs device indices that its CPU devices lack (fabric/strategies/deepspeed.py:877-885,
pytorch/strategies/deepspeed.py:447-448); the workers give them and skip that check
(lightning_worker.CpuDeepSpeedStrategy).
The workers skip DeepSpeed's JIT build of its CPU shared-memory op, which ZeRO training does not use
(tests/integrations/deepspeed_cpu.py).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("deepspeed")

from safetensors.torch import load_file  # noqa: E402

from ckptd.integrations.lightning import CkptdDeepSpeedStrategy  # noqa: E402
from worker_process import load_worker  # noqa: E402  (tests/worker_process.py)

_worker = load_worker(Path(__file__).with_name("lightning_worker.py"))
finish, kill, start_ranks = _worker.finish, _worker.kill, _worker.start_ranks


def losses(path: Path) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in map(json.loads, path.read_text().splitlines())}


def _spec(daemon: Any, tmp: Path, name: str, job: str, stage: int, **changes: Any) -> dict[str, Any]:
    base = {"address": daemon.address, "job": job, "dirpath": str(tmp / job), "out": str(tmp / f"{name}.jsonl"), "max_steps": 8,
            "every": 5, "batch": 4, "ckpt_path": None, "pause_at": 0, "deepspeed": stage,
            "accelerator": "gpu" if os.environ.get("CKPTD_TEST_DEVICE") == "cuda" else "cpu"}  # tests/gpu/deepspeed_integrations.sh
    return {**base, **changes}


def _killed_and_resumed(daemon: Any, tmp: Path, stage: int, reference: bool) -> None:
    """2 processes save at step 5 (the top-k checkpoint and last.ckpt: one ckptd step), train
    steps 6-8 and are SIGKILLed once last.ckpt names step 5; 2 new processes resume from
    ckpt_path="last" and train steps 6-8 again with the same losses (no RNG hooks in the module:
    ckptd restores each rank's generators). reference: an uninterrupted run without kill to
    compare all steps with, besides the killed run's own."""
    job = f"pl-ds{stage}"
    killed = start_ranks(_spec(daemon, tmp, "killed", job, stage, max_steps=10, pause_at=5, pause_after=8))
    try:
        assert _durable(killed[0]) == "DURABLE 5"
    finally:
        kill(killed)
    assert [p.returncode for p in killed] == [-signal.SIGKILL] * 2
    finish(start_ranks(_spec(daemon, tmp, "resumed", job, stage, ckpt_path="last")))
    before, after = losses(tmp / "killed.jsonl"), losses(tmp / "resumed.jsonl")
    assert sorted(before) == list(range(1, 9)) and sorted(after) == [6, 7, 8]
    assert after == {s: before[s] for s in (6, 7, 8)}
    if reference:
        finish(start_ranks(_spec(daemon, tmp, "ref", f"{job}-ref", stage)))
        assert losses(tmp / "ref.jsonl") == {**before, **after}


def _durable(rank0: Any) -> str:
    """Rank 0's DURABLE line (DeepSpeed prints to stdout as well), or "" when it ended first."""
    for line in iter(rank0.stdout.readline, ""):
        if line.startswith("DURABLE"):
            return str(line.strip())
    return ""


def _dumped(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return load_file(f"{path}.safetensors"), json.loads(Path(f"{path}.json").read_text())


def _resized(daemon: Any, tmp: Path, stage: int, worlds: tuple[int, int], load_stage: int) -> None:
    """Saved at step 5 by worlds[0] processes at `stage`, restored by worlds[1] at `load_stage`
    (no step trained): DeepSpeed's whole fp32 master weights and Adam moments, the param groups,
    the scheduler, global_step and the engine's counters are those at the save, bit for bit."""
    job = f"pl-ds{stage}-{worlds[0]}to{worlds[1]}"
    finish(start_ranks(_spec(daemon, tmp, "saved", job, stage, max_steps=5, dump=str(tmp / "saved")), world_size=worlds[0]))
    finish(start_ranks(_spec(daemon, tmp, "loaded", job, load_stage, max_steps=5, ckpt_path="last", dump=str(tmp / "loaded")), world_size=worlds[1]))
    (saved, saved_rest), (loaded, loaded_rest) = _dumped(tmp / "saved"), _dumped(tmp / "loaded")
    assert sorted(loaded) == sorted(saved) and any(k.endswith("exp_avg_sq") for k in saved)
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []
    assert {k: v for k, v in loaded_rest.items() if k != "counters"} == {k: v for k, v in saved_rest.items() if k != "counters"}
    assert loaded_rest["counters"][0] == saved_rest["counters"][0] == 5  # the engine's global_steps


# issue 31 item 2
def test_zero2_killed_resumes_with_the_losses_of_the_run_it_interrupted(daemon, tmp_path: Path) -> None:
    _killed_and_resumed(daemon, tmp_path, 2, reference=False)


# issue 31 item 2
@pytest.mark.long  # the default run keeps ZeRO-2 killed and resumed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_killed_resumes_with_the_losses_of_an_uninterrupted_run(daemon, tmp_path: Path, stage: int) -> None:
    _killed_and_resumed(daemon, tmp_path, stage, reference=True)


# issue 31 item 2
@pytest.mark.long  # the default run keeps ZeRO-2 killed and resumed
@pytest.mark.parametrize(("stage", "worlds", "load_stage"), [(2, (2, 1), 2), (3, (1, 2), 3), (3, (2, 1), 1)])
def test_saved_in_one_layout_resumes_bit_for_bit_in_another(daemon, tmp_path: Path, stage: int, worlds: tuple[int, int], load_stage: int) -> None:
    _resized(daemon, tmp_path, stage, worlds, load_stage)


# issue 31 item 2
def test_the_strategy_needs_ckptds_checkpoint_io_and_partitions() -> None:
    with pytest.raises(TypeError, match="leave out load_full_weights"):
        CkptdDeepSpeedStrategy(load_full_weights=True)
    strategy = CkptdDeepSpeedStrategy(stage=2)
    with pytest.raises(TypeError, match=r"pass plugins=\[CkptdCheckpointIO\(job=...\)\] to the Trainer \(its CheckpointIO is a TorchCheckpointIO\)"):
        strategy.checkpoint_io = L.fabric.plugins.TorchCheckpointIO()
        from ckptd.integrations._lightning_sharded import ckptd_io

        ckptd_io(strategy, "save_engine")
