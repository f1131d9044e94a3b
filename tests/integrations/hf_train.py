"""A tiny GPT-2 trained under the Hugging Face Trainer, with or without CkptdCallback
(tests/integrations/test_transformers.py runs it as a subprocess and imports its helpers).

`python hf_train.py SPEC_JSON` trains. Spec keys:
  address, job   the daemon and the job (no address: plain Trainer, save_strategy="no")
  output_dir     the Trainer's output_dir
  max_steps      optimizer steps to train in all
  save_steps     the Trainer's save_steps (CkptdCallback saves there)
  kill_at        0, or a global step: at its end the process waits until the last ckptd save
                 is durable, writes that step to `marker` and kills itself with SIGKILL
  kill_handed_over  with kill_at: wait only until the last save is handed over (its commit may
                 still be under way in the daemon) before the kill
  resume_step    the ckptd step to resume from (default: the newest committed)
  resume_true    resume through the Trainer's own `train(resume_from_checkpoint=True)` (the newest
                 checkpoint-<step> pointer in output_dir) when there is one, instead of resume_from
  save_total_limit  the Trainer's save_total_limit (ckptd: the job's keep_last)
  out            where {"resumed_from": step or None, "losses": {global step: [micro-batch losses]},
                 "log_history": [...]} goes as JSON (rewritten after every step; rank 0's)
  fsdp           with several ranks: the Trainer's FSDP2 (fsdp=True, fsdp_config fsdp_version 2,
                 sharded state dict; on CPU through tests/integrations/fsdp_cpu.py)
  replicas       with fsdp: HSDP, the Trainer's parallelism_config ParallelismConfig(dp_replicate_size=
                 replicas, dp_shard_size=the other ranks): (Replicate, Shard(0)) DTensors on a 2-D mesh
  dump           a path ("{rank}" allowed): each rank writes the full model and optimizer tensors
                 and the scheduler's state (safetensors, and JSON beside it) as they are when
                 training begins (after a resume's load: keys "loaded/...") and ends ("end/...")
The model has dropout and the Trainer shuffles the data (seedable sampler, seed 7) with
gradient accumulation 2 over 12 batches an epoch: what a resume must reproduce exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

SEED = 7
SAMPLES = 24  # 12 batches of 2 = 6 optimizer steps an epoch (gradient accumulation 2)
SEQ = 16
VOCAB = 96


class TokenData(torch.utils.data.Dataset):
    """Fixed random token sequences, labels = inputs (causal LM)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_model() -> Any:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(SEED)
    return transformers.GPT2LMHeadModel(config)


def save_parallel_model(kind: str, path: str) -> None:
    """Write the tiny model accel_train.py's `parallel` spec loads: "tp" a Llama (its base_model_tp_plan), "ep" a
    Mixtral with 4 experts (its base_model_ep_plan shards the experts on their first dimension)."""
    import transformers

    sizes: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(SEED)
    if kind == "tp":
        model: Any = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    elif kind == "ep":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2))
    else:
        raise ValueError(f"parallel must be 'tp' or 'ep', got {kind!r}")
    model.save_pretrained(path)


def parallel_model(kind: str, path: str, world: int) -> Any:
    """The model save_parallel_model wrote, tensor (and for "ep" expert) parallel over `world` ranks
    (transformers' DistributedConfig: DTensors on a 1-D mesh of all the ranks; gloo on CPU), plain
    in one process. The Trainer refuses to checkpoint such a model (transformers/trainer.py:632-640)."""
    import transformers

    if world == 1:
        return transformers.AutoModelForCausalLM.from_pretrained(path)
    from transformers.distributed.configuration_utils import DistributedConfig

    config = DistributedConfig(tp_size=world, tp_plan="auto", **({"ep_size": world} if kind == "ep" else {}))
    return transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=config)


def training_args(output_dir: str, max_steps: int, save_steps: int, ckptd: bool, **more: Any) -> Any:
    import transformers

    settings: dict[str, Any] = dict(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01,
        save_strategy="steps" if ckptd else "no", save_steps=save_steps, logging_steps=1, report_to="none",
        seed=SEED, use_cpu=os.environ.get("CKPTD_TEST_DEVICE") != "cuda", dataloader_num_workers=0, disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**settings, **more})


class LossLog:
    """Records every micro-batch loss under the global step it trains (a forward hook on the model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.step = 0
        self.losses: dict[int, list[float]] = {}
        model.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if module.training:
            self.losses.setdefault(self.step, []).append(output.loss.item())


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """Train as the spec says; returns what `out` receives."""
    import transformers

    from ckptd.integrations.transformers import CkptdCallback

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = tiny_model()
    record = LossLog(model)
    ckptd = "address" in spec
    fsdp: dict[str, Any] = {"fsdp": True, "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"}}
    if spec.get("replicas"):
        from accelerate.parallelism_config import ParallelismConfig

        fsdp["parallelism_config"] = ParallelismConfig(dp_replicate_size=spec["replicas"], dp_shard_size=world // spec["replicas"])
    more = {**(fsdp if spec.get("fsdp") else {}), **({"save_total_limit": spec["save_total_limit"]} if "save_total_limit" in spec else {})}
    args = training_args(spec["output_dir"], spec["max_steps"], spec.get("save_steps", 3), ckptd, **more)
    result: dict[str, Any] = {"resumed_from": None, "losses": record.losses, "log_history": [], "collectives_in_save": []}

    class CountingCallback(CkptdCallback):
        """CkptdCallback, recording the collectives its saves run (fsdp: each rank hands its own shards)."""

        def _save_if_pending(self, *args: Any) -> None:
            from fsdp_cpu import collectives_during

            result["collectives_in_save"] += collectives_during(super()._save_if_pending, *args)[1]


    rank = int(os.environ.get("RANK", "0"))  # several ranks (torch.distributed from the environment): rank 0 writes

    def write() -> None:
        if "out" in spec and rank == 0:
            Path(spec["out"]).write_text(json.dumps(result))

    dumped: dict[str, Any] = {}

    def dump(tag: str, objects: dict[str, Any]) -> None:
        if "dump" not in spec:
            return
        from fsdp_cpu import full_state

        optimizer = objects["optimizer"]
        dumped.update({f"{tag}/{k}": v for k, v in full_state(objects["model"], getattr(optimizer, "optimizer", optimizer)).items()})
        dumped[f"{tag}/scheduler"] = objects["lr_scheduler"].state_dict()

    class Steps(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            dump("loaded", kwargs)  # after CkptdCallback.on_train_begin loaded the checkpoint

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            dump("end", kwargs)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.step = state.global_step + 1

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            result["log_history"] = state.log_history
            write()
            if state.global_step == spec.get("kill_at", 0):
                last = ckpt.last_save
                if spec.get("kill_handed_over") and last is not None:
                    last.wait_snapshot(host=True)  # handed over: the daemon writes and commits it after the kill
                    done = last.step
                else:
                    info = last.wait_durable(timeout=60) if last is not None else None
                    done = info.step if info is not None else None
                if rank == 0:
                    Path(spec["marker"]).write_text(json.dumps(done))
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks: list[Any] = []
    if ckptd:
        ckpt = (CountingCallback if spec.get("fsdp") else CkptdCallback)(job=spec["job"], address=spec["address"], on_error="raise")
        callbacks.append(ckpt)
    callbacks.append(Steps())
    if spec.get("fsdp"):
        from fsdp_cpu import fsdp_on_cpu

        with fsdp_on_cpu():
            trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=callbacks)
        assert trainer.is_fsdp_enabled
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=callbacks)
    if spec.get("resume_true"):
        from transformers.trainer_utils import get_last_checkpoint

        found = get_last_checkpoint(spec["output_dir"]) if os.path.isdir(spec["output_dir"]) else None
        resume: Any = True if found is not None else None  # the Trainer raises on True with no checkpoint-* at all
    else:
        found = resume = ckpt.resume_from(trainer, step=spec.get("resume_step")) if ckptd else None
    if found is not None:
        result["resumed_from"] = json.loads(Path(found, "trainer_state.json").read_text())["global_step"]
    trainer.train(resume_from_checkpoint=resume)
    result["log_history"] = trainer.state.log_history
    write()
    if "dump" in spec:
        import safetensors.torch

        path = spec["dump"].format(rank=rank)
        safetensors.torch.save_file({k: v.contiguous() for k, v in dumped.items() if isinstance(v, torch.Tensor)}, path)
        Path(path + ".json").write_text(json.dumps({k: v for k, v in dumped.items() if not isinstance(v, torch.Tensor)}))
    if torch.distributed.is_initialized():  # leave the group together: a rank exiting first can abort the other's gloo threads
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)  # the tests train their baselines in-process with one thread too
    train(json.loads(sys.argv[1]))
