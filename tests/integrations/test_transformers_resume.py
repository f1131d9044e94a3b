"""CkptdCallback and the Trainer's own resume path: `trainer.train(resume_from_checkpoint=True)`
(or a checkpoint-<step> path) resumes ckptd's steps through the pointer directories the
callback keeps in output_dir (ckptd.integrations._hf_pointers); save_total_limit is the job's
retention. Real Trainer on CPU, real daemons, SIGKILL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from on_disk import committed  # tests/on_disk.py
from worker_process import load_worker, run_torchrun_like, run_worker  # tests/worker_process.py

from ckptd.client import CheckpointClient, JobRetention

transformers = pytest.importorskip("transformers")

from ckptd.demo.process import DaemonProcess  # noqa: E402
from ckptd.integrations import _hf_pointers as pointers  # noqa: E402
from ckptd.integrations.transformers import CkptdCallback, job_retention  # noqa: E402

WORKER = Path(__file__).with_name("hf_train.py")
hf = load_worker(WORKER)


@pytest.fixture
def daemon(shared_daemon: DaemonProcess) -> DaemonProcess:
    """The module's tests share one daemon (conftest.shared_daemon): each saves under its own job."""
    return shared_daemon


def _pointer_steps(output_dir: Path) -> list[int]:
    """The checkpoint-<step> directories in output_dir, each checked to hold no weights and nothing pickled."""
    steps = []
    for path in sorted(output_dir.glob("checkpoint-*")):
        names = sorted(p.name for p in path.iterdir())
        assert names == sorted([pointers.EMPTY_SHARD_NAME, pointers.POINTER_FILE, "model.safetensors.index.json", "trainer_state.json"]), names
        assert (path / pointers.EMPTY_SHARD_NAME).stat().st_size < 200  # a safetensors header, no tensor
        steps.append(int(path.name.removeprefix("checkpoint-")))
    return sorted(steps)


# issue 31 item 7
def test_killed_and_resumed_through_resume_from_checkpoint_true(daemon, tmp_path: Path, one_thread: None) -> None:
    """SIGKILLed at step 4 right after step 3 is durable, its pointer removed (as when the kill
    comes before the commit is seen): the Trainer made again publishes it, and
    `train(resume_from_checkpoint=True)` resumes step 3: the losses and log history of steps 4-6
    equal an uninterrupted run's."""
    baseline = json.loads(json.dumps(hf.train({"output_dir": str(tmp_path / "plain"), "max_steps": 6})))
    out_dir = tmp_path / "out"
    spec = {"address": daemon.address, "job": "hf-true", "output_dir": str(out_dir), "max_steps": 6, "save_steps": 3,
            "resume_true": True, "marker": str(tmp_path / "marker"), "out": str(tmp_path / "run.json")}
    first = run_worker(WORKER, {**spec, "kill_at": 4}, killed=True)
    assert json.loads(Path(spec["marker"]).read_text()) == 3 and first["resumed_from"] is None
    assert _pointer_steps(out_dir) in ([], [3])
    shutil.rmtree(out_dir / "checkpoint-3", ignore_errors=True)  # as if killed before the commit was seen: the Trainer made again makes it

    resumed = run_worker(WORKER, spec)
    assert resumed["resumed_from"] == 3  # the pointer get_last_checkpoint found once the Trainer was made
    assert resumed["losses"] == {str(k): baseline["losses"][str(k)] for k in range(4, 7)}
    logs = [e for e in resumed["log_history"] if "loss" in e]
    assert logs == [e for e in baseline["log_history"] if "loss" in e]
    assert _pointer_steps(out_dir) == [3, 6]
    with CheckpointClient("hf-true", address=daemon.address) as ckpt:
        assert ckpt.latest() == 6


# issue 31 item 7 (long: 2 x 2 Trainer processes; the single-rank test above runs the same path by default)
@pytest.mark.long
def test_two_ranks_killed_and_resumed_through_resume_from_checkpoint_true(daemon, tmp_path: Path) -> None:
    """DDP over 2 gloo ranks: both SIGKILLed at step 4 after step 2 is durable, restarted with
    `resume_from_checkpoint=True` (rank 1 waits at on_init_end until rank 0 has synced the
    pointers, so both resume step 2): rank 0's micro-batch losses of steps 3-6 equal an
    uninterrupted 2-rank run's, and so does the log history (the mean over the ranks)."""
    plain = run_torchrun_like(WORKER, {"output_dir": str(tmp_path / "plain"), "max_steps": 6, "out": str(tmp_path / "plain.json")}, 2)
    spec = {"address": daemon.address, "job": "hf-true-ddp", "output_dir": str(tmp_path / "out"), "max_steps": 6, "save_steps": 2,
            "resume_true": True, "marker": str(tmp_path / "marker"), "out": str(tmp_path / "run.json")}
    run_torchrun_like(WORKER, {**spec, "kill_at": 4}, 2, killed=True)
    assert json.loads(Path(spec["marker"]).read_text()) == 2  # step 4's save is made at step 5's beginning
    resumed = run_torchrun_like(WORKER, spec, 2)
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == {str(k): plain["losses"][str(k)] for k in range(3, 7)}
    assert [e for e in resumed["log_history"] if "loss" in e] == [e for e in plain["log_history"] if "loss" in e]
    assert _pointer_steps(tmp_path / "out") == [2, 4, 6]


# issue 31 item 7
def test_save_total_limit_keeps_that_many_steps_and_pointers_and_an_older_pointer_resumes(daemon, tmp_path: Path, one_thread: None) -> None:
    """save_total_limit=2 on a daemon that keeps 3 steps (its default): the job keeps 2 steps, and
    only their pointers stay. Resuming `checkpoint-4` (not the newest) trains steps 5 and 6
    exactly as the first run did."""
    out_dir = tmp_path / "out"
    args = hf.training_args(str(out_dir), max_steps=6, save_steps=2, ckptd=True, save_total_limit=2)
    model = hf.tiny_model()
    record = hf.LossLog(model)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=hf.TokenData(),
                                   callbacks=[CkptdCallback(job="hf-ptr", address=daemon.address, on_error="raise"), _Steps(record)])
    trainer.train()
    assert committed(daemon.root, "hf-ptr") == [4, 6]
    assert _pointer_steps(out_dir) == [4, 6]
    index = json.loads((daemon.root / "hf-ptr" / "step-00000006" / "ckptd.index.json").read_text())
    assert index["retention"]["asked"] == {"keep_last": 2} and index["retention"]["keep_last"] == 2
    (out_dir / "checkpoint-9").mkdir()  # not a pointer: left alone
    shutil.copytree(out_dir / "checkpoint-4", out_dir / "checkpoint-0004")  # a copy under a padded name: not the Trainer's, never pruned for step 4
    state = json.loads((out_dir / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["stateful_callbacks"][pointers.MARKER_KEY]["attributes"] == {"job": "hf-ptr", "step": 4}

    model = hf.tiny_model()
    again = hf.LossLog(model)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=hf.TokenData(),
                                   callbacks=[CkptdCallback(job="hf-ptr", address=daemon.address, on_error="raise"), _Steps(again)])
    trainer.train(resume_from_checkpoint=str(out_dir / "checkpoint-4"))
    assert again.losses == {k: record.losses[k] for k in (5, 6)}
    assert trainer.state.global_step == 6
    assert (out_dir / "checkpoint-9").is_dir() and _pointer_steps_of(out_dir) == [4, 6]
    assert pointers.pointer_steps(str(out_dir), "hf-ptr") == {4: str(out_dir / "checkpoint-4"), 6: str(out_dir / "checkpoint-6")}
    assert (out_dir / "checkpoint-0004").is_dir()


# issue 31 item 7
def test_a_pointer_of_another_job_is_refused(daemon, tmp_path: Path, one_thread: None) -> None:
    out_dir = tmp_path / "out"
    args = hf.training_args(str(out_dir), max_steps=2, save_steps=2, ckptd=True)
    trainer = transformers.Trainer(model=hf.tiny_model(), args=args, train_dataset=hf.TokenData(),
                                   callbacks=[CkptdCallback(job="hf-a", address=daemon.address, on_error="raise")])
    trainer.train()
    other = CkptdCallback(job="hf-b", address=daemon.address, on_error="raise", pointer_dirs=False)
    trainer = transformers.Trainer(model=hf.tiny_model(), args=hf.training_args(str(out_dir), max_steps=4, save_steps=2, ckptd=True),
                                   train_dataset=hf.TokenData(), callbacks=[other])
    with pytest.raises(ValueError, match="pointer to ckptd job 'hf-a', but this CkptdCallback is job 'hf-b'"):
        trainer.train(resume_from_checkpoint=True)


# issue 31 item 7
@pytest.mark.parametrize(
    "more, retention",
    [
        ({}, None),
        ({"save_total_limit": 2}, JobRetention(keep_last=2)),
        ({"save_total_limit": 1, "eval_strategy": "steps", "load_best_model_at_end": True, "metric_for_best_model": "accuracy",
          "greater_is_better": True}, JobRetention(keep_last=1, keep_best=1, best_mode="max")),
        ({"eval_strategy": "steps", "save_strategy": "best", "metric_for_best_model": "loss"}, JobRetention(keep_best=1, best_mode="min")),
    ],
)
def test_the_training_arguments_give_the_jobs_retention(tmp_path: Path, more: dict[str, Any], retention: JobRetention | None) -> None:
    args = hf.training_args(str(tmp_path / "out"), max_steps=2, save_steps=1, ckptd=True, **more)
    assert job_retention(args) == retention


def _pointer_steps_of(output_dir: Path) -> list[int]:
    return sorted(pointers.pointer_steps(str(output_dir), "hf-ptr"))


class _Steps(transformers.TrainerCallback):  # type: ignore[misc]
    """Sets the LossLog's step (as hf_train.py's callback does)."""

    def __init__(self, record: Any) -> None:
        self.record = record

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.record.step = state.global_step + 1

