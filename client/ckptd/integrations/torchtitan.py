"""torchtitan's checkpoint manager through ckptd: its saves go to the node's daemon, its resumes
read ckptd steps.

    from ckptd.integrations.torchtitan import CkptdCheckpointManager

    config.checkpoint = CkptdCheckpointManager.Config(enable=True, job="run-42", interval=500)

torchtitan (0.3) builds its checkpointer from `Trainer.Config.checkpoint`, a
`BaseCheckpointManager.Config`: this Config builds CkptdCheckpointManager, a subclass of
torchtitan's own CheckpointManager. Its policies stay torchtitan's (interval, load_step,
exclude_from_loading, load_only, the model-only last step, initial_load_path); only where the
bytes go changes:

- Saves go through `CkptdStorageWriter` (ckptd.integrations.dcp) and its plan-keeping planner:
  `async_mode="disabled"` is `dcp.save` (it returns after the hand-off to the daemon, or after the
  commit with `durable=True`), "async" is `dcp.async_save` (its future is done at the hand-off;
  the daemon persists). "async_with_pinned_mem" runs as "async": torchtitan's variant stages into
  a second copy in pinned shared memory in a separate process, which is what the hand-off into
  the daemon's shared-memory arenas already is (CUDA tensors cross through pinned memory, the
  client's mode), so ckptd makes no second copy.
- `load_step=-1` finds the job's newest committed step (the one committed last), after this
  node's saves of the job still in flight end; a step is read with `CkptdStorageReader` from its
  files (any world size and sharding). `initial_load_path` may be a ckptd step directory or
  anything torchtitan reads itself (a DCP directory, Hugging Face weights).
- `folder` is not used: the steps are ROOT/JOB/step-NNNNNNNN under the daemon's root.

- `keep_latest_k=N` is the job's own retention (`JobRetention(keep_last=N)`, sent with every
  save): the daemon prunes the job's steps, at most to its own `--keep-last` (its flags are the
  upper bound); torchtitan's purge of step directories never runs. 0 (the default here): the
  daemon's setting.

Refused, with the reason in the error: `last_save_in_hf` (the step's model files are
safetensors already; `ckptd export` writes a consolidated Hugging Face copy).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager  # type: ignore[import-not-found,import-untyped,unused-ignore]

from ckptd.client import CheckpointClient, ClientOptions, JobRetention
from ckptd.common.names import check_job_id
from ckptd.format.index import parse_step_dir_name, step_dir_name
from ckptd.integrations.dcp import CkptdStorageReader, CkptdStorageWriter

__all__ = ["CkptdCheckpointManager"]

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a load looks again at this node's saves in flight


class CkptdCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """torchtitan's CheckpointManager saving to and resuming from ckptd (see the module).

    Built by torchtitan from `CkptdCheckpointManager.Config`, with the components torchtitan
    passes to every checkpoint manager. One CkptdStorageWriter (one CheckpointClient: one run of
    the job) serves every save of the run and the daemon queries of its loads.
    """

    # set by torchtitan's CheckpointManager.__init__ (untyped there)
    async_mode: AsyncMode
    save_future: Future[Any] | None
    states: dict[str, Any]
    folder: str
    pg: Any

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        job: str = ""
        """The ckptd job id of this training run: the same at every restart, so a restart resumes it."""

        address: str | None = None
        """The daemon's socket (its --socket); None: $CKPTD_ADDRESS, else the default socket."""

        durable: bool = False
        """Synchronous saves return once the step is committed on every node, not at the hand-off."""

        wait_s: float = 600.0
        """How long a load waits, in seconds, for this node's saves of the job still in flight."""

        keep_latest_k: int = 0
        """Keep the job's N newest steps (the daemon's --keep-last is the upper bound); 0: the daemon's setting."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.last_save_in_hf:
                raise ValueError(
                    "last_save_in_hf=True: through ckptd the last step's model files are safetensors already; "
                    "write a consolidated Hugging Face copy with `ckptd export STEP_DIR OUT` and leave last_save_in_hf=False"
                )
            if self.wait_s <= 0:
                raise ValueError(f"wait_s={self.wait_s}: give the seconds a load waits for saves in flight (> 0)")
            if self.enable or self.load_only:
                if not self.job:
                    raise ValueError("CkptdCheckpointManager.Config needs job=...: the ckptd job id of this run, the same at every restart")
                check_job_id(self.job)

    def __init__(self, config: Config, **components: Any) -> None:
        """`components`: what torchtitan's Trainer passes every checkpoint manager (dataloader,
        model_parts, optimizers, lr_schedulers, states, sd_adapter, base_folder). Asks the daemon
        for its storage root when enabled: the daemon must be up."""
        super().__init__(config, **components)
        if not self.enable:
            return
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            log.info("async_mode=async_with_pinned_mem runs as async through ckptd: the hand-off into the daemon's shared memory is the staging copy")
            self.async_mode = AsyncMode.ASYNC
        self.job = config.job
        self.wait_s = config.wait_s
        retention = JobRetention(keep_last=config.keep_latest_k) if config.keep_latest_k else None
        options = ClientOptions(address=config.address, on_error="raise", retention=retention)
        self.writer = CkptdStorageWriter(config.job, durable=config.durable, options=options)
        self.folder = os.path.join(self.client.status().root, config.job)
        if not os.path.isdir(self.folder) and self.client.list():
            # torchtitan would start afresh where it sees no folder: the steps exist, this process cannot read them
            raise FileNotFoundError(
                f"job {config.job!r} has committed steps under the daemon's root, but {self.folder} is not a directory here: "
                "ckptd steps are read from their files, so mount the daemon's storage root at the same path in this process"
            )

    @property
    def client(self) -> CheckpointClient:
        """The run's client (the writer's): saves, and the daemon queries of loads."""
        return self.writer.client

    def _close(self) -> None:
        if getattr(self, "save_future", None) is not None:  # DCP's save thread may still use the writer's client
            self._wait_for_saving()
        super()._close()
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.close()

    def _should_purge(self) -> bool:
        """Never: the daemon prunes the job's steps (keep_latest_k is sent as its JobRetention)."""
        return False

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """The step's directory under the daemon's root: ROOT/JOB/step-NNNNNNNN."""
        return os.path.join(folder or self.folder, step_dir_name(step))

    def _find_load_step(self, folder: str = "") -> int:
        """The job's newest committed step (committed last), or -1: looked up once this node's
        saves of the job in flight have ended, so a run killed right after a hand-off resumes
        from that step."""
        self._wait_for_saves_in_flight()
        latest = self.client.latest()
        return -1 if latest is None else latest

    def _wait_for_saves_in_flight(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            steps = sorted(f.step for f in self.client.status().in_flight if f.job == self.job)
            if not steps:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"steps {steps} of job {self.job!r} are still being saved after {self.wait_s:g} s; "
                    "`ckptd status` shows their progress (raise wait_s, or load_step=N for a committed step)"
                )
            time.sleep(POLL_S)

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | None:
        """Save `state_dict` as the step of `checkpoint_id` through the writer: None once handed
        off (or committed, durable) when synchronous; else dcp.async_save's future, done at the
        hand-off. `enable_garbage_collection` is torchtitan's (nothing ckptd needs)."""
        if to_hf:  # the Config refuses last_save_in_hf; nothing else asks for it
            raise ValueError("saving in Hugging Face format is not supported through ckptd: use `ckptd export`")
        step = parse_step_dir_name(os.path.basename(checkpoint_id))
        if step is None:
            raise ValueError(f"{checkpoint_id!r} is not a ckptd step directory (ROOT/JOB/step-NNNNNNNN)")
        writer, nested = self.writer, self._nest_model(state_dict)
        if async_mode == AsyncMode.DISABLED:
            dcp_save(nested, storage_writer=writer, planner=writer.planner, checkpoint_id=str(step))
            return None
        future = dcp_async_save(nested, storage_writer=writer, planner=writer.planner, checkpoint_id=str(step), process_group=self.pg)
        if not isinstance(future, Future):  # the writer stages in place: DCP answers with the save's future
            raise TypeError(f"dcp.async_save answered {type(future).__name__}, not the save's Future")
        return future

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load `state_dict` in place from the ckptd step directory `checkpoint_id`; Hugging Face
        weights and DCP directories (initial_load_path) through torchtitan's own readers."""
        if from_hf or not CkptdStorageReader.validate_checkpoint_id(checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        nested = self._nest_model(state_dict)
        reader = CkptdStorageReader(checkpoint_id)
        dcp_load(nested, storage_reader=reader)
        if reader.step.job == self.writer.job:
            self.client.mark_resumed(reader.step.step)  # a resume of this job: its saves may roll back
        state_dict.update(nested.get(MODEL, {}))  # DCP may replace a non-tensor entry of the model's
        if MODEL in self.states:  # the model's entries are flattened into state_dict (torchtitan's layout)
            self.states[MODEL].load_state_dict(state_dict)

    def _nest_model(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """`state_dict` with the model's entries under "model": torchtitan flattens them to the top
        ("layers.0.weight"), DCP's key becomes "model.layers.0.weight", ckptd's tensor
        "model/layers.0.weight", so the step's model files hold the model (Hugging Face loadable,
        `ckptd export`, quantization options that spare it). The values are the same objects."""
        wrapper = self.states.get(MODEL)
        names = set(wrapper.cached_state_dict) if wrapper is not None else set()
        model = {k: v for k, v in state_dict.items() if k in names}
        if not model:
            return state_dict
        if MODEL in state_dict:
            raise ValueError(f"the state has both a {MODEL!r} entry and the model's own entries; cannot nest them under {MODEL!r}")
        return {MODEL: model, **{k: v for k, v in state_dict.items() if k not in names}}
