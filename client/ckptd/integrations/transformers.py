"""Hugging Face Trainer checkpoints through ckptd: `CkptdCallback` (`ckptd[hf]`).

What a user writes beyond their usual Trainer code (three lines):

    from ckptd.integrations.transformers import CkptdCallback

    ckpt = CkptdCallback(job="run-1")            # the daemon: $CKPTD_ADDRESS, or address="unix:///..."
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=ckpt.resume_from(trainer))   # None on the first run: a fresh start
    # or, in a script that restarts the Trainer's way: trainer.train(resume_from_checkpoint=True)

Saving replaces the Trainer's own. Whenever the Trainer decides to save (`save_strategy`,
`save_steps`: DefaultFlowCallback sets `control.should_save`), the callback clears that flag, so
`Trainer._save_checkpoint` never runs: no weights, no `optimizer.pt`, `rng_state.pth` or any
other pickled file in output_dir, whose `checkpoint-<step>` directories are pointers (below). It hands the checkpoint to ckptd instead, as step
`state.global_step`, collectively on every rank (as `CheckpointClient.save` wants):

    "model"          the model (weights as safetensors; the step directory loads with from_pretrained)
    "optimizer"      the optimizer state, keyed by parameter name (Accelerate's wrapper taken off)
    "scheduler"      the LR scheduler's state_dict
    "scaler"         the GradScaler's state_dict, when mixed precision has one
    "trainer_state"  the TrainerState as the Trainer's trainer_state.json holds it (global_step,
                     epoch, log_history, best_metric, the states of stateful callbacks, ...)
    "ckptd_trainer"  where in the loop the save was made and the arguments that count batches
    RNG              rng=True: torch (CPU and CUDA), Python and NumPy generators of every rank

The save is made at the next point where the loop stands between two optimizer steps: the next
step's `on_step_begin` (once its batches are fetched), the next epoch's `on_epoch_begin`, or
`on_train_end`. By then the step's logging and evaluation are done, so the trainer state holds
what the Trainer's own checkpoint would (the step's log entry, best_metric), and the random
generators are saved where a resumed run restores them (below). The step's evaluation metric
(`metric_for_best_model`, or `metric=`) goes to ckptd as the checkpoint's metric, for the
daemon's keep-best retention (`--keep-best N --best-mode min|max`: match `greater_is_better`).

Resuming uses the Trainer's own resume path, which is the only one that fast-forwards the data
(it skips the trained epochs and batches, counted from `global_step`). `resume_from(trainer)`
asks ckptd for the newest committed step (or `step=`) and writes a small directory for
`train(resume_from_checkpoint=...)`, `output_dir/.ckptd-resume-rank<N>` (removed at the end of
training, replaced by the next resume): the checkpoint's `trainer_state.json` (JSON, from ckptd)
and a weights index whose shard holds no tensor, so the Trainer's own weight loading, which runs
before the optimizer exists, loads nothing. Then:

- the Trainer restores the TrainerState (global_step, epoch, log history, best metric, stateful
  callbacks) from that file and skips the batches already trained;
- it finds no optimizer.pt, scheduler.pt, scaler.pt or rng_state.pth there and loads none;
- `on_train_begin` (the optimizer and scheduler exist by then) loads the model, optimizer,
  scheduler and scaler from ckptd, in place;
- the random generators are restored at the point where the interrupted run saved them: the
  first `on_step_begin` (after the resumed epoch's skipped and first batches were fetched: where
  the Trainer itself would load rng_state.pth) or the first `on_epoch_begin`.

resume_from_checkpoint=True (or "<output_dir>/checkpoint-<step>"): the Trainer reads
output_dir/checkpoint-<step> before any callback event of train(). The callback keeps there one
pointer directory per committed step the job keeps (ckptd.integrations._hf_pointers: the step's
trainer_state.json marked with the ckptd step, the tensorless weights index; published once the
daemon lists the step as committed, the newest committed step's made when the Trainer is made,
removed with retention); on_train_begin reads the marker and loads that step as above.

So the losses after a resume equal those of an uninterrupted run, bit for bit on a deterministic
device (tests/integrations/test_transformers.py).

save_strategy="best": the Trainer decides that save after the last callback event
(`_determine_best_metric`: a metric strictly better than `state.best_metric`). `on_evaluate`
makes the same decision by the same rule and records the new best in the TrainerState as the
Trainer would (best_metric, best_global_step); the Trainer then finds no improvement and does not
save, and ckptd saves the step, with its metric. load_best_model_at_end: the Trainer finds no
`checkpoint-*` directory (`best_model_checkpoint` stays None) and loads nothing; `on_train_end`,
after the last save is durable, loads the model of ckptd step `best_global_step` and sets
`best_model_checkpoint` to its directory; when that step had no save (evaluated between saves),
nothing is loaded, as the Trainer does. Retention is the job's own (`job_retention`, sent with
every save, within the daemon's flags, which bound it): `save_total_limit` keeps that many steps,
and load_best_model_at_end / save_strategy="best" keep the best one (keep-best 1).

FSDP2 (fsdp_config={"fsdp_version": 2, ...}): the model's parameters and the optimizer's states are
DTensors; each rank hands its own shards (no gather, no collective in the save) and a checkpoint
resumes in another world size (tests/integrations/test_transformers.py).

Failures: with on_error="warn" (default) a daemon that is down or a save that fails is logged and
training goes on (`last_save.ok` is False); `resume_from` logs that the daemon cannot be reached
and returns None (a fresh start); a best model that cannot be loaded is logged and the model
stays the last step's. A state that can never be saved, and a checkpoint that cannot be loaded
into this model, raise. Not supported (refused with the reason when the Trainer is made):
save_only_model, DeepSpeed, and resuming PEFT models (the Trainer's resume path then loads
adapter files: see ckptd.integrations.peft). `on_save` of other callbacks is never called, since
the Trainer's save does not run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy

from ckptd.client import CheckpointClient, CheckpointError, CheckpointInfo, ClientOptions, DaemonUnavailable, JobRetention, SaveHandle
from ckptd.client.options import options_from_keywords
from ckptd.common.names import check_job_id
from ckptd.common.quant_options import check_master_mode, check_scheme
from ckptd.integrations import _hf_pointers as pointers
from ckptd.integrations._hf_pointers import EMPTY_SHARD_NAME
from ckptd.offline import open_step

__all__ = ["CkptdCallback", "EMPTY_SHARD_NAME", "RESUME_DIR_PREFIX"]

log = logging.getLogger("ckptd.integrations.transformers")

TRAINER_STATE_KEY = "trainer_state"
POSITION_KEY = "ckptd_trainer"
RESUME_DIR_PREFIX = ".ckptd-resume-rank"  # + the rank: the resume directory, in output_dir

# Where a save was made, and so where a resumed run restores the random generators.
AT_STEP = "step"  # on_step_begin of the next step, its batches fetched
AT_EPOCH = "epoch"  # on_epoch_begin of the next epoch, before its data iterator is made
AT_END = "end"  # on_train_end

# The arguments that decide how the Trainer counts and orders batches: the position in the data
# that global_step stands for changes with any of them.
DATA_ARGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "seed", "data_seed",
             "dataloader_drop_last", "train_sampling_strategy", "ignore_data_skip")

# CheckpointClient keywords that the callback sets itself (from the TrainingArguments).
_OWN_CLIENT_ARGS = ("rank", "world_size", "retention")


@dataclass(frozen=True)
class _Resume:
    """The checkpoint a run resumes from: its step, where its generators were saved, the directory given to the Trainer."""

    step: int
    global_step: int
    rng_at: str
    directory: str | None  # resume_from's directory (removed at the end of training); None: a pointer directory (kept)


class CkptdCallback(TrainerCallback):
    """A TrainerCallback that makes the Trainer's checkpoints ckptd checkpoints (see the module docstring).

    job: the run's ckptd job id (1-128 of A-Z a-z 0-9 . _ -). address: the daemon,
    "unix:///path.sock" (default: $CKPTD_ADDRESS, else the default socket). on_error: "warn"
    (default: a failed save is logged, training goes on) or "raise". metric: the evaluation
    metric given to ckptd with each save made at an evaluated step (default: the Trainer's
    `metric_for_best_model`; the "eval_" prefix is added as the Trainer does). quantize,
    master_weights: passed to every `CheckpointClient.save` (None: the daemon's defaults).
    wait_at_end_s: seconds `on_train_end` waits for the last checkpoint to be committed (None:
    it does not wait). pointer_dirs: keep an output_dir/checkpoint-<step> pointer directory
    (no weights) for every committed step the daemon keeps, so that
    `trainer.train(resume_from_checkpoint=True)` resumes the newest (ckptd.integrations._hf_pointers).
    client_options: other `CheckpointClient` keywords (mode, timeout_s,
    read_files, local_world_size, ...), kept with address and on_error as `client_options`, a
    ckptd.client.ClientOptions checked here. Rank, world size and retention come from the TrainingArguments.
    Raises ValueError/TypeError at once for arguments that cannot work.
    """

    def __init__(
        self,
        job: str,
        *,
        address: str | None = None,
        on_error: str = "warn",
        metric: str | None = None,
        quantize: str | None = None,
        master_weights: str | None = None,
        wait_at_end_s: float | None = 600.0,
        pointer_dirs: bool = True,
        **client_options: Any,
    ) -> None:
        self.job = check_job_id(job)
        if address is not None and (not isinstance(address, str) or not address):
            raise TypeError(f"address={address!r}: pass the daemon's address as a string, e.g. 'unix:///run/ckptd/ckptd.sock', or None for $CKPTD_ADDRESS")
        options = options_from_keywords("CkptdCallback", client_options, _OWN_CLIENT_ARGS, address=address, on_error=on_error)
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise TypeError(f"metric={metric!r}: name an evaluation metric such as 'eval_loss', or None for the Trainer's metric_for_best_model")
        if quantize != "none":
            check_scheme(quantize)
        check_master_mode(master_weights)
        if wait_at_end_s is not None and (isinstance(wait_at_end_s, bool) or not isinstance(wait_at_end_s, (int, float)) or wait_at_end_s < 0):
            raise ValueError(f"wait_at_end_s={wait_at_end_s!r}: seconds >= 0, or None not to wait for the last checkpoint")
        if not isinstance(pointer_dirs, bool):
            raise TypeError(f"pointer_dirs={pointer_dirs!r}: True (checkpoint-<step> pointers in output_dir, for resume_from_checkpoint=True) or False")
        self.address = address
        self.on_error = on_error
        self.metric = metric
        self.quantize = quantize
        self.master_weights = master_weights
        self.wait_at_end_s = wait_at_end_s
        self.pointer_dirs = pointer_dirs
        self.client_options: ClientOptions = options  # rank, world_size and retention are set from the TrainingArguments
        self._ckpt: CheckpointClient | None = None
        self._trainer: Trainer | None = None
        self._metric_key: str | None = None
        self._metric_seen: tuple[int, float] | None = None  # (global_step, value) of the latest evaluation
        self._pending = False  # the Trainer asked for a save that has not been made yet
        self._resume: _Resume | None = None
        self._rng_due: str | None = None  # AT_STEP/AT_EPOCH: restore the generators at that hook
        self._last: SaveHandle | None = None
        self._warned_no_trainer = False
        self._training = False  # between on_train_begin and on_train_end
        self._best_saved: int | None = None  # the newest step saved while it was state.best_global_step
        self._resumed = False  # this run resumed from a step of the job (state.best_global_step may be an earlier run's save)
        self._model_keys: list[str] = []  # the model's state_dict keys (a pointer's weights index), from on_init_end
        self._unpublished: dict[int, dict[str, Any]] = {}  # step -> trainer state tree: saved, pointer not yet published

    @property
    def last_save(self) -> SaveHandle | None:
        """The handle of the last save (`ok`, `stall_s`, `wait_durable()`), or None. on_train_end
        waits for it (wait_at_end_s) and closes the client: wait_durable() works until then."""
        return self._last

    # ------------------------------------------------------------ resume

    def resume_from(self, trainer: Trainer, step: int | None = None) -> str | None:
        """The directory to pass as `trainer.train(resume_from_checkpoint=...)`, or None to start fresh.

        Looks up the job's newest committed checkpoint (or `step`) and writes the Trainer's part
        of it (trainer_state.json and a tensorless weights index) to output_dir/.ckptd-resume-rank<N>; the
        rest is loaded from ckptd during `train` (module docstring). Returns None when the job
        has no checkpoint, and, with on_error="warn", when the daemon cannot be reached (logged).
        Also gives the callback the trainer, whose GradScaler and stateful callbacks are saved
        with each checkpoint: call it on every run, the first included. Every rank calls it.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step={step!r}: a committed step (an integer >= 0), or None for the newest")
        self.attach(trainer, what="resume_from")
        model = trainer.model
        if model is None:
            raise ValueError("the trainer has no model yet: make it with Trainer(model=...) (or model_init) before resume_from")
        if _is_peft(model):
            raise ValueError(
                "CkptdCallback cannot resume a PEFT model through the Trainer (its resume path loads adapter files); "
                "save and load the adapter with ckptd.integrations.peft.adapter_state instead"
            )
        if self._resume is not None and self._resume.directory is not None:
            shutil.rmtree(self._resume.directory, ignore_errors=True)
        self._resume = None
        found: dict[str, Any] = {TRAINER_STATE_KEY: {}, POSITION_KEY: {}}
        try:
            loaded = self._client(trainer.args).load(found, step=step)
        except DaemonUnavailable as exc:
            if self.on_error == "raise":
                raise
            log.warning("cannot reach the ckptd daemon, so training starts from the beginning: %s", exc)
            return None
        if loaded is None:
            return None
        position = found[POSITION_KEY]
        _warn_on_changed_data_args(position.get("data_args", {}), trainer.args)
        trainer_state = found[TRAINER_STATE_KEY]
        if trainer.args.output_dir is None:
            raise ValueError("TrainingArguments.output_dir is None: CkptdCallback writes the resume directory there; set it")
        directory = os.path.join(trainer.args.output_dir, f"{RESUME_DIR_PREFIX}{trainer.args.process_index}")
        pointers.write_resume_dir(directory, self.job, loaded, trainer_state, model.state_dict().keys())
        self._resume = _Resume(loaded, int(trainer_state["global_step"]), str(position["at"]), directory)
        self._resumed = True
        log.info("resuming job %s from ckptd step %d (global step %d)", self.job, loaded, self._resume.global_step)
        return directory

    def attach(self, trainer: Trainer, what: str = "attach") -> None:
        """Give the callback its trainer, so that each checkpoint holds the current state of the
        trainer's stateful callbacks (EarlyStoppingCallback, ...; else the state they had when the
        Trainer was made) and the GradScaler. resume_from does it; with
        `train(resume_from_checkpoint=True)` call it before train when such callbacks are used."""
        if not isinstance(trainer, Trainer):
            raise TypeError(f"{what} takes the Trainer this callback belongs to, got {type(trainer).__name__}")
        if self not in trainer.callback_handler.callbacks:
            raise ValueError("this CkptdCallback is not among the trainer's callbacks: pass it as Trainer(..., callbacks=[ckpt])")
        self._trainer = trainer

    # ------------------------------------------------------------ Trainer events

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        _check_training_args(args)
        key = self.metric if self.metric is not None else args.metric_for_best_model
        self._metric_key = None if key is None else key if key.startswith("eval_") else f"eval_{key}"
        model = kwargs.get("model")
        if model is not None and _is_peft(model):
            raise ValueError(
                "CkptdCallback cannot checkpoint a PEFT model through the Trainer: neither resume path could use its "
                "checkpoints (the Trainer's loads adapter files); save and load the adapter with "
                "ckptd.integrations.peft.adapter_state in your own loop (docs/integrations/peft.md)"
            )
        self._model_keys = list(model.state_dict().keys()) if model is not None else []
        if self.pointer_dirs:
            # the other ranks wait (a barrier) until the pointers are synced: then every rank's train() finds the same newest one
            with args.main_process_first(local=args.save_on_each_node, desc="ckptd checkpoint-<step> pointers"):
                self._sync_pointers(args)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._pending = False
        self._rng_due = None
        self._training = True
        resume = self._resume
        if resume is None:
            self._resume_pointed(args, state, kwargs)
            return
        if state.global_step != resume.global_step:
            raise ValueError(
                f"the Trainer starts at global step {state.global_step}, the ckptd checkpoint it should resume is at "
                f"{resume.global_step}: pass trainer.train(resume_from_checkpoint=ckpt.resume_from(trainer))"
            )
        self._client(args).load(self._state(kwargs), step=resume.step)
        self._rng_due = AT_STEP if resume.rng_at == AT_STEP else AT_EPOCH

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._save_if_pending(args, state, control, kwargs, AT_EPOCH)
        if self._rng_due == AT_EPOCH:
            self._restore_rng(args)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._save_if_pending(args, state, control, kwargs, AT_STEP)
        if self._rng_due == AT_STEP:
            self._restore_rng(args)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._take_over_save(control)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._take_over_save(control)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        metrics = kwargs.get("metrics") or {}
        if self._metric_key is not None and isinstance(metrics.get(self._metric_key), (int, float)):
            self._metric_seen = (state.global_step, float(metrics[self._metric_key]))
        if self._training and args.save_strategy == SaveStrategy.BEST:
            self._take_over_best(args, state, metrics)
        self._take_over_save(control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._take_over_save(control)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._take_over_save(control)
        self._save_if_pending(args, state, control, kwargs, AT_END)
        self._training = False
        last = self._last
        if last is not None and last.ok and self.wait_at_end_s is not None:
            last.wait_durable(timeout=self.wait_at_end_s)
        self._publish_pointers(args)
        if args.load_best_model_at_end and state.best_global_step:
            self._load_best_model(args, state, kwargs.get("model"))
        if self._resume is not None and self._resume.directory is not None:
            shutil.rmtree(self._resume.directory, ignore_errors=True)
        self._resume = None
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None

    # ------------------------------------------------------------ pointer directories (resume_from_checkpoint=True)

    def _resume_pointed(self, args: TrainingArguments, state: TrainerState, objects: Mapping[str, Any]) -> None:
        """on_train_begin of a run the Trainer resumed from a pointer directory (its
        trainer_state.json names the ckptd step): load that step's model, optimizer, scheduler
        and scaler in place and restore the generators where they were saved, as for resume_from."""
        step = pointers.marked_step(state.stateful_callbacks if isinstance(state.stateful_callbacks, dict) else None, self.job)
        if step is None:
            return  # a fresh start, or a Trainer checkpoint of its own
        if step != state.global_step:
            raise ValueError(f"the pointer to ckptd step {step} has a trainer_state.json at global step {state.global_step}: "
                             "it was changed by hand; remove it, CkptdCallback makes it again from the daemon")
        found = {**self._state(objects), POSITION_KEY: {}}
        self._client(args).load(found, step=step)
        position = found[POSITION_KEY]
        _warn_on_changed_data_args(position.get("data_args", {}), args)
        self._resume = _Resume(step, step, str(position["at"]), None)
        self._resumed = True
        self._rng_due = AT_STEP if self._resume.rng_at == AT_STEP else AT_EPOCH
        log.info("resuming job %s from ckptd step %d (the Trainer's resume_from_checkpoint)", self.job, step)

    def _pointer_dir(self, args: TrainingArguments) -> str | None:
        """output_dir when this process keeps the pointer directories: the one that writes the
        Trainer's own checkpoints (process 0; with save_on_each_node, each node's local process 0)."""
        return args.output_dir if self.pointer_dirs and args.should_save else None

    def _publish_pointers(self, args: TrainingArguments) -> None:
        """Publish the pointers of this run's saves that the daemon committed since, and remove
        those of steps it no longer keeps. A save not (yet) committed gets none. Called after each
        save and at the end of training (one listing per save, none per step); a run killed
        before gets the pointer of its newest committed step when its Trainer is made again."""
        output_dir = self._pointer_dir(args)
        if not self._unpublished or output_dir is None:
            return
        infos = self._committed(args)
        if infos is None:
            return
        committed = [info.step for info in infos]
        listed = set(committed)
        done = [step for step in self._unpublished if step in listed]
        for step in done:
            pointers.publish(output_dir, self.job, step, self._unpublished[step], self._model_keys)
        newest = max(done, default=-1)  # an older save still unlisted failed or was removed: it never gets one
        self._unpublished = {step: tree for step, tree in self._unpublished.items() if step > newest and step not in listed}
        pointers.prune(output_dir, self.job, committed)

    def _sync_pointers(self, args: TrainingArguments) -> None:
        """When the Trainer is made (before train looks for checkpoint-* directories): the pointer
        of the job's newest committed step (the last save of a killed run may have been
        committed after the kill), read from its files; pointers of removed steps go."""
        output_dir = self._pointer_dir(args)
        if output_dir is None:
            return
        infos = self._committed(args)
        if infos is None:
            return
        newest = infos[-1] if infos else None
        if newest is not None and newest.step not in pointers.pointer_steps(output_dir, self.job):
            try:
                tree = open_step(newest.path).extras(0).get(TRAINER_STATE_KEY)
            except (CheckpointError, OSError) as exc:
                tree = None
                log.warning("cannot read the trainer state of ckptd step %d at %s (%s): resume_from_checkpoint=True will not find it; "
                            "use trainer.train(resume_from_checkpoint=ckpt.resume_from(trainer))", newest.step, newest.path, exc)
            if isinstance(tree, dict):
                pointers.publish(output_dir, self.job, newest.step, tree, self._model_keys)
        pointers.prune(output_dir, self.job, [info.step for info in infos])

    def _committed(self, args: TrainingArguments) -> list[CheckpointInfo] | None:
        """The job's committed steps in commit order, or None (logged) when the daemon cannot say."""
        try:
            return self._client(args).list()
        except CheckpointError as exc:
            log.warning("cannot list the ckptd job's steps, so its checkpoint-* pointers in %s are not updated: %s", args.output_dir, exc)
            return None

    # ------------------------------------------------------------ internals

    def _take_over_best(self, args: TrainingArguments, state: TrainerState, metrics: Mapping[str, Any]) -> None:
        """save_strategy="best": the Trainer decides to save after the last callback event
        (Trainer._determine_best_metric: a metric strictly better than state.best_metric). Make
        that decision here, by the same rule, and record the new best as it would; it then finds
        no improvement, so its own save does not run, and ckptd saves the step instead."""
        key = args.metric_for_best_model
        if key is None:
            return  # the Trainer refuses save_strategy="best" without it
        value = metrics.get(key if key.startswith("eval_") else f"eval_{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return  # the Trainer raises KeyError naming the metrics it got
        best = state.best_metric
        if best is None or (value > best if args.greater_is_better else value < best):
            state.best_metric = float(value)
            state.best_global_step = state.global_step
            self._pending = True

    def _load_best_model(self, args: TrainingArguments, state: TrainerState, model: torch.nn.Module | None) -> None:
        """load_best_model_at_end: the model's weights of the newest step saved while it was the
        best (as the Trainer's best_model_checkpoint: the best evaluated step may have had no save),
        else, in a run resumed since, of state.best_global_step if the job has that step. Nothing
        is loaded when no saved step was the best (the best evaluation fell between saves), as the
        Trainer does then. The Trainer's own _load_best_model finds no checkpoint-* directory and
        does not run."""
        if model is None:
            raise ValueError("the Trainer passed no model to CkptdCallback.on_train_end: it cannot load the best model")
        step = self._best_saved
        if step is None and self._resumed and state.best_global_step:
            committed = {info.step for info in self._client(args).list()}
            step = state.best_global_step if state.best_global_step in committed else None
        if step is None:
            log.info("load_best_model_at_end: the best evaluation (global step %s, %s %s) has no save; the model stays the "
                     "last step's, as with the Trainer's own checkpoints", state.best_global_step, args.metric_for_best_model, state.best_metric)
            return
        try:
            self._client(args).load({"model": model}, step=step)
        except CheckpointError as exc:  # not found (retention removed it, or no save at that step), daemon down
            if self.on_error == "raise":
                raise
            log.error("load_best_model_at_end: could not load the model of ckptd step %d (best %s %s), so the model is "
                      "the last step's; keep best steps with the daemon's --keep-best N --best-mode %s: %s",
                      step, args.metric_for_best_model, state.best_metric, "max" if args.greater_is_better else "min", exc)
            return
        state.best_model_checkpoint = next((info.path for info in self._client(args).list() if info.step == step), None)
        log.info("loaded the best model: ckptd step %d (%s %s)", step, args.metric_for_best_model, state.best_metric)

    def _take_over_save(self, control: TrainerControl) -> None:
        """The Trainer wants a checkpoint: ckptd makes it (at the next step, epoch or end), the Trainer not."""
        if control.should_save:
            control.should_save = False
            self._pending = True

    def _save_if_pending(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, objects: Mapping[str, Any], at: str) -> None:
        if not self._pending:
            return
        self._pending = False
        step = state.global_step
        if self._last is not None and self._last.step == step and self._last.ok:
            return  # already saved at this step (e.g. a step save followed by an epoch save)
        others = sorted({str(name) for name in state.stateful_callbacks or {}} - {"TrainerControl", pointers.MARKER_KEY})
        if self._trainer is None and others and not self._warned_no_trainer:
            self._warned_no_trainer = True
            log.warning("CkptdCallback does not know the trainer, so checkpoints hold the state that the stateful callbacks %s had "
                        "when the Trainer was made; call ckpt.attach(trainer) (or ckpt.resume_from(trainer)) before trainer.train()", others)
        saved = self._state(objects)
        saved[TRAINER_STATE_KEY] = _trainer_state_tree(state, self._exportable(control))
        saved[POSITION_KEY] = {"at": at, "data_args": _data_args(args)}
        metric = self._metric_seen[1] if self._metric_seen is not None and self._metric_seen[0] == step else None
        self._last = self._client(args).save(
            step, saved, metric=metric, quantize=self.quantize, master_weights=self.master_weights, rng=True
        )
        if self._last.ok and state.best_global_step == step:
            self._best_saved = step
        if self._last.ok and self._pointer_dir(args) is not None:
            self._unpublished[step] = saved[TRAINER_STATE_KEY]
            self._publish_pointers(args)  # the earlier saves' pointers, committed by now

    def _restore_rng(self, args: TrainingArguments) -> None:
        """Set the random generators to the checkpoint's, at the point of the loop where they were saved."""
        self._rng_due = None
        if self._resume is not None:  # set whenever _rng_due is
            self._client(args).load({POSITION_KEY: {}}, step=self._resume.step, rng=True)

    def _state(self, objects: Mapping[str, Any]) -> dict[str, Any]:
        """The model, optimizer, scheduler (and scaler) that the Trainer handed to the callback event."""
        model, optimizer, scheduler = objects.get("model"), objects.get("optimizer"), objects.get("lr_scheduler")
        if model is None or optimizer is None or scheduler is None:
            raise ValueError("the Trainer passed no model, optimizer or lr_scheduler to CkptdCallback: it needs all three")
        # Accelerate hands its GradScaler to the optimizer wrapper too: found without the trainer
        scaler = getattr(self._trainer.accelerator, "scaler", None) if self._trainer is not None else getattr(objects.get("optimizer"), "scaler", None)
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def _exportable(self, control: TrainerControl) -> list[ExportableState]:
        """The callbacks whose state the Trainer keeps in TrainerState.stateful_callbacks, and the control."""
        callbacks = self._trainer.callback_handler.callbacks if self._trainer is not None else []
        return [cb for cb in [*callbacks, control] if isinstance(cb, ExportableState)]

    def _client(self, args: TrainingArguments) -> CheckpointClient:
        if self._ckpt is None:
            options = dataclasses.replace(self.client_options, rank=args.process_index, world_size=args.world_size, retention=job_retention(args))
            self._ckpt = CheckpointClient(self.job, options=options)
        return self._ckpt


def job_retention(args: TrainingArguments) -> JobRetention | None:
    """The job's retention that the TrainingArguments ask for, sent with every save (the daemon
    applies it within its own flags, which bound it): save_total_limit -> keep_last;
    load_best_model_at_end or save_strategy="best" -> keep_best 1, best_mode by greater_is_better.
    None when they ask for neither (the daemon's flags)."""
    best = args.load_best_model_at_end or args.save_strategy == SaveStrategy.BEST
    if not args.save_total_limit and not best:
        return None
    return JobRetention(
        keep_last=args.save_total_limit or None,
        keep_best=1 if best else None,
        best_mode=("max" if args.greater_is_better else "min") if best else None,
    )


def _check_training_args(args: TrainingArguments) -> None:
    """Refuse, with the reason, the TrainingArguments whose checkpoints the callback cannot take over."""
    if args.save_only_model:
        raise ValueError("CkptdCallback saves the whole training state; set save_only_model=False")
    if args.deepspeed is not None:
        raise ValueError("CkptdCallback does not support DeepSpeed, whose engine saves its own state")


def _trainer_state_tree(state: TrainerState, exportable: Iterable[ExportableState]) -> dict[str, Any]:
    """The TrainerState as trainer_state.json holds it, with the current states of the stateful callbacks
    (as Trainer._save_checkpoint records them; several callbacks of one class become a list)."""
    tree = dataclasses.asdict(state)
    current: dict[str, Any] = {}
    for callback in exportable:
        name = type(callback).__name__
        if name in current:
            before = current[name]
            current[name] = [*(before if isinstance(before, list) else [before]), callback.state()]
        else:
            current[name] = callback.state()
    earlier = {k: v for k, v in (tree.get("stateful_callbacks") or {}).items() if k != pointers.MARKER_KEY}  # a pointer's marker: not state
    tree["stateful_callbacks"] = {**earlier, **current}
    return tree


def _data_args(args: TrainingArguments) -> dict[str, Any]:
    return {name: _json_value(getattr(args, name, None)) for name in DATA_ARGS}


def _json_value(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _warn_on_changed_data_args(saved: Mapping[str, Any], args: TrainingArguments) -> None:
    now = _data_args(args)
    changed = [f"{name} {saved[name]!r} -> {now[name]!r}" for name in DATA_ARGS if name in saved and saved[name] != now[name]]
    if changed:
        log.warning("the Trainer skips the trained batches by global_step, but these arguments changed since the checkpoint, "
                    "so the data after the resume is not where the run stopped: %s", ", ".join(changed))


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "load_adapter", None))
