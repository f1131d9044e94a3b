"""A LoRA fine-tune of a tiny Llama that saves adapter-only checkpoints through ckptd, and the
model and data it trains on (tests/integrations/test_peft.py imports the helpers).

`python peft_train.py SPEC_JSON` runs the fine-tune. Spec keys:
  address, job     the daemon and the job to save to and load from
  stop             the last step to train
  save_every       save after every step that is a multiple of it (waiting until durable only
                   for the saves of `stop` and `last_save`)
  resume           load the job's latest step first and train from the step after it
  last_save        0, or the last step to save: its save is waited for until durable, then the
                   step number is written to `marker`, training goes on to `stop` without saves,
                   and the process waits to be killed (it exits with 3 after `hang_s`, 300 s)
  out              where to write {"start": step loaded or 0, "losses": {step: loss}} as JSON
Each step's batch is drawn from a generator seeded by the step, and LoRA dropout draws from
torch's global generator, which every save and the load carry (rng=True): a resumed run
computes what an uninterrupted one does, bit for bit.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

VOCAB = 128
TARGETS = ["q_proj", "v_proj"]


def tiny_llama(seed: int = 0) -> Any:
    """A 2-layer Llama (hidden 32, vocabulary 128) with weights drawn from `seed`."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def lora_model(seed: int = 0, **lora: Any) -> Any:
    """tiny_llama(seed) with a fresh LoRA adapter (r=4 on q_proj and v_proj, dropout 0.1 unless
    `lora` says otherwise), its initial values drawn from the generator after the base model's."""
    from peft import LoraConfig, get_peft_model

    options = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": TARGETS, **lora}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations, as peft calls it
        return get_peft_model(tiny_llama(seed), LoraConfig(**options))


def optimizer_and_scheduler(model: Any, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the trainable (adapter) parameters and a linear decay of its learning rate."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=total_steps)
    return optimizer, scheduler


def batch(step: int) -> torch.Tensor:
    """The token ids of `step`'s batch (4 sequences of 16)."""
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1000 + step))


def train_step(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> float:
    tokens = batch(step)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


def run(spec: dict[str, Any]) -> None:
    from ckptd.client import CheckpointClient
    from ckptd.integrations.peft import adapter_state

    model = lora_model()
    model.train()
    optimizer, scheduler = optimizer_and_scheduler(model, spec["stop"])
    state = adapter_state(model, optimizer, scheduler)
    losses: dict[int, float] = {}
    with CheckpointClient(spec["job"], address=spec["address"], on_error="raise", timeout_s=60) as ckpt:
        start = 0
        if spec.get("resume"):
            start = ckpt.load(state, rng=True) or 0
        last_save = spec.get("last_save", 0)
        for step in range(start + 1, spec["stop"] + 1):
            losses[step] = train_step(model, optimizer, scheduler, step)
            if step % spec["save_every"] == 0 and (not last_save or step <= last_save):
                handle = ckpt.save(step, state, rng=True)
                if step in (last_save, spec["stop"]):
                    handle.wait_durable(timeout=60)
                if step == last_save:
                    Path(spec["marker"]).write_text(str(step))
        Path(spec["out"]).write_text(json.dumps({"start": start, "losses": losses}))
    if last_save:
        time.sleep(spec.get("hang_s", 300))  # the test kills the process before this ends
        raise SystemExit(3)


if __name__ == "__main__":
    torch.set_num_threads(1)  # the same arithmetic in every run, whatever the machine's load
    run(json.loads(sys.argv[1]))
