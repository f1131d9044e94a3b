"""`Accelerator.save_state`/`load_state` through ckptd (`ckptd[hf]`).

What a user writes instead of `accelerator.save_state(dir)` / `accelerator.load_state(dir)`:

    from ckptd.client import CheckpointClient
    from ckptd.integrations.accelerate import load_state, save_state

    ckpt = CheckpointClient(job="run-1")                  # after the Accelerator: it sets up the ranks
    start = load_state(accelerator, ckpt) or 0            # the newest checkpoint's step; None: a fresh start
    ...
    save_state(accelerator, ckpt, step)                   # every rank, as accelerator.save_state

Why two functions and not Accelerate's hooks: `register_save_state_pre_hook` and
`register_load_state_pre_hook` can take over the models' weights only; `Accelerator.save_state`
would still write the optimizers, schedulers, GradScaler, samplers, random generators and the
registered objects with torch.save, that is as pickles (optimizer.bin, scheduler.bin,
random_states_0.pkl, custom_checkpoint_0.pkl). These functions replace save_state and
load_state whole; nothing is written but what ckptd writes (safetensors and JSON).

What a checkpoint holds, read from the Accelerator (what `accelerator.prepare` and
`register_for_checkpointing` gave it):

    "model"                 the prepared model, unwrapped (DDP, torch.compile); several models:
                            an nn.ModuleDict of them under "0", "1", ...
    "optimizer", "optimizer_1", ...   the optimizers' states, keyed by parameter name
    "scheduler", "scheduler_1", ...   the LR schedulers' state_dicts
    "scaler"                the GradScaler's state_dict, when mixed precision has one
    "custom_0", ...         the objects registered with accelerator.register_for_checkpointing,
                            each process's own (tensors in their state_dicts too: docs/usage.md, extras)
    "accelerate"            accelerator.step (the gradient accumulation counter), the number of
                            processes and, per prepared data loader, its epoch counter (`iteration`,
                            which seeds the shuffle of a seedable sampler), its length and, for a
                            StatefulDataLoader, its state_dict (each process's own)
    RNG                     rng=True: torch (CPU and CUDA), Python and NumPy generators of every rank

The position inside an epoch is where Accelerate leaves it: the caller skips the batches already
trained with `accelerator.skip_first_batches(dataloader, n)`, n counted from the step that
`load_state` returns, or uses a StatefulDataLoader (`use_stateful_dataloader=True`), whose
state_dict is saved per process and restored to that process. In another world size the saved
states describe the old split and are not restored (a warning says so); `batches_to_skip` gives
each process the batches to skip so that the rest of the epoch is trained once (its docstring has
the rule). For the shuffle
and the random generators after a resume to be those of an uninterrupted run, as in
tests/integrations/test_accelerate.py (and tests/integrations/accel_train.py, the loop to copy):
- make the shuffle order a function of the epoch: DataLoaderConfiguration(use_seedable_sampler=True),
  Accelerate's own requirement for reproducible resumes;
- call `dataloader.set_epoch(epoch)` at the start of every epoch: `skip_first_batches` returns a
  new data loader, so the prepared one's epoch counter does not move on with the resumed epoch
  (the restored counter serves loops that resume at an epoch's start and never call set_epoch);
- give the DataLoader its own `generator=`: otherwise every new iterator of it draws a seed from
  torch's global generator, and the iterator made after `load_state` shifts the restored
  generators by one draw that the interrupted run made before its save (measured: the losses
  after a mid-epoch resume then differ).

FSDP2 (`FullyShardedDataParallelPlugin(fsdp_version=2)`): the parameters and optimizer states
are DTensors, and each process hands its own shards to the client's DTensor path; a save makes no
collective, nothing is gathered to a process, and a checkpoint loads into another number of
processes (tests/integrations/test_accelerate_fsdp.py).

DeepSpeed ZeRO-1/2/3 (`DeepSpeedPlugin`): the prepared model is a DeepSpeed engine, and its
fp32 master weights, optimizer state, engine scheduler and step counters go through
ckptd.integrations.deepspeed (each rank its own partitions, loadable into another number of
processes and another ZeRO stage); the rest (schedulers that Accelerate steps, under
"lr_scheduler", "lr_scheduler_1", ...; registered objects; "accelerate") is that module's
`extra`. One model only (tests/integrations/test_accelerate_deepspeed.py).

Not supported (refused with the reason): Megatron-LM (its engine saves its own state), FSDP
version 1 and XLA. Hooks registered with register_save_state_pre_hook /
register_load_state_pre_hook are not called (they expect a directory): a warning says so.
"""

from __future__ import annotations

import logging
from typing import Any

from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
from accelerate.utils import DistributedType  # type: ignore[import-untyped]
from torch import nn

from ckptd.client import CheckpointClient, SaveHandle

__all__ = ["batches_to_skip", "load_state", "save_state"]

log = logging.getLogger("ckptd.integrations.accelerate")

META_KEY = "accelerate"
_REFUSED = {
    DistributedType.MEGATRON_LM: "Megatron-LM, whose engine saves its own state",
    DistributedType.XLA: "XLA devices",
}


def save_state(
    accelerator: Accelerator,
    client: CheckpointClient,
    step: int,
    *,
    metric: float | None = None,
    quantize: str | None = None,
    master_weights: str | None = None,
) -> SaveHandle:
    """Hand the Accelerator's training state to ckptd as checkpoint `step` (module docstring).

    Collective: every rank calls it for the same step, as `accelerator.save_state`. Returns the
    client's SaveHandle (`ok`, `stall_s`, `wait_durable()`); with the client's on_error="warn" a
    daemon that is down gives a failed handle and training goes on. metric, quantize,
    master_weights: as `CheckpointClient.save`. Raises ValueError/TypeError for what can never be
    saved (an unsupported distributed setup, a client made for other ranks).
    """
    _check(accelerator, client)
    if accelerator.gradient_accumulation_steps > 1 and not accelerator.sync_gradients:
        log.warning(
            "save_state of step %d in the middle of a gradient accumulation (%d micro-batches per optimizer step): the "
            "gradients accumulated so far are not saved (nor by Accelerate's save_state), so a resume from it loses them; "
            "save after the optimizer step (when accelerator.sync_gradients is True)", step, accelerator.gradient_accumulation_steps,
        )
    engine = _deepspeed_engine(accelerator)
    if engine is not None:
        if master_weights not in (None, "keep"):
            raise ValueError(
                f"master_weights={master_weights!r}: under DeepSpeed the fp32 master weights are the only copy of the weights "
                "ckptd saves (the module's bf16/fp16 weights are set from them on load); leave master_weights out"
            )
        from ckptd.integrations import deepspeed

        return deepspeed.save(engine, client, step, extra=_deepspeed_extra(accelerator), metric=metric, quantize=quantize)
    return client.save(step, _state(accelerator), metric=metric, quantize=quantize, master_weights=master_weights, rng=True)


def load_state(accelerator: Accelerator, client: CheckpointClient, step: int | None = None) -> int | None:
    """Restore the Accelerator's training state from ckptd checkpoint `step` (None: the newest committed).

    Collective, like `accelerator.load_state`: every rank calls it, after `accelerator.prepare`
    and `register_for_checkpointing` gave the Accelerator the same objects as when the
    checkpoint was saved. Models, optimizers, schedulers, scaler and registered objects are
    filled in place; the random generators, accelerator.step and the data loaders' epoch
    counters (and, in the same world size, StatefulDataLoader states) are set back. Returns the step loaded, or None when
    the job has no checkpoint yet (nothing changed). Raises CheckpointError when the step
    cannot be loaded and ValueError when the checkpoint holds other objects than the Accelerator.
    """
    _check(accelerator, client)
    meta: dict[str, Any] = {META_KEY: {}}
    loaded = client.load(meta, step=step)
    if loaded is None:
        return None
    _check_counts(meta[META_KEY], _counts(accelerator), loaded)
    engine = _deepspeed_engine(accelerator)
    if engine is not None:
        from ckptd.integrations import deepspeed

        state = _deepspeed_extra(accelerator)
        deepspeed.load(engine, client, step=loaded, extra=state)
    else:
        state = _state(accelerator)
        client.load(state, step=loaded, rng=True)
    _restore_meta(accelerator, state[META_KEY])
    return loaded


def _check(accelerator: Accelerator, client: CheckpointClient) -> None:
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if not isinstance(client, CheckpointClient):
        raise TypeError(f"expected a ckptd.client.CheckpointClient, got {type(client).__name__}")
    kind = accelerator.distributed_type
    if kind in _REFUSED:
        raise ValueError(f"ckptd.integrations.accelerate does not support {_REFUSED[kind]}")
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError("ckptd.integrations.accelerate supports FSDP version 2 only (DTensor parameters): set fsdp_version=2")
    if (client.rank, client.world_size) != (accelerator.process_index, accelerator.num_processes):
        raise ValueError(
            f"the CheckpointClient is rank {client.rank} of {client.world_size}, the Accelerator process "
            f"{accelerator.process_index} of {accelerator.num_processes}: make the client after the Accelerator, "
            "or pass rank=accelerator.process_index, world_size=accelerator.num_processes"
        )
    if accelerator._save_model_state_pre_hook or accelerator._load_model_state_pre_hook:
        log.warning("hooks registered with register_save_state_pre_hook/register_load_state_pre_hook are not called by "
                    "ckptd.integrations.accelerate (they expect a checkpoint directory)")


def _deepspeed_engine(accelerator: Accelerator) -> Any | None:
    """The DeepSpeed engine Accelerate prepared (None when it runs without DeepSpeed)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    if len(accelerator._models) != 1:
        raise ValueError(
            f"ckptd.integrations.accelerate saves one DeepSpeed engine, and this Accelerator prepared {len(accelerator._models)} "
            "models: prepare one model (with its optimizer) per Accelerator"
        )
    return accelerator._models[0]


def _deepspeed_extra(accelerator: Accelerator) -> dict[str, Any]:
    """What ckptd.integrations.deepspeed saves besides the engine: the schedulers Accelerate
    steps itself (a scheduler DeepSpeed's engine holds is saved with the engine), the registered
    objects and the Accelerator's own counters; live objects, so a load fills them in place."""
    from accelerate.utils.deepspeed import DeepSpeedSchedulerWrapper  # type: ignore[import-untyped]

    state: dict[str, Any] = {
        _name("lr_scheduler", i): scheduler
        for i, scheduler in enumerate(accelerator._schedulers)
        if not isinstance(scheduler, DeepSpeedSchedulerWrapper)
    }
    state.update((f"custom_{i}", obj) for i, obj in enumerate(accelerator._custom_objects))
    state[META_KEY] = _meta(accelerator)
    return state


def _state(accelerator: Accelerator) -> dict[str, Any]:
    """The state to save or to load into: live objects, so a load fills them in place."""
    models = [accelerator.unwrap_model(m, keep_torch_compile=False) for m in accelerator._models]
    state: dict[str, Any] = {}
    if len(models) == 1:
        state["model"] = models[0]
    elif models:
        state["model"] = nn.ModuleDict({str(i): m for i, m in enumerate(models)})
    for i, optimizer in enumerate(accelerator._optimizers):
        if not models:
            raise ValueError("the Accelerator has optimizers but no model: prepare the model with accelerator.prepare as well")
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        state[_name("optimizer", i)] = optimizer
    for i, scheduler in enumerate(accelerator._schedulers):
        state[_name("scheduler", i)] = scheduler
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    state[META_KEY] = _meta(accelerator)
    if not models and not accelerator._custom_objects:
        raise ValueError("the Accelerator holds nothing to checkpoint: prepare a model (or register objects) first")
    return state


def _meta(accelerator: Accelerator) -> dict[str, Any]:
    """The Accelerator's own counters and its data loaders' positions (JSON, per process)."""
    return {
        "step": accelerator.step,
        "counts": _counts(accelerator),
        "world_size": accelerator.num_processes,
        "dataloaders": [_loader_position(dl) for dl in accelerator._dataloaders],
    }


def _name(key: str, i: int) -> str:
    return key if i == 0 else f"{key}_{i}"


def _counts(accelerator: Accelerator) -> dict[str, int]:
    return {
        "models": len(accelerator._models),
        "optimizers": len(accelerator._optimizers),
        "schedulers": len(accelerator._schedulers),
        "dataloaders": len(accelerator._dataloaders),
        "custom_objects": len(accelerator._custom_objects),
        "scaler": int(accelerator.scaler is not None),
    }


def _check_counts(saved: Any, now: dict[str, int], step: int) -> None:
    counts = saved.get("counts") if isinstance(saved, dict) else None
    if not isinstance(counts, dict):
        raise ValueError(f"ckptd step {step} was not saved by ckptd.integrations.accelerate.save_state")
    differ = [f"{name}: {counts.get(name)} saved, {value} now" for name, value in now.items() if counts.get(name) != value]
    if differ:
        raise ValueError(
            f"ckptd step {step} holds other objects than this Accelerator ({'; '.join(differ)}): prepare and register "
            "the same models, optimizers, schedulers, data loaders and objects, in the same order, before load_state"
        )


def _loader_position(dataloader: Any) -> dict[str, Any]:
    position: dict[str, Any] = {"iteration": getattr(dataloader, "iteration", None), "length": _length(dataloader)}
    if getattr(dataloader, "use_stateful_dataloader", False):
        position["state"] = dataloader.state_dict()
    return position


def _length(dataloader: Any) -> int | None:
    try:
        return len(dataloader)
    except TypeError:  # an iterable dataset without a length
        return None


def _restore_meta(accelerator: Accelerator, meta: dict[str, Any]) -> None:
    accelerator.step = int(meta["step"])
    saved_world = int(meta.get("world_size", accelerator.num_processes))
    resized = saved_world != accelerator.num_processes
    for dataloader, position in zip(accelerator._dataloaders, meta["dataloaders"]):
        if position.get("iteration") is not None and hasattr(dataloader, "iteration"):
            dataloader.iteration = int(position["iteration"])  # __iter__ calls set_epoch(iteration)
        if "state" in position and not resized:
            dataloader.load_state_dict(position["state"])
    if resized and any("state" in position for position in meta["dataloaders"]):
        log.warning(
            "the StatefulDataLoader states were saved by %d processes and this run has %d: each describes its process's share "
            "of the old split, so none is restored; skip the trained batches with accelerator.skip_first_batches(loader, "
            "batches_to_skip(...)[1]) (ckptd.integrations.accelerate.batches_to_skip)", saved_world, accelerator.num_processes,
        )


def batches_to_skip(accelerator: Accelerator, client: CheckpointClient, step: int, batches_done: int, dataloader: int = 0) -> tuple[int, int]:
    """Where this process resumes prepared data loader number `dataloader`: (epoch, batches to skip in it).

    batches_done: the batches each process of the saving run had taken from that loader since
    training began (the step, when every step takes one batch; step * accumulation steps with
    gradient accumulation). Reads the loader's length and the world size saved with checkpoint
    `step`. In the same world size: (batches_done // length, batches_done % length), the usual
    skip. In another world size, with the same batch size per process and a seedable sampler
    (the epoch's batch order is then the same; Accelerate deals batch b to process b % world size):
    the old run had trained the epoch's first `done = (batches_done % length) * old world size`
    batches, and this process skips its batches among them, ceil((done - process index) / world size);
    every later batch is then trained once, none twice. The processes' remaining batch counts
    differ unless `done` is a multiple of the new world size: Accelerate's even_batches then
    repeats batches of the epoch's start on the short processes, as in any epoch whose batches
    do not divide by the processes. Raises ValueError when the checkpoint does not hold that loader.
    """
    _check(accelerator, client)
    if isinstance(batches_done, bool) or not isinstance(batches_done, int) or batches_done < 0:
        raise ValueError(f"batches_done={batches_done!r}: the batches each saving process had taken, an integer >= 0")
    meta: dict[str, Any] = {META_KEY: {}}
    client.load(meta, step=step)
    loaders = meta[META_KEY].get("dataloaders") or []
    if not 0 <= dataloader < len(loaders) or not loaders[dataloader].get("length"):
        raise ValueError(f"ckptd step {step} holds no length of prepared data loader {dataloader} (saved by an older ckptd, or the loader has no len())")
    length = int(loaders[dataloader]["length"])
    saved_world = int(meta[META_KEY].get("world_size", accelerator.num_processes))
    epoch, done = divmod(batches_done, length)
    if saved_world == accelerator.num_processes:
        return epoch, done
    trained = done * saved_world  # the epoch's first batches, in the order the sampler gives them
    return epoch, max(0, -(-(trained - accelerator.process_index) // accelerator.num_processes))

