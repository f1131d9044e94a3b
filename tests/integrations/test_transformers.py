"""CkptdCallback (ckptd.integrations.transformers) with the real Trainer on CPU and real daemons:
a run killed with SIGKILL and resumed (twice: mid-epoch and at an epoch boundary) trains exactly
what an uninterrupted run does; the Trainer writes no checkpoint of its own; metrics reach
ckptd's keep-best; a daemon that is down does not stop training; misuse is refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from worker_process import load_worker, run_torchrun_like, run_worker  # tests/worker_process.py
import torch

from ckptd.client import CheckpointClient, ClientOptions, DaemonUnavailable

transformers = pytest.importorskip("transformers")

from ckptd.demo.process import DaemonProcess  # noqa: E402
from ckptd.integrations._hf_pointers import POINTER_FILE  # noqa: E402
from ckptd.integrations.transformers import EMPTY_SHARD_NAME, RESUME_DIR_PREFIX, CkptdCallback  # noqa: E402

WORKER = Path(__file__).with_name("hf_train.py")


hf = load_worker(WORKER)


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


def _run(spec: dict[str, Any], killed: bool = False) -> dict[str, Any]:
    return run_worker(WORKER, spec, killed)


def _no_trainer_checkpoints(output_dir: Path) -> None:
    """No checkpoint of the Trainer's own: checkpoint-<step> directories are ckptd pointers (no weights, nothing pickled)."""
    written = sorted(p.relative_to(output_dir).as_posix() for p in output_dir.rglob("*")) if output_dir.exists() else []
    pointer_files = {"", EMPTY_SHARD_NAME, POINTER_FILE, "model.safetensors.index.json", "trainer_state.json"}
    assert not [p for p in written if p.startswith("checkpoint-") and p.partition("/")[2] not in pointer_files], written
    assert not [p for p in written if p.endswith((".pt", ".pth", ".bin", ".pkl"))], written


def _train_logs(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in log_history if "loss" in entry]


@pytest.mark.slow
def test_killed_and_resumed_twice_trains_what_an_uninterrupted_run_does(daemon, tmp_path: Path, one_thread: None) -> None:
    # 6 optimizer steps an epoch (12 batches, accumulation 2), saves at 3, 6 (an epoch's end), 9, 10.
    baseline = json.loads(json.dumps(hf.train({"output_dir": str(tmp_path / "plain"), "max_steps": 10})))  # keys as the workers write them
    losses = baseline["losses"]
    assert len(losses) == 10 and all(len(v) == 2 for v in losses.values())

    out_dir = tmp_path / "out"
    spec = {"address": daemon.address, "job": "hf-run", "output_dir": str(out_dir), "max_steps": 10, "save_steps": 3,
            "marker": str(tmp_path / "marker"), "out": str(tmp_path / "run.json")}

    first = _run({**spec, "kill_at": 4}, killed=True)  # killed at step 4, after step 3 is durable
    assert json.loads(Path(spec["marker"]).read_text()) == 3
    assert (daemon.root / "hf-run" / "step-00000003" / "ckptd.index.json").is_file()
    assert first["resumed_from"] is None and first["losses"] == {k: losses[k] for k in "1 2 3 4".split()}

    second = _run({**spec, "kill_at": 7}, killed=True)  # resumed mid-epoch, killed after step 6 is durable
    assert json.loads(Path(spec["marker"]).read_text()) == 6
    assert second["resumed_from"] == 3
    assert second["losses"] == {str(k): losses[str(k)] for k in range(4, 8)}

    third = _run(spec)  # resumed at an epoch boundary, trained to the end
    assert third["resumed_from"] == 6
    assert third["losses"] == {str(k): losses[str(k)] for k in range(7, 11)}
    # the trainer state came back too: the log history of the whole run, loss, grad norm, lr and epoch of every step
    assert _train_logs(third["log_history"]) == _train_logs(baseline["log_history"])

    _no_trainer_checkpoints(out_dir)
    with CheckpointClient("hf-run", address=daemon.address) as ckpt:
        assert ckpt.latest() == 10


# issue 30 finding 7
@pytest.mark.slow
def test_a_resume_never_redoes_a_held_step_and_a_redone_ones_save_is_kept(daemons, tmp_path: Path, one_thread: None) -> None:
    """Killed right after step 6 is handed over (before it is durable): resume_from picks 6,
    which the daemon committed after the kill. A run resumed from an earlier step (3) redoes
    4..10: its saves of the held steps 6, 9 and 10 are kept as committed (not written again, no
    error with on_error="raise") and it trains as an uninterrupted run."""
    daemon = daemons.start("--keep-last", "0")  # every step stays
    losses = json.loads(json.dumps(hf.train({"output_dir": str(tmp_path / "plain"), "max_steps": 10})))["losses"]
    spec = {"address": daemon.address, "job": "hf-window", "output_dir": str(tmp_path / "out"), "max_steps": 10, "save_steps": 3,
            "marker": str(tmp_path / "marker"), "out": str(tmp_path / "run.json")}
    _run({**spec, "kill_at": 7, "kill_handed_over": True}, killed=True)  # step 6 is saved at the start of step 7
    assert json.loads(Path(spec["marker"]).read_text()) == 6

    second = _run(spec)
    assert second["resumed_from"] == 6
    assert second["losses"] == {str(k): losses[str(k)] for k in range(7, 11)}

    held = {step: (daemon.root / "hf-window" / f"step-{step:08d}" / "ckptd.index.json").read_bytes() for step in (6, 9, 10)}
    third = _run({**spec, "resume_step": 3, "out": str(tmp_path / "again.json")})
    assert third["resumed_from"] == 3
    assert third["losses"] == {str(k): losses[str(k)] for k in range(4, 11)}
    assert {step: (daemon.root / "hf-window" / f"step-{step:08d}" / "ckptd.index.json").read_bytes() for step in held} == held


def _run_ranks(spec: dict[str, Any], world_size: int, killed: bool = False) -> dict[str, Any]:
    return run_torchrun_like(WORKER, spec, world_size, killed)


@pytest.mark.slow
def test_two_ranks_save_collectively_and_resume_exactly(daemon, tmp_path: Path) -> None:
    spec = {"address": daemon.address, "job": "hf-ddp", "output_dir": str(tmp_path / "out"), "max_steps": 6, "save_steps": 2,
            "marker": str(tmp_path / "marker"), "out": str(tmp_path / "run.json")}
    first = _run_ranks({**spec, "kill_at": 4}, 2, killed=True)  # both ranks killed at step 4, step 2 durable, 4 not saved
    assert json.loads(Path(spec["marker"]).read_text()) == 2
    index = json.loads((daemon.root / "hf-ddp" / "step-00000002" / "ckptd.index.json").read_text())
    assert "rng/rank1/torch_cpu" in json.dumps(index)  # each rank's generators

    resumed = _run_ranks(spec, 2)
    assert resumed["resumed_from"] == 2
    # rank 0's micro-batches of steps 3 and 4 (its half of the data under DDP) as before the kill
    assert {k: resumed["losses"][k] for k in ("3", "4")} == {k: first["losses"][k] for k in ("3", "4")}
    _no_trainer_checkpoints(tmp_path / "out")


# issue 31 item 1
@pytest.mark.slow
def test_fsdp2_killed_and_resumed_trains_what_an_uninterrupted_run_does(daemon, tmp_path: Path) -> None:
    """The Trainer's FSDP2 (fsdp_config fsdp_version 2, sharded state dict) over 2 gloo ranks:
    killed after step 2 is durable, resumed, the losses and the log history of steps 3-6 equal an
    uninterrupted FSDP2 run's (rank 0's micro-batches; the log's loss is the mean over the ranks)."""
    plain = _run_ranks({"output_dir": str(tmp_path / "plain"), "max_steps": 6, "fsdp": True, "out": str(tmp_path / "plain.json")}, 2)
    spec = {"address": daemon.address, "job": "hf-fsdp", "output_dir": str(tmp_path / "out"), "max_steps": 6, "save_steps": 2,
            "fsdp": True, "marker": str(tmp_path / "marker"), "out": str(tmp_path / "run.json")}
    _run_ranks({**spec, "kill_at": 3}, 2, killed=True)
    assert json.loads(Path(spec["marker"]).read_text()) == 2
    resumed = _run_ranks(spec, 2)
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == {str(k): plain["losses"][str(k)] for k in range(3, 7)}
    assert _train_logs(resumed["log_history"]) == _train_logs(plain["log_history"])
    index = json.loads((daemon.root / "hf-fsdp" / "step-00000006" / "ckptd.index.json").read_text())
    assert index["tensors"]["model/transformer.wte.weight"]["aliases"] == ["model/lm_head.weight"]  # tied, stored once
    _no_trainer_checkpoints(tmp_path / "out")


# issue 31 item 1
def test_fsdp2_each_rank_hands_its_own_shards(daemon, tmp_path: Path) -> None:
    """The Trainer's FSDP2 over 2 gloo ranks: the saves run no collective (nothing gathered), the
    step holds the logical tensors, each rank's generators, and no Trainer checkpoint is written."""
    spec = {"address": daemon.address, "job": "hf-fsdp-shards", "output_dir": str(tmp_path / "out"), "max_steps": 2, "save_steps": 1,
            "fsdp": True, "out": str(tmp_path / "run.json")}
    run = _run_ranks(spec, 2)
    assert run["collectives_in_save"] == []  # rank 0's; rank 1 runs the same code
    index = json.loads((daemon.root / "hf-fsdp-shards" / "step-00000002" / "ckptd.index.json").read_text())
    assert index["world_size"] == 2 and index["tensors"]["model/transformer.wte.weight"]["shape"] == [hf.VOCAB, 32]
    assert "rng/rank1/torch_cpu" in json.dumps(index)
    _no_trainer_checkpoints(tmp_path / "out")


# issue 31 item 1 (long: 3 Trainer processes; test_accelerate_fsdp.py's 2 -> 3 test runs the same client path by default)
@pytest.mark.long
def test_fsdp2_saved_by_two_ranks_resumes_bit_exact_in_three(daemon, tmp_path: Path) -> None:
    """Saved by the Trainer's FSDP2 over 2 ranks (each rank hands its own DTensor shards), resumed
    by 3: the model, the optimizer and the scheduler each rank holds when training begins equal
    the 2-rank run's at its save, bit for bit."""
    _saved_then_resumed_bit_exact(daemon, tmp_path, "hf-fsdp-3", {"fsdp": True}, 2, {"fsdp": True}, 3)


def _saved_then_resumed_bit_exact(daemon: Any, tmp_path: Path, job: str, saving: dict[str, Any], saving_world: int,
                                  resuming: dict[str, Any], resuming_world: int) -> dict[str, Any]:
    """Train 2 steps in `saving_world` ranks with spec `saving`, save at step 2; resume with spec
    `resuming` in `resuming_world` ranks: each resuming rank's model, optimizer and scheduler when
    training begins equal the saving run's at its save, bit for bit. Returns rank 0's saving run."""
    spec = {"address": daemon.address, "job": job, "output_dir": str(tmp_path / "out"), "max_steps": 2, "save_steps": 2,
            "out": str(tmp_path / "run.json")}
    saved_run = _run_ranks({**spec, **saving, "dump": str(tmp_path / "saved-{rank}.safetensors")}, saving_world)
    resumed = _run_ranks({**spec, **resuming, "dump": str(tmp_path / "resumed-{rank}.safetensors")}, resuming_world)
    assert resumed["resumed_from"] == 2
    import safetensors.torch

    saved = safetensors.torch.load_file(str(tmp_path / "saved-0.safetensors"))
    expected = {k.removeprefix("end/"): v for k, v in saved.items() if k.startswith("end/")}
    assert any(k.endswith("/exp_avg_sq") for k in expected)
    scheduler = json.loads((tmp_path / "saved-0.safetensors.json").read_text())["end/scheduler"]
    for rank in range(resuming_world):
        dumped = safetensors.torch.load_file(str(tmp_path / f"resumed-{rank}.safetensors"))
        loaded = {k.removeprefix("loaded/"): v for k, v in dumped.items() if k.startswith("loaded/")}
        assert sorted(loaded) == sorted(expected)
        assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []
        assert json.loads((tmp_path / f"resumed-{rank}.safetensors.json").read_text())["loaded/scheduler"] == scheduler
    return saved_run


# issue 31 item 1 (long: 4 + 2 Trainer processes; test_accelerate_fsdp.py's HSDP test runs the same client path)
@pytest.mark.long
def test_hsdp_saved_by_two_replicas_of_two_shards_resumes_bit_exact_in_fsdp2_over_two(daemon, tmp_path: Path) -> None:
    """The Trainer's HSDP (parallelism_config dp_replicate 2 x dp_shard 2 with its FSDP2): saved at
    4 ranks, resumed by the Trainer's FSDP2 over 2, bit-exact; no collective in the saves."""
    saved = _saved_then_resumed_bit_exact(daemon, tmp_path, "hf-hsdp", {"fsdp": True, "replicas": 2}, 4, {"fsdp": True}, 2)
    assert saved["collectives_in_save"] == []
    index = json.loads((daemon.root / "hf-hsdp" / "step-00000002" / "ckptd.index.json").read_text())
    assert index["world_size"] == 4 and index["tensors"]["model/transformer.wte.weight"]["shape"] == [hf.VOCAB, 32]


def test_metrics_reach_keep_best_and_a_step_holds_the_trainer_state(daemon, tmp_path: Path, one_thread: None) -> None:
    ckpt = CkptdCallback(job="hf-metric", address=daemon.address, on_error="raise")
    args = hf.training_args(str(tmp_path / "out"), max_steps=4, save_steps=2, ckptd=True,
                            eval_strategy="steps", eval_steps=2, metric_for_best_model="loss", per_device_eval_batch_size=8)
    trainer = transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData(), eval_dataset=hf.TokenData(),
                                   callbacks=[ckpt])
    assert ckpt.resume_from(trainer) is None  # nothing saved yet: a fresh start
    trainer.train(resume_from_checkpoint=None)

    evals = {entry["step"]: entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry}
    assert sorted(evals) == [2, 4]
    with CheckpointClient("hf-metric", address=daemon.address) as client:
        infos = {info.step: info for info in client.list()}
        assert {step: infos[step].metric for step in infos} == evals
        saved: dict[str, Any] = {"trainer_state": {}}
        assert client.load(saved, step=4) == 4
    state = saved["trainer_state"]
    assert state["global_step"] == 4 and state["best_metric"] == min(evals.values())
    assert [e for e in state["log_history"] if "eval_loss" in e] == [e for e in trainer.state.log_history if "eval_loss" in e]
    assert "TrainerControl" in state["stateful_callbacks"]
    _no_trainer_checkpoints(tmp_path / "out")
    # the step directory is a Hugging Face model directory as it is
    loaded = transformers.GPT2LMHeadModel.from_pretrained(infos[4].path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), trainer.model.state_dict().values()))


# issue 31 item 7
def test_save_strategy_best_saves_each_new_best_and_load_best_model_at_end_loads_it(daemons, tmp_path: Path, one_thread: None) -> None:
    """save_strategy="best": ckptd saves exactly the evaluated steps whose eval_loss beat the best so
    far (the Trainer writes nothing), each with its metric; load_best_model_at_end leaves the
    model of the best step, loaded from ckptd; the daemon's keep-best retention keeps that step."""
    daemon = daemons.start("--keep-last", "1", "--keep-best", "1", "--best-mode", "min")
    ckpt = CkptdCallback(job="hf-best", address=daemon.address, on_error="raise")
    args = hf.training_args(str(tmp_path / "out"), max_steps=6, save_steps=1, ckptd=True, learning_rate=0.3, warmup_steps=0, lr_scheduler_type="constant",
                            save_strategy="best", eval_strategy="steps", eval_steps=1, metric_for_best_model="loss",
                            load_best_model_at_end=True, per_device_eval_batch_size=24)
    trainer = transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData(), eval_dataset=hf.TokenData(),
                                   callbacks=[ckpt])
    assert ckpt.resume_from(trainer) is None
    seen: dict[int, dict[str, torch.Tensor]] = {}

    saved: set[int] = set()

    class Weights(transformers.TrainerCallback):  # the model after each step, and the steps ckptd saved
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            saved.update([ckpt.last_save.step] if ckpt.last_save is not None else [])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen[state.global_step] = {k: v.clone() for k, v in kwargs["model"].state_dict().items()}

    trainer.add_callback(Weights())
    trainer.train(resume_from_checkpoint=None)

    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    improved, best = [], float("inf")
    for step in sorted(evals):
        if evals[step] < best:
            improved.append(step)
            best = evals[step]
    best_step = improved[-1]
    assert best_step != max(evals), evals  # the learning rate is high enough that the last step is not the best
    assert (trainer.state.best_global_step, trainer.state.best_metric) == (best_step, best)
    assert sorted(saved) == improved and ckpt.last_save is not None and ckpt.last_save.step == best_step  # a save per new best, no other
    with CheckpointClient("hf-best", address=daemon.address) as client:
        kept = {info.step: info.metric for info in client.list()}
    assert kept == {best_step: best}  # --keep-last 1: the newest save is the best one
    assert trainer.state.best_model_checkpoint is not None and trainer.state.best_model_checkpoint.endswith(f"step-{best_step:08d}")
    assert all(torch.equal(v, seen[best_step][k]) for k, v in trainer.model.state_dict().items())
    assert not all(torch.equal(v, seen[6][k]) for k, v in trainer.model.state_dict().items())
    _no_trainer_checkpoints(tmp_path / "out")


def test_the_resume_directory_holds_json_and_a_tensorless_shard(daemon, tmp_path: Path, one_thread: None) -> None:
    args = hf.training_args(str(tmp_path / "out"), max_steps=2, save_steps=2, ckptd=True)
    first = CkptdCallback(job="hf-dir", address=daemon.address, on_error="raise")
    trainer = transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData(), callbacks=[first])
    trainer.train(resume_from_checkpoint=first.resume_from(trainer))

    again = CkptdCallback(job="hf-dir", address=daemon.address, on_error="raise")
    model = hf.tiny_model()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=hf.TokenData(), callbacks=[again])
    directory = Path(again.resume_from(trainer))
    assert directory == tmp_path / "out" / f"{RESUME_DIR_PREFIX}0"
    assert sorted(p.name for p in directory.iterdir()) == sorted([EMPTY_SHARD_NAME, POINTER_FILE, "model.safetensors.index.json", "trainer_state.json"])
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    import safetensors.torch

    assert safetensors.torch.load_file(str(directory / EMPTY_SHARD_NAME)) == {}
    assert json.loads((directory / "trainer_state.json").read_text())["global_step"] == 2
    trainer.args.max_steps = 4
    trainer.train(resume_from_checkpoint=str(directory))
    assert trainer.state.global_step == 4
    assert not directory.exists()  # removed at the end of training


def test_a_daemon_that_is_down_does_not_stop_training(tmp_path: Path, one_thread: None, caplog: pytest.LogCaptureFixture) -> None:
    address = f"unix://{tmp_path}/nobody.sock"
    args = hf.training_args(str(tmp_path / "out"), max_steps=2, save_steps=1, ckptd=True)
    ckpt = CkptdCallback(job="hf-down", address=address)
    trainer = transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData(), callbacks=[ckpt])
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_from(trainer) is None
        trainer.train(resume_from_checkpoint=None)
    assert "cannot reach the ckptd daemon" in caplog.text
    assert trainer.state.global_step == 2
    assert ckpt.last_save is not None and ckpt.last_save.step == 2 and not ckpt.last_save.ok
    _no_trainer_checkpoints(tmp_path / "out")

    strict = CkptdCallback(job="hf-down", address=address, on_error="raise")
    trainer = transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData(), callbacks=[strict])
    with pytest.raises(DaemonUnavailable):
        strict.resume_from(trainer)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"job": "no spaces"}, ValueError, "invalid job id"),
        ({"job": "j", "on_error": "ignore"}, ValueError, "on_error='ignore'"),
        ({"job": "j", "quantize": "O9"}, ValueError, "quantize='O9'"),
        ({"job": "j", "master_weights": "half"}, ValueError, "master_weights='half'"),
        ({"job": "j", "metric": 3}, TypeError, "metric=3"),
        ({"job": "j", "wait_at_end_s": -1}, ValueError, "wait_at_end_s=-1"),
        ({"job": "j", "address": ""}, TypeError, "address=''"),
        ({"job": "j", "timeout": 5}, TypeError, "unknown keyword arguments ['timeout']"),
        ({"job": "j", "rank": 1}, TypeError, "unknown keyword arguments ['rank']"),  # set from the TrainingArguments
        ({"job": "j", "timeout_s": 0}, ValueError, "timeout_s=0"),
    ],
)
def test_bad_arguments_are_refused_at_once(kwargs: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=None) as raised:
        CkptdCallback(**kwargs)
    assert words in str(raised.value)


def test_client_options_pass_through() -> None:
    ckpt = CkptdCallback(job="j", quantize="O1", master_weights="drop", timeout_s=5.0, read_files=False)
    assert ckpt.client_options == ClientOptions(timeout_s=5.0, read_files=False)
    assert (ckpt.quantize, ckpt.master_weights, ckpt.on_error) == ("O1", "drop", "warn")


@pytest.mark.parametrize(
    "more, words",
    [
        ({"save_only_model": True}, "save_only_model=False"),
    ],
)
def test_trainer_settings_it_cannot_take_over_are_refused(tmp_path: Path, more: dict[str, Any], words: str) -> None:
    args = hf.training_args(str(tmp_path / "out"), max_steps=2, save_steps=3, ckptd=True, **more)
    with pytest.raises(ValueError) as raised:
        transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData(), eval_dataset=hf.TokenData(),
                             callbacks=[CkptdCallback(job="j")])
    assert words in str(raised.value)


def test_resume_from_needs_the_trainer_it_belongs_to(tmp_path: Path) -> None:
    args = hf.training_args(str(tmp_path / "out"), max_steps=2, save_steps=3, ckptd=True)
    ckpt = CkptdCallback(job="j")
    with pytest.raises(TypeError, match="resume_from takes the Trainer"):
        ckpt.resume_from(args)  # type: ignore[arg-type]
    trainer = transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData())
    with pytest.raises(ValueError, match="not among the trainer's callbacks"):
        ckpt.resume_from(trainer)
    trainer.add_callback(ckpt)
    with pytest.raises(ValueError, match="step=-1"):
        ckpt.resume_from(trainer, step=-1)


def test_load_best_model_at_end_loads_nothing_when_the_best_evaluation_had_no_save(daemon, tmp_path: Path, one_thread: None) -> None:
    """Found by a probe: evaluated every step, saved every second, the best evaluation at step 1
    (greater_is_better on the loss: the first is the highest). The Trainer's own checkpoints find
    no checkpoint-1 and load nothing; the callback loaded "ckptd step 1", never saved, and under
    on_error="raise" train() failed after all its steps with CheckpointNotFound."""
    ckpt = CkptdCallback(job="hf-best-unsaved", address=daemon.address, on_error="raise")
    args = hf.training_args(str(tmp_path / "out"), max_steps=4, save_steps=2, ckptd=True, eval_strategy="steps", eval_steps=1,
                            metric_for_best_model="loss", greater_is_better=True, load_best_model_at_end=True, per_device_eval_batch_size=8)
    trainer = transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData(), eval_dataset=hf.TokenData(),
                                   callbacks=[ckpt])
    assert ckpt.resume_from(trainer) is None
    last: dict[str, torch.Tensor] = {}

    class Weights(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            last.update({k: v.clone() for k, v in kwargs["model"].state_dict().items()})

    trainer.add_callback(Weights())
    trainer.train(resume_from_checkpoint=None)
    assert trainer.state.best_global_step % 2 == 1, trainer.state.log_history  # the premise: the best step had no save
    assert trainer.state.best_model_checkpoint is None
    assert all(torch.equal(v, last[k]) for k, v in trainer.model.state_dict().items())  # the last step's model, as the Trainer leaves it
