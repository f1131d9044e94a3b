"""ckptd.integrations.deepspeed with the real DeepSpeed engine (its CPU accelerator, gloo ranks as
processes) and a real daemon: ZeRO-1/2/3 partitions saved by each rank, the ranks SIGKILLed,
resumed with the losses of the uninterrupted run, resumed at another data-parallel size with
the master weights and optimizer state bit-exact, and read into a plain PyTorch model.

The run that saves is the uninterrupted one: it saves at step 2, trains on to step 4 and is
SIGKILLed there (what it trained after the save is lost); the resumed run must repeat its
steps 3 and 4. The workers skip DeepSpeed's JIT build of its CPU shared-memory op
(deepspeed_shm_comm), which ZeRO training does not use (tests/integrations/deepspeed_cpu.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file
from worker_process import load_worker, run_ranks  # tests/worker_process.py

pytest.importorskip("deepspeed")

from ckptd.client import CheckpointClient  # noqa: E402
from ckptd.integrations.deepspeed import load_consolidated  # noqa: E402

WORKER = Path(__file__).with_name("deepspeed_ranks.py")
SAVE_AT, STEPS = 2, 4


def _run(daemon: Any, out: Path, world: int, *, kill: bool = False, steps: int = STEPS, **spec: Any) -> list[dict[str, Any]]:
    out.mkdir()
    run_ranks(WORKER, world, 240, -9 if kill else 0, address=daemon.address, out=str(out), steps=steps, kill=kill, **spec)
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(world)]


def _dump(out: Path, which: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"0-{which}.safetensors"))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _saved_run(daemon: Any, tmp: Path, stage: int, job: str) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    saved = _run(daemon, tmp / f"saved-{stage}", 2, kill=True, job=job, stage=stage, save_at=SAVE_AT)
    return saved, _dump(tmp / f"saved-{stage}", "saved")


def _check_resumed(saved: list[dict[str, Any]], saved_dump: dict[str, torch.Tensor], resumed: list[dict[str, Any]], out: Path) -> None:
    """The resumed ranks hold what the saved ones held at the save."""
    _assert_same(_dump(out, "loaded"), saved_dump)
    for rank, report in enumerate(resumed):
        assert report["loaded_step"] == SAVE_AT
        own = rank if rank < len(saved) else 0  # a rank the save did not have gets rank 0's extras
        assert report["extra"] == {"epoch": SAVE_AT // 2, "position": 10 * own + SAVE_AT}
        assert report["loaded"] == saved[0]["saved"]


def _check_consolidated(daemon: Any, root: Path, job: str, saved_dump: dict[str, torch.Tensor]) -> None:
    """A plain Net gets the whole fp32 weights, offline and through the daemon."""
    net = load_worker(WORKER).Net
    for source in ("offline", "daemon"):
        model = net()
        with torch.no_grad():
            model.scale.zero_()
        if source == "offline":
            assert load_consolidated(model, root, job=job) == SAVE_AT
        else:
            with CheckpointClient(job, address=daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
                assert load_consolidated(model, ckpt) == SAVE_AT
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), saved_dump[f"master.{name}"]), (source, name)
        assert model.scale.tolist() == [1.0, 0.5, 2.0]


@pytest.fixture(scope="module")
def ds_daemon(module_daemons: Any) -> Any:
    return module_daemons.start()


@pytest.fixture(scope="module")
def saved_runs(ds_daemon: Any, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[str, list[dict[str, Any]], dict[str, torch.Tensor]]]:
    """(stage, bf16=False) -> (job, the reports, the dump at the save) of a 2-rank run that
    saved at step 2 and was SIGKILLed at step 4; run once per stage, bf16 and module."""
    runs: dict[tuple[int, bool], tuple[str, list[dict[str, Any]], dict[str, torch.Tensor]]] = {}

    def get(stage: int, bf16: bool = False) -> tuple[str, list[dict[str, Any]], dict[str, torch.Tensor]]:
        if (stage, bf16) not in runs:
            job = f"ds-zero{stage}" + ("-bf16" if bf16 else "")
            out = tmp_path_factory.mktemp(job) / "saved"
            reports = _run(ds_daemon, out, 2, kill=True, job=job, stage=stage, save_at=SAVE_AT, bf16=bf16)
            runs[stage, bf16] = job, reports, _dump(out, "saved")
        return runs[stage, bf16]

    return get


def _same_size(ds_daemon: Any, saved_runs: Any, tmp: Path, stage: int, bf16: bool = False) -> None:
    job, saved, saved_dump = saved_runs(stage, bf16)
    resumed = _run(ds_daemon, tmp / "same", 2, job=job, stage=stage, resume=True, bf16=bf16)
    _check_resumed(saved, saved_dump, resumed, tmp / "same")
    for rank in range(2):
        assert resumed[rank]["losses"] == {str(s): saved[rank]["losses"][str(s)] for s in range(SAVE_AT + 1, STEPS + 1)}
        assert resumed[rank]["final"] == saved[rank]["final"]


def _other_sizes(ds_daemon: Any, saved_runs: Any, tmp: Path, stage: int, worlds: tuple[int, ...] = (3, 1), bf16: bool = False) -> None:
    job, saved, saved_dump = saved_runs(stage, bf16)
    for world in worlds:
        out = tmp / f"dp{world}"
        resumed = _run(ds_daemon, out, world, job=job, stage=stage, resume=True, steps=SAVE_AT + 1, bf16=bf16)
        _check_resumed(saved, saved_dump, resumed, out)


# issue 31 item 2
def test_issue31_item2_zero2_killed_resumes_with_the_same_losses(ds_daemon: Any, module_daemons: Any, saved_runs: Any, tmp_path: Path) -> None:
    _same_size(ds_daemon, saved_runs, tmp_path, 2)
    job, _, saved_dump = saved_runs(2)
    _check_consolidated(ds_daemon, module_daemons.root, job, saved_dump)


# issue 31 item 2
@pytest.mark.long  # the full sweep (pytest -m long); the default run keeps ZeRO-2 killed-and-resumed and ZeRO-3 into ZeRO-1 at 1 rank
def test_issue31_item2_zero2_resumes_at_another_data_parallel_size(ds_daemon: Any, saved_runs: Any, tmp_path: Path) -> None:
    _other_sizes(ds_daemon, saved_runs, tmp_path, 2)


# issue 31 item 2
@pytest.mark.long  # the full sweep (pytest -m long); the default run keeps ZeRO-2 killed-and-resumed and ZeRO-3 into ZeRO-1 at 1 rank
@pytest.mark.parametrize("stage", [1, 3])
def test_issue31_item2_zero1_zero3_killed_resumed_and_resharded(ds_daemon: Any, module_daemons: Any, saved_runs: Any, tmp_path: Path, stage: int) -> None:
    _same_size(ds_daemon, saved_runs, tmp_path, stage)
    _other_sizes(ds_daemon, saved_runs, tmp_path, stage)
    job, _, saved_dump = saved_runs(stage)
    _check_consolidated(ds_daemon, module_daemons.root, job, saved_dump)


# issue 31 item 2
def test_issue31_item2_zero3_checkpoint_loads_into_zero1(ds_daemon: Any, saved_runs: Any, tmp_path: Path) -> None:
    job, saved, saved_dump = saved_runs(3)
    resumed = _run(ds_daemon, tmp_path / "zero1", 1, job=job, stage=1, resume=True, steps=SAVE_AT + 1)
    _check_resumed(saved, saved_dump, resumed, tmp_path / "zero1")


# issue 31 item 2
def test_issue31_item2_consolidated_load_names_what_does_not_fit(ds_daemon: Any, module_daemons: Any, saved_runs: Any) -> None:
    job, _, saved_dump = saved_runs(2)
    model = load_worker(WORKER).Net()
    model.head = torch.nn.Linear(3, 2)  # a parameter the checkpoint lacks
    with pytest.raises(ValueError, match=r"not in the checkpoint: head\.bias, head\.weight"):
        load_consolidated(model, module_daemons.root, job=job)
    assert load_consolidated(model, module_daemons.root, job=job, strict=False) == SAVE_AT
    assert torch.equal(model.inp.weight.detach(), saved_dump["master.inp.weight"])


# issue 31 item 2
def test_issue31_item2_refuses_other_checkpoints_and_objects(ds_daemon: Any, module_daemons: Any) -> None:
    from ckptd.integrations.deepspeed import load, save

    model = torch.nn.Linear(2, 2)
    with CheckpointClient("ds-plain", address=ds_daemon.address, rank=0, world_size=1, on_error="raise") as ckpt:
        ckpt.save(1, {"model": model}).wait_durable(timeout=60)
        with pytest.raises(ValueError, match="was not saved by ckptd.integrations.deepspeed.save"):
            load_consolidated(model, ckpt)
        with pytest.raises(TypeError, match="expected a deepspeed.DeepSpeedEngine"):
            save(model, ckpt, 2)
        with pytest.raises(TypeError, match="expected a deepspeed.DeepSpeedEngine"):
            load(model, ckpt)
    with pytest.raises(ValueError, match="was not saved by ckptd.integrations.deepspeed.save"):
        load_consolidated(model, module_daemons.root, job="ds-plain")


# issue 31 item 2
@pytest.mark.long  # the full sweep (pytest -m long); the default run keeps ZeRO-2 killed-and-resumed and ZeRO-3 into ZeRO-1 at 1 rank
@pytest.mark.parametrize("stage", [2, 3])
def test_issue31_item2_bf16_killed_resumed_and_resharded(ds_daemon: Any, module_daemons: Any, saved_runs: Any, tmp_path: Path, stage: int) -> None:
    """bf16 weights, fp32 master weights: only the master weights are saved, and the bf16
    weights set from them on load are those of the uninterrupted run (the same losses)."""
    _same_size(ds_daemon, saved_runs, tmp_path, stage, bf16=True)
    _other_sizes(ds_daemon, saved_runs, tmp_path, stage, (1,), bf16=True)
    job, _, saved_dump = saved_runs(stage, True)
    _check_consolidated(ds_daemon, module_daemons.root, job, saved_dump)


# issue 31 item 2
@pytest.mark.long  # the full sweep (pytest -m long); the default run keeps ZeRO-2 killed-and-resumed and ZeRO-3 into ZeRO-1 at 1 rank
def test_issue31_item2_a_job_without_a_checkpoint_starts_fresh(ds_daemon: Any, tmp_path: Path) -> None:
    (report,) = _run(ds_daemon, tmp_path / "fresh", 1, job="ds-fresh", stage=1, resume=True, steps=1)
    assert report["loaded_step"] is None and report["extra"] == {"epoch": -1, "position": -1}
    assert list(report["losses"]) == ["1"] and report["final"]["counters"][0] == 1


def _cpu_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator takes fp16 on this machine (it asks oneDNN: AVX512-FP16
    or AMX CPUs; an AMD EPYC without them is refused with "Type fp16 is not supported")."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


@pytest.mark.skipif(not _cpu_fp16(), reason="DeepSpeed's CPU accelerator refuses fp16 on this CPU (no AVX512-FP16/AMX in oneDNN)")
def test_a_checkpoint_of_another_precision_keeps_the_engines_own_loss_scaler(ds_daemon: Any, saved_runs: Any, tmp_path: Path) -> None:
    """Found by a probe: the fp32 run's static scale (1.0, dynamic off) was set into an fp16
    engine asking for a dynamic scale of 2**16, which then trained fp16 unscaled, silently."""
    job, _, _ = saved_runs(2)
    resumed = _run(ds_daemon, tmp_path / "fp16", 1, job=job, stage=2, resume=True, steps=SAVE_AT + 1, fp16=True)
    assert resumed[0]["loaded_step"] == SAVE_AT
    assert resumed[0]["loss_scaler"] == {"scale": 2.0**16, "dynamic": True}


def test_an_engine_without_an_optimizer_is_refused_saying_what_to_save(ds_daemon: Any, tmp_path: Path) -> None:
    """Found by a probe: ZeRO-3 built without an optimizer (an evaluation engine) failed with
    DeepSpeed's AttributeError ('bit16_groups') instead of the documented ValueError."""
    (report,) = _run(ds_daemon, tmp_path / "bare", 1, job="ds-bare", stage=3, no_optimizer=True)
    assert report["refused"].startswith("ValueError: this engine has no ZeRO optimizer"), report
    assert "CheckpointClient.save({'model': engine.module})" in report["refused"]


def test_a_consolidated_load_takes_weights_frozen_in_training_from_the_step(ds_daemon: Any, module_daemons: Any, tmp_path: Path) -> None:
    """Found by a probe: a parameter frozen in training is stored as a model tensor, not a master
    weight; a fresh evaluation model (every requires_grad True, as the docs describe it) was
    refused as lacking it."""
    _run(ds_daemon, tmp_path / "frozen", 1, job="ds-frozen", stage=2, save_at=SAVE_AT, steps=SAVE_AT, frozen=True)
    net = load_worker(WORKER).Net
    torch.manual_seed(0)
    expected = net().inp.weight.detach().clone()  # never trained: the worker's initial value
    model = net()
    assert all(p.requires_grad for p in model.parameters())
    assert load_consolidated(model, module_daemons.root, job="ds-frozen") == SAVE_AT
    assert torch.equal(model.inp.weight.detach(), expected)
    model.head = torch.nn.Linear(3, 2)  # still named when truly missing
    with pytest.raises(ValueError, match=r"not in the checkpoint: head\.bias, head\.weight"):
        load_consolidated(model, module_daemons.root, job="ds-frozen")


def test_a_step_saved_without_a_scheduler_is_refused_by_an_engine_with_one(ds_daemon: Any, saved_runs: Any, tmp_path: Path) -> None:
    """Found by a probe: the refusal said "save it with that key, or leave it out of the load",
    neither of which the user can do. The step now says it was saved without a scheduler, before
    anything of the engine changed; a step saved with one loads into an engine without one."""
    _run(ds_daemon, tmp_path / "saved", 1, job="ds-nosched", stage=2, save_at=SAVE_AT, steps=SAVE_AT, scheduler=False)
    (refused,) = _run(ds_daemon, tmp_path / "with", 1, job="ds-nosched", stage=2, resume=True)
    assert "was saved from an engine without an LR scheduler, and this engine has one (WarmupLR)" in refused["refused"], refused
    assert refused["after"]["counters"] == [0, 0, 0, 0] and refused["after"]["adam_steps"] == []
    (resumed,) = _run(ds_daemon, tmp_path / "without", 1, job="ds-nosched", stage=2, resume=True, steps=SAVE_AT + 1, scheduler=False)
    assert resumed["loaded_step"] == SAVE_AT
    job, _, _ = saved_runs(2)
    (other,) = _run(ds_daemon, tmp_path / "other", 1, job=job, stage=2, resume=True, steps=SAVE_AT + 1, scheduler=False)
    assert other["loaded_step"] == SAVE_AT and other["loaded"]["scheduler"] is None
