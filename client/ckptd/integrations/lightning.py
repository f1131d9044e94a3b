"""PyTorch Lightning checkpoints through ckptd: `CkptdCheckpointIO`, a Lightning CheckpointIO plugin.

    from ckptd.integrations.lightning import CkptdCheckpointIO
    trainer = lightning.Trainer(plugins=[CkptdCheckpointIO(job="run-42")], callbacks=[ModelCheckpoint(...)])

Lightning builds a checkpoint dict and calls `save_checkpoint(checkpoint, path)`; this plugin
hands the dict to the node's ckptd daemon as step checkpoint["global_step"] of its job and
returns (the daemon writes in the background). Tensors travel as tensors (safetensors), every
other value as JSON; nothing is pickled (the mapping: ckptd.integrations._lightning_state).
At `path` it leaves a small JSON pointer naming the job and step, written once the step is
durable (ckptd.integrations._lightning_pointer). `load_checkpoint(path)` reads the pointer and
loads the step back into the dict Lightning expects; `remove_checkpoint(path)` removes the
pointer. So ModelCheckpoint (top-k, save_last), `trainer.fit(ckpt_path=...)` and
`ckpt_path="last"` work as with Lightning's own files. docs/integrations/lightning.md has the
details and the limits.

Strategies: one process, or DDP (several processes that each hold the whole model). Under DDP
Lightning calls save_checkpoint and remove_checkpoint on global rank 0 only, with the whole
(replicated) state, and load_checkpoint on every rank. So global rank 0 saves as the only rank
of a job of one rank, and every rank loads the step back on its own (ckptd's loads are per
rank; a rank the step was not saved by gets rank 0's extras). DDP started by multiprocessing
(ddp_spawn, ddp_fork, ddp_notebook) works alike: a copy of the plugin carries only its
configuration, and the trained weights its launcher hands back to the main process through the
plugin go to a safetensors file, not to the daemon (ckptd.integrations._lightning_handback).
Lightning's sharding strategies (FSDP, ModelParallel) save and load without the CheckpointIO:
their subclasses CkptdModelParallelStrategy and CkptdFSDPStrategy
(ckptd.integrations._lightning_sharded) call save_shards / load_shards on every rank instead,
each rank handing over and loading its own shards. DeepSpeed saves without it too: its subclass
CkptdDeepSpeedStrategy (ckptd.integrations._lightning_deepspeed) calls save_engine / load_engine
on every rank, each handing over its ZeRO partitions through ckptd.integrations.deepspeed.
The random generators are saved with every step and restored when a fit resumes (rng=True).
CkptdLoadFromCheckpoint lets LightningModule.load_from_checkpoint read a pointer.

Needs the `lightning` package (`pip install 'ckptd[lightning]'`); the rest of ckptd does not.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Callable, ClassVar

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import LightningModule
from lightning.pytorch.core.saving import _load_state
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

from ckptd.client import CheckpointClient, ClientOptions, rank_and_world
from ckptd.client.errors import CheckpointError, CheckpointNotFound
from ckptd.client.handle import SaveHandle
from ckptd.client.run_id import new_run_id
from ckptd.common.names import check_job_id
from ckptd.common.quant_options import check_scheme
from ckptd.integrations._lightning_caller import check_saver, find_caller, is_last_checkpoint, resuming_fit
from ckptd.integrations._lightning_deepspeed import CkptdDeepSpeedStrategy
from ckptd.integrations._lightning_handback import read_weights, write_weights
from ckptd.integrations._lightning_pointer import Pointer, PointerWriter, local_path, read_pointer, restore_missing_pointer
from ckptd.integrations._lightning_sharded import CkptdFSDPStrategy, CkptdModelParallelStrategy
from ckptd.integrations._lightning_state import (
    LAYOUT,
    PARTS,
    MapLocation,
    Mapped,
    SameStep,
    assemble,
    decode_parts,
    layout_of,
    parts_lacking,
    global_step_of,
    map_tensors,
    monitored_metric,
    templates,
    to_state,
)

__all__ = ["CkptdCheckpointIO", "CkptdDeepSpeedStrategy", "CkptdFSDPStrategy", "CkptdLoadFromCheckpoint", "CkptdModelParallelStrategy"]

log = logging.getLogger("ckptd.integrations.lightning")

# What a copy of the plugin keeps (__getstate__): the arguments of its constructor.
_CONFIG = ("job", "address", "on_error", "quantize", "durable_timeout_s", "timeout_s", "rng")

# How a save hands a mapped checkpoint over: (client, step, state, metric) -> the client's handle;
# how a load fills the state to load into: (client, state, step). None: CheckpointClient's own.
HandOver = Callable[[CheckpointClient, int, dict[str, Any], "float | None"], SaveHandle]
Fill = Callable[[CheckpointClient, dict[str, Any], int], None]


class CkptdCheckpointIO(CheckpointIO):
    """A Lightning CheckpointIO that saves through ckptd: `Trainer(plugins=[CkptdCheckpointIO(job="run-42")])`.

    job: the ckptd job the checkpoints are saved to (a checkpoint is step
    checkpoint["global_step"] of it). address: the daemon ("unix:///path.sock"; default
    $CKPTD_ADDRESS, else the default socket). on_error: "warn" (default: a save the daemon
    cannot take is logged, training goes on, and no pointer appears at its path) or "raise".
    quantize: None (the daemon's default), "none", "O1" or "O2" (ckptd's compression of Adam
    moments). durable_timeout_s: how long a pointer waits for its step to be durable.
    timeout_s: the client's wait for the daemon on a save or load. rng: save this process's
    random generators with every step, and restore them when a fit resumes.

    Strategies (see the module docstring): one process or DDP (also started by
    multiprocessing): global rank 0 saves, every rank loads; CkptdModelParallelStrategy and
    CkptdFSDPStrategy: every rank saves and loads its shards (save_shards, load_shards);
    CkptdDeepSpeedStrategy: every rank its ZeRO partitions (save_engine, load_engine). A save
    from Lightning's own sharding strategies (FSDP, ModelParallel, DeepSpeed), or through
    save_checkpoint on another rank, is refused.
    CUDA tensors are handed over in ckptd's mode "copy": save_checkpoint returns once they are
    in host memory, since this plugin sees tensors, not the optimizer whose step would fence an
    overlapped copy.
    """

    def __init__(
        self,
        job: str,
        *,
        address: str | None = None,
        on_error: str = "warn",
        quantize: str | None = None,
        durable_timeout_s: float = 600.0,
        timeout_s: float = 600.0,
        rng: bool = True,
    ) -> None:
        super().__init__()
        self.job = check_job_id(job)
        if quantize != "none":
            check_scheme(quantize)
        if not durable_timeout_s > 0 or not timeout_s > 0:
            raise ValueError(f"durable_timeout_s={durable_timeout_s!r} and timeout_s={timeout_s!r} must be > 0 seconds")
        # every client of the plugin: CUDA tensors in mode "copy" (see above); rank and world size per client
        self._options = ClientOptions(address=address, mode="copy", on_error=on_error, timeout_s=float(timeout_s))
        self.address = address
        self.on_error = on_error
        self.quantize = quantize
        self.durable_timeout_s = float(durable_timeout_s)
        self.timeout_s = float(timeout_s)
        self.rng = bool(rng)
        self._client: CheckpointClient | None = None  # saves (a job of one rank), and loads on global rank 0
        self._reader: CheckpointClient | None = None  # loads on the other ranks of a run of several processes
        self._writer = PointerWriter()
        # the step handed over last and whether it became durable: a later save of the same
        # global_step reuses it (kept across teardown: trainer.save_checkpoint after fit)
        self._last: tuple[SameStep, _Durable] | None = None
        self._loaded: tuple[str, int, str | None] | None = None  # (job, step, the file it was saved to) of the last load
        self._pid = os.getpid()  # the process the connections and the pointer writer's thread belong to

    def __getstate__(self) -> dict[str, Any]:
        """The plugin's configuration only (strategy="ddp_spawn" pickles the Trainer with its
        plugins into each new process): a copy connects to the daemon when it first needs to
        and has no pointers pending."""
        return {name: getattr(self, name) for name in _CONFIG}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("job"), **state)  # type: ignore[misc]

    # ------------------------------------------------------------ CheckpointIO

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Hand `checkpoint` to ckptd as step checkpoint["global_step"] and return; the pointer
        at `path` appears once the step is durable.

        A second save of the step handed over last (ModelCheckpoint's last.ckpt after the top-k
        file) is not handed over again: ckptd holds one checkpoint per step. It must have the
        same tensors, unchanged (else ValueError); its pointer names the same step and carries
        the parts of its non-tensor content that differ (JSON). Raises TypeError naming the key
        of a value that is neither a tensor nor JSON-able, and for storage_options (none are
        supported); RuntimeError when called by one of Lightning's own sharding strategies or on
        a global rank other than 0. Called by the multiprocessing launcher at the end of fit
        (the trained weights for the main process: a bare state dict), it writes them to `path`
        as a safetensors file instead, which load_checkpoint reads back for the launcher.
        """
        self._own_process()
        caller = find_caller()
        if isinstance(caller, _MultiProcessingLauncher):  # the trained weights, handed back at the end of fit
            write_weights(local_path(path), checkpoint)
            return
        check_saver(caller)
        self._save(checkpoint, path, storage_options, self._connect, pointer=True)

    def save_shards(self, checkpoint: dict[str, Any], path: Any, rank: int, world_size: int, storage_options: Any | None = None) -> None:
        """Hand this rank's part of a sharded checkpoint to ckptd (a sharding strategy calls it on
        every rank: CkptdModelParallelStrategy); the pointer at `path` is written by rank 0.

        `checkpoint` is Lightning's dict with this rank's shards: DTensors in state_dict and in
        the optimizer states (keyed by parameter name). Every rank saves as itself in a job of
        `world_size` ranks, each handing over only its own shards (no gather); the daemon
        stores each logical tensor once. Raises as save_checkpoint does.
        """
        self._own_process()
        self._save(checkpoint, path, storage_options, lambda: self._sharded_client(rank, world_size), pointer=rank == 0)

    def save_engine(self, engine: Any, checkpoint: dict[str, Any], path: Any, rank: int, world_size: int, storage_options: Any | None = None) -> None:
        """Hand this rank's part of a DeepSpeed ZeRO checkpoint to ckptd (CkptdDeepSpeedStrategy
        calls it on every rank); the pointer at `path` is written by rank 0.

        The engine's fp32 master weights, optimizer state and counters go through
        ckptd.integrations.deepspeed.save (each rank its own partitions); Lightning's other keys
        (loops, callbacks, schedulers, ...) are its `extra`. The checkpoint's state_dict and
        optimizer_states are not saved: the engine holds them. Raises as save_checkpoint does.
        """
        from ckptd.integrations import deepspeed

        self._own_process()

        def hand_over(client: CheckpointClient, step: int, state: dict[str, Any], metric: float | None) -> SaveHandle:
            return deepspeed.save(engine, client, step, extra=state, metric=metric, quantize=self.quantize)

        rest = {key: value for key, value in checkpoint.items() if key not in PARTS}
        self._save(rest, path, storage_options, lambda: self._sharded_client(rank, world_size), pointer=rank == 0, hand_over=hand_over)

    def _save(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None, connect: Callable[[], CheckpointClient], pointer: bool,
        hand_over: HandOver | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}: "
                "ckptd's daemon decides where and how the checkpoint is stored (its --root and configuration)"
            )
        target = local_path(path)
        self._raise_background_error()
        step = global_step_of(checkpoint)
        mapped = to_state(checkpoint, os.path.abspath(target))
        if self._last is not None and self._last[0].step == step:
            same, durable = self._last
            why = same.mismatch(mapped)
            if why is not None and not same.rest_only(mapped):  # rest_only: the pointer carries its own small tensors
                message = (
                    f"global_step {step} was already saved to ckptd (job {self.job!r}) by this run, and the checkpoint for "
                    f"{target} differs from it: {why}. ckptd holds one checkpoint per step, so {target} is not written: save "
                    "a step once (a weights-only and a full save of one step, two ModelCheckpoints meeting at a step?), or "
                    "save again only after the next optimizer step"
                )
                if self.on_error == "raise" or not same.fewer(mapped):  # else every full save of a step would be left out
                    raise ValueError(message)
                return log.warning("%s", message)  # weights only, on_error="warn": training goes on
            if pointer:
                self._writer.submit(target, Pointer(self.job, step, same.own_shape(mapped)), durable)
            return
        client = connect()
        try:
            metric = monitored_metric(checkpoint, target)
            if hand_over is None:
                handle = client.save(step, mapped.state, metric=metric, quantize=self.quantize, rng=self.rng)
            else:
                handle = hand_over(client, step, mapped.state, metric)
        except CheckpointError as exc:  # on_error="raise", or a state the daemon refuses
            self._last = None
            raise type(exc)(self._not_saved(step, target, str(exc)), exc.code, exc.reason) from exc
        if not handle.ok:
            self._last = None
            log.warning("%s", self._not_saved(step, target, handle.error or "unknown error"))
            return
        durable = _Durable(handle, self.durable_timeout_s)
        self._last = (SameStep(step, mapped), durable)
        if pointer and not (handle.kept and _kept_lacks_parts(client, step, mapped, target)):
            self._writer.submit(target, Pointer(self.job, step), durable)

    def load_checkpoint(self, path: Any, map_location: MapLocation = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict the pointer at `path` names, as Lightning saved it.

        Waits first for pointers this process is still writing. On every rank of a run of
        several processes (Lightning's DDP loads on each): the pointer must be in a directory
        this rank sees; global rank 0 wrote it (Lightning tears the fit that saved down, which
        waits for its pointers, before a later fit or test of the same processes loads). Each
        rank loads the step from its node's daemon on its own. map_location as torch's (None:
        CPU tensors). weights_only is accepted and has no effect: nothing is ever unpickled.
        Raises FileNotFoundError when there is no file or ckptd no longer holds the step (with
        the steps it holds), ValueError ("not a ckptd checkpoint pointer: ...") for another
        file, CheckpointError when the daemon cannot serve the step.

        A ModelCheckpoint's last checkpoint (`last.ckpt`, `last-v1.ckpt`, ...: what
        ckpt_path="last" picks) loads the newest committed step of its job, which is newer than
        the step its pointer names when the run stopped after a save and before the pointer was
        written (a warning says so): a resume never redoes an interval the job holds.
        """
        self._own_process()
        caller = find_caller()
        if isinstance(caller, _MultiProcessingLauncher):  # the weights a worker handed back (save_checkpoint)
            return map_tensors(read_weights(local_path(path)), map_location)
        follow_newest = is_last_checkpoint(path, caller)
        rank, world_size = rank_and_world()
        target, pointer = self._pointer(path, rank, world_size)
        rng = self.rng and rank == 0 and resuming_fit(caller)  # the saving rank's generators (a job of one rank): see docs
        if pointer.job == self.job:
            checkpoint = self._load(self._load_client(rank, world_size), pointer, target, follow_newest, rng=rng)
            if rank == 0 and self._loaded is not None:
                restore_missing_pointer(*self._loaded, target, checkpoint.get("callbacks"))
        else:  # a checkpoint of another job (e.g. the run this one was started from)
            who = (rank, world_size) if rank else (0, 1)
            with self._new_client(pointer.job, "raise", *who) as client:
                checkpoint = self._load(client, pointer, target, follow_newest, rng=rng)
        return map_tensors(checkpoint, map_location)

    def load_shards(self, path: Any, targets: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
        """Load the checkpoint the pointer at `path` names into this rank's shards (a sharding
        strategy calls it on every rank: CkptdModelParallelStrategy), in any world size.

        targets: the parts to fill in place, in the layout of this run: "model" (the model's
        sharded state dict: DTensors keyed by parameter name) and, when resuming a fit,
        "optimizer" ({"0": the first optimizer's sharded state dict, ...}). Each rank reads
        only its own boxes, whatever layout saved them. Returns Lightning's checkpoint dict,
        whose state_dict and optimizer_states are the filled targets; this rank's random
        generators are restored when it saved them (a rank beyond the saved world keeps its
        own). Raises as load_checkpoint does.
        """
        self._own_process()
        return self._load_sharded(find_caller(), path, rank, world_size, targets)

    def load_engine(self, engine: Any, path: Any, rank: int, world_size: int) -> dict[str, Any]:
        """Load the checkpoint the pointer at `path` names into a DeepSpeed ZeRO engine
        (CkptdDeepSpeedStrategy calls it on every rank), in any data-parallel size and ZeRO
        stage (ckptd.integrations.deepspeed.load: master weights, optimizer state, counters,
        random generators, then the module's weights). Returns Lightning's checkpoint dict
        without state_dict and optimizer_states (the engine holds them, as after
        DeepSpeedStrategy's own load). Raises as load_checkpoint does.
        """
        from ckptd.integrations import deepspeed

        self._own_process()

        def fill(client: CheckpointClient, state: dict[str, Any], step: int) -> None:
            deepspeed.load(engine, client, step, extra=state)

        return self._load_sharded(find_caller(), path, rank, world_size, None, fill)

    def _load_sharded(
        self, caller: Any, path: Any, rank: int, world_size: int, targets: dict[str, Any] | None, fill: Fill | None = None,
    ) -> dict[str, Any]:
        """A load of every rank of a sharded run (load_shards, load_engine)."""
        follow_newest = is_last_checkpoint(path, caller if isinstance(caller, Strategy) else None)
        target, pointer = self._pointer(path, rank, world_size)
        rng = self.rng and resuming_fit(caller)
        if pointer.job == self.job:
            return self._load(self._sharded_client(rank, world_size), pointer, target, follow_newest, targets, rng=rng, fill=fill)
        with self._new_client(pointer.job, "raise", rank, world_size) as client:
            return self._load(client, pointer, target, follow_newest, targets, rng=rng, fill=fill)

    def _pointer(self, path: Any, rank: int, world_size: int) -> tuple[str, Pointer]:
        """The local path and the pointer at `path`, once this process's pending pointers are written."""
        target = local_path(path)
        self._writer.flush()
        try:
            return target, read_pointer(target)
        except FileNotFoundError as exc:
            if rank == 0:
                raise
            raise FileNotFoundError(
                f"{exc} (on global rank {rank} of {world_size}): global rank 0 writes CkptdCheckpointIO's pointer files, "
                "each once its step is durable; every rank reads them, so ModelCheckpoint's dirpath (or the ckpt_path) "
                "must be a directory every rank sees: on several nodes, a shared file system"
            ) from None

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at `path` (and one still waiting to be written).

        The step stays in ckptd until the daemon's retention deletes it: ckptd has no call that
        deletes one step. Run the daemon with retention that keeps what ModelCheckpoint keeps
        (docs/integrations/lightning.md: --keep-best with this plugin's metrics, --keep-last).
        """
        self._own_process()
        target = local_path(path)
        self._writer.cancel(target)
        if os.path.isdir(target) and not os.path.islink(target):
            log.warning("%s is a directory, not a pointer file of CkptdCheckpointIO: left in place", target)
            return
        try:
            os.remove(target)
        except FileNotFoundError:
            log.debug("%s: no pointer to remove (its save was not durable, or it is gone already)", target)

    def wait_durable(self) -> None:
        """Block until every checkpoint saved so far is durable and its pointer file written (or
        its save failed: logged; raised with on_error="raise"). Not part of Lightning's
        CheckpointIO: for code that hands a checkpoint path on at once (load_checkpoint and
        teardown wait by themselves)."""
        self._own_process()
        self._writer.flush()
        self._raise_background_error()

    def teardown(self) -> None:
        """Wait for the pointers still being written, then close the connection to the daemon.

        Lightning calls it at the end of fit, validate and test; a later save or load connects
        again. With on_error="raise", a pointer that could not be written raises here.
        """
        self._own_process()
        try:
            self._writer.close()
        finally:
            clients = (self._client, self._reader)
            self._client = self._reader = None
            for client in clients:
                if client is not None:
                    client.close()
        self._raise_background_error()

    # ------------------------------------------------------------ internals

    def _own_process(self) -> None:
        """After a fork (strategy="ddp_fork", "ddp_notebook"), the parent's connections and pointer
        thread are not this process's: start afresh, leaving the parent's to it."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._client = self._reader = None
            self._writer = PointerWriter()
            self._last = None

    def _connect(self) -> CheckpointClient:
        if self._client is None:
            self._client = self._new_client(self.job, self.on_error, 0, 1)
        return self._client

    def _sharded_client(self, rank: int, world_size: int) -> CheckpointClient:
        """The client of a sharded run: this rank of a job of `world_size` ranks, under the run id
        every rank derives alike (the launcher's, else rank 0's through torch.distributed)."""
        if self._client is not None and (self._client.rank, self._client.world_size) != (rank, world_size):
            self._client.close()
            self._client = None
        if self._client is None:
            self._client = CheckpointClient(self.job, options=dataclasses.replace(self._options, rank=rank, world_size=world_size))
        return self._client

    def _load_client(self, rank: int, world_size: int) -> CheckpointClient:
        """The client this process loads its job's steps with: the saving client on global rank
        0 (or in one process), else one as this rank of the run's world (a rank other than 0
        never takes part in a save, so its loads cannot disturb one of global rank 0)."""
        if rank == 0:
            return self._connect()
        if self._reader is None or (self._reader.rank, self._reader.world_size) != (rank, world_size):
            if self._reader is not None:
                self._reader.close()
            self._reader = self._new_client(self.job, self.on_error, rank, world_size)
        return self._reader

    def _new_client(self, job: str, on_error: str, rank: int, world_size: int) -> CheckpointClient:
        # Lightning saves the whole state from one process (global rank 0): a job of one rank.
        # Other ranks only load, each as itself in the run's world (ckptd's loads are per rank),
        # under a run id of their own: they never save, and no collective may settle one.
        options = dataclasses.replace(
            self._options, on_error=on_error, rank=rank, world_size=world_size, local_world_size=1 if world_size == 1 else None, run_id=new_run_id()
        )
        return CheckpointClient(job, options=options)

    def _not_saved(self, step: int, path: str, error: str) -> str:
        return f"checkpoint {path} (step {step} of job {self.job!r}) was not saved to ckptd and no pointer is written: {error}"

    def _raise_background_error(self) -> None:
        error = self._writer.take_error()
        if error is not None and self.on_error == "raise":
            raise CheckpointError(f"an earlier checkpoint's pointer file was not written: {error}") from error

    def _load(
        self, client: CheckpointClient, pointer: Pointer, path: str, follow_newest: bool = False,
        targets: dict[str, Any] | None = None, rng: bool = False, fill: Fill | None = None,
    ) -> dict[str, Any]:
        """The checkpoint `pointer` names; follow_newest: the job's newest committed step instead
        when that is another (a last checkpoint whose pointer the stopped run did not update).
        targets: parts filled in place instead of fresh tensors (load_shards); rng: restore
        this rank's random generators saved with the step; fill: loads the state instead of
        CheckpointClient.load (load_engine: the engine's partitions, and the generators always)."""
        layout: dict[str, Any] = {}
        try:
            loaded = client.load({LAYOUT: layout}, step=None if follow_newest else pointer.step)
            if loaded is None:  # the job holds no step at all
                raise CheckpointNotFound(f"job {pointer.job!r} has no committed checkpoint")
        except CheckpointNotFound:
            held = [info.step for info in client.list()]
            raise FileNotFoundError(
                f"{path} names step {pointer.step} of ckptd job {pointer.job!r}, which the daemon at {client.address} does not "
                f"hold (the job's steps: {held or 'none'}): the daemon's retention deleted it (keep what ModelCheckpoint "
                "keeps: see docs/integrations/lightning.md), or another daemon or storage root holds it"
            ) from None
        except ValueError as exc:
            raise ValueError(f"{path} names step {pointer.step} of ckptd job {pointer.job!r}, which CkptdCheckpointIO did not save: {exc}") from None
        if loaded != pointer.step:
            layout, pointer = _newest_or_named(client, layout, loaded, pointer, path)
        self._loaded = (pointer.job, pointer.step, layout["path"] if isinstance(layout.get("path"), str) else None)
        fresh = templates(layout, skip=set(targets or ()))
        state = {**fresh.state, **(targets or {})}
        if fill is None:
            client.load(state, step=pointer.step, rng=rng)
        else:
            fill(client, state, pointer.step)
        if pointer.shape is None:
            return assemble(layout["order"], layout["state_dict_metadata"], state)
        shape = pointer.shape  # a later save of the step: its own key order and the parts that differ
        parts = {**state, **decode_parts(shape["trees"], fresh.tensors, shape.get("tensors"))}
        return assemble(shape["order"], shape["state_dict_metadata"], parts)


def _kept_lacks_parts(client: CheckpointClient, step: int, mapped: Mapped, target: str) -> bool:
    """A resumed run redid `step`, and the daemon kept the step it holds: whether that one lacks
    top-level parts of this checkpoint (another ModelCheckpoint's weights-only save), which a
    pointer at `target` would then not hold (warned)."""
    lacking = parts_lacking(mapped.state[LAYOUT], layout_of(client, step))
    if lacking:
        log.warning("%s is not written: step %s, which the job holds already and keeps, lacks its %s (a weights-only save "
                    "of that step before the resume?)", target, step, ", ".join(lacking))
    return bool(lacking)


def _newest_or_named(client: CheckpointClient, layout: dict[str, Any], newest: int, pointer: Pointer, path: str) -> tuple[dict[str, Any], Pointer]:
    """A last checkpoint whose pointer names an older step than the job's newest: the newest
    (its layout given), unless it lacks a top-level part of the named step (another
    ModelCheckpoint's, weights only): then the named one. Either way with a warning."""
    try:
        named = layout_of(client, pointer.step)
    except CheckpointNotFound:  # removed since: the newest it is
        named = {}
    lacking = parts_lacking(named, layout)
    if lacking:
        log.warning(
            "%s names step %s of ckptd job %r; the job's newest committed step %s lacks its %s (another "
            "ModelCheckpoint's, weights only?): loading step %s", path, pointer.step, pointer.job, newest, ", ".join(lacking), pointer.step,
        )
        return named, pointer
    log.warning(
        "%s names step %s of ckptd job %r, whose newest committed step is %s (the run stopped after saving it and "
        "before the pointer was updated): loading step %s", path, pointer.step, pointer.job, newest, newest,
    )
    return layout, Pointer(pointer.job, newest)  # the step's own layout


class CkptdLoadFromCheckpoint:
    """A LightningModule mixin: `Model.load_from_checkpoint(path)` also reads CkptdCheckpointIO's pointers.

        class Model(CkptdLoadFromCheckpoint, L.LightningModule): ...
        model = Model.load_from_checkpoint("ckpts/epoch=3-step=20.ckpt")

    Lightning's load_from_checkpoint reads the file with torch.load itself (no CheckpointIO:
    lightning/pytorch/core/saving.py, _load_from_checkpoint), which a pointer is not. For a
    pointer this loads the step it names from the daemon (`ckptd_address`, default
    $CKPTD_ADDRESS, else the default socket; a last checkpoint: the job's newest committed
    step, as CkptdCheckpointIO.load_checkpoint does), whole, in this process, from whatever
    layout saved it (one process, DDP, FSDP2, TP), then builds the module as Lightning does: its
    saved hyper-parameters updated with `kwargs`, `on_load_checkpoint`, `load_state_dict(strict)`,
    moved to the device of the loaded weights (map_location as torch's). Any other path or file
    object goes to Lightning's own load_from_checkpoint. Raises what
    CkptdCheckpointIO.load_checkpoint raises; TypeError for hparams_file with a pointer.
    """

    ckptd_address: ClassVar[str | None] = None

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: Any, map_location: MapLocation = None, hparams_file: Any = None, strict: bool | None = None,
        weights_only: bool | None = None, **kwargs: Any,
    ) -> Any:
        try:
            pointer = read_pointer(local_path(checkpoint_path))
        except (TypeError, ValueError, OSError):  # a file object, another format, no file: Lightning's own answer
            return super().load_from_checkpoint(  # type: ignore[misc]
                checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, weights_only=weights_only, **kwargs
            )
        if hparams_file is not None:
            raise TypeError(f"{checkpoint_path} is a ckptd pointer, whose checkpoint holds its hyper-parameters: pass changed ones as keyword arguments, not hparams_file")
        io = CkptdCheckpointIO(pointer.job, address=cls.ckptd_address, on_error="raise", rng=False)
        try:
            checkpoint = io.load_checkpoint(checkpoint_path, map_location=map_location)
        finally:
            io.teardown()
        checkpoint.setdefault(LightningModule.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
        model: Any = _load_state(cls, checkpoint, strict=strict, **kwargs)  # type: ignore[arg-type]
        weights = [t for t in checkpoint["state_dict"].values() if isinstance(t, torch.Tensor)]
        return model.to(weights[0].device) if weights else model


class _Durable:
    """Whether one save became durable: the first call waits (SaveHandle.wait_durable), later
    calls give the same answer, also once the client is closed. Thread-safe."""

    def __init__(self, handle: SaveHandle, timeout_s: float) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._result: bool | None = None
        self._error: BaseException | None = None

    def __call__(self) -> bool:
        with self._lock:
            if self._result is None and self._error is None:
                try:
                    self._result = self._handle.wait_durable(timeout=self._timeout_s) is not None
                except CheckpointError as exc:  # on_error="raise": kept, raised to every caller
                    self._error = exc
            if self._error is not None:
                raise self._error
            return bool(self._result)
